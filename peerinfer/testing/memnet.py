"""An in-memory network for node tests: ``MemNetwork`` hands out ``MemHost``s, which provide
the node's narrow host API (:class:`peerinfer.net.api.NodeHost`) over trio memory channels.

Nothing in it touches a socket or a thread, so nodes on it run under trio's virtual clock
(``trio.testing.MockClock(autojump_threshold=0)``, pytest-trio's ``autojump_clock``): a test
that waits 20 s of node time takes what its computation takes. ``MemNetwork.node`` builds a
``Node`` on it with inline engine calls (``NodeContext.inline_engine``), the other half of that.

The model, kept small and said plainly:

* **Hosts and addresses.** Each host has a real libp2p peer id (a fresh Ed25519 key) and one
  address, ``/memory/<n>/p2p/<peer id>``. ``connect``/``dial`` reach any host of the network
  that is open and not cut off (``partition``), in one link delay; there is no NAT, relay,
  mDNS, admission (a swarm key is ignored: every connected peer counts as admitted) or
  connection limit. Bootstrap addresses are dialed once at start, then every second while not
  connected. A host that closes disconnects from everyone.
* **Links.** Every frame, gossip message and ping reply arrives one link delay after it was
  sent (``set_delay``; default ``delay_s``), in order per stream; sending never blocks.
  ``partition(a, b)`` cuts every link between the two groups: their connections close at once
  (both ends see ``disconnected``, their streams are reset) and new ones are refused until
  ``heal()``. A real partition stalls connections until pings fail; here the failure is
  immediate.
* **Streams.** ``open_stream`` starts the peer's handler for the protocol at once (refused
  protocols fail the opening); the handler's stream is closed when it returns, reset when it
  raises. ``host.streams.exchange`` opens a new stream per exchange and closes it after: no
  stream reuse, no retry (``peerinfer.net.streampool`` is libp2p's and tested there).
* **Gossip.** ``publish`` floods the message to every connected peer that subscribed to the
  topic, and each floods what it has not seen before to its own, so a message crosses a chain
  of hosts; a topic validator that says False drops it (no scoring).
* **Liveness.** ``ping`` takes one round trip (two link delays) and fills the RTT table that
  ``fresh_rtt`` reads. There is no liveness loop: a peer is gone when its host closes or a
  partition cuts it off.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import math
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

import trio

from peerinfer.engine.base import Engine
from peerinfer.errors import (
    ClosedError,
    InvalidRequestError,
    PeerUnavailableError,
    ProtocolError,
    RequestTimeoutError,
)
from peerinfer.net.api import NodeHost, Stream, StreamHandler, StreamUse
from peerinfer.net.config import HostConfig
from peerinfer.net.context import PEER_EVENT_BUFFER, PeerEvent
from peerinfer.net.gossip import GossipMessage, Validator
from peerinfer.net.identity import new_identity, peer_id_of
from peerinfer.node import Node, NodeOptions

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Messages a host remembers having seen (gossip deduplication).
SEEN_GOSSIP = 4096


class _End:
    """What travels after the last frame: a clean end (``reset`` False) or a reset."""

    def __init__(self, reset: bool) -> None:
        self.reset = reset


@dataclass(eq=False)
class _Wire:
    """One direction of a stream: items with the time they arrive."""

    send: trio.MemorySendChannel[tuple[float, bytes | _End]]
    receive: trio.MemoryReceiveChannel[tuple[float, bytes | _End]]

    @classmethod
    def open(cls) -> _Wire:
        send, receive = trio.open_memory_channel[tuple[float, "bytes | _End"]](math.inf)
        return cls(send, receive)


class MemStream:
    """One end of an in-memory stream (the :class:`~peerinfer.net.api.Stream` protocol, with
    ``FramedStream``'s errors: a timeout, an oversized frame or a reset leaves it reset)."""

    def __init__(
        self, host: MemHost, remote_peer: str, protocol: str, outgoing: _Wire, incoming: _Wire
    ) -> None:
        self._host = host
        self.remote_peer = remote_peer
        self.protocol = protocol
        self.frames_received = 0
        self._out = outgoing
        self._in = incoming
        self._done = False
        self._wrote_end = False
        self._read_end = False
        #: Its connection closed under it (``cut``): sends fail, receives see a reset.
        self._cut = False
        self.other: MemStream | None = None

    def __repr__(self) -> str:
        return f"<MemStream {self.protocol} with {self.remote_peer}>"

    def _put(self, item: bytes | _End) -> None:
        at = trio.current_time() + self._host.network.delay(self._host.peer_id, self.remote_peer)
        try:
            self._out.send.send_nowait((at, item))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the other end is gone: like bytes into a reset stream

    async def send(self, data: bytes, *, timeout: float | None = None) -> None:
        if self._done:
            raise ClosedError(f"{self!r} is closed")
        if self._wrote_end:
            raise ClosedError(f"{self!r} was closed for writing")
        if self._cut:
            await self.reset()
            raise PeerUnavailableError(f"the connection to {self.remote_peer} closed")
        if len(data) > self._host.config.max_frame_bytes:
            raise InvalidRequestError(f"frame of {len(data)} bytes exceeds {self._host.config.max_frame_bytes}")
        await trio.lowlevel.checkpoint()
        self._put(bytes(data))

    async def close_write(self) -> None:
        await trio.lowlevel.checkpoint()
        if not self._done and not self._wrote_end:
            self._wrote_end = True
            self._put(_End(reset=False))

    async def receive(self, *, timeout: float | None = None, max_bytes: int | None = None) -> bytes:
        if self._done:
            raise ClosedError(f"{self!r} is closed")
        if self._read_end:
            raise trio.EndOfChannel
        limit = self._host.config.max_frame_bytes if max_bytes is None else min(max_bytes, self._host.config.max_frame_bytes)
        deadline = self._host.config.stream_timeout_s if timeout is None else timeout
        try:
            with trio.fail_after(deadline):
                try:
                    at, item = await self._in.receive.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    item, at = _End(reset=True), trio.current_time()
                await trio.sleep_until(at)
        except trio.TooSlowError:
            await self.reset()
            raise RequestTimeoutError(f"receive from {self.remote_peer} timed out after {deadline:g} s") from None
        if isinstance(item, _End):
            if item.reset:
                await self.reset()
                raise PeerUnavailableError(f"stream reset by {self.remote_peer}")
            self._read_end = True
            raise trio.EndOfChannel
        if len(item) > limit:
            await self.reset()
            raise ProtocolError(f"{self.remote_peer} sent a {len(item)}-byte frame; limit {limit}")
        self.frames_received += 1
        return item

    def __aiter__(self) -> MemStream:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._done:
            return
        if not self._wrote_end:
            self._wrote_end = True
            self._put(_End(reset=False))
        self._finish()

    async def reset(self) -> None:
        await trio.lowlevel.checkpoint()
        self.reset_now()

    def reset_now(self) -> None:
        if self._done:
            return
        self._put(_End(reset=True))
        self._finish()

    def cut(self) -> None:
        """Its connection closed: what is in flight is lost, the next receive is a reset."""
        if self._done:
            return
        self._cut = True
        while True:
            try:
                self._in.receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self._in.send.send_nowait((trio.current_time(), _End(reset=True)))
        self._host.streams_open.discard(self)

    def _finish(self) -> None:
        self._done = True
        self._in.receive.close()
        self._host.streams_open.discard(self)

    @property
    def closed(self) -> bool:
        return self._done

    @property
    def reusable(self) -> bool:
        return not (self._done or self._wrote_end or self._read_end)

    async def __aenter__(self) -> MemStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None,
    ) -> None:
        if exc is None:
            await self.aclose()
        else:
            await self.reset()


