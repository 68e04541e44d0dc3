"""Circuit relay v2 for peerinfer hosts behind NATs (py-libp2p 0.8.1's ``relay.circuit_v2``).

What it does
------------
* **Relay service** (``service=True``): this host serves the circuit v2 *hop* protocol, so a
  peer behind a NAT may reserve a slot here and others reach it through us. Bounded by
  ``RelayLimits``: at most ``max_reservations`` reservations and ``max_circuits`` circuits,
  each circuit at most ``circuit_bytes`` and ``circuit_s``.
* **Client**: :meth:`Relay.reserve` reserves a slot on a relay peer (we must be connected to
  it); our relayed address is then ``<relay addr>/p2p/<relay>/p2p-circuit/p2p/<us>``.
  :meth:`Relay.dial` connects to a peer through such an address. The relayed connection is
  a full libp2p connection (Noise and yamux negotiated end to end *over* the relayed stream),
  so the relay sees only ciphertext, and the swarm upgrade path runs as for a direct dial.

Admission
---------
A relay admits only what swarm admission admits: the hop handler (reservations and circuit
connects) waits for the caller's admission verdict and resets the stream of a peer that has
none or failed; a relayed connection is an ordinary swarm connection, so the far end's
admission challenge runs on it before any stream is served (``peerinfer.net.admission``).

What py-libp2p 0.8.1 gets wrong here and how we work around it: see docs/reach.md.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import multiaddr
import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from peerinfer.errors import PeerUnavailableError
from peerinfer.net.host import Host

__all__ = ["HOP_PROTOCOL", "Relay", "RelaySettings", "open_relay", "relayed_addr"]

logger = logging.getLogger(__name__)


class _CircuitKey:
    """Stands in for the peer id that py-libp2p's relay pump files a circuit's streams under
    (``_relay_data``'s ``peer_id``): one per direction of one circuit, so its own clean-up
    finds nothing, and :class:`_CircuitRelay` closes that circuit's streams itself."""

    __slots__ = ("peer",)

    def __init__(self, peer: ID) -> None:
        self.peer = peer

    def __str__(self) -> str:  # its log lines name the peer
        return str(self.peer)


class _CircuitRelay(CircuitV2Protocol):
    """Circuit v2 whose relay closes, when a circuit ends, that circuit's own two streams.

    py-libp2p 0.8.1 keeps one entry per *peer* in ``_active_relays`` (the newest circuit of
    that peer, as source or destination), and a circuit's pump, when it ends, closes the
    streams of the entry under its peer id: with two circuits between the same peers (a fresh
    relayed connection beside a stalled one being replaced, after a heal) the end of the
    older one closed the newer, and left its own streams open, so the far end of the older
    connection never learnt it was gone (it stayed silent). Seen in the heal tests as a
    relayed connection that dropped at both ends at once right after it replaced a stalled
    one (tests/net/test_reach_relay.py::test_closing_one_circuit_leaves_a_newer_one_to_the_same_peer_open).
    Only the per-reservation byte tracking, which the pump does by peer id when the circuit
    has no byte limit of its own, is lost; every circuit here has one (``RelayLimits.data``)."""

    async def _relay_data(
        self,
        src_stream: INetStream,
        dst_stream: INetStream,
        peer_id: ID,
        deadline: float | None = None,
        circuit_data_limit: list[int] | None = None,
    ) -> None:
        try:
            await super()._relay_data(
                src_stream, dst_stream, _CircuitKey(peer_id),  # type: ignore[arg-type]
                deadline, circuit_data_limit,
            )
        finally:
            for key, streams in list(self._active_relays.items()):
                if src_stream in streams or dst_stream in streams:
                    del self._active_relays[key]
            with trio.CancelScope(shield=True):
                await self._close_stream(src_stream)
                await self._close_stream(dst_stream)


@dataclass(frozen=True)
class RelaySettings:
    """Limits of the relay service (hop role), and whether to offer it at all."""

    service: bool = False
    max_reservations: int = 16
    max_circuits: int = 32
    #: Bytes one relayed circuit may carry before the relay closes it (then: failover).
    circuit_bytes: int = 64 * 1024 * 1024
    #: Seconds one relayed circuit may last before the relay closes it.
    circuit_s: int = 3600


def relayed_addr(relay_addr: str, relay_id: str, peer_id: str) -> str:
    """The circuit address of ``peer_id`` through the relay at ``relay_addr`` (no /p2p)."""
    return f"{relay_addr}/p2p/{relay_id}/p2p-circuit/p2p/{peer_id}"


class Relay:
    """Circuit v2 on one peerinfer :class:`Host` (create with :func:`open_relay`)."""

    def __init__(self, host: Host, settings: RelaySettings) -> None:
        self._host = host
        self._settings = settings
        lh = host._h  # the libp2p host: this module is part of the network shell
        self._limits = RelayLimits(
            duration=settings.circuit_s,
            data=settings.circuit_bytes,
            max_circuit_conns=settings.max_circuits,
            max_reservations=settings.max_reservations,
        )
        roles = RelayRole.STOP | RelayRole.CLIENT
        if settings.service:
            roles |= RelayRole.HOP
        # allow_hop=False: circuit v2 would register its hop handler ungated; enable_service()
        # registers it behind admission instead (and only once we are found reachable).
        self._protocol = _CircuitRelay(lh, limits=self._limits, allow_hop=False)
        self._serving = False
        self._transport = CircuitV2Transport(lh, self._protocol, RelayConfig(roles=roles, limits=self._limits))
        #: relay peer id -> our relayed address through it
        self.reservations: dict[str, str] = {}

    @property
    def serving(self) -> bool:
        """Whether we serve the hop protocol now (others may reserve slots here)."""
        return self._serving

    def enable_service(self) -> None:
        """Serve circuit v2 hop, behind swarm admission (no-op unless the settings allow it)."""
        if not self._settings.service or self._serving:
            return
        self._serving = True
        inner = self._protocol._handle_hop_stream
        host = self._host

        async def gated(stream: INetStream) -> None:
            peer = stream.muxed_conn.peer_id.to_base58()
            if host._admission_key is not None:
                adm = await host._wait_admitted(peer)
                if adm is None or not adm.ok:
                    host._counters.unadmitted_streams_refused += 1
                    with contextlib.suppress(Exception):
                        await stream.reset()
                    return
            try:
                await inner(stream)
            except Exception:  # a handler that raises would take the host down
                logger.exception("relay hop stream from %s failed", peer)
                with contextlib.suppress(Exception):
                    await stream.reset()

        host._h.set_stream_handler(HOP_PROTOCOL, gated)

    async def reserve(self, relay_id: str, relay_addr: str, *, timeout: float = 10.0) -> str:
        """Reserve a slot on ``relay_id`` (connected, or dialed at ``relay_addr``); our relayed
        address. PeerUnavailableError when the relay refuses or does not answer in time."""
        ok = False
        with trio.move_on_after(timeout) as scope:
            if not self._host.is_connected(relay_id):
                await self._host.connect(f"{relay_addr}/p2p/{relay_id}", timeout=timeout)
            try:
                stream = await self._host._h.new_stream(ID.from_base58(relay_id), [TProtocol(HOP_PROTOCOL)])
            except Exception as exc:  # StreamFailure: no relay service there, or it reset us
                raise PeerUnavailableError(f"relay {relay_id}: no relay service ({exc})") from exc
            try:
                ok = await self._transport._make_reservation(stream, ID.from_base58(relay_id))
            finally:
                with contextlib.suppress(Exception):
                    await stream.close()
        if scope.cancelled_caught:
            raise PeerUnavailableError(f"relay {relay_id}: no reservation within {timeout:.1f} s")
        if not ok:
            raise PeerUnavailableError(f"relay {relay_id} refused a reservation")
        addr = relayed_addr(relay_addr, relay_id, self._host.peer_id)
        self.reservations[relay_id] = addr
        return addr

    async def dial(self, circuit_addr: str, *, timeout: float = 10.0) -> str:
        """Connect through a relay (``.../p2p/<relay>/p2p-circuit/p2p/<peer>``); the peer id."""
        maddr = multiaddr.Multiaddr(circuit_addr)
        conn = None
        with trio.move_on_after(timeout) as scope:
            try:
                conn = await self._transport.dial(maddr)
            except Exception as exc:  # ConnectionError and libp2p's own: refused, no reservation
                raise PeerUnavailableError(f"relayed dial {circuit_addr}: {exc}") from exc
        if scope.cancelled_caught or conn is None:
            raise PeerUnavailableError(f"relayed dial {circuit_addr}: no connection within {timeout:.1f} s")
        return conn.muxed_conn.peer_id.to_base58()


@contextlib.asynccontextmanager
async def open_relay(host: Host, settings: RelaySettings, *, serve_now: bool = True) -> AsyncIterator[Relay]:
    """Run circuit v2 on ``host`` for the duration of the block (the stop role: relayed
    connections to us are accepted); with ``serve_now`` and ``settings.service`` also the hop
    role at once (else on ``enable_service()``)."""
    relay = Relay(host, settings)
    async with background_trio_service(relay._protocol):
        await relay._protocol.event_started.wait()
        if serve_now:
            relay.enable_service()
        try:
            yield relay
        finally:
            if relay.serving:
                host._h.remove_stream_handler(HOP_PROTOCOL)
