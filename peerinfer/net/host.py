"""``open_host``: a py-libp2p host, locked down, behind a narrow trio API.

Theory of operation
-------------------
``open_host(config)`` builds one libp2p ``BasicHost`` and runs, inside one nursery that it
owns, everything the node needs from the network:

* **Transport and security.** TCP, Noise (XX) as the *only* security protocol and Yamux as the
  only muxer. py-libp2p's ``new_host`` offers plaintext, SECIO and TLS too by default; a
  plaintext dialer can claim any peer id. With Noise only, every connection proves possession of
  the private key behind the peer id, so ``FramedStream.remote_peer`` and ``GossipMessage.sender``
  are authenticated.
* **Muxer.** Yamux streams return receive-window credit once half the window is consumed,
  not after nearly every read (``peerinfer.net.muxer``: half of a request's frames were window
  updates).
* **Limits.** A resource manager bounds pending and established connections (total, per
  direction, per peer); its memory limit (which refuses every connection once the *machine* is
  above 90 % memory, i.e. whenever a model is loaded), circuit breaker (five refusals block all
  connections for 60 s) and "graceful degradation" (which shrinks limits) are turned off. Per
  peer, ``max_connections_per_peer`` direct connections plus ``RELAYED_CONNECTIONS_PER_PEER``
  relayed ones: two homes that dial each other through a relay at once hold two relayed
  connections, and the hole-punched direct one must still fit (libp2p's own per-peer limit
  counts both kinds, so it is set to the sum, and a direct connection beyond the bound is
  closed as it opens, ``_connection_opened``). The
  swarm's auto-connector and retry loop are disabled: dialing policy is ours (bootstrap redial,
  mDNS, ``dial``). Frames are bounded by ``max_frame_bytes``; inbound handler invocations per peer
  by ``max_streams_per_peer`` (excess streams are reset on arrival).
* **Admission** (only with ``swarm_key``; see ``peerinfer.net.admission``). Every new peer must
  prove it holds the swarm key before anything else: handlers (ping included) and the gossip
  layer wait for the verdict, our own ``open_stream``/``request``/``ping`` too, ``connect``
  returns only once the peer passed, and ``connected`` events and ``connected_peers()`` cover
  admitted peers only. A peer that fails is disconnected and the refusal logged once per peer.
* **Stream handlers** registered with ``set_handler`` run wrapped: an exception is logged, the
  stream reset, and the host carries on (in py-libp2p an exception escaping a handler crashes
  the host). A handler that returns normally has its stream closed for it.
* **Gossip** (``subscribe``/``publish``): see ``peerinfer.net.gossip``. Accepted messages go
  straight from libp2p's push path into per-subscriber channels of ``subscription_buffer``
  slots (full: dropped and counted in ``statistics()``), bypassing libp2p's 32-slot queue.
  Our own ``publish`` is paced by a token bucket per topic and waits (briefly) for libp2p's
  32-RPC per-peer outbound queues to drain, rather than letting libp2p drop silently.
* **Streams that cost less.** ``open_stream(..., lazy=True)`` (and ``request``) negotiate the
  protocol along with the first frame instead of two round trips before it
  (``peerinfer.net.framing``). ``keep_idle_stream``/``take_idle_stream`` keep a stream whose
  exchange ended cleanly for the next exchange with the same peer and protocol (the node's
  forwards; at most ``MAX_IDLE_STREAMS_PER_PEER`` per peer and protocol, ``MAX_IDLE_STREAMS``
  in all, for ``IDLE_STREAM_TTL_S``, or ``SPARE_STREAM_TTL_S`` for a spare opened ahead of
  its first exchange; only for a peer still connected, admitted and not banned; dropped when it
  disconnects). ``connect`` returns once the connection is open rather than
  after py-libp2p's 250 ms happy-eyeballs head start (``_dial``).
* **Liveness.** ``ping(peer)`` measures one round trip on ``/peerinfer/ping/1.0.0``. Every
  ``liveness_interval_s`` the host pings all connected peers; after ``liveness_max_failures``
  consecutive failures the peer is disconnected and an ``unresponsive`` event emitted (a
  SIGSTOPped peer otherwise stays "connected", in the mesh, for minutes). A peer whose ping
  failed is probed with a fresh connection, which replaces the stalled ones; a new connection
  to a peer that holds others has each older one pinged over itself, and a silent one is
  replaced too (``replace_stalled_connections``; docs/reach.md, "Healing").
* **Discovery.** One task per bootstrap address keeps it connected, redialing with capped
  exponential backoff forever (libp2p's own bootstrap gives up after 3 failures). mDNS
  discoveries are dialed (libp2p's mDNS only fills the peerstore). ``add_known_peer`` +
  ``dial`` serve peer exchange.
* **Events.** ``peer_events()`` gives a channel of ``PeerEvent``: ``connected`` and
  ``disconnected`` (first connection opened / last one closed), ``discovered`` (mDNS, bootstrap
  config, ``add_known_peer``), ``unresponsive`` (liveness), ``misbehaved`` (protocol violation;
  the peer is disconnected). The node keeps its own reputation from these: libp2p's peer scores
  are wiped on disconnect.

Every libp2p failure reaching the caller is translated in ``peerinfer.net._errors``.

Deadlines: every stream open, frame read and frame write runs under ``trio.fail_after``
(default ``stream_timeout_s``); ``connect``/``dial`` under ``connect_timeout_s``. Stream opening
and dialing run in a helper task the caller stops waiting for at the deadline (``_within``),
because py-libp2p cleans up a cancelled ``new_stream`` inside ``CancelScope(shield=True)`` and,
on a hung peer, that cleanup waits forever behind a write stuck on the full socket.
``disconnect`` and shutdown close such sockets underneath libp2p after a short grace period, so
they are bounded too (about 1-2 s with a hung peer).

Concurrency: all methods are called from the trio thread; any number of tasks may use the host
at once (one sender and one receiver per ``FramedStream``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import random
import secrets
import socket
from collections import OrderedDict, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, IMuxedConn, INetConn, INetStream, INetwork, INotifee
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.protocol_muxer.exceptions import MultiselectCommunicatorError, MultiselectError
from libp2p.protocol_muxer.multiselect import (
    DEFAULT_NEGOTIATE_TIMEOUT,
    PROTOCOL_NOT_FOUND_MSG,
    Multiselect,
)
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.rpc_queue import OutBoundQueueSize
from libp2p.rcmgr import ResourceLimits, ResourceManager
from libp2p.rcmgr.connection_limits import ConnectionLimits
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

from peerinfer.errors import (
    ClosedError,
    ConfigError,
    InvalidRequestError,
    PeerUnavailableError,
    ProtocolError,
    RemoteError,
    RequestTimeoutError,
)
from peerinfer.net import muxer
from peerinfer.net._errors import translated
from peerinfer.net.admission import (
    ADMIT_PROTOCOL,
    NONCE_BYTES,
    PROOF_BYTES,
    admission_key,
    check_proof,
    new_nonce,
    proof,
)
from peerinfer.net.config import HostConfig, own_publish_rate
from peerinfer.net.discovery import MdnsBridge, expand_unspecified, local_ipv4s
from peerinfer.net.framing import FramedStream, peer_id_text
from peerinfer.net.gossip import (
    GossipMessage,
    GuardedPubsub,
    Validator,
    gossip_message_from_pb,
    make_router,
    wrap_validator,
)
from peerinfer.net.identity import load_or_create_identity, new_identity, peer_id_of
from peerinfer.net.pacing import Backoff, TokenBucket

logger = logging.getLogger(__name__)

#: Our liveness protocol: the dialer sends one frame of up to 64 bytes, the listener echoes it.
PING_PROTOCOL = "/peerinfer/ping/1.0.0"
PING_MAX_BYTES = 64
#: How long addresses learned from config, mDNS or peer exchange stay in the peerstore.
KNOWN_ADDR_TTL_S = 3600
#: Addresses kept from one ``add_known_peer`` call (a peer could send thousands).
MAX_KNOWN_ADDRS_PER_PEER = 8
#: Buffer of each ``peer_events()`` channel; a full one drops events (counted).
PEER_EVENT_BUFFER = 256
#: Bound on one attempt to close a peer's connections politely (see ``Host.disconnect``).
DISCONNECT_TIMEOUT_S = 1.0
#: Before publishing, wait (at most OUTBOUND_DRAIN_WAIT_S) until every peer's libp2p outbound
#: queue is below this many RPCs (of OutBoundQueueSize = 32; a full queue drops silently).
OUTBOUND_HIGH_WATER = OutBoundQueueSize // 2
OUTBOUND_DRAIN_WAIT_S = 0.25
#: On shutdown, how long connections may take to close politely before their sockets are
#: closed under them.
SHUTDOWN_GRACE_S = 1.0
#: Peers we remember relayed (circuit) addresses for; the oldest are forgotten beyond this.
MAX_CIRCUIT_PEERS = 1024
#: The direct dial tried before the relayed one, for a peer with a relayed address.
RELAYED_DIRECT_TRY_S = 2.0
#: Relayed connections a peer may hold beside its ``max_connections_per_peer`` direct ones: one
#: dialed by each end through the relay when both learn the other's relayed address at once.
#: Counted in libp2p's per-peer limit, they refused the hole-punched connection (measured on the
#: emulated internet: the cone pair stayed relayed, every later punch failing on the refused
#: connection's TIME_WAIT 4-tuple).
RELAYED_CONNECTIONS_PER_PEER = 2
#: Peers whose admission refusal was logged (once each); the oldest are forgotten beyond this.
MAX_REFUSALS_LOGGED = 4096
#: Streams kept for reuse (``keep_idle_stream``): per peer and protocol, in all, and for how
#: long (well below the idle timeout a serving node gives a stream waiting for its next request).
MAX_IDLE_STREAMS_PER_PEER = 2
MAX_IDLE_STREAMS = 64
IDLE_STREAM_TTL_S = 5.0
#: How long a spare stream waits for its first exchange (``keep_idle_stream(ttl_s=...)``: the
#: node opens one ahead of the next forward to a peer it reaches only through a relay). The
#: serving node waits for a stream's first request without a deadline, so a spare may wait
#: longer than a stream kept after an exchange.
SPARE_STREAM_TTL_S = 60.0
#: A peer whose liveness ping failed is probed with a fresh connection every PROBE_EVERY_S (each
#: try at most PROBE_TIMEOUT_S), while its pings keep failing and it is not yet disconnected, at
#: most MAX_PROBES peers at once: a new TCP flow goes out at once, where the stalled one waits
#: out its retransmission backoff (seen: 3-6 s after a cut link came back) and liveness would
#: then close it. Once the fresh one opens, the stalled ones are closed (``_connection_opened``).
PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 2.0
MAX_PROBES = 16

T = TypeVar("T")

PeerEventKind = Literal["connected", "disconnected", "discovered", "unresponsive", "misbehaved"]
StreamHandler = Callable[[FramedStream], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class PeerEvent:
    """Something happened to a peer (see the module docstring for each kind)."""

    kind: PeerEventKind
    peer_id: str
    #: For ``discovered``: the multiaddrs (without /p2p) it was found at.
    addrs: tuple[str, ...] = ()
    #: Human-readable reason, for logs (``misbehaved``, ``unresponsive``).
    detail: str = ""


@dataclass(frozen=True, slots=True)
class HostStatistics:
    """A snapshot of counters since the host started."""

    peer_id: str
    connected_peers: int
    handler_streams_running: int
    streams_refused: int
    handler_errors: int
    protocol_violations: int
    gossip_dropped: int
    peer_events_dropped: int
    dial_failures: int
    bootstrap_attempts: int
    unresponsive_disconnects: int
    #: peers refused by admission (wrong key, no key, silent), and streams of peers not (yet)
    #: admitted that were reset unserved
    admissions_refused: int = 0
    unadmitted_streams_refused: int = 0
    #: protocols (or protocol lists) asked for by peers not admitted, answered "na"
    unadmitted_protocols_refused: int = 0


@dataclass
class _Admission:
    """The admission verdict for one peer's current connections."""

    done: trio.Event = field(default_factory=trio.Event)
    ok: bool = False
    reason: str = ""
    started: bool = False


