"""Dialing for one host: ``connect``/``dial`` (direct, or through a relay for a peer we know
relayed addresses of), the addresses learned from peers (``add_known_peer``), the bootstrap
loop and mDNS discoveries."""

from __future__ import annotations

import random
import secrets
from collections import OrderedDict
from collections.abc import Sequence

import multiaddr
import trio
from libp2p.peer.peerinfo import PeerInfo

from peerinfer.errors import (
    ClosedError,
    InvalidRequestError,
    PeerUnavailableError,
    ProtocolError,
    RemoteError,
)
from peerinfer.net.connections import Connections, RelayDialer
from peerinfer.net.context import (
    KNOWN_ADDR_TTL_S,
    MAX_KNOWN_ADDRS_PER_PEER,
    HostContext,
    PeerEvent,
    logger,
    parse_multiaddr,
    parse_peer_id,
)
from peerinfer.net.gatekeeper import Gatekeeper
from peerinfer.net.pacing import Backoff

#: Peers we remember relayed (circuit) addresses for; the oldest are forgotten beyond this.
MAX_CIRCUIT_PEERS = 1024
#: The direct dial tried before the relayed one, for a peer with a relayed address.
RELAYED_DIRECT_TRY_S = 2.0


class Dialer:
    """How we reach peers: known addresses, direct and relayed dials, bootstrap and mDNS."""

    def __init__(self, ctx: HostContext, connections: Connections, gatekeeper: Gatekeeper) -> None:
        self._ctx = ctx
        self._connections = connections
        self._gatekeeper = gatekeeper
        self._rng = random.Random(secrets.randbits(64))
        # Peers' circuit addresses, kept out of libp2p's peerstore: its TCP transport would
        # dial the relay's part of one and fail the handshake.
        self._circuit_addrs: OrderedDict[str, list[str]] = OrderedDict()
        #: the relayed dial, once ``peerinfer.net.reach`` has set one up
        self.relay_dialer: RelayDialer | None = None
        connections.circuit_addrs = self.circuit_addrs
        connections.relay_dialer = lambda: self.relay_dialer

    def circuit_addrs(self, peer_id: str) -> list[str]:
        """The relayed addresses we know for ``peer_id`` (with ``/p2p/<peer id>``)."""
        return list(self._circuit_addrs.get(peer_id, ()))

    def known_addrs(self, peer_id: str) -> list[str]:
        """What the peerstore knows about how to reach ``peer_id`` (without /p2p), for peer
        exchange. Empty if nothing is known."""
        pid = parse_peer_id(peer_id)
        try:
            direct = [str(a) for a in self._ctx.h.get_peerstore().addrs(pid)]
        except Exception:  # PeerStoreError: unknown peer
            direct = []
        return direct + self.circuit_addrs(peer_id)

    def add_known_peer(self, peer_id: str, addrs: Sequence[str]) -> None:
        """See ``Host.add_known_peer``."""
        pid = parse_peer_id(peer_id, ProtocolError)
        if peer_id == self._ctx.peer_id:
            return
        parsed = [parse_multiaddr(a, ProtocolError) for a in addrs]
        circuits = [str(a) for a in parsed if "/p2p-circuit" in str(a)]
        parsed = [a for a in parsed if "/p2p-circuit" not in str(a)]
        if circuits:
            suffix = f"/p2p/{peer_id}"
            full = [c if c.endswith("/p2p-circuit" + suffix) else c + suffix for c in circuits
                    if c.endswith("/p2p-circuit") or c.endswith("/p2p-circuit" + suffix)]
            if full:
                self._circuit_addrs[peer_id] = list(dict.fromkeys(full))[:MAX_KNOWN_ADDRS_PER_PEER]
                self._circuit_addrs.move_to_end(peer_id)
                while len(self._circuit_addrs) > MAX_CIRCUIT_PEERS:
                    self._circuit_addrs.popitem(last=False)
        cleaned: list[multiaddr.Multiaddr] = []
        for addr in parsed:
            try:
                if addr.value_for_protocol("p2p") not in (None, peer_id):
                    raise ProtocolError(f"address {addr} names another peer than {peer_id}")
                addr = addr.decapsulate(multiaddr.Multiaddr(f"/p2p/{peer_id}"))
            except ProtocolError:
                raise
            except Exception:
                pass  # no /p2p component
            cleaned.append(addr)
        cleaned = cleaned[:MAX_KNOWN_ADDRS_PER_PEER]
        already = set(self.known_addrs(peer_id))
        self._ctx.h.get_peerstore().add_addrs(pid, cleaned, KNOWN_ADDR_TTL_S)
        if any(str(a) not in already for a in cleaned):
            self._ctx.emit(PeerEvent("discovered", peer_id, tuple(str(a) for a in cleaned)))

    async def connect_info(self, info: PeerInfo, timeout: float | None) -> str:
        ctx = self._ctx
        ctx.check_open()
        peer = info.peer_id.to_base58()
        if peer == ctx.peer_id:
            raise InvalidRequestError("cannot connect to ourselves")
        deadline = ctx.config.connect_timeout_s if timeout is None else timeout
        # The swarm blocks a peer for 60 s after a failed dial; our callers pace themselves.
        ctx.network.unblock_peer(info.peer_id)
        # libp2p's connect() returns at once if the swarm lists any connection to the peer,
        # even a closed one; drop those first so that it dials.
        listed = ctx.network.connections.get(info.peer_id)
        if listed:
            listed[:] = [conn for conn in listed if not conn.is_closed]
            if not listed:
                del ctx.network.connections[info.peer_id]
        started = trio.current_time()
        try:
            await self._connect_direct_or_relayed(info, deadline)
            if not self._connections.is_connected(peer):
                if ctx.admission_key is not None:
                    reason = self._gatekeeper.refusals_logged.get(peer) or "closed by the peer"
                    raise PeerUnavailableError(f"connect: {peer} refused by swarm admission: {reason}")
                raise PeerUnavailableError(
                    f"connect: the connection to {peer} closed at once (a node of a private "
                    "swarm closes it like this: it needs the swarm key)"
                )
            if ctx.admission_key is not None:
                left = max(0.0, deadline - (trio.current_time() - started))
                await self._gatekeeper.require_admitted(peer, left)
        except RemoteError:
            ctx.counters.dial_failures += 1
            raise
        return peer

    async def _connect_direct_or_relayed(self, info: PeerInfo, deadline: float) -> None:
        """Dial ``info`` directly; a peer we know relayed addresses for gets a short direct
        try (a third of the deadline, at most RELAYED_DIRECT_TRY_S) and then each circuit."""
        peer = info.peer_id.to_base58()
        circuits = self.circuit_addrs(peer) if self.relay_dialer is not None else []
        if not circuits:
            await self._dial(info, deadline)
            return
        started = trio.current_time()
        direct_s = min(RELAYED_DIRECT_TRY_S, deadline / 3)
        try:
            await self._dial(info, direct_s)
            if self._connections.is_connected(peer):
                return
        except RemoteError:
            pass
        last: Exception | None = None
        dialer = self.relay_dialer
        assert dialer is not None
        for circuit in circuits:
            left = deadline - (trio.current_time() - started)
            if left <= 0:
                break
            if self._connections.is_connected(peer):
                # It dialed us (through the relay) during our direct try: a second relayed
                # connection would only take room (RELAYED_CONNECTIONS_PER_PEER).
                return
            try:
                await dialer(circuit, left)
                return
            except Exception as exc:  # the relay refused, has no reservation, or is gone
                last = exc
        raise PeerUnavailableError(f"connect: cannot reach {peer} directly or through a relay ({last})")

    async def _dial(self, info: PeerInfo, deadline: float) -> None:
        """libp2p's ``connect``, returning as soon as a connection to the peer is open.

        py-libp2p 0.8.1's ``dial_peer`` waits out its whole happy-eyeballs head start
        (``_HAPPY_EYEBALLS_DELAY``, 250 ms) after starting the dial of its last address, even
        when that dial succeeded at once: every connect took at least 250 ms, twice over on a
        newcomer's path into the swarm (its bootstrap, then the peers it learns of). The dial
        runs on in ``within``'s helper task and ends by itself; we stop waiting for it once
        the connection is registered (``Connections.opened`` saw it open).
        """
        peer = info.peer_id.to_base58()
        events = self._connections.connect_events
        opened = events.setdefault(peer, trio.Event())
        try:
            await self._ctx.within("connect", peer, deadline, lambda: self._ctx.h.connect(info), done_when=opened)
        finally:
            if not opened.is_set() and events.get(peer) is opened:
                del events[peer]  # bounded: only dials under way keep one

    # -- discovery ----------------------------------------------------------------------------

    async def keep_connected(self, info: PeerInfo) -> None:
        """Bootstrap: stay connected to one peer forever, redialing with backoff."""
        ctx = self._ctx
        peer = info.peer_id.to_base58()
        ctx.h.get_peerstore().add_addrs(info.peer_id, info.addrs, KNOWN_ADDR_TTL_S)
        ctx.emit(PeerEvent("discovered", peer, tuple(str(a) for a in info.addrs)))
        backoff = Backoff(ctx.config.bootstrap_backoff_min_s, ctx.config.bootstrap_backoff_max_s)
        while True:
            if self._connections.is_connected(peer):
                backoff.reset()
                await self._connections.wait_disconnected(peer)
                continue
            ctx.counters.bootstrap_attempts += 1
            try:
                await self.connect_info(info, None)
                logger.debug("bootstrap peer %s connected", peer)
                backoff.reset()
            except RemoteError as exc:
                delay = backoff.next_delay(self._rng)
                logger.info("bootstrap peer %s unreachable (%s); retrying in %.1f s", peer, exc, delay)
                await trio.sleep(delay)

    def on_discovered(self, peer_id: str, addrs: tuple[str, ...]) -> None:
        """An mDNS discovery (trio thread): remember, announce, dial in the background."""
        if not self._ctx.running or peer_id == self._ctx.peer_id:
            return
        try:
            self.add_known_peer(peer_id, addrs)
        except ProtocolError as exc:
            logger.info("ignoring a malformed mDNS record for %s: %s", peer_id, exc)
            return
        if not self._connections.is_connected(peer_id):
            self._ctx.start_soon(self._dial_quietly, peer_id)

    async def _dial_quietly(self, peer_id: str) -> None:
        try:
            await self.connect_info(PeerInfo(parse_peer_id(peer_id), []), None)
        except (RemoteError, ClosedError) as exc:
            logger.info("could not connect to discovered peer %s: %s", peer_id, exc)


__all__ = ["MAX_CIRCUIT_PEERS", "RELAYED_DIRECT_TRY_S", "Dialer"]
