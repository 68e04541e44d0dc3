"""GPU check: the batched Transformers or llama.cpp engine on a CUDA machine, in one run of a
few minutes.

    python bench/gpu_check.py                      # CUDA, writes gpu_check.json
    python bench/gpu_check.py --device cpu --quick # a dry run of every part, small, on the CPU
    python bench/gpu_check.py --engine llamacpp    # the GGUF through llama.cpp, every layer
                                                   # offloaded (--gpu-layers, default -1: all)

Without CUDA (and without ``--device cpu``) it stops at once with exit status 2 and says so; for
``--engine llamacpp`` that means a llama-cpp-python build that cannot offload (a CPU build:
reinstall it with ``CMAKE_ARGS="-DGGML_CUDA=on"``). It is not part of ``make test``; tests run
its CPU dry run on a tiny model (Transformers) and on the default GGUF (llama.cpp, no layers
offloaded).

``--engine llamacpp`` measures the same three parts on the llama.cpp engine (``--model``: a GGUF,
default the default model's), once, in the GGUF's own precision (``--dtypes`` does not apply):
agreement is with the engine's own lone run of each prompt (no cache), a difference counting as
a tie when the lone run's best logit led the produced token by at most ``LLAMA_TIE_TOLERANCE``
(llama.cpp's teacher-forced logits, ``scored_logits``).

What it measures, for float32 and bfloat16 (``--dtypes``), on the default model (``--model``)
with MMLU 5-shot chat prompts of two subjects (as bench/batch_bench.py builds them):

* ``agreement``: ``--agree-requests`` greedy requests through the ``BatchScheduler`` 8 at a time,
  each compared with transformers' ``generate`` of its prompt alone in the same dtype, no prefix
  cache: ``equal``, ``tie`` (first difference where the lone run's best logit and the token
  produced were within ``tie_tolerance``: 1e-4 in float32, 0.25 in bfloat16, whose 8-bit
  mantissa rounds logits that coarsely) and ``mismatch``, with the largest gap seen.
* ``throughput``: aggregate generated tokens/s with 1, 8, 32 and 64 requests submitted at once
  (``--batch-sizes``), ``--tokens`` each (plain-text few-shot prompts, which keep decoding).
* ``ttft``: time to first token of a miss (empty cache) and of a hit (the subject's prefix
  cached), medians of 3.

A time budget (``--budget-s``, 420 s) skips what is left once spent, saying so in the JSON, so
the whole run stays under 8 minutes. Output: one JSON file (``--output``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

TIE_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.25, "float16": 0.05}
#: llama.cpp: batched and lone rows run other kernels on a GPU (their sums round differently);
#: the conformance suite's near-tie bound.
LLAMA_TIE_TOLERANCE = 0.05


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    parser.add_argument("--model", default=None, help="model to load (default: the engine's)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--agree-requests", type=int, default=32)
    parser.add_argument("--data", default=None, help="MMLU directory (as bench/batch_bench.py)")
    parser.add_argument("--output", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--budget-s", type=float, default=420.0)
    parser.add_argument("--quick", action="store_true", help="a few requests per part (dry run)")
    parser.add_argument("--engine", choices=["hf", "llamacpp"], default="hf",
                        help="hf (default): the Transformers engine per dtype; llamacpp: the GGUF")
    parser.add_argument("--gpu-layers", type=int, default=-1,
                        help="llamacpp: layers to offload (default -1: all; 0 with --device cpu)")
    args = parser.parse_args(argv)
    try:
        args.batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x]
        args.dtypes = [x.strip() for x in args.dtypes.split(",") if x.strip()]
    except ValueError:
        parser.error("--batch-sizes takes integers separated by commas")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        parser.error("--batch-sizes needs integers >= 1")
    bad = [d for d in args.dtypes if d not in TIE_TOLERANCE]
    if bad or not args.dtypes:
        parser.error(f"--dtypes takes some of {sorted(TIE_TOLERANCE)}, got {bad or 'none'}")
    if args.device not in ("cuda", "cpu") and not args.device.startswith("cuda:"):
        parser.error(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    if args.quick:
        args.batch_sizes = [n for n in args.batch_sizes if n <= 2] or [1]
        args.tokens, args.agree_requests = min(args.tokens, 4), min(args.agree_requests, 3)
    return args


def cuda_problem(device: str, engine: str = "hf") -> str | None:
    """Why ``device`` cannot run, or None."""
    if not device.startswith("cuda"):
        return None
    if engine == "llamacpp":
        import llama_cpp

        if not llama_cpp.llama_supports_gpu_offload():
            return (
                f"this llama-cpp-python {llama_cpp.__version__} build cannot offload to a GPU (a CPU "
                'build); reinstall it with CMAKE_ARGS="-DGGML_CUDA=on", or pass --device cpu --quick '
                "for a dry run"
            )
        return None
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA (a CPU-only build)"
        return (
            f"CUDA is not available here (torch {torch.__version__}, built for {built}); run this "
            "on a CUDA machine, or pass --device cpu --quick for a dry run"
        )
    return None


def _prompts(engine: Any, args: argparse.Namespace, count: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(chat prompts alternating two subjects, plain-text prompts, one warm prompt per subject),
    cut to fit the model's context."""
    from batch_bench import Workload

    work = Workload(engine, args.data, ("astronomy", "virology"), max(8, count // 2 + 1))
    room = engine.max_context_tokens - args.tokens - 1
    if args.quick:  # a dry run: short prompts (their head keeps the shared subject prefix)
        room = min(room, 96)

    def fit(p: list[int]) -> list[int]:
        return p if len(p) <= room else p[: room * 2 // 3] + p[-(room - room * 2 // 3) :]

    return (
        [fit(p) for p in work.mixed(count)],
        [fit(p) for p in work.raw],
        [fit(p) for p in work.warm],
    )


def _fresh(engine: Any, warm: Sequence[list[int]]) -> None:
    from peerinfer.core.messages import SamplingParams
    from peerinfer.core.prefix import PrefixHasher

    engine.configure_cache(PrefixHasher(engine.fingerprint))
    for p in warm:
        for _ in engine.generate(p, SamplingParams(max_tokens=1)):
            pass


def measure_speed(engine: Any, args: argparse.Namespace, chat: Sequence[list[int]], raw: Sequence[list[int]],
                  warm: Sequence[list[int]], deadline: float, out: dict[str, Any]) -> None:
    """``out["throughput"]`` by batch size and ``out["ttft"]`` (a miss, a hit) on ``engine``."""
    from batch_bench import run_scheduler

    from peerinfer.core.messages import SamplingParams
    from peerinfer.engine import Started, Tokens

    # Throughput by batch size (plain-text prompts keep decoding), cycling the prompts.
    out["throughput"] = {}
    for n in args.batch_sizes:
        if time.monotonic() > deadline:
            out["throughput"][str(n)] = "skipped: time budget spent"
            continue
        _fresh(engine, warm)
        batch = [raw[i % len(raw)] for i in range(n)]
        if args.device.startswith("cuda") and hasattr(engine, "model"):  # torch's queue drained
            import torch

            torch.cuda.synchronize()
        elapsed, toks, _ = run_scheduler(engine, batch, args.tokens, n)
        produced = sum(map(len, toks))
        out["throughput"][str(n)] = {"seconds": round(elapsed, 4), "tokens": produced, "tokens_per_s": round(produced / elapsed, 2)}

    # TTFT, miss and hit.
    def ttft(prompt: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        cached = 0
        for ev in engine.generate(prompt, SamplingParams(max_tokens=1)):
            if isinstance(ev, Started):
                cached = ev.cached_tokens
            elif isinstance(ev, Tokens) and ev.token_ids:
                return time.perf_counter() - t0, cached
        raise AssertionError("no token")

    if time.monotonic() > deadline:
        out["ttft"] = "skipped: time budget spent"
    else:
        miss, hit, hit_cached = [], [], []
        for p in chat[:3]:
            _fresh(engine, [])
            miss.append(ttft(p)[0])
            _fresh(engine, warm)
            t, c = ttft(p)
            hit.append(t)
            hit_cached.append(c)
        out["ttft"] = {"miss_s": round(statistics.median(miss), 5), "hit_s": round(statistics.median(hit), 5),
                       "hit_cached_tokens": hit_cached, "prompt_tokens": [len(p) for p in chat[:3]]}


def check_dtype(args: argparse.Namespace, dtype: str, deadline: float) -> dict[str, Any]:
    from batch_bench import reference, run_scheduler

    from peerinfer.engine.hf import TransformersEngine

    out: dict[str, Any] = {}
    engine = TransformersEngine(args.model, device=args.device, dtype=dtype, max_batch_size=max(args.batch_sizes + [8]))
    try:
        chat, raw, warm = _prompts(engine, args, max(args.agree_requests, 8))
        tolerance = TIE_TOLERANCE[dtype]
        # Agreement with unbatched generate.
        _fresh(engine, warm)
        prompts = chat[: args.agree_requests]
        _, got, _ = run_scheduler(engine, prompts, args.tokens, 8)
        verdicts = {"equal": 0, "tie": 0, "mismatch": 0}
        worst = 0.0
        for p, g in zip(prompts, got, strict=True):
            expected, logits = reference(engine, p, args.tokens)
            if g == expected:
                verdicts["equal"] += 1
                continue
            i = next((i for i, (a, b) in enumerate(zip(g, expected, strict=False)) if a != b), None)
            gap = float("inf") if i is None else float(logits[i].max().float() - logits[i][g[i]].float())
            worst = max(worst, gap)
            verdicts["tie" if gap <= tolerance else "mismatch"] += 1
        out["agreement"] = {**verdicts, "requests": len(prompts), "tie_tolerance": tolerance, "largest_gap": worst}
        measure_speed(engine, args, chat, raw, warm, deadline, out)
    finally:
        engine.close()
    return out


def check_llamacpp(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    from batch_bench import reference, run_scheduler

    from peerinfer.engine.llamacpp import LlamaCppEngine

    out: dict[str, Any] = {}
    gpu_layers = 0 if args.device == "cpu" else args.gpu_layers
    engine = LlamaCppEngine(args.model, gpu_layers=gpu_layers, max_batch_size=max(args.batch_sizes + [8]),
                            threads=1 if args.device == "cpu" else None)
    out.update(gguf=str(engine.gguf), gpu_layers=gpu_layers, extra_buffers=engine.extra_buffers)
    try:
        chat, raw, warm = _prompts(engine, args, max(args.agree_requests, 8))
        # Agreement with the engine's own lone run of each prompt (nothing cached).
        _fresh(engine, warm)
        prompts = chat[: args.agree_requests]
        _, got, _ = run_scheduler(engine, prompts, args.tokens, 8)
        verdicts = {"equal": 0, "tie": 0, "mismatch": 0}
        worst = 0.0
        for p, g in zip(prompts, got, strict=True):
            expected, _ = reference(engine, p, args.tokens)
            if g == expected:
                verdicts["equal"] += 1
                continue
            i = next((i for i, (a, b) in enumerate(zip(g, expected, strict=False)) if a != b), None)
            if i is None:  # one stopped earlier: no token to weigh
                gap = float("inf")
            else:
                logits = engine.scored_logits(list(p) + expected[: i + 1], len(p))
                gap = float(logits[i].max() - logits[i][g[i]])
            worst = max(worst, gap)
            verdicts["tie" if gap <= LLAMA_TIE_TOLERANCE else "mismatch"] += 1
        out["agreement"] = {**verdicts, "requests": len(prompts), "tie_tolerance": LLAMA_TIE_TOLERANCE,
                            "largest_gap": worst}
        measure_speed(engine, args, chat, raw, warm, deadline, out)
    finally:
        engine.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    problem = cuda_problem(args.device, args.engine)
    if problem is not None:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 2
    if args.engine == "llamacpp":
        import llama_cpp

        started = time.monotonic()
        result: dict[str, Any] = {
            "engine": "llamacpp", "device": args.device, "device_name": platform.processor() or "cpu",
            "llama_cpp_python": llama_cpp.__version__,
            "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
            "tokens": args.tokens, "quick": args.quick,
        }
        print("gpu_check: llamacpp ...", file=sys.stderr, flush=True)
        result["llamacpp"] = check_llamacpp(args, started + args.budget_s)
        result["wall_s"] = round(time.monotonic() - started, 2)
        args.output.write_text(json.dumps(result, indent=1), encoding="utf-8")
        print(json.dumps(result))
        return 0
    import torch
    import transformers

    started = time.monotonic()
    deadline = started + args.budget_s
    result: dict[str, Any] = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "tokens": args.tokens, "quick": args.quick, "dtypes": {},
    }
    if args.device == "cpu":
        torch.set_num_threads(min(4, os.cpu_count() or 1))
    for dtype in args.dtypes:
        if time.monotonic() > deadline:
            result["dtypes"][dtype] = "skipped: time budget spent"
            continue
        print(f"gpu_check: {dtype} ...", file=sys.stderr, flush=True)
        result["dtypes"][dtype] = check_dtype(args, dtype, deadline)
    result["wall_s"] = round(time.monotonic() - started, 2)
    args.output.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
