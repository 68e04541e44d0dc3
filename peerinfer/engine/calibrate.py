"""Calibration: measure an engine's per-token costs on this machine, as a CostModel.

Method (every figure is a median over ``repeats`` runs, after one warm-up request):

* **Prefill and overhead.** Time to first token (from calling ``generate`` to the first
  ``Tokens`` event) for fresh random prompts of several lengths, nothing cached; a least-squares
  line through (length, TTFT) gives ``prefill_s_per_token`` (slope) and ``overhead_s``
  (intercept, at least 0).
* **Cached tokens.** A random prefix of ``P`` tokens is cached by one request, then prompts of
  that prefix plus a fresh ``suffix``-token tail are timed; with two prefix lengths, the slope
  of TTFT against ``P`` is the cost of one cached token (rebuilding the model's cache from its
  segments and attending over it).
* **Decode.** The median gap between consecutive ``Tokens`` events of a greedy generation.
* **Batches** (``batch=True``, the default): the decode step time at 1, 2, 4, 8 and 16
  running requests (up to what the engine can hold at once: llama.cpp's fixed sequences stop
  it at 8) and the prefill rate alone and while 8 requests decode, by
  :func:`measure_batch_costs`, which says in its ``method`` how it measured (the engine's own
  ``decode_batch``; for a transformers engine without one, batched forward passes of its model;
  else the decoders one by one, which is what an engine that cannot batch does). They become
  the cost model's ``decode_step_s_by_batch`` and ``prefill_busy_s_per_token`` (the fitted
  prefill rate times the busy/alone ratio of the chunk timings), and its ``slots`` is the
  engine's ``max_batch_size``.

Every point is the median of its repetitions by default; ``statistic="min"`` keeps the fastest
run instead, the steadier figure on a machine shared with other work (noise only ever adds).
``clock="cpu"`` times with the process's CPU time instead of the wall clock: with one compute
thread (``--threads 1``) that is what the wall clock would read on an idle machine, so it
measures the machine rather than its other tenants.

Prompts are random token ids from the upper part of the vocabulary (clear of the special tokens
that tokenizers put first), drawn from ``random.Random(seed)``, so runs are repeatable and never
hit each other's cache by accident. Calibration works through the public ``Engine`` interface
only, so it measures any backend, and it leaves the engine's cache as it found it configured
(it clears it at the end).

``peerinfer calibrate`` calls :func:`run_calibrate_command` with the options that
:func:`add_calibrate_arguments` declares.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peerinfer.core.costmodel import CostModel
from peerinfer.core.messages import SamplingParams
from peerinfer.engine.base import Engine, Finished, Tokens
from peerinfer.errors import ConfigError, EngineError

DEFAULT_LENGTHS = (32, 128, 384)
DEFAULT_PREFIXES = (128, 384, 768)
DEFAULT_SUFFIX = 16
DEFAULT_DECODE_TOKENS = 24
_STATISTICS: dict[str, Callable[[Sequence[float]], float]] = {
    "median": statistics.median,
    "min": min,
}


@dataclass(frozen=True, slots=True)
class Calibration:
    """The fitted cost model and the medians it was fitted to (seconds)."""

    costs: CostModel
    miss_ttft_s: dict[int, float] = field(default_factory=dict)
    hit_ttft_s: dict[int, float] = field(default_factory=dict)
    suffix_tokens: int = DEFAULT_SUFFIX
    decode_gaps: int = 0
    wall_s: float = 0.0
    batch: BatchMeasurement | None = None

    def to_dict(self) -> dict[str, Any]:
        measurements: dict[str, Any] = {
            "miss_ttft_s": {str(k): round(v, 6) for k, v in self.miss_ttft_s.items()},
            "hit_ttft_s": {str(k): round(v, 6) for k, v in self.hit_ttft_s.items()},
            "hit_suffix_tokens": self.suffix_tokens,
            "decode_gaps_measured": self.decode_gaps,
            "wall_s": round(self.wall_s, 3),
        }
        if self.batch is not None:
            measurements["batch"] = self.batch.to_dict()
        return {"costs": self.costs.to_dict(), "measurements": measurements}


def _random_prompt(rng: random.Random, engine: Engine, n: int) -> list[int]:
    vocab = engine.vocab_size
    low = min(vocab // 4, 1000)
    return [rng.randrange(low, vocab) for _ in range(n)]


_CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    "cpu": time.process_time,
}


def _ttft(
    engine: Engine, prompt: Sequence[int], max_tokens: int = 1, clock: Callable[[], float] = time.perf_counter
) -> float:
    t0 = clock()
    first = None
    for ev in engine.generate(prompt, SamplingParams(max_tokens=max_tokens)):
        if first is None and isinstance(ev, Tokens):
            first = clock() - t0
    if first is None:
        raise EngineError("the engine produced no token while calibrating")
    return first


def _fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (slope, intercept)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0, my
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return slope, my - slope * mx


def calibrate_report(
    engine: Engine,
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    prefixes: Sequence[int] = DEFAULT_PREFIXES,
    suffix: int = DEFAULT_SUFFIX,
    decode_tokens: int = DEFAULT_DECODE_TOKENS,
    repeats: int = 3,
    seed: int = 0,
    statistic: str = "median",
    clock: str = "wall",
    progress: Callable[[str], None] | None = None,
    batch: bool = True,
    batch_options: dict[str, Any] | None = None,
) -> Calibration:
    """Measure ``engine`` and fit a cost model (see the module docstring);
    ``batch_options`` go to :func:`measure_batch_costs`."""
    if clock not in _CLOCKS:
        raise ConfigError(f"clock must be one of {sorted(_CLOCKS)}, got {clock!r}")
    now = _CLOCKS[clock]
    if statistic not in _STATISTICS:
        raise ConfigError(f"statistic must be one of {sorted(_STATISTICS)}, got {statistic!r}")
    pick = _STATISTICS[statistic]
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    if len(set(lengths)) < 2 or len(set(prefixes)) < 2:
        raise ConfigError("calibration needs at least two prompt lengths and two prefix lengths")
    limit = engine.max_context_tokens - decode_tokens - 2
    if max(lengths) >= limit or max(prefixes) + suffix >= limit:
        raise ConfigError(f"calibration prompts must stay under the context ({limit} tokens)")
    say = progress or (lambda _msg: None)
    rng = random.Random(seed)
    started = time.perf_counter()
    _ttft(engine, _random_prompt(rng, engine, 16), max_tokens=2)  # warm-up

    miss: dict[int, float] = {}
    for n in lengths:
        miss[n] = pick(
            [_ttft(engine, _random_prompt(rng, engine, n), clock=now) for _ in range(repeats)]
        )
        say(f"miss ttft {n:5d} tokens: {miss[n] * 1000:8.1f} ms")
    prefill, overhead = _fit_line(list(miss.items()))

    hit: dict[int, float] = {}
    for p in prefixes:
        prefix = _random_prompt(rng, engine, p)
        _ttft(engine, [*prefix, *_random_prompt(rng, engine, 1)])  # caches the prefix
        times = []
        for _ in range(repeats):
            prompt = [*prefix, *_random_prompt(rng, engine, suffix)]
            times.append(_ttft(engine, prompt, clock=now))
        hit[p] = pick(times)
        say(f"hit ttft  {p:5d} cached + {suffix} new: {hit[p] * 1000:8.1f} ms")
    cached, _ = _fit_line(list(hit.items()))

    gaps: list[float] = []
    for _ in range(repeats):
        last = None
        prompt = _random_prompt(rng, engine, 64)
        for ev in engine.generate(prompt, SamplingParams(max_tokens=decode_tokens)):
            if isinstance(ev, Tokens) and ev.token_ids:
                stamp = now()
                if last is not None:
                    gaps.append(stamp - last)
                last = stamp
            elif isinstance(ev, Finished):
                break
    if not gaps:
        raise EngineError("the engine never generated two tokens in a row while calibrating")
    decode = pick(gaps)
    say(f"decode: {decode * 1000:.2f} ms/token over {len(gaps)} gaps")

    cache = engine.radix_cache
    if cache is not None:
        cache.clear()
        engine.take_cache_changes()
    measured = None
    if batch:
        options: dict[str, Any] = {"repeats": repeats, "seed": seed + 1, "statistic": statistic, "clock": clock}
        options.update(batch_options or {})
        measured = measure_batch_costs(engine, progress=progress, **options)
    costs = CostModel(
        prefill_s_per_token=max(0.0, prefill),
        cached_s_per_token=max(0.0, cached),
        decode_s_per_token=max(0.0, decode),
        overhead_s=max(0.0, overhead),
        slots=max(1, int(getattr(engine, "max_batch_size", 1) or 1)),
        decode_step_s_by_batch=(
            tuple(sorted(measured.step_s_by_batch.items())) if measured is not None else ()
        ),
        # The chunk timings run a longer prompt than the fit's (attention grows with it), so
        # only their ratio is kept: the busy rate is the fitted rate times what running next
        # to decoders added in the chunks.
        prefill_busy_s_per_token=(
            max(0.0, prefill) * measured.prefill_s_per_token_busy / measured.prefill_s_per_token_idle
            if measured is not None and measured.prefill_s_per_token_idle > 0
            else None
        ),
        prefill_chunk_tokens=measured.chunk_tokens if measured is not None else 512,
    )
    return Calibration(
        costs, miss, hit, suffix, len(gaps), time.perf_counter() - started, measured
    )


DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)
DEFAULT_BATCH_CONTEXT = 512
DEFAULT_BATCH_STEPS = 6
DEFAULT_BUSY_DECODERS = 8
#: The batch scheduler's default prefill chunk (CONTRACT: the engine's, else 512).
DEFAULT_BATCH_CHUNK = 512

#: How a batch measurement was taken (reported with it, so a figure never hides its method).
METHOD_DECODE_BATCH = "engine.decode_batch (the backend's own batched decode)"
METHOD_PADDED_FORWARD = (
    "model forward passes over a batch of equal-length sequences with a shared KV cache "
    "(the engine has no decode_batch of its own yet)"
)
METHOD_SERIAL = "engine decoders stepped one by one (the backend does not batch)"


@dataclass(frozen=True, slots=True)
class BatchMeasurement:
    """Decode step time against the number of running requests, and prefill per token alone
    and with ``busy_decoders`` decoding in between (seconds); ``method`` says how."""

    method: str
    context_tokens: int
    step_s_by_batch: dict[int, float]
    prefill_s_per_token_idle: float
    prefill_s_per_token_busy: float
    chunk_tokens: int
    busy_decoders: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "context_tokens": self.context_tokens,
            "step_s_by_batch": {str(k): round(v, 6) for k, v in self.step_s_by_batch.items()},
            "prefill_s_per_token_idle": round(self.prefill_s_per_token_idle, 7),
            "prefill_s_per_token_busy": round(self.prefill_s_per_token_busy, 7),
            "chunk_tokens": self.chunk_tokens,
            "busy_decoders": self.busy_decoders,
        }


def _overrides_decode_batch(engine: Engine) -> bool:
    base = getattr(Engine, "decode_batch", None)
    own = getattr(type(engine), "decode_batch", None)
    return own is not None and own is not base


def measure_batch_costs(
    engine: Engine,
    *,
    sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    context_tokens: int = DEFAULT_BATCH_CONTEXT,
    steps: int = DEFAULT_BATCH_STEPS,
    chunk_tokens: int | None = None,
    busy_decoders: int = DEFAULT_BUSY_DECODERS,
    repeats: int = 3,
    seed: int = 0,
    statistic: str = "median",
    clock: str = "wall",
    progress: Callable[[str], None] | None = None,
) -> BatchMeasurement:
    """Measure the batched costs of ``engine``.

    Every request of a batch holds ``context_tokens`` of random prompt. The decode step time at
    ``n`` running is the ``statistic`` over ``steps`` steps (after one warm-up step) of one
    batched step. Prefill is timed in chunks of ``chunk_tokens`` (default 512, the batch
    scheduler's chunk) of a fresh prompt: alone, and alternating with decode
    steps of ``busy_decoders`` running requests (only the chunk is timed).

    Three methods, in order of preference: the engine's own ``decode_batch`` and
    ``Decoder.prefill`` (the batching contract); for a transformers engine without them,
    forward passes of its model over an equal-length batch sharing one KV cache (what a padded
    batch computes, without padding); otherwise the engine's decoders one by one, which is what
    such a backend really does with a batch.
    """
    if clock not in _CLOCKS:
        raise ConfigError(f"clock must be one of {sorted(_CLOCKS)}, got {clock!r}")
    if statistic not in _STATISTICS:
        raise ConfigError(f"statistic must be one of {sorted(_STATISTICS)}, got {statistic!r}")
    if not sizes or min(sizes) < 1 or steps < 1 or repeats < 1 or busy_decoders < 1:
        raise ConfigError("batch calibration needs sizes >= 1, steps >= 1, repeats >= 1")
    if context_tokens + steps + 4 >= engine.max_context_tokens:
        raise ConfigError(f"batch context must stay under the context ({engine.max_context_tokens})")
    chunk = chunk_tokens or DEFAULT_BATCH_CHUNK
    pick = _STATISTICS[statistic]
    now = _CLOCKS[clock]
    say = progress or (lambda _msg: None)
    rng = random.Random(seed)
    if _overrides_decode_batch(engine):
        method = METHOD_DECODE_BATCH
        runner: _BatchRunner = _EngineRunner(engine)
    elif hasattr(engine, "model") and hasattr(engine.model, "forward"):
        method = METHOD_PADDED_FORWARD
        runner = _ForwardRunner(engine)
    else:
        method = METHOD_SERIAL
        runner = _EngineRunner(engine)
    say(f"batch costs by {method}")
    step_s: dict[int, float] = {}
    for n in sorted(set(sizes)):
        try:
            batch = runner.open([_random_prompt(rng, engine, context_tokens) for _ in range(n)])
        except EngineError as exc:
            # An engine with a fixed number of sequences (llama.cpp: max_batch_size + 2) cannot
            # hold every size asked for; a node never runs more than it holds, so the sizes it
            # can hold are the whole curve.
            if not step_s:
                raise
            say(f"decode step, {n:3d} running: skipped ({exc})")
            break
        try:
            runner.step(batch)  # warm-up (and the first token)
            times = []
            for _ in range(steps):
                t0 = now()
                runner.step(batch)
                times.append(now() - t0)
        finally:
            runner.close(batch)
        step_s[n] = pick(times)
        say(f"decode step, {n:3d} running: {step_s[n] * 1000:8.2f} ms")

    def chunk_s_per_token(busy: int) -> float:
        decoders = (
            runner.open([_random_prompt(rng, engine, context_tokens) for _ in range(busy)])
            if busy
            else None
        )
        try:
            if decoders is not None:
                runner.step(decoders)
            per_token = []
            for _ in range(repeats):
                if decoders is not None:
                    runner.step(decoders)
                t0 = now()
                runner.prefill_chunk(_random_prompt(rng, engine, chunk))
                per_token.append((now() - t0) / chunk)
            return pick(per_token)
        finally:
            if decoders is not None:
                runner.close(decoders)

    runner.prefill_chunk(_random_prompt(rng, engine, min(chunk, 32)))  # warm-up
    idle = chunk_s_per_token(0)
    say(f"prefill alone: {idle * 1000:.3f} ms/token (chunks of {chunk})")
    busy = chunk_s_per_token(busy_decoders)
    say(f"prefill with {busy_decoders} decoding: {busy * 1000:.3f} ms/token")
    cache = engine.radix_cache
    if cache is not None:
        cache.clear()
        engine.take_cache_changes()
    return BatchMeasurement(method, context_tokens, step_s, idle, busy, chunk, busy_decoders)


class _BatchRunner:
    """One way of running a batch of requests on ``engine`` (see ``measure_batch_costs``)."""

    def open(self, prompts: list[list[int]]) -> Any:
        raise NotImplementedError

    def step(self, batch: Any) -> None:
        raise NotImplementedError

    def prefill_chunk(self, prompt: list[int]) -> None:
        raise NotImplementedError

    def close(self, batch: Any) -> None:
        return None


class _EngineRunner(_BatchRunner):
    """Through the engine's decoders: ``decode_batch`` where the backend has it, else one by
    one (the base class's behaviour)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def _decoder(self, prompt: list[int], max_tokens: int) -> Any:
        from peerinfer.engine.base import NEVER_CANCELLED, DecodeRequest

        request = DecodeRequest(
            tuple(prompt), SamplingParams(max_tokens=max_tokens), NEVER_CANCELLED, random.Random(0)
        )
        return self.engine.open_decoder(request)

    def open(self, prompts: list[list[int]]) -> Any:
        decoders = []
        try:
            for p in prompts:
                d = self._decoder(p, 1 << 10)
                decoders.append(d)
                prefill = getattr(d, "prefill", None)
                if prefill is not None:
                    for _ in range(len(p) + 1):  # bounded: each call runs >= 1 token
                        if prefill(1 << 20):
                            break
        except BaseException:
            self.close(decoders)
            raise
        return decoders

    def step(self, batch: Any) -> None:
        decode_batch = getattr(self.engine, "decode_batch", None)
        if decode_batch is not None:
            decode_batch(batch)
        else:
            for d in batch:
                d.step()

    def prefill_chunk(self, prompt: list[int]) -> None:
        d = self._decoder(prompt, 1)
        try:
            prefill = getattr(d, "prefill", None)
            if prefill is not None:
                prefill(len(prompt))
            else:
                d.step()  # the whole prompt and one sample: what such a backend does
        finally:
            d.close()

    def close(self, batch: Any) -> None:
        for d in batch:
            d.close()


class _ForwardRunner(_BatchRunner):
    """Forward passes of a transformers engine's model (``engine.model``)."""

    def __init__(self, engine: Any) -> None:
        import torch
        from transformers import DynamicCache

        self.torch = torch
        self.cache_class = DynamicCache
        self.model = engine.model
        self.device = engine.device
        # The engine found which keyword the model's forward takes its cache by.
        self.cache_kw = str(getattr(engine, "_cache_kw", "past_key_values"))

    def _forward(self, ids: Any, cache: Any) -> Any:
        with self.torch.inference_mode():
            kwargs = {self.cache_kw: cache, "use_cache": True, "logits_to_keep": 1}
            out = self.model(input_ids=ids, **kwargs)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    def open(self, prompts: list[list[int]]) -> Any:
        cache = self.cache_class(config=self.model.config)
        ids = self.torch.tensor(prompts, dtype=self.torch.long, device=self.device)
        return [cache, self._forward(ids, cache)]

    def step(self, batch: Any) -> None:
        batch[1] = self._forward(batch[1], batch[0])

    def prefill_chunk(self, prompt: list[int]) -> None:
        ids = self.torch.tensor([prompt], dtype=self.torch.long, device=self.device)
        self._forward(ids, self.cache_class(config=self.model.config))


def calibrate(engine: Engine, **options: Any) -> CostModel:
    """The cost model of ``engine`` on this machine (options as :func:`calibrate_report`)."""
    return calibrate_report(engine, **options).costs


# --------------------------------------------------------------------------------------------
# The command line (``peerinfer calibrate``).


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", default="hf", help="backend to measure (default: hf)")
    parser.add_argument("--model", help="hub id, local directory or GGUF file (hf default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", help="cpu, cuda, ... (hf default: CUDA when available)")
    parser.add_argument("--threads", type=int, help="CPU threads: torch's (hf; default: torch's choice) or llama.cpp's (llamacpp)")
    parser.add_argument("--gpu-layers", type=int, metavar="N", help="llamacpp: layers to offload to the GPU of a CUDA/Metal/Vulkan build (-1: all; default 0)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), help="hf: weights and KV precision (default auto: see peerinfer node --help)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per point; medians are kept (default: 3)")
    parser.add_argument("--statistic", choices=sorted(_STATISTICS), default="median", help="per point: median (default) or min (steadier on a busy machine)")
    parser.add_argument("--clock", choices=sorted(_CLOCKS), default="wall", help="wall (default) or cpu: process CPU time, for a busy machine (use with --threads 1)")
    parser.add_argument("--quick", action="store_true", help="shorter prompts (a rough figure in seconds)")
    parser.add_argument("--no-batch", dest="batch", action="store_false", help="skip the batch measurements (decode step time by batch size, busy prefill)")
    parser.add_argument("--output", type=Path, help="also write the result as JSON to this file (for --costs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run_calibrate_command(args: argparse.Namespace) -> int:
    from peerinfer.engine.registry import load_engine

    options: dict[str, Any] = {}
    for name in ("model", "device", "threads", "dtype", "gpu_layers"):
        value = getattr(args, name, None)
        if value is not None:
            options[name] = value
    engine = load_engine(args.engine, **options)
    try:
        kwargs: dict[str, Any] = {"repeats": args.repeats, "statistic": args.statistic, "clock": args.clock}
        kwargs["batch"] = getattr(args, "batch", True)
        if args.quick:
            kwargs.update(lengths=(16, 64), prefixes=(64, 128), decode_tokens=8, repeats=1)
            kwargs["batch_options"] = {
                "sizes": (1, 2, 4), "context_tokens": 64, "steps": 2, "chunk_tokens": 64,
                "busy_decoders": 2,
            }
        report = calibrate_report(
            engine,
            progress=None if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True)),
            **kwargs,
        )
    finally:
        engine.close()
    data = report.to_dict()
    data["model"] = engine.model_name
    if args.output is not None:
        args.output.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(data))
    else:
        c = report.costs
        print(f"model                {engine.model_name}")
        print(f"prefill_s_per_token  {c.prefill_s_per_token:.6f}   (uncached prompt token)")
        print(f"cached_s_per_token   {c.cached_s_per_token:.6f}   (prompt token from cache)")
        print(f"decode_s_per_token   {c.decode_s_per_token:.6f}   (generated token)")
        print(f"overhead_s           {c.overhead_s:.6f}   (per request)")
        print(f"slots                {c.slots}   (the engine's max_batch_size)")
        if report.batch is not None:
            b = report.batch
            print(f"batch measured by    {b.method}, {b.context_tokens}-token contexts")
            for n, t in sorted(b.step_s_by_batch.items()):
                print(f"decode step @ {n:3d}    {t:.6f}   ({n / t if t else 0.0:.1f} tokens/s)")
            print(f"prefill alone        {b.prefill_s_per_token_idle:.6f}   (per token, chunks of {b.chunk_tokens})")
            print(f"prefill, {b.busy_decoders} decoding  {b.prefill_s_per_token_busy:.6f}   (per token)")
        if args.output is not None:
            print(f"written to {args.output} (use with --costs)")
    return 0


def main_calibrate(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry: ``python -m peerinfer.engine.calibrate [options]``."""
    parser = argparse.ArgumentParser(prog="peerinfer calibrate", description="Measure an engine's per-token costs on this machine.")
    add_calibrate_arguments(parser)
    return run_calibrate_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main_calibrate())


__all__ = [
    "Calibration",
    "add_calibrate_arguments",
    "calibrate",
    "calibrate_report",
    "main_calibrate",
    "run_calibrate_command",
]
