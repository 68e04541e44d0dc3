"""Engine benchmark: what KV reuse from the radix cache buys on a real model.

Run ``python bench/engine_bench.py`` for a table, ``--json`` for one JSON object with the keys
``ttft_miss_s``, ``ttft_hit_s``, ``suffix_floor_s``, ``decode_tokens_per_s_reuse``,
``decode_tokens_per_s_hf``, ``cache_build_s``, ``second_load_s`` and ``kv_bytes_per_token`` (and
a few more: ratios, prompt sizes, hit TTFT against prefix length).

Workload: MMLU 5-shot prompts (``../shared/data/mmlu`` or ``--data``). A subject's *prefix* is
the standard header plus its five ``dev`` examples with answers; a *suffix* is one ``test``
question ending in ``Answer:``. Prefix and suffix are tokenized separately and concatenated, as
a client reusing a prefix would. Model: the engine's default (SmolLM2-135M-Instruct), greedy.

What is timed (medians over subjects x repetitions)
---------------------------------------------------
* ``ttft_miss_s``: ``generate`` to the first token, nothing cached.
* ``ttft_hit_s``: the same with the subject's prefix cached (by an earlier request with another
  question): build the model's cache from stored segments, run the suffix, pick a token.
* ``suffix_floor_s``: one forward pass over exactly the tokens the hit ran, after a ready-made
  cache of the same prefix (built untimed): the least any reuse scheme could cost.
* ``cache_build_s``: the hit's cache assembly alone (the engine's own measurement).
* ``decode_tokens_per_s_reuse`` / ``_hf``: tokens per second after the first, through the engine
  (prefix cached) and through ``model.generate`` on the full prompt (a streamer timestamps each
  token), for the same number of tokens.
* ``second_load_s``: a fresh Python process importing the engine and loading the default model
  once its converted copy exists (imports included).
* ``hit TTFT against prefix length``: 1- to 5-shot prefixes cached.

``--engine NAME`` measures another engine (any name ``peerinfer node --engine`` takes, given
``device``, ``dtype`` and ``threads`` where its constructor has them); the figures that need the
Transformers engine's internals (``suffix_floor_s``, ``cache_build_s``,
``decode_tokens_per_s_hf`` and their ratios) are then left out, and prompts are tokenized with
``engine.tokenize`` (a leading special token it adds to every text is kept only on the prefix).
``--dtype`` (hf) picks the precision: float32 by default, the exact one.

``--engine llamacpp`` measures the llama.cpp engine instead (``run_llamacpp``; same workload, same
prompt texts): miss/hit TTFT and the suffix floor (one ``llama_decode`` over the tokens the hit ran,
after a sequence already holding the prefix), the same prompt through raw llama-cpp-python (a fresh
context, no cache: ``raw_ttft_s``, ``raw_decode_tokens_per_s``), single-stream decode tokens/s of
the llama.cpp engine and of the Transformers engine (float32) on the same text, and, with
``--memory``, the resident memory of a fresh process after loading each engine and serving 64
requests (8 at a time) against GGUF size + KV budget + 300 MB. Unless ``--skip-node``, one prompt
per subject also goes through a real node (``node_vs_raw``: a client on libp2p, in this
process), paired with raw llama-cpp-python on the same token ids: ``node_miss_over_raw`` and
``node_decode_over_raw``, always on the wall clock (the client's TTFT is one).

``--clock cpu`` times everything but the second load with the process's CPU time instead of the
wall clock. With ``--threads 1`` that is what the wall clock would read on an idle machine: use it
on a machine shared with other work, and say so when quoting the figures.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "mmlu"
CHOICES = "ABCD"
#: The clock the timed sections read (``--clock``).
clock = time.perf_counter


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return [row for row in csv.reader(f) if len(row) == 6]


def _format(row: Sequence[str], with_answer: bool) -> str:
    text = row[0].strip()
    for letter, choice in zip(CHOICES, row[1:5], strict=True):
        text += f"\n{letter}. {choice}"
    text += "\nAnswer:"
    if with_answer:
        text += f" {row[5]}\n\n"
    return text


def mmlu_prompts(data: Path, subjects: int, questions: int, shots: int = 5) -> list[tuple[str, str, list[str]]]:
    """(subject, k-shot prefix text, test question texts) for the first ``subjects`` subjects."""
    out = []
    for dev in sorted((data / "dev").glob("*_dev.csv"))[:subjects]:
        subject = dev.name[: -len("_dev.csv")]
        test = data / "test" / f"{subject}_test.csv"
        header = (
            "The following are multiple choice questions (with answers) about "
            f"{subject.replace('_', ' ')}.\n\n"
        )
        prefix = header + "".join(_format(r, True) for r in _rows(dev)[:shots])
        out.append((subject, prefix, [_format(r, False) for r in _rows(test)[:questions]]))
    if not out:
        raise SystemExit(f"no MMLU data under {data} (give --data PATH)")
    return out


class _Stamps:
    """A transformers streamer that timestamps every generated token."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt
            self._prompt_seen = True
            return
        self.times.append(clock())

    def end(self) -> None:
        pass