@dataclass
class _Counters:
    streams_refused: int = 0
    handler_errors: int = 0
    protocol_violations: int = 0
    gossip_dropped: int = 0
    peer_events_dropped: int = 0
    dial_failures: int = 0
    bootstrap_attempts: int = 0
    unresponsive_disconnects: int = 0
    admissions_refused: int = 0
    unadmitted_streams_refused: int = 0
    #: protocols (or protocol lists) asked for by peers not admitted, answered "na"
    unadmitted_protocols_refused: int = 0


@dataclass
class _Subscriber:
    channel: trio.MemorySendChannel[GossipMessage]
    include_own: bool


@dataclass
class _Topic:
    subscribers: list[_Subscriber] = field(default_factory=list)


def parse_peer_id(text: str, error: type[Exception] = InvalidRequestError) -> ID:
    """The libp2p ID for a base58 peer id; ``error`` if it is not one."""
    try:
        return ID.from_base58(text)
    except Exception as exc:
        raise error(f"not a peer id: {text!r}") from exc


def parse_peer_multiaddr(text: str, error: type[Exception] = ConfigError) -> PeerInfo:
    """A full ``/.../p2p/<id>`` multiaddr as libp2p PeerInfo; ``error`` if malformed."""
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(text))
    except Exception as exc:
        raise error(f"not a multiaddr ending in /p2p/<peer id>: {text!r}") from exc


def _parse_multiaddr(text: str, error: type[Exception]) -> multiaddr.Multiaddr:
    try:
        return multiaddr.Multiaddr(text)
    except Exception as exc:
        raise error(f"not a multiaddr: {text!r}") from exc


class _ConnectionNotifee(INotifee):
    """Feeds connection open/close into the host (inline in libp2p's notify path)."""

    def __init__(self, host: Host) -> None:
        self._host = host

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self._host._connection_opened(conn.muxed_conn.peer_id.to_base58(), conn)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._host._connection_closed(conn.muxed_conn.peer_id.to_base58(), conn)

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None


class _AdmissionGate(Multiselect):
    """py-libp2p's multistream-select listener, for a private swarm: a peer not admitted (yet)
    is offered only ``ADMIT_PROTOCOL``. Any other protocol it names waits for its verdict
    (``admission_timeout_s`` at most, like our handlers) and is then served if it was
    admitted, else answered "na" (or its connection is closed first), exactly as a protocol
    we do not speak; "ls" lists only the admission protocol to it (answered at once). So a stranger without the key learns neither our protocol names
    nor, through identify, our listen addresses. (It shares the host's multiselect's handlers
    dict: handlers set later are seen here.)"""

    def __init__(self, handlers: dict[Any, Any], host: Host) -> None:
        super().__init__(handlers)
        self._host = host

    async def negotiate(
        self, communicator: Any, negotiate_timeout: int = DEFAULT_NEGOTIATE_TIMEOUT
    ) -> tuple[Any, Any]:
        try:
            peer: str | None = peer_id_text(communicator.read_writer)
        except Exception:
            peer = None
        host = self._host
        if peer is not None and host.is_admitted(peer):
            return await super().negotiate(communicator, negotiate_timeout)
        try:
            with trio.fail_after(negotiate_timeout):
                await self.handshake(communicator)
                while True:
                    try:
                        command = await communicator.read()
                    except MultiselectCommunicatorError as error:
                        raise MultiselectError() from error
                    try:
                        if command == "ls":  # at once (a refusal closes the connection)
                            admitted = peer is not None and host.is_admitted(peer)
                            if not admitted:
                                host._counters.unadmitted_protocols_refused += 1
                            listed = ([p for p in self.handlers if p is not None] if admitted
                                      else [ADMIT_PROTOCOL])
                            await communicator.write("\n".join(listed) + "\n")
                            continue
                        admitted = command == ADMIT_PROTOCOL or (
                            peer is not None and await host._admitted_in_time(peer)
                        )
                        if admitted and command and TProtocol(command) in self.handlers:
                            await communicator.write(command)
                            return TProtocol(command), self.handlers[TProtocol(command)]
                        if not admitted:
                            host._counters.unadmitted_protocols_refused += 1
                        await communicator.write(PROTOCOL_NOT_FOUND_MSG)
                    except MultiselectCommunicatorError as error:
                        raise MultiselectError() from error
        except trio.TooSlowError:
            raise MultiselectError("handshake read timeout") from None