class _NewStreamEachTime:
    """``host.streams`` of a ``MemHost``: each exchange on a new stream, closed after it (reset
    when the body raised). A clean end escaping the body is the peer's failure, as in
    ``StreamPool.use``."""

    def __init__(self, host: MemHost) -> None:
        self._host = host

    async def exchange(
        self, peer: str, protocol: str, body: Callable[[StreamUse], Awaitable[T]], *,
        timeout: float, spare: bool = False,
    ) -> T:
        started = trio.current_time()
        stream = await self._host.open_stream(peer, protocol, timeout=timeout)
        try:
            result = await body(StreamUse(stream, started=started, reused=False, retry=False))
        except trio.EndOfChannel as exc:
            await stream.reset()
            raise PeerUnavailableError(f"{peer} ended the {protocol} stream before the exchange was done") from exc
        except BaseException:
            await stream.reset()
            raise
        await stream.aclose()
        return result


class MemHost:
    """A host on a :class:`MemNetwork` (see the module docstring for what it models)."""

    def __init__(self, network: MemNetwork, config: HostConfig, number: int, nursery: trio.Nursery) -> None:
        self.network = network
        self.config = config
        self._peer_id = peer_id_of(new_identity())
        self.address = f"/memory/{number}/p2p/{self._peer_id}"
        self._nursery = nursery
        self.open = True
        self._connected: set[str] = set()
        self._known: dict[str, tuple[str, ...]] = {}
        self._banned: set[str] = set()
        self._handlers: dict[str, StreamHandler] = {}
        self._event_channels: list[trio.MemorySendChannel[PeerEvent]] = []
        self._rtt: dict[str, tuple[float, float]] = {}
        self._subscribers: dict[str, list[tuple[trio.MemorySendChannel[GossipMessage], bool]]] = {}
        self._validators: dict[str, Validator] = {}
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._seqno = itertools.count(1)
        #: when our last gossip message to each peer arrives (``_flood``)
        self._gossip_due: dict[str, float] = {}
        self.streams_open: set[MemStream] = set()
        self._streams = _NewStreamEachTime(self)

    # -- identity and addresses ---------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def streams(self) -> _NewStreamEachTime:
        return self._streams

    def dialable_addrs(self) -> list[str]:
        return [self.address]

    def circuit_addrs(self, peer_id: str) -> list[str]:
        return []  # no relays here

    def known_addrs(self, peer_id: str) -> list[str]:
        other = self.network.host(peer_id)
        known = list(self._known.get(peer_id, ()))
        if other is not None and peer_id in self._connected:
            known.append(other.address.rsplit("/p2p/", 1)[0])
        return list(dict.fromkeys(known))

    def add_known_peer(self, peer_id: str, addrs: Sequence[str]) -> None:
        bare = tuple(a.removesuffix(f"/p2p/{peer_id}") for a in addrs)
        new = tuple(a for a in bare if a not in self._known.get(peer_id, ()))
        if new:
            self._known[peer_id] = self._known.get(peer_id, ()) + new
            self._emit(PeerEvent("discovered", peer_id, new))

    # -- connections --------------------------------------------------------------------------

    async def connect(self, maddr: str, *, timeout: float | None = None) -> str:
        """Connect to ``.../p2p/<id>``: the host of that id must hold that address."""
        peer = maddr.rsplit("/p2p/", 1)[-1]
        other = self.network.host(peer)
        if other is None or other.address.rsplit("/p2p/", 1)[0] != maddr.rsplit("/p2p/", 1)[0]:
            await trio.lowlevel.checkpoint()
            raise PeerUnavailableError(f"nothing listens at {maddr}")
        await self.dial(peer, timeout=timeout)
        return peer

    async def dial(self, peer_id: str, *, timeout: float | None = None) -> None:
        if peer_id in self._connected:
            await trio.lowlevel.checkpoint()
            return
        with trio.move_on_after(self.config.connect_timeout_s if timeout is None else timeout) as scope:
            await trio.sleep(2 * self.network.delay(self.peer_id, peer_id))  # the handshake
        if scope.cancelled_caught:
            raise RequestTimeoutError(f"dialing {peer_id} timed out")
        other = self.network.host(peer_id)
        if other is None or not self.open or not self.network.reachable(self.peer_id, peer_id):
            raise PeerUnavailableError(f"{peer_id} is unreachable")
        if peer_id in self._banned or self.peer_id in other._banned:
            raise PeerUnavailableError(f"{peer_id} refused the connection")
        if peer_id not in self._connected:
            self._connected.add(peer_id)
            other._connected.add(self.peer_id)
            self._emit(PeerEvent("connected", peer_id))
            other._emit(PeerEvent("connected", self.peer_id))

    def disconnect_now(self, peer_id: str) -> None:
        """Close the connection to ``peer_id`` (both ends see it), resetting its streams."""
        other = self.network.host(peer_id)
        for host, peer in ((self, peer_id), (other, self.peer_id)):
            if host is None or peer not in host._connected:
                continue
            host._connected.discard(peer)
            for stream in [s for s in host.streams_open if s.remote_peer == peer]:
                stream.cut()
            host._emit(PeerEvent("disconnected", peer))

    async def disconnect(self, peer_id: str) -> None:
        await trio.lowlevel.checkpoint()
        self.disconnect_now(peer_id)

    def is_connected(self, peer_id: str) -> bool:
        return peer_id in self._connected

    def is_admitted(self, peer_id: str) -> bool:
        return peer_id in self._connected

    def connected_peers(self) -> list[str]:
        return sorted(self._connected)

    def peer_events(self, buffer: int = PEER_EVENT_BUFFER) -> trio.MemoryReceiveChannel[PeerEvent]:
        send, receive = trio.open_memory_channel[PeerEvent](buffer)
        self._event_channels.append(send)
        return receive

    def _emit(self, event: PeerEvent) -> None:
        for channel in list(self._event_channels):
            try:
                channel.send_nowait(event)
            except trio.WouldBlock:
                logger.debug("peer event dropped: %s", event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._event_channels.remove(channel)

    # -- bans ---------------------------------------------------------------------------------

    def ban(self, peer_id: str) -> None:
        self._banned.add(peer_id)
        self.disconnect_now(peer_id)

    def unban(self, peer_id: str) -> None:
        self._banned.discard(peer_id)

    def banned_peers(self) -> list[str]:
        return sorted(self._banned)

    # -- streams ------------------------------------------------------------------------------

    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        self._handlers[protocol] = handler

    async def open_stream(
        self, peer_id: str, protocol: str, *, timeout: float | None = None, lazy: bool = False
    ) -> MemStream:
        if peer_id not in self._connected:
            await self.dial(peer_id, timeout=timeout)
        await trio.lowlevel.checkpoint()
        other = self.network.host(peer_id)
        if other is None or peer_id not in self._connected:
            raise PeerUnavailableError(f"{peer_id} is not connected")
        handler = other._handlers.get(protocol)
        if handler is None:
            raise PeerUnavailableError(f"{peer_id} refused the protocol {protocol}")
        ours, theirs = _Wire.open(), _Wire.open()
        mine = MemStream(self, peer_id, protocol, outgoing=ours, incoming=theirs)
        remote = MemStream(other, self.peer_id, protocol, outgoing=theirs, incoming=ours)
        mine.other, remote.other = remote, mine
        self.streams_open.add(mine)
        other.streams_open.add(remote)
        other._nursery.start_soon(other._serve, handler, remote)
        return mine

    async def _serve(self, handler: StreamHandler, stream: MemStream) -> None:
        try:
            await handler(stream)
        except Exception as exc:
            logger.info("handler for %s from %s raised %r", stream.protocol, stream.remote_peer, exc)
            await stream.reset()
        else:
            await stream.aclose()

    async def request(self, peer_id: str, protocol: str, data: bytes, *, timeout: float | None = None) -> bytes:
        deadline = self.config.stream_timeout_s if timeout is None else timeout
        try:
            with trio.fail_after(deadline):
                stream = await self.open_stream(peer_id, protocol, timeout=deadline)
                async with stream:
                    await stream.send(data)
                    await stream.close_write()
                    try:
                        return await stream.receive(timeout=math.inf)
                    except trio.EndOfChannel:
                        raise PeerUnavailableError(f"{peer_id} ended the {protocol} stream without a reply") from None
        except trio.TooSlowError:
            raise RequestTimeoutError(f"{protocol} request to {peer_id} timed out after {deadline:g} s") from None

    # -- liveness -----------------------------------------------------------------------------

    async def ping(self, peer_id: str, *, timeout: float | None = None) -> float:
        if peer_id not in self._connected:
            await self.dial(peer_id, timeout=timeout)
        started = trio.current_time()
        rtt = 2 * self.network.delay(self.peer_id, peer_id)
        with trio.move_on_after(self.config.stream_timeout_s if timeout is None else timeout) as scope:
            await trio.sleep(rtt)
        if scope.cancelled_caught:
            raise RequestTimeoutError(f"ping to {peer_id} timed out")
        if peer_id not in self._connected:
            raise PeerUnavailableError(f"{peer_id} went away during the ping")
        rtt = trio.current_time() - started
        self._rtt[peer_id] = (rtt, trio.current_time())
        return rtt

    def fresh_rtt(self, peer_id: str, max_age_s: float) -> float | None:
        entry = self._rtt.get(peer_id)
        if entry is None or peer_id not in self._connected or trio.current_time() - entry[1] > max_age_s:
            return None
        return entry[0]

    # -- gossip -------------------------------------------------------------------------------

    async def subscribe(
        self, topic: str, validator: Validator | None = None, *, include_own: bool = False
    ) -> trio.MemoryReceiveChannel[GossipMessage]:
        await trio.lowlevel.checkpoint()
        if validator is not None:
            self._validators[topic] = validator
        send, receive = trio.open_memory_channel[GossipMessage](self.config.subscription_buffer)
        self._subscribers.setdefault(topic, []).append((send, include_own))
        return receive

    def subscribed(self, topic: str) -> bool:
        return bool(self._subscribers.get(topic))

    async def publish(self, topic: str, data: bytes, *, timeout: float | None = None) -> None:
        if len(data) > self.config.gossip_max_message_bytes:
            raise InvalidRequestError(f"message of {len(data)} bytes exceeds {self.config.gossip_max_message_bytes}")
        await trio.lowlevel.checkpoint()
        message = GossipMessage(topic, self.peer_id, bytes(data), next(self._seqno))
        self._note_seen(message)
        self._deliver(message, own=True)
        self._flood(message, came_from=None)

    def _note_seen(self, message: GossipMessage) -> bool:
        key = (message.sender, message.seqno)
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > SEEN_GOSSIP:
            self._seen.popitem(last=False)
        return True

    def _flood(self, message: GossipMessage, came_from: str | None) -> None:
        now = trio.current_time()
        for peer in sorted(self._connected):
            other = self.network.host(peer)
            if peer != came_from and other is not None and other.subscribed(message.topic):
                # In order per link, as over one gossip stream: tasks woken at one instant run
                # in any order, so each message is due a hair after the one before it.
                due = max(now + self.network.delay(self.peer_id, peer), self._gossip_due.get(peer, -math.inf) + 1e-9)
                self._gossip_due[peer] = due
                self._nursery.start_soon(other._arrive, message, self.peer_id, due)

    async def _arrive(self, message: GossipMessage, forwarder: str, due: float) -> None:
        await trio.sleep_until(due)
        if not self.open or forwarder not in self._connected or message.sender in self._banned or not self._note_seen(message):
            return
        validator = self._validators.get(message.topic)
        if validator is not None:
            try:
                verdict = validator(message)
                if inspect.isawaitable(verdict):
                    verdict = await verdict
            except Exception:
                logger.exception("validator for topic %r raised; rejecting the message", message.topic)
                verdict = False
            if not verdict:
                return
        self._deliver(message, own=False)
        self._flood(message, came_from=forwarder)

    def _deliver(self, message: GossipMessage, *, own: bool) -> None:
        for send, include_own in list(self._subscribers.get(message.topic, ())):
            if own and not include_own:
                continue
            try:
                send.send_nowait(message)
            except trio.WouldBlock:
                logger.debug("gossip dropped: a subscriber of %s is full", message.topic)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._subscribers[message.topic].remove((send, include_own))

    # -- lifecycle ----------------------------------------------------------------------------

    async def _keep_bootstrapped(self) -> None:
        peers = [a for a in self.config.bootstrap if "/p2p/" in a]
        while True:
            for addr in peers:
                if addr.rsplit("/p2p/", 1)[-1] not in self._connected:
                    try:
                        await self.connect(addr)
                    except (PeerUnavailableError, RequestTimeoutError) as exc:
                        logger.debug("bootstrap %s: %s", addr, exc)
            await trio.sleep(1.0)

    def _close(self) -> None:
        self.open = False
        for peer in list(self._connected):
            self.disconnect_now(peer)
        for channel in self._event_channels:
            channel.close()
        for subscribers in self._subscribers.values():
            for send, _ in subscribers:
                send.close()


def _as_node_host(host: MemHost) -> NodeHost:
    """Never called: mypy checks here that ``MemHost`` provides the node's narrow API."""
    return host


def _as_stream(stream: MemStream) -> Stream:
    """Never called: mypy checks here that ``MemStream`` is a ``Stream``."""
    return stream


class MemNetwork:
    """Hosts connected in memory, with a delay per link and partitions (module docstring)."""

    def __init__(self, *, delay_s: float = 0.001) -> None:
        self.delay_s = delay_s
        self._hosts: dict[str, MemHost] = {}
        self._numbers = itertools.count(1)
        self._delays: dict[frozenset[str], float] = {}
        self._cut: set[frozenset[str]] = set()

    def host(self, peer_id: str) -> MemHost | None:
        """The open host of ``peer_id``, if any."""
        return self._hosts.get(peer_id)

    def delay(self, a: str, b: str) -> float:
        """One-way delay of the link between ``a`` and ``b`` (seconds)."""
        return self._delays.get(frozenset((a, b)), self.delay_s)

    def set_delay(self, a: str, b: str, seconds: float) -> None:
        self._delays[frozenset((a, b))] = seconds

    def reachable(self, a: str, b: str) -> bool:
        return frozenset((a, b)) not in self._cut

    def partition(self, group_a: Iterable[str], group_b: Iterable[str]) -> None:
        """Cut every link between the two groups of peer ids (see the module docstring)."""
        side_b = list(group_b)
        for a in group_a:
            for b in side_b:
                self._cut.add(frozenset((a, b)))
                host = self._hosts.get(a)
                if host is not None:
                    host.disconnect_now(b)

    def heal(self) -> None:
        """Restore every cut link (connections come back as the nodes redial)."""
        self._cut.clear()

    @asynccontextmanager
    async def open_host(self, config: HostConfig) -> AsyncIterator[MemHost]:
        """A host on this network for ``config`` (its bootstrap, frame and gossip limits and
        timeouts are used; listen addresses, identity, mDNS and the swarm key are not)."""
        async with trio.open_nursery() as nursery:
            host = MemHost(self, config, next(self._numbers), nursery)
            self._hosts[host.peer_id] = host
            nursery.start_soon(host._keep_bootstrapped)
            try:
                yield host
            finally:
                del self._hosts[host.peer_id]
                host._close()
                nursery.cancel_scope.cancel()

    def node(self, options: NodeOptions, engine: Engine | None = None) -> Node:
        """A node on this network, calling its engine inline (for trio's virtual clock)."""
        return Node(options, engine, transport=self.open_host, inline_engine=True)


__all__ = ["MemHost", "MemNetwork", "MemStream"]
