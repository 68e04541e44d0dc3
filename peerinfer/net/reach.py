"""Reachability: is this node dialable from the internet, and if not, a relay slot.

Algorithm (one task per node, :func:`run_reach`)
------------------------------------------------
1. **Dial-back test** (AutoNAT's rule, our own small protocol ``/peerinfer/dialback/1.0.0``):
   we ask up to ``DIALBACK_ASKED`` connected peers to open a plain TCP connection back to *the
   address they see our connection coming from*, at our listen port. A peer never dials any
   other address (it cannot be used to make a node connect to a third party), and serves at
   most ``DIALBACK_RATE`` tests per second in all. Any success: we are reachable. Behind a
   NAT the observed address is the router's, which has no mapping for our port: refused.
   Only over a direct connection: through a relay the address a peer sees is the *relay's*
   (py-libp2p's relayed connection reports the one under it), so a relayed peer is never
   asked and never answers (else a node behind a NAT, asking a peer it reached through a
   relay listening on the same port, was told "reachable" and withdrew its relayed address:
   seen after a cut link healed, as a forward reset mid-request).
2. **Reachable** and ``relay_service`` on (the default): we serve circuit relay v2 hop
   (bounded: ``RelaySettings``), behind swarm admission.
3. **Not reachable**: we keep one reservation on a relay: a connected peer that accepts one
   (peers are tried in random order, at most ``RELAY_CANDIDATES`` per round). Our relayed
   address ``<relay addr>/p2p/<relay>/p2p-circuit/p2p/<us>`` is then one of
   ``Host.dialable_addrs()``, so it reaches others through peer exchange and status. When the
   relay's connection goes, the address is withdrawn and the next round reserves again
   (on the same relay once the bootstrap loop reconnects it, or on another).
4. Every ``RECHECK_S`` the test and reservation are redone (a reservation is refreshed well
   within its TTL).
5. Before the first verdict, a reservation is taken speculatively while the test runs (behind
   a NAT the verdict waits for the dial-backs to time out), and dropped if we turn out
   reachable: joining does not wait for the verdict.

With ``upnp`` (off by default), a port mapping is asked of the router before the first test
(net/upnp.py); where one is made, the test finds the port open and no relay is needed.

Dialing a relayed peer is in ``Dialer.connect_info`` (``peerinfer.net.dialing``): a short
direct attempt first, then the circuit address (see ``Host.relay_dialer``). A relayed connection is then upgraded to a direct
one by hole punching (py-libp2p's DCUtR, TCP with SO_REUSEPORT from the listen port) where
both NATs allow; else it stays relayed.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import multiaddr
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import MAX_HOLE_PUNCH_ATTEMPTS, DCUtRProtocol
from libp2p.relay.circuit_v2.dcutr import PROTOCOL_ID as DCUTR_PROTOCOL
from libp2p.tools.anyio_service import background_trio_service

from peerinfer.errors import PeerInferError
from peerinfer.net.framing import FramedStream
from peerinfer.net.host import Host, parse_peer_id, stream_is_relayed
from peerinfer.net.pacing import TokenBucket
from peerinfer.net.relay import HOP_PROTOCOL, Relay, RelaySettings, open_relay
from peerinfer.net.upnp import open_port_mapping

if TYPE_CHECKING:
    # trio's own ``trio.TaskStatus``, as mypy sees it: libp2p depends on trio-typing, whose
    # trio-stubs shadow trio's inline types and name the class here.
    from trio_typing import TaskStatus

__all__ = ["DIALBACK_PROTOCOL", "ReachSettings", "ReachState", "run_reach"]

logger = logging.getLogger(__name__)

DIALBACK_PROTOCOL = "/peerinfer/dialback/1.0.0"
DIALBACK_ASKED = 3
DIALBACK_TIMEOUT_S = 3.0
DIALBACK_RATE = 2.0
DIALBACK_BURST = 8
RELAY_CANDIDATES = 8
RECHECK_S = 60.0
#: How often the reservation's relay is checked to be still connected.
WATCH_S = 1.0
#: Before the first dial-back verdict, how often to look for a peer to ask (and a relay to
#: reserve on meanwhile, speculatively: ``_Reach._test_reserving_meanwhile``). Joining waits
#: for both.
FIRST_VERDICT_POLL_S = 0.2
#: After py-libp2p's DCUtR has spent its attempts on a peer (3, then never again while the
#: relayed connection lasts), its budget is given back after this long, doubling per peer up
#: to PUNCH_RETRY_MAX_S: a punch that lost a race on a busy machine or router is tried again
#: (measured: 1 cone pair in 10 stayed relayed for good), a symmetric NAT costs a few
#: attempts per PUNCH_RETRY_MAX_S at most.
PUNCH_RETRY_S = 15.0
PUNCH_RETRY_MAX_S = 600.0
#: Of two peers with a relayed connection, the one with the smaller peer id starts the hole
#: punch; the other starts one only after this long still relayed (in case the first never
#: does). Both starting at once (each DCUtR's auto-drive loop ticks every 2 s) ran two sessions
#: that dialed the same TCP 4-tuple with opposite roles (measured: EADDRNOTAVAIL, and a merged
#: connection whose two ends both took the Noise responder role failed, leaving the 4-tuple in
#: TIME_WAIT for 60 s: the cone pair stayed relayed).
PUNCH_FOLLOWER_WAIT_S = 20.0
#: A peer not asked about for this long (DCUtR asks every 2 s while relayed) starts afresh.
PUNCH_ASK_GAP_S = 10.0
MAX_PUNCH_PEERS = 1024
#: Hole punches under way at once (to different peers; each dials from our listen port).
MAX_CONCURRENT_PUNCHES = 16


@dataclass(frozen=True)
class ReachSettings:
    #: Offer relay service when we turn out reachable (``peerinfer node --no-relay-service``).
    relay_service: bool = True
    #: Upgrade relayed connections to direct ones by TCP hole punching (DCUtR) where the NATs
    #: allow (cone NATs that drop unsolicited packets; never a symmetric NAT).
    hole_punching: bool = True
    relay: RelaySettings = field(default_factory=RelaySettings)
    #: Ask the router for a port mapping by UPnP first (``peerinfer node --upnp``; net/upnp.py).
    upnp: bool = False

    @classmethod
    def of(cls, relay_service: bool, circuit_bytes: int | None = None, upnp: bool = False) -> ReachSettings:
        relay = RelaySettings() if circuit_bytes is None else RelaySettings(circuit_bytes=circuit_bytes)
        return cls(relay_service=relay_service, relay=relay, upnp=upnp)


@dataclass
class ReachState:
    """What the node knows about its reachability (read by status and tests)."""

    #: None: not tested yet; True: a peer dialed us back; False: every test failed
    reachable: bool | None = None
    relaying_for_others: bool = False
    #: relay peer id -> our address through it
    reservations: dict[str, str] = field(default_factory=dict)
    #: our address through the router's UPnP port mapping (None: none asked for, or none made)
    upnp_addr: str | None = None


def _listen_port(host: Host) -> int | None:
    for addr in host.listen_addrs():
        try:
            return int(multiaddr.Multiaddr(addr).value_for_protocol("tcp"))
        except Exception:
            continue
    return None


def _observed_ip(stream: FramedStream) -> str | None:
    try:
        remote = stream._stream.get_remote_address()
    except Exception:
        return None
    return None if remote is None else str(remote[0])


def _remote_ip(host: Host, peer: str) -> str | None:
    for conn in host._live_connections(parse_peer_id(peer)):
        try:
            remote = conn.muxed_conn.get_remote_address()  # type: ignore[attr-defined]
        except Exception:
            continue
        if remote:
            return str(remote[0])
    return None


def _relay_addr(host: Host, relay: str) -> str | None:
    """The relay's own dialable address: a known address on the IP we reach it at."""
    ip = _remote_ip(host, relay)
    if ip is None:
        return None
    for addr in host.known_addrs(relay):
        if "p2p-circuit" in addr:
            continue
        addr = addr.removesuffix(f"/p2p/{relay}")
        with contextlib.suppress(Exception):
            if multiaddr.Multiaddr(addr).value_for_protocol("ip4") == ip:
                return addr
    return None


