"""Stream reuse: one place that takes a kept stream or opens one, keeps it after a clean
exchange, resets it on failure, repeats an exchange once when its stream was gone before any
answer, and opens spares ahead for peers reached only through a relay.

Use::

    async def exchange(use: StreamUse) -> Reply:
        await use.stream.send(request, timeout=...)
        reply = await use.stream.receive(...)
        use.keep()  # the exchange ended cleanly: the stream serves the next one
        return reply

    reply = await pool.exchange(peer, protocol, exchange, timeout=...)

``pool.use(peer, protocol)`` is the one context manager underneath (one attempt);
``pool.exchange`` runs it, and once more on a new stream when the first attempt raised
``StreamGoneEarly``: the stream failed (reset, or ended) before any answer, and not for the
peer's doing. Either it was kept from an earlier exchange and the peer let it go meanwhile, or
its connection was replaced as stalled since the attempt began (``Connections.replaced_since``;
seen after a partition healed: a forward begun on the dead connection failed the moment the
fresh one replaced it, and was served locally). The body must be safe to run twice: the peer
saw nothing of the first attempt, or dropped it.

Kept streams: at most ``MAX_IDLE_STREAMS_PER_PEER`` per peer and protocol, ``MAX_IDLE_STREAMS``
in all, for ``IDLE_STREAM_TTL_S`` (well below the idle timeout a serving node gives a stream
waiting for its next request), or ``SPARE_STREAM_TTL_S`` for a spare opened ahead of its first
exchange; only for a peer still connected, admitted and not banned (a stream is bound to the
connection it was opened on, so its ``remote_peer`` stays the authenticated one); dropped when
the peer disconnects, is banned, its pings fail or its connections are replaced.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Protocol, TypeVar

import trio
from libp2p.abc import INetConn

from peerinfer.errors import PeerInferError, PeerUnavailableError
from peerinfer.net.api import StreamUse
from peerinfer.net.connections import Connections
from peerinfer.net.context import HostContext, logger
from peerinfer.net.framing import FramedStream
from peerinfer.net.gatekeeper import Gatekeeper

#: Streams kept for reuse (``keep``): per peer and protocol, in all, and for how long.
MAX_IDLE_STREAMS_PER_PEER = 2
MAX_IDLE_STREAMS = 64
IDLE_STREAM_TTL_S = 5.0
#: How long a spare stream waits for its first exchange (``spare_ahead``). The serving node
#: waits for a stream's first request without a deadline, so a spare may wait longer than a
#: stream kept after an exchange.
SPARE_STREAM_TTL_S = 60.0
#: How long opening a spare stream may take.
SPARE_OPEN_TIMEOUT_S = 10.0

T = TypeVar("T")


class OpenStream(Protocol):
    """``Host.open_stream`` (looked up on the host at each call, so a test can stand in)."""

    def __call__(
        self, peer_id: str, protocol: str, *, timeout: float | None = None, lazy: bool = False
    ) -> Awaitable[FramedStream]: ...


class StreamGoneEarly(Exception):
    """An attempt's stream failed before any answer, and not for the peer's doing (see the
    module docstring); ``StreamPool.exchange`` tries once more on a new stream."""


class StreamPool:
    """Kept streams per (peer, protocol), and the attempts that use them."""

    def __init__(
        self, ctx: HostContext, connections: Connections, gatekeeper: Gatekeeper, open_stream: OpenStream
    ) -> None:
        self._ctx = ctx
        self._connections = connections
        self._gatekeeper = gatekeeper
        self._open_stream = open_stream
        #: streams kept for reuse, per (peer, protocol), oldest first, with when they expire
        self._idle: OrderedDict[tuple[str, str], list[tuple[float, FramedStream]]] = OrderedDict()
        #: peers a spare stream is being opened to
        self.spares_opening: set[str] = set()
        connections.on_replaced.append(self._replaced)
        connections.on_gone.append(self.drop)

    def _replaced(self, peer_id: str, stalled: list[INetConn]) -> None:
        self.drop(peer_id)

    # -- attempts -----------------------------------------------------------------------------

    async def exchange(
        self, peer: str, protocol: str, body: Callable[[StreamUse], Awaitable[T]], *,
        timeout: float, spare: bool = False,
    ) -> T:
        """``body`` on a kept or new stream (``use``); once more on a new stream if the first
        attempt's stream was gone before any answer (``StreamGoneEarly``)."""
        try:
            async with self.use(peer, protocol, timeout=timeout, spare=spare) as use:
                return await body(use)
        except StreamGoneEarly as exc:
            logger.debug("a %s stream to %s was gone before any answer (%s); again on a new one",
                         protocol, peer, exc)
        async with self.use(peer, protocol, timeout=timeout, spare=spare, retry=True) as use:
            return await body(use)

    @asynccontextmanager
    async def use(
        self, peer: str, protocol: str, *, timeout: float, spare: bool = False, retry: bool = False,
    ) -> AsyncIterator[StreamUse]:
        """One attempt: a kept stream (not on a ``retry``) or a new one, opened lazily (the
        first frame travels with the protocol negotiation; a refused protocol fails the first
        ``receive``) within ``timeout``. On a clean exit the stream is kept if the body called
        ``keep()``, else closed; on an exception it is reset, and ``StreamGoneEarly`` raised
        instead when the attempt may be repeated (see the module docstring). A clean end of
        the stream escaping the body (``trio.EndOfChannel``) becomes ``PeerUnavailableError``.

        ``spare``: when we reach ``peer`` only through a relay, open a spare stream ahead of
        the next attempt (``spare_ahead``)."""
        started = trio.current_time()
        stream = None if retry else self.take(peer, protocol)
        reused = stream is not None
        if stream is None:
            try:
                stream = await self._open_stream(peer, protocol, timeout=timeout, lazy=True)
            except PeerUnavailableError as exc:
                if not retry and self._connections.replaced_since(peer, started):
                    raise StreamGoneEarly(str(exc)) from exc
                raise
        if spare:
            self.spare_ahead(peer, protocol)
        use = StreamUse(stream, started=started, reused=reused, retry=retry)
        try:
            yield use
        except BaseException as exc:
            await stream.reset()
            if (
                not retry
                and not use.answered
                and isinstance(exc, PeerUnavailableError | trio.EndOfChannel)
                and (reused or self._connections.replaced_since(stream.remote_peer, started))
            ):
                raise StreamGoneEarly(str(exc)) from exc
            if isinstance(exc, trio.EndOfChannel):
                # The peer ended the stream cleanly, but before the exchange was done: to the
                # caller that is the peer's failure like a reset (it catches ours only).
                raise PeerUnavailableError(
                    f"{peer} ended the {protocol} stream before the exchange was done"
                ) from exc
            raise
        if use.kept:
            self.keep(stream)
        else:
            await stream.aclose()

    # -- spares -------------------------------------------------------------------------------

    def spare_ahead(self, peer: str, protocol: str) -> None:
        """Open a spare stream to ``peer`` in the background, negotiated and kept
        (``SPARE_STREAM_TTL_S``), when we reach it only through a relay and keep no stream for
        it: the next attempt, concurrent or up to a minute later, then starts at once. A new
        stream through a relay cost 41.5 ms more than a kept one on the emulated internet
        (docs/reach.md: its opening exchanges all cross the relay), against 12.8 ms for a
        direct one, which gets no spare."""
        if (
            peer in self.spares_opening
            or not self._ctx.running
            or not self._connections.only_relayed(peer)
            or self.has(peer, protocol)
        ):
            return
        self.spares_opening.add(peer)
        self._ctx.start_soon(self._open_spare, peer, protocol)

    async def _open_spare(self, peer: str, protocol: str) -> None:
        try:
            stream = await self._open_stream(peer, protocol, timeout=SPARE_OPEN_TIMEOUT_S)
        except PeerInferError as exc:
            logger.debug("no spare stream to %s: %s", peer, exc)
        else:
            self.keep(stream, ttl_s=SPARE_STREAM_TTL_S)
        finally:
            self.spares_opening.discard(peer)

    # -- kept streams -------------------------------------------------------------------------

    def take(self, peer_id: str, protocol: str) -> FramedStream | None:
        """A stream to ``peer_id`` on ``protocol`` kept by ``keep`` and still usable as far as
        can be told without I/O, or None. The protocol must allow another exchange on the
        stream; the caller must be ready for the peer having let it go meanwhile (a reset or
        end of stream before any answer: ``use`` repeats on a new stream)."""
        key = (peer_id, protocol)
        kept = self._idle.get(key)
        if not kept:
            return None
        if self._ctx.closed or peer_id in self._ctx.banned or not self._gatekeeper.is_admitted(peer_id):
            self.drop(peer_id)
            return None
        now = trio.current_time()
        found: FramedStream | None = None
        while kept and found is None:
            # The soonest to expire first: a spare (longer-lived) stays for the attempt after.
            expires_at, stream = kept.pop(0)
            if now < expires_at and stream.reusable:
                found = stream
            else:
                self._close(stream)
        if not kept:
            del self._idle[key]
        return found

    def has(self, peer_id: str, protocol: str) -> bool:
        """Whether a stream to ``peer_id`` on ``protocol`` is kept (it may have expired)."""
        return bool(self._idle.get((peer_id, protocol)))

    def keep(self, stream: FramedStream, *, ttl_s: float = IDLE_STREAM_TTL_S) -> None:
        """Keep ``stream``, whose exchange ended cleanly (or a spare that has had none yet), for
        the next exchange with the same peer and protocol (``take``), for ``ttl_s``; bounded
        per peer and in all, beyond which the oldest are closed. A stream that cannot be
        reused is closed now."""
        ctx = self._ctx
        peer, key = stream.remote_peer, (stream.remote_peer, stream.protocol)
        if ctx.closed or not stream.reusable or peer in ctx.banned or not self._gatekeeper.is_admitted(peer):
            self._close(stream)
            return
        now = trio.current_time()
        kept = self._idle.setdefault(key, [])
        self._idle.move_to_end(key)
        kept.append((now + ttl_s, stream))
        kept.sort(key=lambda k: k[0])  # the soonest to expire first: the first to go
        while len(kept) > MAX_IDLE_STREAMS_PER_PEER or (kept and now >= kept[0][0]):
            self._close(kept.pop(0)[1])
        while sum(len(k) for k in self._idle.values()) > MAX_IDLE_STREAMS:
            oldest_key = next(iter(self._idle))
            oldest = self._idle[oldest_key]
            self._close(oldest.pop(0)[1])
            if not oldest:
                del self._idle[oldest_key]

    def drop(self, peer_id: str) -> None:
        """Close every stream kept for ``peer_id``."""
        for key in [k for k in self._idle if k[0] == peer_id]:
            for _, stream in self._idle.pop(key):
                self._close(stream)

    def _close(self, stream: FramedStream) -> None:
        self._ctx.start_soon(stream.aclose)


__all__ = [
    "IDLE_STREAM_TTL_S",
    "MAX_IDLE_STREAMS",
    "MAX_IDLE_STREAMS_PER_PEER",
    "OpenStream",
    "SPARE_OPEN_TIMEOUT_S",
    "SPARE_STREAM_TTL_S",
    "StreamGoneEarly",
    "StreamPool",
    "StreamUse",
]
