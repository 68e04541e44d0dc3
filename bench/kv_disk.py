"""KV tier benchmark: what a block kept beyond memory buys (issue 24, the disk tier).

``python bench/kv_disk.py [--engine llamacpp|hf|simulated] [--prefix-tokens 2000] [--reps 3]
[--threads 1] [--json]``

Also a study for ``bench/kv_bench.py``'s dispatcher: ``add_disk_parser(sub)`` registers it as
its ``disk`` subcommand (``kv_bench.py disk ...`` then takes the same options).

Workload: a ``--prefix-tokens`` prefix (deterministic English-like text, a different one per
repetition) followed by a short question; greedy, one generated token (TTFT is the time from
``generate`` to the first token, including the engine's prefix lookup and, for a disk hit, the
disk load). Model: the engine's default (SmolLM2-135M-Instruct: the GGUF through llama.cpp, or
its converted copy through Transformers); ``--model`` picks another.

For each repetition:

* ``recompute``: an empty memory cache and an empty disk tier: the whole prompt is prefilled.
* ``disk hit``: the memory cache is emptied (``configure_cache``: every block spills to the disk
  tier), then the same prefix with another question: the prefix's blocks are read from disk,
  checked, decoded and inserted, then the question is prefilled.
* ``memory hit``: the same once more: the prefix is in memory now.

Then ``restart``: a new engine object on the same disk directory (as a restarted node) serves
the last prefix once more; ``restart_cached_tokens`` says whether its very first request hit.

The files are read through the OS page cache (the bench just wrote them, and it cannot drop the
cache without root): the figure is the load path's CPU cost (read, checksum, decode, restore),
and a cold SSD adds its read time (``disk_bytes_per_token`` x tokens / its read rate). The
ratio to report is ``disk_hit_ttft / recompute_ttft`` (target: <= 0.5 for a 2,000-token
prefix).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from peerinfer.core.messages import SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.engine import Started, Tokens
from peerinfer.engine.base import Engine

WORDS = (
    "the of and to in is was for on that with as by at from his her their river mountain city "
    "village winter summer market harbour bridge lantern garden library window letter morning "
    "evening traveller merchant teacher farmer sailor painter quiet bright ancient narrow wide "
    "walked carried noticed remembered built opened closed followed wrote listened because "
    "although while after before during beyond beneath across toward"
).split()


def prefix_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    out = []
    for i in range(words):
        out.append(rng.choice(WORDS))
        if i % 17 == 16:
            out[-1] += "."
    return " ".join(out)


def make_engine(name: str, model: str | None, threads: int) -> Engine:
    if name == "llamacpp":
        from peerinfer.engine.llamacpp import LlamaCppEngine

        return LlamaCppEngine(model, threads=threads, extra_buffers=False)
    if name == "hf":
        import torch

        from peerinfer.engine.hf import TransformersEngine

        torch.set_num_threads(threads)
        return TransformersEngine(model, device="cpu", dtype="float32")
    if name == "simulated":
        from peerinfer.engine.simulated import SimulatedEngine

        return SimulatedEngine(time_scale=1.0)
    raise SystemExit(f"unknown engine {name!r}")


def ttft(engine: Engine, prompt: Sequence[int]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, cached tokens) to the first token."""
    w0, c0 = time.perf_counter(), time.process_time()
    cached = -1
    first: tuple[float, float] | None = None
    # Run to the end (one token): a request abandoned early stores nothing in the cache.
    for ev in engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0)):
        if isinstance(ev, Started):
            cached = ev.cached_tokens
        elif isinstance(ev, Tokens) and ev.token_ids and first is None:
            first = time.perf_counter() - w0, time.process_time() - c0
    if first is None:
        raise RuntimeError("no token generated")
    return first[0], first[1], cached