class Host:
    """A running peerinfer network host. Created only by ``open_host``."""

    def __init__(self, config: HostConfig, libp2p_host: IHost, key_pair: KeyPair) -> None:
        self._config = config
        self._h = libp2p_host
        network = libp2p_host.get_network()
        assert isinstance(network, Swarm)
        self._network: Swarm = network
        self._peer_id = peer_id_of(key_pair)
        self._counters = _Counters()
        self._rng = random.Random(secrets.randbits(64))
        self._nursery: trio.Nursery | None = None
        self._closed = False
        # Our own registry of live connections, from libp2p's notifications: under load the
        # swarm's table can lose a connection that is still open (a close_peer racing a new
        # dial pops the peer's entry wholesale), and then nothing could close it.
        self._connections: dict[str, set[INetConn]] = defaultdict(set)
        self._banned: set[str] = set()
        self._disconnect_events: dict[str, trio.Event] = {}
        #: set when a connection to the peer opens (see ``_dial``)
        self._connect_events: dict[str, trio.Event] = {}
        #: streams kept for reuse, per (peer, protocol), oldest first, with when they were kept
        self._idle_streams: OrderedDict[tuple[str, str], list[tuple[float, FramedStream]]] = OrderedDict()
        self._inflight: dict[str, int] = defaultdict(int)
        self._liveness_failures: dict[str, int] = defaultdict(int)
        #: peers being probed with a fresh connection (see PROBE_EVERY_S)
        self._probing: set[str] = set()
        #: when stalled connections of a peer were last replaced by a new one
        self._replaced_at: dict[str, float] = {}
        self._rtts: dict[str, float] = {}
        self._event_channels: list[trio.MemorySendChannel[PeerEvent]] = []
        self._topics: dict[str, _Topic] = {}
        self._buckets: dict[str, TokenBucket] = {}
        self._publish_rate = own_publish_rate(config.effective_gossip_rate_limit())
        self._admission_key = None if config.swarm_key is None else admission_key(config.swarm_key)
        # Reachability (peerinfer.net.reach): our relayed addresses, advertised with the others;
        # peers' circuit addresses (kept out of libp2p's peerstore: its TCP transport would dial
        # the relay's part of one and fail the handshake); the relayed dial, once set up.
        self._advertised: list[str] = []
        self._circuit_addrs: OrderedDict[str, list[str]] = OrderedDict()
        self.relay_dialer: Callable[[str, float], Awaitable[str]] | None = None
        self.reach_state: object | None = None
        self._admissions: dict[str, _Admission] = {}
        #: the last admission refusal of each peer (bounded), logged once per peer
        self._refusals_logged: OrderedDict[str, str] = OrderedDict()
        self._router = make_router(config)
        self._pubsub = GuardedPubsub(
            libp2p_host, self._router, config, self._on_violation, self._deliver,
            admitted=None if self._admission_key is None else self._pubsub_admitted,
        )
        self._mdns: MdnsBridge | None = None
        self._network.register_notifee(_ConnectionNotifee(self))
        self.set_handler(PING_PROTOCOL, self._serve_ping)
        if self._admission_key is not None:
            self.set_handler(ADMIT_PROTOCOL, self._serve_admit)
            # Before admission a stranger gets nothing from protocol negotiation but the
            # admission protocol: not our protocol names (multistream "ls"), not identify's
            # listen addresses and protocols (issue 21).
            mux = libp2p_host.get_mux()
            assert isinstance(mux, Multiselect)
            libp2p_host.multiselect = _AdmissionGate(mux.handlers, self)  # type: ignore[attr-defined]
            # Nor is our identify pushed to it (py-libp2p pushes to every connected peer when
            # a listen address appears): only to admitted peers.
            libp2p_host._push_identify_to_all_peers = self._push_identify_to_admitted  # type: ignore[attr-defined]

    # -- identity and addresses ---------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        """Our base58 peer id (``12D3KooW...``)."""
        return self._peer_id

    def listen_addrs(self) -> list[str]:
        """The addresses we are bound to, as full multiaddrs with ``/p2p/<our id>``.

        Exactly what the sockets are bound to: ``/ip4/0.0.0.0/...`` stays as is. Use
        ``dialable_addrs()`` for addresses another node can dial.
        """
        suffix = f"/p2p/{self._peer_id}"
        return [str(a) + suffix for a in self._h.get_transport_addrs()]

    def dialable_addrs(self) -> list[str]:
        """Addresses others can dial: unspecified binds expanded to 127.0.0.1 (same machine)
        and this machine's primary LAN address, each with ``/p2p/<our id>``; then our relayed
        addresses (circuit addresses through a relay), if a relay reservation holds one."""
        return [str(a) for a in self._h.get_addrs()] + list(self._advertised)

    def add_advertised_addr(self, addr: str) -> None:
        """Advertise ``addr`` (a relayed address of ours) in ``dialable_addrs``."""
        if addr not in self._advertised:
            self._advertised.append(addr)

    def remove_advertised_addr(self, addr: str) -> None:
        if addr in self._advertised:
            self._advertised.remove(addr)

    def circuit_addrs(self, peer_id: str) -> list[str]:
        """The relayed addresses we know for ``peer_id`` (with ``/p2p/<peer id>``)."""
        return list(self._circuit_addrs.get(peer_id, ()))

    def known_addrs(self, peer_id: str) -> list[str]:
        """What the peerstore knows about how to reach ``peer_id`` (without /p2p), for peer
        exchange. Empty if nothing is known."""
        pid = parse_peer_id(peer_id)
        try:
            direct = [str(a) for a in self._h.get_peerstore().addrs(pid)]
        except Exception:  # PeerStoreError: unknown peer
            direct = []
        return direct + self.circuit_addrs(peer_id)

    # -- connections --------------------------------------------------------------------------

    async def connect(self, maddr: str, *, timeout: float | None = None) -> str:
        """Connect to ``/.../p2p/<id>`` (no-op if connected); return the verified peer id.

        Raises ``ConfigError`` for a malformed address, ``PeerUnavailableError`` if the peer
        cannot be reached or is not who the address says (Noise checks the id),
        ``RequestTimeoutError`` after ``timeout`` (default ``connect_timeout_s``).
        """
        info = parse_peer_multiaddr(maddr, ConfigError)
        return await self._connect_info(info, timeout)

    def add_known_peer(self, peer_id: str, addrs: Sequence[str]) -> None:
        """Remember addresses (without ``/p2p``; a trailing one is tolerated) for a peer learned
        from another node; at most ``MAX_KNOWN_ADDRS_PER_PEER`` per call are kept. Raises
        ``ProtocolError`` for a malformed id or address (it came from a peer). Emits a
        ``discovered`` event if an address is new; does not dial (use ``dial``)."""
        pid = parse_peer_id(peer_id, ProtocolError)
        if peer_id == self._peer_id:
            return
        parsed = [_parse_multiaddr(a, ProtocolError) for a in addrs]
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
        self._h.get_peerstore().add_addrs(pid, cleaned, KNOWN_ADDR_TTL_S)
        if any(str(a) not in already for a in cleaned):
            self._emit(PeerEvent("discovered", peer_id, tuple(str(a) for a in cleaned)))

    async def dial(self, peer_id: str, *, timeout: float | None = None) -> None:
        """Connect to a peer whose addresses we know (``add_known_peer``, mDNS, identify)."""
        pid = parse_peer_id(peer_id)
        await self._connect_info(PeerInfo(pid, []), timeout)

    async def _connect_info(self, info: PeerInfo, timeout: float | None) -> str:
        self._check_open()
        peer = info.peer_id.to_base58()
        if peer == self._peer_id:
            raise InvalidRequestError("cannot connect to ourselves")
        deadline = self._config.connect_timeout_s if timeout is None else timeout
        # The swarm blocks a peer for 60 s after a failed dial; our callers pace themselves.
        self._network.unblock_peer(info.peer_id)
        # libp2p's connect() returns at once if the swarm lists any connection to the peer,
        # even a closed one; drop those first so that it dials.
        listed = self._network.connections.get(info.peer_id)
        if listed:
            listed[:] = [conn for conn in listed if not conn.is_closed]
            if not listed:
                del self._network.connections[info.peer_id]
        started = trio.current_time()
        try:
            await self._connect_direct_or_relayed(info, deadline)
            if not self.is_connected(peer):
                if self._admission_key is not None:
                    reason = self._refusals_logged.get(peer) or "closed by the peer"
                    raise PeerUnavailableError(f"connect: {peer} refused by swarm admission: {reason}")
                raise PeerUnavailableError(
                    f"connect: the connection to {peer} closed at once (a node of a private "
                    "swarm closes it like this: it needs the swarm key)"
                )
            if self._admission_key is not None:
                left = max(0.0, deadline - (trio.current_time() - started))
                await self._require_admitted(peer, left)
        except RemoteError:
            self._counters.dial_failures += 1
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
            if self.is_connected(peer):
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
            if self.is_connected(peer):
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
        runs on in ``_within``'s helper task and ends by itself; we stop waiting for it once
        the connection is registered (our notifee saw it open).
        """
        peer = info.peer_id.to_base58()
        opened = self._connect_events.setdefault(peer, trio.Event())
        try:
            await self._within("connect", peer, deadline, lambda: self._h.connect(info), done_when=opened)
        finally:
            if not opened.is_set() and self._connect_events.get(peer) is opened:
                del self._connect_events[peer]  # bounded: only dials under way keep one

    # -- admission ----------------------------------------------------------------------------

    def is_admitted(self, peer_id: str) -> bool:
        """Whether ``peer_id`` passed admission on its current connections (always True for an
        open swarm, i.e. without ``swarm_key``, once connected)."""
        if self._admission_key is None:
            return self.is_connected(peer_id)
        adm = self._admissions.get(peer_id)
        return adm is not None and adm.done.is_set() and adm.ok

    async def _wait_admitted(self, peer_id: str, timeout: float | None = None) -> _Admission | None:
        """The peer's verdict once known (None: no connection, so no admission under way)."""
        adm = self._admissions.get(peer_id)
        if adm is None:
            return None
        limit = self._config.admission_timeout_s if timeout is None else timeout
        with trio.move_on_after(limit):
            await adm.done.wait()
        return adm

    async def _require_admitted(self, peer_id: str, timeout: float) -> None:
        adm = await self._wait_admitted(peer_id, timeout)
        if adm is None or not adm.done.is_set():
            reason = "no connection" if adm is None else f"admission not done within {timeout:.1f} s"
            raise PeerUnavailableError(f"{peer_id} is not admitted to this swarm: {reason}")
        if not adm.ok:
            raise PeerUnavailableError(f"{peer_id} refused by swarm admission: {adm.reason}")

    async def _push_identify_to_admitted(self) -> None:
        from libp2p.identity.identify_push.identify_push import push_identify_to_peers

        admitted = {p for p in self._h.get_connected_peers() if self.is_admitted(p.to_base58())}
        if admitted:
            with contextlib.suppress(Exception):  # best effort, as py-libp2p's own push
                await push_identify_to_peers(self._h, admitted)

    async def _admitted_in_time(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is admitted, waiting for its verdict if it is under way."""
        adm = await self._wait_admitted(peer_id)
        return adm is not None and adm.done.is_set() and adm.ok

    async def _pubsub_admitted(self, pid: ID) -> bool:
        adm = await self._wait_admitted(pid.to_base58())
        return adm is not None and adm.ok

    def _begin_admission(self, peer_id: str) -> None:
        adm = self._admissions.get(peer_id)
        if adm is None or (adm.done.is_set() and not adm.ok):
            adm = self._admissions[peer_id] = _Admission()
        if not adm.started and self._nursery is not None and not self._closed:
            adm.started = True
            self._nursery.start_soon(self._admit, peer_id, adm)

    async def _admit(self, peer_id: str, adm: _Admission) -> None:
        """Challenge ``peer_id``; admit it, or refuse and disconnect it."""
        try:
            ok, reason = await self._challenge(peer_id)
        except ClosedError:
            ok, reason = False, "the host is closing"
        adm.ok, adm.reason = ok, reason
        adm.done.set()
        if ok:
            self._emit(PeerEvent("connected", peer_id))
            return
        self._counters.admissions_refused += 1
        if peer_id not in self._refusals_logged:
            logger.warning("refusing peer %s: %s", peer_id, reason)
        self._refusals_logged[peer_id] = reason
        if len(self._refusals_logged) > MAX_REFUSALS_LOGGED:
            self._refusals_logged.popitem(last=False)
        if not self._closed:
            await self.disconnect(peer_id)

    async def _challenge(self, peer_id: str) -> tuple[bool, str]:
        key = self._admission_key
        assert key is not None
        timeout = self._config.admission_timeout_s
        deadline = trio.current_time() + timeout
        pid = parse_peer_id(peer_id)
        while True:
            left = deadline - trio.current_time()
            if left <= 0:
                return False, f"no admission answer within {timeout:.1f} s"
            try:
                net_stream = await self._within(
                    "admission", peer_id, left,
                    lambda: self._h.new_stream(pid, [TProtocol(ADMIT_PROTOCOL)]),
                    discard=_reset_stream,
                )
                break
            except RequestTimeoutError:
                return False, f"no admission answer within {timeout:.1f} s"
            except PeerUnavailableError as exc:
                if "refused the protocol" in str(exc):
                    return False, "it does not speak swarm admission (no swarm key: an open-swarm node?)"
                if not self.is_connected(peer_id):
                    return False, f"the connection closed during admission ({exc})"
                # The connected notification can precede the muxer's readiness: try again.
                await trio.sleep(0.02)
        stream = FramedStream(net_stream, max_frame_bytes=PROOF_BYTES + 16, timeout_s=timeout)
        async with stream:
            nonce = new_nonce()
            try:
                await stream.send(nonce, timeout=max(0.01, deadline - trio.current_time()))
                answer = await stream.receive(
                    timeout=max(0.01, deadline - trio.current_time()), max_bytes=PROOF_BYTES
                )
            except RequestTimeoutError:
                return False, f"no admission answer within {timeout:.1f} s"
            except (RemoteError, trio.EndOfChannel) as exc:
                return False, f"the admission exchange failed ({type(exc).__name__}: {exc})"
        if not check_proof(key, self._peer_id, peer_id, nonce, answer):
            return False, "wrong admission proof: it does not hold this swarm's key"
        return True, ""

    async def _serve_admit(self, stream: FramedStream) -> None:
        """Answer a peer's challenge (to anyone: the proof is useless for any other exchange)."""
        key = self._admission_key
        assert key is not None
        nonce = await stream.receive(max_bytes=NONCE_BYTES)
        if len(nonce) != NONCE_BYTES:
            raise ProtocolError(f"admission nonce of {len(nonce)} bytes, expected {NONCE_BYTES}")
        await stream.send(proof(key, stream.remote_peer, self._peer_id, nonce))

    async def _within(
        self,
        operation: str,
        peer: str | None,
        deadline: float,
        call: Callable[[], Awaitable[T]],
        discard: Callable[[T], Awaitable[None]] | None = None,
        done_when: trio.Event | None = None,
    ) -> T:
        """``await call()``, giving up at ``deadline`` even if libp2p's cleanup is shielded.

        py-libp2p runs some cleanups under ``CancelScope(shield=True)``: a cancelled
        ``new_stream`` resets its half-open stream shielded, and on a hung peer that reset waits
        for the muxer's write lock forever (held by a write stuck on the full socket), so a
        ``fail_after`` around the call never fires. The call therefore runs in its own task; at
        the deadline we stop waiting and leave it behind (it ends when the connection does, at
        the latest when ``disconnect`` or shutdown aborts the socket), and a result that comes
        too late is handed to ``discard``.

        ``done_when``: an event that, once set, ends the wait as if ``call`` had returned None
        (``call`` goes on in its task; what it returns or raises later is dropped).
        """
        send, receive = trio.open_memory_channel[tuple[bool, object]](1)

        async def worker() -> None:
            async with send:
                try:
                    result: tuple[bool, object] = (True, await call())
                except Exception as exc:
                    result = (False, exc)
                try:
                    send.send_nowait(result)
                except (trio.BrokenResourceError, trio.WouldBlock):  # gave up, or ended early
                    if result[0] and discard is not None:
                        await discard(result[1])  # type: ignore[arg-type]

        async def early(event: trio.Event, scope: trio.CancelScope) -> None:
            with scope:
                await event.wait()
                try:
                    send.send_nowait((True, None))
                except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

        nursery = self._nursery_or_closed()
        nursery.start_soon(worker)
        early_scope = trio.CancelScope()
        if done_when is not None:
            nursery.start_soon(early, done_when, early_scope)
        with translated(operation, peer, deadline):
            try:
                with trio.fail_after(deadline):
                    ok, value = await receive.receive()
            except trio.EndOfChannel:
                raise ClosedError(f"{operation}: the host is shutting down") from None
            except trio.TooSlowError:
                try:  # a result that arrived just as the deadline fired
                    late_ok, late = receive.receive_nowait()
                    if late_ok and discard is not None and self._nursery is not None:
                        self._nursery.start_soon(discard, late)
                except (trio.WouldBlock, trio.EndOfChannel):
                    pass
                raise
            finally:
                early_scope.cancel()
                receive.close()
            if not ok:
                assert isinstance(value, BaseException)
                raise value
        return value  # type: ignore[return-value]

    def connected_peers(self) -> list[str]:
        """Peers with at least one open connection (and, in a private swarm, admitted)."""
        peers = {pid.to_base58() for pid in self._h.get_connected_peers()} | set(self._connections)
        if self._admission_key is not None:
            return sorted(p for p in peers if self.is_admitted(p))
        return sorted(p for p in peers if self.is_connected(p))

    def is_connected(self, peer_id: str) -> bool:
        """Whether we hold at least one open connection to ``peer_id``."""
        return bool(self._live_connections(parse_peer_id(peer_id)))

    def only_relayed(self, peer_id: str) -> bool:
        """Whether we are connected to ``peer_id`` and only through relays (no direct path)."""
        live = self._live_connections(parse_peer_id(peer_id))
        return bool(live) and all(_is_relayed(c) for c in live)

    def _live_connections(self, pid: ID) -> list[INetConn]:
        known = set(self._network.get_connections(pid)) | self._connections.get(pid.to_base58(), set())
        return [conn for conn in known if not conn.is_closed]

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
        live = self._live_connections(pid)
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for conn in live:
                    nursery.start_soon(self._close_connection, peer_id, conn)
        self._forget_closed(peer_id)

    async def _close_connection(self, peer_id: str, conn: INetConn) -> None:
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
                await _abort_socket(conn)
                with trio.move_on_after(DISCONNECT_TIMEOUT_S):
                    await finished.wait()
            if not finished.is_set():
                nursery.cancel_scope.cancel()

    def ban(self, peer_id: str) -> None:
        """Refuse ``peer_id`` until ``unban``: disconnect it, ignore its gossip (and gossip it
        originated), and close its future connections as soon as they open. For the node's
        reputation policy; not persisted across restarts."""
        pid = parse_peer_id(peer_id)
        self._banned.add(peer_id)
        self._pubsub.add_to_blacklist(pid)
        self._drop_idle_streams(peer_id)
        if self.is_connected(peer_id):
            self._nursery_or_closed().start_soon(self.disconnect, peer_id)

    def unban(self, peer_id: str) -> None:
        self._banned.discard(peer_id)
        self._pubsub.remove_from_blacklist(parse_peer_id(peer_id))

    def banned_peers(self) -> list[str]:
        return sorted(self._banned)

    def _connection_opened(self, peer_id: str, conn: INetConn) -> None:
        older = [c for c in self._connections.get(peer_id, ()) if not c.is_closed]
        first = not older
        self._connections[peer_id].add(conn)
        replacing = bool(older) and self._config.replace_stalled_connections and peer_id not in self._banned
        running = self._nursery is not None and not self._closed
        if replacing and self._liveness_failures.get(peer_id, 0) > 0:
            # The older ones are stalled and go (so this one never counts as one too many).
            self._replace_stalled(peer_id, older)
        elif running:
            assert self._nursery is not None
            if not _is_relayed(conn):
                direct = [c for c in self._connections[peer_id] if not c.is_closed and not _is_relayed(c)]
                if len(direct) > self._config.max_connections_per_peer:
                    # libp2p's per-peer limit leaves room for relayed ones (RELAYED_CONNECTIONS_PER_PEER)
                    self._nursery.start_soon(self._close_connection, peer_id, conn)
            if replacing:
                self._nursery.start_soon(self._replace_silent, peer_id, older)
        opened = self._connect_events.pop(peer_id, None)
        if opened is not None:
            opened.set()
        if peer_id in self._banned:
            if self._nursery is not None and not self._closed:
                self._nursery.start_soon(self.disconnect, peer_id)
            return
        if self._admission_key is not None:
            # "connected" comes from _admit, once the peer has passed.
            if first or peer_id not in self._admissions:
                self._begin_admission(peer_id)
        elif first:
            self._emit(PeerEvent("connected", peer_id))

    def _replace_stalled(self, peer_id: str, older: list[INetConn], why: str = "its pings failed") -> None:
        """A new connection to a peer whose pings failed on the ones we had: those are
        stalled (a cut link, a partition, a NAT that lost its mapping), and libp2p would keep
        opening streams on them (it prefers a direct connection, then the one with the most
        streams: the stalled one, whose streams pile up), until liveness closed them all, the
        new one too. Close them now; the peer counts as newly connected."""
        self._liveness_failures.pop(peer_id, None)
        self._replaced_at[peer_id] = trio.current_time()
        self._rtts.pop(peer_id, None)
        self._drop_idle_streams(peer_id)
        logger.info("a new connection to %s replaces %d stalled one(s) (%s)", peer_id, len(older), why)
        # Out of libp2p's choice at once (closing a stalled one takes DISCONNECT_TIMEOUT_S, and
        # meanwhile a relay's circuit or a forward opened on it went down with it: seen).
        pid = parse_peer_id(peer_id)
        self._out_of_choice(pid, older)
        self._pubsub.renew_stream_off(pid, older)
        if self._nursery is not None and not self._closed:
            for stale in older:
                self._nursery.start_soon(self._close_connection, peer_id, stale)
        if self._admission_key is None or self.is_admitted(peer_id):
            self._emit(PeerEvent("connected", peer_id))

    async def _replace_silent(self, peer_id: str, older: list[INetConn]) -> None:
        """A new connection to a peer that holds others: ping each older one over itself, and
        replace those that do not answer within ``liveness_timeout_s`` (``_replace_stalled``).

        A peer restarted with the same identity, or one whose NAT lost the old flow, dials us
        anew while its old connection is still listed here, dead but never closed (no FIN
        came). Liveness pings need not notice: libp2p opens each ping on the connection it
        prefers, which can be the new one. Meanwhile our pubsub stream to the peer stays on the
        old connection (libp2p opens no second one), so the peer never gets our subscriptions
        and never gossips to us (a restart in tests/test_admission_nodes.py, whose old
        connections stay open: 1 of 6 runs of it failed so before this check).

        While an older connection is checked it is out of libp2p's choice for new streams, and
        back as soon as it answers: libp2p prefers the connection with the most streams, which
        a dead one, piling up streams that hang, always is (seen after a partition healed: for
        the 3 s of the check, a relayed peer's pings and pulls went to a circuit its other end
        had closed, and its digest waited)."""
        timeout = self._config.liveness_timeout_s
        silent: list[INetConn] = []
        pid = parse_peer_id(peer_id)
        listed = self._network.connections.get(pid, [])
        if any(c not in older and not c.is_closed for c in listed):  # never the last one
            self._out_of_choice(pid, older)

        async def check(conn: INetConn) -> None:
            if await self._answers_on(peer_id, conn, timeout):
                self._back_in_choice(pid, conn)
            else:
                silent.append(conn)

        async with trio.open_nursery() as nursery:
            for conn in older:
                nursery.start_soon(check, conn)
        silent = [c for c in silent if not c.is_closed]
        if silent and not self._closed and peer_id not in self._banned and self.is_connected(peer_id):
            live = [c for c in self._live_connections(pid) if c not in silent]
            if live:  # never the last: then it is the peer that is silent, liveness's business
                self._replace_stalled(peer_id, silent, "silent on a ping over it")
                return
        for conn in silent:
            self._back_in_choice(pid, conn)

    def _out_of_choice(self, pid: ID, conns: list[INetConn]) -> None:
        """Take ``conns`` out of the connections libp2p picks from for new streams (they stay
        open, and ours: ``_live_connections``)."""
        listed = self._network.connections.get(pid)
        if listed:
            listed[:] = [c for c in listed if c not in conns]

    def _back_in_choice(self, pid: ID, conn: INetConn) -> None:
        """Undo ``_out_of_choice`` for ``conn``, if it is still open."""
        listed = self._network.connections.get(pid)
        if not conn.is_closed and listed is not None and conn not in listed:
            listed.append(conn)

    async def _answers_on(self, peer_id: str, conn: INetConn, timeout: float) -> bool:
        """Whether ``peer_id`` echoes a ping on ``conn`` itself within ``timeout`` (``ping``
        lets libp2p pick the connection). One that closes meanwhile, or refuses, is not silent."""
        deadline = trio.current_time() + timeout

        def left() -> float:
            return max(0.01, deadline - trio.current_time())

        try:
            net_stream = await self._within("ping", peer_id, timeout, conn.new_stream, discard=_reset_stream)
            stream = FramedStream(
                net_stream, max_frame_bytes=PING_MAX_BYTES, timeout_s=timeout, negotiate=PING_PROTOCOL
            )
            async with stream:
                await _echo_nonce(stream, peer_id, left)
        except RequestTimeoutError:
            return conn.is_closed
        except (RemoteError, ClosedError, trio.EndOfChannel):
            pass
        except Exception as exc:  # libp2p's own, from a connection closing under the stream
            logger.debug("pinging %s on one connection: %r", peer_id, exc)
        return True

    def _connection_closed(self, peer_id: str, conn: INetConn) -> None:
        self._connections.get(peer_id, set()).discard(conn)
        self._forget_closed(peer_id)

    def _forget_closed(self, peer_id: str) -> None:
        """Drop closed connections of ``peer_id``; if none is left, it is disconnected."""
        known = self._connections.get(peer_id)
        if known is None:
            return
        known.difference_update([c for c in known if c.is_closed])
        if not known:
            del self._connections[peer_id]
            self._liveness_failures.pop(peer_id, None)
            self._replaced_at.pop(peer_id, None)
            self._rtts.pop(peer_id, None)
            self._admissions.pop(peer_id, None)
            self._drop_idle_streams(peer_id)
            event = self._disconnect_events.pop(peer_id, None)
            if event is not None:
                event.set()
            if peer_id not in self._banned:
                self._emit(PeerEvent("disconnected", peer_id))

    async def _wait_disconnected(self, peer_id: str) -> None:
        event = self._disconnect_events.setdefault(peer_id, trio.Event())
        if not self.is_connected(peer_id):
            self._disconnect_events.pop(peer_id, None)
            return
        await event.wait()

    # -- streams ------------------------------------------------------------------------------

    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        """Serve ``protocol`` with ``handler``; it gets a ``FramedStream`` per inbound stream.

        The handler may raise: the exception is logged (a ``RemoteError`` briefly, anything
        else with its traceback), the stream reset, the host unharmed. If it returns, the
        stream is closed. At most ``max_streams_per_peer`` handlers run per peer (all
        protocols together); streams beyond that are reset unanswered.
        """

        async def run(net_stream: INetStream) -> None:
            await self._run_handler(protocol, handler, net_stream)

        self._h.set_stream_handler(TProtocol(protocol), run)

    def remove_handler(self, protocol: str) -> None:
        self._h.remove_stream_handler(TProtocol(protocol))

    async def _run_handler(self, protocol: str, handler: StreamHandler, net_stream: INetStream) -> None:
        try:
            peer = peer_id_text(net_stream)
        except Exception:
            return  # no peer behind the stream (connection torn down meanwhile)
        stream = FramedStream(
            net_stream,
            max_frame_bytes=self._config.max_frame_bytes,
            timeout_s=self._config.stream_timeout_s,
        )
        if peer in self._banned:
            await stream.reset()
            return
        if self._admission_key is not None and protocol != ADMIT_PROTOCOL:
            adm = await self._wait_admitted(peer)
            if adm is None or not adm.ok:
                self._counters.unadmitted_streams_refused += 1
                await stream.reset()
                return
        if self._inflight[peer] >= self._config.max_streams_per_peer:
            self._counters.streams_refused += 1
            logger.info("refusing a %s stream from %s: %d already running", protocol, peer, self._inflight[peer])
            await stream.reset()
            return
        self._inflight[peer] += 1
        failed = True
        try:
            await handler(stream)
            failed = False
        except RemoteError as exc:
            self._counters.handler_errors += 1
            logger.info("%s handler for %s: %s", protocol, peer, exc)
        except Exception:
            self._counters.handler_errors += 1
            logger.exception("%s handler for %s raised; resetting the stream", protocol, peer)
        finally:
            self._inflight[peer] -= 1
            if self._inflight[peer] <= 0:
                del self._inflight[peer]
            if failed:
                await stream.reset()
            else:
                await stream.aclose()

    async def open_stream(
        self, peer_id: str, protocol: str, *, timeout: float | None = None, lazy: bool = False
    ) -> FramedStream:
        """Open a stream to ``peer_id`` speaking ``protocol`` (dialing known addresses if not
        connected). Raises ``PeerUnavailableError`` (unreachable, or protocol refused) or
        ``RequestTimeoutError`` after ``timeout`` (default ``stream_timeout_s``).

        ``lazy``: return as soon as the muxer has the stream, and negotiate ``protocol`` along
        with the first frame (``peerinfer.net.framing``): two round trips fewer, but a refused
        protocol is then reported by the first ``receive``, after our first frame went out.
        For protocols the peer is expected to speak (a node's own), where a refusal is as good
        as any other failure of the exchange."""
        self._check_open()
        pid = parse_peer_id(peer_id)
        deadline = self._config.stream_timeout_s if timeout is None else timeout
        if self._admission_key is not None:
            # Never a stream to a peer that has not proved membership; dial it first if needed.
            started = trio.current_time()
            if not self.is_connected(peer_id):
                await self._connect_info(PeerInfo(pid, []), deadline)
            else:
                await self._require_admitted(peer_id, deadline)
            deadline = max(0.01, deadline - (trio.current_time() - started))
        elif not self.is_connected(peer_id):
            # Connect our way first: libp2p's new_stream would dial the peerstore's direct
            # addresses only (never a relayed one: a peer behind a NAT is unreachable so), wait
            # out another dial of them in flight (10 s for a NAT that drops the SYN), or refuse
            # at once from its negative cache; a forward to a candidate we are not connected
            # to stalled so until the client gave up (the lost request of the relay-cut test).
            started = trio.current_time()
            await self._connect_info(PeerInfo(pid, []), min(deadline, self._config.connect_timeout_s))
            deadline = max(0.01, deadline - (trio.current_time() - started))
        net_stream = await self._within(
            "open_stream",
            peer_id,
            deadline,
            (lambda: self._network.new_stream(pid)) if lazy
            else (lambda: self._h.new_stream(pid, [TProtocol(protocol)])),
            discard=_reset_stream,
        )
        return FramedStream(
            net_stream,
            max_frame_bytes=self._config.max_frame_bytes,
            timeout_s=self._config.stream_timeout_s,
            negotiate=protocol if lazy else None,
        )

    def take_idle_stream(self, peer_id: str, protocol: str) -> FramedStream | None:
        """A stream to ``peer_id`` on ``protocol`` kept by ``keep_idle_stream`` and still
        usable as far as can be told without I/O, or None. Only for a peer still connected,
        admitted and not banned (the stream is bound to the connection it was opened on, so
        its ``remote_peer`` stays the authenticated one). The protocol must allow another
        exchange on the stream; the caller must be ready for the peer having let it go
        meanwhile (a reset or end of stream before any answer: open a new stream and repeat)."""
        key = (peer_id, protocol)
        kept = self._idle_streams.get(key)
        if not kept:
            return None
        if self._closed or peer_id in self._banned or not self.is_admitted(peer_id):
            self._drop_idle_streams(peer_id)
            return None
        now = trio.current_time()
        found: FramedStream | None = None
        while kept and found is None:
            # The soonest to expire first: a spare (longer-lived) stays for the forward after.
            expires_at, stream = kept.pop(0)
            if now < expires_at and stream.reusable:
                found = stream
            else:
                self._close_idle(stream)
        if not kept:
            del self._idle_streams[key]
        return found

    def has_idle_stream(self, peer_id: str, protocol: str) -> bool:
        """Whether a stream to ``peer_id`` on ``protocol`` is kept (it may have expired)."""
        return bool(self._idle_streams.get((peer_id, protocol)))

    def keep_idle_stream(self, stream: FramedStream, *, ttl_s: float = IDLE_STREAM_TTL_S) -> None:
        """Keep ``stream``, whose exchange ended cleanly (or a spare that has had none yet), for
        the next exchange with the same peer and protocol (``take_idle_stream``), for
        ``ttl_s``; bounded per peer and in all, beyond which the oldest are closed. A stream
        that cannot be reused is closed now."""
        peer, key = stream.remote_peer, (stream.remote_peer, stream.protocol)
        if self._closed or not stream.reusable or peer in self._banned or not self.is_admitted(peer):
            self._close_idle(stream)
            return
        now = trio.current_time()
        kept = self._idle_streams.setdefault(key, [])
        self._idle_streams.move_to_end(key)
        kept.append((now + ttl_s, stream))
        kept.sort(key=lambda k: k[0])  # the soonest to expire first: the first to go
        while len(kept) > MAX_IDLE_STREAMS_PER_PEER or (kept and now >= kept[0][0]):
            self._close_idle(kept.pop(0)[1])
        while sum(len(k) for k in self._idle_streams.values()) > MAX_IDLE_STREAMS:
            oldest_key = next(iter(self._idle_streams))
            oldest = self._idle_streams[oldest_key]
            self._close_idle(oldest.pop(0)[1])
            if not oldest:
                del self._idle_streams[oldest_key]

    def _drop_idle_streams(self, peer_id: str) -> None:
        for key in [k for k in self._idle_streams if k[0] == peer_id]:
            for _, stream in self._idle_streams.pop(key):
                self._close_idle(stream)

    def _close_idle(self, stream: FramedStream) -> None:
        if self._nursery is not None and not self._closed:
            self._nursery.start_soon(stream.aclose)

    async def request(
        self, peer_id: str, protocol: str, data: bytes, *, timeout: float | None = None
    ) -> bytes:
        """Open a stream, send one frame, half-close, return the one-frame reply, close.

        ``timeout`` bounds the whole exchange. A reset, an end of stream without a reply, or
        a refused protocol is a PeerUnavailableError. The stream is opened lazily (see
        ``open_stream``): the request travels with the protocol negotiation.
        """
        deadline = trio.current_time() + (self._config.stream_timeout_s if timeout is None else timeout)

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

    # -- liveness -----------------------------------------------------------------------------

    async def ping(self, peer_id: str, *, timeout: float | None = None) -> float:
        """Round-trip time to ``peer_id`` in seconds (one echo on a fresh stream; the stream
        opening is not counted). ``timeout`` bounds each try.

        A ping that fails because the connection it ran on was replaced meanwhile (a stalled
        one, ``_replace_stalled``) is asked once more, on the connection that replaced it:
        its failure says nothing of the peer. (Seen after a partition healed: a node's ping
        begun on the stalled connection failed a second after the fresh one replaced it, and
        the node dropped the peer it had just got back, for another round of pings.)"""
        total = self._config.stream_timeout_s if timeout is None else timeout
        started = trio.current_time()
        try:
            return await self._ping_once(peer_id, total)
        except RemoteError:
            if not self.replaced_since(peer_id, started) or not self.is_connected(peer_id):
                raise
        logger.debug("a ping to %s ran on a connection replaced meanwhile: asking again", peer_id)
        return await self._ping_once(peer_id, total)

    async def _ping_once(self, peer_id: str, total: float) -> float:
        deadline = trio.current_time() + total

        def left() -> float:
            return max(0.0, deadline - trio.current_time())

        stream = await self.open_stream(peer_id, PING_PROTOCOL, timeout=left())
        async with stream:
            rtt = await _echo_nonce(stream, peer_id, left)
        self._rtts[peer_id] = rtt
        return rtt

    def replaced_since(self, peer_id: str, since: float) -> bool:
        """Whether stalled connections to ``peer_id`` were replaced by a fresh one at or after
        ``since`` (``trio.current_time()``): an exchange begun before then that failed may
        have failed on one of them, not on the peer, and may be tried again."""
        return self._replaced_at.get(peer_id, float("-inf")) >= since

    def last_rtt(self, peer_id: str) -> float | None:
        """The last measured round trip to ``peer_id`` (seconds), if any."""
        return self._rtts.get(peer_id)

    async def _serve_ping(self, stream: FramedStream) -> None:
        async for frame in stream:
            if len(frame) > PING_MAX_BYTES:
                raise ProtocolError("ping frame too large")
            await stream.send(frame)

    async def _liveness_loop(self) -> None:
        interval = self._config.liveness_interval_s
        while True:
            await trio.sleep(interval)
            async with trio.open_nursery() as nursery:
                for peer in self.connected_peers():
                    nursery.start_soon(self._check_liveness, peer)

    async def _check_liveness(self, peer: str) -> None:
        started = trio.current_time()
        try:
            await self.ping(peer, timeout=self._config.liveness_timeout_s)
        except RemoteError as exc:
            if self.replaced_since(peer, started):
                return  # it failed on a stalled connection replaced meanwhile: not this one's
            self._liveness_failures[peer] += 1
            failures = self._liveness_failures[peer]
            logger.info("liveness ping to %s failed (%d): %s", peer, failures, exc)
            # Kept and spare streams likely ride the stalled connection: a forward taking one
            # would wait out its first-token deadline (seen: a spare kept through a cut link).
            self._drop_idle_streams(peer)
            self._start_probe(peer)
            if failures >= self._config.liveness_max_failures:
                self._liveness_failures.pop(peer, None)
                self._counters.unresponsive_disconnects += 1
                self._emit(PeerEvent("unresponsive", peer, detail=str(exc)))
                await self.disconnect(peer)
        except ClosedError:
            return
        else:
            self._liveness_failures.pop(peer, None)

    def _start_probe(self, peer: str) -> None:
        if peer in self._probing or len(self._probing) >= MAX_PROBES or self._nursery is None or self._closed:
            return
        self._probing.add(peer)
        self._nursery.start_soon(self._probe, peer)

    async def _probe(self, peer: str) -> None:
        """Fresh connections to ``peer`` (see PROBE_EVERY_S) until one opens, its pings
        answer again, or liveness disconnects it (redialing it is then the bootstrap loop's
        or the node's). Bounded: liveness ends a failing peer within a few rounds."""
        try:
            while not self._closed and self._liveness_failures.get(peer, 0) > 0 and self.is_connected(peer):
                if await self._fresh_connection(peer, PROBE_TIMEOUT_S):
                    return
                await trio.sleep(PROBE_EVERY_S)
        finally:
            self._probing.discard(peer)

    async def _fresh_connection(self, peer: str, timeout: float) -> bool:
        """Open one more connection to ``peer`` (libp2p's connect would return the stalled
        one): through a relay when we know a relayed address of it (its direct ones are then
        a NAT's, which drop the SYN), else to each known direct address. True once one opened."""
        circuits = [c for c in self.circuit_addrs(peer) if f"/p2p/{self._peer_id}/p2p-circuit" not in c]
        dialer = self.relay_dialer
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
            addrs = list(self._h.get_peerstore().addrs(pid))
        except Exception:  # PeerStoreError: nothing known
            return False
        for addr in addrs[:MAX_KNOWN_ADDRS_PER_PEER]:
            try:
                await self._within("probe", peer, timeout, lambda a=addr: self._network.dial_addr(a, pid))
                return True
            except (RemoteError, ClosedError) as exc:
                logger.debug("probing %s at %s: %s", peer, addr, exc)
        return False

    # -- gossip -------------------------------------------------------------------------------

    async def subscribe(
        self, topic: str, validator: Validator | None = None, *, include_own: bool = False
    ) -> trio.MemoryReceiveChannel[GossipMessage]:
        """Receive the messages of ``topic``; each call returns a new channel.

        ``validator`` (sync or async, see ``peerinfer.net.gossip``) applies to the topic, for
        every subscriber; a later one replaces an earlier one. ``include_own`` also delivers our
        own publications. Closing the channel ends that subscription (the topic stays joined;
        see ``unsubscribe``). If the channel is not drained, messages beyond
        ``subscription_buffer`` are dropped and counted.
        """
        self._check_open()
        self._check_topic(topic)
        if validator is not None:
            self._pubsub.set_topic_validator(topic, wrap_validator(topic, validator), True)
        state = self._topics.get(topic)
        if state is None:
            with translated("subscribe"):
                await self._pubsub.subscribe(topic)  # messages arrive through _deliver
            state = self._topics[topic] = _Topic()
        send, receive = trio.open_memory_channel[GossipMessage](self._config.subscription_buffer)
        state.subscribers.append(_Subscriber(send, include_own))
        return receive

    async def unsubscribe(self, topic: str) -> None:
        """Leave ``topic``: every subscriber's channel ends (``EndOfChannel``)."""
        state = self._topics.pop(topic, None)
        if state is None:
            return
        for subscriber in state.subscribers:
            subscriber.channel.close()
        self._pubsub.remove_topic_validator(topic)
        with translated("unsubscribe"):
            await self._pubsub.unsubscribe(topic)

    def _deliver(self, topic: str, raw: rpc_pb2.Message) -> None:
        """Called by GuardedPubsub, synchronously, for each accepted message of a joined topic."""
        state = self._topics.get(topic)
        if state is None:
            return
        message = gossip_message_from_pb(topic, raw)
        own = message.sender == self._peer_id
        for subscriber in list(state.subscribers):
            if own and not subscriber.include_own:
                continue
            try:
                subscriber.channel.send_nowait(message)
            except trio.WouldBlock:
                self._counters.gossip_dropped += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                state.subscribers.remove(subscriber)

    async def publish(self, topic: str, data: bytes, *, timeout: float | None = None) -> None:
        """Sign and publish ``data`` on ``topic``.

        Paced per topic (a quarter of the gossip rate limit, see ``peerinfer.net.config``):
        waits for the pacer rather than letting libp2p drop. Raises ``InvalidRequestError`` for
        data above ``gossip_max_message_bytes``, ``RequestTimeoutError`` if the pacer does not
        admit it within ``timeout`` (default ``stream_timeout_s``).
        """
        self._check_open()
        self._check_topic(topic)
        if len(data) > self._config.gossip_max_message_bytes:
            raise InvalidRequestError(
                f"gossip message of {len(data)} bytes exceeds {self._config.gossip_max_message_bytes}"
            )
        bucket = self._buckets.get(topic)
        if bucket is None:
            bucket = self._buckets[topic] = TokenBucket(self._publish_rate, self._publish_rate)
        deadline = self._config.stream_timeout_s if timeout is None else timeout
        with translated("publish", None, deadline), trio.fail_after(deadline):
            while not bucket.take(trio.current_time()):
                await trio.sleep(bucket.delay(trio.current_time()))
            await self._wait_for_outbound_room()
            await self._pubsub.publish(topic, bytes(data))

    async def _wait_for_outbound_room(self) -> None:
        """Let libp2p's per-peer outbound queues (32 RPCs, full: dropped) drain below half.

        Bounded: a hung peer's queue never drains, and must not stall publishing to others.
        """
        with trio.move_on_after(OUTBOUND_DRAIN_WAIT_S):
            while any(len(q) >= OUTBOUND_HIGH_WATER for q in self._pubsub.peer_queues.values()):
                await trio.sleep(0.001)
        await trio.lowlevel.checkpoint()

    def gossip_peers(self, topic: str) -> list[str]:
        """Connected peers known to be subscribed to ``topic``."""
        return [pid.to_base58() for pid in self._pubsub.peer_topics.get(topic, ())]

    def mesh_peers(self, topic: str) -> list[str]:
        """Peers in our gossipsub mesh for ``topic`` (they get our messages first-hand)."""
        return [pid.to_base58() for pid in self._router.mesh.get(topic, ())]

    def _check_topic(self, topic: str) -> None:
        if not topic:
            raise InvalidRequestError("empty topic")
        allowed = self._config.gossip_topics
        if allowed is not None and topic not in allowed:
            raise ConfigError(f"topic {topic!r} is not in the configured gossip_topics")

    def _on_violation(self, peer_id: str, reason: str) -> None:
        self._counters.protocol_violations += 1
        self._emit(PeerEvent("misbehaved", peer_id, detail=reason))
        if self._nursery is not None and not self._closed:
            self._nursery.start_soon(self.disconnect, peer_id)

    # -- events and statistics ----------------------------------------------------------------

    def peer_events(self, buffer: int = PEER_EVENT_BUFFER) -> trio.MemoryReceiveChannel[PeerEvent]:
        """A new channel receiving every later ``PeerEvent``; close it when done. If it is not
        drained, events beyond ``buffer`` are dropped (counted in ``statistics()``).

        Discovery (bootstrap, mDNS) starts only at the first checkpoint of the ``open_host``
        body, so a channel opened before the body's first ``await`` misses no event."""
        send, receive = trio.open_memory_channel[PeerEvent](buffer)
        self._event_channels.append(send)
        return receive

    def _emit(self, event: PeerEvent) -> None:
        for channel in list(self._event_channels):
            try:
                channel.send_nowait(event)
            except trio.WouldBlock:
                self._counters.peer_events_dropped += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._event_channels.remove(channel)

    def statistics(self) -> HostStatistics:
        c = self._counters
        return HostStatistics(
            peer_id=self._peer_id,
            connected_peers=len(self.connected_peers()),
            handler_streams_running=sum(self._inflight.values()),
            streams_refused=c.streams_refused,
            handler_errors=c.handler_errors,
            protocol_violations=c.protocol_violations,
            gossip_dropped=c.gossip_dropped,
            peer_events_dropped=c.peer_events_dropped,
            dial_failures=c.dial_failures,
            bootstrap_attempts=c.bootstrap_attempts,
            unresponsive_disconnects=c.unresponsive_disconnects,
            admissions_refused=c.admissions_refused,
            unadmitted_streams_refused=c.unadmitted_streams_refused,
            unadmitted_protocols_refused=c.unadmitted_protocols_refused,
        )

    # -- discovery ----------------------------------------------------------------------------

    async def _keep_connected(self, info: PeerInfo) -> None:
        """Bootstrap: stay connected to one peer forever, redialing with backoff."""
        peer = info.peer_id.to_base58()
        self._h.get_peerstore().add_addrs(info.peer_id, info.addrs, KNOWN_ADDR_TTL_S)
        self._emit(PeerEvent("discovered", peer, tuple(str(a) for a in info.addrs)))
        backoff = Backoff(self._config.bootstrap_backoff_min_s, self._config.bootstrap_backoff_max_s)
        while True:
            if self.is_connected(peer):
                backoff.reset()
                await self._wait_disconnected(peer)
                continue
            self._counters.bootstrap_attempts += 1
            try:
                await self._connect_info(info, None)
                logger.debug("bootstrap peer %s connected", peer)
                backoff.reset()
            except RemoteError as exc:
                delay = backoff.next_delay(self._rng)
                logger.info("bootstrap peer %s unreachable (%s); retrying in %.1f s", peer, exc, delay)
                await trio.sleep(delay)

    def _on_discovered(self, peer_id: str, addrs: tuple[str, ...]) -> None:
        """An mDNS discovery (trio thread): remember, announce, dial in the background."""
        if self._closed or self._nursery is None or peer_id == self._peer_id:
            return
        try:
            self.add_known_peer(peer_id, addrs)
        except ProtocolError as exc:
            logger.info("ignoring a malformed mDNS record for %s: %s", peer_id, exc)
            return
        if not self.is_connected(peer_id):
            self._nursery.start_soon(self._dial_quietly, peer_id)

    async def _dial_quietly(self, peer_id: str) -> None:
        try:
            await self.dial(peer_id)
        except (RemoteError, ClosedError) as exc:
            logger.info("could not connect to discovered peer %s: %s", peer_id, exc)

    # -- lifecycle ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the host is closed")

    def _nursery_or_closed(self) -> trio.Nursery:
        if self._nursery is None or self._closed:
            raise ClosedError("the host is closed")
        return self._nursery

    def _start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        # Connections that arrived while libp2p was starting, before we had a nursery.
        for peer_id, adm in list(self._admissions.items()):
            if not adm.started:
                self._begin_admission(peer_id)

    def _start_discovery(self, bootstrap: Sequence[PeerInfo]) -> None:
        nursery = self._nursery_or_closed()
        for info in bootstrap:
            nursery.start_soon(self._keep_connected, info)
        if self._config.liveness_interval_s > 0:
            nursery.start_soon(self._liveness_loop)
        if self._config.mdns:
            self._mdns = MdnsBridge(self._network, self._peer_id, self._on_discovered)
            bare = [multiaddr.Multiaddr(a.rsplit("/p2p/", 1)[0]) for a in self.dialable_addrs()]
            nursery.start_soon(self._mdns.start, bare)

    async def _reap_connections_after(self, grace_s: float) -> None:
        """Shutdown helper: once ``grace_s`` has passed, keep aborting the sockets of whatever
        connections are left, until the shutdown completes (and cancels us)."""
        await trio.sleep(grace_s)
        while True:
            for connections in list(self._network.connections.values()):
                for conn in list(connections):
                    await _abort_socket(conn)
            await trio.sleep(0.5)

    async def _stop(self) -> None:
        self._closed = True
        if self._mdns is not None:
            await self._mdns.stop()
        for channel in self._event_channels:
            channel.close()
        self._event_channels.clear()


def _build_libp2p_host(config: HostConfig, key_pair: KeyPair, listen: list[multiaddr.Multiaddr]) -> IHost:
    muxer.install()  # yamux window credit without a frame per read (peerinfer.net.muxer)
    per_peer = config.max_connections_per_peer + RELAYED_CONNECTIONS_PER_PEER
    connection_config = ConnectionConfig(
        max_connections=config.max_connections,
        min_connections=0,
        low_watermark=0,  # no auto-connector: dialing policy is ours
        high_watermark=config.max_connections,
        max_connections_per_peer=per_peer,
        dial_timeout=config.connect_timeout_s,
        inbound_upgrade_timeout=config.connect_timeout_s,
        outbound_upgrade_timeout=config.connect_timeout_s,
        outbound_stream_protocol_negotiation_timeout=config.stream_timeout_s,
        inbound_stream_protocol_negotiation_timeout=config.stream_timeout_s,
    )
    resource_manager = ResourceManager(
        limits=ResourceLimits(
            max_connections=config.max_connections + config.max_pending_connections,
            max_streams=config.max_connections * (config.max_streams_per_peer + 8),
        ),
        connection_limits=ConnectionLimits(
            max_pending_inbound=config.max_pending_connections,
            max_pending_outbound=config.max_pending_connections,
            max_established_inbound=config.max_connections,
            max_established_outbound=config.max_connections,
            max_established_per_peer=per_peer,
            max_established_total=config.max_connections,
        ),
        enable_memory_limits=False,
        enable_circuit_breaker=False,
        enable_graceful_degradation=False,
    )
    ipv4s = local_ipv4s()
    noise = NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        listen_addrs=listen,
        enable_mDNS=False,
        bootstrap=None,
        negotiate_timeout=max(1, int(config.stream_timeout_s)),
        resource_manager=resource_manager,
        connection_config=connection_config,
        addrs_factory=lambda candidates: expand_unspecified(candidates, ipv4s),
    )
    network = host.get_network()
    if isinstance(network, Swarm):
        network.retry_config = RetryConfig(max_retries=0)  # one attempt per dial; we pace retries
        # The auto-connector dials peerstore entries until half of high_watermark is connected,
        # whatever low_watermark says; it would redial peers we just dropped for misbehaving.
        network.auto_connector.maybe_connect = _no_auto_connect  # type: ignore[method-assign]
    return host


