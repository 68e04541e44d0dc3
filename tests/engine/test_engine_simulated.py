"""The simulated engine: deterministic tokenizer and output, cost-model timing, real cache."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from peerinfer.core.costmodel import CostModel
from peerinfer.core.messages import SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.engine import Finished, SimulatedEngine, Started, Tokens
from peerinfer.errors import ConfigError, InvalidRequestError

COSTS = CostModel(
    prefill_s_per_token=0.001,
    cached_s_per_token=0.0001,
    decode_s_per_token=0.01,
    overhead_s=0.005,
)


def _engine(**kw: object) -> SimulatedEngine:
    kw.setdefault("time_scale", 0.0)
    kw.setdefault("costs", COSTS)
    return SimulatedEngine(**kw)  # type: ignore[arg-type]


def _run(engine, tokens, params=None, cancel=None):
    events = list(engine.generate(tokens, params or SamplingParams(max_tokens=4), cancel))
    started = events[0]
    done = events[-1]
    assert isinstance(started, Started) and isinstance(done, Finished)
    ids = [t for ev in events if isinstance(ev, Tokens) for t in ev.token_ids]
    text = "".join(ev.text for ev in events if isinstance(ev, Tokens))
    return started, ids, text, done


def test_tokenizer_is_pinned_across_processes_and_versions():
    # Pinned values: a change here changes every prefix hash in deployed simulations.
    engine = _engine()
    assert engine.tokenize("The capital of France is Paris, isn't it? 12345 extraordinarily") == [
        8647, 19404, 25851, 7297, 21198, 11155, 29468, 30780, 24395,
        10422, 10368, 19546, 8975, 12374, 19092, 2403,
    ]  # fmt: skip
    assert engine.completion_ids([5, 6, 7], SamplingParams(), 4) == [9450, 21661, 21253, 24228]
    assert engine.detokenize([2, 4, 100, 31999]) == " bu mabe dunide"  # reserved ids: no text
    code = (
        "from peerinfer.engine.simulated import SimulatedEngine;"
        "print(SimulatedEngine().tokenize('Hello there, world'))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": ":".join(sys.path)},
        ).stdout
        for seed in ("1", "2")
    }
    assert outs == {f"{engine.tokenize('Hello there, world')}\n"}


def test_tokenizer_pieces_roughly_like_bpe():
    engine = _engine()
    assert len(engine.tokenize("hello world")) == 2
    assert len(engine.tokenize("a" * 20)) == 3  # long words come in pieces of 8 characters
    assert all(4 <= t < engine.vocab_size for t in engine.tokenize("Ünïcödé, 😀 ok"))
    assert engine.tokenize("") == []


def test_output_is_deterministic_and_seeded_sampling_repeats():
    a, b = _engine(), _engine()
    prompt = a.tokenize("one two three four five six seven eight nine ten")
    greedy = SamplingParams(max_tokens=6)
    assert _run(a, prompt, greedy)[1] == _run(b, prompt, greedy)[1]
    seeded = SamplingParams(max_tokens=6, temperature=0.7, seed=42)
    assert _run(a, prompt, seeded)[1] == _run(b, prompt, seeded)[1]
    other = SamplingParams(max_tokens=6, temperature=0.7, seed=43)
    assert _run(a, prompt, seeded)[1] != _run(a, prompt, other)[1]
    unseeded = SamplingParams(max_tokens=6, temperature=0.7)
    assert _run(a, prompt, unseeded)[1] != _run(a, prompt, unseeded)[1]


def test_prefix_hits_follow_the_real_engine_rules():
    engine = _engine()
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4))
    prompt = list(range(10, 30))  # 20 tokens
    started, ids, _, done = _run(engine, prompt, SamplingParams(max_tokens=5))
    assert started.cached_tokens == 0
    hasher = engine.radix_cache.hasher
    assert set(done.cache_added) == set(hasher.chain(prompt + ids[:-1]))
    # Full-prompt hit: the last prompt token always runs, so 16 of 20 come from cache.
    assert _run(engine, prompt)[0].cached_tokens == 16
    # The next turn hits the generated tokens too.
    turn = prompt + ids + [7, 7]
    assert _run(engine, turn)[0].cached_tokens == (len(prompt) + len(ids) - 1) // 4 * 4


def test_plan_is_the_pure_twin_of_generate():
    """The simulator's plan() and a real-time generate() agree request for request."""
    timed, planned = _engine(capacity_bytes=8 * 4 * 100), _engine(capacity_bytes=8 * 4 * 100)
    for engine in (timed, planned):
        engine.kv_bytes_per_token = 100
        engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4))
    prompts = [list(range(20)), list(range(18)) + [1, 1], list(range(30, 60)), list(range(20))]
    for prompt in prompts:
        params = SamplingParams(max_tokens=3)
        started, ids, _, done = _run(timed, prompt, params)
        plan = planned.plan(prompt, params)
        assert plan.cached_tokens == started.cached_tokens
        assert list(plan.completion_ids) == ids and plan.completion_tokens == done.completion_tokens
        assert (plan.cache_added, plan.cache_removed) == (done.cache_added, done.cache_removed)
        assert plan.ttft_s == COSTS.prefill_s(len(prompt), plan.cached_tokens)
        assert plan.service_s == COSTS.service_s(len(prompt), plan.cached_tokens, 3)
    assert timed.radix_cache.stats().evicted_blocks > 0
    assert set(timed.radix_cache.block_hashes()) == set(planned.radix_cache.block_hashes())


