"""Loopback figures for the network shell: the host's own costs, the forwarding overhead, the join.

    python bench/net_bench.py                      # everything in one process, ~1 minute
    python bench/net_bench.py --json               # one JSON object
    python bench/net_bench.py --processes 8 --json # also both node figures with node processes

What it measures
----------------
* **Host** (three in-process hosts, ``--tries`` each): ``connect``; ``request`` (stream open,
  one request and its reply, close; lazily negotiated, see ``peerinfer.net.framing``); the same
  exchange on an eagerly negotiated stream (``open_stream`` waits for multistream-select's two
  round trips); a round trip on an already open stream; ping; gossip one and two hops.
* **Forwarding overhead** (``forward_overhead_p50_ms``; target < 5 ms): two nodes in one
  process, the simulated engine with fast costs. B, alone, caches a 300-word prefix; A joins;
  once A's view of B's digest holds the prefix, ``--rounds`` times, a request for that prefix (distinct suffixes of
  equal length, 2 tokens) goes straight to B, then to A, which forwards it to B. The figure is
  the median of the paired differences of the client-side time to first token (through A minus
  straight to B); also A's time in ``Host.open_stream`` per forward.
* **Join** (``join_confirmed_by_all_s``; target < 1.5 s): ``--members`` nodes in one process,
  joined; a newcomer bootstraps from one of them. The time from the newcomer's ``ready`` (it
  listens) until every member lists it with a confirmed digest (an announcement of it taken in)
  equal to its own; the median of ``--joins`` newcomers, each stopped after its measurement
  (and gone from the members' connections before the next starts).
  Also the time from its start to ``ready``.
* With ``--processes N``: the same two node figures on ``N`` ``peerinfer node`` processes
  (``bench/cluster_bench.py``'s measurements, on an idle cluster of the simulated engine), where
  the nodes do not share one event loop and the machine's scheduling between them shows.

Announce interval 1 s everywhere (the node's default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import trio  # noqa: E402

from peerinfer.client import Client  # noqa: E402
from peerinfer.core.costmodel import CostModel  # noqa: E402
from peerinfer.engine.simulated import SimulatedEngine  # noqa: E402
from peerinfer.net import Host, HostConfig, open_host  # noqa: E402
from peerinfer.node import Node, NodeOptions  # noqa: E402
from peerinfer.node.options import GENERATE_PROTOCOL  # noqa: E402

#: Fast simulated costs: the node's own work, not the model's, dominates what is measured.
COSTS = CostModel(
    prefill_s_per_token=0.0004, cached_s_per_token=0.00001, decode_s_per_token=0.002,
    overhead_s=0.002, slots=1,
)
SHARED = " ".join(f"shared{i}" for i in range(300))
ANNOUNCE_INTERVAL_S = 1.0
FORWARD_TARGET_MS = 5.0
JOIN_TARGET_S = 1.5


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def summary_ms(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": round(pct(xs, 0.5) * 1e3, 2), "p90_ms": round(pct(xs, 0.9) * 1e3, 2)}


def host_cfg() -> HostConfig:
    return HostConfig(
        listen=("/ip4/127.0.0.1/tcp/0",), persist_identity=False, mdns=False, liveness_interval_s=0
    )


def node_options(bootstrap: tuple[str, ...] = (), policy: str = "cost") -> NodeOptions:
    return NodeOptions(
        engine="simulated", listen=("/ip4/127.0.0.1/tcp/0",), mdns=False, persist_identity=False,
        policy=policy, costs=COSTS, announce_interval_s=ANNOUNCE_INTERVAL_S, seed=1,
        bootstrap=bootstrap,
    )


async def echo(stream: Any) -> None:
    async for frame in stream:
        await stream.send(frame)


# -- the host -----------------------------------------------------------------------------------


async def host_figures(tries: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    async with open_host(host_cfg()) as a, open_host(host_cfg()) as b, open_host(host_cfg()) as c:
        out["start_3_hosts_s"] = round(time.perf_counter() - t0, 3)
        b.set_handler("/bench/echo/1", echo)
        t = time.perf_counter()
        await a.connect(b.listen_addrs()[0])
        out["connect_s"] = round(time.perf_counter() - t, 4)
        await c.connect(b.listen_addrs()[0])
        lazy, eager = [], []
        for _ in range(tries):
            t = time.perf_counter()
            await a.request(b.peer_id, "/bench/echo/1", b"x" * 100)
            lazy.append(time.perf_counter() - t)
            t = time.perf_counter()
            async with await a.open_stream(b.peer_id, "/bench/echo/1") as stream:
                await stream.send(b"x" * 100)
                await stream.receive()
            eager.append(time.perf_counter() - t)
        out["request_open_plus_rtt"] = summary_ms(lazy)
        out["eager_open_plus_rtt"] = summary_ms(eager)
        rt = []
        async with await a.open_stream(b.peer_id, "/bench/echo/1") as stream:
            for _ in range(tries):
                t = time.perf_counter()
                await stream.send(b"x" * 100)
                await stream.receive()
                rt.append(time.perf_counter() - t)
        out["round_trip_on_open_stream"] = summary_ms(rt)
        out["ping"] = summary_ms([await a.ping(b.peer_id) for _ in range(tries)])
        topic = "bench"
        at_b = await b.subscribe(topic)
        at_c = await c.subscribe(topic)
        await a.subscribe(topic)
        with trio.fail_after(10):
            while not (b.peer_id in a.mesh_peers(topic) and c.peer_id in b.mesh_peers(topic)):
                await trio.sleep(0.02)
        one_hop, two_hops = [], []
        for i in range(tries):
            t = time.perf_counter()
            await a.publish(topic, str(i).encode())
            await at_b.receive()
            one_hop.append(time.perf_counter() - t)
            await at_c.receive()
            two_hops.append(time.perf_counter() - t)
            await trio.sleep(0.02)
        out["gossip_1_hop"], out["gossip_2_hops"] = summary_ms(one_hop), summary_ms(two_hops)
    return out


# -- forwarding overhead ------------------------------------------------------------------------


async def forward_figures(rounds: int) -> dict[str, Any]:
    opens: list[float] = []
    original = Host.open_stream
    forwarder: list[Host] = []

    async def timed_open(self: Host, peer_id: str, protocol: str, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await original(self, peer_id, protocol, **kwargs)
        finally:
            if forwarder and self is forwarder[0] and protocol == GENERATE_PROTOCOL:
                opens.append(time.perf_counter() - started)

    Host.open_stream = timed_open  # type: ignore[method-assign]
    try:
        async with trio.open_nursery() as nursery:
            b = Node(node_options(policy="longest_prefix"), engine=SimulatedEngine(costs=COSTS))
            await nursery.start(b.serve)
            async with Client.connect(b.addresses()[0]) as to_b:  # alone, B serves it itself
                await to_b.generate(SHARED + " warm", max_tokens=2)
            a = Node(node_options((b.addresses()[0],), policy="longest_prefix"),
                     engine=SimulatedEngine(costs=COSTS))
            await nursery.start(a.serve)
            assert a.host is not None and a.core is not None
            forwarder.append(a.host)
            async with Client.connect(b.addresses()[0]) as to_b, Client.connect(a.addresses()[0]) as to_a:
                with trio.fail_after(30):  # until A's view of B holds the prefix
                    while not any(p.cached_tokens >= 300 for p in a.core.peers(trio.current_time())):
                        await trio.sleep(0.05)
                opens.clear()
                direct: list[float] = []
                via: list[float] = []
                for k in range(rounds):
                    straight = await to_b.generate(SHARED + f" q{k:04d} direct", max_tokens=2)
                    through = await to_a.generate(SHARED + f" q{k:04d} viaaa", max_tokens=2)
                    if through.served_by != b.peer_id or straight.served_by != b.peer_id:
                        raise SystemExit("a request through A was not forwarded to B")
                    direct.append(straight.ttft_s)
                    via.append(through.ttft_s)
            nursery.cancel_scope.cancel()
    finally:
        Host.open_stream = original  # type: ignore[method-assign]
    diffs = [v - d for v, d in zip(via, direct, strict=True)]
    return {
        "rounds": rounds,
        "forward_overhead_p50_ms": round(statistics.median(diffs) * 1e3, 2),
        "forward_overhead_p90_ms": round(pct(diffs, 0.9) * 1e3, 2),
        "direct_ttft": summary_ms(direct),
        "via_ttft": summary_ms(via),
        "forwarder_open_stream": summary_ms(opens),
    }


# -- join ---------------------------------------------------------------------------------------


def _confirmed_by_all(members: list[Node], newcomer: Node) -> bool:
    assert newcomer.core is not None
    own = len(newcomer.core.local.digest) * newcomer.core.hasher.block_size
    for member in members:
        assert member.core is not None
        view = next(
            (p for p in member.core.peers(trio.current_time()) if p.peer_id == newcomer.peer_id), None
        )
        if view is None or view.digest_age_s >= 1e10 or view.cached_tokens != own:
            return False
    return True


async def join_figures(members: int, joins: int) -> dict[str, Any]:
    ready_s: list[float] = []
    confirmed_s: list[float] = []
    async with trio.open_nursery() as nursery:
        nodes: list[Node] = []
        for _ in range(members):
            node = Node(node_options((nodes[0].addresses()[0],) if nodes else ()),
                        engine=SimulatedEngine(costs=COSTS))
            await nursery.start(node.serve)
            nodes.append(node)
        with trio.fail_after(60):  # until the members know each other's digests
            while not all(
                sum(p.digest_age_s < 1e10 for p in n.core.peers(trio.current_time())) >= members - 1  # type: ignore[union-attr]
                for n in nodes
            ):
                await trio.sleep(0.05)
        for k in range(joins):
            await trio.sleep(ANNOUNCE_INTERVAL_S)  # the members settle between newcomers
            newcomer = Node(node_options((nodes[k % members].addresses()[0],)),
                            engine=SimulatedEngine(costs=COSTS))
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as own:
                    started = time.perf_counter()
                    await own.start(newcomer.serve)
                    ready = time.perf_counter()
                    with trio.fail_after(60):
                        while not _confirmed_by_all(nodes, newcomer):
                            await trio.sleep(0.005)
                    confirmed_s.append(time.perf_counter() - ready)
                    ready_s.append(ready - started)
                    scope.cancel()
            gone = newcomer.peer_id
            with trio.move_on_after(10):  # the members saw it leave: no pings to it meanwhile
                while any(gone in n.host.connected_peers() for n in nodes):  # type: ignore[union-attr]
                    await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    return {
        "members": members,
        "joins": joins,
        "join_confirmed_by_all_s": round(statistics.median(confirmed_s), 3),
        "join_confirmed_by_all_each_s": [round(x, 3) for x in confirmed_s],
        "start_to_ready_s": round(statistics.median(ready_s), 3),
    }


# -- the same on node processes -----------------------------------------------------------------


async def process_figures(n: int, samples: int) -> dict[str, Any]:
    from cluster_bench import measure_forward_overhead, measure_join

    from peerinfer.testing.cluster import open_cluster

    def quiet(_line: str) -> None:
        return None

    async with open_cluster(n, announce_interval_s=ANNOUNCE_INTERVAL_S, converge_timeout_s=120) as cluster:
        forward = await measure_forward_overhead(cluster, samples=samples, log=quiet)
        join = await measure_join(cluster, ANNOUNCE_INTERVAL_S, log=quiet)
    return {"nodes": n, "forward_overhead": forward, "join": join}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"note": "in-process hosts and nodes on 127.0.0.1, TCP+Noise+Yamux"}
    out["host"] = await host_figures(args.tries)
    out["forward"] = await forward_figures(args.rounds)
    out["join"] = await join_figures(args.members, args.joins)
    if args.processes:
        out["processes"] = await process_figures(args.processes, args.rounds)
    forward_ms = out["forward"]["forward_overhead_p50_ms"]
    join_s = out["join"]["join_confirmed_by_all_s"]
    out["targets"] = {
        "forward_overhead_p50_ms": {"measured": forward_ms, "target": f"< {FORWARD_TARGET_MS}",
                                    "met": forward_ms < FORWARD_TARGET_MS},
        "join_confirmed_by_all_s": {"measured": join_s, "target": f"< {JOIN_TARGET_S}",
                                    "met": join_s < JOIN_TARGET_S},
    }
    with contextlib.suppress(OSError):
        out["load_average_1m"] = round(__import__("os").getloadavg()[0], 2)
    return out


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tries", type=int, default=50, help="host figures: tries each")
    parser.add_argument("--rounds", type=int, default=40, help="forwarding: paired requests")
    parser.add_argument("--members", type=int, default=4, help="join: nodes already joined")
    parser.add_argument("--joins", type=int, default=5, help="join: newcomers, one at a time")
    parser.add_argument("--processes", type=int, default=0,
                        help="also measure both node figures on this many node processes")
    args = parser.parse_args(argv)
    out = trio.run(main, args)
    if args.json:
        print(json.dumps(out))
    else:
        for section, value in out.items():
            if isinstance(value, dict):
                print(section)
                for k, v in value.items():
                    print(f"  {k:34} {v}")
            else:
                print(f"{section:36} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