def _first_token_s(engine: Any, prompt: Sequence[int]) -> tuple[float, int]:
    from peerinfer.core.messages import SamplingParams
    from peerinfer.engine import Started, Tokens

    t0 = clock()
    first = None
    cached = 0
    for ev in engine.generate(prompt, SamplingParams(max_tokens=1)):
        if isinstance(ev, Started):
            cached = ev.cached_tokens
        elif isinstance(ev, Tokens) and first is None:
            first = clock() - t0
    assert first is not None
    return first, cached


def _fresh_cache(engine: Any) -> None:
    from peerinfer.core.prefix import PrefixHasher

    engine.configure_cache(PrefixHasher(engine.fingerprint))


def _engine_kwargs(name: str, device: str, dtype: str | None, threads: int | None) -> dict[str, Any]:
    """The options among device, dtype and threads that engine ``name``'s constructor takes."""
    import inspect

    from peerinfer.engine.registry import resolve_engine_class

    wanted = {"device": device, "dtype": dtype, "threads": threads}
    accepted = inspect.signature(resolve_engine_class(name)).parameters
    return {k: v for k, v in wanted.items() if k in accepted and v is not None}


def second_load_s(name: str, kwargs: dict[str, Any]) -> tuple[float, float]:
    """Wall and CPU seconds of a fresh process loading the default model."""
    threads = kwargs.get("threads")
    code = (
        "import time; t = time.perf_counter();"
        "import torch;"
        + (f"torch.set_num_threads({threads});" if threads else "")
        + "from peerinfer.engine.registry import load_engine;"
        f"load_engine({name!r}, **{kwargs!r});"
        "print(time.perf_counter() - t)"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return float(out.stdout.strip().splitlines()[-1]), cpu


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from peerinfer.core.messages import SamplingParams
    from peerinfer.engine import Tokens
    from peerinfer.engine.registry import load_engine

    say = (lambda _m: None) if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    kwargs = _engine_kwargs(args.engine, args.device, args.dtype, args.threads)
    engine = load_engine(args.engine, **kwargs)  # hf: converts the GGUF once if needed
    hf = hasattr(engine, "kv_cache_from_segments") and hasattr(engine, "model")
    load_runs = [second_load_s(args.engine, kwargs) for _ in range(args.load_repeats)]
    loads = [wall for wall, _ in load_runs]
    load_cpu = [cpu for _, cpu in load_runs]
    say(f"second load: wall {[round(x, 2) for x in loads]} s, cpu {[round(x, 2) for x in load_cpu]} s")

    tokenizer = getattr(engine, "tokenizer", None) if hf else None
    special = [] if tokenizer is not None else engine.tokenize("")

    def ids(text: str) -> list[int]:
        if tokenizer is not None:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        out = engine.tokenize(text)
        return out[len(special):] if out[: len(special)] == special else out

    workload = mmlu_prompts(Path(args.data), args.subjects, args.repeats + 1)
    _first_token_s(engine, ids("Warm-up: the quick brown fox.") * 4)

    miss, hit, floor, build, prefix_lens, suffix_lens, ran = [], [], [], [], [], [], []
    for subject, prefix_text, questions in workload:
        prefix = special + ids(prefix_text)
        prefix_lens.append(len(prefix))
        for q in questions[1 : args.repeats + 1]:
            prompt = prefix + ids(q)
            suffix_lens.append(len(prompt) - len(prefix))
            _fresh_cache(engine)
            _first_token_s(engine, prefix + ids(questions[0]))  # caches the prefix
            t_hit, cached = _first_token_s(engine, prompt)
            assert cached > 0, "the prefix was not cached"
            assert cached <= len(prefix), "the suffix must not be cached"
            t_floor, build_s = math.nan, math.nan
            if hf:
                timings = engine.last_timings
                assert timings is not None and timings.cached_tokens == cached
                build_s = timings.build_s
                # The floor: a forward pass over the same uncached tokens after a ready-made
                # cache.
                segments = engine.radix_cache.match(prompt[:cached], touch=False).payloads
                cache = engine.kv_cache_from_segments(segments, contiguous=True)
                t0 = clock()
                logits = engine.forward(prompt[cached:], cache)
                int(torch.argmax(logits))
                t_floor = clock() - t0
                del cache
            _fresh_cache(engine)
            t_miss, nothing = _first_token_s(engine, prompt)
            assert nothing == 0
            miss.append(t_miss)
            hit.append(t_hit)
            floor.append(t_floor)
            build.append(build_s)
            ran.append(len(prompt) - cached)
            say(
                f"{subject:28s} prefix {len(prefix):4d} suffix {len(prompt) - len(prefix):3d} "
                f"cached {cached:4d}: miss {t_miss * 1000:7.1f} ms  hit {t_hit * 1000:6.1f} ms  "
                f"floor {t_floor * 1000:6.1f} ms  build {build_s * 1000:5.2f} ms"
            )

    # Decode throughput, same prompt and token count through the engine and model.generate.
    subject, prefix_text, questions = workload[0]
    prompt = special + ids(prefix_text) + ids(questions[1])
    rates_reuse, rates_hf = [], []
    for _ in range(args.decode_repeats):
        _fresh_cache(engine)
        _first_token_s(engine, special + ids(prefix_text) + ids(questions[0]))
        stamps: list[float] = []
        for ev in engine.generate(prompt, SamplingParams(max_tokens=args.decode_tokens)):
            if isinstance(ev, Tokens) and ev.token_ids:
                stamps.append(clock())
        n = len(stamps)
        rates_reuse.append((n - 1) / (stamps[-1] - stamps[0]))
        if not hf:
            say(f"decode {n} tokens: engine {rates_reuse[-1]:.1f} tok/s")
            continue
        streamer = _Stamps()
        input_ids = torch.tensor([prompt], device=engine.device)
        with torch.inference_mode():
            engine.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                streamer=streamer,
                pad_token_id=next(iter(engine.eos_token_ids), 0),
            )
        t = streamer.times
        rates_hf.append((len(t) - 1) / (t[-1] - t[0]))
        say(f"decode {n} tokens: reuse {rates_reuse[-1]:.1f} tok/s, hf {rates_hf[-1]:.1f} tok/s")

    # Hit TTFT against prefix length (one subject, 1- to 5-shot prefixes).
    by_prefix: dict[int, float] = {}
    data = Path(args.data)
    for shots in range(1, 6):
        subject, prefix_text, questions = mmlu_prompts(data, 1, args.repeats + 1, shots)[0]
        prefix = special + ids(prefix_text)
        _fresh_cache(engine)
        _first_token_s(engine, prefix + ids(questions[0]))
        times = [_first_token_s(engine, prefix + ids(q))[0] for q in questions[1:]]
        by_prefix[len(prefix)] = statistics.median(times)
        say(f"{shots}-shot prefix {len(prefix):4d} tokens: hit ttft {by_prefix[len(prefix)] * 1000:.1f} ms")

    med = statistics.median
    result: dict[str, Any] = {
        "ttft_miss_s": med(miss),
        "ttft_hit_s": med(hit),
        "suffix_floor_s": med(floor) if hf else None,
        "decode_tokens_per_s_reuse": med(rates_reuse),
        "decode_tokens_per_s_hf": med(rates_hf) if rates_hf else None,
        "cache_build_s": med(build) if hf else None,
        "second_load_s": med(loads),
        "second_load_cpu_s": med(load_cpu),
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "miss_over_hit": med(m / h for m, h in zip(miss, hit, strict=True)),
        "hit_over_floor": med(h / f for h, f in zip(hit, floor, strict=True)) if hf else None,
        "build_over_hit": med(b / h for b, h in zip(build, hit, strict=True)) if hf else None,
        "decode_reuse_over_hf": med(rates_reuse) / med(rates_hf) if rates_hf else None,
        "prefix_tokens_median": med(prefix_lens),
        "suffix_tokens_median": med(suffix_lens),
        "uncached_tokens_run_median": med(ran),
        "hit_ttft_s_by_prefix_tokens": {str(k): v for k, v in by_prefix.items()},
        "samples": len(hit),
        "engine": args.engine,
        "device": str(getattr(engine, "device", args.device)),
        "dtype": str(getattr(engine, "dtype", "")).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "model": engine.model_name,
    }
    engine.close()
    return result


