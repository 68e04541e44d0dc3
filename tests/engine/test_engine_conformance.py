"""One conformance suite that every engine passes: the example backend, the simulated engine,
the Transformers engine (on a tiny random model) and the batching test engine. A new backend can
add itself to ENGINES.

The batching part drives each engine through the :class:`BatchScheduler` (with room for several
requests, whatever the engine's own ``max_batch_size``): requests join and leave at any step,
are cancelled mid-batch, fail alone, stay within the KV budget, and every request's tokens equal
what ``generate()`` gives it alone (every engine here is deterministic under greedy decoding)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from peerinfer.core.messages import SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.engine import Engine, Finished, Started, Tokens, load_engine
from peerinfer.engine.batch import BatchScheduler
from peerinfer.errors import EngineError, InvalidRequestError, PeerInferError
from peerinfer.testing.engines import BatchRecordingEngine

ROOT = Path(__file__).resolve().parents[2]


def _echo() -> Engine:
    return load_engine(f"{ROOT / 'examples' / 'custom_backend.py'}:EchoEngine")


def _simulated() -> Engine:
    return load_engine("simulated", time_scale=0.0)


_TINY: list[Path] = []


def _tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    pytest.importorskip("torch")
    from tests.engine.test_engine_hf import _make_tiny_model

    if not _TINY:  # build the model once per session
        directory = tmp_path_factory.mktemp("conformance-tiny")
        _make_tiny_model(directory)
        _TINY.append(directory)
    return load_engine("hf", model=str(_TINY[0]), device="cpu")


def _llamacpp(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    pytest.importorskip("llama_cpp")
    # The default model's GGUF (SmolLM2-135M Q4_1), small context, one thread; the extra
    # buffer types' probe is the subject of tests/test_engine_llamacpp.py, not of these.
    return load_engine("llamacpp", threads=1, capacity_bytes=64 << 20, max_batch_size=4,
                       extra_buffers=False)


ENGINES: dict[str, Callable[[pytest.TempPathFactory], Engine]] = {
    "echo": lambda _: _echo(),
    "simulated": lambda _: _simulated(),
    "hf-tiny": _tiny_hf,
    "llamacpp": _llamacpp,
    "batch-recording": lambda _: BatchRecordingEngine(kv_bytes_per_token=64),
}


@pytest.fixture(params=sorted(ENGINES))
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    made = ENGINES[request.param](tmp_path_factory)
    made.configure_cache(PrefixHasher(made.fingerprint, block_size=4))
    yield made
    made.close()


def _prompt(engine: Engine) -> list[int]:
    ids = engine.tokenize("The quick brown fox jumps over the lazy dog again and again")
    return [t % engine.vocab_size for t in ids][:40]


def _events(engine: Engine, prompt, params, cancel=None):
    events = list(engine.generate(prompt, params, cancel))
    assert isinstance(events[0], Started)
    assert isinstance(events[-1], Finished)
    assert all(isinstance(ev, Tokens) for ev in events[1:-1])
    return events


def test_identity(engine):
    assert isinstance(engine.fingerprint, bytes) and engine.fingerprint
    assert engine.vocab_size > 0 and engine.max_context_tokens > 1
    assert all(0 <= t < engine.vocab_size for t in engine.eos_token_ids)
    assert isinstance(engine.model_name, str) and engine.model_name


def test_event_stream_accounting(engine):
    prompt = _prompt(engine)
    events = _events(engine, prompt, SamplingParams(max_tokens=7))
    started, done = events[0], events[-1]
    ids = [t for ev in events[1:-1] for t in ev.token_ids]
    assert started.prompt_tokens == done.prompt_tokens == len(prompt)
    assert started.cached_tokens == done.cached_tokens <= len(prompt) - 1
    assert done.completion_tokens == len(ids) <= 7
    if done.finish_reason == "length":
        assert len(ids) == 7
    text = "".join(ev.text for ev in events[1:-1])
    assert text == engine.detokenize([t for t in ids if t not in engine.eos_token_ids])


def test_greedy_is_deterministic_and_reuses_the_cache(engine):
    prompt = _prompt(engine)
    first = _events(engine, prompt, SamplingParams(max_tokens=5))
    second = _events(engine, prompt, SamplingParams(max_tokens=5))
    ids = [[t for ev in run[1:-1] for t in ev.token_ids] for run in (first, second)]
    assert ids[0] == ids[1]
    assert second[0].cached_tokens >= first[0].cached_tokens
    if engine.supports_prefix_cache:
        assert second[0].cached_tokens == (len(prompt) - 1) // 4 * 4


def test_reports_replay_to_the_cache(engine):
    digest = set(engine.cached_block_hashes())
    for i in range(3):
        prompt = _prompt(engine)[: 10 + 9 * i]
        done = _events(engine, prompt, SamplingParams(max_tokens=3))[-1]
        digest = (digest | set(done.cache_added)) - set(done.cache_removed)
    cache = engine.radix_cache
    assert digest == (set() if cache is None else set(cache.block_hashes()))


def test_bad_requests_and_cancellation(engine):
    for tokens, params in (
        ([], SamplingParams()),
        ([engine.vocab_size], SamplingParams()),
        (_prompt(engine), SamplingParams(max_tokens=0)),
        (_prompt(engine), SamplingParams(top_p=0.0)),
    ):
        with pytest.raises(InvalidRequestError):
            engine.generate(tokens, params)
    cancel = threading.Event()
    cancel.set()
    done = _events(engine, _prompt(engine), SamplingParams(max_tokens=5), cancel)[-1]
    assert done.finish_reason == "cancelled" and done.completion_tokens == 0
    assert _events(engine, _prompt(engine), SamplingParams(max_tokens=2))[-1].completion_tokens >= 1


# --------------------------------------------------------------------------------------------
# Batching: the scheduler on every engine.


class _Run:
    """One request's events as the scheduler reported them, checked for shape as they come."""

    def __init__(self) -> None:
        self.started: Started | None = None
        self.ids: list[int] = []
        self.text = ""
        self.finished: Finished | None = None
        self.error: PeerInferError | None = None

    def add(self, item: object) -> None:
        assert self.finished is None and self.error is None, "an event after the end"
        if isinstance(item, Started):
            assert self.started is None
            self.started = item
        elif isinstance(item, Tokens):
            assert self.started is not None
            self.ids.extend(item.token_ids)
            self.text += item.text
        elif isinstance(item, Finished):
            assert self.started is not None
            self.finished = item
        else:
            assert isinstance(item, PeerInferError), item
            self.error = item