async def _echo_nonce(stream: FramedStream, peer_id: str, left: Callable[[], float]) -> float:
    """One ping exchange on ``stream``: a random nonce out, the same bytes back, each step
    within ``left()`` seconds; returns the round trip."""
    nonce = secrets.token_bytes(8)
    started = trio.current_time()
    await stream.send(nonce, timeout=left())
    try:
        echo = await stream.receive(timeout=left(), max_bytes=PING_MAX_BYTES)
    except trio.EndOfChannel:
        # A remote failure like any other: escaping as EndOfChannel it ended the node that
        # pinged (its ping and liveness tasks catch peerinfer's errors only).
        raise PeerUnavailableError(f"{peer_id} ended a ping stream without answering") from None
    rtt = trio.current_time() - started
    if echo != nonce:
        raise ProtocolError(f"{peer_id} answered a ping with the wrong bytes")
    return rtt


def _is_relayed(conn: INetConn | IMuxedConn) -> bool:
    """Whether ``conn`` runs through a relay (a circuit v2 connection)."""
    try:
        addrs = conn.get_transport_addresses()
    except Exception:
        return False
    return any("/p2p-circuit" in str(a) for a in addrs)


def stream_is_relayed(stream: FramedStream) -> bool:
    """Whether ``stream`` runs over a relayed connection (its remote address is then the
    relay's, not the peer's)."""
    return _is_relayed(stream._stream.muxed_conn)


