"""The load a swarm of batched nodes carries: the knee of mean TTFT against arrival rate.

Runs the load sweep of ``python -m experiments batch`` alone (``hot:2``, 16 nodes,
``cost``, 5 ms, the ``batched`` cost model on 1 and on 8 slots), optionally with another number
of generated tokens per request, and prints the rate at which mean TTFT first exceeds 5x its
idle value for each, and their ratio, as one JSON object with ``--json``.

    PYTHONPATH=. python bench/sim_batch_knee.py --max-tokens 32 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # experiments/ is not installed

from experiments.runner import run_all  # noqa: E402
from experiments.sweeps import (  # noqa: E402
    BASE,
    BATCH_RATE_REQUESTS,
    BATCH_RATES,
    BATCH_SLOTS,
    HOT,
    batched,
    knee_rate,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, help="generated tokens per request (default: the workload's, 8)")
    parser.add_argument("--requests", type=int, default=BATCH_RATE_REQUESTS)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = replace(BASE, requests=args.requests, max_tokens=args.max_tokens)
    configs = [
        replace(batched(base, k), skew=HOT, delay_ms="5", policy="cost", rate=r)
        for k in BATCH_SLOTS
        for r in BATCH_RATES
    ]
    runs = run_all(configs, jobs=args.jobs, log=(lambda _m: None) if args.json else print)
    out: dict[str, object] = {"max_tokens": args.max_tokens or 8, "requests": args.requests}
    knees = {}
    for k in BATCH_SLOTS:
        curve = [(c.rate, r["ttft_mean_s"]) for c, r in zip(configs, runs, strict=True)
                 if c.costs.slots == k]
        knees[k] = knee_rate(curve)
        out[f"curve_{k}_slots"] = curve
        out[f"knee_rate_{k}_slots"] = knees[k]
    single, multi = knees[BATCH_SLOTS[0]], knees[BATCH_SLOTS[-1]]
    out["knee_ratio"] = multi / single if single and multi else None
    print(json.dumps(out) if args.json else out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
