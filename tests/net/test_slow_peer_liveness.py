"""Liveness against a peer that is slow but alive (peerinfer.net.liveness, "Slow but alive";
docs/architecture.md): a client on an overloaded machine answers pings late while its
request's tokens keep flowing. Its request must finish; a peer that only pretends to be alive
must still be cut."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from libp2p.peer.id import ID

import peerinfer.net as net
from peerinfer.errors import PeerUnavailableError
from peerinfer.net import FramedStream, Host, PeerEvent
from tests.net.net_helpers import config, wait_until

TOKENS = "/peerinfer/test/tokens/1.0.0"
ROOT = Path(__file__).resolve().parents[2]

#: A client in a process of its own: connects to argv[1], asks for 60 tokens on protocol argv[2],
#: prints the outcome.
CLIENT = """
import sys, trio
import peerinfer.net as net
from tests.net.net_helpers import config

async def main(addr):
    async with net.open_host(config()) as b:
        peer = await b.connect(addr)
        got = 0
        try:
            stream = await b.open_stream(peer, sys.argv[2])
            async with stream:
                await stream.send(b"go")
                for _ in range(60):
                    await stream.receive()
                    got += 1
            print("OK", got, flush=True)
        except Exception as exc:
            print("ERR", got, repr(exc), flush=True)

trio.run(main, sys.argv[1])
"""


async def late_echo(stream: FramedStream) -> None:
    """A ping answer from a loaded machine: every echo comes 0.6 s late (the deadlines here
    are 0.3 s)."""
    async for frame in stream:
        await trio.sleep(0.6)
        await stream.send(frame)


async def never_answer(stream: FramedStream) -> None:
    await trio.sleep_forever()


def tokens_every(count: int, pause: float):  # type: ignore[no-untyped-def]
    async def stream_tokens(stream: FramedStream) -> None:
        """The node's side of a request: ``count`` small frames, one every ``pause`` s."""
        await stream.receive()
        for i in range(count):
            await stream.send(b"token %d" % i)
            await trio.sleep(pause)
    return stream_tokens


async def ask_tokens(client: Host, node: Host, count: int, got: list[bytes] | None = None) -> list[bytes]:
    got = [] if got is None else got
    stream = await client.open_stream(node.peer_id, TOKENS)
    async with stream:
        await stream.send(b"generate")
        for _ in range(count):
            got.append(await stream.receive())
    return got


def drained(events: trio.MemoryReceiveChannel[PeerEvent]) -> list[PeerEvent]:
    seen = []
    while True:
        try:
            seen.append(events.receive_nowait())
        except trio.WouldBlock:
            return seen


async def test_late_pings_of_a_peer_whose_frames_arrive_are_excused() -> None:
    """b (a client) answers pings late; a (the node) streams it tokens meanwhile. b's muxer
    still acknowledges each ping stream at once: frames from b arrive during every ping, so a
    excuses the late pings (no probe, no replacement) and b's request runs on the connection it
    began on."""
    node_cfg = config(liveness_interval_s=0.2, liveness_timeout_s=0.3, replace_stalled_connections=True)
    async with net.open_host(node_cfg) as a, net.open_host(config()) as b:
        a.set_handler(TOKENS, tokens_every(30, 0.05))
        b.set_handler(net.host.PING_PROTOCOL, late_echo)
        await b.connect(a.listen_addrs()[0])
        (first,) = a._live_connections(ID.from_base58(b.peer_id))
        with trio.fail_after(20):
            got = await ask_tokens(b, a, 30)
        assert got == [b"token %d" % i for i in range(30)]
        assert a._liveness.excused[b.peer_id] > 0, "no ping was late: this test shows nothing"
        assert not first.is_closed and a._liveness_failures.get(b.peer_id, 0) == 0


