"""Helpers for testing peerinfer and programs built on it.

``peerinfer.testing.cluster``: start and stop clusters of real ``peerinfer node`` processes on
127.0.0.1 (``open_cluster`` for trio code, ``start_cluster`` for plain scripts).
``peerinfer.testing.engines``: ``BatchRecordingEngine``, a deterministic batching engine that
records its batch sizes and prefill chunks.
``peerinfer.testing.inprocess``: real nodes in the test's own process (``node_options``,
``open_nodes``); imported on its own, since it loads the node and libp2p.
``peerinfer.testing.memnet``: ``MemNetwork``, an in-memory network (link delays, partitions) whose
nodes (``MemNetwork.node``) run under trio's virtual clock; imported on its own too.
``peerinfer.testing.waiting``: bounded waits, ``wait_until`` (a predicate) and ``wait_for``
(an awaited probe).
``peerinfer.testing.netns``: an emulated internet of network namespaces and NATs (root only).
``peerinfer.testing.lan``: a two-host LAN (two namespaces and a veth, rate-shaped with ``tc
tbf``) and ``LoopThread``, a trio loop on a thread inside one namespace (root only).
"""

from peerinfer.testing.cluster import (
    Cluster,
    ClusterError,
    NodeHandle,
    open_cluster,
    start_cluster,
)
from peerinfer.testing.engines import BatchRecordingEngine
from peerinfer.testing.waiting import wait_for, wait_until

__all__ = [
    "BatchRecordingEngine",
    "Cluster",
    "ClusterError",
    "NodeHandle",
    "open_cluster",
    "start_cluster",
    "wait_for",
    "wait_until",
]