def _drive(engine, scheduler, runs, *, max_steps=2000, each_step=None):
    """Step until idle (bounded), routing events into ``runs``; checks the cache every step."""
    for _ in range(max_steps):
        if scheduler.idle:
            return
        for key, item in scheduler.step():
            runs.setdefault(key, _Run()).add(item)
        if engine.radix_cache is not None:
            engine.radix_cache.check_invariants(verify_hashes=False)
        if each_step is not None:
            each_step()
    raise AssertionError("the scheduler did not become idle")


def _prompts(engine: Engine, n: int) -> list[list[int]]:
    """``n`` prompts of different lengths, the later ones sharing a prefix with the first."""
    base = _prompt(engine)
    out = [base[: 9 + 5 * (i % 4)] + [(7 * i + 3) % engine.vocab_size] for i in range(n)]
    return out


#: llama.cpp's CPU flash attention accumulates in a cell order that depends on where a sequence's
#: KV cells sit in the shared context, so a batched request can round differently from a lone
#: run; a token may then flip where the lone run's two best logits were this close (logit units).
#: Every other engine here must match exactly.
LLAMACPP_NEAR_TIE = 0.05


def _assert_as_alone(engine: Engine, prompt, run, expected, *, prefix_only: bool = False) -> None:
    """``run`` got what ``generate()`` gives the prompt alone (``expected``: ids, text, reason);
    on the llama.cpp engine, or it first differs at a near-tie of llama.cpp alone."""
    got = (run.ids, run.text, run.finished.finish_reason)
    if prefix_only:
        if run.ids == expected[0][: len(run.ids)]:
            return
    elif got == expected:
        return
    assert type(engine).__name__ == "LlamaCppEngine", (got, expected)
    from peerinfer.testing.llamacpp_reference import LlamaCppReference, first_difference

    ref = LlamaCppReference(engine.gguf, extra_buffers=engine.extra_buffers)
    try:
        lone = ref.greedy(prompt, len(expected[0]) + 1, stop=engine.eos_token_ids, keep_logits=True)
    finally:
        ref.close()
    k = first_difference(run.ids, lone)
    assert k is not None and k < len(run.ids) and k < len(lone.tokens), (run.ids, lone.tokens)
    gap = float(lone.logits[k].max() - lone.logits[k][run.ids[k]])
    assert gap <= LLAMACPP_NEAR_TIE, f"token {k}: {run.ids[k]} vs {lone.tokens[k]}, logit gap {gap:.4f}"


