"""Simulator benchmark: simulated requests per second of wall time, and how it scales with nodes.

Run ``python bench/sim_bench.py`` for a table, ``--json`` for one JSON object::

    {"runs": [{"nodes": 4, "requests": ..., "wall_s": ..., "requests_per_wall_s": ...,
               "events_per_wall_s": ..., "us_per_request_per_node": ...}, ...],
     "requests_per_wall_s_64_nodes": ..., "projected_wall_s_64_nodes_100k": ...,
     "params": {...}}

What is timed
-------------
Whole ``peerinfer sim`` runs (setup, event loop and summary; figures off): the default MMLU
workload (Zipf 1.1 over 57 subjects, 5-shot prefixes), Poisson arrivals at the default rate (0.25
requests per node per second), the default cost model, 8,192-token caches, 5 ms links, the
``cost`` policy, seed 1. The requests per run grow
with the node count (``--requests-per-node``, default 60, so every node serves a comparable share
and the caches warm up alike); ``--full`` adds the headline run, 64 nodes and 100,000 requests
(long on a 2-core machine: see docs/evaluation.md).

Where the time goes: every announcement is applied by every other node to its replica of the
sender (``Replica.apply_announce``: the replica's flat set and root summary, and ``PeerIndex``
upkeep), so the work per simulated request grows with the number of nodes;
``us_per_request_per_node`` shows that constant (docs/evaluation.md, "Simulator speed").
Announcements that change nothing wait until the recipient next reads its index
(``NodeConfig.lazy_announcements``, the default), and a delay group's run of them is shared
(``AnnounceRun``: a node following it is not handed them one by one); ``--eager`` takes every
one in at once and ``--no-share`` hands every one to every node, for comparisons (the
decisions are the same). ``peak_rss_mb`` is the process's peak resident size.
``--profile`` prints the top functions of the largest run (cProfile, which inflates small
calls); ``--sample`` instead samples the Python stack on a 2 ms CPU timer (``SIGPROF``; the
kernel's tick may deliver it less often, about every 4 ms on a 250 Hz kernel) and prints
the functions most often running (self) and on the stack (inclusive), the figures that add up
to the run's CPU. ``cpu_s`` is the run's CPU time
(``time.process_time``) and ``cpu_us_per_request_per_node`` that divided by requests x nodes:
on a shared machine the CPU figures are the ones to compare. ``--no-holders`` routes over
every peer (``NodeConfig.route_among_holders=False``; the same decisions). ``core`` says which
core ran: the compiled one after ``make native`` (peerinfer/native.py; 1.14-1.24x faster, the same
decisions), else the pure Python one and why.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import resource
import signal
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peerinfer import native  # noqa: E402
from peerinfer.sim.config import SimConfig  # noqa: E402
from peerinfer.sim.run import simulate  # noqa: E402

BASE = SimConfig(requests=0, cache_tokens=8192, delay_ms="5", skew="zipf:1.1", policy="cost", seed=1)


class _Sampler:
    """On a timer of the process's CPU (2 ms; the kernel's tick may deliver it less often), the
    running Python stack, as ``file:function`` names
    (a dataclass's generated ``__init__`` named with its caller). Unix only (``SIGPROF``)."""

    def __init__(self, every_s: float = 0.002) -> None:
        self.every_s = every_s
        self.stacks: list[tuple[str, ...]] = []

    def _take(self, signum: int, frame: object) -> None:
        names = []
        f = frame
        while f is not None:
            code = f.f_code  # type: ignore[attr-defined]
            name = f"{Path(code.co_filename).name}:{code.co_name}"
            if code.co_filename == "<string>" and f.f_back is not None:  # type: ignore[attr-defined]
                back = f.f_back.f_code  # type: ignore[attr-defined]
                name += f"@{Path(back.co_filename).name}:{back.co_name}"
            names.append(name)
            f = f.f_back  # type: ignore[attr-defined]
        self.stacks.append(tuple(names))

    def __enter__(self) -> _Sampler:
        self._before = signal.signal(signal.SIGPROF, self._take)
        signal.setitimer(signal.ITIMER_PROF, self.every_s, self.every_s)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, self._before)

    def report(self, top: int = 40) -> str:
        n = len(self.stacks) or 1
        own = Counter(s[0] for s in self.stacks if s)
        on_stack = Counter(name for s in self.stacks for name in set(s))
        lines = [f"{len(self.stacks)} samples, timer {self.every_s * 1e3:g} ms of CPU", "self:"]
        lines += [f"  {100 * c / n:6.2f}% {name}" for name, c in own.most_common(top)]
        lines.append("inclusive:")
        lines += [f"  {100 * c / n:6.2f}% {name}" for name, c in on_stack.most_common(2 * top)]
        return "\n".join(lines)