class _Reach:
    def __init__(
        self, host: Host, relay: Relay, settings: ReachSettings, on_addrs_changed: Callable[[], None]
    ) -> None:
        self.on_addrs_changed = on_addrs_changed
        self.host = host
        self.relay = relay
        self.settings = settings
        self.state = ReachState()
        self._bucket = TokenBucket(DIALBACK_RATE, DIALBACK_BURST)

    async def serve_dialback(self, stream: FramedStream) -> None:
        """Dial the asker back at its observed IP and the port it names; reply b"1" or b"0".
        Through a relay no reply: the observed IP would be the relay's."""
        request = await stream.receive()
        if stream_is_relayed(stream):
            return
        ok = False
        ip = _observed_ip(stream)
        if ip is not None and request.isdigit() and 0 < int(request) < 65536:
            if self._bucket.take(trio.current_time()):
                with trio.move_on_after(DIALBACK_TIMEOUT_S), contextlib.suppress(OSError):
                    sock = await trio.open_tcp_stream(ip, int(request))
                    await sock.aclose()
                    ok = True
        await stream.send(b"1" if ok else b"0")

    def _speaking(self, protocol: str) -> list[str]:
        """Admitted connected peers whose identify lists ``protocol`` (clients, and nodes
        without reachability support, are never asked)."""
        ps = self.host._h.get_peerstore()
        out = []
        for peer in self.host.connected_peers():
            if not self.host.is_admitted(peer):
                continue
            try:
                protocols = ps.get_protocols(parse_peer_id(peer))
            except Exception:
                continue
            if protocol in protocols:
                out.append(peer)
        return out

    async def test_reachable(self, speakers: list[str] | None = None) -> bool | None:
        """``speakers``: ``self._speaking(DIALBACK_PROTOCOL)`` if the caller has just made it."""
        if speakers is None:
            speakers = self._speaking(DIALBACK_PROTOCOL)
        peers = [p for p in speakers if not self.host.only_relayed(p)]
        if not peers:  # before the multiaddr parse: polled every FIRST_VERDICT_POLL_S meanwhile
            return None
        port = _listen_port(self.host)
        if port is None:
            return None
        random.shuffle(peers)
        answered = False
        for peer in peers[:DIALBACK_ASKED]:
            try:
                reply = await self.host.request(
                    peer, DIALBACK_PROTOCOL, str(port).encode(), timeout=DIALBACK_TIMEOUT_S + 2
                )
            except PeerInferError:
                continue
            answered = True
            if reply == b"1":
                return True
        return False if answered else None

    def _withdraw_lost(self) -> None:
        for relay_id in list(self.state.reservations):
            if not self.host.is_connected(relay_id):
                addr = self.state.reservations.pop(relay_id)
                self.relay.reservations.pop(relay_id, None)
                self.host.remove_advertised_addr(addr)
                self.on_addrs_changed()
                logger.info("relay %s lost; its address withdrawn", relay_id)

    async def reserve_somewhere(self) -> None:
        # Peers that announced relay service first; then other peerinfer nodes (identify may
        # predate a relay's switching its service on).
        relays = self._speaking(HOP_PROTOCOL)
        others = [p for p in self._speaking(DIALBACK_PROTOCOL) if p not in relays]
        random.shuffle(relays)
        random.shuffle(others)
        peers = relays + others
        for peer in peers[:RELAY_CANDIDATES]:
            relay_addr = _relay_addr(self.host, peer)
            if relay_addr is None or _is_circuit(relay_addr):
                continue
            try:
                addr = await self.relay.reserve(peer, relay_addr, timeout=5.0)
            except Exception as exc:  # a refusal, a reset, a peer without relay service
                logger.debug("no reservation on %s: %s", peer, exc)
                continue
            self.state.reservations[peer] = addr
            self.host.add_advertised_addr(addr)
            self.on_addrs_changed()
            logger.info("reachable through relay %s as %s", peer, addr)
            return

    async def run(self) -> None:
        next_check = 0.0
        while True:
            now = trio.current_time()
            self._withdraw_lost()
            if now >= next_check or self.state.reachable is None:
                was = self.state.reachable
                verdict = await self._test_reserving_meanwhile()
                if verdict is not None:
                    if verdict != self.state.reachable:
                        logger.info("dial-back test: %s", "reachable" if verdict else "not reachable (behind a NAT?)")
                    self.state.reachable = verdict
                    next_check = trio.current_time() + RECHECK_S
                    if verdict and self.settings.relay_service and not self.state.relaying_for_others:
                        self.relay.enable_service()
                        self.state.relaying_for_others = True
                    if verdict:
                        self._drop_reservations()  # a speculative one (see FIRST_VERDICT_POLL_S)
                    if not verdict and was is False and self.state.reservations:
                        # refresh: reserve again on the same relays (well within the TTL)
                        for relay_id in list(self.state.reservations):
                            with contextlib.suppress(Exception):
                                await self.relay.reserve(relay_id, _relay_addr(self.host, relay_id) or "", timeout=5.0)
            if self.state.reachable is False and not self.state.reservations:
                await self.reserve_somewhere()
            await trio.sleep(WATCH_S if self.state.reachable is not None else FIRST_VERDICT_POLL_S)

    async def _test_reserving_meanwhile(self) -> bool | None:
        """The dial-back verdict; before the first one, a reservation is taken meanwhile (a
        node behind a NAT learns it only when its dial-backs time out, DIALBACK_TIMEOUT_S, and
        joining waited for that), and dropped if the verdict is "reachable". Only while a
        verdict is pending: with no peer to ask, no reservation is taken on a guess."""
        verdict_known = trio.Event()

        async def reserve_until_the_verdict() -> None:
            # A relay that has just started offers its service only once its own verdict is
            # in (its first peers dial it back): try again until then.
            while not self.state.reservations and not verdict_known.is_set():
                await self.reserve_somewhere()
                with trio.move_on_after(FIRST_VERDICT_POLL_S):
                    await verdict_known.wait()

        async with trio.open_nursery() as nursery:
            # Made once per round: before the first verdict this runs every FIRST_VERDICT_POLL_S
            # over every connected peer (clients included), and nothing awaits before the test
            # reads it.
            speakers = self._speaking(DIALBACK_PROTOCOL)
            pending = bool(speakers)
            # Not with a fresh UPnP port mapping: the verdict is expected to be "reachable",
            # and a relayed address advertised meanwhile had peers connect through the relay
            # and stay there (tests/net/test_reach_upnp.py saw it).
            speculate = self.state.upnp_addr is None
            if self.state.reachable is None and not self.state.reservations and pending and speculate:
                nursery.start_soon(reserve_until_the_verdict)
            verdict = await self.test_reachable(speakers)
            verdict_known.set()  # a reservation under way may finish (kept if not reachable)
            if verdict:
                nursery.cancel_scope.cancel()
        return verdict

    def _drop_reservations(self) -> None:
        if not self.state.reservations:
            return
        for relay_id, addr in list(self.state.reservations.items()):
            self.relay.reservations.pop(relay_id, None)
            self.host.remove_advertised_addr(addr)
            logger.info("reachable: our address through relay %s withdrawn", relay_id)
        self.state.reservations.clear()
        self.on_addrs_changed()


