"""Issue 24's KV benchmarks: a small argparse dispatcher, one subcommand per study.

    python bench/kv_bench.py decision   # the pull decision in the simulator: the core against
                                        # always recompute / forward / pull, over link
                                        # bandwidths and loads (docs/evaluation.md)
    python bench/kv_bench.py verify     # the pull verifier's policy: liars caught, honest peers
                                        # spared, cost (docs/performance.md)
    python bench/kv_bench.py pull       # TTFT of pulling a 2,000-token prefix's KV from a peer
                                        # plus the suffix, against a local recompute, on real
                                        # nodes (bench/kv_pull_bench.py; docs/performance.md)
    python bench/kv_bench.py disk       # TTFT of a disk-tier hit on a 2,000-token prefix against
                                        # a recompute, and a restart (bench/kv_disk.py)
    python bench/kv_bench.py verifycost # the pull check's compute on a real engine, against
                                        # the prefill a pull saves (bench/kv_verify_cost.py)

Each subcommand is one function taking the parsed arguments, or a module beside this one with
``add_parser(subparsers)`` (``pull``, ``disk``); add a study by adding a parser and a function
(``SUBCOMMANDS``).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# --------------------------------------------------------------------------- decision


def decision(args: argparse.Namespace) -> None:
    """Mean TTFT of the core's pull decision against the three fixed strategies, per load and
    link bandwidth, in the simulator (the same core decision a real node runs)."""
    from peerinfer.sim.config import SimConfig
    from peerinfer.sim.run import simulate

    strategies: dict[str, dict[str, object]] = {
        "recompute": {"policy": "local"},
        "forward": {"policy": "longest_prefix"},
        "pull": {"policy": "local", "pull": "always"},
        "core": {"policy": "cost", "pull": "auto", "pull_extra_work_weight": args.extra_work_weight},
    }
    if args.with_cost:
        strategies["cost (no pulls)"] = {"policy": "cost"}
    if args.with_greedy:
        # The core before the extra-work charge (PullSettings.extra_work_weight 0).
        strategies["core (greedy)"] = {"policy": "cost", "pull": "auto", "pull_extra_work_weight": 0.0}
    fixed = ("recompute", "forward")  # they never move KV: the link's bandwidth changes nothing
    print(f"# kv_bench decision: {args.nodes} nodes, {args.requests} requests, seed {args.seed}, "
          f"workload {args.workload}, kv {args.kv_bytes} B/token, delay {args.delay_ms} ms, "
          f"disk tier {'on (' + str(args.disk_mb_s) + ' MB/s)' if args.kv_disk else 'off'}, "
          f"core's extra-work weight {args.extra_work_weight:g}; "
          f"load average {os.getloadavg()[0]:.2f}")
    names = list(strategies)
    print("| rate/node | link Mb/s | " + " | ".join(names) + " | core / best of 3 | pulls |")
    print("|---|---|" + "---|" * (len(names) + 2))
    misses: list[str] = []
    beats = 0
    started = time.perf_counter()
    for rate in args.rates:
        cache: dict[str, float] = {}
        for mbps in args.mbps:
            ttft: dict[str, float] = {}
            pulls = 0
            for name, kw in strategies.items():
                if name in fixed and name in cache:
                    ttft[name] = cache[name]
                    continue
                config = SimConfig(
                    nodes=args.nodes, requests=args.requests, seed=args.seed, rate=rate,
                    workload=args.workload, delay_ms=args.delay_ms, link_mbps=mbps,
                    kv_bytes_per_token=args.kv_bytes, kv_disk=args.kv_disk,
                    disk_read_mb_s=args.disk_mb_s, **kw,  # type: ignore[arg-type]
                )
                sim, summary = simulate(config, check=True)
                ttft[name] = float(summary["ttft_mean_s"])
                if name in fixed:
                    cache[name] = ttft[name]
                if name == "core":
                    pulls = sim.kv.pulls if sim.kv is not None else 0
            best = min(ttft["recompute"], ttft["forward"], ttft["pull"])
            ratio = ttft["core"] / best
            if ratio > 1.1:
                misses.append(f"rate {rate}, {mbps:g} Mb/s: {ratio:.3f}")
            if ttft["core"] < best:
                beats += 1
            cells = " | ".join(f"{ttft[n]:.3f}" for n in names)
            print(f"| {rate:g} | {mbps:g} | {cells} | {ratio:.3f} | {pulls} |", flush=True)
    print(f"# points over 1.1x the best of the three: {len(misses)} {misses}")
    print(f"# points where the core beats all three: {beats}")
    print(f"# wall {time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.2f}")


# --------------------------------------------------------------------------- verify


def _token_values(rng: random.Random, width: int) -> list[float]:
    """One token's KV values, as a model writes them (roughly normal, a few large)."""
    return [rng.gauss(0.0, 1.0) * (4.0 if rng.random() < 0.02 else 1.0) for _ in range(width)]