def run_disk(args: argparse.Namespace) -> dict[str, Any]:
    make: Callable[[], Engine] = lambda: make_engine(args.engine, args.model, args.threads)  # noqa: E731
    engine = make()
    bs = 16
    hasher = PrefixHasher(engine.fingerprint, block_size=bs)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kv-bench-") as tmp:
        directory = Path(tmp)
        # Size the prefix in tokens: grow the text until it tokenizes to --prefix-tokens.
        words = args.prefix_tokens
        for rep in range(args.reps):
            text = prefix_text(rep, words)
            prefix = engine.tokenize(text)
            while len(prefix) < args.prefix_tokens:
                words += 50
                text = prefix_text(rep, words)
                prefix = engine.tokenize(text)
            prefix = prefix[: args.prefix_tokens]
            q1 = engine.tokenize(" Question: which word came first? Answer:")
            q2 = engine.tokenize(" Question: which word came last? Answer:")
            engine.configure_cache(hasher)
            engine.configure_disk(directory / f"rep{rep}", 1 << 34)
            miss = ttft(engine, prefix + q1)
            engine.configure_cache(hasher)  # memory emptied: every block spills to disk
            stats0 = engine.disk_statistics()
            assert stats0 is not None
            disk = ttft(engine, prefix + q2)
            stats1 = engine.disk_statistics()
            assert stats1 is not None
            ram = ttft(engine, prefix + q1)
            rows.append({
                "prompt_tokens": len(prefix) + len(q1),
                "recompute_s": miss[0], "recompute_cpu_s": miss[1],
                "disk_hit_s": disk[0], "disk_hit_cpu_s": disk[1], "disk_hit_cached": disk[2],
                "memory_hit_s": ram[0], "memory_hit_cpu_s": ram[1], "memory_hit_cached": ram[2],
                "disk_read_bytes": stats1.read_bytes - stats0.read_bytes,
                "disk_load_s": stats1.read_s - stats0.read_s,
                "disk_files_bytes": stats1.bytes,
            })
        kv_per_token = rows[-1]["disk_read_bytes"] / max(1, rows[-1]["disk_hit_cached"])
        kv_format = engine.kv_format()
        engine.close()  # as a stopping node: what memory held spills
        again = make()
        again.configure_cache(hasher)
        again.configure_disk(directory / f"rep{args.reps - 1}", 1 << 34)
        restart = ttft(again, prefix + q2)
        again.close()

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {
        "engine": args.engine,
        "model": engine.model_name,
        "kv_format": kv_format,
        "threads": args.threads,
        "prefix_tokens": args.prefix_tokens,
        "reps": args.reps,
        "recompute_ttft_s": med("recompute_s"),
        "disk_hit_ttft_s": med("disk_hit_s"),
        "memory_hit_ttft_s": med("memory_hit_s"),
        "disk_over_recompute": med("disk_hit_s") / med("recompute_s"),
        "disk_over_recompute_cpu": med("disk_hit_cpu_s") / med("recompute_cpu_s"),
        "disk_load_s": med("disk_load_s"),
        "disk_load_bytes_per_s": med("disk_read_bytes") / med("disk_load_s"),
        "disk_bytes_per_token": kv_per_token,
        "restart_cached_tokens": restart[2],
        "restart_ttft_s": restart[0],
        "rows": rows,
        "load_average": os.getloadavg(),
    }


def report(r: dict[str, Any]) -> None:
    print(f"{r['engine']} {r['model']}, {r['prefix_tokens']}-token prefix, {r['threads']} thread(s), "
          f"median of {r['reps']}; load average {r['load_average'][0]:.2f}")
    print(f"  recompute TTFT     {r['recompute_ttft_s']:.3f} s")
    print(f"  disk-hit TTFT      {r['disk_hit_ttft_s']:.3f} s  ({r['disk_over_recompute']:.3f}x recompute; "
          f"CPU time {r['disk_over_recompute_cpu']:.3f}x)")
    print(f"  memory-hit TTFT    {r['memory_hit_ttft_s']:.3f} s")
    print(f"  disk load          {r['disk_load_s']:.3f} s for the prefix "
          f"({r['disk_load_bytes_per_s'] / 1e6:.0f} MB/s, {r['disk_bytes_per_token'] / 1e3:.1f} KB/token)")
    print(f"  after a restart    first request cached {r['restart_cached_tokens']} tokens, "
          f"TTFT {r['restart_ttft_s']:.3f} s")


def disk(args: argparse.Namespace) -> None:
    """The study: run it and print a table, or one JSON object with ``--json``."""
    result = run_disk(args)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        report(result)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="llamacpp", choices=("llamacpp", "hf", "simulated"))
    p.add_argument("--model", help="another model than the engine's default")
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_disk_parser(sub: Any) -> None:
    """Register the study as the ``disk`` subcommand of a dispatcher's subparsers (``run``)."""
    p = sub.add_parser("disk", help="TTFT of a disk-tier hit against a recompute, and a restart")
    add_arguments(p)
    p.set_defaults(run=disk)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    disk(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
