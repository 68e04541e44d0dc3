"""The one error tree of peerinfer.

Errors say who must act. A *local* error is a mistake of the caller on this machine (a bad
argument, a closed client); a *remote* error is something a peer sent or did (garbage on the
wire, a refusal, a timeout). Foreign exceptions (libp2p, msgpack, torch) are translated into
this tree in exactly one place each, keeping the original as ``__cause__``.

    PeerInferError
    ├── LocalError                  the caller must fix something
    │   ├── ConfigError             bad option, unknown policy/engine, missing model file
    │   ├── InvalidRequestError     empty prompt, prompt too long, absurd sampling parameters
    │   └── ClosedError             used after close()
    ├── RemoteError                 a peer (or the network) failed us
    │   ├── ProtocolError           malformed / oversized / wrong-version frame from a peer
    │   ├── PeerUnavailableError    could not reach the peer, or it went away mid-request
    │   ├── PeerBusyError           the peer refused: at capacity
    │   └── RequestTimeoutError     a deadline passed
    └── EngineError                 the inference backend failed on a well-formed request
"""

from __future__ import annotations


class PeerInferError(Exception):
    """Root of every error that peerinfer raises on purpose."""


class LocalError(PeerInferError):
    """The caller on this machine must act."""


class ConfigError(LocalError):
    """A configuration value is invalid or refers to something that does not exist."""


class InvalidRequestError(LocalError):
    """A request cannot be served as given (empty prompt, too long, bad parameters)."""


class ClosedError(LocalError):
    """The object was used after it was closed."""


class RemoteError(PeerInferError):
    """A peer or the network failed."""


class ProtocolError(RemoteError):
    """A peer sent bytes that are not a valid peerinfer message."""


class PeerUnavailableError(RemoteError):
    """A peer could not be reached or went away."""


class PeerBusyError(RemoteError):
    """A peer refused the request because it is at capacity."""


class RequestTimeoutError(RemoteError):
    """A deadline passed before the peer answered."""


class EngineError(PeerInferError):
    """The inference backend failed while serving a well-formed request."""


__all__ = [
    "ClosedError",
    "ConfigError",
    "EngineError",
    "InvalidRequestError",
    "LocalError",
    "PeerBusyError",
    "PeerInferError",
    "PeerUnavailableError",
    "ProtocolError",
    "RemoteError",
    "RequestTimeoutError",
]