async def test_a_slow_peer_s_request_survives_the_replacement_of_its_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As above, but no late ping is excused (as when b delivered nothing during them): a's
    pings fail, a probes b with a fresh connection, which opens and replaces the old one. The
    old one goes out of libp2p's choice but is retired, not cut: b's stream on it finishes (it
    used to be reset with the connection), then it closes; b is never disconnected."""
    monkeypatch.setattr(net.liveness, "MAX_EXCUSED_PINGS", 0)
    node_cfg = config(liveness_interval_s=0.2, liveness_timeout_s=0.3, replace_stalled_connections=True)
    async with net.open_host(node_cfg) as a, net.open_host(config()) as b:
        events = a.peer_events()
        a.set_handler(TOKENS, tokens_every(50, 0.05))
        b.set_handler(net.host.PING_PROTOCOL, late_echo)
        await b.connect(a.listen_addrs()[0])
        (first,) = a._live_connections(ID.from_base58(b.peer_id))
        with trio.fail_after(20):
            got = await ask_tokens(b, a, 50)
        assert got == [b"token %d" % i for i in range(50)]
        assert a.replaced_since(b.peer_id, 0.0), "no replacement happened: this test shows nothing"
        await wait_until(lambda: first.is_closed)
        assert a.is_connected(b.peer_id)
        seen = drained(events)
        assert not any(e.kind in ("disconnected", "unresponsive") and e.peer_id == b.peer_id for e in seen), seen


async def test_the_client_keeps_a_connection_whose_tokens_flow_though_its_ping_is_late() -> None:
    """The other side: b (a node, loaded) streams a (a client) tokens and answers pings late,
    and dials a anew (as its probe does). a pings its older connection over itself, gets no
    answer in time, but b's tokens arrive on it: it is alive, stays, and a's request finishes
    (a's host used to replace it as silent, resetting its own request)."""
    client_cfg = config(liveness_timeout_s=0.3, replace_stalled_connections=True)
    async with net.open_host(client_cfg) as a, net.open_host(config()) as b:
        b.set_handler(TOKENS, tokens_every(40, 0.05))
        b.set_handler(net.host.PING_PROTOCOL, late_echo)
        await a.connect(b.listen_addrs()[0])
        b_id = ID.from_base58(b.peer_id)
        (first,) = a._live_connections(b_id)
        got: list[bytes] = []

        async def ask() -> None:
            await ask_tokens(a, b, 40, got)

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                await wait_until(lambda: len(got) > 0)
                assert await b._fresh_connection(a.peer_id, 5.0)
                await wait_until(lambda: len(a._live_connections(b_id)) == 2)
        assert got == [b"token %d" % i for i in range(40)]
        assert not first.is_closed


async def test_a_peer_that_keeps_delivering_but_never_answers_is_still_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bound: b never answers a ping but keeps a stream busy (a frame every 0.05 s, for
    ever). a excuses MAX_EXCUSED_PINGS late pings, then counts one failed, replaces the
    connection, and retires the old one: it stays only while the busy stream runs, at most
    DRAIN_MAX_S (1 s here), then it is closed, the stream with it."""
    monkeypatch.setattr(net.liveness, "MAX_EXCUSED_PINGS", 2)
    monkeypatch.setattr(net.connections, "DRAIN_MAX_S", 1.0)
    node_cfg = config(liveness_interval_s=0.2, liveness_timeout_s=0.3, replace_stalled_connections=True)
    async with net.open_host(node_cfg) as a, net.open_host(config()) as b:

        async def swallow(stream: FramedStream) -> None:
            async for _ in stream:
                pass

        a.set_handler(TOKENS, swallow)
        b.set_handler(net.host.PING_PROTOCOL, never_answer)
        await b.connect(a.listen_addrs()[0])
        (first,) = a._live_connections(ID.from_base58(b.peer_id))
        with trio.fail_after(20):
            stream = await b.open_stream(a.peer_id, TOKENS)
            with pytest.raises(PeerUnavailableError):
                while True:
                    await stream.send(b"busy")
                    await trio.sleep(0.05)
        assert first.is_closed


async def test_a_client_process_frozen_for_three_ping_deadlines_keeps_its_request() -> None:
    """The overloaded machine itself: a client in its own process is stopped (SIGSTOP) for
    1.5 s, three ping deadlines, while a streams it tokens. a's ping fails (nothing arrives
    from b meanwhile), its probe's fresh connection opens once b runs again and replaces the old
    one, which carries b's request: retired, not cut, the request finishes (before the change:
    reset after 40-some of 60 tokens)."""
    node_cfg = config(liveness_interval_s=0.5, liveness_timeout_s=0.5, replace_stalled_connections=True)
    async with net.open_host(node_cfg) as a:
        flowing = trio.Event()

        async def stream_tokens(stream: FramedStream) -> None:
            await stream.receive()
            for i in range(60):
                await stream.send(b"token %d" % i)
                if i == 10:
                    flowing.set()
                await trio.sleep(0.05)

        a.set_handler(TOKENS, stream_tokens)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-c", CLIENT, a.listen_addrs()[0], TOKENS], stdout=subprocess.PIPE, cwd=ROOT, env=env
        )
        try:
            with trio.fail_after(60):
                await flowing.wait()
                os.kill(proc.pid, signal.SIGSTOP)
                await trio.sleep(1.5)
                os.kill(proc.pid, signal.SIGCONT)
                assert proc.stdout is not None
                out = b""
                while chunk := await proc.stdout.receive_some():
                    out += chunk
                await proc.wait()
        finally:
            if proc.returncode is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                with trio.move_on_after(5):
                    await proc.wait()
        assert out.decode().strip() == "OK 60"


async def test_a_second_replacement_keeps_its_fresh_connection_at_the_peer() -> None:
    """a replaces its connection to b twice while b's request drains on the first (as when a
    slow client's pings keep failing): b then holds three direct connections, over its limit
    of two, not knowing that a retired two of them. b must not close the newest, a's only
    choice for new streams (it did: a's next ping failed with "No valid connections
    available"; docs/reach.md, "A fresh connection closed right after it replaced a stalled
    one", item 2); it closes the older one without a request, which a retired anyway, and the
    drained one finishes."""
    node_cfg = config(liveness_timeout_s=0.5, replace_stalled_connections=True)
    async with net.open_host(node_cfg) as a, net.open_host(config(replace_stalled_connections=True)) as b:
        a.set_handler(TOKENS, tokens_every(60, 0.05))
        await b.connect(a.listen_addrs()[0])
        b_id = ID.from_base58(b.peer_id)
        (first,) = a._live_connections(b_id)
        got: list[bytes] = []

        async def ask() -> None:
            await ask_tokens(b, a, 60, got)

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                await wait_until(lambda: len(got) > 0)
                for _ in range(2):  # as a's probe does after a failed ping
                    a._liveness_failures[b.peer_id] = 1
                    assert await a._fresh_connection(b.peer_id, 5.0)
                    await wait_until(lambda: a._liveness_failures.get(b.peer_id, 0) == 0)
                (fresh,) = a._network.connections[b_id]
                await trio.sleep(0.5)  # b's limit check and a's retirement of the second one
                assert not fresh.is_closed, "the peer closed the fresh connection"
                assert fresh in a._network.connections.get(b_id, [])
                assert await a.ping(b.peer_id, timeout=2.0) >= 0
                assert not first.is_closed, "the request's connection was cut, not drained"
        assert got == [b"token %d" % i for i in range(60)]
        await wait_until(lambda: first.is_closed)
        assert a.is_connected(b.peer_id)


async def test_a_connection_we_retire_does_not_count_against_the_peer_s_fresh_one() -> None:
    """Both ends replace: a replaces its connection to b (the first drains b's request), a's
    own request to b runs on a's fresh one, then b's probe opens a third and b replaces the two
    it had. a holds three direct connections, but one of them it is retiring itself: it must
    keep b's fresh one, b's only choice for new streams (a closed it, as the newest: b's next
    stream found no valid connection), and every request finishes."""
    cfg = config(liveness_timeout_s=0.5, replace_stalled_connections=True)
    async with net.open_host(cfg) as a, net.open_host(cfg) as b:
        a.set_handler(TOKENS, tokens_every(60, 0.05))
        b.set_handler(TOKENS, tokens_every(60, 0.05))
        await b.connect(a.listen_addrs()[0])
        a_id, b_id = ID.from_base58(a.peer_id), ID.from_base58(b.peer_id)
        b_got: list[bytes] = []
        a_got: list[bytes] = []

        async def b_asks() -> None:
            await ask_tokens(b, a, 60, b_got)

        async def a_asks() -> None:
            await ask_tokens(a, b, 60, a_got)

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(b_asks)
                await wait_until(lambda: len(b_got) > 0)
                a._liveness_failures[b.peer_id] = 1
                assert await a._fresh_connection(b.peer_id, 5.0)
                nursery.start_soon(a_asks)  # on a's fresh connection, its only choice
                await wait_until(lambda: len(a_got) > 0)
                b._liveness_failures[a.peer_id] = 1
                assert await b._fresh_connection(a.peer_id, 5.0)
                await wait_until(lambda: b._liveness_failures.get(a.peer_id, 0) == 0)
                (fresh,) = b._network.connections[a_id]
                await trio.sleep(0.5)  # a's limit check
                assert not fresh.is_closed, "the peer closed the fresh connection"
                assert await b.ping(a.peer_id, timeout=2.0) >= 0
        assert b_got == [b"token %d" % i for i in range(60)]
        assert a_got == [b"token %d" % i for i in range(60)]
        assert a.is_connected(b.peer_id) and len(a._live_connections(b_id)) >= 1


async def test_a_host_that_left_closes_its_connections_and_its_listener() -> None:
    """A client in the node's process (bench/batch_bench.py's) leaves its ``open_host``: the
    node must see its connection close, not ping it until liveness gives up, and a probe must
    not reach the departed host (its listener still accepted and completed the handshake, the
    node counted that as a fresh connection replacing the stalled one, and the departed host's
    stopped swarm closed it at once: the next ping failed with "No valid connections
    available", about one ping deadline after every such replacement)."""
    async with net.open_host(config()) as a:
        async with net.open_host(config()) as b:
            await b.connect(a.listen_addrs()[0])
            b_id = ID.from_base58(b.peer_id)
            (conn,) = a._live_connections(b_id)
        with trio.move_on_after(3):
            while not conn.is_closed:
                await trio.sleep(0.05)
        a._liveness_failures[b.peer_id] = 1
        reached = await a._fresh_connection(b.peer_id, 2.0)
        assert conn.is_closed, "the departed host's connection stayed open"
        assert not reached, "a dial reached the departed host's listener"
