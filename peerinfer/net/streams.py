"""Streams of one host: inbound ones served by wrapped handlers (bounded per peer, never
crashing the host), outbound ones opened on deadlines (``open_stream``), and the one-frame
exchange ``request``. Reusing a stream is ``peerinfer.net.streampool``'s."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Awaitable, Callable

import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import PeerInfo

from peerinfer.errors import PeerUnavailableError, RemoteError
from peerinfer.net.admission import ADMIT_PROTOCOL
from peerinfer.net.connections import Connections
from peerinfer.net.context import HostContext, logger, parse_peer_id, reset_stream
from peerinfer.net.dialing import Dialer
from peerinfer.net.framing import FramedStream, peer_id_text
from peerinfer.net.gatekeeper import Gatekeeper

StreamHandler = Callable[[FramedStream], Awaitable[None]]


class Streams:
    """Handlers for inbound streams and the opening of outbound ones."""

    def __init__(self, ctx: HostContext, connections: Connections, gatekeeper: Gatekeeper, dialer: Dialer) -> None:
        self._ctx = ctx
        self._connections = connections
        self._gatekeeper = gatekeeper
        self._dialer = dialer
        #: handlers running per peer (all protocols together)
        self.inflight: dict[str, int] = defaultdict(int)

    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        """See ``Host.set_handler``."""

        async def run(net_stream: INetStream) -> None:
            await self._run_handler(protocol, handler, net_stream)

        self._ctx.h.set_stream_handler(TProtocol(protocol), run)

    async def _run_handler(self, protocol: str, handler: StreamHandler, net_stream: INetStream) -> None:
        ctx = self._ctx
        try:
            peer = peer_id_text(net_stream)
        except Exception:
            return  # no peer behind the stream (connection torn down meanwhile)
        stream = FramedStream(
            net_stream,
            max_frame_bytes=ctx.config.max_frame_bytes,
            timeout_s=ctx.config.stream_timeout_s,
        )
        if peer in ctx.banned:
            await stream.reset()
            return
        if ctx.admission_key is not None and protocol != ADMIT_PROTOCOL:
            adm = await self._gatekeeper.wait_admitted(peer)
            if adm is None or not adm.ok:
                ctx.counters.unadmitted_streams_refused += 1
                await stream.reset()
                return
        if self.inflight[peer] >= ctx.config.max_streams_per_peer:
            ctx.counters.streams_refused += 1
            logger.info("refusing a %s stream from %s: %d already running", protocol, peer, self.inflight[peer])
            await stream.reset()
            return
        self.inflight[peer] += 1
        failed = True
        try:
            await handler(stream)
            failed = False
        except RemoteError as exc:
            ctx.counters.handler_errors += 1
            logger.info("%s handler for %s: %s", protocol, peer, exc)
        except Exception:
            ctx.counters.handler_errors += 1
            logger.exception("%s handler for %s raised; resetting the stream", protocol, peer)
        finally:
            self.inflight[peer] -= 1
            if self.inflight[peer] <= 0:
                del self.inflight[peer]
            if failed:
                await stream.reset()
            else:
                await stream.aclose()

    async def open_stream(
        self, peer_id: str, protocol: str, *, timeout: float | None = None, lazy: bool = False
    ) -> FramedStream:
        """See ``Host.open_stream``."""
        ctx = self._ctx
        ctx.check_open()
        pid = parse_peer_id(peer_id)
        deadline = ctx.config.stream_timeout_s if timeout is None else timeout
        if ctx.admission_key is not None:
            # Never a stream to a peer that has not proved membership; dial it first if needed.
            started = trio.current_time()
            if not self._connections.is_connected(peer_id):
                await self._dialer.connect_info(PeerInfo(pid, []), deadline)
            else:
                await self._gatekeeper.require_admitted(peer_id, deadline)
            deadline = max(0.01, deadline - (trio.current_time() - started))
        elif not self._connections.is_connected(peer_id):
            # Connect our way first: libp2p's new_stream would dial the peerstore's direct
            # addresses only (never a relayed one: a peer behind a NAT is unreachable so), wait
            # out another dial of them in flight (10 s for a NAT that drops the SYN), or refuse
            # at once from its negative cache; a forward to a candidate we are not connected
            # to stalled so until the client gave up (the lost request of the relay-cut test).
            started = trio.current_time()
            await self._dialer.connect_info(PeerInfo(pid, []), min(deadline, ctx.config.connect_timeout_s))
            deadline = max(0.01, deadline - (trio.current_time() - started))
        net_stream = await ctx.within(
            "open_stream",
            peer_id,
            deadline,
            (lambda: ctx.network.new_stream(pid)) if lazy
            else (lambda: ctx.h.new_stream(pid, [TProtocol(protocol)])),
            discard=reset_stream,
        )
        return FramedStream(
            net_stream,
            max_frame_bytes=ctx.config.max_frame_bytes,
            timeout_s=ctx.config.stream_timeout_s,
            negotiate=protocol if lazy else None,
        )

    async def request(
        self, peer_id: str, protocol: str, data: bytes, *, timeout: float | None = None
    ) -> bytes:
        """See ``Host.request``."""
        deadline = trio.current_time() + (self._ctx.config.stream_timeout_s if timeout is None else timeout)

        def left() -> float:
            return max(0.0, deadline - trio.current_time())

        stream = await self.open_stream(peer_id, protocol, timeout=left(), lazy=True)
        async with stream:
            await stream.send(data, timeout=left())
            await stream.close_write()
            try:
                return await stream.receive(timeout=left())
            except trio.EndOfChannel:
                raise PeerUnavailableError(f"{peer_id} ended {protocol} without replying") from None


__all__ = ["StreamHandler", "Streams"]