async def _no_auto_connect() -> None:
    return None


async def _reset_stream(net_stream: INetStream) -> None:
    """Reset a stream nobody waits for any more (bounded: the connection may be hung)."""
    with trio.move_on_after(1.0):
        try:
            await net_stream.reset()
        except Exception:
            pass


async def _abort_socket(conn: INetConn) -> None:
    """Close the TCP socket under a connection's muxer and security layers (no lock taken)."""
    secured = getattr(getattr(conn, "muxed_conn", None), "secured_conn", None)
    if secured is None:
        return
    with trio.move_on_after(1.0) as scope:
        scope.shield = True
        try:
            await secured.close()
        except Exception as exc:
            logger.debug("aborting a connection: %r", exc)


@asynccontextmanager
async def open_host(config: HostConfig) -> AsyncIterator[Host]:
    """Start a host; on exit stop everything it started (connections, tasks, mDNS).

    Raises ``ConfigError`` for an invalid config, an unreadable identity key or an address we
    cannot listen on.
    """
    config.check()
    listen = [_parse_multiaddr(a, ConfigError) for a in config.listen]
    _check_ports_free(listen)
    bootstrap = [parse_peer_multiaddr(a, ConfigError) for a in config.bootstrap]
    key_pair = (
        load_or_create_identity(config.effective_identity_path())
        if config.persist_identity
        else new_identity()
    )
    libp2p_host = _build_libp2p_host(config, key_pair, listen)
    host = Host(config, libp2p_host, key_pair)
    if any(info.peer_id.to_base58() == host.peer_id for info in bootstrap):
        bootstrap = [info for info in bootstrap if info.peer_id.to_base58() != host.peer_id]
    try:
        async with _running(host, libp2p_host, listen, bootstrap):
            yield host
    except BaseExceptionGroup as group:
        # libp2p's run() and its services yield inside their own nurseries, so an exception
        # from the body (or our own startup checks) arrives wrapped in one group per nursery.
        # A lone exception is unwrapped so callers can catch what was raised.
        leaf = _sole_leaf(group)
        if leaf is None:
            raise
        raise leaf from leaf.__cause__