def test_cache_budget_and_eviction_reports():
    engine = _engine(capacity_bytes=3 * 16 * 10, kv_bytes_per_token=10)
    digest = set(engine.cached_block_hashes())
    for i in range(6):
        _, _, _, done = _run(engine, [100 + i] * 40, SamplingParams(max_tokens=2))
        digest = (digest | set(done.cache_added)) - set(done.cache_removed)
        stats = engine.radix_cache.stats()
        assert stats.bytes <= 3 * 16 * 10
    assert digest == set(engine.radix_cache.block_hashes())
    assert engine.radix_cache.stats().evicted_blocks > 0


def test_stop_sequences_in_generate():
    engine = _engine()
    prompt = engine.tokenize("stop me if you can")
    _, ids, text, _ = _run(engine, prompt, SamplingParams(max_tokens=6))
    third = engine.detokenize(ids[2:3])
    _, ids2, text2, done = _run(engine, prompt, SamplingParams(max_tokens=6, stop=(third,)))
    assert done.finish_reason == "stop" and text2 == engine.detokenize(ids[:2])
    assert ids2 == ids[:3]


def test_bad_requests_and_options():
    engine = _engine(max_context_tokens=32)
    for bad in ([], [0] * 32, [32_000]):
        with pytest.raises(InvalidRequestError):
            engine.generate(bad, SamplingParams())
        with pytest.raises(InvalidRequestError):
            engine.plan(bad, SamplingParams())
    assert _run(engine, [5] * 30, SamplingParams(max_tokens=10))[3].completion_tokens == 2
    for options in ({"vocab_size": 3}, {"max_context_tokens": 1}, {"time_scale": -1.0}):
        with pytest.raises(ConfigError):
            SimulatedEngine(**options)  # type: ignore[arg-type]


def test_sleeps_follow_the_cost_model_and_cancel_wakes_them():
    # If cancellation did not interrupt the sleep, this would take 30 s and finish 'length'.
    engine = SimulatedEngine(
        costs=CostModel(prefill_s_per_token=0.0, decode_s_per_token=30.0, overhead_s=0.0),
        time_scale=1.0,
    )
    cancel = threading.Event()
    events = []
    for ev in engine.generate([5, 6, 7], SamplingParams(max_tokens=2), cancel):
        events.append(ev)
        if isinstance(ev, Tokens):
            threading.Timer(0.05, cancel.set).start()
    assert events[-1].finish_reason == "cancelled"
    assert events[-1].completion_tokens == 1


def test_generate_takes_the_planned_time():
    # Behaviour, not a timing assertion: generate sleeps at least the modelled time.
    engine = SimulatedEngine(
        costs=CostModel(prefill_s_per_token=0.0, decode_s_per_token=0.02, overhead_s=0.01),
        time_scale=1.0,
    )
    t0 = time.monotonic()
    _run(engine, [5, 6, 7], SamplingParams(max_tokens=3))
    assert time.monotonic() - t0 >= 0.01 + 2 * 0.02