def _decode_rate(engine: Any, prompt: Sequence[int], n: int) -> float:
    """Tokens/s after the first, through ``engine.generate`` (greedy, ``n`` tokens at most)."""
    from peerinfer.core.messages import SamplingParams
    from peerinfer.engine import Tokens

    stamps: list[float] = []
    for ev in engine.generate(prompt, SamplingParams(max_tokens=n)):
        if isinstance(ev, Tokens) and ev.token_ids:
            stamps.append(clock())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def node_vs_raw(engine: Any, workload: list[tuple[str, str, list[str]]], decode_tokens: int,
                say: Any) -> dict[str, Any]:
    """The issue's "a request through a node compared with raw llama-cpp-python on the same
    GGUF, no cache": each prompt sent by a client to one real node (libp2p on 127.0.0.1, the
    ``local`` policy, in this process), then the same token ids through raw llama-cpp-python
    (a fresh context), back to back. Both are timed with the wall clock, since the client's
    TTFT is a wall-clock figure (from sending to the first token arriving): run it on a quiet
    machine. A prompt starts with its own line (``Request k.``), so nothing of it is cached.
    Decode tokens/s: the tokens after the first over the time after the first, as the client
    sees them and as the raw run times its steps."""
    import trio

    from peerinfer.client import Client
    from peerinfer.node import Node, NodeOptions
    from peerinfer.testing.llamacpp_reference import LlamaCppReference

    raw = LlamaCppReference(engine.gguf, extra_buffers=engine.extra_buffers, threads=engine.threads,
                            clock=time.perf_counter)
    texts = [f"Request {k}.\n{prefix}{q}" for k, (_s, prefix, questions) in enumerate(workload)
             for q in questions[1:2]]
    rows: list[dict[str, float]] = []

    async def run() -> None:
        options = NodeOptions(engine="unused", listen=("/ip4/127.0.0.1/tcp/0",), mdns=False,
                              persist_identity=False, policy="local", seed=1)
        node = Node(options, engine=engine)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.serve)
            async with Client.connect(node.addresses()[0]) as client:
                await client.generate("Warm-up: the quick brown fox.", max_tokens=2)
                for text in texts:
                    ids = engine.tokenize(text)
                    res = await client.generate(text, max_tokens=decode_tokens)
                    if res.cached_tokens or res.prompt_tokens != len(ids):
                        raise RuntimeError(f"not the same uncached prompt: {res.prompt_tokens} tokens "
                                           f"({res.cached_tokens} cached), raw {len(ids)}")
                    # Off the trio loop's thread is not needed: nothing else runs meanwhile.
                    ref = raw.greedy(ids, decode_tokens)
                    node_rate = (res.completion_tokens - 1) / max(1e-9, res.latency_s - res.ttft_s)
                    raw_rate = (len(ref.tokens) - 1) / ref.decode_s
                    rows.append({"tokens": len(ids), "node_ttft_s": res.ttft_s, "raw_ttft_s": ref.prefill_s,
                                 "node_decode_tokens_per_s": node_rate, "raw_decode_tokens_per_s": raw_rate,
                                 "node_tokens": res.completion_tokens, "raw_tokens": len(ref.tokens)})
                    say(f"through a node: {len(ids):4d} tokens, TTFT {res.ttft_s * 1000:7.1f} ms against raw "
                        f"{ref.prefill_s * 1000:7.1f} ms; decode {node_rate:5.1f} against {raw_rate:5.1f} tok/s "
                        f"({res.completion_tokens} and {len(ref.tokens)} tokens)")
            nursery.cancel_scope.cancel()

    try:
        trio.run(run)
    finally:
        raw.close()
    med = statistics.median
    return {
        "node_ttft_miss_s": med(r["node_ttft_s"] for r in rows),
        "node_raw_ttft_s": med(r["raw_ttft_s"] for r in rows),
        "node_miss_over_raw": med(r["node_ttft_s"] / r["raw_ttft_s"] for r in rows),
        "node_decode_tokens_per_s": med(r["node_decode_tokens_per_s"] for r in rows),
        "node_raw_decode_tokens_per_s": med(r["raw_decode_tokens_per_s"] for r in rows),
        "node_decode_over_raw": med(r["node_decode_tokens_per_s"] / r["raw_decode_tokens_per_s"] for r in rows),
        "node_samples": len(rows),
        "node_rows": rows,
    }


