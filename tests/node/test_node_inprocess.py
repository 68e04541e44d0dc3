"""Real nodes (libp2p on 127.0.0.1, the simulated engine) in one process, under trio: what the
node's use of libp2p streams and connections does (stream reuse, replaced connections, redial).

Routing, forwarding, refusals, streaming and failover run on the in-memory network under the
virtual clock: tests/node/test_node_memnet.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio

from peerinfer.client import Client
from peerinfer.core.costmodel import CostModel
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.node import Node, NodeOptions
from peerinfer.testing import inprocess
from peerinfer.testing.inprocess import node_options, open_nodes

# Fast but not instantaneous: prefill dominates, so a cache hit is visible in the timings.
COSTS = CostModel(
    prefill_s_per_token=0.0004, cached_s_per_token=0.00001, decode_s_per_token=0.002,
    overhead_s=0.002, slots=1,
)
SHARED = " ".join(f"shared{i}" for i in range(300))


def options(**overrides: object) -> NodeOptions:
    return node_options(**{"costs": COSTS, "peer_timeout_s": 4.0, **overrides})


@asynccontextmanager
async def cluster(n: int, **overrides: object) -> AsyncIterator[list[Node]]:
    """``n`` nodes in a chain: each bootstraps from the previous one only."""
    def make(i: int, bootstrap: tuple[str, ...]) -> Node:
        return Node(options(bootstrap=bootstrap, **overrides), engine=SimulatedEngine(costs=COSTS))

    async with open_nodes(n, make) as nodes:
        yield nodes


#: A four-node chain converging on a loaded machine: these waits allow a minute.
wait_until = partial(inprocess.wait_until, timeout=60.0)


def addr(node: Node) -> str:
    return node.addresses()[0]


async def _holder_and_asker() -> AsyncIterator[tuple[Node, Node]]:
    """B holds SHARED (cached while alone); A joins and knows it."""
    async with trio.open_nursery() as nursery:
        b = Node(options(), engine=SimulatedEngine(costs=COSTS))
        await nursery.start(b.serve)
        async with Client.connect(addr(b)) as client:
            await client.generate(SHARED + " warm", max_tokens=2)
        a = Node(options(bootstrap=(addr(b),)), engine=SimulatedEngine(costs=COSTS))
        await nursery.start(a.serve)
        await wait_until(
            lambda: any(p.cached_tokens >= 256 for p in a.core.peers(trio.current_time()))  # type: ignore[union-attr]
        )
        try:
            yield b, a
        finally:
            nursery.cancel_scope.cancel()


holder_and_asker = asynccontextmanager(_holder_and_asker)


def _counting_generate_streams() -> tuple[list[str], object]:
    """A stand-in for ``Host.open_stream`` (to monkeypatch in) that records the peer of every
    generate stream it opens, in the list returned beside it, and then opens it."""
    from peerinfer.net import Host
    from peerinfer.node.options import GENERATE_PROTOCOL

    opened: list[str] = []
    original = Host.open_stream

    async def counting(self: Host, peer_id: str, protocol: str, **kwargs: object) -> object:
        if protocol == GENERATE_PROTOCOL:
            opened.append(peer_id)
        return await original(self, peer_id, protocol, **kwargs)  # type: ignore[arg-type]

    return opened, counting


async def test_forwards_to_a_peer_reuse_one_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Consecutive forwards to the same peer go over one kept stream: one stream opened for
    five forwards, each answered by the holder (its authenticated id), nothing failed over."""
    from peerinfer.net import Host

    opened, counting = _counting_generate_streams()

    async with holder_and_asker() as (b, a):
        monkeypatch.setattr(Host, "open_stream", counting)
        async with Client.connect(addr(a)) as client:
            results = [await client.generate(SHARED + f" q{i}", max_tokens=2) for i in range(5)]
        assert all(r.served_by == b.peer_id and r.completion_tokens == 2 for r in results)
        assert opened.count(b.peer_id) == 1  # the client's own stream goes to A, the rest reuse
        assert a.core.statistics().failovers == 0  # type: ignore[union-attr]