def bench_one(
    nodes: int, requests: int, profile: bool = False, sample: bool = False, **overrides: object
) -> tuple[dict[str, Any], str]:
    config = replace(BASE, nodes=nodes, requests=requests, **overrides)  # type: ignore[arg-type]
    prof = cProfile.Profile() if profile else None
    sampler = _Sampler() if sample else None
    if prof:
        prof.enable()
    cpu_started = time.process_time()
    if sampler is not None:
        with sampler:
            _, s = simulate(config)
    else:
        _, s = simulate(config)
    cpu_s = time.process_time() - cpu_started
    text = ""
    if prof:
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
        text = buf.getvalue()
    if sampler is not None:
        text = sampler.report()
    row = {
        "nodes": nodes,
        "requests": requests,
        "wall_s": s["wall_s"],
        "loop_s": s["loop_s"],
        "setup_s": s["setup_s"],
        "virtual_s": s["virtual_s"],
        "events": s["events"],
        "requests_per_wall_s": round(requests / s["wall_s"], 1),
        "events_per_wall_s": round(s["events"] / s["wall_s"]),
        "announce_deliveries": s["anti_entropy"]["announce_deliveries"],
        # the bytes every announcement's recipients were sent (its msgpack frame's length each)
        "announce_bytes": s["anti_entropy"]["announce_bytes"],
        "us_per_request_per_node": round(1e6 * s["wall_s"] / requests / nodes, 1),
        # CPU time of the whole run (set-up, loop, summary), the fairer figure on a shared machine
        "cpu_s": round(cpu_s, 2),
        "cpu_us_per_request_per_node": round(1e6 * cpu_s / requests / nodes, 2),
        "ttft_mean_s": s["ttft_mean_s"],
        "hit_ratio": s["hit_ratio"],
        # with churn (--crash-rate, --join-rate): requests lost must be 0
        **({"churn": s["churn"]} if "churn" in s else {}),
        # The process's peak so far (Linux reports KiB): an upper bound for this run's.
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        # which core ran: "compiled (mypyc)" after make native, else "pure Python (why)"
        "core": native.describe(),
    }
    return row, text


