"""Connections of one host: our registry of them, disconnecting (bounded on a hung peer), and
healing: a stalled connection replaced by a fresh one, a silent one found by a ping over
itself, and the probe that opens the fresh one (docs/reach.md, "Healing").

Why our own registry: under load the swarm's table can lose a connection that is still open
(a close_peer racing a new dial pops the peer's entry wholesale), and then nothing could close
it. The swarm's table is only libp2p's *choice* for new streams: ``out_of_choice`` takes a
connection out of it while it is checked or closed, ``back_in_choice`` returns it.

Slow but alive. A connection judged stalled (its pings failed, or one over itself did) may
only be slow: a client on an overloaded machine answers late while its request's tokens still
flow. A connection whose peer delivered a frame within ``liveness_timeout_s`` is not silent
(``heard_within``, from the muxer's read stamps, ``peerinfer.net.muxer.heard_at``); and one
being replaced is *retired* (``retire``), not cut: out of libp2p's choice at once (new streams
use the fresh connection), closed at once if it carries no request stream or proves dead (no
frame within the timeout, not even in answer to a ping opened over it), else closed
once its request streams ended, at most ``DRAIN_MAX_S`` later. Why draining rather than only
trusting traffic: a client reading tokens sends us nothing for long stretches (window credit
goes back once per 128 KiB), so at the moment the fresh connection opens its old one looks
exactly like a cut link; and why not our own writes as proof: a cut link swallows megabytes
into socket buffers. Against a hostile peer every wait is bounded: the drain by
``DRAIN_MAX_S``, each request stream by its own read and write deadlines.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Awaitable, Callable

import trio
from libp2p.abc import INetConn
from libp2p.peer.id import ID

from peerinfer.errors import ClosedError, RemoteError, RequestTimeoutError
from peerinfer.net.context import (
    MAX_KNOWN_ADDRS_PER_PEER,
    HostContext,
    PeerEvent,
    abort_socket,
    is_relayed,
    logger,
    parse_peer_id,
    reset_stream,
)
from peerinfer.net.framing import FramedStream
from peerinfer.net.muxer import heard_at
from peerinfer.net.ping import PING_MAX_BYTES, PING_PROTOCOL, echo_nonce

#: Bound on one attempt to close a peer's connections politely (see ``Connections.disconnect``).
DISCONNECT_TIMEOUT_S = 1.0
#: A peer whose liveness ping failed is probed with a fresh connection every PROBE_EVERY_S (each
#: try at most PROBE_TIMEOUT_S), while its pings keep failing and it is not yet disconnected, at
#: most MAX_PROBES peers at once: a new TCP flow goes out at once, where the stalled one waits
#: out its retransmission backoff (seen: 3-6 s after a cut link came back) and liveness would
#: then close it. Once the fresh one opens, the stalled ones are retired (``opened``, ``retire``).
PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 2.0
MAX_PROBES = 16

#: A retired connection (``Connections.retire``) that proves alive is closed once its request
#: streams ended, at most DRAIN_MAX_S after it was retired (a request's tokens arrive within a
#: client's per-frame deadline, 120 s, or the request fails anyway); checked every DRAIN_POLL_S.
DRAIN_MAX_S = 120.0
DRAIN_POLL_S = 0.25
#: Streams that live as long as their connection rather than one request (gossip, identify,
#: pings): a retired connection does not wait for them.
BACKGROUND_PROTOCOLS = ("/meshsub/", "/floodsub/", "/ipfs/id/", PING_PROTOCOL)

#: Dials ``circuit`` (a relayed address) within the timeout; returns the peer id.
RelayDialer = Callable[[str, float], Awaitable[str]]


class Connections:
    """The live connections per peer, and their healing. Other parts hook in:
    ``on_opened(peer, first)`` after a connection is registered (admission, the ``connected``
    event), ``on_replaced(peer, stalled)`` when stalled ones are replaced, ``on_gone(peer)``
    when the last one closed."""

    def __init__(self, ctx: HostContext) -> None:
        self._ctx = ctx
        self._connections: dict[str, set[INetConn]] = defaultdict(set)
        self._disconnect_events: dict[str, trio.Event] = {}
        #: set when a connection to the peer opens (see ``peerinfer.net.dialing``)
        self.connect_events: dict[str, trio.Event] = {}
        #: consecutive failed liveness pings per peer (``peerinfer.net.liveness`` counts them)
        self.failures: dict[str, int] = defaultdict(int)
        #: peers being probed with a fresh connection (see PROBE_EVERY_S)
        self._probing: set[str] = set()
        #: when stalled connections of a peer were last replaced by a new one
        self.replaced_at: dict[str, float] = {}
        #: connections being retired (``retire``): each once, however often it is judged stalled
        self._retiring: set[INetConn] = set()
        self.on_opened: Callable[[str, bool], None] = lambda peer, first: None
        self.on_replaced: list[Callable[[str, list[INetConn]], None]] = []
        self.on_gone: list[Callable[[str], None]] = []
        self.is_admitted: Callable[[str], bool] = lambda peer: True
        #: relayed addresses known for a peer, and the relayed dial (``peerinfer.net.dialing``)
        self.circuit_addrs: Callable[[str], list[str]] = lambda peer: []
        self.relay_dialer: Callable[[], RelayDialer | None] = lambda: None

    # -- the registry -------------------------------------------------------------------------

    def peers(self) -> set[str]:
        return set(self._connections)

    def is_connected(self, peer_id: str) -> bool:
        """Whether we hold at least one open connection to ``peer_id``."""
        return bool(self.live(parse_peer_id(peer_id)))

    def only_relayed(self, peer_id: str) -> bool:
        """Whether we are connected to ``peer_id`` and only through relays (no direct path)."""
        live = self.live(parse_peer_id(peer_id))
        return bool(live) and all(is_relayed(c) for c in live)

    def live(self, pid: ID) -> list[INetConn]:
        known = set(self._ctx.network.get_connections(pid)) | self._connections.get(pid.to_base58(), set())
        return [conn for conn in known if not conn.is_closed]

    def heard_within(self, conn: INetConn, window: float) -> bool:
        """Whether the peer delivered a frame on ``conn`` within the last ``window`` seconds."""
        stamp = heard_at(conn)
        return stamp is not None and trio.current_time() - stamp <= window

    def heard_since(self, peer_id: str, since: float) -> bool:
        """Whether ``peer_id`` delivered a frame on any of its connections at or after ``since``
        (``trio.current_time()``): its process runs and a link of it delivers."""
        return any((heard_at(c) or float("-inf")) >= since for c in self.live(parse_peer_id(peer_id)))

    @staticmethod
    def requests_in_flight(conn: INetConn) -> int:
        """Streams on ``conn`` that carry a request (not gossip, identify or a ping)."""
        count = 0
        for stream in list(getattr(conn, "streams", ())):
            protocol = stream.get_protocol()
            if protocol is None or not str(protocol).startswith(BACKGROUND_PROTOCOLS):
                count += 1
        return count

    @staticmethod
    def _may_carry_request(conn: INetConn) -> bool:
        """Whether ``conn`` has a request stream, or one of ours still negotiating (a lazily
        negotiated request of ours has no protocol until its reply). A stream the peer opened
        and has not negotiated yet carries no request we serve yet (seen on a connection just
        retired by the peer: two such streams, which ``requests_in_flight`` counts)."""
        for stream in list(getattr(conn, "streams", ())):
            protocol = stream.get_protocol()
            if protocol is None:
                if getattr(getattr(stream, "muxed_stream", None), "is_initiator", True):
                    return True
            elif not str(protocol).startswith(BACKGROUND_PROTOCOLS):
                return True
        return False

    def replaced_since(self, peer_id: str, since: float) -> bool:
        """Whether stalled connections to ``peer_id`` were replaced by a fresh one at or after
        ``since`` (``trio.current_time()``): an exchange begun before then that failed may
        have failed on one of them, not on the peer, and may be tried again."""
        return self.replaced_at.get(peer_id, float("-inf")) >= since

    def opened(self, peer_id: str, conn: INetConn) -> None:
        """libp2p's notification (inline in its notify path) of a new connection."""
        ctx = self._ctx
        older = [c for c in self._connections.get(peer_id, ()) if not c.is_closed]
        first = not older
        self._connections[peer_id].add(conn)
        replacing = bool(older) and ctx.config.replace_stalled_connections and peer_id not in ctx.banned
        if replacing and self.failures.get(peer_id, 0) > 0:
            # The older ones are stalled and go (so this one never counts as one too many).
            self.replace_stalled(peer_id, older)
        elif ctx.running:
            if not is_relayed(conn):
                self._enforce_direct_limit(peer_id, conn)
            if replacing:
                ctx.start_soon(self._replace_silent, peer_id, older)
        opened = self.connect_events.pop(peer_id, None)
        if opened is not None:
            opened.set()
        if peer_id in ctx.banned:
            ctx.start_soon(self.disconnect, peer_id)
            return
        self.on_opened(peer_id, first)

    def _enforce_direct_limit(self, peer_id: str, new: INetConn) -> None:
        """At most ``max_connections_per_peer`` direct connections per peer (libp2p's own
        per-peer limit leaves room for relayed ones, RELAYED_CONNECTIONS_PER_PEER); one too
        many is closed. Not counted: connections we retire ourselves (``retire``: out of
        libp2p's choice, closed at once or within ``DRAIN_MAX_S``). Closed: an older one that
        carries no request stream (``_may_carry_request``), else the new one.

        Why not simply the new one (as before): a new connection is usually a replacement, and
        closing it broke the replacement (reproduced on loopback: docs/reach.md, "A fresh
        connection closed right after it replaced a stalled one", item 2). The side that
        replaces puts every older connection out of libp2p's choice, so the fresh one is its
        only choice; the other side cannot tell retired connections from live ones, and with
        the drained one, an earlier fresh one and this one it counted 3 of 2 and closed this
        one (the replacing side's next ping: "No valid connections available"). Nor may it
        close the oldest: that is the one draining a request. An older one without a request
        stream is one the replacing side has retired and is closing anyway (or an idle spare)."""
        ctx = self._ctx
        direct = [c for c in self._connections[peer_id]
                  if not c.is_closed and not is_relayed(c) and c not in self._retiring]
        if len(direct) <= ctx.config.max_connections_per_peer:
            return
        idle = [c for c in direct if c is not new and not self._may_carry_request(c)]
        victim = idle[0] if idle else new
        logger.info("%d direct connections to %s, over the limit of %d: closing %s one",
                    len(direct), peer_id, ctx.config.max_connections_per_peer,
                    "the new" if victim is new else "an older idle")
        if victim is not new:
            # As for a replaced one: our pubsub stream on it is renewed on the others at once.
            self.out_of_choice(parse_peer_id(peer_id), [victim])
            for replaced in self.on_replaced:
                replaced(peer_id, [victim])
        ctx.start_soon(self.close_connection, peer_id, victim)

    def closed(self, peer_id: str, conn: INetConn) -> None:
        """libp2p's notification of a closed connection."""
        self._connections.get(peer_id, set()).discard(conn)
        self.forget_closed(peer_id)

    def forget_closed(self, peer_id: str) -> None:
        """Drop closed connections of ``peer_id``; if none is left, it is disconnected."""
        known = self._connections.get(peer_id)
        if known is None:
            return
        known.difference_update([c for c in known if c.is_closed])
        if not known:
            del self._connections[peer_id]
            self.failures.pop(peer_id, None)
            self.replaced_at.pop(peer_id, None)
            for gone in self.on_gone:
                gone(peer_id)
            event = self._disconnect_events.pop(peer_id, None)
            if event is not None:
                event.set()
            if peer_id not in self._ctx.banned:
                self._ctx.emit(PeerEvent("disconnected", peer_id))

    async def wait_disconnected(self, peer_id: str) -> None:
        event = self._disconnect_events.setdefault(peer_id, trio.Event())
        if not self.is_connected(peer_id):
            self._disconnect_events.pop(peer_id, None)
            return
        await event.wait()

    # -- closing ------------------------------------------------------------------------------

    async def disconnect(self, peer_id: str) -> None:
        """Close every connection to ``peer_id``; bounded even if the peer is hung.

        A polite close writes a yamux GO_AWAY, which waits behind any write already stuck on a
        hung peer's full socket. A close that has not finished after ``DISCONNECT_TIMEOUT_S``
        gets its socket closed underneath, which fails the stuck writes and lets the polite
        close (and libp2p's disconnect notifications) complete.
        """
        pid = parse_peer_id(peer_id)
        # The connections open now (from the swarm and from our own registry, which keeps the
        # ones the swarm lost track of); a connection dialed meanwhile is left alone.
        live = self.live(pid)
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for conn in live:
                    nursery.start_soon(self.close_connection, peer_id, conn)
        self.forget_closed(peer_id)

    async def close_connection(self, peer_id: str, conn: INetConn) -> None:
        finished = trio.Event()

        async def close_politely() -> None:
            try:
                await conn.close()
            except Exception as exc:
                logger.debug("closing a connection to %s: %r", peer_id, exc)
            finally:
                finished.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close_politely)
            with trio.move_on_after(DISCONNECT_TIMEOUT_S):
                await finished.wait()
            if not finished.is_set():
                logger.info("closing %s politely is stuck; aborting its socket", peer_id)
                await abort_socket(conn)
                with trio.move_on_after(DISCONNECT_TIMEOUT_S):
                    await finished.wait()
            if not finished.is_set():
                nursery.cancel_scope.cancel()

    async def retire(self, peer_id: str, conn: INetConn, *, checked: bool = False) -> None:
        """Close ``conn``, judged stalled, without cutting a request still flowing on it (the
        module's "Slow but alive"): at once if it carries no request stream, or if the peer
        delivered nothing on it within ``liveness_timeout_s``, not even in answer to a ping
        opened over it then (``checked``: that ping was just made, and failed); else once its
        request streams ended, at most ``DRAIN_MAX_S`` from now. Call it with ``conn`` out of
        libp2p's choice."""
        if conn in self._retiring:
            return
        self._retiring.add(conn)
        try:
            await self._retire(peer_id, conn, checked)
        finally:
            self._retiring.discard(conn)

    async def _retire(self, peer_id: str, conn: INetConn, checked: bool) -> None:
        ctx = self._ctx
        timeout = ctx.config.liveness_timeout_s
        # A ping opened over it solicits frames from a live peer's stack (the stream's
        # acknowledgement, the protocol's), however late its echo: either is proof of life.
        if self.requests_in_flight(conn) and (
            self.heard_within(conn, timeout)
            or (not checked and (await self._answers_on(peer_id, conn, timeout) or self.heard_within(conn, timeout)))
        ):
            deadline = trio.current_time() + DRAIN_MAX_S
            logger.info("a replaced connection to %s is alive: its %d request stream(s) may finish",
                        peer_id, self.requests_in_flight(conn))
            while (not conn.is_closed and not ctx.closed and self.requests_in_flight(conn)
                   and trio.current_time() < deadline):
                await trio.sleep(DRAIN_POLL_S)
        await self.close_connection(peer_id, conn)

    def retire_all(self, peer_id: str) -> None:
        """Liveness's verdict on ``peer_id``: every connection to it goes out of libp2p's choice
        and is retired (``retire``; a hung peer's are closed within ``liveness_timeout_s`` plus
        ``DISCONNECT_TIMEOUT_S``, a slow one's once its requests ended)."""
        pid = parse_peer_id(peer_id)
        live = self.live(pid)
        self.out_of_choice(pid, live)
        for conn in live:
            self._ctx.start_soon(self.retire, peer_id, conn)

    # -- healing ------------------------------------------------------------------------------

    def replace_stalled(
        self, peer_id: str, older: list[INetConn], why: str = "its pings failed", *, checked: bool = False
    ) -> None:
        """A new connection to a peer whose pings failed on the ones we had: those are
        stalled (a cut link, a partition, a NAT that lost its mapping), and libp2p would keep
        opening streams on them (it prefers a direct connection, then the one with the most
        streams: the stalled one, whose streams pile up), until liveness closed them all, the
        new one too. Retire them now (``retire``: a request still flowing on one finishes;
        ``checked``: each was just found silent on a ping over itself, so it is closed at once);
        the peer counts as newly connected. The fresh one is then our only choice for new
        streams, while the peer still counts the retired ones: its per-peer limit must not close
        the newest (``_enforce_direct_limit``). Where the "fresh" one closes at once all the
        same, the peer had left: an in-process host whose ``open_host`` exited still accepted
        the probe's dial (docs/reach.md, "A fresh connection closed right after it replaced a
        stalled one", item 1; liveness then finds the peer gone)."""
        self.failures.pop(peer_id, None)
        self.replaced_at[peer_id] = trio.current_time()
        logger.info("a new connection to %s replaces %d stalled one(s) (%s)", peer_id, len(older), why)
        # Out of libp2p's choice at once (closing a stalled one takes DISCONNECT_TIMEOUT_S, and
        # meanwhile a relay's circuit or a forward opened on it went down with it: seen).
        self.out_of_choice(parse_peer_id(peer_id), older)
        for replaced in self.on_replaced:  # RTT, kept streams, our pubsub stream
            replaced(peer_id, older)
        for stale in older:
            self._ctx.start_soon(functools.partial(self.retire, peer_id, stale, checked=checked))
        if self._ctx.admission_key is None or self.is_admitted(peer_id):
            self._ctx.emit(PeerEvent("connected", peer_id))

    async def _replace_silent(self, peer_id: str, older: list[INetConn]) -> None:
        """A new connection to a peer that holds others: ping each older one over itself, and
        replace those that do not answer within ``liveness_timeout_s`` (``replace_stalled``).

        A peer restarted with the same identity, or one whose NAT lost the old flow, dials us
        anew while its old connection is still listed here, dead but never closed (no FIN
        came). Liveness pings need not notice: libp2p opens each ping on the connection it
        prefers, which can be the new one. Meanwhile our pubsub stream to the peer stays on the
        old connection (libp2p opens no second one), so the peer never gets our subscriptions
        and never gossips to us (a restart in tests/node/test_admission_nodes.py, whose old
        connections stay open: 1 of 6 runs of it failed so before this check).

        While an older connection is checked it is out of libp2p's choice for new streams, and
        back as soon as it answers: libp2p prefers the connection with the most streams, which
        a dead one, piling up streams that hang, always is (seen after a partition healed: for
        the 3 s of the check, a relayed peer's pings and pulls went to a circuit its other end
        had closed, and its digest waited)."""
        ctx = self._ctx
        timeout = ctx.config.liveness_timeout_s
        silent: list[INetConn] = []
        pid = parse_peer_id(peer_id)
        listed = ctx.network.connections.get(pid, [])
        if any(c not in older and not c.is_closed for c in listed):  # never the last one
            self.out_of_choice(pid, older)

        async def check(conn: INetConn) -> None:
            if await self._answers_on(peer_id, conn, timeout):
                self.back_in_choice(pid, conn)
            else:
                silent.append(conn)

        async with trio.open_nursery() as nursery:
            for conn in older:
                nursery.start_soon(check, conn)
        # One still delivering frames is alive, if slow to answer (a node streaming us tokens
        # under load): only the ping was late.
        for conn in [c for c in silent if self.heard_within(c, timeout)]:
            silent.remove(conn)
            self.back_in_choice(pid, conn)
        silent = [c for c in silent if not c.is_closed]
        if silent and not ctx.closed and peer_id not in ctx.banned and self.is_connected(peer_id):
            live = [c for c in self.live(pid) if c not in silent]
            if live:  # never the last: then it is the peer that is silent, liveness's business
                self.replace_stalled(peer_id, silent, "silent on a ping over it", checked=True)
                return
        for conn in silent:
            self.back_in_choice(pid, conn)

    def out_of_choice(self, pid: ID, conns: list[INetConn]) -> None:
        """Take ``conns`` out of the connections libp2p picks from for new streams (they stay
        open, and ours: ``live``)."""
        listed = self._ctx.network.connections.get(pid)
        if listed:
            listed[:] = [c for c in listed if c not in conns]

    def back_in_choice(self, pid: ID, conn: INetConn) -> None:
        """Undo ``out_of_choice`` for ``conn``, if it is still open."""
        listed = self._ctx.network.connections.get(pid)
        if not conn.is_closed and listed is not None and conn not in listed:
            listed.append(conn)

    async def _answers_on(self, peer_id: str, conn: INetConn, timeout: float) -> bool:
        """Whether ``peer_id`` echoes a ping on ``conn`` itself within ``timeout`` (``ping``
        lets libp2p pick the connection). One that closes meanwhile, or refuses, is not silent."""
        deadline = trio.current_time() + timeout

        def left() -> float:
            return max(0.01, deadline - trio.current_time())

        try:
            net_stream = await self._ctx.within("ping", peer_id, timeout, conn.new_stream, discard=reset_stream)
            stream = FramedStream(
                net_stream, max_frame_bytes=PING_MAX_BYTES, timeout_s=timeout, negotiate=PING_PROTOCOL
            )
            async with stream:
                await echo_nonce(stream, peer_id, left)
        except RequestTimeoutError:
            return conn.is_closed
        except (RemoteError, ClosedError, trio.EndOfChannel):
            pass
        except Exception as exc:  # libp2p's own, from a connection closing under the stream
            logger.debug("pinging %s on one connection: %r", peer_id, exc)
        return True

    # -- probes -------------------------------------------------------------------------------

    def start_probe(self, peer: str) -> None:
        if peer in self._probing or len(self._probing) >= MAX_PROBES or not self._ctx.running:
            return
        self._probing.add(peer)
        self._ctx.start_soon(self._probe, peer)

    async def _probe(self, peer: str) -> None:
        """Fresh connections to ``peer`` (see PROBE_EVERY_S) until one opens, its pings
        answer again, or liveness disconnects it (redialing it is then the bootstrap loop's
        or the node's). Bounded: liveness ends a failing peer within a few rounds."""
        try:
            while not self._ctx.closed and self.failures.get(peer, 0) > 0 and self.is_connected(peer):
                if await self.fresh_connection(peer, PROBE_TIMEOUT_S):
                    return
                await trio.sleep(PROBE_EVERY_S)
        finally:
            self._probing.discard(peer)

    async def fresh_connection(self, peer: str, timeout: float) -> bool:
        """Open one more connection to ``peer`` (libp2p's connect would return the stalled
        one): through a relay when we know a relayed address of it (its direct ones are then
        a NAT's, which drop the SYN), else to each known direct address. True once one opened."""
        ctx = self._ctx
        circuits = [c for c in self.circuit_addrs(peer) if f"/p2p/{ctx.peer_id}/p2p-circuit" not in c]
        dialer = self.relay_dialer()
        if circuits and dialer is not None:
            for circuit in circuits:
                try:
                    await dialer(circuit, timeout)
                    return True
                except Exception as exc:  # the relay refused, has no reservation, or is stalled too
                    logger.debug("probing %s through %s: %s", peer, circuit, exc)
            return False
        pid = parse_peer_id(peer)
        try:
            addrs = list(ctx.h.get_peerstore().addrs(pid))
        except Exception:  # PeerStoreError: nothing known
            return False
        for addr in addrs[:MAX_KNOWN_ADDRS_PER_PEER]:
            try:
                await ctx.within("probe", peer, timeout, functools.partial(ctx.network.dial_addr, addr, pid))
                return True
            except (RemoteError, ClosedError) as exc:
                logger.debug("probing %s at %s: %s", peer, addr, exc)
        return False


__all__ = [
    "BACKGROUND_PROTOCOLS", "DISCONNECT_TIMEOUT_S", "DRAIN_MAX_S", "DRAIN_POLL_S", "MAX_PROBES", "PROBE_EVERY_S",
    "PROBE_TIMEOUT_S", "Connections", "RelayDialer",
]