@contextlib.asynccontextmanager
async def _running_dcutr(host: Host) -> AsyncIterator[None]:
    """py-libp2p's DCUtR service: every 2 s it tries a hole punch to each peer it has only a
    relayed connection to (at most a few attempts per peer; the smaller peer id of the two
    first, each peer on its own: see ``_one_side_first``); its stream handler is re-registered
    behind swarm admission. The punched connection is an ordinary swarm connection (admitted
    as any other); DCUtR then closes the relayed one after a grace period."""
    dcutr = DCUtRProtocol(host._h)
    async with background_trio_service(dcutr):
        await dcutr.event_started.wait()
        inner = dcutr._handle_dcutr_stream

        async def gated(stream: INetStream) -> None:
            peer = stream.muxed_conn.peer_id.to_base58()
            if not host.is_admitted(peer):
                with contextlib.suppress(Exception):
                    await stream.reset()
                return
            try:
                await inner(stream)
            except Exception:
                logger.exception("hole punch with %s failed", peer)
                with contextlib.suppress(Exception):
                    await stream.reset()

        host._h.set_stream_handler(DCUTR_PROTOCOL, gated)
        async with trio.open_nursery() as nursery:
            # The auto-drive loop calls the instance's initiate_hole_punch: one side leads,
            # and each peer's attempt runs on its own.
            dcutr.initiate_hole_punch = _one_side_first(  # type: ignore[method-assign,assignment]  # an instance patch
                host.peer_id, dcutr.initiate_hole_punch, nursery
            )
            nursery.start_soon(_give_back_punch_budgets, dcutr)
            yield
            nursery.cancel_scope.cancel()


