"""``FramedStream``: one libp2p stream carrying length-prefixed frames, every step on a deadline.

Wire format: each frame is an unsigned LEB128 varint length followed by that many bytes (the
same framing libp2p uses for its own protocols). The receiver refuses a length above its limit
*before* reading the body, so a peer cannot make us buffer more than ``max_frame_bytes`` plus
one read chunk.

Deadlines: every ``send``, every ``receive`` (the whole frame, not each byte, so a slow-loris
sending one byte a second still runs out of time) and the stream opening in ``Host.open_stream``
run under ``trio.fail_after``. py-libp2p's stream reads have no deadline of their own, and a
hung (SIGSTOPped) peer keeps its TCP connection open, so without them a task would wait forever.

Failure means the stream is unusable: on a timeout, a malformed or oversized frame or a reset by
the peer, the stream is reset before the error is raised (``RequestTimeoutError``,
``ProtocolError``, ``PeerUnavailableError``). A clean end of stream at a frame boundary is not
an error: ``receive`` raises ``trio.EndOfChannel``, like a trio channel, and ``async for`` stops.

py-libp2p 0.8.1's yamux drops a stream's state when a reset (RST) arrives and then reports a
plain end of stream; we tell the two apart by the ``reset_received`` flag left on the yamux
stream object (so a reset is ``PeerUnavailableError``, not ``EndOfChannel``). Protocols should
still end with an explicit final frame (a "done" message): a peer that closes cleanly in the
middle of an answer, having given up, is indistinguishable from one that finished.

Lazy protocol negotiation (``Host.open_stream(..., lazy=True)``): multistream-select costs two
round trips before the first byte of a protocol can move (the multistream header, then the
protocol id, each answered by the listener). A stream opened lazily writes both proposals in
front of its first frame, in one write, and reads and checks the listener's two answers before
its first frame in: the request travels with the negotiation, one round trip instead of three
(go-libp2p's "lazy" client negotiation does the same). The listener is standard libp2p: it
answers the header, then the protocol id, and only then hands the stream, our frame already in
its buffer, to the handler. A refused protocol ("na") surfaces at the first ``receive`` as
``PeerUnavailableError`` (the listener never gives the bytes after a refused proposal to a
handler: it reads them as another proposal, which fails, and resets the stream).

Use: at most one task sending and one task receiving at a time. ``async with stream:`` closes
it on exit, or resets it when the body raised.
"""

from __future__ import annotations

import logging
from types import TracebackType

import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.protocol_muxer.multiselect import MULTISELECT_PROTOCOL_ID, PROTOCOL_NOT_FOUND_MSG
from libp2p.utils.varint import encode_delim, encode_uvarint

from peerinfer.errors import (
    ClosedError,
    InvalidRequestError,
    PeerUnavailableError,
    ProtocolError,
    RemoteError,
)
from peerinfer.net._errors import translated

logger = logging.getLogger(__name__)

#: How much we ask the muxer for at once (it returns what is buffered, up to this).
READ_CHUNK = 64 * 1024
#: A varint longer than this cannot encode a 64-bit length.
MAX_VARINT_BYTES = 10
#: Closing or resetting writes one muxer frame; on a hung connection even that can block.
CLOSE_TIMEOUT_S = 1.0
#: The largest multistream-select answer we read during a lazy negotiation (a protocol id).
MAX_NEGOTIATION_BYTES = 1024


def _parse_varint(buffer: bytearray) -> tuple[int, int] | None:
    """``(value, length)`` of the varint at the start of ``buffer``, or None if incomplete."""
    value = 0
    for i, byte in enumerate(buffer[:MAX_VARINT_BYTES]):
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value, i + 1
    if len(buffer) >= MAX_VARINT_BYTES:
        raise ProtocolError("frame length prefix is longer than 10 bytes")
    return None


def peer_id_text(net_stream: INetStream) -> str:
    """The base58 id of the peer at the other end of a libp2p stream."""
    return net_stream.muxed_conn.peer_id.to_base58()


