"""Status and peers: the status protocol, peer exchange, peer events and liveness pings.

:class:`PeerKeeper` is a component of the node (see ``peerinfer.node``): it takes the node's
:class:`~peerinfer.node.context.NodeContext`."""

from __future__ import annotations

import contextlib
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from peerinfer.core.messages import (
    CacheStatus,
    PeerAddrs,
    PeerExchange,
    PeerStatus,
    RequestCounters,
    StatusRequest,
    StatusResponse,
    decode,
    encode,
)
from peerinfer.core.node import (
    PeerLost,
    PeerSeen,
)
from peerinfer.errors import (
    PeerInferError,
    ProtocolError,
)
from peerinfer.net import NodeHost, PeerEvent, Stream
from peerinfer.net.pacing import TokenBucket
from peerinfer.node.context import NodeContext
from peerinfer.node.options import (
    LOST_REDIAL_FIRST_S,
    LOST_REDIAL_FOR_S,
    MAX_EXCHANGED_PEERS,
    MAX_LOST_REDIALED,
    MAX_PEER_TABLE,
    PEER_DIAL_BURST,
    PEER_DIAL_RATE,
    PEER_EXCHANGE_INTERVAL_S,
    PEER_REDIAL_S,
    PEERS_PROTOCOL,
    SPREAD_ADDRS_PEERS,
    logger,
)
from peerinfer.node.trust import reputation_line
from peerinfer.types import PeerId


def _new_circuit(host: NodeHost, peer: str, addrs: Sequence[str]) -> bool:
    """Whether ``addrs`` (told for ``peer``) hold a relayed address we do not know yet."""
    known = {a.removesuffix(f"/p2p/{peer}") for a in host.circuit_addrs(peer)}
    return any("/p2p-circuit" in a and a.removesuffix(f"/p2p/{peer}") not in known for a in addrs)


@dataclass(slots=True)
class LostNode:
    """A node we lost the connection to, and when it is next redialed."""

    since: float
    wait: float
    due: float
    dialing: bool = False


