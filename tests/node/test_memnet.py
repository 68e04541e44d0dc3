"""The in-memory network itself (``peerinfer.testing.memnet``), under trio's virtual clock:
link delays, partitions, stream ends and errors, gossip flooding and validation, bans."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio
import trio.testing

from peerinfer.errors import PeerUnavailableError, ProtocolError, RequestTimeoutError
from peerinfer.net import GossipMessage, HostConfig, Stream
from peerinfer.testing.memnet import MemHost, MemNetwork

ECHO = "/test/echo/1"


def config(**overrides: object) -> HostConfig:
    return HostConfig(**{"persist_identity": False, "mdns": False, **overrides})  # type: ignore[arg-type]


@asynccontextmanager
async def hosts(net: MemNetwork, n: int, *, chain: bool = False) -> AsyncIterator[list[MemHost]]:
    """``n`` hosts; with ``chain`` each bootstraps from the one before it (else none connect)."""
    async with AsyncExitStack() as stack:
        made: list[MemHost] = []
        for _ in range(n):
            bootstrap = (made[-1].address,) if chain and made else ()
            made.append(await stack.enter_async_context(net.open_host(config(bootstrap=bootstrap))))
        yield made


async def echo(stream: Stream) -> None:
    async for frame in stream:
        await stream.send(frame)


async def test_frames_and_pings_take_the_link_delay(autojump_clock: trio.testing.MockClock) -> None:
    net = MemNetwork(delay_s=0.010)
    async with hosts(net, 3) as (a, b, c):
        net.set_delay(a.peer_id, c.peer_id, 0.100)
        for host in (b, c):
            host.set_handler(ECHO, echo)
        await a.dial(b.peer_id)
        await a.dial(c.peer_id)
        assert a.connected_peers() == sorted([b.peer_id, c.peer_id])
        for peer, one_way in ((b.peer_id, 0.010), (c.peer_id, 0.100)):
            start = trio.current_time()
            assert await a.request(peer, ECHO, b"hi") == b"hi"
            assert trio.current_time() - start == pytest.approx(2 * one_way)
            assert await a.ping(peer) == pytest.approx(2 * one_way)
            assert a.fresh_rtt(peer, 1.0) == pytest.approx(2 * one_way)
        await trio.sleep(2.0)
        assert a.fresh_rtt(b.peer_id, 1.0) is None  # too old


async def test_a_partition_cuts_connections_and_streams_until_healed(autojump_clock: trio.testing.MockClock) -> None:
    net = MemNetwork()
    async with hosts(net, 2) as (a, b):
        b.set_handler(ECHO, echo)
        events = a.peer_events()
        await a.dial(b.peer_id)
        assert (await events.receive()).kind == "connected"
        stream = await a.open_stream(b.peer_id, ECHO)
        await stream.send(b"one")
        assert await stream.receive() == b"one"
        net.partition([a.peer_id], [b.peer_id])
        assert (await events.receive()).kind == "disconnected"
        assert not a.is_connected(b.peer_id) and not b.is_connected(a.peer_id)
        with pytest.raises(PeerUnavailableError):
            await stream.receive()
        with pytest.raises(PeerUnavailableError):
            await a.dial(b.peer_id)
        with pytest.raises(PeerUnavailableError):
            await a.ping(b.peer_id)
        net.heal()
        await a.dial(b.peer_id)
        assert await a.request(b.peer_id, ECHO, b"two") == b"two"


async def test_bootstrap_redials_after_a_partition_heals(autojump_clock: trio.testing.MockClock) -> None:
    net = MemNetwork()
    async with hosts(net, 2, chain=True) as (a, b):
        with trio.fail_after(5):
            while not b.is_connected(a.peer_id):
                await trio.sleep(0.1)
        net.partition([b.peer_id], [a.peer_id])
        assert not b.is_connected(a.peer_id)
        await trio.sleep(5.0)
        assert not b.is_connected(a.peer_id)
        net.heal()
        with trio.fail_after(2):
            while not b.is_connected(a.peer_id):
                await trio.sleep(0.1)


async def test_stream_ends_refusals_timeouts_and_oversized_frames(autojump_clock: trio.testing.MockClock) -> None:
    net = MemNetwork()
    async with hosts(net, 2) as (a, b):

        async def silent(stream: Stream) -> None:
            await trio.sleep(100)

        async def raises(stream: Stream) -> None:
            await stream.receive()
            raise RuntimeError("a handler bug")

        async def answers_then_ends(stream: Stream) -> None:
            await stream.receive()
            await stream.send(b"x" * 100)

        b.set_handler("/silent", silent)
        b.set_handler("/raises", raises)
        b.set_handler("/ends", answers_then_ends)
        with pytest.raises(PeerUnavailableError, match="refused the protocol"):
            await a.open_stream(b.peer_id, "/nobody")
        with pytest.raises(RequestTimeoutError):
            await a.request(b.peer_id, "/silent", b"?", timeout=3.0)
        with pytest.raises(PeerUnavailableError, match="reset"):
            await a.request(b.peer_id, "/raises", b"?")
        stream = await a.open_stream(b.peer_id, "/ends")
        await stream.send(b"?")
        with pytest.raises(ProtocolError):
            await stream.receive(max_bytes=10)
        assert stream.closed
        stream = await a.open_stream(b.peer_id, "/ends")
        await stream.send(b"?")
        assert await stream.receive() == b"x" * 100
        with pytest.raises(trio.EndOfChannel):
            await stream.receive()


async def test_gossip_floods_a_chain_once_and_a_validator_stops_it(autojump_clock: trio.testing.MockClock) -> None:
    net = MemNetwork()
    async with hosts(net, 4, chain=True) as chain:
        with trio.fail_after(5):
            while not all(h.is_connected(n.peer_id) for h, n in zip(chain, chain[1:], strict=False)):
                await trio.sleep(0.1)
        refused: list[GossipMessage] = []

        def third_refuses(message: GossipMessage) -> bool:
            if message.data == b"bad":
                refused.append(message)
                return False
            return True

        inboxes = [await chain[0].subscribe("t", include_own=True)]
        inboxes.append(await chain[1].subscribe("t"))
        inboxes.append(await chain[2].subscribe("t", third_refuses))
        inboxes.append(await chain[3].subscribe("t"))
        await chain[0].publish("t", b"good")
        await chain[0].publish("t", b"bad")
        await trio.sleep(1.0)
        got = [[m.data for m in drain(inbox)] for inbox in inboxes]
        # The origin (include_own), then each hop once; the fourth host is reached through the
        # third only, which refused "bad".
        assert got == [[b"good", b"bad"], [b"good", b"bad"], [b"good"], [b"good"]]
        assert [m.sender for m in refused] == [chain[0].peer_id]


def drain(inbox: trio.MemoryReceiveChannel[GossipMessage]) -> list[GossipMessage]:
    out = []
    while True:
        try:
            out.append(inbox.receive_nowait())
        except trio.WouldBlock:
            return out


async def test_a_ban_disconnects_and_refuses(autojump_clock: trio.testing.MockClock) -> None:
    net = MemNetwork()
    async with hosts(net, 2) as (a, b):
        await a.dial(b.peer_id)
        a.ban(b.peer_id)
        assert not a.is_connected(b.peer_id) and a.banned_peers() == [b.peer_id]
        with pytest.raises(PeerUnavailableError):
            await b.dial(a.peer_id)
        a.unban(b.peer_id)
        await b.dial(a.peer_id)
        assert a.is_connected(b.peer_id)
