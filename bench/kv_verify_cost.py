"""What checking a pull costs on a real engine (issue 24): ``python bench/kv_bench.py verifycost``.

One process, one engine, one thread: a prefix of ``--prefix-tokens`` random-word tokens is
prefilled on an empty cache (timed: the compute a pull of it saves), its blocks are exported and
the cache emptied; then the blocks are checked as a puller checks them
(``Engine.token_errors`` over the default verifier's sample, ``PullVerifier``), for each
granularity ("token": single tokens spread over every block, the default, checked as the
engine checks them; "block": every token of whole blocks, the first verifier; on llama.cpp
also "run4": runs of 4 tokens, one ``llama_decode`` a run, the check before the one-batch
check; on Transformers also "dense": the "token" sample with the pass's attention over every
cell, masked, the check before its chunked attention), looked up in the engine's digests of the blocks it
computed itself (``peerinfer.engine.kvmemo``: a free check), and adopted (``Engine.adopt_blocks``, timed: what
using the pull costs instead of the prefill). Figures are ratios within this one run:
check / prefill, and check / (prefill - adopt), the compute the pull saved.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("verifycost", help="the pull check's compute on a real engine")
    p.add_argument("--engine", default="llamacpp", choices=("llamacpp", "hf"))
    p.add_argument("--model", default=None, help="the model (default: the engine's default)")
    p.add_argument("--dtype", default="float32", help="the Transformers dtype")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--rate", type=float, default=None, help="default: the core's verify_rate")
    p.add_argument("--granularities", default="token,block",
                   help="of token, block; on llama.cpp also run4, batch1, runs1; on "
                   "Transformers also dense (see _method)")
    p.add_argument("--trials", type=int, default=2, help="checks per granularity (other seeds)")
    p.add_argument("--prefills", type=int, default=2, help="prefills timed (before and after)")
    p.set_defaults(run=verify_cost)


def _engine(args: argparse.Namespace) -> Any:
    if args.engine == "llamacpp":
        from peerinfer.engine.llamacpp import LlamaCppEngine

        kwargs: dict[str, Any] = {"threads": args.threads}
        if args.model:
            kwargs["model"] = args.model
        return LlamaCppEngine(**kwargs)
    from peerinfer.engine.hf import TransformersEngine

    return TransformersEngine(args.model, dtype=args.dtype, threads=args.threads, device="cpu")


#: The Transformers check's attention chunk as it was before "dense" set it to 0.
_HF_CHUNK: list[int] = []


def _method(engine: Any, granularity: str, default_run: int, default_batch: bool | None) -> int:
    """Set the engine's check method for ``granularity`` and return the run length to
    sample: "token" and "block" the engine's defaults; "run4" (llama.cpp only) runs of 4
    consecutive tokens, one ``llama_decode`` a run in the engine's own context; "batch1" and
    "runs1" (llama.cpp only) single tokens, all in one batch or one ``llama_decode`` each;
    "dense" (Transformers only) single tokens, the pass's attention over every cell, masked
    (``hf_verify._CHUNK`` 0: the check before its chunked attention)."""
    if default_batch is None:  # the Transformers engine
        from peerinfer.engine import hf_verify

        hf_verify._CHUNK = 0 if granularity == "dense" else _HF_CHUNK[0]
        granularity = "token" if granularity == "dense" else granularity
    if granularity in ("token", "block"):
        if default_batch is not None:
            engine.verify_in_one_batch = default_batch
        engine.verify_run_tokens = default_run
        return default_run
    if default_batch is None:
        raise SystemExit(f"granularity {granularity!r} is the llama.cpp engine's only")
    batch, run = {"run4": (False, 4), "batch1": (True, 1), "runs1": (False, 1)}[granularity]
    engine.verify_in_one_batch = batch
    engine.verify_run_tokens = run
    return run


def verify_cost(args: argparse.Namespace) -> None:
    from kv_pull_bench import _text

    from peerinfer.core.kvpull import PullSettings, PullVerifier
    from peerinfer.core.messages import SamplingParams
    from peerinfer.core.prefix import PrefixHasher
    from peerinfer.engine.kvmemo import known_blocks

    rate = PullSettings().verify_rate if args.rate is None else args.rate
    engine = _engine(args)
    try:
        bs = 16
        text = _text(engine.tokenize, random.Random(1), args.prefix_tokens + 1)
        tokens = engine.tokenize(text)[: args.prefix_tokens + 1]
        n_blocks = args.prefix_tokens // bs

        def prefill() -> float:
            engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=bs))  # empty
            t0 = time.perf_counter()
            for _ in engine.generate(tokens, SamplingParams(max_tokens=1, temperature=0.0)):
                pass
            return time.perf_counter() - t0

        prefills = [prefill()]
        cache = engine.radix_cache
        assert cache is not None
        nodes = cache.match(tuple(tokens), touch=False).nodes[:n_blocks]
        assert len(nodes) == n_blocks, f"{len(nodes)} blocks cached of {n_blocks}"
        blocks = engine.encode_blocks([n.hash for n in nodes])
        nbytes = sum(len(b) for b in blocks)
        print(f"# kv_bench verifycost: {args.engine} ({engine.kv_format().split('/')[1]}), "
              f"{args.threads} thread(s), {len(tokens) - 1}-token prefix = {n_blocks} blocks of "
              f"{bs} ({nbytes / 1e6:.1f} MB), rate {rate}, runs of {engine.verify_run_tokens} "
              f"token(s); load average {os.getloadavg()[0]:.2f}")
        rows: list[tuple[str, int, float, float]] = []
        default_run = engine.verify_run_tokens
        default_batch = getattr(engine, "verify_in_one_batch", None)
        if default_batch is None:
            from peerinfer.engine import hf_verify

            _HF_CHUNK[:] = [hf_verify._CHUNK]
        # Granularities alternate within each trial: the load on a shared machine drifts, and
        # one granularity's trials all run back to back would meet another load than the other's.
        for trial in range(args.trials):
            for granularity in [g for g in args.granularities.split(",") if g]:
                engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=bs))  # empty
                run = _method(engine, granularity, default_run, default_batch)
                # "dense" samples what "token" samples: the same tokens, another attention.
                verifier = PullVerifier(f"cost/{trial}", rate=rate,
                                        granularity="block" if granularity == "block" else "token")
                checks = verifier.sample(n_blocks, bs, run)
                t0 = time.perf_counter()
                errors = engine.token_errors(tokens, 0, blocks, checks)
                check_s = time.perf_counter() - t0
                _method(engine, "token", default_run, default_batch)
                verdict = verifier.judge(errors, bs)
                assert verdict.ok, verdict.detail
                rows.append((granularity, len(checks), check_s, verdict.worst_error))
        # The prefill again after the checks: on a shared machine the load drifts, so the
        # checks are set against the mean of a prefill before and one after them.
        prefills += [prefill() for _ in range(args.prefills - 1)]
        prefill_s = statistics.mean(prefills)
        print(f"prefill on an empty cache: {', '.join(f'{p:.2f}' for p in prefills)} s "
              f"(mean {prefill_s:.2f} s)")
        # Free checks: the blocks are what this engine computed itself (its prefills above).
        t0 = time.perf_counter()
        known = known_blocks(engine, [n.hash for n in nodes], blocks)
        memo_s = time.perf_counter() - t0
        print(f"blocks this engine computed itself (kvmemo digests): {len(known)} of {n_blocks} "
              f"known, in {memo_s:.3f} s")
        engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=bs))
        t0 = time.perf_counter()
        adopted = engine.adopt_blocks(tokens, blocks)
        adopt_s = time.perf_counter() - t0
        assert adopted == n_blocks * bs
        saved_s = prefill_s - adopt_s
        print(f"adopting the {n_blocks} pulled blocks: {adopt_s:.2f} s; a pull saves "
              f"{saved_s:.2f} s of compute here")
        print("\n| granularity | tokens checked | check s | check / prefill | check / saved | worst honest error |")
        print("|---|---|---|---|---|---|")
        for granularity, n, check_s, worst in rows:
            print(f"| {granularity} | {n} | {check_s:.2f} | {check_s / prefill_s:.3f} | "
                  f"{check_s / saved_s:.3f} | {worst:.2e} |")
        for granularity in sorted({r[0] for r in rows}):
            mean = statistics.mean(r[2] for r in rows if r[0] == granularity)
            print(f"# {granularity}: mean check {mean:.2f} s = {mean / saved_s:.3f} of the saving")
        print(f"# load average at the end {os.getloadavg()[0]:.2f}")
    finally:
        engine.close()
