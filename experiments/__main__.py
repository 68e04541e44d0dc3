"""``python -m experiments NAME [--out DIR] [--jobs J]``: the simulator experiments of
docs/evaluation.md (see ``experiments.sweeps`` and ``experiments.scenarios``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from experiments.runner import use_cache
from experiments.scenarios import churn_experiment, mesh_experiment, mix_experiment
from experiments.sweeps import (
    BASE,
    SCALE_NODES,
    SCALE_REQUESTS_PER_NODE,
    SCALE_REQUESTS_PER_NODE_AT,
    admission_experiment,
    batch_experiment,
    cycle_experiment,
    delay_experiment,
    hot_experiment,
    parse_scale_nodes,
    print_batch_tables,
    print_delay_table,
    scale_experiment,
    share_experiment,
)
from experiments.tables import markdown_tables

# ------------------------------------------------------------------------------ command line

EXPERIMENTS: dict[str, Callable[..., dict[str, Any]]] = {
    "delay": delay_experiment,
    "share": share_experiment,
    "cycle": cycle_experiment,
    "hot": hot_experiment,
    "admission": admission_experiment,
    "scale": scale_experiment,
    "batch": batch_experiment,
}
#: Issue 14's experiments, run by name only (``all`` stays the paper's and the batching ones).
EXTRA_EXPERIMENTS: dict[str, Callable[..., dict[str, Any]]] = {
    "churn": churn_experiment,
    "mix": mix_experiment,
    "mesh": mesh_experiment,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments",
        description="Run the simulator experiments of docs/evaluation.md.",
    )
    parser.add_argument(
        "name", choices=[*EXPERIMENTS, *EXTRA_EXPERIMENTS, "all", "tables"],
        help="an experiment, all of them, or 'tables' (print the markdown tables of --out)",
    )
    parser.add_argument("--out", default="docs/figures", help="output directory (PNG + JSON)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel runs (default 2)")
    parser.add_argument("--requests", type=int, help=f"requests per run (default {BASE.requests})")
    parser.add_argument("--nodes", type=int, help=f"nodes (default {BASE.nodes})")
    parser.add_argument("--seed", type=int, help=f"seed (default {BASE.seed})")
    parser.add_argument(
        "--requests-per-node", type=int, default=SCALE_REQUESTS_PER_NODE,
        help=f"scale: requests per node (default {SCALE_REQUESTS_PER_NODE})",
    )
    parser.add_argument(
        "--scale-nodes", metavar="N[:R],...",
        default=",".join(
            f"{n}:{SCALE_REQUESTS_PER_NODE_AT[n]}" if n in SCALE_REQUESTS_PER_NODE_AT else str(n)
            for n in SCALE_NODES
        ),
        help="scale: the node counts, each with its own requests per node R if given "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--cache", metavar="FILE", help="keep finished runs in FILE (JSON lines) and reuse them"
    )
    args = parser.parse_args(argv)
    use_cache(Path(args.cache) if args.cache else None)
    base = BASE
    if args.requests is not None:
        base = replace(base, requests=args.requests)
    if args.nodes is not None:
        base = replace(base, nodes=args.nodes)
    if args.seed is not None:
        base = replace(base, seed=args.seed)
    out = Path(args.out)
    if args.name == "tables":
        print(markdown_tables(out))
        return 0
    out.mkdir(parents=True, exist_ok=True)

    def log(line: str) -> None:
        print(line, flush=True)

    names = list(EXPERIMENTS) if args.name == "all" else [args.name]
    for name in names:
        log(f"experiment {name}:")
        kw: dict[str, Any] = {}
        if name == "scale":
            counts, at = parse_scale_nodes(args.scale_nodes)
            kw = {"requests_per_node": args.requests_per_node, "nodes": counts,
                  "requests_per_node_at": at}
        data = {**EXPERIMENTS, **EXTRA_EXPERIMENTS}[name](out, base, args.jobs, log, **kw)
        data["experiment"] = name
        data["argv"] = sys.argv
        (out / f"{name}.json").write_text(json.dumps(data, indent=1, sort_keys=True))
        if name == "delay":
            print_delay_table(data, log)
        elif name == "batch":
            print_batch_tables(data, log)
        elif name in EXTRA_EXPERIMENTS:
            pass  # their tables were printed as they finished
        else:
            for r in data["runs"]:
                p = r["params"]
                log(
                    f"  {p['policy']:<15} {p['costs_source']:<8} nodes {p['nodes']:>4} delay "
                    f"{p['delay_ms']:>4} {p['skew']:<10} cache {p['cache_tokens']} max_queue "
                    f"{p['max_queue']}: mean {r['latency_mean_s']:.4f} "
                    f"p99 {r['latency_p99_s']:.4f} hit {r['hit_ratio']:.3f} "
                    f"fwd {r['forwarded_fraction']:.3f} spec {r.get('specialization')}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
