"""Batched serving benchmark: many requests at once on one engine.

Run ``python bench/batch_bench.py`` for a table on stderr and ``--json`` for one JSON object on
stdout. Engine: ``--engine`` (default ``hf``, the Transformers engine; any name
``peerinfer node --engine`` takes), given the options of its constructor that it has among
``device`` (cpu), ``dtype`` (``--dtype``, hf: float32 by default, the exact one),
``threads`` and ``max_batch_size`` (``--max-batch``; default: the engine's own default, what a
node started without options runs; the 8-request figures use a scheduler of 8 either way). Model: the engine's default (SmolLM2-135M-Instruct),
one thread for every figure (``--threads``). Figures that compare with transformers' own
``generate`` (``vs_hf_*``, the near-tie test of ``exact_share``) need the Transformers engine;
on another engine ``exact_share`` compares with the engine's own lone run (``engine.generate``
with an empty cache) and counts every difference as a mismatch. Workload: MMLU 5-shot **chat** prompts of two subjects
(``--subjects``, default astronomy and virology; the data from ``../shared/data/mmlu`` when
present, else the excerpt shipped in peerinfer/data): one user message holding the subject's
five-shot block and a test question, through the model's chat template. Every timed phase
starts from a fresh cache holding the two subjects' prefixes (cached by one request per subject
with another question), greedy, ``--tokens`` (32) new tokens at most (a request also ends at
the model's end of sequence: every system compared produces the same tokens).

Figures (keys of the JSON object)
---------------------------------
* ``throughput_x_8``: 8 requests (4 per subject) submitted at once to a ``BatchScheduler``,
  aggregate generated tokens/s, over the same 8 through ``engine.generate`` one after another.
* ``throughput_x_8_one_prefill_per_step``: the same with the scheduler prefilling one
  newcomer per step (as before ``prefill_batch``), for the before/after ratio in one run.
* ``vs_hf_padded_8``: the same aggregate over transformers' own left-padded batch
  ``generate`` of the 8 full prompts (no prefix cache; its own KV cache as always).
* ``vs_hf_cb_8``: ... over transformers' ``generate_batch`` (continuous batching) of the 8.
* ``ttft_join_ratio``: time to first token of a request submitted while 7 others decode, over
  the same request's on an idle engine (medians over ``--ttft-repeats`` prompts).
* ``step_time_by_batch``: seconds per ``engine.decode_batch`` with 1, 2, 4, 8, 16 requests
  decoding (contexts of the workload's prompts, cached prefixes); also as the cost model's
  ``decode_step_s_by_batch`` (``[[n, seconds], ...]``, what ``peerinfer calibrate`` writes).
* ``exact_share``: share of ``--exact-requests`` (64) requests, run through the scheduler 8 at
  a time (joining and leaving as others end), whose greedy tokens equal transformers'
  ``generate`` of the prompt alone with no prefix cache; ``tie_flips`` counts the differing
  ones whose first differing token scored within 1e-4 of the lone run's best logit (float
  rounding of a near tie), ``mismatches`` the others (bugs).
* ``rss_after_load_mb`` / ``rss_after_64_mb``: the process's resident memory after loading
  the engine and after the exactness phase's requests (``--exact-requests``, 64), with
  ``kv_budget_mb`` (the cache's byte budget) beside it.
* ``node_x_16``: 16 concurrent clients (``Client.connect``, the client behind ``peerinfer.connect``)
  on one real node (libp2p on 127.0.0.1), generated tokens/s over the
  same 16 one after another, if this checkout's node serves batches (else ``node_level``
  says why it is missing).

``--engine llamacpp`` runs the llama.cpp engine instead (``run_llamacpp``): ``throughput_x_8``,
``step_time_by_batch``, ``node_x_16`` as above; ``vs_hf_engine_8``: its aggregate tokens/s of the
8 over the Transformers engine's (float32, same prompt texts, same scheduler, same thread count);
and ``exact_share`` against llama.cpp alone (``peerinfer.testing.llamacpp_reference``: a fresh
context, no cache, greedy), where a tie is a first difference at which the lone run's best logit
exceeded the logit of the token the engine chose by at most ``LLAMA_TIE``; ``tie_gaps`` lists
those gaps.

``--only node`` measures ``node_x_16`` alone (either engine); ``--only exact`` (llamacpp) measures
``exact_share`` alone, with the scheduler's time for the 64 (``exact_batched_s``) and the lone
runs' prefill and decode times (``ref_prefill_s``, ``ref_decode_s``). ``--flash-attn on|off``
(llamacpp) sets the engine's flash attention and its lone reference's alike (default: the
engine's own default).

``--clock cpu`` times with the process's CPU time instead of the wall clock (with one thread,
what the wall clock would read on an idle machine; generate_batch runs a thread of its own,
whose time is counted too). Say which when quoting figures, with the machine's load.
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

#: The clock the timed sections read (``--clock``).
clock: Callable[[], float] = time.perf_counter
TIE = 1e-4
#: llama.cpp's near-tie tolerance (logit units). With ubatches under 64 rows its batched and lone
#: logits are bit-identical (engine/llamacpp.py), so this only allows for a last-bit difference.
LLAMA_TIE = 1e-3


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Workload:
    """Chat prompts per subject, and the warm-up prompts that cache each subject's prefix."""

    def __init__(self, engine: Any, data: str | None, subjects: Sequence[str], per_subject: int) -> None:
        from peerinfer.core.messages import ChatMessage
        from peerinfer.workload import MMLU, default_data_dir, five_shot_prefix, question_suffix

        if data is None:
            data = default_data_dir()
        if data is None and (ROOT.parent / "shared" / "data" / "mmlu" / "dev").is_dir():
            data = ROOT.parent / "shared" / "data" / "mmlu"
        mmlu = MMLU.load(data)
        self.source = str(data or "packaged excerpt")
        self.prompts: dict[str, list[list[int]]] = {}
        #: The same questions as plain text, no chat template: the model continues the pattern
        #: instead of answering and ending, so these keep decoding (the busy requests).
        self.raw: list[list[int]] = []
        self.warm: list[list[int]] = []
        #: The user messages of ``prompts`` and ``warm`` (what a client sends a node).
        self.texts: dict[str, list[str]] = {}
        self.warm_texts: list[str] = []
        for subject in subjects:
            if subject not in mmlu.subjects:
                raise SystemExit(f"no subject {subject!r} in {self.source}")
            prefix = five_shot_prefix(subject, mmlu.dev(subject))
            questions = mmlu.test(subject)
            if len(questions) < 2:
                raise SystemExit(f"{subject}: needs at least 2 test questions")

            def chat(q: Any, prefix: str = prefix) -> list[int]:
                return list(engine.chat_tokens([ChatMessage("user", prefix + question_suffix(q))]))

            self.warm.append(chat(questions[-1]))
            self.warm_texts.append(prefix + question_suffix(questions[-1]))
            qs = questions[:-1]
            self.texts[subject] = [prefix + question_suffix(qs[i % len(qs)]) for i in range(per_subject)]
            self.prompts[subject] = [chat(qs[i % len(qs)]) for i in range(per_subject)]
            self.raw += [engine.tokenize(prefix + question_suffix(q)) for q in qs[:4]]

    def mixed(self, n: int, offset: int = 0) -> list[list[int]]:
        """``n`` prompts alternating between the subjects."""
        return _alternate(list(self.prompts.values()), n, offset)

    def mixed_texts(self, n: int, offset: int = 0) -> list[str]:
        return _alternate(list(self.texts.values()), n, offset)