def run_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    """The llama.cpp engine's figures (see the module docstring)."""
    import numpy as np

    from peerinfer.engine.llamacpp import LlamaCppEngine
    from peerinfer.testing.llamacpp_reference import LlamaCppReference

    say = (lambda _m: None) if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    threads = args.threads or 1
    engine = LlamaCppEngine(threads=threads)
    # The raw run is timed with the same clock as the engine (CPU time under --clock cpu).
    raw = LlamaCppReference(engine.gguf, extra_buffers=engine.extra_buffers, threads=threads, clock=clock)

    def ids(text: str) -> list[int]:
        return engine._tokenize(text, False)

    workload = mmlu_prompts(Path(args.data), args.subjects, args.repeats + 1)
    _first_token_s(engine, ids("Warm-up: the quick brown fox.") * 4)
    miss, hit, floor, raw_ttft, build, prefix_lens, suffix_lens = [], [], [], [], [], [], []
    for subject, prefix_text, questions in workload:
        prefix = ids(prefix_text)
        prefix_lens.append(len(prefix))
        for q in questions[1 : args.repeats + 1]:
            prompt = prefix + ids(q)
            suffix_lens.append(len(prompt) - len(prefix))
            _fresh_cache(engine)
            _first_token_s(engine, prefix + ids(questions[0]))  # caches the prefix
            t_hit, cached = _first_token_s(engine, prompt)
            timings = engine.last_timings
            assert timings is not None and timings.cached_tokens == cached > 0
            # The floor: one llama_decode of the same uncached tokens after a sequence that
            # already holds the prefix (restored untimed).
            seq = engine._take_seq()
            try:
                engine.restore_blocks(seq, engine.radix_cache.match(prompt[:cached], touch=False).payloads)
                rest = prompt[cached:]
                t0 = clock()
                engine._decode([(t, cached + j, seq, j == len(rest) - 1) for j, t in enumerate(rest)])
                int(np.argmax(engine._logits(len(rest) - 1)))
                t_floor = clock() - t0
            finally:
                engine._give_seq(seq)
            _fresh_cache(engine)
            t_miss, nothing = _first_token_s(engine, prompt)
            assert nothing == 0
            t0 = clock()
            raw.greedy(prompt, 1)
            t_raw = clock() - t0  # includes creating its context: see raw_prefill_s
            run = raw.greedy(prompt, 1)
            miss.append(t_miss)
            hit.append(t_hit)
            floor.append(t_floor)
            raw_ttft.append(run.prefill_s)
            build.append(timings.build_s)
            say(f"{subject:28s} prefix {len(prefix):4d} suffix {len(prompt) - len(prefix):3d} "
                f"cached {cached:4d}: miss {t_miss * 1000:7.1f} ms  raw {run.prefill_s * 1000:7.1f} ms "
                f"(with context {t_raw * 1000:7.1f})  hit {t_hit * 1000:6.1f} ms  "
                f"floor {t_floor * 1000:6.1f} ms  restore {timings.build_s * 1000:5.2f} ms")

    # Single-stream decode: the llama.cpp engine (prefix cached), raw llama-cpp-python, and the
    # Transformers engine (float32, prefix cached) on the same prompt text.
    subject, prefix_text, questions = workload[0]
    prompt_text = (prefix_text, questions[1])
    prompt = ids(prompt_text[0]) + ids(prompt_text[1])
    rates, raw_rates = [], []
    for _ in range(args.decode_repeats):
        _fresh_cache(engine)
        _first_token_s(engine, ids(prefix_text) + ids(questions[0]))
        rates.append(_decode_rate(engine, prompt, args.decode_tokens))
        run = raw.greedy(prompt, args.decode_tokens)
        raw_rates.append((len(run.tokens) - 1) / run.decode_s)
        say(f"decode {args.decode_tokens} tokens: llamacpp engine {rates[-1]:.1f} tok/s, "
            f"raw llama-cpp-python {raw_rates[-1]:.1f} tok/s")
    raw.close()
    result_engine = {
        "kv_bytes_per_token": engine.kv_bytes_per_token, "extra_buffers": engine.extra_buffers,
        "context_tokens": engine.context_tokens, "model": engine.model_name,
    }
    if not args.skip_node:
        _fresh_cache(engine)
        result_engine.update(node_vs_raw(engine, workload, args.decode_tokens, say))
    engine.close()
    hf_rates: list[float] = []
    if not args.skip_hf:
        import torch

        from peerinfer.engine.hf import TransformersEngine

        torch.set_num_threads(threads)
        hf = TransformersEngine(device="cpu", dtype="float32", threads=threads)
        tok = hf.tokenizer

        def hf_ids(text: str) -> list[int]:
            return list(tok(text, add_special_tokens=False)["input_ids"])

        hf_prompt = hf_ids(prompt_text[0]) + hf_ids(prompt_text[1])
        for _ in range(args.decode_repeats):
            _fresh_cache(hf)
            _first_token_s(hf, hf_ids(prefix_text) + hf_ids(questions[0]))
            hf_rates.append(_decode_rate(hf, hf_prompt, args.decode_tokens))
            say(f"decode {args.decode_tokens} tokens: transformers engine (float32) {hf_rates[-1]:.1f} tok/s")
        hf.close()

    med = statistics.median
    result: dict[str, Any] = {
        "engine": "llamacpp",
        "ttft_miss_s": med(miss),
        "ttft_hit_s": med(hit),
        "suffix_floor_s": med(floor),
        "raw_ttft_s": med(raw_ttft),
        "restore_s": med(build),
        "miss_over_hit": med(m / h for m, h in zip(miss, hit, strict=True)),
        "hit_over_floor": med(h / f for h, f in zip(hit, floor, strict=True)),
        "miss_over_raw": med(m / r for m, r in zip(miss, raw_ttft, strict=True)),
        "decode_tokens_per_s": med(rates),
        "raw_decode_tokens_per_s": med(raw_rates),
        "decode_over_raw": med(rates) / med(raw_rates),
        "hf_decode_tokens_per_s": med(hf_rates) if hf_rates else None,
        "decode_over_hf": med(rates) / med(hf_rates) if hf_rates else None,
        "prefix_tokens_median": med(prefix_lens),
        "suffix_tokens_median": med(suffix_lens),
        "samples": len(hit),
        "threads": threads,
        "clock": args.clock,
        **result_engine,
    }
    if args.memory:
        result["memory"] = {name: _memory_in_child(name, threads, args) for name in ("llamacpp", "hf")}
    result["load_avg"] = [round(x, 2) for x in __import__("os").getloadavg()]
    return result


