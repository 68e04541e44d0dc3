"""What the parts of a ``Host`` share: the libp2p objects, the config, the counters, the
nursery, the ban list, the event channels and the deadline helper ``within``.

``peerinfer.net.host`` composes the parts (``connections``, ``gatekeeper``, ``dialing``,
``streams``, ``streampool``, ``liveness``, ``topics``); each takes this context and the parts it
calls, never the ``Host``, so no part imports the façade or another part above it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

import multiaddr
import trio
from libp2p.abc import IHost, IMuxedConn, INetConn, INetStream
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

from peerinfer.errors import ClosedError, ConfigError, InvalidRequestError
from peerinfer.net._errors import translated
from peerinfer.net.config import HostConfig

logger = logging.getLogger("peerinfer.net.host")

#: How long addresses learned from config, mDNS or peer exchange stay in the peerstore.
KNOWN_ADDR_TTL_S = 3600
#: Addresses kept from one ``add_known_peer`` call (a peer could send thousands).
MAX_KNOWN_ADDRS_PER_PEER = 8
#: Buffer of each ``peer_events()`` channel; a full one drops events (counted).
PEER_EVENT_BUFFER = 256

T = TypeVar("T")

PeerEventKind = Literal["connected", "disconnected", "discovered", "unresponsive", "misbehaved"]


@dataclass(frozen=True, slots=True)
class PeerEvent:
    """Something happened to a peer (see ``peerinfer.net.host`` for each kind)."""

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
class Counters:
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


#: Peer ids kept decoded by ``parse_peer_id`` (least recently used dropped first). The base58
#: decode is pure Python (~30 us; ~0.2 us from here): the hot callers (``is_connected``,
#: ``is_admitted``, ``only_relayed``, reachability's poll over every connected peer) ask about
#: the same few peers many times a second (17,363 decodes in one run of the 16-client node
#: bench: docs/performance.md, "What the node still adds: the reachability poll").
PEER_ID_CACHE = 4096


@functools.lru_cache(maxsize=PEER_ID_CACHE)
def _decoded_peer_id(text: str) -> ID:
    # An ID is immutable (its bytes; base58 and xor_id are cached properties of them), so one
    # instance can be shared by every caller. A malformed text raises and is not cached.
    return ID.from_base58(text)


def parse_peer_id(text: str, error: type[Exception] = InvalidRequestError) -> ID:
    """The libp2p ID for a base58 peer id; ``error`` if it is not one."""
    try:
        return _decoded_peer_id(text)
    except Exception as exc:  # a malformed id, or an unhashable argument
        raise error(f"not a peer id: {text!r}") from exc


def parse_peer_multiaddr(text: str, error: type[Exception] = ConfigError) -> PeerInfo:
    """A full ``/.../p2p/<id>`` multiaddr as libp2p PeerInfo; ``error`` if malformed."""
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(text))
    except Exception as exc:
        raise error(f"not a multiaddr ending in /p2p/<peer id>: {text!r}") from exc


def parse_multiaddr(text: str, error: type[Exception]) -> multiaddr.Multiaddr:
    try:
        return multiaddr.Multiaddr(text)
    except Exception as exc:
        raise error(f"not a multiaddr: {text!r}") from exc


def is_relayed(conn: INetConn | IMuxedConn) -> bool:
    """Whether ``conn`` runs through a relay (a circuit v2 connection)."""
    try:
        addrs = conn.get_transport_addresses()
    except Exception:
        return False
    return any("/p2p-circuit" in str(a) for a in addrs)


async def reset_stream(net_stream: INetStream) -> None:
    """Reset a stream nobody waits for any more (bounded: the connection may be hung)."""
    with trio.move_on_after(1.0):
        try:
            await net_stream.reset()
        except Exception:
            pass


async def abort_socket(conn: INetConn) -> None:
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


class HostContext:
    """The state every part of one host reads: set up by ``Host``, started by ``open_host``."""

    def __init__(self, config: HostConfig, libp2p_host: IHost, network: Swarm, peer_id: str,
                 admission_key: bytes | None) -> None:
        self.config = config
        self.h = libp2p_host
        self.network = network
        self.peer_id = peer_id
        #: derived from ``config.swarm_key``; None for an open swarm
        self.admission_key = admission_key
        self.counters = Counters()
        self.nursery: trio.Nursery | None = None
        self.closed = False
        self.banned: set[str] = set()
        self.event_channels: list[trio.MemorySendChannel[PeerEvent]] = []

    @property
    def running(self) -> bool:
        """Whether background tasks may be started (started and not closing)."""
        return self.nursery is not None and not self.closed

    def check_open(self) -> None:
        if self.closed:
            raise ClosedError("the host is closed")

    def nursery_or_closed(self) -> trio.Nursery:
        if self.nursery is None or self.closed:
            raise ClosedError("the host is closed")
        return self.nursery

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Start a background task if the host runs; else do nothing (it is closing)."""
        if self.nursery is not None and not self.closed:
            self.nursery.start_soon(fn, *args)

    def peer_events(self, buffer: int) -> trio.MemoryReceiveChannel[PeerEvent]:
        send, receive = trio.open_memory_channel[PeerEvent](buffer)
        self.event_channels.append(send)
        return receive

    def emit(self, event: PeerEvent) -> None:
        for channel in list(self.event_channels):
            try:
                channel.send_nowait(event)
            except trio.WouldBlock:
                self.counters.peer_events_dropped += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.event_channels.remove(channel)

    async def within(
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

        nursery = self.nursery_or_closed()
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
                    if late_ok and discard is not None and self.nursery is not None:
                        self.nursery.start_soon(discard, late)
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