def _alone(engine: Engine, prompt, params):
    events = _events(engine, prompt, params)
    ids = [t for ev in events[1:-1] for t in ev.token_ids]
    return ids, "".join(ev.text for ev in events[1:-1]), events[-1].finish_reason


def test_batch_results_equal_one_by_one_generate(engine):
    prompts = _prompts(engine, 6)
    params = [SamplingParams(max_tokens=3 + i % 4) for i in range(len(prompts))]
    alone = [_alone(engine, p, q) for p, q in zip(prompts, params, strict=True)]
    scheduler = BatchScheduler(engine, max_running=4)
    for i, (p, q) in enumerate(zip(prompts, params, strict=True)):
        scheduler.submit(i, p, q)
    runs: dict[int, _Run] = {}
    _drive(engine, scheduler, runs)
    for i, expected in enumerate(alone):
        run = runs[i]
        assert run.error is None and run.finished is not None
        _assert_as_alone(engine, prompts[i], run, expected)
        assert run.finished.completion_tokens == len(run.ids)
        assert run.started.cached_tokens == run.finished.cached_tokens <= len(prompts[i]) - 1
    stats = scheduler.statistics()
    assert max(size for size, _ in stats.batch_sizes) > 1  # they really ran together
    assert stats.running == stats.waiting == 0 and stats.finished == len(prompts)
    assert max(size for size, _ in stats.batch_sizes) <= 4
    cache = engine.radix_cache
    assert cache is None or (cache.stats().locked_blocks == 0 and cache.reserved_bytes == 0)


def test_requests_join_and_leave_at_any_step(engine):
    prompts = _prompts(engine, 5)
    lengths = [9, 2, 5, 1, 4]
    alone = [_alone(engine, p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, lengths, strict=True)]
    scheduler = BatchScheduler(engine, max_running=3)
    runs: dict[int, _Run] = {}
    scheduler.submit(0, prompts[0], SamplingParams(max_tokens=lengths[0]))
    submitted = 1
    for _ in range(200):
        if submitted == len(prompts) and scheduler.idle:
            break
        for key, item in scheduler.step():
            runs.setdefault(key, _Run()).add(item)
        assert scheduler.running <= 3
        if submitted < len(prompts):  # one more joins after every step
            scheduler.submit(submitted, prompts[submitted], SamplingParams(max_tokens=lengths[submitted]))
            submitted += 1
    assert scheduler.idle
    for i, expected in enumerate(alone):
        assert runs[i].error is None
        _assert_as_alone(engine, prompts[i], runs[i], expected)
    # The short ones finished while the long first one was still decoding.
    first_done = scheduler.statistics()
    assert first_done.finished == 5 and first_done.admitted == 5


def test_cancellation_mid_batch_leaves_the_neighbours_alone(engine):
    prompts = _prompts(engine, 4)
    params = SamplingParams(max_tokens=8)
    alone = [_alone(engine, p, params) for p in prompts]
    scheduler = BatchScheduler(engine, max_running=4)
    by_token = threading.Event()
    for i, p in enumerate(prompts):
        scheduler.submit(i, p, params, by_token if i == 1 else None)
    scheduler.submit("waiting", prompts[0], params)  # cancelled before it is ever admitted
    scheduler.cancel("waiting")
    runs: dict[object, _Run] = {}

    def cancel_after_two_tokens() -> None:
        if 1 in runs and len(runs[1].ids) >= 2:
            by_token.set()
        if 2 in runs and len(runs[2].ids) >= 3:
            scheduler.cancel(2)

    _drive(engine, scheduler, runs, each_step=cancel_after_two_tokens)
    for i in (1, 2):
        done = runs[i].finished
        assert done is not None and done.finish_reason == "cancelled"
        assert done.completion_tokens == len(runs[i].ids) < 8
        _assert_as_alone(engine, prompts[i], runs[i], alone[i], prefix_only=True)
    for i in (0, 3):
        _assert_as_alone(engine, prompts[i], runs[i], alone[i])
    assert runs["waiting"].finished.finish_reason == "cancelled"
    assert runs["waiting"].finished.completion_tokens == 0
    assert scheduler.statistics().cancelled == 3
    cache = engine.radix_cache
    assert cache is None or cache.stats().locked_blocks == 0