def _check_ports_free(listen: Sequence[multiaddr.Multiaddr]) -> None:
    """Refuse a TCP listen address another socket already listens on.

    py-libp2p's TCP listener sets SO_REUSEPORT (for hole punching), so on Linux a second
    process binds the same port without complaint and the kernel then spreads incoming
    connections over both: dials to the first node land on either at random. A probe bound
    without SO_REUSEPORT (SO_REUSEADDR only, which still fails while a socket listens there)
    finds the port taken first.
    """
    for addr in listen:
        protocols = {p.name for p in addr.protocols()}
        if "tcp" not in protocols:
            continue
        port = int(addr.value_for_protocol("tcp"))
        if port == 0:
            continue
        if "ip6" in protocols:
            family, ip = socket.AF_INET6, addr.value_for_protocol("ip6")
        elif "ip4" in protocols:
            family, ip = socket.AF_INET, addr.value_for_protocol("ip4")
        else:
            continue
        probe = socket.socket(family, socket.SOCK_STREAM)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((ip, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"cannot listen on {addr}: the address is in use (another node?); pick "
                    "another port with --listen"
                ) from None
            raise ConfigError(f"cannot listen on {addr}: {exc.strerror}") from None
        finally:
            probe.close()


def _sole_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    while len(group.exceptions) == 1:
        inner = group.exceptions[0]
        if not isinstance(inner, BaseExceptionGroup):
            return inner
        group = inner
    return None


@asynccontextmanager
async def _running(
    host: Host, libp2p_host: IHost, listen: list[multiaddr.Multiaddr], bootstrap: list[PeerInfo]
) -> AsyncIterator[None]:
    # The reaper lives outside libp2p's run(): on shutdown, libp2p closes each connection
    # politely, and on a hung peer that close (like any shielded libp2p cleanup) waits forever
    # behind a write stuck on the full socket. After a grace period the reaper closes the
    # sockets underneath, which unblocks them.
    async with trio.open_nursery() as guard:
        try:
            async with libp2p_host.run(listen):
                listening = set(host._network.listeners)
                failed = [str(a) for a in listen if str(a) not in listening]
                if failed:
                    raise ConfigError(f"cannot listen on {failed} (address in use or not local?)")
                async with background_trio_service(host._pubsub), background_trio_service(host._router):
                    await host._pubsub.wait_until_ready()
                    try:
                        async with trio.open_nursery() as nursery:
                            host._start(nursery)
                            host._start_discovery(bootstrap)
                            try:
                                yield
                            finally:
                                guard.start_soon(host._reap_connections_after, SHUTDOWN_GRACE_S)
                                nursery.cancel_scope.cancel()
                    finally:
                        await host._stop()
        finally:
            guard.cancel_scope.cancel()


__all__ = [
    "PING_PROTOCOL",
    "Host",
    "HostStatistics",
    "PeerEvent",
    "PeerEventKind",
    "StreamHandler",
    "open_host",
    "parse_peer_id",
    "parse_peer_multiaddr",
]
