"""peerinfer: serve an LLM from a peer-to-peer network of ordinary machines.

The curated public API (pinned by tests/test_public_api.py)::

    peerinfer.Client            async client (``async with Client.connect(multiaddr) as c``)
    peerinfer.connect           synchronous client (``with peerinfer.connect(multiaddr) as c``)
    peerinfer.GenerationResult  what ``generate`` returns
    peerinfer.Node, NodeOptions run a node from Python
    peerinfer.serve_node        run a node with its HTTP API (``NodeOptions.http``) beside it
    peerinfer.errors            the error tree (PeerInferError and its children)

Heavier parts (libp2p, torch) load only when these names are first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from peerinfer import native as _native

# Before any core module loads: its compiled form only where built and current (native.py).
_native.choose()

from peerinfer.errors import (  # noqa: E402
    ClosedError,
    ConfigError,
    EngineError,
    InvalidRequestError,
    LocalError,
    PeerBusyError,
    PeerInferError,
    PeerUnavailableError,
    ProtocolError,
    RemoteError,
    RequestTimeoutError,
)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from peerinfer.client import Client, GenerationResult, SyncClient, connect
    from peerinfer.node import Node, NodeOptions
    from peerinfer.serve import serve_node

_LAZY = {
    "Client": "peerinfer.client",
    "GenerationResult": "peerinfer.client",
    "SyncClient": "peerinfer.client",
    "connect": "peerinfer.client",
    "Node": "peerinfer.node",
    "NodeOptions": "peerinfer.node",
    "serve_node": "peerinfer.serve",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'peerinfer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "Client",
    "ClosedError",
    "ConfigError",
    "EngineError",
    "GenerationResult",
    "InvalidRequestError",
    "LocalError",
    "Node",
    "NodeOptions",
    "PeerBusyError",
    "PeerInferError",
    "PeerUnavailableError",
    "ProtocolError",
    "RemoteError",
    "RequestTimeoutError",
    "SyncClient",
    "__version__",
    "connect",
    "serve_node",
]