class FramedStream:
    """A bidirectional stream of frames with one peer, on one protocol."""

    def __init__(
        self,
        net_stream: INetStream,
        *,
        max_frame_bytes: int,
        timeout_s: float,
        negotiate: str | None = None,
    ) -> None:
        """``negotiate``: a protocol id to negotiate lazily (see the module docstring) on a
        stream fresh from the muxer; None for a stream already negotiated."""
        self._stream = net_stream
        self._max_frame_bytes = max_frame_bytes
        self._timeout_s = timeout_s
        self._buffer = bytearray()
        self._pending_length: int | None = None
        self._done = False
        #: Frames ``receive`` returned so far (``StreamUse.answered``: did any answer come?).
        self.frames_received = 0
        #: The verified peer id at the other end (proven by the Noise handshake).
        self.remote_peer: str = peer_id_text(net_stream)
        #: Lazy negotiation: the proposals not written yet, and whether the answers are due.
        self._proposal = b""
        self._answers_due = False
        if negotiate is not None:
            self._proposal = encode_delim(MULTISELECT_PROTOCOL_ID.encode()) + encode_delim(negotiate.encode())
            self._answers_due = True
            net_stream.set_protocol(TProtocol(negotiate))
        #: The protocol id of this stream (negotiated, or being negotiated lazily).
        self.protocol: str = str(net_stream.get_protocol())

    def __repr__(self) -> str:
        return f"<FramedStream {self.protocol} with {self.remote_peer}>"

    # -- sending ------------------------------------------------------------------------------

    async def send(self, data: bytes, *, timeout: float | None = None) -> None:
        """Send one frame; wait at most ``timeout`` (default: the host's stream timeout)."""
        if self._done:
            raise ClosedError(f"{self!r} is closed")
        if len(data) > self._max_frame_bytes:
            raise InvalidRequestError(f"frame of {len(data)} bytes exceeds {self._max_frame_bytes}")
        deadline = self._timeout_s if timeout is None else timeout
        try:
            with translated("send", self.remote_peer, deadline), trio.fail_after(deadline):
                proposal, self._proposal = self._proposal, b""
                await self._stream.write(proposal + encode_uvarint(len(data)) + bytes(data))
        except RemoteError:
            await self.reset()
            raise

    async def close_write(self) -> None:
        """Half-close: the peer's ``receive`` raises ``EndOfChannel`` once it has read all."""
        try:
            with translated("close_write", self.remote_peer, CLOSE_TIMEOUT_S):
                with trio.fail_after(CLOSE_TIMEOUT_S):
                    await self._write_proposal()
                    # NetStream has close_write (a yamux FIN); the INetStream interface does not.
                    close_write = getattr(self._stream, "close_write", None)
                    await (self._stream.close() if close_write is None else close_write())
        except RemoteError:
            await self.reset()
            raise

    # -- receiving ----------------------------------------------------------------------------

    async def receive(self, *, timeout: float | None = None, max_bytes: int | None = None) -> bytes:
        """The next frame. Raises ``trio.EndOfChannel`` at a clean end of stream.

        ``timeout`` bounds the whole frame (default: the host's stream timeout); ``max_bytes``
        lowers the frame limit for this read.
        """
        if self._done:
            raise ClosedError(f"{self!r} is closed")
        limit = self._max_frame_bytes if max_bytes is None else min(max_bytes, self._max_frame_bytes)
        deadline = self._timeout_s if timeout is None else timeout
        try:
            with translated("receive", self.remote_peer, deadline), trio.fail_after(deadline):
                if self._answers_due:
                    await self._read_answers()
                frame = await self._read_frame(limit)
            self.frames_received += 1
            return frame
        except RemoteError:
            await self.reset()
            raise

    async def _write_proposal(self) -> None:
        proposal, self._proposal = self._proposal, b""
        if proposal:
            await self._stream.write(proposal)

    async def _read_answers(self) -> None:
        """Lazy negotiation: check the listener's answers to our two proposals."""
        await self._write_proposal()  # a receive before any send
        for wanted in (MULTISELECT_PROTOCOL_ID, self.protocol):
            try:
                answer = await self._read_frame(MAX_NEGOTIATION_BYTES)
            except trio.EndOfChannel:
                raise PeerUnavailableError(
                    f"{self.remote_peer} ended the stream while negotiating {self.protocol}"
                ) from None
            if answer == PROTOCOL_NOT_FOUND_MSG.encode() + b"\n":
                raise PeerUnavailableError(f"{self.remote_peer} refused the protocol {self.protocol}")
            if answer != wanted.encode() + b"\n":
                raise ProtocolError(
                    f"{self.remote_peer} answered {answer[:64]!r} to the proposal {wanted!r}"
                )
        self._answers_due = False

    async def _read_frame(self, limit: int) -> bytes:
        while True:
            if self._pending_length is None:
                parsed = _parse_varint(self._buffer)
                if parsed is not None:
                    length, used = parsed
                    del self._buffer[:used]
                    if length > limit:
                        raise ProtocolError(f"{self.remote_peer} announced a {length}-byte frame; limit {limit}")
                    self._pending_length = length
            if self._pending_length is not None and len(self._buffer) >= self._pending_length:
                frame = bytes(self._buffer[: self._pending_length])
                del self._buffer[: self._pending_length]
                self._pending_length = None
                return frame
            try:
                chunk = await self._stream.read(READ_CHUNK)
            except StreamEOF:
                chunk = b""
            if not chunk:
                if self._reset_by_peer():
                    raise PeerUnavailableError(f"stream reset by {self.remote_peer}")
                if self._pending_length is None and not self._buffer:
                    raise trio.EndOfChannel
                raise ProtocolError(f"{self.remote_peer} ended the stream inside a frame")
            self._buffer += chunk

    def _reset_by_peer(self) -> bool:
        # py-libp2p's yamux forgets a stream once a RST arrives and then reports a plain EOF;
        # the flag on the muxed stream object is the only trace left of the reset.
        muxed = getattr(self._stream, "muxed_stream", None)
        return bool(getattr(muxed, "reset_received", False))

    def __aiter__(self) -> FramedStream:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    # -- closing ------------------------------------------------------------------------------

    async def widen_receive_window(self, nbytes: int) -> bool:
        """Let the peer send ``nbytes`` more ahead of our reads on this stream, for good (bulk
        transfers: ``peerinfer.net.muxer.widen_receive_window``); after the first frame went.
        The window update is a write: a reset or broken stream raises a peerinfer error, as
        ``send`` does, never the muxer's own."""
        from peerinfer.net import muxer

        with translated("window", self.remote_peer):
            return await muxer.widen_receive_window(self._stream, nbytes)

    async def aclose(self) -> None:
        """Close both directions politely (our pending writes are flushed). Idempotent."""
        if self._done:
            return
        self._done = True
        with trio.move_on_after(CLOSE_TIMEOUT_S) as scope:
            scope.shield = True
            try:
                await self._stream.close()
            except Exception as exc:  # closing a broken stream: nothing left to do
                logger.debug("closing %r: %r", self, exc)
                await self._reset_quietly()

    async def reset(self) -> None:
        """Abort the stream in both directions (the peer sees a reset). Idempotent."""
        if self._done:
            return
        self._done = True
        await self._reset_quietly()

    async def _reset_quietly(self) -> None:
        with trio.move_on_after(CLOSE_TIMEOUT_S) as scope:
            scope.shield = True
            try:
                await self._stream.reset()
            except Exception as exc:  # the connection is already gone
                logger.debug("resetting %r: %r", self, exc)

    @property
    def closed(self) -> bool:
        """Whether we closed or reset this stream (not whether the peer did)."""
        return self._done

    @property
    def reusable(self) -> bool:
        """Whether the stream can carry another exchange as far as we can tell without I/O:
        neither side closed or reset it, no frame is half read or unread, negotiation is done."""
        if self._done or self._buffer or self._pending_length is not None or self._answers_due:
            return False
        muxed = getattr(self._stream, "muxed_stream", None)
        if getattr(getattr(muxed, "muxed_conn", None), "is_closed", False):
            return False  # its connection went (closed under it, replaced)
        return not any(
            getattr(muxed, flag, False) for flag in ("closed", "send_closed", "recv_closed", "reset_received")
        )

    async def __aenter__(self) -> FramedStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            await self.aclose()
        else:
            await self.reset()


__all__ = ["FramedStream", "peer_id_text"]