def _alternate(lists: list[list[Any]], n: int, offset: int) -> list[Any]:
    return [lists[(offset + i) % len(lists)][(offset + i) // len(lists)] for i in range(n)]


def fresh_cache(engine: Any, workload: Workload) -> None:
    """An empty cache, then each subject's prefix cached by a request with another question."""
    from peerinfer.core.messages import SamplingParams
    from peerinfer.core.prefix import PrefixHasher

    engine.configure_cache(PrefixHasher(engine.fingerprint))
    for prompt in workload.warm:
        for _ in engine.generate(prompt, SamplingParams(max_tokens=1)):
            pass


def run_serial(engine: Any, prompts: Sequence[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    from peerinfer.core.messages import SamplingParams
    from peerinfer.engine import Tokens

    outs = []
    t0 = clock()
    for p in prompts:
        outs.append([t for ev in engine.generate(p, SamplingParams(max_tokens=tokens)) if isinstance(ev, Tokens) for t in ev.token_ids])
    return clock() - t0, outs


def run_scheduler(
    engine: Any, prompts: Sequence[list[int]], tokens: int, max_running: int,
    one_prefill_per_step: bool = False,
) -> tuple[float, list[list[int]], list[int]]:
    """All ``prompts`` submitted at once; (seconds, tokens per request, cached tokens).
    ``one_prefill_per_step``: the scheduler as it was before batched prefill (one request's
    chunk per step, as it still runs engines without their own ``prefill_batch``)."""
    from peerinfer.core.messages import SamplingParams
    from peerinfer.engine import Started, Tokens
    from peerinfer.engine.batch import BatchScheduler
    from peerinfer.errors import PeerInferError

    sched = BatchScheduler(engine, max_running=max_running)
    if one_prefill_per_step:
        sched._prefill_one_by_one = True  # the bench's before/after comparison only
    outs: list[list[int]] = [[] for _ in prompts]
    cached = [0] * len(prompts)
    t0 = clock()
    for k, p in enumerate(prompts):
        sched.submit(k, p, SamplingParams(max_tokens=tokens))
    for _ in range(100_000):
        if sched.idle:
            break
        for key, ev in sched.step():
            if isinstance(ev, PeerInferError):
                raise ev
            if isinstance(ev, Tokens):
                outs[key].extend(ev.token_ids)
            elif isinstance(ev, Started):
                cached[key] = ev.cached_tokens
    return clock() - t0, outs, cached


def run_hf_padded(engine: Any, prompts: Sequence[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    import torch

    tok = engine.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(engine.eos_token_ids)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=engine.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=engine.device)
    t0 = clock()
    with torch.inference_mode():
        out = engine.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False,
            pad_token_id=pad,
        )
    elapsed = clock() - t0
    return elapsed, [_until_eos(engine, row[width:].tolist()) for row in out]


def run_hf_cb(engine: Any, prompts: Sequence[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    from transformers import GenerationConfig

    gc = GenerationConfig(
        max_new_tokens=tokens, do_sample=False, eos_token_id=sorted(engine.eos_token_ids),
        pad_token_id=min(engine.eos_token_ids),
    )
    t0 = clock()
    outs = engine.model.generate_batch(inputs=[list(p) for p in prompts], generation_config=gc)
    elapsed = clock() - t0
    by_id = sorted(outs.items(), key=lambda kv: kv[0])
    return elapsed, [_until_eos(engine, list(o.generated_tokens)) for _, o in by_id]


def _until_eos(engine: Any, ids: list[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in engine.eos_token_ids:
            return ids[: i + 1]
    return ids


def rss_mb() -> float:
    """This process's resident memory now (Linux), in MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def reference(engine: Any, prompt: Sequence[int], n: int) -> tuple[list[int], list[Any]]:
    import torch

    if not hasattr(engine, "model"):  # not the Transformers engine: its own lone run
        from peerinfer.core.messages import SamplingParams
        from peerinfer.core.prefix import PrefixHasher
        from peerinfer.engine import Tokens

        engine.configure_cache(PrefixHasher(engine.fingerprint))  # nothing cached
        alone = [t for ev in engine.generate(list(prompt), SamplingParams(max_tokens=n))
                 if isinstance(ev, Tokens) for t in ev.token_ids]
        return alone, []

    ids = torch.tensor([list(prompt)], device=engine.device)
    with torch.inference_mode():
        out = engine.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            pad_token_id=min(engine.eos_token_ids), output_logits=True, return_dict_in_generate=True,
        )
    return _until_eos(engine, out.sequences[0, len(prompt):].tolist()), [r[0] for r in out.logits]


def compare(engine: Any, prompt: Sequence[int], got: Sequence[int], n: int) -> str:
    """'equal', 'tie' (first difference at a near tie of the lone run) or 'mismatch'."""
    expected, logits = reference(engine, prompt, n)
    if list(got) == expected:
        return "equal"
    for i, (a, b) in enumerate(zip(got, expected, strict=False)):
        if a != b and i < len(logits):
            gap = float(logits[i].max() - logits[i][a])
            return "tie" if gap <= TIE else "mismatch"
    return "mismatch"  # one is a prefix of the other: a length difference


def ttft_scheduler(engine: Any, prompt: list[int], busy: Sequence[list[int]], tokens: int) -> float:
    """Time from submitting ``prompt`` to its first token, with ``busy`` decoding meanwhile."""
    from peerinfer.core.messages import SamplingParams
    from peerinfer.engine import Tokens
    from peerinfer.engine.batch import BatchScheduler
    from peerinfer.errors import PeerInferError

    sched = BatchScheduler(engine, max_running=len(busy) + 1)
    seen: set[int] = set()
    for k, p in enumerate(busy):
        sched.submit(k, p, SamplingParams(max_tokens=128))  # outlives the timed part; fits the KV budget
    for _ in range(10_000):  # until every busy request decodes, then two more steps
        if len(seen) == len(busy):
            break
        for key, ev in sched.step():
            if isinstance(ev, PeerInferError):
                raise ev
            if isinstance(ev, Tokens) and ev.token_ids:
                seen.add(key)  # type: ignore[arg-type]
    for _ in range(2 if busy else 0):
        sched.step()
    assert sched.running == len(busy), "a busy request ended early"
    t0 = clock()
    sched.submit("new", prompt, SamplingParams(max_tokens=tokens))
    first = None
    for _ in range(10_000):
        for key, ev in sched.step():
            if key == "new" and isinstance(ev, Tokens) and ev.token_ids:
                first = clock() - t0
        if first is not None:
            break
    for k in range(len(busy)):
        sched.cancel(k)
    sched.cancel("new")
    for _ in range(10_000):
        if sched.idle:
            break
        sched.step()
    assert first is not None
    return first


def step_times(engine: Any, prompts: Sequence[list[int]], sizes: Sequence[int], steps: int) -> dict[int, float]:
    """Median ``decode_batch`` seconds with ``n`` decoders (end of sequence ignored: timing only)."""
    from peerinfer.core.messages import SamplingParams
    from peerinfer.engine.base import NEVER_CANCELLED, RequestJob

    out: dict[int, float] = {}
    for n in sizes:
        jobs = [RequestJob(engine, tuple(p), SamplingParams(max_tokens=steps + 4), NEVER_CANCELLED) for p in prompts[:n]]
        try:
            for job in jobs:
                job.start()
                assert job.decoder is not None
                job.decoder.prefill(1 << 20)
            decoders = [job.decoder for job in jobs]
            engine.decode_batch(decoders)  # first tokens: sampling only
            engine.decode_batch(decoders)  # joins the batch
            times = []
            for _ in range(steps):
                t0 = clock()
                engine.decode_batch(decoders)
                times.append(clock() - t0)
            out[n] = statistics.median(times)
        finally:
            for job in jobs:
                job.close()
        say(f"decode step with {n:2d} running: {out[n] * 1000:7.1f} ms ({n / out[n]:.1f} tokens/s)")
    return out


def node_level(engine: Any, work: Workload, tokens: int, n: int = 16) -> dict[str, Any]:
    """``n`` clients at once on one real node (libp2p on 127.0.0.1, the ``local`` policy) over
    the same ``n`` requests sent one after another; each run on a freshly started node (its
    cache cleared) that first caches the two prefixes."""
    import inspect

    import trio

    import peerinfer.node as node_module
    from peerinfer.client import Client
    from peerinfer.node import Node, NodeOptions

    if "BatchScheduler" not in inspect.getsource(node_module):
        return {"node_level": "missing: this checkout's node does not run the BatchScheduler"}
    chats = [[{"role": "user", "content": text}] for text in work.mixed_texts(n)]
    warm = [[{"role": "user", "content": text}] for text in work.warm_texts]

    async def run(concurrent: bool) -> tuple[float, int]:
        # The clients share the node's process and trio loop, so a loaded machine delays a
        # client's answer to the node's liveness ping past its deadline (3 s at the default
        # peer_timeout_s). That used to reset the client's generate stream in flight (seen: 6
        # clients' streams reset at load 4-7; this phase ran with a 30 s deadline then); now a
        # slow but live client keeps its request (peerinfer.net.liveness, "Slow but alive"),
        # so the node runs with its default liveness.
        options = NodeOptions(
            engine="unused", listen=("/ip4/127.0.0.1/tcp/0",), mdns=False, persist_identity=False,
            policy="local", seed=1, max_queue=n,
        )
        node = Node(options, engine=engine)
        produced = [0] * n
        async with trio.open_nursery() as nursery:
            await nursery.start(node.serve)
            addr = node.addresses()[0]
            async with Client.connect(addr) as client:
                for chat in warm:
                    await client.generate(chat, max_tokens=1)
            # Every client connects before the clock starts, and the concurrent ones send at
            # once: the figure is the node's serving, not libp2p's handshakes (16 connects cost
            # ~0.5 s of CPU here), nor arrivals straggling behind connects on a loaded machine.
            start = trio.Event()
            connected = 0
            t0 = 0.0
            if concurrent:
                async def ask(i: int) -> None:
                    nonlocal connected, t0
                    async with Client.connect(addr) as client:
                        connected += 1
                        if connected == n:
                            t0 = clock()
                            start.set()
                        await start.wait()
                        produced[i] = (await client.generate(chats[i], max_tokens=tokens)).completion_tokens

                async with trio.open_nursery() as clients:
                    for i in range(n):
                        clients.start_soon(ask, i)
            else:
                async with Client.connect(addr) as client:
                    t0 = clock()
                    for i in range(n):
                        produced[i] = (await client.generate(chats[i], max_tokens=tokens)).completion_tokens
            elapsed = clock() - t0
            nursery.cancel_scope.cancel()
        return elapsed, sum(produced)

    t_seq, n_seq = trio.run(run, False)
    t_conc, n_conc = trio.run(run, True)
    say(f"node, {n} clients: one after another {t_seq:.2f} s ({n_seq} tokens), "
        f"at once {t_conc:.2f} s ({n_conc} tokens)")
    # The same n prompts straight through the engine (one by one, and through a BatchScheduler
    # of the node's batch size), for what the node adds on top.
    prompts = work.mixed(n)
    fresh_cache(engine, work)
    t_eng_seq, seq_out = run_serial(engine, prompts, tokens)
    fresh_cache(engine, work)
    t_eng_conc, conc_out, _ = run_scheduler(engine, prompts, tokens, engine.max_batch_size)
    e_seq, e_conc = sum(map(len, seq_out)), sum(map(len, conc_out))
    say(f"engine, the same {n}: one by one {t_eng_seq:.2f} s ({e_seq} tokens), "
        f"scheduler {t_eng_conc:.2f} s ({e_conc} tokens)")
    return {
        f"node_sequential_{n}_s": round(t_seq, 3), f"node_concurrent_{n}_s": round(t_conc, 3),
        f"node_tokens_{n}": [n_seq, n_conc],
        f"node_x_{n}": round((n_conc / t_conc) / (n_seq / t_seq), 3),
        f"engine_sequential_{n}_s": round(t_eng_seq, 3), f"engine_concurrent_{n}_s": round(t_eng_conc, 3),
        f"engine_tokens_{n}": [e_seq, e_conc],
        f"engine_x_{n}": round((e_conc / t_eng_conc) / (e_seq / t_eng_seq), 3),
    }


def llama_exactness(engine: Any, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """``exact_share`` on the llama.cpp engine: ``--exact-requests`` through the scheduler, 8 at a
    time, against llama.cpp alone with the engine's flash attention setting."""
    from peerinfer.testing.llamacpp_reference import LlamaCppReference, first_difference

    fresh_cache(engine, work)
    prompts = work.mixed(args.exact_requests)
    t_batched, outs, _ = run_scheduler(engine, prompts, args.tokens, 8)
    ref = LlamaCppReference(engine.gguf, extra_buffers=engine.extra_buffers, threads=args.threads,
                            flash_attn=engine.flash_attn, clock=clock)
    verdicts, gaps = [], []
    ref_prefill = ref_decode = 0.0
    for p, o in zip(prompts, outs, strict=True):
        run = ref.greedy(p, args.tokens, stop=engine.eos_token_ids, keep_logits=True)
        ref_prefill += run.prefill_s
        ref_decode += run.decode_s
        k = first_difference(o, run)
        if k is None:
            verdicts.append("equal")
            continue
        gap = float(run.logits[k].max() - run.logits[k][o[k]]) if k < min(len(o), len(run.tokens)) else float("inf")
        gaps.append(round(gap, 5))
        verdicts.append("tie" if gap <= LLAMA_TIE else "mismatch")
    ref.close()
    out = dict(
        exact_requests=len(prompts), exact_equal=verdicts.count("equal"),
        exact_share=round(verdicts.count("equal") / len(prompts), 4),
        tie_flips=verdicts.count("tie"), mismatches=verdicts.count("mismatch"), tie_gaps=gaps,
        tie_tolerance=LLAMA_TIE, exact_batched_s=round(t_batched, 3),
        exact_tokens=sum(map(len, outs)), ref_prefill_s=round(ref_prefill, 3),
        ref_prompt_tokens=sum(map(len, prompts)), ref_decode_s=round(ref_decode, 3),
    )
    say(f"exact: {verdicts.count('equal')}/{len(prompts)} equal, {verdicts.count('tie')} tie flips "
        f"(gaps {gaps}), {verdicts.count('mismatch')} mismatches; batched {t_batched:.2f} s, lone "
        f"runs' prefill {ref_prefill:.2f} s, decode {ref_decode:.2f} s")
    return out


def run_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    """The llama.cpp engine's batching figures (see the module docstring)."""
    from peerinfer.engine.llamacpp import LlamaCppEngine

    sizes = [int(s) for s in args.step_sizes.split(",")]
    flash = {"auto": None, "on": True, "off": False}[args.flash_attn]
    engine = LlamaCppEngine(threads=args.threads, max_batch_size=8,
                            **({} if args.flash_attn == "auto" else {"flash_attn": flash}))
    subjects = [s.strip() for s in args.subjects.split(",") if s.strip()]
    needed = max(sizes + [args.exact_requests, 16])
    per_subject = max(8, -(-needed // len(subjects)))
    work = Workload(engine, args.data, subjects, per_subject)
    result: dict[str, Any] = {
        "engine": "llamacpp", "model": engine.model_name, "threads": args.threads,
        "clock": args.clock, "tokens": args.tokens, "data": work.source, "subjects": subjects,
        "extra_buffers": engine.extra_buffers, "flash_attn": engine.flash_attn,
    }
    if args.only == "node":
        result.update(node_level(engine, work, args.tokens))
        engine.close()
        result["load_avg"] = [round(x, 2) for x in os.getloadavg()]
        return result
    if args.only == "exact":
        result.update(llama_exactness(engine, work, args))
        engine.close()
        result["load_avg"] = [round(x, 2) for x in os.getloadavg()]
        return result
    eight = work.mixed(8)
    say(f"prompt tokens of the 8: {[len(p) for p in eight]}")
    fresh_cache(engine, work)
    run_serial(engine, eight[:1], 2)  # warm-up
    fresh_cache(engine, work)
    t_serial, serial = run_serial(engine, eight, args.tokens)
    fresh_cache(engine, work)
    t_batch, batched, cached = run_scheduler(engine, eight, args.tokens, 8)
    n_tokens = sum(map(len, batched))
    rate = n_tokens / t_batch
    result.update(
        serial_8_s=round(t_serial, 3), batched_8_s=round(t_batch, 3), tokens_8=n_tokens,
        tokens_8_serial=sum(map(len, serial)), cached_tokens_8=cached,
        serial_equal=sum(a == b for a, b in zip(serial, batched, strict=True)),
        throughput_x_8=round(rate / (sum(map(len, serial)) / t_serial), 3),
        tokens_per_s_8=round(rate, 2),
    )
    say(f"8 requests, {n_tokens} tokens: one by one {t_serial:.2f} s, batched {t_batch:.2f} s "
        f"-> x{result['throughput_x_8']} (cached {cached})")

    fresh_cache(engine, work)
    steps = step_times(engine, work.mixed(max(sizes)), sizes, args.steps)
    result["step_time_by_batch"] = {str(n): round(t, 5) for n, t in steps.items()}
    result["decode_step_s_by_batch"] = [[n, round(t, 5)] for n, t in sorted(steps.items())]

    result.update(llama_exactness(engine, work, args))

    if args.skip_node:
        result["node_level"] = "skipped (--skip-node)"
    else:
        result.update(node_level(engine, work, args.tokens))
    engine.close()

    if not args.skip_hf:
        import torch

        from peerinfer.engine.hf import TransformersEngine

        torch.set_num_threads(args.threads)
        hf = TransformersEngine(device="cpu", dtype="float32", threads=args.threads, max_batch_size=8)
        hf_work = Workload(hf, args.data, subjects, 8)
        hf_eight = hf_work.mixed(8)
        fresh_cache(hf, hf_work)
        run_serial(hf, hf_eight[:1], 2)  # warm-up
        fresh_cache(hf, hf_work)
        t_hf, hf_out, _ = run_scheduler(hf, hf_eight, args.tokens, 8)
        hf_rate = sum(map(len, hf_out)) / t_hf
        result.update(hf_batched_8_s=round(t_hf, 3), hf_tokens_per_s_8=round(hf_rate, 2),
                      vs_hf_engine_8=round(rate / hf_rate, 3))
        say(f"transformers engine, the same 8 batched: {t_hf:.2f} s ({hf_rate:.1f} tok/s) -> "
            f"llamacpp x{result['vs_hf_engine_8']}")
        hf.close()
    result["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    return result


def main(argv: Sequence[str] | None = None) -> int:
    global clock
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--data", help="MMLU directory (default $PEERINFER_MMLU or ../shared/data/mmlu, else the excerpt)")
    parser.add_argument("--subjects", default="astronomy,virology")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per request (32)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=None,
                        help="hf: the engine's max_batch_size, the node's slots (default: the engine's default)")
    parser.add_argument("--engine", default="hf", help="engine name, as for peerinfer node --engine (default hf)")
    parser.add_argument("--dtype", default="float32", help="hf engine: float32 (default), bfloat16, float16, auto")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--exact-requests", type=int, default=64)
    parser.add_argument("--ttft-repeats", type=int, default=4)
    parser.add_argument("--step-sizes", default="1,2,4,8,16")
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size")
    parser.add_argument("--skip-cb", action="store_true", help="skip generate_batch (slow on CPU)")
    parser.add_argument("--skip-node", action="store_true", help="skip the node-level figure")
    parser.add_argument("--only", choices=("node", "exact"),
                        help="measure only node_x_16 (node) or, llamacpp, only exact_share (exact)")
    parser.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto",
                        help="llamacpp: flash attention of the engine and of its lone reference (default auto: the engine's default)")
    parser.add_argument("--quick", action="store_true", help="tiny figures, for a smoke run")
    parser.add_argument("--skip-hf", action="store_true", help="llamacpp: skip the Transformers engine comparison")
    args = parser.parse_args(argv)
    if args.clock == "cpu":
        clock = time.process_time
    if args.quick:
        args.tokens, args.exact_requests, args.ttft_repeats, args.steps = 4, 4, 1, 2
        args.step_sizes = "1,2"
    if args.engine == "llamacpp":
        result = run_llamacpp(args)
        if args.json:
            print(json.dumps(result))
        else:
            for k, v in result.items():
                print(f"{k:24s} {v}")
        return 0

    import inspect

    import torch

    from peerinfer.engine.registry import load_engine, resolve_engine_class

    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.step_sizes.split(",")]
    wanted: dict[str, Any] = {"device": "cpu", "dtype": args.dtype, "threads": args.threads}
    if args.max_batch is not None:
        wanted["max_batch_size"] = args.max_batch
    accepted = inspect.signature(resolve_engine_class(args.engine)).parameters
    engine = load_engine(args.engine, **{k: v for k, v in wanted.items() if k in accepted})
    rss_after_load = rss_mb()
    hf = hasattr(engine, "model")
    subjects = [s.strip() for s in args.subjects.split(",") if s.strip()]
    # The TTFT figures take prompts from offset 15 on (past the throughput runs' prompts).
    needed = max(sizes + [args.exact_requests, 15 + args.ttft_repeats])
    per_subject = max(8, -(-needed // len(subjects)))
    work = Workload(engine, args.data, subjects, per_subject)
    result: dict[str, Any] = {
        "engine": args.engine, "dtype": str(getattr(engine, "dtype", "")).removeprefix("torch."),
        "model": engine.model_name, "threads": args.threads, "clock": args.clock,
        "max_batch_size": getattr(engine, "max_batch_size", None),
        "tokens": args.tokens, "data": work.source, "subjects": subjects,
    }
    if args.only == "node":
        result.update(node_level(engine, work, args.tokens))
        result["load_avg"] = [round(x, 2) for x in os.getloadavg()]
        engine.close()
        print(json.dumps(result) if args.json else result)
        return 0
    eight = work.mixed(8)
    say(f"prompt tokens of the 8: {[len(p) for p in eight]}")
    fresh_cache(engine, work)
    run_serial(engine, eight[:1], 2)  # warm-up

    fresh_cache(engine, work)
    t_serial, serial = run_serial(engine, eight, args.tokens)
    fresh_cache(engine, work)
    t_batch, batched, cached = run_scheduler(engine, eight, args.tokens, 8)
    n_tokens = sum(map(len, batched))
    rate = n_tokens / t_batch  # the batched engine's aggregate tokens/s
    result.update(
        serial_8_s=round(t_serial, 3), batched_8_s=round(t_batch, 3), tokens_8=n_tokens,
        tokens_8_serial=sum(map(len, serial)), cached_tokens_8=cached,
        serial_equal=sum(a == b for a, b in zip(serial, batched, strict=True)),
        throughput_x_8=round(rate / (sum(map(len, serial)) / t_serial), 3),
    )
    say(f"8 requests, {n_tokens} tokens: one by one {t_serial:.2f} s, batched {t_batch:.2f} s "
        f"-> x{result['throughput_x_8']} (cached {cached})")
    fresh_cache(engine, work)
    t_old, old, _ = run_scheduler(engine, eight, args.tokens, 8, one_prefill_per_step=True)
    result.update(
        batched_8_one_prefill_per_step_s=round(t_old, 3),
        throughput_x_8_one_prefill_per_step=round(
            (sum(map(len, old)) / t_old) / (sum(map(len, serial)) / t_serial), 3),
    )
    say(f"  the same, one newcomer prefilled per step (before batched prefill): {t_old:.2f} s "
        f"-> x{result['throughput_x_8_one_prefill_per_step']}")

    t_pad, padded = run_hf_padded(engine, eight, args.tokens) if hf else (0.0, [])
    if hf:
        result.update(hf_padded_8_s=round(t_pad, 3),
                      vs_hf_padded_8=round(rate / (sum(map(len, padded)) / t_pad), 3),
                      hf_padded_equal=sum(a == b for a, b in zip(padded, batched, strict=True)))
        say(f"transformers padded generate: {t_pad:.2f} s -> x{result['vs_hf_padded_8']} "
            f"({result['hf_padded_equal']}/8 outputs equal)")
    if hf and not args.skip_cb:
        t_cb, cb = run_hf_cb(engine, eight, args.tokens)
        result.update(hf_cb_8_s=round(t_cb, 3),
                      vs_hf_cb_8=round(rate / (sum(map(len, cb)) / t_cb), 3),
                      hf_cb_equal=sum(a == b for a, b in zip(cb, batched, strict=True)))
        say(f"transformers generate_batch: {t_cb:.2f} s -> x{result['vs_hf_cb_8']} "
            f"({result['hf_cb_equal']}/8 outputs equal)")

    idle, joined = [], []
    others = work.raw[:7]
    for i in range(args.ttft_repeats):
        prompt = work.mixed(1, offset=15 + i)[0]
        fresh_cache(engine, work)
        idle.append(ttft_scheduler(engine, prompt, [], args.tokens))
        fresh_cache(engine, work)
        joined.append(ttft_scheduler(engine, prompt, others, args.tokens))
        say(f"TTFT idle {idle[-1] * 1000:.0f} ms, joining 7 decoding {joined[-1] * 1000:.0f} ms")
    ti, tj = statistics.median(idle), statistics.median(joined)
    result.update(ttft_idle_s=round(ti, 4), ttft_join_s=round(tj, 4), ttft_join_ratio=round(tj / ti, 3))

    fresh_cache(engine, work)
    steps = step_times(engine, work.mixed(max(sizes)), sizes, args.steps)
    result["step_time_by_batch"] = {str(n): round(t, 5) for n, t in steps.items()}
    result["decode_step_s_by_batch"] = [[n, round(t, 5)] for n, t in sorted(steps.items())]

    fresh_cache(engine, work)
    prompts = work.mixed(args.exact_requests)
    _, outs, _ = run_scheduler(engine, prompts, args.tokens, 8)
    cache = engine.radix_cache
    result.update(rss_after_load_mb=rss_after_load, rss_after_64_mb=rss_mb(),
                  kv_budget_mb=round(cache.capacity_bytes / 2**20, 1) if cache is not None and cache.capacity_bytes else None)
    say(f"resident memory: {rss_after_load} MiB after load, {result['rss_after_64_mb']} MiB after "
        f"{len(prompts)} more requests (KV budget {result['kv_budget_mb']} MiB)")
    verdicts = [compare(engine, p, o, args.tokens) for p, o in zip(prompts, outs, strict=True)]
    result.update(
        exact_requests=len(prompts), exact_share=round(verdicts.count("equal") / len(prompts), 4),
        tie_flips=verdicts.count("tie"), mismatches=verdicts.count("mismatch"),
    )
    say(f"exact: {verdicts.count('equal')}/{len(prompts)} equal, {verdicts.count('tie')} tie flips, "
        f"{verdicts.count('mismatch')} mismatches")

    if args.skip_node:
        result["node_level"] = "skipped (--skip-node)"
    else:
        result.update(node_level(engine, work, args.tokens))
    result["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    engine.close()
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:24s} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