def _configure_cache_capacity(engine: Engine, capacity: int) -> None:
    """Configure the cache so that its own byte budget (what running requests reserve from) is
    ``capacity``: an engine may keep part of the configured budget for itself (the llama.cpp
    engine's context), so the configured figure is scaled until the cache gets ``capacity``."""
    configured = capacity
    for _ in range(4):
        engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4), capacity_bytes=configured)
        got = engine.radix_cache.capacity_bytes
        if got == capacity:
            return
        configured = configured * capacity // max(1, got) + (1 if got > capacity else 0)
    assert abs(engine.radix_cache.capacity_bytes - capacity) <= 1, engine.radix_cache.capacity_bytes


class _ExplodingToken:
    """A cancel token that raises once the request has been polled ``after`` times: a failure
    inside one request, mid-batch, that works the same on every engine."""

    def __init__(self, after: int) -> None:
        self.calls = 0
        self.after = after

    def is_set(self) -> bool:
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("request-local failure")
        return False


def test_an_error_in_one_request_does_not_fail_its_neighbours(engine):
    prompts = _prompts(engine, 3)
    params = SamplingParams(max_tokens=6)
    alone = [_alone(engine, p, params) for p in prompts]
    scheduler = BatchScheduler(engine, max_running=3)
    for i, p in enumerate(prompts):
        scheduler.submit(i, p, params, _ExplodingToken(after=6) if i == 1 else None)
    runs: dict[int, _Run] = {}
    _drive(engine, scheduler, runs)
    assert isinstance(runs[1].error, EngineError) and runs[1].finished is None
    assert "request-local failure" in str(runs[1].error)
    for i in (0, 2):
        assert runs[i].error is None
        _assert_as_alone(engine, prompts[i], runs[i], alone[i])
    assert scheduler.statistics().failed == 1
    assert engine.statistics().errors >= 1
    cache = engine.radix_cache
    assert cache is None or (cache.stats().locked_blocks == 0 and cache.reserved_bytes == 0)
    # The engine keeps serving.
    assert _alone(engine, prompts[0], params) == alone[0]


def test_running_requests_and_the_cache_stay_within_the_kv_budget(engine):
    kv = engine.kv_bytes_per_token
    base = _prompt(engine)[:19]
    prompts = [base + [(7 * i + 3) % engine.vocab_size] for i in range(5)]  # equal lengths
    params = SamplingParams(max_tokens=6)
    alone = [_alone(engine, p, params) for p in prompts]
    if not engine.supports_prefix_cache or kv <= 0:
        # No KV accounting (the contract's kv_bytes_per_token = 0): the scheduler reserves
        # nothing and admits up to max_running at once.
        scheduler = BatchScheduler(engine, max_running=5)
        for i, p in enumerate(prompts):
            scheduler.submit(i, p, params)
        runs_free: dict[int, _Run] = {}
        seen = [0]

        def nothing_reserved() -> None:
            assert scheduler.statistics().kv_reserved_bytes == 0
            seen[0] = max(seen[0], scheduler.running)

        _drive(engine, scheduler, runs_free, each_step=nothing_reserved)
        assert seen[0] == 5
        for i, expected in enumerate(alone):
            _assert_as_alone(engine, prompts[i], runs_free[i], expected)
        return
    need = (len(prompts[0]) + 6) * kv
    budget = 2 * need + need // 2  # two requests at a time, never three
    _configure_cache_capacity(engine, budget)
    with pytest.raises(InvalidRequestError, match="KV memory"):
        BatchScheduler(engine).submit("huge", prompts[0], SamplingParams(max_tokens=budget // kv))
    scheduler = BatchScheduler(engine, max_running=5)
    for i, p in enumerate(prompts):
        scheduler.submit(i, p, params)
    runs: dict[int, _Run] = {}
    peak = [0]

    def within_budget() -> None:
        stats = engine.radix_cache.stats()
        assert stats.bytes + stats.reserved_bytes <= budget
        assert scheduler.statistics().kv_reserved_bytes == stats.reserved_bytes
        peak[0] = max(peak[0], scheduler.running)

    _drive(engine, scheduler, runs, each_step=within_budget)
    assert peak[0] == 2  # admission waited for memory instead of overcommitting
    for i, expected in enumerate(alone):
        _assert_as_alone(engine, prompts[i], runs[i], expected)
    assert engine.radix_cache.reserved_bytes == 0