_MEMORY_CHILD = r"""
import json, sys, time
sys.path.insert(0, {root!r})
from peerinfer.core.messages import ChatMessage, SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.engine import load_engine
from peerinfer.engine.batch import BatchScheduler
from peerinfer.workload import MMLU, default_data_dir, five_shot_prefix, question_suffix

def rss():
    out = {{}}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS", "VmHWM")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out

name, threads, budget = {name!r}, {threads}, {budget}
opts = dict(threads=threads, capacity_bytes=budget)
if name == "hf":
    opts["device"] = "cpu"
engine = load_engine(name, **opts)
engine.configure_cache(PrefixHasher(engine.fingerprint), capacity_bytes=budget)
after_load = rss()
mmlu = MMLU.load(default_data_dir() or {data!r})
prompts = []
for subject in sorted(mmlu.subjects)[:8]:
    prefix = five_shot_prefix(subject, mmlu.dev(subject))
    for q in mmlu.test(subject)[:8]:
        prompts.append(engine.chat_tokens([ChatMessage("user", prefix + question_suffix(q))]))
prompts = prompts[:64]
sched = BatchScheduler(engine, max_running=8)
for i, p in enumerate(prompts):
    sched.submit(i, p, SamplingParams(max_tokens={tokens}))
t0 = time.perf_counter()
while not sched.idle:
    sched.step()
done = rss()
stats = engine.statistics()
print(json.dumps(dict(after_load=after_load, after_64=done, seconds=time.perf_counter() - t0,
      cached_bytes=stats.cache.bytes if stats.cache else 0, requests=len(prompts),
      gguf_bytes=__import__("os").path.getsize(str(getattr(engine, "gguf", "") or __import__("peerinfer.engine.modelfiles", fromlist=["x"]).default_gguf_path())))))
"""


