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
  closed as it opens, ``Connections.opened``). The
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
  (``peerinfer.net.framing``). ``host.streams`` (``peerinfer.net.streampool``) keeps a stream
  whose exchange ended cleanly for the next exchange with the same peer and protocol (the
  node's forwards: ``host.streams.exchange``), repeats an exchange once whose stream was gone
  before any answer, and opens spares ahead for peers reached only through a relay.
  ``connect`` returns once the connection is open rather than after py-libp2p's 250 ms
  happy-eyeballs head start (``peerinfer.net.dialing``).
* **Liveness.** ``ping(peer)`` measures one round trip on ``/peerinfer/ping/1.0.0``. Every
  ``liveness_interval_s`` the host pings all connected peers; after ``liveness_max_failures``
  consecutive failures the peer's connections are retired (below) and an ``unresponsive``
  event emitted (a SIGSTOPped peer otherwise stays "connected", in the mesh, for minutes). A
  peer whose ping failed is probed with a fresh connection, which replaces the stalled ones; a
  new connection to a peer that holds others has each older one pinged over itself, and a
  silent one is replaced too (``replace_stalled_connections``; docs/reach.md, "Healing").
  *Slow but alive* (``peerinfer.net.liveness``, ``peerinfer.net.connections``): a late ping
  while the peer's frames arrive is excused (at most ``MAX_EXCUSED_PINGS`` in a row), a
  connection still delivering frames is not silent, and a replaced connection is *retired*:
  out of libp2p's choice at once, closed at once when it carries no request or proves dead,
  else once its requests ended (at most ``DRAIN_MAX_S``), so a slow client's request in flight
  finishes instead of being reset.
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
and dialing run in a helper task the caller stops waiting for at the deadline (``HostContext.within``),
because py-libp2p cleans up a cancelled ``new_stream`` inside ``CancelScope(shield=True)`` and,
on a hung peer, that cleanup waits forever behind a write stuck on the full socket.
``disconnect`` and shutdown close such sockets underneath libp2p after a short grace period, so
they are bounded too (about 1-2 s with a hung peer).

Concurrency: all methods are called from the trio thread; any number of tasks may use the host
at once (one sender and one receiver per ``FramedStream``).

Layout: ``Host`` is the façade; each concern has a module, and each part takes the shared
``HostContext`` (``peerinfer.net.context``) and the parts below it, never the ``Host``:
``connections`` (registry, disconnect, healing and probes) < ``gatekeeper`` (admission
verdicts) < ``dialing`` (connect, known addresses, bootstrap, mDNS) < ``streams`` (handlers,
``open_stream``); ``streampool`` (reuse) < ``liveness`` (pings, the one RTT table); ``topics``
(gossip glue). A part calls back up only through hooks the façade wires
(``Connections.on_opened``, ``on_replaced``, ``on_gone``). The libp2p host itself is
built in ``transport``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import multiaddr
import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.protocol_muxer.multiselect import Multiselect
from libp2p.tools.anyio_service import background_trio_service

from peerinfer.errors import ConfigError
from peerinfer.net.admission import ADMIT_PROTOCOL, admission_key
from peerinfer.net.api import NodeHost
from peerinfer.net.config import HostConfig
from peerinfer.net.connections import (
    DISCONNECT_TIMEOUT_S,
    MAX_PROBES,
    PROBE_EVERY_S,
    PROBE_TIMEOUT_S,
    Connections,
    RelayDialer,
)
from peerinfer.net.context import (
    KNOWN_ADDR_TTL_S,
    MAX_KNOWN_ADDRS_PER_PEER,
    PEER_EVENT_BUFFER,
    Counters,
    HostContext,
    HostStatistics,
    PeerEvent,
    PeerEventKind,
    T,
    abort_socket,
    is_relayed,
    parse_multiaddr,
    parse_peer_id,
    parse_peer_multiaddr,
)
from peerinfer.net.dialing import MAX_CIRCUIT_PEERS, RELAYED_DIRECT_TRY_S, Dialer
from peerinfer.net.discovery import MdnsBridge
from peerinfer.net.framing import FramedStream
from peerinfer.net.gatekeeper import MAX_REFUSALS_LOGGED, Admission, AdmissionGate, Gatekeeper
from peerinfer.net.gossip import GossipMessage, GuardedPubsub, Validator
from peerinfer.net.identity import load_or_create_identity, new_identity, peer_id_of
from peerinfer.net.liveness import Liveness
from peerinfer.net.ping import PING_MAX_BYTES, PING_PROTOCOL, serve_ping
from peerinfer.net.streampool import (
    IDLE_STREAM_TTL_S,
    MAX_IDLE_STREAMS,
    MAX_IDLE_STREAMS_PER_PEER,
    SPARE_STREAM_TTL_S,
    StreamPool,
)
from peerinfer.net.streams import StreamHandler, Streams
from peerinfer.net.topics import OUTBOUND_DRAIN_WAIT_S, OUTBOUND_HIGH_WATER, Topics
from peerinfer.net.transport import (
    RELAYED_CONNECTIONS_PER_PEER,
    build_libp2p_host,
    check_ports_free,
)

logger = logging.getLogger(__name__)

#: On shutdown, how long connections may take to close politely before their sockets are
#: closed under them.
SHUTDOWN_GRACE_S = 1.0
#: The most a host's shutdown waits for its connections and listeners to close
#: (``Host._close_everything``); what is left then is the reaper's.
SHUTDOWN_CLOSE_MAX_S = 5.0


class _ConnectionNotifee(INotifee):
    """Feeds connection open/close into the host (inline in libp2p's notify path)."""

    def __init__(self, connections: Connections) -> None:
        self._connections = connections

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self._connections.opened(conn.muxed_conn.peer_id.to_base58(), conn)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._connections.closed(conn.muxed_conn.peer_id.to_base58(), conn)

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None


class Host:
    """A running peerinfer network host. Created only by ``open_host``."""

    def __init__(self, config: HostConfig, libp2p_host: IHost, key_pair: KeyPair) -> None:
        network = libp2p_host.get_network()
        assert isinstance(network, Swarm)
        key = None if config.swarm_key is None else admission_key(config.swarm_key)
        ctx = self._ctx = HostContext(config, libp2p_host, network, peer_id_of(key_pair), key)
        self._connections = connections = Connections(ctx)
        self._gatekeeper = gatekeeper = Gatekeeper(ctx, connections)
        self._dialer = Dialer(ctx, connections, gatekeeper)
        self._streams = Streams(ctx, connections, gatekeeper, self._dialer)
        #: stream reuse (``peerinfer.net.streampool``): the node's forwards use ``exchange``
        self.streams = StreamPool(ctx, connections, gatekeeper, self._open_stream_late_bound)
        self._liveness = Liveness(ctx, connections, self._open_stream_late_bound, self.streams, self.connected_peers)
        self._topics = Topics(ctx, connections, admitted=None if key is None else gatekeeper.pubsub_admitted)
        connections.on_opened = self._on_connection_opened
        connections.on_replaced.append(self._renew_pubsub_stream)
        # Reachability (peerinfer.net.reach): our relayed addresses, advertised with the others.
        self._advertised: list[str] = []
        self.reach_state: object | None = None
        self._mdns: MdnsBridge | None = None
        network.register_notifee(_ConnectionNotifee(connections))
        self.set_handler(PING_PROTOCOL, serve_ping)
        if key is not None:
            self.set_handler(ADMIT_PROTOCOL, gatekeeper.serve_admit)
            # Before admission a stranger gets nothing from protocol negotiation but the
            # admission protocol: not our protocol names (multistream "ls"), not identify's
            # listen addresses and protocols (issue 21).
            mux = libp2p_host.get_mux()
            assert isinstance(mux, Multiselect)
            libp2p_host.multiselect = AdmissionGate(mux.handlers, ctx, gatekeeper)  # type: ignore[attr-defined]
            # Nor is our identify pushed to it (py-libp2p pushes to every connected peer when
            # a listen address appears): only to admitted peers.
            libp2p_host._push_identify_to_all_peers = gatekeeper.push_identify_to_admitted  # type: ignore[attr-defined]

    def _on_connection_opened(self, peer_id: str, first: bool) -> None:
        if self._ctx.admission_key is not None:
            self._gatekeeper.opened(peer_id, first)  # "connected" once the peer has passed
        elif first:
            self._ctx.emit(PeerEvent("connected", peer_id))

    def _renew_pubsub_stream(self, peer_id: str, stalled: list[INetConn]) -> None:
        self._topics.pubsub.renew_stream_off(parse_peer_id(peer_id), stalled)

    def _open_stream_late_bound(
        self, peer_id: str, protocol: str, *, timeout: float | None = None, lazy: bool = False
    ) -> Awaitable[FramedStream]:
        # Looked up at each call: tests stand in for ``Host.open_stream`` to count or fail opens.
        return self.open_stream(peer_id, protocol, timeout=timeout, lazy=lazy)

    # -- what the parts hold, under the names tools and tests use ----------------------------

    @property
    def _config(self) -> HostConfig:
        return self._ctx.config

    @property
    def _h(self) -> IHost:
        return self._ctx.h

    @property
    def _network(self) -> Swarm:
        return self._ctx.network

    @property
    def _counters(self) -> Counters:
        return self._ctx.counters

    @property
    def _admission_key(self) -> bytes | None:
        return self._ctx.admission_key

    @property
    def _pubsub(self) -> GuardedPubsub:
        return self._topics.pubsub

    @property
    def _liveness_failures(self) -> dict[str, int]:
        return self._connections.failures

    @property
    def _replaced_at(self) -> dict[str, float]:
        return self._connections.replaced_at

    async def _within(self, operation: str, peer: str | None, deadline: float,
                      call: Callable[[], Awaitable[T]]) -> T:
        return await self._ctx.within(operation, peer, deadline, call)

    def _live_connections(self, pid: ID) -> list[INetConn]:
        return self._connections.live(pid)

    async def _fresh_connection(self, peer: str, timeout: float) -> bool:
        return await self._connections.fresh_connection(peer, timeout)

    async def _close_connection(self, peer_id: str, conn: INetConn) -> None:
        await self._connections.close_connection(peer_id, conn)

    def _drop_idle_streams(self, peer_id: str) -> None:
        self.streams.drop(peer_id)

    async def _wait_admitted(self, peer_id: str, timeout: float | None = None) -> Admission | None:
        return await self._gatekeeper.wait_admitted(peer_id, timeout)

    # -- identity and addresses ---------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        """Our base58 peer id (``12D3KooW...``)."""
        return self._ctx.peer_id

    def listen_addrs(self) -> list[str]:
        """The addresses we are bound to, as full multiaddrs with ``/p2p/<our id>``.

        Exactly what the sockets are bound to: ``/ip4/0.0.0.0/...`` stays as is. Use
        ``dialable_addrs()`` for addresses another node can dial.
        """
        suffix = f"/p2p/{self.peer_id}"
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
        return self._dialer.circuit_addrs(peer_id)

    def known_addrs(self, peer_id: str) -> list[str]:
        """What the peerstore knows about how to reach ``peer_id`` (without /p2p), for peer
        exchange. Empty if nothing is known."""
        return self._dialer.known_addrs(peer_id)

    @property
    def relay_dialer(self) -> RelayDialer | None:
        """The relayed dial (set by ``peerinfer.net.reach`` once a relay is set up)."""
        return self._dialer.relay_dialer

    @relay_dialer.setter
    def relay_dialer(self, dialer: RelayDialer | None) -> None:
        self._dialer.relay_dialer = dialer

    # -- connections --------------------------------------------------------------------------

    async def connect(self, maddr: str, *, timeout: float | None = None) -> str:
        """Connect to ``/.../p2p/<id>`` (no-op if connected); return the verified peer id.

        Raises ``ConfigError`` for a malformed address, ``PeerUnavailableError`` if the peer
        cannot be reached or is not who the address says (Noise checks the id),
        ``RequestTimeoutError`` after ``timeout`` (default ``connect_timeout_s``).
        """
        info = parse_peer_multiaddr(maddr, ConfigError)
        return await self._dialer.connect_info(info, timeout)

    def add_known_peer(self, peer_id: str, addrs: Sequence[str]) -> None:
        """Remember addresses (without ``/p2p``; a trailing one is tolerated) for a peer learned
        from another node; at most ``MAX_KNOWN_ADDRS_PER_PEER`` per call are kept. Raises
        ``ProtocolError`` for a malformed id or address (it came from a peer). Emits a
        ``discovered`` event if an address is new; does not dial (use ``dial``)."""
        self._dialer.add_known_peer(peer_id, addrs)

    async def dial(self, peer_id: str, *, timeout: float | None = None) -> None:
        """Connect to a peer whose addresses we know (``add_known_peer``, mDNS, identify)."""
        pid = parse_peer_id(peer_id)
        await self._dialer.connect_info(PeerInfo(pid, []), timeout)

    def is_admitted(self, peer_id: str) -> bool:
        """Whether ``peer_id`` passed admission on its current connections (always True for an
        open swarm, i.e. without ``swarm_key``, once connected)."""
        return self._gatekeeper.is_admitted(peer_id)

    def connected_peers(self) -> list[str]:
        """Peers with at least one open connection (and, in a private swarm, admitted)."""
        peers = {pid.to_base58() for pid in self._h.get_connected_peers()} | self._connections.peers()
        if self._ctx.admission_key is not None:
            return sorted(p for p in peers if self.is_admitted(p))
        return sorted(p for p in peers if self.is_connected(p))

    def is_connected(self, peer_id: str) -> bool:
        """Whether we hold at least one open connection to ``peer_id``."""
        return self._connections.is_connected(peer_id)

    def only_relayed(self, peer_id: str) -> bool:
        """Whether we are connected to ``peer_id`` and only through relays (no direct path)."""
        return self._connections.only_relayed(peer_id)

    def relayed_connections(self, peer_id: str) -> list[object]:
        """The connections to ``peer_id`` as ``relayed_connection`` names a stream's (keys for
        what each circuit carried) when every live one runs through a relay; [] when a direct
        one exists or none does."""
        live = self._live_connections(parse_peer_id(peer_id))
        if not live or not all(is_relayed(c) for c in live):
            return []
        return [getattr(c, "muxed_conn", c) for c in live]

    async def disconnect(self, peer_id: str) -> None:
        """Close every connection to ``peer_id``; bounded even if the peer is hung (see
        ``Connections.disconnect``)."""
        await self._connections.disconnect(peer_id)

    def ban(self, peer_id: str) -> None:
        """Refuse ``peer_id`` until ``unban``: disconnect it, ignore its gossip (and gossip it
        originated), and close its future connections as soon as they open. For the node's
        reputation policy; not persisted across restarts."""
        pid = parse_peer_id(peer_id)
        self._ctx.banned.add(peer_id)
        self._pubsub.add_to_blacklist(pid)
        self.streams.drop(peer_id)
        if self.is_connected(peer_id):
            self._ctx.nursery_or_closed().start_soon(self.disconnect, peer_id)

    def unban(self, peer_id: str) -> None:
        self._ctx.banned.discard(peer_id)
        self._pubsub.remove_from_blacklist(parse_peer_id(peer_id))

    def banned_peers(self) -> list[str]:
        return sorted(self._ctx.banned)

    def replaced_since(self, peer_id: str, since: float) -> bool:
        """Whether stalled connections to ``peer_id`` were replaced by a fresh one at or after
        ``since`` (``trio.current_time()``): an exchange begun before then that failed may
        have failed on one of them, not on the peer, and may be tried again."""
        return self._connections.replaced_since(peer_id, since)

    # -- streams ------------------------------------------------------------------------------

    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        """Serve ``protocol`` with ``handler``; it gets a ``FramedStream`` per inbound stream.

        The handler may raise: the exception is logged (a ``RemoteError`` briefly, anything
        else with its traceback), the stream reset, the host unharmed. If it returns, the
        stream is closed. At most ``max_streams_per_peer`` handlers run per peer (all
        protocols together); streams beyond that are reset unanswered.
        """
        self._streams.set_handler(protocol, handler)

    def remove_handler(self, protocol: str) -> None:
        self._h.remove_stream_handler(TProtocol(protocol))

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
        return await self._streams.open_stream(peer_id, protocol, timeout=timeout, lazy=lazy)

    async def request(
        self, peer_id: str, protocol: str, data: bytes, *, timeout: float | None = None
    ) -> bytes:
        """Open a stream, send one frame, half-close, return the one-frame reply, close.

        ``timeout`` bounds the whole exchange. A reset, an end of stream without a reply, or
        a refused protocol is a PeerUnavailableError. The stream is opened lazily (see
        ``open_stream``): the request travels with the protocol negotiation.
        """
        return await self._streams.request(peer_id, protocol, data, timeout=timeout)

    # Kept streams (``peerinfer.net.streampool``), under the names tools and benchmarks use.

    def take_idle_stream(self, peer_id: str, protocol: str) -> FramedStream | None:
        """``host.streams.take``: a kept stream to ``peer_id`` on ``protocol``, or None."""
        return self.streams.take(peer_id, protocol)

    def has_idle_stream(self, peer_id: str, protocol: str) -> bool:
        """``host.streams.has``: whether a stream is kept (it may have expired)."""
        return self.streams.has(peer_id, protocol)

    def keep_idle_stream(self, stream: FramedStream, *, ttl_s: float = IDLE_STREAM_TTL_S) -> None:
        """``host.streams.keep``: keep ``stream`` for the next exchange (or close it)."""
        self.streams.keep(stream, ttl_s=ttl_s)

    # -- liveness -----------------------------------------------------------------------------

    async def ping(self, peer_id: str, *, timeout: float | None = None) -> float:
        """Round-trip time to ``peer_id`` in seconds (one echo on a fresh stream; the stream
        opening is not counted). ``timeout`` bounds each try.

        A ping that fails because the connection it ran on was replaced meanwhile (a stalled
        one, ``Connections.replace_stalled``) is asked once more, on the connection that
        replaced it: its failure says nothing of the peer. (Seen after a partition healed: a
        node's ping begun on the stalled connection failed a second after the fresh one
        replaced it, and the node dropped the peer it had just got back, for another round of
        pings.)"""
        return await self._liveness.ping(peer_id, timeout=timeout)

    def last_rtt(self, peer_id: str) -> float | None:
        """The last measured round trip to ``peer_id`` (seconds), if any: the host's one RTT
        table, filled by ``ping`` and by the liveness loop's pings."""
        return self._liveness.last_rtt(peer_id)

    def fresh_rtt(self, peer_id: str, max_age_s: float) -> float | None:
        """The last round trip to ``peer_id`` if it was measured at most ``max_age_s`` ago
        (and its connections were not replaced since), else None (``Liveness.fresh_rtt``)."""
        return self._liveness.fresh_rtt(peer_id, max_age_s)

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
        return await self._topics.subscribe(topic, validator, include_own=include_own)

    async def unsubscribe(self, topic: str) -> None:
        """Leave ``topic``: every subscriber's channel ends (``EndOfChannel``)."""
        await self._topics.unsubscribe(topic)

    async def publish(self, topic: str, data: bytes, *, timeout: float | None = None) -> None:
        """Sign and publish ``data`` on ``topic``.

        Paced per topic (a quarter of the gossip rate limit, see ``peerinfer.net.config``):
        waits for the pacer rather than letting libp2p drop. Raises ``InvalidRequestError`` for
        data above ``gossip_max_message_bytes``, ``RequestTimeoutError`` if the pacer does not
        admit it within ``timeout`` (default ``stream_timeout_s``).
        """
        await self._topics.publish(topic, data, timeout=timeout)

    def gossip_peers(self, topic: str) -> list[str]:
        """Connected peers known to be subscribed to ``topic``."""
        return self._topics.gossip_peers(topic)

    def mesh_peers(self, topic: str) -> list[str]:
        """Peers in our gossipsub mesh for ``topic`` (they get our messages first-hand)."""
        return self._topics.mesh_peers(topic)

    # -- events and statistics ----------------------------------------------------------------

    def peer_events(self, buffer: int = PEER_EVENT_BUFFER) -> trio.MemoryReceiveChannel[PeerEvent]:
        """A new channel receiving every later ``PeerEvent``; close it when done. If it is not
        drained, events beyond ``buffer`` are dropped (counted in ``statistics()``).

        Discovery (bootstrap, mDNS) starts only at the first checkpoint of the ``open_host``
        body, so a channel opened before the body's first ``await`` misses no event."""
        return self._ctx.peer_events(buffer)

    def statistics(self) -> HostStatistics:
        c = self._ctx.counters
        return HostStatistics(
            peer_id=self.peer_id,
            connected_peers=len(self.connected_peers()),
            handler_streams_running=sum(self._streams.inflight.values()),
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

    # -- lifecycle ----------------------------------------------------------------------------

    def _start(self, nursery: trio.Nursery) -> None:
        self._ctx.nursery = nursery
        self._gatekeeper.begin_pending()

    def _start_discovery(self, bootstrap: Sequence[PeerInfo]) -> None:
        nursery = self._ctx.nursery_or_closed()
        for info in bootstrap:
            nursery.start_soon(self._dialer.keep_connected, info)
        if self._config.liveness_interval_s > 0:
            nursery.start_soon(self._liveness.loop)
        if self._config.mdns:
            self._mdns = MdnsBridge(self._network, self.peer_id, self._dialer.on_discovered)
            bare = [multiaddr.Multiaddr(a.rsplit("/p2p/", 1)[0]) for a in self.dialable_addrs()]
            nursery.start_soon(self._mdns.start, bare)

    async def _reap_connections_after(self, grace_s: float) -> None:
        """Shutdown helper: once ``grace_s`` has passed, keep aborting the sockets of whatever
        connections are left, until the shutdown completes (and cancels us)."""
        await trio.sleep(grace_s)
        while True:
            for connections in list(self._network.connections.values()):
                for conn in list(connections):
                    await abort_socket(conn)
            await trio.sleep(0.5)

    async def _close_everything(self) -> None:
        """Shutdown: close every connection and the listeners before libp2p's run() returns.

        libp2p's run() stops the swarm's service but never closes the swarm: its connections
        and listeners stay open after the host is gone. A peer then kept pinging a departed
        host over its old connection, and a probe dial of its address still completed the
        handshake at the dead listener (which counted as a fresh connection and was closed at
        once by the stopped swarm: docs/reach.md, "A fresh connection closed right after it
        replaced a stalled one"). Shielded, so the cancelled body cannot skip it, and bounded:
        each disconnect is (``DISCONNECT_TIMEOUT_S``), the reaper started beside it aborts what
        is left after ``SHUTDOWN_GRACE_S``, and the whole step gives up after
        ``SHUTDOWN_CLOSE_MAX_S``.
        """
        with trio.move_on_after(SHUTDOWN_CLOSE_MAX_S) as scope:
            scope.shield = True
            async with trio.open_nursery() as closing:
                for peer in self._connections.peers():
                    closing.start_soon(self._connections.disconnect, peer)
            await self._network.close()
        if scope.cancelled_caught:
            logger.warning("closing the host's connections took over %.0f s; left to the reaper",
                           SHUTDOWN_CLOSE_MAX_S)

    async def _stop(self) -> None:
        self._ctx.closed = True
        if self._mdns is not None:
            await self._mdns.stop()
        for channel in self._ctx.event_channels:
            channel.close()
        self._ctx.event_channels.clear()


def _as_node_host(host: Host) -> NodeHost:
    """Never called: mypy checks here that ``Host`` provides the node's narrow API."""
    return host


def stream_is_relayed(stream: FramedStream) -> bool:
    """Whether ``stream`` runs over a relayed connection (its remote address is then the
    relay's, not the peer's)."""
    return relayed_connection(stream) is not None


def relayed_connection(stream: object) -> object | None:
    """The relayed connection ``stream`` runs on (a key for what that circuit has carried:
    ``peerinfer.node.kvpull``), or None when it runs on a direct one or is not a libp2p
    ``FramedStream`` (the in-memory network has no relays)."""
    conn = getattr(getattr(stream, "_stream", None), "muxed_conn", None)
    return conn if conn is not None and is_relayed(conn) else None


@asynccontextmanager
async def open_host(config: HostConfig) -> AsyncIterator[Host]:
    """Start a host; on exit stop everything it started (connections, tasks, mDNS).

    Raises ``ConfigError`` for an invalid config, an unreadable identity key or an address we
    cannot listen on.
    """
    config.check()
    listen = [parse_multiaddr(a, ConfigError) for a in config.listen]
    check_ports_free(listen)
    bootstrap = [parse_peer_multiaddr(a, ConfigError) for a in config.bootstrap]
    key_pair = (
        load_or_create_identity(config.effective_identity_path())
        if config.persist_identity
        else new_identity()
    )
    libp2p_host = build_libp2p_host(config, key_pair, listen)
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
                async with background_trio_service(host._pubsub), background_trio_service(host._topics.router):
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
                                await host._close_everything()
                    finally:
                        await host._stop()
        finally:
            guard.cancel_scope.cancel()

__all__ = [
    "DISCONNECT_TIMEOUT_S",
    "IDLE_STREAM_TTL_S",
    "KNOWN_ADDR_TTL_S",
    "MAX_CIRCUIT_PEERS",
    "MAX_IDLE_STREAMS",
    "MAX_IDLE_STREAMS_PER_PEER",
    "MAX_KNOWN_ADDRS_PER_PEER",
    "MAX_PROBES",
    "MAX_REFUSALS_LOGGED",
    "OUTBOUND_DRAIN_WAIT_S",
    "OUTBOUND_HIGH_WATER",
    "PEER_EVENT_BUFFER",
    "PING_MAX_BYTES",
    "PING_PROTOCOL",
    "PROBE_EVERY_S",
    "PROBE_TIMEOUT_S",
    "RELAYED_CONNECTIONS_PER_PEER",
    "RELAYED_DIRECT_TRY_S",
    "SHUTDOWN_GRACE_S",
    "SPARE_STREAM_TTL_S",
    "Host",
    "HostStatistics",
    "PeerEvent",
    "PeerEventKind",
    "StreamHandler",
    "open_host",
    "parse_peer_id",
    "parse_peer_multiaddr",
    "stream_is_relayed",
]
