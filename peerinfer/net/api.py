"""The narrow network API a node uses: :class:`NodeHost`, :class:`Stream`, :class:`StreamUse`.

``peerinfer.node`` and ``peerinfer.client`` type their host as :class:`NodeHost`, not as the
libp2p :class:`~peerinfer.net.host.Host`, so that another transport can stand in: the in-memory
one of ``peerinfer.testing.memnet``, under which node tests run on trio's virtual clock. The
libp2p ``Host`` satisfies these protocols (mypy checks it, ``peerinfer.net.host._as_node_host``),
and so does ``MemHost``.

What the node uses, and nothing more (read from ``peerinfer.node`` and ``peerinfer.client``):

=======================  ===========================================================================
identity, addresses      ``peer_id``, ``dialable_addrs``, ``circuit_addrs``, ``known_addrs``
connections              ``add_known_peer``, ``dial``, ``connect``, ``is_connected``,
                         ``is_admitted``, ``connected_peers``, ``peer_events``
bans                     ``ban``, ``unban``, ``banned_peers``
streams                  ``set_handler``, ``open_stream``, ``request``, ``streams.exchange``
liveness                 ``ping``, ``fresh_rtt``
gossip                   ``subscribe``, ``publish``
=======================  ===========================================================================

Reachability (relays, hole punching, UPnP: ``peerinfer.net.reach``) is not in it: it is the
libp2p host's own business, and ``Node`` runs it only on that host.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Protocol, TypeVar

import trio

from peerinfer.net.config import HostConfig
from peerinfer.net.context import PeerEvent
from peerinfer.net.gossip import GossipMessage, Validator

T = TypeVar("T")


class Stream(Protocol):
    """A stream of frames with one peer on one protocol (``peerinfer.net.framing.FramedStream``
    for libp2p). ``receive`` raises ``trio.EndOfChannel`` at a clean end; failures are
    ``peerinfer.errors.RemoteError``s and leave the stream reset."""

    #: The authenticated peer at the other end, and the stream's protocol id.
    remote_peer: str
    protocol: str
    #: Frames ``receive`` returned so far.
    frames_received: int

    async def send(self, data: bytes, *, timeout: float | None = None) -> None: ...

    async def close_write(self) -> None: ...

    async def receive(self, *, timeout: float | None = None, max_bytes: int | None = None) -> bytes: ...

    async def aclose(self) -> None: ...

    async def reset(self) -> None: ...

    @property
    def closed(self) -> bool: ...

    @property
    def reusable(self) -> bool: ...

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def __aenter__(self) -> Stream: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None,
    ) -> None: ...


#: Serves one inbound stream; the host closes it when the handler returns, resets it if it raised.
StreamHandler = Callable[[Stream], Awaitable[None]]


class StreamUse:
    """One attempt's stream (``stream``), with when the attempt began (``started``: before the
    stream was taken or opened, for deadlines and first-token times) and whether it is the
    second try (``retry``). See ``peerinfer.net.streampool``."""

    def __init__(self, stream: Stream, *, started: float, reused: bool, retry: bool) -> None:
        self.stream = stream
        self.started = started
        self.reused = reused
        self.retry = retry
        self._frames_before = stream.frames_received
        self.kept = False

    @property
    def answered(self) -> bool:
        """Whether any frame came back on this attempt."""
        return self.stream.frames_received > self._frames_before

    def keep(self) -> None:
        """The exchange ended cleanly: keep the stream for the next one to the same peer on
        the same protocol (else it is closed at the end of the attempt)."""
        self.kept = True


class StreamExchange(Protocol):
    """``host.streams``: runs an exchange on a stream to a peer (``StreamPool.exchange``)."""

    async def exchange(
        self, peer: str, protocol: str, body: Callable[[StreamUse], Awaitable[T]], *,
        timeout: float, spare: bool = False,
    ) -> T: ...


class NodeHost(Protocol):
    """The host as a node (and a client) uses it; see the module docstring."""

    @property
    def peer_id(self) -> str: ...

    @property
    def streams(self) -> StreamExchange: ...

    def dialable_addrs(self) -> list[str]: ...

    def circuit_addrs(self, peer_id: str) -> list[str]: ...

    def known_addrs(self, peer_id: str) -> list[str]: ...

    def add_known_peer(self, peer_id: str, addrs: Sequence[str]) -> None: ...

    async def dial(self, peer_id: str, *, timeout: float | None = None) -> None: ...

    async def connect(self, maddr: str, *, timeout: float | None = None) -> str: ...

    def is_connected(self, peer_id: str) -> bool: ...

    def is_admitted(self, peer_id: str) -> bool: ...

    def connected_peers(self) -> list[str]: ...

    def peer_events(self) -> trio.MemoryReceiveChannel[PeerEvent]: ...

    def ban(self, peer_id: str) -> None: ...

    def unban(self, peer_id: str) -> None: ...

    def banned_peers(self) -> list[str]: ...

    def set_handler(self, protocol: str, handler: StreamHandler) -> None: ...

    async def open_stream(
        self, peer_id: str, protocol: str, *, timeout: float | None = None, lazy: bool = False
    ) -> Stream: ...

    async def request(self, peer_id: str, protocol: str, data: bytes, *, timeout: float | None = None) -> bytes: ...

    async def ping(self, peer_id: str, *, timeout: float | None = None) -> float: ...

    def fresh_rtt(self, peer_id: str, max_age_s: float) -> float | None: ...

    async def subscribe(
        self, topic: str, validator: Validator | None = None, *, include_own: bool = False
    ) -> trio.MemoryReceiveChannel[GossipMessage]: ...

    async def publish(self, topic: str, data: bytes, *, timeout: float | None = None) -> None: ...


#: Opens a host for a node: ``peerinfer.net.open_host`` (libp2p), or an in-memory network's
#: ``MemNetwork.open_host`` (``peerinfer.testing.memnet``).
Transport = Callable[[HostConfig], AbstractAsyncContextManager[NodeHost]]


__all__ = ["NodeHost", "Stream", "StreamExchange", "StreamHandler", "StreamUse", "Transport"]
