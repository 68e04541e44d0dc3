"""``peerinfer.net.streampool``: one attempt (``use``) takes a kept stream or opens one, keeps
it after ``keep()``, closes it otherwise, resets it on failure; ``exchange`` repeats once, on
a new stream, an attempt whose stream was gone before any answer, and only then."""

from __future__ import annotations

import pytest
import trio

from peerinfer.errors import PeerUnavailableError, ProtocolError
from peerinfer.net import FramedStream, open_host
from peerinfer.net.streampool import StreamGoneEarly, StreamUse
from tests.net.net_helpers import config, wait_until

ECHO = "/test/pooled-echo/1.0.0"


async def test_an_exchange_kept_serves_the_next_one_and_one_not_kept_is_closed() -> None:
    handled: list[FramedStream] = []

    async def echo(stream: FramedStream) -> None:
        handled.append(stream)
        async for frame in stream:
            await stream.send(frame)

    async with open_host(config()) as a, open_host(config()) as b:
        b.set_handler(ECHO, echo)
        await a.connect(b.listen_addrs()[0])
        streams: list[FramedStream] = []

        async def once(use: StreamUse, keep: bool = True) -> bytes:
            streams.append(use.stream)
            await use.stream.send(b"ping")
            answer = await use.stream.receive()
            if keep:
                use.keep()
            return answer

        assert await a.streams.exchange(b.peer_id, ECHO, once, timeout=5.0) == b"ping"
        assert a.streams.has(b.peer_id, ECHO)
        assert await a.streams.exchange(b.peer_id, ECHO, once, timeout=5.0) == b"ping"
        assert streams[0] is streams[1] and len(handled) == 1  # one stream for both

        async def without_keep(use: StreamUse) -> bytes:
            return await once(use, keep=False)

        assert await a.streams.exchange(b.peer_id, ECHO, without_keep, timeout=5.0) == b"ping"
        assert streams[2] is streams[0] and streams[2].closed  # taken, then closed, not kept
        assert not a.streams.has(b.peer_id, ECHO)


async def test_a_kept_stream_gone_before_any_answer_is_tried_once_more_on_a_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The peer drops the kept stream; we cannot tell without I/O (``reusable`` stands in):
    the attempt on it fails before any answer and the body runs again on a new stream."""
    monkeypatch.setattr(FramedStream, "reusable", property(lambda self: not self.closed))
    served: list[FramedStream] = []

    async def one_answer_then_drop(stream: FramedStream) -> None:
        served.append(stream)
        frame = await stream.receive()
        await stream.send(frame)
        await stream.reset()

    async with open_host(config()) as a, open_host(config()) as b:
        b.set_handler(ECHO, one_answer_then_drop)
        await a.connect(b.listen_addrs()[0])
        tries: list[tuple[bool, bool]] = []

        async def once(use: StreamUse) -> bytes:
            tries.append((use.reused, use.retry))
            await use.stream.send(b"hello")
            answer = await use.stream.receive()
            use.keep()
            return answer

        assert await a.streams.exchange(b.peer_id, ECHO, once, timeout=5.0) == b"hello"
        await wait_until(lambda: len(served) == 1 and served[0].closed)
        await trio.sleep(0.1)  # the reset reaches us
        assert await a.streams.exchange(b.peer_id, ECHO, once, timeout=5.0) == b"hello"
        assert tries == [(False, False), (True, False), (False, True)]
        assert len(served) == 2


async def test_a_failure_after_an_answer_or_on_a_new_stream_is_not_tried_again() -> None:
    async def two_answers_then_reset(stream: FramedStream) -> None:
        for _ in range(2):
            await stream.send(await stream.receive())
        await stream.reset()

    async with open_host(config()) as a, open_host(config()) as b:
        b.set_handler(ECHO, two_answers_then_reset)
        await a.connect(b.listen_addrs()[0])
        calls = 0

        async def kept(use: StreamUse) -> bytes:
            await use.stream.send(b"one")
            answer = await use.stream.receive()
            use.keep()
            return answer

        async def answer_then_more(use: StreamUse) -> bytes:
            nonlocal calls
            calls += 1
            assert use.reused
            await use.stream.send(b"two")
            await use.stream.receive()
            return await use.stream.receive()  # the peer reset the stream after its answer

        await a.streams.exchange(b.peer_id, ECHO, kept, timeout=5.0)
        # Failed on a kept stream, but after an answer: the peer's failure, no second try.
        with pytest.raises(PeerUnavailableError):
            await a.streams.exchange(b.peer_id, ECHO, answer_then_more, timeout=5.0)
        assert calls == 1

        # A new stream (not kept) failing before any answer is the peer's failure: no retry.
        async def no_answer(use: StreamUse) -> bytes:
            nonlocal calls
            calls += 1
            raise PeerUnavailableError("as if reset before any answer")

        calls = 0
        with pytest.raises(PeerUnavailableError):
            await a.streams.exchange(b.peer_id, ECHO, no_answer, timeout=5.0)
        assert calls == 1

        # A peer that ends the stream cleanly before the exchange is done fails it with our
        # error, not trio's EndOfChannel.
        async def end_early(stream: FramedStream) -> None:
            await stream.receive()

        b.set_handler(ECHO, end_early)

        async def waits_for_an_answer(use: StreamUse) -> bytes:
            await use.stream.send(b"anyone?")
            return await use.stream.receive()

        with pytest.raises(PeerUnavailableError, match="before the exchange was done"):
            await a.streams.exchange(b.peer_id, ECHO, waits_for_an_answer, timeout=5.0)

        # Whatever the body raises, the stream is reset, never kept.
        async def breaks_contract(use: StreamUse) -> bytes:
            use.keep()
            raise ProtocolError("a bad answer")

        with pytest.raises(ProtocolError):
            await a.streams.exchange(b.peer_id, ECHO, breaks_contract, timeout=5.0)
        assert not a.streams.has(b.peer_id, ECHO)


async def test_use_raises_stream_gone_early_only_for_a_kept_stream_without_an_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(FramedStream, "reusable", property(lambda self: not self.closed))

    async def echo(stream: FramedStream) -> None:
        async for frame in stream:
            await stream.send(frame)

    async with open_host(config()) as a, open_host(config()) as b:
        b.set_handler(ECHO, echo)
        await a.connect(b.listen_addrs()[0])
        async with a.streams.use(b.peer_id, ECHO, timeout=5.0) as use:
            await use.stream.send(b"x")
            assert await use.stream.receive() == b"x"
            use.keep()
        with pytest.raises(StreamGoneEarly):
            async with a.streams.use(b.peer_id, ECHO, timeout=5.0) as use:
                assert use.reused
                raise PeerUnavailableError("the peer let it go")
        assert use.stream.closed
        with pytest.raises(PeerUnavailableError):  # a retry never raises StreamGoneEarly
            async with a.streams.use(b.peer_id, ECHO, timeout=5.0, retry=True) as use:
                raise PeerUnavailableError("gone again")