def _one_side_first(
    our_id: str, initiate: Callable[[ID], Awaitable[bool]], nursery: trio.Nursery
) -> Callable[[ID], Coroutine[Any, Any, bool]]:
    """``initiate`` (DCUtR's ``initiate_hole_punch``) as the auto-drive loop should call it:

    * the peer with the smaller id of the two starts at once, the other only once
      ``PUNCH_FOLLOWER_WAIT_S`` has passed since it was first asked about that peer (a gap of
      ``PUNCH_ASK_GAP_S`` without asking starts the wait afresh: the relayed connection went,
      or was punched);
    * each attempt runs in ``nursery`` and the call returns False at once: DCUtR's loop awaits
      each peer's attempt in turn, and a futile one (a symmetric NAT: 3 rounds, ~20 s) held
      back every other peer's (measured: a cone pair punched 20 s late beside a symmetric
      peer). One attempt per peer at a time.

    A call held back or handed to the nursery returns False, which DCUtR does not count."""
    asked: OrderedDict[ID, tuple[float, float]] = OrderedDict()  # peer -> (first, last) ask
    running: set[ID] = set()

    async def attempt(peer_id: ID) -> None:
        try:
            await initiate(peer_id)
        except Exception as exc:  # DCUtR logs its own failures; never take the node down
            logger.debug("hole punch with %s: %r", peer_id, exc)
        finally:
            running.discard(peer_id)

    async def first_or_after_a_wait(peer_id: ID) -> bool:
        now = trio.current_time()
        if our_id > peer_id.to_base58():
            first, last = asked.pop(peer_id, (now, now))
            if now - last > PUNCH_ASK_GAP_S:
                first = now
            asked[peer_id] = (first, now)
            while len(asked) > MAX_PUNCH_PEERS:
                asked.popitem(last=False)
            if now - first < PUNCH_FOLLOWER_WAIT_S:
                return False
        if peer_id not in running and len(running) < MAX_CONCURRENT_PUNCHES:
            running.add(peer_id)
            nursery.start_soon(attempt, peer_id)
        return False

    return first_or_after_a_wait