async def test_a_kept_stream_the_peer_let_go_costs_no_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder drops its end of the kept stream (its idle timeout) while the asker still
    believes it usable: the next forward fails on it before any answer and goes again on a new
    stream, still to the holder, without a failover."""
    import peerinfer.node.door as door
    from peerinfer.net import FramedStream, Host

    opened, counting = _counting_generate_streams()

    monkeypatch.setattr(door, "GENERATE_IDLE_TIMEOUT_S", 0.05)
    # The asker cannot see that the stream is gone (as when the reset is still on its way).
    monkeypatch.setattr(FramedStream, "reusable", property(lambda self: not self.closed))
    async with holder_and_asker() as (b, a):
        monkeypatch.setattr(Host, "open_stream", counting)
        assert b.host is not None
        async with Client.connect(addr(a)) as client:
            first = await client.generate(SHARED + " one", max_tokens=2)
            # The holder's door gave up waiting for a next request and reset the idle stream
            # (its handler is gone), not a fixed sleep that a loaded machine may outrun.
            await wait_until(lambda: b.host.statistics().handler_streams_running == 0)  # type: ignore[union-attr]
            second = await client.generate(SHARED + " two", max_tokens=2)
        assert first.served_by == b.peer_id and second.served_by == b.peer_id
        # The second forward found the kept stream gone and went again on a new one.
        assert opened.count(b.peer_id) == 2
        assert second.completion_tokens == 2
        stats = a.core.statistics()  # type: ignore[union-attr]
        assert stats.failovers == 0 and stats.served_locally == 0


@pytest.mark.parametrize("replaced", [True, False], ids=["connection-replaced", "peer-failed"])
async def test_a_forward_whose_connection_was_replaced_before_any_answer_goes_again(
    monkeypatch: pytest.MonkeyPatch, replaced: bool
) -> None:
    """A forward's first stream fails before any answer. If the peer's stalled connections
    were replaced by a fresh one meanwhile (as after a healed partition), the failure was the
    dead connection's: the request goes again on a new stream, to the same holder, without a
    failover. Otherwise it is the peer's failure, and the request fails over (here: served by
    the asker itself)."""
    import trio

    from peerinfer.net import Host
    from peerinfer.node.options import GENERATE_PROTOCOL

    original = Host.open_stream
    opened: list[str] = []
    holder = ""

    async def first_one_fails(self: Host, peer_id: str, protocol: str, **kwargs: object) -> object:
        if protocol != GENERATE_PROTOCOL or peer_id != holder:  # (the client's own stream goes to A)
            return await original(self, peer_id, protocol, **kwargs)  # type: ignore[arg-type]
        opened.append(peer_id)
        if len(opened) > 1:
            return await original(self, peer_id, protocol, **kwargs)  # type: ignore[arg-type]
        if replaced:
            self._replaced_at[peer_id] = trio.current_time()  # what _replace_stalled records
        # A protocol nobody speaks: refused, before any answer.
        return await original(self, peer_id, "/peerinfer/nobody-speaks-this/1.0.0", **kwargs)  # type: ignore[arg-type]

    async with holder_and_asker() as (b, a):
        holder = b.peer_id
        monkeypatch.setattr(Host, "open_stream", first_one_fails)
        async with Client.connect(addr(a)) as client:
            result = await client.generate(SHARED + " after the heal", max_tokens=2)
        stats = a.core.statistics()  # type: ignore[union-attr]
        if replaced:
            assert result.served_by == b.peer_id and opened == [b.peer_id, b.peer_id]
            assert stats.failovers == 0
        else:
            assert result.served_by == a.peer_id and opened == [b.peer_id]
            assert stats.failovers == 1


async def test_a_node_lost_is_redialed_without_waiting_for_peer_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    """nodes[2] met nodes[0] through peer exchange (its bootstrap is nodes[1]); their
    connection goes (as after a cut link): they dial each other again by themselves. With the
    periodic peer exchange off, nothing else would (nodes[0]'s gossip still reaches nodes[2]
    through nodes[1], but a peer heard of only through gossip is never dialed for it)."""
    import peerinfer.node.peers as peers

    # Peer exchange runs often until nodes[2] has met nodes[0] (the one exchange at connection
    # can come before nodes[1] knows nodes[0], and then only a later exchange introduces them),
    # and is off from then on: after a pause longer than any sleep begun at the short interval
    # (at most 1.5x it), every exchange loop sleeps at the long one.
    monkeypatch.setattr(peers, "PEER_EXCHANGE_INTERVAL_S", 0.2)
    async with cluster(3) as nodes:
        first, _, last = nodes
        assert first.host is not None and last.host is not None
        await wait_until(lambda: last.host.is_connected(first.peer_id) and last.peers.has_met(first.peer_id))  # type: ignore[union-attr]
        monkeypatch.setattr(peers, "PEER_EXCHANGE_INTERVAL_S", 1e6)
        await trio.sleep(1.0)
        await wait_until(lambda: last.host.is_connected(first.peer_id))  # type: ignore[union-attr]
        await last.host.disconnect(first.peer_id)
        await wait_until(lambda: last.peers.is_lost(first.peer_id) or last.host.is_connected(first.peer_id))  # type: ignore[union-attr]
        await wait_until(lambda: last.host.is_connected(first.peer_id), timeout=30)  # type: ignore[union-attr]