def _honest_noise(values: list[float], rng: random.Random, ulps: float) -> list[float]:
    """A recompute of the same token on the same engine: each value off by up to ``ulps``
    units in the last place of bfloat16 (8 significant bits), as batching or thread counts
    change the order of float sums."""
    step = 2.0 ** -8
    return [v + v * step * rng.uniform(-ulps, ulps) for v in values]


def _altered(values: list[float], scale: float, rng: random.Random, strength: float) -> list[float]:
    """A liar's token: a tenth of its values (at least one) moved by ``strength`` times the
    block's scale."""
    out = list(values)
    moved = [i for i in range(len(out)) if rng.random() < 0.1] or [rng.randrange(len(out))]
    for i in moved:
        out[i] += strength * scale * rng.choice((-1.0, 1.0))
    return out


#: The liars the bench models, by name: (share of blocks altered, 0 for exactly one; whether
#: only one token of them is altered, else every token of each).
LIARS = {
    "5% of blocks": (0.05, False),
    "20% of blocks": (0.2, False),
    "1 block": (0.0, False),
    "1 token": (0.0, True),
}


def verify(args: argparse.Namespace) -> None:
    """Drive the core's verifier (``PullVerifier``) and trust (``Trust.on_pull_checked``) with
    modelled peers: honest ones whose tokens' KV matches the recompute up to float noise, liars
    that alter every token of a share of each pull's blocks, or one token of one block; count
    catches, false bans and the recompute cost."""
    from peerinfer.core.costmodel import DEFAULT_COSTS
    from peerinfer.core.kvpull import PullSettings, PullVerifier
    from peerinfer.core.node import NodeConfig, PullChecked
    from peerinfer.core.node.trust import Trust
    from peerinfer.types import PeerId

    settings = PullSettings(verify_rate=args.rate, verify_tolerance=args.tolerance,
                            verify_min_blocks=args.min_blocks,
                            verify_granularity=args.granularity)
    costs = DEFAULT_COSTS
    bs = args.block_size
    print(f"# kv_bench verify: {settings.verify_granularity} granularity, runs of {args.run_tokens} "
          f"token(s), rate "
          f"{settings.verify_rate} of the tokens, at least {settings.verify_min_blocks} "
          f"block(s) a pull, tolerance {settings.verify_tolerance}, {bs}-token blocks, "
          f"{args.width} values a token (model), honest noise up to {args.ulps} bf16 ulps, "
          f"liar strength {args.strength}; load average {os.getloadavg()[0]:.2f}")

    def one_pull(verifier: PullVerifier, blocks: int, bad: dict[int, set[int] | None],
                 rng: random.Random) -> tuple[bool, int]:
        """One pull checked: ``bad`` maps an altered block to its altered token offsets (None:
        all of them). The block's scale is modelled as 4 (the few large values)."""
        picked = verifier.sample(blocks, bs, args.run_tokens)
        errors = []
        for t in picked:
            b, o = divmod(t, bs)
            pulled = _token_values(rng, args.width)
            recomputed = _honest_noise(pulled, rng, args.ulps)
            scale = max(4.0, max(abs(v) for v in pulled))
            offsets = bad.get(b, set())
            if offsets is None or o in offsets:
                pulled = _altered(pulled, scale, rng, args.strength)
            diff = max(abs(x - y) for x, y in zip(pulled, recomputed, strict=True))
            errors.append((t, diff / scale))
        return verifier.judge(errors, bs).ok, len(picked)

    def liar_blocks(blocks: int, share: float, one_token: bool,
                    rng: random.Random) -> dict[int, set[int] | None]:
        count = max(1, round(share * blocks)) if share > 0 else 1
        chosen = rng.sample(range(blocks), min(count, blocks))
        return {b: {rng.randrange(bs)} if one_token else None for b in chosen}

    print("\n| pull tokens | liar alters | caught within 20 pulls (of runs) | median pulls to catch |")
    print("|---|---|---|---|")
    for tokens in args.pull_tokens:
        blocks = tokens // bs
        for name in args.liars:
            share, one_token = LIARS[name]
            caught = 0
            to_catch: list[int] = []
            for run in range(args.runs):
                rng = random.Random(f"liar/{tokens}/{name}/{run}")
                config = NodeConfig(peer_id=PeerId(f"verifier-{run}"), kv_pull=settings)
                trust = Trust(config)
                verifier = trust.pull_verifier
                assert verifier is not None
                liar = PeerId("liar")
                for k in range(1, args.max_pulls + 1):
                    bad = liar_blocks(blocks, share, one_token, rng)
                    ok, _ = one_pull(verifier, blocks, bad, rng)
                    ban = trust.on_pull_checked(PullChecked(liar, ok, ""), float(k))
                    if ban is not None:
                        to_catch.append(k)
                        if k <= 20:
                            caught += 1
                        break
            median = statistics.median(to_catch) if to_catch else math.inf
            print(f"| {tokens} | {name} | {caught}/{args.runs} = {caught / args.runs:.1%} | {median} |")

    print("\n| pull tokens | honest pulls | honest peers penalized | tokens recomputed | "
          "verify compute / compute saved (model) |")
    print("|---|---|---|---|---|")
    for tokens in args.pull_tokens:
        blocks = tokens // bs
        rng = random.Random(f"honest/{tokens}")
        trust = Trust(NodeConfig(peer_id=PeerId("verifier"), kv_pull=settings))
        verifier = trust.pull_verifier
        assert verifier is not None
        peers = [PeerId(f"honest-{j}") for j in range(args.honest_peers)]
        penalized: set[PeerId] = set()
        checked = 0
        for k in range(args.honest_pulls):
            peer = peers[k % len(peers)]
            ok, n = one_pull(verifier, blocks, {}, rng)
            checked += n
            if trust.on_pull_checked(PullChecked(peer, ok, ""), float(k)) is not None or not ok:
                penalized.add(peer)
        # Recomputing a token costs its prefill (the model; the engines' measured cost is
        # ``verifycost``); a pull saves the prefill of every pulled token, less what reading
        # it from the cache costs.
        verify_s = checked * costs.prefill_s_per_token
        saved_s = args.honest_pulls * tokens * (costs.prefill_s_per_token - costs.cached_s_per_token)
        print(f"| {tokens} | {args.honest_pulls} | {len(penalized)} | {checked} | "
              f"{verify_s / saved_s:.1%} |")