async def _give_back_punch_budgets(dcutr: DCUtRProtocol) -> None:
    """Retry hole punching with a relayed peer after DCUtR gave up (``PUNCH_RETRY_S``).

    Reads and edits DCUtR's private attempt table: 0.8.1 has no public way to retry."""
    retry_in: dict[object, float] = {}  # peer -> current wait before its budget comes back
    due: dict[object, float] = {}  # peer -> when it comes back
    while True:
        await trio.sleep(1.0)
        now = trio.current_time()
        attempts = dcutr._hole_punch_attempts
        for peer in list(due):  # forget peers DCUtR forgot (disconnected) or punched
            if peer not in attempts or peer in dcutr._direct_connections:
                due.pop(peer)
                retry_in.pop(peer, None)
        for peer, spent in list(attempts.items()):
            if spent < MAX_HOLE_PUNCH_ATTEMPTS or peer in dcutr._direct_connections:
                continue
            if peer not in due:
                wait = retry_in.get(peer, PUNCH_RETRY_S)
                due[peer] = now + wait
                retry_in[peer] = min(2 * wait, PUNCH_RETRY_MAX_S)
            elif now >= due[peer]:
                del due[peer]
                logger.info("hole punching with %s again", peer)
                attempts.pop(peer, None)
        if len(retry_in) > 64 + 4 * len(attempts):  # bounded: drop peers long gone
            retry_in = {p: w for p, w in retry_in.items() if p in attempts or p in due}


def _is_circuit(addr: str) -> bool:
    return "p2p-circuit" in addr


async def run_reach(
    host: Host,
    settings: ReachSettings,
    *,
    on_addrs_changed: Callable[[], None] = lambda: None,
    task_status: TaskStatus[ReachState] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run reachability, relay service and relay reservations on ``host`` until cancelled.
    ``on_addrs_changed`` is called (it must not block) when our relayed address comes or goes,
    so the node can tell its peers at once rather than at the next periodic peer exchange."""
    relay_settings = RelaySettings(
        service=settings.relay_service,
        max_reservations=settings.relay.max_reservations,
        max_circuits=settings.relay.max_circuits,
        circuit_bytes=settings.relay.circuit_bytes,
        circuit_s=settings.relay.circuit_s,
    )
    async with open_relay(host, relay_settings, serve_now=False) as relay, contextlib.AsyncExitStack() as stack:
        if settings.hole_punching:
            await stack.enter_async_context(_running_dcutr(host))
        reach = _Reach(host, relay, settings, on_addrs_changed)
        host.set_handler(DIALBACK_PROTOCOL, reach.serve_dialback)
        host.relay_dialer = lambda circuit, timeout: relay.dial(circuit, timeout=timeout)
        host.reach_state = reach.state
        task_status.started(reach.state)
        try:
            port = _listen_port(host)
            if settings.upnp and port is not None:
                # Before the first dial-back test, which then finds the mapped port open.
                mapping = await open_port_mapping(host, port)
                if mapping is not None:
                    stack.push_async_callback(mapping.close)
                    reach.state.upnp_addr = mapping.addr
                    on_addrs_changed()
            await reach.run()
        finally:
            host.relay_dialer = None
            host.remove_handler(DIALBACK_PROTOCOL)
