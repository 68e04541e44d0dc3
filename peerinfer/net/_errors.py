"""The one place where py-libp2p's (and trio's deadline) exceptions become peerinfer errors.

Every await into libp2p that can fail because of a peer runs inside :func:`translated`; the
original exception is kept as ``__cause__``. The mapping:

==========================================  ====================================================
foreign exception                            peerinfer error
==========================================  ====================================================
``trio.TooSlowError`` (our own deadlines)    ``RequestTimeoutError``
``MessageTooLarge``, ``ParseError``          ``ProtocolError`` (the peer sent bad framing)
``StreamReset``                              ``PeerUnavailableError`` ("reset by peer")
``StreamFailure``, ``MultiselectError``s     ``PeerUnavailableError`` (protocol not supported)
``SwarmException``, ``PeerStoreError``       ``PeerUnavailableError`` (could not dial)
any other ``BaseLibp2pError``, ``OSError``,  ``PeerUnavailableError``
trio ``Broken``/``ClosedResourceError``
``LifecycleError`` (a libp2p service gone)   ``ClosedError`` (the host is shutting down)
==========================================  ====================================================

Exceptions that are not in this table (our own bugs, ``Cancelled``) pass through untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio
from libp2p.exceptions import BaseLibp2pError, ParseError
from libp2p.host.exceptions import StreamFailure
from libp2p.io.exceptions import MessageTooLarge
from libp2p.network.exceptions import SwarmException
from libp2p.network.stream.exceptions import StreamReset
from libp2p.peer.peerstore import PeerStoreError
from libp2p.protocol_muxer.exceptions import MultiselectClientError, MultiselectError
from libp2p.tools.anyio_service.exceptions import LifecycleError

from peerinfer.errors import (
    ClosedError,
    PeerUnavailableError,
    ProtocolError,
    RequestTimeoutError,
)


def _short(peer: str | None) -> str:
    return "peer" if peer is None else f"peer {peer[-12:]}"


@contextmanager
def translated(operation: str, peer: str | None = None, timeout: float | None = None) -> Iterator[None]:
    """Run the body, re-raising libp2p failures as peerinfer errors (see the module table)."""
    try:
        yield
    except trio.TooSlowError as exc:
        raise RequestTimeoutError(f"{operation}: no progress from {_short(peer)} within {timeout} s") from exc
    except (MessageTooLarge, ParseError) as exc:
        raise ProtocolError(f"{operation}: {_short(peer)} sent malformed framing: {exc}") from exc
    except StreamReset as exc:
        raise PeerUnavailableError(f"{operation}: stream reset by {_short(peer)}") from exc
    except (StreamFailure, MultiselectError, MultiselectClientError) as exc:
        raise PeerUnavailableError(f"{operation}: {_short(peer)} refused the protocol: {exc}") from exc
    except (SwarmException, PeerStoreError) as exc:
        raise PeerUnavailableError(f"{operation}: cannot reach {_short(peer)}: {exc}") from exc
    except LifecycleError as exc:
        raise ClosedError(f"{operation}: the host is shutting down") from exc
    except (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise PeerUnavailableError(f"{operation}: {_short(peer)} failed: {exc!r}") from exc


__all__ = ["translated"]
