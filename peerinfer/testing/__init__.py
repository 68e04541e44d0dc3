"""Helpers for testing peerinfer and programs built on it.

``peerinfer.testing.cluster``: start and stop clusters of real ``peerinfer node`` processes on
127.0.0.1 (``open_cluster`` for trio code, ``start_cluster`` for plain scripts).
``peerinfer.testing.engines``: ``BatchRecordingEngine``, a deterministic batching engine that
records its batch sizes and prefill chunks.
"""

from peerinfer.testing.cluster import (
    Cluster,
    ClusterError,
    NodeHandle,
    open_cluster,
    start_cluster,
)
from peerinfer.testing.engines import BatchRecordingEngine

__all__ = ["BatchRecordingEngine", "Cluster", "ClusterError", "NodeHandle", "open_cluster", "start_cluster"]
