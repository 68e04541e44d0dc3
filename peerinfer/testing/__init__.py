"""Helpers for testing peerinfer and programs built on it.

``peerinfer.testing.cluster``: start and stop clusters of real ``peerinfer node`` processes on
127.0.0.1 (``open_cluster`` for trio code, ``start_cluster`` for plain scripts).
"""

from peerinfer.testing.cluster import (
    Cluster,
    ClusterError,
    NodeHandle,
    open_cluster,
    start_cluster,
)

__all__ = ["Cluster", "ClusterError", "NodeHandle", "open_cluster", "start_cluster"]
