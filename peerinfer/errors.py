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

``ERROR_TABLE`` is the one table from the wire's error codes (``ErrorMessage.code``) to these
classes, HTTP statuses, OpenAI error types and forwarding reasons; the client, the node's
forwarding, the HTTP API and the simulator all read it (``error_kind(code)``).
"""

from __future__ import annotations

from dataclasses import dataclass as _dataclass


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
    """A peer refused the request because it is at capacity. ``retry_after_s``: when the node
    suggests retrying (0: no hint)."""

    retry_after_s: float = 0.0


class RequestTimeoutError(RemoteError):
    """A deadline passed before the peer answered."""


class EngineError(PeerInferError):
    """The inference backend failed while serving a well-formed request."""


# --------------------------------------------------------------------------------------------
# The one table from wire error codes to what each front end makes of them.


@_dataclass(frozen=True, slots=True)
class ErrorKind:
    """What one wire error code (``ErrorMessage.code``) means, for every front end.

    ``exception``: what the client raises. ``http_status`` and ``openai_type``: what the HTTP API
    answers (OpenAI's error ``type``). ``forward_reason``: what a forwarding node tells its core
    when a peer answers with this code (a ``ForwardFailed`` reason; the node and the simulator
    both read it here). A forwarding node fails every error a peer answers over to the next
    candidate, ``invalid`` included: it validated the request itself, so a peer that calls it
    invalid is at fault, not the client (issue 12). A peer that *answered* is reachable, so
    only ``unavailable`` and ``timeout`` make the core stop routing to it.
    """

    code: str
    exception: type[PeerInferError]
    http_status: int
    openai_type: str
    forward_reason: str
    reason: str


#: Every code of ``peerinfer.core.messages.ERROR_CODES``, once (a test pins that they match).
ERROR_TABLE: dict[str, ErrorKind] = {
    kind.code: kind
    for kind in (
        ErrorKind("invalid", InvalidRequestError, 400, "invalid_request_error", "invalid",
                  "the request cannot be served as given"),
        ErrorKind("busy", PeerBusyError, 429, "rate_limit_error", "busy",
                  "the node (and every peer it could use) is at capacity"),
        ErrorKind("timeout", RequestTimeoutError, 504, "timeout_error", "timeout",
                  "no first token within the deadline"),
        ErrorKind("unavailable", PeerUnavailableError, 503, "service_unavailable_error",
                  "unavailable", "no peer could serve the request"),
        ErrorKind("protocol", ProtocolError, 502, "api_error", "protocol",
                  "a peer sent a malformed message"),
        ErrorKind("internal", EngineError, 500, "api_error", "internal",
                  "the inference backend failed"),
        ErrorKind("shutdown", PeerUnavailableError, 503, "service_unavailable_error",
                  "unavailable", "the node is shutting down"),
    )
}


def error_kind(code: str) -> ErrorKind:
    """The table's row for ``code``; an unknown code (a newer peer) reads as ``internal``."""
    return ERROR_TABLE.get(code) or ERROR_TABLE["internal"]


def error_from_code(code: str, message: str, retry_after_s: float = 0.0) -> PeerInferError:
    """The exception a client raises for an ``ErrorMessage(code, message)`` (a busy one keeps
    the node's ``retry_after_s`` hint)."""
    error = error_kind(code).exception(f"{code}: {message}")
    if isinstance(error, PeerBusyError):
        error.retry_after_s = retry_after_s
    return error


__all__ = [
    "ERROR_TABLE",
    "ErrorKind",
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
    "error_from_code",
    "error_kind",
]
