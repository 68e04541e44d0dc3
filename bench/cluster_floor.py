"""How low can any router take the 3-node cluster bench's mean TTFT, against ``random``?

bench/cluster_bench.py measures ``cost`` over ``random`` on real llama.cpp nodes (issue 20's
target: <= 0.5 on 3 nodes, MMLU, Zipf). Real runs take half an hour each, so this asks the
question where it is cheap: the simulator, which drives the same node core with the llama.cpp
engine's calibrated costs (the ``llamacpp`` preset), replays the bench's workload family, and
has an ``oracle`` policy: a central router with exact, instant knowledge of every cache and
queue. The oracle's mean TTFT over ``random``'s is a bound no peer-to-peer router reaches, so a
workload where it stays above 0.5 is one where the target is out of any router's reach.

The oracle still estimates as ``cost`` does and decides one request at a time, so it bounds
what knowledge buys, not what any schedule could do. The ``floor`` column is a bound on every
policy, given the cost model: each request costs at least its prefill on an idle node with the
longest prefix it shares with any earlier request already cached (the first request of a
subject shares only the chat template with the others), with no queue and no link. It takes
every earlier prompt as cached, so it is tight only where the caches hold everything (the
``unbounded`` points, as on the real nodes); with a small cache it is still a bound, but a
loose one (it ignores eviction), and only the oracle speaks there.

The grid varies what could widen the gap: the skew, the run's length, each node's prefix cache
(``none``: unbounded, as on the real nodes, whose 1 GiB budget holds every subject's prefix),
and the arrival rate. Each point is the mean over ``--seeds`` seeds (workload, arrivals and
routing randomness all change with the seed).

    python bench/cluster_floor.py --data ../shared/data/mmlu --seeds 5
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peerinfer.engine.simulated import SimulatedEngine  # noqa: E402
from peerinfer.sim import SimConfig  # noqa: E402
from peerinfer.sim.costs import COST_PRESETS  # noqa: E402
from peerinfer.sim.run import sim_requests, simulate  # noqa: E402
from peerinfer.workload import default_data_dir  # noqa: E402

POLICIES = ("oracle", "cost", "random")
#: (skew, requests, cache tokens or None, per-node arrival rate): the bench's own point first.
DEFAULT_GRID = (
    ("zipf:1.1", 40, None, 0.035),
    ("zipf:1.1", 100, None, 0.035),
    ("zipf:1.1", 300, None, 0.035),
    ("zipf:1.1", 100, None, 0.07),
    ("zipf:1.1", 100, None, 0.015),
    ("zipf:1.5", 100, None, 0.035),
    ("zipf:0.6", 300, None, 0.035),
    ("uniform", 300, None, 0.035),
    ("zipf:1.1", 100, 4096, 0.035),
    ("zipf:1.1", 300, 2048, 0.035),
    ("zipf:1.1", 300, 1024, 0.035),
    ("uniform", 300, 2048, 0.035),
)


def point_config(policy: str, skew: str, requests: int, cache: int | None, rate: float, seed: int,
                 nodes: int, data: str | None) -> SimConfig:
    return SimConfig(
        nodes=nodes, requests=requests, policy=policy, delay_ms="0.5", cache_tokens=cache,
        costs=COST_PRESETS["llamacpp"], costs_source="llamacpp", rate=rate, workload="mmlu",
        skew=skew, data=data, max_tokens=8, seed=seed,
    )


def mean_ttft(config: SimConfig) -> float:
    _sim, summary = simulate(config)
    return float(summary["ttft_mean_s"])


_MOD = (1 << 61) - 1


def _prefix_hashes(tokens: tuple[int, ...]) -> list[int]:
    """A polynomial hash of each prefix, ``out[k]`` for ``tokens[:k]``."""
    out, h = [0], 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % _MOD
        out.append(h)
    return out


def floor_ttft(config: SimConfig) -> float:
    """The mean over the workload of each request's least possible TTFT (the module docstring)."""
    costs = config.costs
    seen: set[int] = set()
    total = 0.0
    requests = sim_requests(config, SimulatedEngine(costs=costs))
    for request in requests:
        hashes = _prefix_hashes(request.tokens)
        # Every prefix of an earlier prompt is in ``seen``, so "shared" is monotone in k.
        lo, hi = 0, len(request.tokens)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid] in seen:
                lo = mid
            else:
                hi = mid - 1
        total += costs.prefill_s(len(request.tokens), lo)
        seen.update(hashes[1:])
    return total / len(requests)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--seeds", type=int, default=5, help="seeds per point, 1..K (default 5)")
    p.add_argument("--data", help="MMLU directory (default: the full set beside the checkout, else the packaged excerpt)")
    p.add_argument("--quick", action="store_true", help="only the bench's own point (zipf:1.1, 40 requests)")
    p.add_argument("--json", action="store_true", help="one JSON object per point instead of a table")
    args = p.parse_args(argv)
    # None: the packaged MMLU excerpt (a checkout without the full set beside it).
    full = args.data if args.data is not None else default_data_dir()
    data = None if full is None else str(full)
    grid = DEFAULT_GRID[:1] if args.quick else DEFAULT_GRID
    if not args.json:
        print("| skew | requests | cache tokens | rate/node | floor / random | oracle / random | cost / random | cost / oracle | random mean TTFT (s) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    lowest = float("inf")
    for skew, requests, cache, rate in grid:
        sums = dict.fromkeys(POLICIES, 0.0)
        floor = 0.0
        for policy, seed in itertools.product(POLICIES, range(1, args.seeds + 1)):
            config = point_config(policy, skew, requests, cache, rate, seed, args.nodes, data)
            sums[policy] += mean_ttft(config)
            if policy == "random":
                floor += floor_ttft(config)
        oracle, cost, rnd = (sums[k] for k in POLICIES)
        if cache is None:
            lowest = min(lowest, floor / rnd)
        row = {"skew": skew, "requests": requests, "cache_tokens": cache, "rate": rate,
               "floor_over_random": round(floor / rnd, 3), "oracle_over_random": round(oracle / rnd, 3), "cost_over_random": round(cost / rnd, 3),
               "cost_over_oracle": round(cost / oracle, 3), "random_ttft_mean_s": round(rnd / args.seeds, 3)}
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"| {skew} | {requests} | {cache or 'unbounded'} | {rate} | {row['floor_over_random']} | {row['oracle_over_random']} | "
                  f"{row['cost_over_random']} | {row['cost_over_oracle']} | {row['random_ttft_mean_s']} |", flush=True)
    print(f"lowest floor / random where the caches hold everything: {lowest:.3f} "
          "(the target: cost / random <= 0.5)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
