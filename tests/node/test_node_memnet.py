"""Nodes on the in-memory network (``peerinfer.testing.memnet``), the simulated engine called
inline, under trio's virtual clock: routing, forwarding to the holder of a prefix, refusals,
streaming, failover and the one pinger, as the node does them, without libp2p or real time.

(The same nodes on libp2p over 127.0.0.1: tests/node/test_node_inprocess.py.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trio.testing

from peerinfer.client import Client
from peerinfer.core.costmodel import CostModel
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.errors import InvalidRequestError
from peerinfer.node import Node, NodeOptions
from peerinfer.testing import inprocess
from peerinfer.testing.inprocess import node_options, open_nodes
from peerinfer.testing.memnet import MemNetwork
from peerinfer.types import PeerId

# Fast but not instantaneous: prefill dominates, so a cache hit is visible in the timings.
COSTS = CostModel(
    prefill_s_per_token=0.0004, cached_s_per_token=0.00001, decode_s_per_token=0.002,
    overhead_s=0.002, slots=1,
)
SHARED = " ".join(f"shared{i}" for i in range(300))

#: Virtual seconds: generous, and free.
wait_until = partial(inprocess.wait_until, timeout=60.0)


def options(**overrides: object) -> NodeOptions:
    return node_options(**{"costs": COSTS, "peer_timeout_s": 4.0, **overrides})


@asynccontextmanager
async def cluster(net: MemNetwork, n: int, **overrides: object) -> AsyncIterator[list[Node]]:
    """``n`` nodes in a chain: each bootstraps from the previous one only."""
    def make(i: int, bootstrap: tuple[str, ...]) -> Node:
        return net.node(options(bootstrap=bootstrap, **overrides), SimulatedEngine(costs=COSTS))

    async with open_nodes(n, make) as nodes:
        yield nodes


def addr(node: Node) -> str:
    return node.addresses()[0]


async def test_chain_bootstrap_converges_to_full_membership_and_digests(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemNetwork()
    async with cluster(net, 4) as nodes:
        ids = {n.peer_id for n in nodes}

        def everyone_known() -> bool:
            return all(
                {p.peer_id for p in n.core.peers(trio.current_time())} == ids - {n.peer_id}  # type: ignore[union-attr]
                for n in nodes
            )

        await wait_until(everyone_known)
        async with Client.connect(addr(nodes[0]), transport=net.open_host) as client:
            first = await client.generate(SHARED + " first question", max_tokens=3)
        (holder,) = [n for n in nodes if n.peer_id == first.served_by]
        # Every other node's replica of the holder converges to the holder's own digest.
        await wait_until(
            lambda: all(
                n.core.index.replica(holder.core.peer_id) is not None  # type: ignore[union-attr]
                and set(n.core.index.replica(holder.core.peer_id).digest)  # type: ignore[union-attr]
                == set(holder.core.local.digest)  # type: ignore[union-attr]
                for n in nodes
                if n is not holder
            )
        )
        assert len(holder.core.local.digest) > 0  # type: ignore[union-attr]


async def test_repeated_prefix_is_forwarded_to_the_holder_and_served_from_cache(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemNetwork()
    async with cluster(net, 3) as nodes:
        async with Client.connect(addr(nodes[1]), transport=net.open_host) as client:
            warm = await client.generate(SHARED + " warm up", max_tokens=3)
        (holder,) = [n for n in nodes if n.peer_id == warm.served_by]
        asker = next(n for n in nodes if n is not holder)
        # Wait until the asker knows the holder holds the prefix.
        await wait_until(
            lambda: asker.core.index.replica(holder.core.peer_id) is not None  # type: ignore[union-attr]
            and len(asker.core.index.replica(holder.core.peer_id).digest) > 0  # type: ignore[union-attr]
        )
        async with Client.connect(addr(asker), transport=net.open_host) as client:
            result = await client.generate(SHARED + " another question", max_tokens=3)
        assert result.served_by == holder.peer_id
        assert result.cached_tokens >= 256
        assert result.completion_tokens == 3
        assert result.text


async def test_bad_requests_are_refused_and_the_node_keeps_serving(autojump_clock: trio.testing.MockClock) -> None:
    net = MemNetwork()
    async with cluster(net, 1) as (node,):
        async with Client.connect(addr(node), transport=net.open_host) as client:
            with pytest.raises(InvalidRequestError):
                await client.generate("", max_tokens=3)
            with pytest.raises(InvalidRequestError):
                await client.generate("x " * 9000, max_tokens=3)  # longer than the context
            with pytest.raises(InvalidRequestError):
                await client.generate("hello", max_tokens=0)
            ok = await client.generate("hello there", max_tokens=2)
            assert ok.completion_tokens == 2
            status = await client.status()
            assert status["peer_id"] == node.peer_id
            assert status["cache"]["tokens"] >= 0
            load = status["load"]
            assert load["running"] == load["queued"] == 0 and load["capacity"] == load["slots"] >= 1
            # The three bad requests were refused at the door, before the core counted them.
            assert status["requests"] == {
                "received": 1, "served_locally": 1, "forwarded": 0, "failovers": 0,
                "rejected": 0, "rejected_over_limit": 0,
            }


async def test_streaming_and_chat(autojump_clock: trio.testing.MockClock) -> None:
    net = MemNetwork()
    async with cluster(net, 1) as (node,):
        async with Client.connect(addr(node), transport=net.open_host) as client:
            chunks = [t async for t in client.stream([{"role": "user", "content": "hi"}], max_tokens=5)]
            assert chunks and all(isinstance(t, str) for t in chunks)
            whole = await client.generate([{"role": "user", "content": "hi"}], max_tokens=5)
            assert "".join(chunks) == whole.text


async def test_a_dead_peer_costs_no_request(autojump_clock: trio.testing.MockClock) -> None:
    """The holder of the prefix vanishes; requests routed to it fail over and complete."""
    net = MemNetwork()
    async with trio.open_nursery() as outer:
        survivor = net.node(options(first_token_timeout_s=5.0), SimulatedEngine(costs=COSTS))
        await outer.start(survivor.serve)
        victim_scope = trio.CancelScope()
        victim = net.node(
            # 'local': the warm-up request entering at the victim is served (and cached) there.
            options(bootstrap=(addr(survivor),), first_token_timeout_s=5.0, policy="local"),
            SimulatedEngine(costs=COSTS),
        )

        async def run_victim(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with victim_scope:
                await victim.serve(task_status=task_status)

        await outer.start(run_victim)
        async with Client.connect(addr(victim), transport=net.open_host) as cv:
            await cv.generate(SHARED + " warm", max_tokens=2)
        await wait_until(
            lambda: survivor.core.index.replica(victim.core.peer_id) is not None  # type: ignore[union-attr]
            and len(survivor.core.index.replica(victim.core.peer_id).digest) > 0  # type: ignore[union-attr]
        )
        victim_scope.cancel()
        async with Client.connect(addr(survivor), transport=net.open_host) as cs:
            results = []
            for i in range(4):
                results.append(await cs.generate(SHARED + f" question {i}", max_tokens=2))
        assert all(r.completion_tokens == 2 for r in results)
        assert all(r.served_by == survivor.peer_id for r in results)
        outer.cancel_scope.cancel()


async def test_a_ping_the_core_asks_for_uses_a_fresh_round_trip_of_the_host(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One pinger: the core's ``PingPeer`` is answered from the host's round trip when one was
    measured within ``ping_after_s`` (the liveness loop's, on libp2p), and pings otherwise."""
    net = MemNetwork(delay_s=0.005)
    async with cluster(net, 2) as (a, b):
        assert a.host is not None and a.core is not None
        core = a.core
        await wait_until(lambda: any(p.peer_id == b.peer_id for p in core.peers(trio.current_time())))
        ping_after = core.config.ping_after_s
        net.set_delay(a.peer_id, b.peer_id, 0.020)
        await a.host.ping(b.peer_id)  # what the host's liveness loop does on libp2p
        await trio.sleep(ping_after / 2)  # fresh still
        sent = a.peers.pings_sent
        await a.peers.ping(PeerId(b.peer_id))
        assert a.peers.pings_sent == sent  # answered from the host's table
        (seen,) = [p for p in core.peers(trio.current_time()) if p.peer_id == b.peer_id]
        assert seen.rtt_s is not None and seen.rtt_s > 0.010  # the 40 ms round trip moved it
        await trio.sleep(ping_after / 2 + 0.1)  # the host's figure is stale now
        await a.peers.ping(PeerId(b.peer_id))
        assert a.peers.pings_sent == sent + 1