# --------------------------------------------------------------------------- dispatcher


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("decision", help="the pull decision against fixed strategies (simulator)")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--requests", type=int, default=800)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workload", default="mmlu")
    p.add_argument("--delay-ms", default="5", help="one-way link delay spec (peerinfer.sim.network)")
    p.add_argument("--rates", type=_floats, default=[0.1, 0.25, 0.4],
                   help="arrivals per second per node, comma-separated")
    p.add_argument("--mbps", type=_floats, default=[10, 30, 100, 300, 1000, 3000, 10000],
                   help="link bandwidths in Mb/s, comma-separated")
    p.add_argument("--kv-bytes", type=int, default=46_000, help="KV bytes per token")
    p.add_argument("--kv-disk", action="store_true", help="holders serve pulls from a disk tier")
    p.add_argument("--disk-mb-s", type=float, default=500.0, help="the disk tier's read rate")
    p.add_argument("--with-cost", action="store_true", help="also the cost policy without pulls")
    p.add_argument("--with-greedy", action="store_true",
                   help="also the core without the extra-work charge (weight 0)")
    p.add_argument("--extra-work-weight", type=float, default=None,
                   help="the core's PullSettings.extra_work_weight (default: PullSettings')")
    p.set_defaults(run=decision)

    p = sub.add_parser("verify", help="the pull verifier: liars caught, honest spared, cost")
    p.add_argument("--rate", type=float, default=None, help="share of tokens checked (default: the core's)")
    p.add_argument("--tolerance", type=float, default=None)
    p.add_argument("--min-blocks", type=int, default=None)
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--max-pulls", type=int, default=200)
    p.add_argument("--pull-tokens", type=_ints, default=[2000, 512, 192])
    p.add_argument("--liars", type=lambda t: [x for x in t.split(",") if x], default=list(LIARS),
                   help=f"which liars, comma-separated, of {list(LIARS)}")
    p.add_argument("--granularity", default=None, help="token or block (default: the core's)")
    p.add_argument("--run-tokens", type=int, default=1,
                   help="checked tokens come in runs of this many (the engine's verify_run_tokens: "
                        "1 on both engines; llama.cpp's runs before its one-batch check: 4)")
    p.add_argument("--honest-pulls", type=int, default=1000)
    p.add_argument("--honest-peers", type=int, default=10)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--width", type=int, default=8, help="values per modelled token")
    p.add_argument("--ulps", type=float, default=4.0, help="honest recompute noise, bf16 ulps")
    p.add_argument("--strength", type=float, default=0.1,
                   help="a liar's change, times the block's largest value")
    p.set_defaults(run=verify)

    import kv_disk
    import kv_pull_bench
    import kv_verify_cost

    kv_pull_bench.add_parser(sub)
    kv_disk.add_disk_parser(sub)
    kv_verify_cost.add_parser(sub)

    args = parser.parse_args(argv)
    if args.command == "decision" and args.extra_work_weight is None:
        from peerinfer.core.kvpull import PullSettings

        args.extra_work_weight = PullSettings().extra_work_weight
    if args.command == "verify":
        from peerinfer.core.kvpull import PullSettings

        d = PullSettings()
        args.rate = d.verify_rate if args.rate is None else args.rate
        args.tolerance = d.verify_tolerance if args.tolerance is None else args.tolerance
        args.min_blocks = d.verify_min_blocks if args.min_blocks is None else args.min_blocks
        args.granularity = d.verify_granularity if args.granularity is None else args.granularity
        unknown = [n for n in args.liars if n not in LIARS]
        if unknown:
            parser.error(f"unknown liars {unknown}; known: {list(LIARS)}")
    run: Callable[[argparse.Namespace], None] = args.run
    run(args)


SUBCOMMANDS = ("decision", "verify", "pull", "disk", "verifycost")

if __name__ == "__main__":
    main()
