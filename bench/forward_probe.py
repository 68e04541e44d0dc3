"""Where a forwarded request's extra time goes, with two nodes in one process (one trio loop).

Run ``python bench/forward_probe.py``. Two real nodes (libp2p on 127.0.0.1, the simulated engine
with fast costs) share a prefix held by B; each round asks B directly, then asks A, which forwards
to B. It prints the median and p90 of both times to first token, of their paired difference, and
of the time A's shell spends in ``Host.open_stream`` for each forward (timed by wrapping it).

In one process there is no scheduling between processes, so this is the floor of the forwarding
overhead that ``bench/cluster_bench.py`` measures with one process per node.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

from peerinfer.client import Client  # noqa: E402
from peerinfer.core.costmodel import CostModel  # noqa: E402
from peerinfer.engine.simulated import SimulatedEngine  # noqa: E402
from peerinfer.net import Host  # noqa: E402
from peerinfer.node import Node, NodeOptions  # noqa: E402
from peerinfer.node.options import GENERATE_PROTOCOL  # noqa: E402

COSTS = CostModel(
    prefill_s_per_token=0.0004, cached_s_per_token=0.00001, decode_s_per_token=0.002,
    overhead_s=0.002, slots=1,
)
SHARED = " ".join(f"shared{i}" for i in range(300))


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def probe(rounds: int) -> None:
    opens: list[float] = []
    original = Host.open_stream

    async def timed_open(self: Host, peer_id: str, protocol: str, **kwargs: object) -> object:
        started = time.perf_counter()
        try:
            return await original(self, peer_id, protocol, **kwargs)  # type: ignore[arg-type]
        finally:
            # A's forwards only (not the clients' streams, nor pings).
            if len(nodes) == 2 and self is nodes[1].host and protocol == GENERATE_PROTOCOL:
                opens.append(time.perf_counter() - started)

    nodes: list[Node] = []
    Host.open_stream = timed_open  # type: ignore[method-assign,assignment]
    try:
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                options = NodeOptions(
                    engine="simulated", listen=("/ip4/127.0.0.1/tcp/0",), mdns=False,
                    persist_identity=False, policy="longest_prefix", costs=COSTS,
                    announce_interval_s=0.3, seed=1,
                    bootstrap=(nodes[0].addresses()[0],) if nodes else (),
                )
                node = Node(options, engine=SimulatedEngine(costs=COSTS))
                await nursery.start(node.serve)
                nodes.append(node)
                if len(nodes) == 1:  # B, alone, caches the prefix itself
                    async with Client.connect(node.addresses()[0]) as to_b:
                        await to_b.generate(SHARED + " warm", max_tokens=2)
            b, a = nodes
            async with Client.connect(b.addresses()[0]) as to_b, \
                    Client.connect(a.addresses()[0]) as to_a:
                with trio.fail_after(30):  # until A's view of B holds the prefix
                    while not any(
                        p.cached_tokens >= 300 for p in a.core.peers(trio.current_time())  # type: ignore[union-attr]
                    ):
                        await trio.sleep(0.05)
                opens.clear()
                direct: list[float] = []
                via: list[float] = []
                for k in range(rounds):
                    t0 = time.perf_counter()
                    await to_b.generate(SHARED + f" q{k} direct", max_tokens=1)
                    t1 = time.perf_counter()
                    result = await to_a.generate(SHARED + f" q{k} viaaa", max_tokens=1)
                    t2 = time.perf_counter()
                    if result.served_by != b.peer_id:
                        raise SystemExit("a request through A was not forwarded to B")
                    direct.append(t1 - t0)
                    via.append(t2 - t1)
            nursery.cancel_scope.cancel()
    finally:
        Host.open_stream = original  # type: ignore[method-assign]
    diff = [v - d for v, d in zip(via, direct, strict=True)]
    print(f"{rounds} rounds, two nodes in one process (p50 / p90, ms)")
    for name, values in (("direct TTFT", direct), ("through A", via), ("difference", diff),
                         ("A's open_stream", opens)):
        print(f"  {name:16} {1000 * statistics.median(values):7.2f} / {1000 * _p(values, 0.9):7.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args(argv)
    trio.run(probe, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