class PeerKeeper:
    """Whom the node knows: status, peer exchange, lost nodes redialed, peer events and the
    liveness pings the core asks for."""

    def __init__(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        #: members (nodes, not clients) we have swapped peer lists with (bounded)
        self._exchanged: OrderedDict[str, None] = OrderedDict()
        #: when peer exchange last made us dial each peer (bounded), and the dial pacer
        self._dialed_at: OrderedDict[str, float] = OrderedDict()
        self._dial_bucket = TokenBucket(PEER_DIAL_RATE, PEER_DIAL_BURST)
        #: nodes that answered peer exchange (bounded), and those of them lost, being redialed
        self._nodes_met: OrderedDict[str, None] = OrderedDict()
        self._lost: OrderedDict[str, LostNode] = OrderedDict()
        self._lost_wake = trio.Event()
        #: peers a dial of ours is under way to (one at a time each)
        self._dialing: set[str] = set()
        #: dials caused by peer exchange (statistics for tests and the attack bench)
        self.exchange_dials = 0
        #: pings the core's ``PingPeer`` cost (not answered from the host's fresh round trips)
        self.pings_sent = 0

    def has_met(self, peer: str) -> bool:
        """``peer`` answered peer exchange: a node, redialed if lost."""
        return peer in self._nodes_met

    def is_lost(self, peer: str) -> bool:
        """``peer`` is a node we lost and redial."""
        return peer in self._lost

    def forget(self, peer: str) -> None:
        """The core dropped ``peer`` from its candidates: swap peer lists again when it is back."""
        self._exchanged.pop(peer, None)

    def on_announcer(self, sender: str) -> None:
        """``sender`` announced on our topic: a member we have not swapped peer lists with yet
        is asked whom it knows (clients never announce, so they are never asked for a protocol
        they do not speak; identities heard of only through gossip are not members, and are
        never dialed for it)."""
        if sender not in self._exchanged and self.is_member(sender) and self._ctx.nursery is not None:
            self._exchanged[sender] = None
            if len(self._exchanged) > MAX_PEER_TABLE:
                self._exchanged.popitem(last=False)
            self._ctx.nursery.start_soon(self._exchange_peers, sender)

    def is_member(self, peer: str) -> bool:
        """A peer that answered us over a direct (admitted) connection, and still has one."""
        core, host = self._ctx.core, self._ctx.host
        return core is not None and host is not None and core.is_member(PeerId(peer)) and host.is_admitted(peer)

    def status(self) -> StatusResponse:
        core, host, engine = self._ctx.core, self._ctx.host, self._ctx.engine
        assert core is not None and host is not None and engine is not None
        now = self._ctx.now()
        peers = tuple(
            PeerStatus(
                peer_id=p.peer_id,
                digest_age_s=min(p.digest_age_s, 1e11),
                load=p.load,
                cached_tokens=p.cached_tokens,
                rtt_ms=(p.rtt_s or 0.0) * 1000.0,
                reputation=reputation_line(core, p.peer_id, now),
            )
            for p in core.peers(now)
        )
        cache_tokens = len(core.local.digest) * core.hasher.block_size
        stats = engine.statistics().cache
        capacity = (stats.capacity_bytes or 0) if stats is not None else 0
        counts = core.statistics()
        cache_bytes = stats.bytes if stats is not None else 0
        return StatusResponse(
            peer_id=host.peer_id,
            addrs=tuple(host.dialable_addrs())[:64],
            model=engine.model_name[:512],
            peers=peers[:4096],
            cache=CacheStatus(tokens=cache_tokens, bytes=cache_bytes, capacity_bytes=capacity),
            load=core.load(),
            counters=RequestCounters(
                requests=counts.requests,
                served_locally=counts.served_locally,
                forwarded=counts.forwarded,
                failovers=counts.failovers,
                rejected=counts.rejected,
                rejected_over_limit=counts.rejected_over_limit,
            ),
        )

    async def serve_status(self, stream: Stream) -> None:
        decode(await stream.receive(), expected=StatusRequest)
        await stream.send(encode(self.status()))

    def _known_peers(self) -> PeerExchange:
        host = self._ctx.host
        assert host is not None
        peers = [PeerAddrs(host.peer_id, tuple(host.dialable_addrs())[:16])]
        # Only nodes (peers that announced on our topic), never clients: a client is not a
        # routing candidate and should not be dialed by every node it is told about.
        others = [p for p in host.connected_peers() if p in self._exchanged]
        random.shuffle(others)
        for peer in others[:MAX_EXCHANGED_PEERS]:
            addrs = tuple(host.known_addrs(peer))[:16]
            if addrs:
                peers.append(PeerAddrs(peer, addrs))
        return PeerExchange(tuple(peers))

    async def _learn_peers(self, source: str, exchange: PeerExchange) -> None:
        """Dial the peers a member told us about: each at most once per PEER_REDIAL_S, all of
        them at PEER_DIAL_RATE; what exceeds the rate is dropped (the next exchange retries)."""
        host = self._ctx.host
        assert host is not None
        if not self.is_member(source):
            return  # only members' word counts
        now = trio.current_time()
        seen: set[str] = set()
        for entry in exchange.peers[:MAX_EXCHANGED_PEERS]:
            peer = entry.peer_id
            if peer == source and entry.addrs:
                # The sender's own addresses, relayed ones included, for the peers we tell; a
                # new relayed one is passed on at once (a peer behind a NAT is reachable only so).
                before = host.circuit_addrs(peer)
                with contextlib.suppress(ProtocolError):
                    host.add_known_peer(peer, tuple(dict.fromkeys(entry.addrs)))
                if host.circuit_addrs(peer) != before:
                    self.spread_addrs(exclude=peer)
            if peer == host.peer_id or peer in seen or host.is_connected(peer):
                continue
            seen.add(peer)
            last = self._dialed_at.get(peer)
            if (
                last is not None and now - last < PEER_REDIAL_S
                and not _new_circuit(host, peer, entry.addrs) and peer not in self._lost
            ):
                # (A relay address we did not know is a new way in: a peer behind a NAT that
                # we failed to dial directly a moment ago is reachable now, not in 10 s. And a
                # node we lost that a member names is likely back.)
                continue
            if not self._dial_bucket.take(now):
                break
            try:
                host.add_known_peer(peer, tuple(dict.fromkeys(entry.addrs)))
            except ProtocolError:
                continue
            self._dialed_at.pop(peer, None)
            self._dialed_at[peer] = now
            if len(self._dialed_at) > MAX_PEER_TABLE:
                self._dialed_at.popitem(last=False)
            self.exchange_dials += 1
            logger.info("dialing %s, told by %s", peer, source)
            assert self._ctx.nursery is not None
            self._ctx.nursery.start_soon(self._dial_quietly, peer)

    def spread_addrs(self, exclude: str | None = None) -> None:
        """Swap peer lists now with (a bounded number of) connected members: our own or a
        peer's relayed address changed, and waiting for the periodic exchange would leave it
        unreachable meanwhile."""
        host = self._ctx.host
        if host is None or self._ctx.nursery is None:
            return
        members = [p for p in host.connected_peers() if p in self._exchanged and p != exclude and self.is_member(p)]
        random.shuffle(members)
        for peer in members[:SPREAD_ADDRS_PEERS]:
            self._ctx.nursery.start_soon(self._exchange_peers, peer)

    async def _dial_quietly(self, peer: str) -> None:
        """Dial ``peer`` unless a dial of ours to it is under way or it is connected (two
        relayed connections dialed at once, by us twice or by both sides, are trimmed by
        libp2p's per-peer limit or replace each other: seen as seconds of churn after a heal)."""
        host = self._ctx.host
        assert host is not None
        if peer in self._dialing or host.is_connected(peer):
            return
        self._dialing.add(peer)
        try:
            await host.dial(peer, timeout=5.0)
        except PeerInferError as exc:
            logger.info("dialing %s failed: %s", peer, exc)
        finally:
            self._dialing.discard(peer)

    async def serve_peers(self, stream: Stream) -> None:
        exchange = decode(await stream.receive(), expected=PeerExchange)
        assert isinstance(exchange, PeerExchange)
        self._met_node(stream.remote_peer)
        await stream.send(encode(self._known_peers()))
        await self._learn_peers(stream.remote_peer, exchange)

    async def _exchange_peers(self, peer: str) -> None:
        host = self._ctx.host
        assert host is not None
        try:
            reply = await host.request(peer, PEERS_PROTOCOL, encode(self._known_peers()), timeout=5.0)
            exchange = decode(reply, expected=PeerExchange)
        except PeerInferError:
            return
        assert isinstance(exchange, PeerExchange)
        self._met_node(peer)
        await self._learn_peers(peer, exchange)

    def _met_node(self, peer: str) -> None:
        """``peer`` speaks peer exchange: a node (never a client), redialed if we lose it."""
        self._nodes_met.pop(peer, None)
        self._nodes_met[peer] = None
        if len(self._nodes_met) > MAX_PEER_TABLE:
            self._nodes_met.popitem(last=False)

    def _note_lost(self, peer: str) -> None:
        host = self._ctx.host
        if host is None or peer not in self._nodes_met or peer in host.banned_peers():
            return
        now = trio.current_time()
        self._lost.pop(peer, None)
        first = self._first_redial_wait(peer)
        self._lost[peer] = LostNode(since=now, wait=first, due=now + first)
        while len(self._lost) > MAX_LOST_REDIALED:
            self._lost.popitem(last=False)
        self._lost_wake.set()

    def _redial_lost_now(self) -> None:
        """A connection to a node opened: the network may be back, so redial every lost node
        now (and the wait starts over) rather than at its next backoff step."""
        now = trio.current_time()
        for peer, lost in self._lost.items():
            first = self._first_redial_wait(peer)
            lost.wait, lost.due = first, min(lost.due, now + first - LOST_REDIAL_FIRST_S)
        self._lost_wake.set()

    def _first_redial_wait(self, peer: str) -> float:
        """Of two nodes that lost each other, the one with the smaller peer id redials first;
        the other waits a few steps longer, so that they rarely dial each other at once."""
        host = self._ctx.host
        mine = host is not None and host.peer_id < peer
        return LOST_REDIAL_FIRST_S if mine else 4 * LOST_REDIAL_FIRST_S

    async def redial_lost_loop(self) -> None:
        """Redial lost nodes (see LOST_REDIAL_FIRST_S); one dial per node at a time."""
        host = self._ctx.host
        assert host is not None and self._ctx.nursery is not None
        while True:
            now = trio.current_time()
            next_due = now + 1.0
            for peer, lost in list(self._lost.items()):
                if host.is_connected(peer) or now - lost.since > LOST_REDIAL_FOR_S:
                    if not lost.dialing:
                        del self._lost[peer]
                    continue
                if lost.dialing:
                    continue
                if now >= lost.due:
                    lost.dialing = True
                    lost.wait = min(2 * lost.wait, PEER_REDIAL_S)
                    lost.due = now + lost.wait
                    self._ctx.nursery.start_soon(self._redial_lost, peer, lost)
                next_due = min(next_due, lost.due)
            self._lost_wake = trio.Event()
            with trio.move_on_after(max(0.05, next_due - trio.current_time())):
                await self._lost_wake.wait()

    async def _redial_lost(self, peer: str, lost: LostNode) -> None:
        try:
            logger.info("redialing lost node %s", peer)
            await self._dial_quietly(peer)
        finally:
            lost.dialing = False
            self._lost_wake.set()

    async def peer_exchange_loop(self) -> None:
        host = self._ctx.host
        assert host is not None
        while True:
            await trio.sleep(PEER_EXCHANGE_INTERVAL_S * (0.5 + random.random()))
            peers = [p for p in host.connected_peers() if p in self._exchanged and self.is_member(p)]
            if peers:
                await self._exchange_peers(random.choice(peers))

    async def peer_event_loop(self, events: trio.MemoryReceiveChannel[PeerEvent]) -> None:
        assert self._ctx.nursery is not None
        async for ev in events:
            if ev.kind != "discovered":
                logger.info("peer %s %s%s", ev.peer_id, ev.kind, f": {ev.detail}" if ev.detail else "")
            if ev.kind in ("disconnected", "unresponsive"):
                self._note_lost(ev.peer_id)
            elif ev.kind == "misbehaved":
                self._lost.pop(ev.peer_id, None)
            elif ev.kind == "connected" and (ev.peer_id in self._nodes_met or ev.peer_id in self._bootstrap_peers()):
                self._lost.pop(ev.peer_id, None)
                self._redial_lost_now()
            if ev.kind in ("disconnected", "unresponsive", "misbehaved"):
                # Swap peer lists again as soon as it is back (its next announcement): after a
                # partition or a cut link, waiting for the periodic exchange (up to 15 s) would
                # leave the peers it knows (behind NATs: reachable only so) undialed meanwhile.
                self._exchanged.pop(ev.peer_id, None)
            if ev.kind == "connected":
                self._ctx.feed(PeerSeen(PeerId(ev.peer_id)))
            elif ev.kind in ("unresponsive", "misbehaved"):
                self._ctx.feed(PeerLost(PeerId(ev.peer_id)))

    async def ping(self, peer: PeerId) -> None:
        host, core = self._ctx.host, self._ctx.core
        assert host is not None and core is not None
        if not core.is_member(peer) and not host.is_admitted(peer):
            # A would-be member is pinged over its own direct connection only: an identity
            # heard of through gossip (forged, or just far away) is never dialed for it.
            return
        # One pinger: a round trip the host measured lately (its liveness loop pings every
        # connected peer) is the proof of life the core asks for; ping only without one.
        rtt = host.fresh_rtt(peer, core.config.ping_after_s)
        if rtt is None:
            try:
                rtt = await host.ping(peer, timeout=2.0)
            except PeerInferError:
                self._ctx.feed(PeerLost(peer))
                return
            self.pings_sent += 1
        self._ctx.feed(PeerSeen(peer, rtt_s=rtt))
        if peer not in self._exchanged and peer in self._bootstrap_peers() and self.is_member(peer):
            # A bootstrap peer is a node (we were told so): swap peer lists as soon as it is a
            # member rather than at its first announcement, so a newcomer meets the swarm sooner.
            self._exchanged[peer] = None
            if len(self._exchanged) > MAX_PEER_TABLE:
                self._exchanged.popitem(last=False)
            assert self._ctx.nursery is not None
            self._ctx.nursery.start_soon(self._exchange_peers, peer)

    def _bootstrap_peers(self) -> set[str]:
        return {a.rsplit("/p2p/", 1)[-1] for a in self._ctx.options.bootstrap if "/p2p/" in a}
