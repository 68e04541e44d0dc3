"""dtype benchmark: the Transformers engine in float32, bfloat16 and float16 on this machine.

Run ``python bench/dtype_bench.py`` for a table on stderr, ``--json`` for one JSON object on
stdout. For each dtype (``--dtypes``) the engine loads the default model (SmolLM2-135M-Instruct)
on the CPU with one torch thread (``--threads``) and serves, through ``engine.generate`` with an
empty cache, the prompt of ``../shared/probes/engine_cpu_probe.py`` (a 16-shot MMLU-style chat
prompt, ~586 tokens): ``prefill_s`` is its time to first token, ``decode_tokens_per_s`` the
tokens/s of the ``--tokens`` (32) greedy tokens after the first (medians of ``--repeats``).
Ratios are against float32 in the same run; ``same_tokens_as_float32`` says whether the greedy
tokens equal float32's. Also printed: the CPU's bfloat16 flags and what ``--dtype auto`` picks
here (``peerinfer.engine.hf.auto_dtype``).

``--clock cpu`` (the default here) reads the process's CPU time: with one thread, what the wall
clock reads on an idle machine. Quote the load (``load_avg``) beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

clock: Callable[[], float] = time.process_time


def probe_prompt() -> str:
    """The user message of ../shared/probes/engine_cpu_probe.py (its chat prompt's content)."""
    shots = "".join(
        f"Question {i}: Which planet is the {i}th from the sun? A) Mars B) Venus C) Earth "
        "D) Jupiter\nAnswer: C\n\n"
        for i in range(1, 17)
    )
    return (
        "The following are multiple choice questions about astronomy.\n\n" + shots
        + "Question: What is the largest planet?\nA) Mars B) Jupiter C) Earth D) Venus\nAnswer:"
    )


def measure(engine: Any, prompt: list[int], tokens: int, repeats: int) -> dict[str, Any]:
    from peerinfer.core.messages import SamplingParams
    from peerinfer.core.prefix import PrefixHasher
    from peerinfer.engine import Tokens

    prefills, rates, out = [], [], []
    for _ in range(repeats + 1):  # the first run warms up and is dropped
        engine.configure_cache(PrefixHasher(engine.fingerprint))  # nothing cached
        t0 = clock()
        stamps: list[float] = []
        out = []
        for ev in engine.generate(prompt, SamplingParams(max_tokens=tokens + 1)):
            if isinstance(ev, Tokens) and ev.token_ids:
                stamps.append(clock())
                out.extend(ev.token_ids)
        prefills.append(stamps[0] - t0)
        if len(stamps) > 1:
            rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return {
        "prefill_s": round(statistics.median(prefills[1:]), 4),
        "decode_tokens_per_s": round(statistics.median(rates[1:]), 2) if rates[1:] else None,
        "tokens": out,
    }


def main(argv: Sequence[str] | None = None) -> int:
    global clock
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    args = parser.parse_args(argv)
    if args.clock == "wall":
        clock = time.perf_counter

    import torch

    from peerinfer.core.messages import ChatMessage
    from peerinfer.engine.hf import NATIVE_BF16_CPU_FLAGS, TransformersEngine, auto_dtype, cpu_flags

    torch.set_num_threads(args.threads)
    flags = cpu_flags()
    result: dict[str, Any] = {
        "threads": args.threads, "clock": args.clock, "tokens": args.tokens,
        "cpu_bf16_flags": sorted(flags & NATIVE_BF16_CPU_FLAGS),
        "cpu_has_avx512f": "avx512f" in flags, "cpu_has_avx2": "avx2" in flags,
        "auto_picks": str(auto_dtype("cpu", flags=flags)).removeprefix("torch."),
        "torch": torch.__version__, "load_avg_before": [round(x, 2) for x in os.getloadavg()],
    }
    print(f"CPU bf16 flags: {result['cpu_bf16_flags'] or 'none'}; auto picks {result['auto_picks']}",
          file=sys.stderr, flush=True)
    reference: list[int] | None = None
    base: dict[str, Any] | None = None
    for name in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        engine = TransformersEngine(device="cpu", dtype=name, threads=args.threads)
        prompt = engine.chat_tokens([ChatMessage("user", probe_prompt())])
        figures = measure(engine, prompt, args.tokens, args.repeats)
        engine.close()
        tokens = figures.pop("tokens")
        if reference is None:
            reference, base = tokens, figures
        assert base is not None
        figures["same_tokens_as_float32"] = tokens == reference
        figures["prefill_speedup"] = round(base["prefill_s"] / figures["prefill_s"], 3)
        if figures["decode_tokens_per_s"] and base["decode_tokens_per_s"]:
            figures["decode_speedup"] = round(figures["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
        figures["prompt_tokens"] = len(prompt)
        result[name] = figures
        print(f"{name:9s} prefill {figures['prefill_s']:.3f} s (x{figures['prefill_speedup']}), "
              f"decode {figures['decode_tokens_per_s']} tok/s (x{figures.get('decode_speedup')}), "
              f"same tokens as the first: {figures['same_tokens_as_float32']}", file=sys.stderr, flush=True)
    result["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:24s} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