def _memory_in_child(name: str, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """Resident memory of a fresh process that loads engine ``name`` and serves 64 requests."""
    budget = args.memory_budget
    code = _MEMORY_CHILD.format(root=str(ROOT), name=name, threads=threads, budget=budget,
                                data=str(args.data), tokens=args.memory_tokens)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    limit = r["gguf_bytes"] + budget + (300 << 20)
    r.update(budget_bytes=budget, limit_bytes=limit, within=r["after_64"]["VmRSS"] <= limit,
             rss_over_limit=round(r["after_64"]["VmRSS"] / limit, 3))
    print(f"memory {name}: after load {r['after_load']['VmRSS'] / 2**20:.0f} MiB, after 64 requests "
          f"{r['after_64']['VmRSS'] / 2**20:.0f} MiB (peak {r['after_64']['VmHWM'] / 2**20:.0f}); limit "
          f"GGUF + budget + 300 MB = {limit / 2**20:.0f} MiB", file=sys.stderr, flush=True)
    return r


def _table(r: dict[str, Any]) -> None:
    def ok(cond: bool) -> str:
        return "ok" if cond else "MISSED"

    print(f"model {r['model']} on {r['device']} ({r['dtype']}, {r['threads']} threads, "
          f"{r['clock']} clock), "
          f"{r['samples']} MMLU 5-shot prompts: prefix ~{r['prefix_tokens_median']:.0f} tokens, "
          f"suffix ~{r['suffix_tokens_median']:.0f}")
    rows = [
        ("TTFT, nothing cached", f"{r['ttft_miss_s'] * 1000:.1f} ms", ""),
        ("TTFT, prefix cached", f"{r['ttft_hit_s'] * 1000:.1f} ms",
         f"{r['miss_over_hit']:.1f}x lower (target >= 4x: {ok(r['miss_over_hit'] >= 4)})"),
        ("decode, engine w/ reuse", f"{r['decode_tokens_per_s_reuse']:.1f} tok/s", ""),
        ("second load", f"{r['second_load_s']:.2f} s",
         f"target < 5 s: {ok(r['second_load_s'] < 5)} ({r['second_load_cpu_s']:.2f} s of CPU)"),
        ("KV bytes per token", f"{r['kv_bytes_per_token']}", ""),
    ]
    if r["suffix_floor_s"] is not None:  # the Transformers engine's own figures
        rows[2:2] = [
            ("suffix forward floor", f"{r['suffix_floor_s'] * 1000:.1f} ms",
             f"hit/floor {r['hit_over_floor']:.2f} (target <= 1.2: {ok(r['hit_over_floor'] <= 1.2)})"),
            ("cache build", f"{r['cache_build_s'] * 1000:.2f} ms",
             f"{r['build_over_hit'] * 100:.1f}% of hit TTFT (target < 10%: {ok(r['build_over_hit'] < 0.1)})"),
        ]
        rows[4] = ("decode, engine w/ reuse", f"{r['decode_tokens_per_s_reuse']:.1f} tok/s",
                   f"{r['decode_reuse_over_hf'] * 100:.0f}% of model.generate "
                   f"(target >= 95%: {ok(r['decode_reuse_over_hf'] >= 0.95)})")
        rows.insert(5, ("decode, model.generate", f"{r['decode_tokens_per_s_hf']:.1f} tok/s", ""))
    for name, value, note in rows:
        print(f"  {name:26s} {value:>14s}  {note}")
    print("  hit TTFT by cached prefix length:")
    for k, v in r["hit_ttft_s_by_prefix_tokens"].items():
        print(f"    {k:>5s} tokens  {v * 1000:7.1f} ms")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="peerinfer engine benchmark (KV reuse)")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="MMLU directory (dev/, test/)")
    parser.add_argument("--subjects", type=int, default=3, help="subjects (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="questions per subject (default 3)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--load-repeats", type=int, default=3)
    parser.add_argument("--engine", default="hf", help="engine name, as for peerinfer node --engine (default hf)")
    parser.add_argument("--dtype", default="float32", help="hf engine: float32 (default), bfloat16, float16, auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall (default) or cpu: process CPU time (a busy machine; use --threads 1)")
    parser.add_argument("--skip-hf", action="store_true", help="llamacpp: skip the Transformers decode figure")
    parser.add_argument("--skip-node", action="store_true",
                        help="llamacpp: skip the figures of a request through a real node against raw llama-cpp-python")
    parser.add_argument("--memory", action="store_true", help="llamacpp: resident memory of both engines after 64 requests")
    parser.add_argument("--memory-budget", type=int, default=1 << 30, help="KV budget for --memory (bytes; default 1 GiB)")
    parser.add_argument("--memory-tokens", type=int, default=16, help="tokens per request for --memory (16)")
    args = parser.parse_args(argv)
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    result = run_llamacpp(args) if args.engine == "llamacpp" else run(args)
    if args.engine == "llamacpp" and not args.json:
        for k, v in result.items():
            print(f"{k:26s} {v}")
        return 0
    if args.json:
        print(json.dumps(result))
    else:
        _table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
