"""The simulator's cost from 4 to 1,024 nodes: CPU per request per node and peak memory.

Each point is one ``bench/sim_bench.py`` run in its own process (so its peak resident size is
its own): the default MMLU workload at Zipf 1.0 (the packaged excerpt unless ``$PEERINFER_MMLU``
or ``../shared/data/mmlu`` names the full set), ``cost`` routing, 5 ms links, default costs,
``--requests-per-node`` requests per node (default 10: every swarm runs about 40 s of virtual
time). Prints one line per point and writes ``--out`` (JSON) and ``--plot`` (PNG)::

    python bench/sim_scale.py --nodes 4,16,64,256,512,1024 --out docs/figures/sim_scaling.json \\
        --plot docs/figures/sim_scaling.png

The figure to read is ``cpu_us_per_request_per_node``: a run's CPU time divided by its
requests and nodes. Flat means the work per request grows linearly with the swarm (every node
hears every other node); the issue's target is at most 2x from 64 to 1,024 nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_point(nodes: int, requests: int, skew: str, extra: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, str(HERE / "sim_bench.py"), "--nodes", str(nodes), "--requests",
         str(requests), "--skew", skew, "--json", *extra],
        check=True, capture_output=True, text=True,
    )
    row = json.loads(out.stdout)["runs"][0]
    row["load_after"] = round(os.getloadavg()[0], 2)
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = [r["nodes"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(nodes, [r["cpu_us_per_request_per_node"] for r in rows], "o-")
    a.set_xscale("log", base=2)
    a.set_xlabel("nodes")
    a.set_ylabel("CPU µs per request per node")
    a.set_ylim(bottom=0)
    a.set_title("simulator CPU per request per node")
    b.plot(nodes, [r["peak_rss_mb"] for r in rows], "o-")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("nodes")
    b.set_ylabel("peak RSS (MB)")
    b.set_title("peak memory of the run's process")
    for ax in (a, b):
        ax.set_xticks(nodes)
        ax.set_xticklabels([str(n) for n in nodes])
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="4,16,64,256,512,1024")
    parser.add_argument("--requests-per-node", type=int, default=10)
    parser.add_argument("--skew", default="zipf:1.0")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--plot", type=Path, help="write the figure here (PNG)")
    parser.add_argument("--from-json", type=Path, help="plot rows written before (no runs)")
    parser.add_argument("extra", nargs="*", help="more sim_bench.py options (after --)")
    args = parser.parse_args(argv)
    if args.from_json:
        rows = json.loads(args.from_json.read_text())["rows"]
    else:
        rows = []
        for n in (int(x) for x in args.nodes.split(",")):
            row = run_point(n, n * args.requests_per_node, args.skew, args.extra)
            rows.append(row)
            print(f"nodes {n:>5}  requests {row['requests']:>7}  CPU {row['cpu_s']:>8.1f} s  "
                  f"{row['cpu_us_per_request_per_node']:>6.1f} µs/request/node  "
                  f"peak {row['peak_rss_mb']:>7.0f} MB  load {row['load_after']}", flush=True)
            if args.out:
                args.out.write_text(json.dumps({"rows": rows, "skew": args.skew,
                                                "requests_per_node": args.requests_per_node},
                                               indent=1, sort_keys=True) + "\n")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
