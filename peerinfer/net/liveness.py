"""Liveness for one host: ``ping`` (one echo on ``PING_PROTOCOL``), the host's one table of
round-trip times, and the loop that pings every connected peer every ``liveness_interval_s``,
starts a probe (``Connections.start_probe``) on a failure and, after ``liveness_max_failures``
in a row, retires the peer's connections (``Connections.retire_all``: a SIGSTOPped peer
otherwise stays "connected", in the mesh, for minutes) and reports it ``unresponsive``.

Slow but alive. A ping that misses its deadline is proof of nothing when the peer delivered
frames meanwhile (any frame on any of its connections since the ping went out: its muxer's
acknowledgement of the ping stream itself, a request's frames): its process runs and its link
delivers, only the answer was late (a client on an overloaded machine; seen with 16 in-process clients
at load 10+, whose requests were reset with the connection replaced under them). Such a ping
is excused, not counted, and starts no probe. The rule is the one gRPC and QUIC keep (data
received counts as life), bounded against a peer that keeps a connection busy and never
answers: at most ``MAX_EXCUSED_PINGS`` excused in a row, then the next late ping counts as
failed. Only what the peer *delivered* counts, never our own writes (a cut link swallows them
into socket buffers). And a connection replaced or retired all the same keeps its requests
in flight until they finish, bounded (``Connections.retire``), so even a peer slow enough to
fail its pings with nothing else delivered loses no request that was making progress."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import trio
from libp2p.abc import INetConn

from peerinfer.errors import ClosedError, RemoteError
from peerinfer.net.connections import Connections
from peerinfer.net.context import HostContext, PeerEvent, logger
from peerinfer.net.ping import PING_PROTOCOL, echo_nonce
from peerinfer.net.streampool import OpenStream, StreamPool

#: Late liveness pings excused in a row for a peer that delivered frames meanwhile; the next
#: one counts as failed (a peer trickling frames and never answering is still cut).
MAX_EXCUSED_PINGS = 5


class Liveness:
    """Pings and the RTT table (dropped when a peer's connections are replaced or gone)."""

    def __init__(
        self, ctx: HostContext, connections: Connections, open_stream: OpenStream, pool: StreamPool,
        connected_peers: Callable[[], list[str]],
    ) -> None:
        self._ctx = ctx
        self._connections = connections
        self._open_stream = open_stream
        self._pool = pool
        #: the peers to check: the host's ``connected_peers`` (admitted ones, in a private swarm)
        self._connected_peers = connected_peers
        #: the one RTT table of the host: per peer, the last round trip and when it ended
        self.rtts: dict[str, tuple[float, float]] = {}
        #: late pings excused in a row per peer (see MAX_EXCUSED_PINGS)
        self.excused: dict[str, int] = defaultdict(int)
        connections.on_replaced.append(self._replaced)
        connections.on_gone.append(self._gone)

    def _replaced(self, peer_id: str, stalled: list[INetConn]) -> None:
        self.rtts.pop(peer_id, None)

    def _gone(self, peer_id: str) -> None:
        self.rtts.pop(peer_id, None)
        self.excused.pop(peer_id, None)

    def last_rtt(self, peer_id: str) -> float | None:
        """The last measured round trip to ``peer_id`` (seconds), if any."""
        measured = self.rtts.get(peer_id)
        return None if measured is None else measured[0]

    def fresh_rtt(self, peer_id: str, max_age_s: float) -> float | None:
        """The last round trip to ``peer_id`` if it ended at most ``max_age_s`` ago (by
        ``ping`` or the liveness loop, on a connection not replaced since), else None: a
        caller that needs a proof of life that recent can take it instead of a second ping."""
        measured = self.rtts.get(peer_id)
        if measured is None or trio.current_time() - measured[1] > max_age_s:
            return None
        return measured[0]

    async def ping(self, peer_id: str, *, timeout: float | None = None) -> float:
        """See ``Host.ping``."""
        total = self._ctx.config.stream_timeout_s if timeout is None else timeout
        started = trio.current_time()
        try:
            return await self._ping_once(peer_id, total)
        except RemoteError:
            if not self._connections.replaced_since(peer_id, started) or not self._connections.is_connected(peer_id):
                raise
        logger.debug("a ping to %s ran on a connection replaced meanwhile: asking again", peer_id)
        return await self._ping_once(peer_id, total)

    async def _ping_once(self, peer_id: str, total: float) -> float:
        deadline = trio.current_time() + total

        def left() -> float:
            return max(0.0, deadline - trio.current_time())

        stream = await self._open_stream(peer_id, PING_PROTOCOL, timeout=left())
        async with stream:
            rtt = await echo_nonce(stream, peer_id, left)
        self.rtts[peer_id] = (rtt, trio.current_time())
        return rtt

    async def loop(self) -> None:
        """Every ``liveness_interval_s``, check every connected (and admitted) peer."""
        interval = self._ctx.config.liveness_interval_s
        while True:
            await trio.sleep(interval)
            async with trio.open_nursery() as nursery:
                for peer in self._connected_peers():
                    nursery.start_soon(self._check, peer)

    async def _check(self, peer: str) -> None:
        ctx, connections = self._ctx, self._connections
        started = trio.current_time()
        try:
            await self.ping(peer, timeout=ctx.config.liveness_timeout_s)
        except RemoteError as exc:
            if connections.replaced_since(peer, started):
                return  # it failed on a stalled connection replaced meanwhile: not this one's
            if connections.heard_since(peer, started) and self.excused[peer] < MAX_EXCUSED_PINGS:
                self.excused[peer] += 1
                logger.debug("liveness ping to %s was late, but frames from it arrived meanwhile "
                             "(%d excused in a row): %s", peer, self.excused[peer], exc)
                return
            self.excused.pop(peer, None)
            connections.failures[peer] += 1
            failures = connections.failures[peer]
            logger.info("liveness ping to %s failed (%d): %s", peer, failures, exc)
            # Kept and spare streams likely ride the stalled connection: a forward taking one
            # would wait out its first-token deadline (seen: a spare kept through a cut link).
            self._pool.drop(peer)
            connections.start_probe(peer)
            if failures >= ctx.config.liveness_max_failures:
                connections.failures.pop(peer, None)
                ctx.counters.unresponsive_disconnects += 1
                ctx.emit(PeerEvent("unresponsive", peer, detail=str(exc)))
                connections.retire_all(peer)
        except ClosedError:
            return
        else:
            connections.failures.pop(peer, None)
            self.excused.pop(peer, None)


__all__ = ["MAX_EXCUSED_PINGS", "Liveness"]