def _report_progress(every_s: float) -> None:
    """Print, every ``every_s`` seconds from a daemon thread, the running simulation's completed
    requests and virtual time, the process's CPU and peak RSS (stderr; read-only: the thread
    only reads attributes the loop sets, so the run is the same)."""
    import threading

    from peerinfer.sim import run as run_module

    running: list[object] = []
    base = run_module.Simulation  # type: ignore[attr-defined]

    class _Watched(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            running.append(self)

    run_module.Simulation = _Watched  # type: ignore[attr-defined]
    started = time.perf_counter()

    def report() -> None:
        while True:
            time.sleep(every_s)
            if not running:
                continue
            sim = running[-1]
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            print(
                f"progress: wall {time.perf_counter() - started:.0f} s, cpu "
                f"{time.process_time():.1f} s, completed {sim.completed}/{sim.total}, "  # type: ignore[attr-defined]
                f"virtual {sim.now:.1f} s, peak rss {rss:.0f} MB",  # type: ignore[attr-defined]
                file=sys.stderr, flush=True,
            )

    threading.Thread(target=report, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--nodes", default="4,16,64", help="comma-separated node counts (default 4,16,64)"
    )
    parser.add_argument("--requests-per-node", type=int, default=60)
    parser.add_argument("--full", action="store_true", help="also 64 nodes x 100,000 requests")
    parser.add_argument("--profile", action="store_true", help="profile the largest run")
    parser.add_argument(
        "--sample", action="store_true",
        help="sample the largest run's stack on a 2 ms CPU timer (stderr; beside --json too)",
    )
    parser.add_argument(
        "--requests", type=int, default=0,
        help="requests per run (default: nodes x --requests-per-node)",
    )
    parser.add_argument("--skew", default=BASE.skew, help=f"workload skew (default {BASE.skew})")
    parser.add_argument(
        "--eager", action="store_true",
        help="take in every announcement at once (NodeConfig.lazy_announcements=False)",
    )
    parser.add_argument("--crash-rate", type=float, default=0.0,
                        help="churn: crashes per node-hour (peerinfer.sim.churn)")
    parser.add_argument("--join-rate", type=float, default=0.0,
                        help="churn: joins per node-hour")
    parser.add_argument(
        "--no-holders", action="store_true",
        help="route over every peer (NodeConfig.route_among_holders=False)",
    )
    parser.add_argument(
        "--no-share", action="store_true",
        help="hand every announcement to every node (Simulation.share_runs=False)",
    )
    parser.add_argument(
        "--progress", type=float, default=0.0, metavar="SECONDS",
        help="every SECONDS of wall time, print to stderr how far the run got (requests "
        "completed, virtual time, CPU, peak RSS): a long run stopped by a timeout still says",
    )
    args = parser.parse_args(argv)
    if args.progress > 0:
        _report_progress(args.progress)
    churn = {"crash_rate": args.crash_rate, "join_rate": args.join_rate}
    sizes = [int(x) for x in args.nodes.split(",")]
    plan = [(n, args.requests or n * args.requests_per_node) for n in sizes]
    if args.eager or args.no_holders:
        from peerinfer.sim import simulator

        simulator.Simulation.node_overrides = {
            "lazy_announcements": not args.eager, "route_among_holders": not args.no_holders,
        }
    if args.no_share:
        from peerinfer.sim import simulator as sim_module

        sim_module.Simulation.share_runs = False
    if args.full:
        plan.append((64, 100_000))
    rows = []
    profile_text = ""
    for i, (n, r) in enumerate(plan):
        row, text = bench_one(
            n, r, profile=args.profile and i == len(plan) - 1,
            sample=args.sample and i == len(plan) - 1, skew=args.skew, **churn
        )
        rows.append(row)
        profile_text = text or profile_text
        if not args.json:
            print(
                f"nodes {n:>4}  requests {r:>7}  wall {row['wall_s']:>8.2f} s  "
                f"{row['requests_per_wall_s']:>8.1f} req/s  {row['events_per_wall_s']:>8} events/s  "
                f"{row['us_per_request_per_node']:>7.1f} us/request/node",
                flush=True,
            )
    out: dict[str, Any] = {
        "runs": rows,
        "params": {**BASE.to_dict(), "skew": args.skew, "lazy_announcements": not args.eager,
                   **churn,
                   "share_runs": not args.no_share,
                   "route_among_holders": not args.no_holders,
                   "requests": args.requests or "nodes x per-node"},
    }
    r64 = [r for r in rows if r["nodes"] == 64]
    if r64:
        best = max(r64, key=lambda r: r["requests"])
        out["requests_per_wall_s_64_nodes"] = best["requests_per_wall_s"]
        out["projected_wall_s_64_nodes_100k"] = round(100_000 / best["requests_per_wall_s"])
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        if "projected_wall_s_64_nodes_100k" in out:
            print(
                f"64 nodes x 100,000 requests: {out['projected_wall_s_64_nodes_100k']} s "
                f"(at {out['requests_per_wall_s_64_nodes']} req/s)"
            )
        if profile_text and not args.sample:
            print(profile_text)
    if args.sample:
        print(profile_text, file=sys.stderr)
    return 0


if __name__ == "__main__":
    from peerinfer.sim.cli import exit_skipping_teardown

    exit_skipping_teardown(main())
