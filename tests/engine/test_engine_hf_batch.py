"""The Transformers engine decoding many requests at once: exact, whatever joins and leaves.

"Exact" means: every request decoded in a batch produces the greedy tokens that transformers'
own ``model.generate(do_sample=False)`` produces for its full prompt alone, with no prefix
cache, in float32 on the CPU. Batched matrix products round differently from lone ones, so a
token may flip where the lone run's two best logits are (nearly) tied: a difference is accepted
only where the token produced scores within ``TIE`` of the lone run's best logit at that
position (after which the two continuations legitimately differ); any other difference fails.

The requests are driven by ``_Driver``, a minimal scheduler written here against the engine's
hooks (cache match and lock, ``open_decoder``, ``prefill`` chunks, ``decode_batch``, store and
close), so the tests pin the engine's side of the batching contract on their own.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from peerinfer.core.messages import ChatMessage, SamplingParams  # noqa: E402
from peerinfer.core.prefix import PrefixHasher  # noqa: E402
from peerinfer.engine import Tokens  # noqa: E402
from peerinfer.engine.base import NO_PREFIX, CachedPrefix, DecodeRequest  # noqa: E402
from peerinfer.engine.hf import TransformersEngine  # noqa: E402
from peerinfer.errors import ConfigError  # noqa: E402
from tests.engine.test_engine_hf import _make_tiny_model  # noqa: E402

BS = 4
#: The largest gap between the lone run's best logit and the batched run's token accepted as a
#: rounding flip.
TIE = 1e-4


# --------------------------------------------------------------------------------------------
# Helpers.


@dataclass
class _Job:
    key: int
    prompt: tuple[int, ...]
    params: SamplingParams
    decoder: Any
    prefix: CachedPrefix
    locked: Any
    cancel: threading.Event
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    cancelled: bool = False


class _Driver:
    """Runs requests on one engine the way a batch scheduler would, one iteration per step()."""

    def __init__(self, engine: TransformersEngine, chunk: int = 16) -> None:
        self.engine = engine
        self.cache = engine._ensure_cache()
        self.chunk = chunk
        self.jobs: dict[int, _Job] = {}
        self.finished: dict[int, _Job] = {}
        self.batch_sizes: list[int] = []

    def submit(self, key: int, prompt: Sequence[int], params: SamplingParams) -> _Job:
        prompt = tuple(prompt)
        cache = self.cache
        prefix, locked = NO_PREFIX, None
        if cache is not None:
            match = cache.match(prompt[:-1])
            if match.nodes:
                locked = match.last_node
                cache.lock(locked)
                prefix = CachedPrefix(match.tokens, tuple(match.payloads))
        seed = params.seed if params.seed is not None else key
        cancel = threading.Event()
        request = DecodeRequest(
            prompt, params, cancel, random.Random(seed), prefix, cache.block_size if cache is not None else BS
        )
        job = _Job(key, prompt, params, self.engine.open_decoder(request), prefix, locked, cancel)
        self.jobs[key] = job
        return job

    def step(self) -> None:
        for job in list(self.jobs.values()):
            if job.cancel.is_set():
                job.cancelled = True
                self._finish(job)
        for job in self.jobs.values():  # one prefill chunk, oldest first
            if job.decoder.prefill_remaining:
                job.decoder.prefill(self.chunk)
                break
        ready = [j for j in self.jobs.values() if j.decoder.prefill_remaining == 0]
        if not ready:
            return
        self.batch_sizes.append(len(ready))
        tokens = self.engine.decode_batch([j.decoder for j in ready])
        eos = self.engine.eos_token_ids
        for job, token in zip(ready, tokens, strict=True):
            assert token is not None
            job.tokens.append(token)
            if len(job.tokens) >= job.params.max_tokens or token in eos:
                self._finish(job)

    def _finish(self, job: _Job) -> None:
        try:
            if self.cache is not None:
                self.engine._store(self.cache, job.decoder, job.prompt, job.tokens, job.prefix)
        finally:
            job.decoder.close()
            if job.locked is not None and not job.locked.evicted:
                self.cache.unlock(job.locked)
        job.done = True
        del self.jobs[job.key]
        self.finished[job.key] = job

    def run(self, limit: int = 10_000) -> None:
        for _ in range(limit):
            if not self.jobs:
                return
            self.step()
        raise AssertionError("requests did not finish")


def _reference(engine: TransformersEngine, prompt: Sequence[int], n: int) -> tuple[list[int], list[Any]]:
    """transformers' greedy tokens for ``prompt`` alone, and its logits at every position."""
    ids = torch.tensor([list(prompt)])
    with torch.inference_mode():
        out = engine.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=min(engine.eos_token_ids),
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), [row[0] for row in out.logits]


def _assert_exact(engine: TransformersEngine, prompt: Sequence[int], got: Sequence[int]) -> int:
    """Fail unless ``got`` equals the lone greedy run up to a rounding flip; 1 if it flipped."""
    expected, logits = _reference(engine, prompt, len(got))
    for i, token in enumerate(got):
        if i >= len(expected):
            pytest.fail(f"generated past the reference's end at {i}: {got} vs {expected}")
        if token != expected[i]:
            gap = float(logits[i].max() - logits[i][token])
            assert gap <= TIE, (
                f"token {i} differs ({token} vs {expected[i]}) and the lone run's logits were "
                f"{gap:.3g} apart (more than {TIE}): {got} vs {expected}"
            )
            return 1
    assert len(got) == len(expected), (got, expected)
    return 0


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# The tiny model.


@pytest.fixture(scope="module")
def shared_tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TransformersEngine]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    directory = tmp_path_factory.mktemp("tiny-llama-batch")
    _make_tiny_model(directory)
    engine = TransformersEngine(directory, device="cpu", dtype="float32", max_batch_size=3)
    yield engine
    engine.close()
    torch.set_num_threads(before)


@pytest.fixture
def tiny(shared_tiny: TransformersEngine) -> TransformersEngine:
    shared_tiny.configure_cache(PrefixHasher(shared_tiny.fingerprint, block_size=BS))
    return shared_tiny


def test_max_batch_size_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_batch_size"):
        TransformersEngine(tmp_path, max_batch_size=0)


def test_batched_greedy_is_exact_with_joins_leaves_hits_and_cancellation(tiny):
    """Requests of different lengths and prefix hits join every few steps and leave at
    different lengths; one is cancelled mid-batch; more run at once than max_batch_size."""
    base_a, base_b = _prompt(10, 37), _prompt(11, 22)
    warm = _Driver(tiny)
    warm.submit(0, base_a + [1, 2, 3], SamplingParams(max_tokens=2))
    warm.submit(1, base_b, SamplingParams(max_tokens=2))
    warm.run()
    prompts = [
        base_a + _prompt(20, 5),  # hits 36 tokens of base_a
        _prompt(21, 9),  # miss
        base_b[:13] + _prompt(22, 30),  # hits 12
        base_a[:17] + _prompt(23, 2),  # hits 16
        _prompt(24, 51),  # miss, long
        base_b + _prompt(25, 1),  # hits 20
        _prompt(26, 3),  # miss, short
    ]
    lengths = [9, 14, 5, 12, 7, 11, 10]
    driver = _Driver(tiny, chunk=8)
    cancelled = 4
    for step in range(200):
        if step % 2 == 0 and step // 2 < len(prompts):
            k = step // 2
            driver.submit(k, prompts[k], SamplingParams(max_tokens=lengths[k]))
        job = driver.jobs.get(cancelled)
        if job is not None and len(job.tokens) == 3:  # mid-batch
            job.cancel.set()
        if not driver.jobs and step // 2 >= len(prompts):
            break
        driver.step()
    assert not driver.jobs
    assert max(driver.batch_sizes) > tiny.max_batch_size  # grew past its default capacity
    hits = [driver.finished[k].prefix.tokens for k in range(len(prompts))]
    assert hits == [36, 0, 12, 16, 0, 20, 0]
    for k, prompt in enumerate(prompts):
        job = driver.finished[k]
        if k == cancelled:
            assert job.cancelled and 0 < len(job.tokens) < lengths[k]
        else:
            assert len(job.tokens) == lengths[k] or job.tokens[-1] in tiny.eos_token_ids
        _assert_exact(tiny, prompt, job.tokens)
    assert tiny._batch is None or not tiny._batch.rows


def test_rows_sharing_a_cached_prefix_read_it_once_and_stay_exact(tiny, monkeypatch):
    """Rows that reused the same cached blocks form groups whose step attends over the shared
    prefix once (``_shared_prefix_attention``); a row sharing less, or nothing, attends over
    its own KV. Rows join and leave at different lengths; every request stays exact."""
    from peerinfer.engine import hf_decoder

    monkeypatch.setattr(hf_decoder, "_MIN_SHARED_TOKENS", 8)  # the tiny prompts are short
    plans: list[list[tuple[int, int]]] = []
    plan_of = hf_decoder._BatchKV._shared_plan

    def spy(self: Any) -> Any:
        plan = plan_of(self)
        plans.append([] if plan is None else sorted((len(g[0]), g[3]) for g in plan.groups))
        return plan

    monkeypatch.setattr(hf_decoder._BatchKV, "_shared_plan", spy)
    assert tiny._shared_prefix_attention
    base_a, base_b = _prompt(50, 40), _prompt(51, 24)
    warm = _Driver(tiny)
    warm.submit(0, base_a + [1, 2, 3], SamplingParams(max_tokens=2))
    warm.submit(1, base_b + [4, 5], SamplingParams(max_tokens=2))
    warm.run()
    prompts = [
        base_a + _prompt(60, 5),  # hits 40
        base_b + _prompt(61, 11),  # hits 24
        base_a + _prompt(62, 17),  # hits 40
        base_a[:20] + _prompt(63, 6),  # hits 20: shares less than the rows of base_a
        base_b + _prompt(64, 3),  # hits 24
        _prompt(65, 13),  # miss
        base_a + _prompt(66, 2),  # hits 40
    ]
    lengths = [12, 9, 14, 10, 6, 11, 8]
    driver = _Driver(tiny, chunk=64)
    for k, p in enumerate(prompts):
        driver.submit(k, p, SamplingParams(max_tokens=lengths[k]))
    driver.run()
    assert [driver.finished[k].prefix.tokens for k in range(len(prompts))] == [40, 24, 40, 20, 24, 0, 40]
    assert [(2, 24), (3, 40)] in plans  # both groups in one step; rows 3 and 5 in none
    for k, prompt in enumerate(prompts):
        job = driver.finished[k]
        assert len(job.tokens) == lengths[k] or job.tokens[-1] in tiny.eos_token_ids
        _assert_exact(tiny, prompt, job.tokens)


def test_blocks_exported_from_a_batch_are_a_lone_runs_and_feed_exact_hits(tiny):
    """The KV a batched request leaves in the cache equals what a lone run stores, and the
    next turn hitting it is exact."""
    prompts = [_prompt(30, 14), _prompt(31, 27), _prompt(32, 6)]
    driver = _Driver(tiny)
    for k, p in enumerate(prompts):
        driver.submit(k, p, SamplingParams(max_tokens=10))
    driver.run()
    assert max(driver.batch_sizes) == 3
    cache = tiny.radix_cache
    for k, p in enumerate(prompts):
        seq = tuple(p) + tuple(driver.finished[k].tokens)
        match = cache.match(seq, touch=False)
        assert match.tokens == (len(seq) - 1) // BS * BS  # the last token has no KV yet
        own = tiny.kv_cache_from_segments(())
        tiny.forward(seq[: match.tokens], own)
        expected = tiny.export_blocks(own, 0, match.tokens // BS, BS)
        for stored, lone_seg in zip(match.payloads, expected, strict=True):
            assert stored.shape == lone_seg.payload.shape
            # Equal up to float32 rounding (a lone run that decoded token by token rounds
            # differently from this one-pass prefill, too).
            torch.testing.assert_close(stored, lone_seg.payload, rtol=1e-4, atol=1e-5)
    follow = [tuple(p) + tuple(driver.finished[k].tokens) + (7, 8, 9) for k, p in enumerate(prompts)]
    again = _Driver(tiny)
    for k, p in enumerate(follow):
        again.submit(k, p, SamplingParams(max_tokens=8))
    again.run()
    for k, p in enumerate(follow):
        assert again.finished[k].prefix.tokens >= len(prompts[k]) // BS * BS
        _assert_exact(tiny, p, again.finished[k].tokens)


def test_batch_state_is_edited_in_place_not_rebuilt(tiny):
    """Steady steps write into the same buffers; a leave keeps them; a lone step parks."""
    driver = _Driver(tiny)
    for k in range(3):
        driver.submit(k, _prompt(40 + k, 10 + 7 * k), SamplingParams(max_tokens=30 if k else 10))
    for _ in range(10):  # prefill chunks and first tokens, until all three decode together
        driver.step()
        batch = tiny._batch
        if batch is not None and len(batch.rows) == 3:
            break
    assert batch is not None and len(batch.rows) == 3
    pointers = [t.data_ptr() for t in batch._keys]
    for _ in range(3):
        driver.step()
    assert [t.data_ptr() for t in batch._keys] == pointers  # no per-step copies
    for _ in range(10):  # until request 0 finishes and leaves
        if 0 in driver.finished:
            break
        driver.step()
    assert 0 in driver.finished and len(batch.rows) == 2
    assert [t.data_ptr() for t in batch._keys] == pointers
    # One decoder stepped alone leaves the batch with its KV, then rejoins: still exact.
    job = driver.jobs[1]
    job.tokens.append(job.decoder.step())
    assert job.decoder._row is None and len(batch.rows) == 1
    driver.run()
    for k in range(3):
        _assert_exact(tiny, driver.finished[k].prompt, driver.finished[k].tokens)


def test_a_failed_batch_step_leaves_every_decoder_intact(tiny, monkeypatch):
    driver = _Driver(tiny)
    for k in range(3):
        driver.submit(k, _prompt(50 + k, 9 + k), SamplingParams(max_tokens=8))
    for _ in range(5):
        driver.step()
    model = tiny.model
    real = type(model).forward
    calls = {"n": 0}

    def broken(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", broken)
    decoders = [j.decoder for j in driver.jobs.values()]
    with pytest.raises(RuntimeError, match="injected"):
        tiny.decode_batch(decoders)
    # The scheduler's isolation retry: each alone, then together again.
    for job in list(driver.jobs.values()):
        (token,) = tiny.decode_batch([job.decoder])
        job.tokens.append(token)
    monkeypatch.undo()
    driver.run()
    for k in range(3):
        _assert_exact(tiny, driver.finished[k].prompt, driver.finished[k].tokens)


def test_seeded_sampling_does_not_depend_on_batch_neighbours(tiny):
    params = SamplingParams(max_tokens=12, temperature=1.3, top_p=0.9, seed=1234)
    prompt = _prompt(60, 15)
    alone = [t for ev in tiny.generate(prompt, params) if isinstance(ev, Tokens) for t in ev.token_ids]
    for neighbours in ([_prompt(61, 5)], [_prompt(62, 30), _prompt(63, 8), _prompt(64, 19)]):
        driver = _Driver(tiny)
        for k, p in enumerate(neighbours, start=1):
            driver.submit(k, p, SamplingParams(max_tokens=6, temperature=0.8, seed=k))
        driver.step()
        driver.submit(0, prompt, params)
        driver.run()
        assert driver.finished[0].tokens == alone


# --------------------------------------------------------------------------------------------
# The default model.


@pytest.fixture(scope="module")
def smol() -> Iterator[TransformersEngine]:
    pytest.importorskip("gguf")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = TransformersEngine(device="cpu", dtype="float32", max_batch_size=8)
    yield engine
    engine.close()
    torch.set_num_threads(before)


@pytest.mark.slow
def test_default_model_batched_greedy_is_exact(smol):
    """SmolLM2-135M-Instruct: two cached few-shot prefixes, misses, joins and leaves while
    others decode, a cancellation: every request equals model.generate alone."""
    from peerinfer.workload import MMLU, five_shot_prefix, question_suffix

    smol.configure_cache(PrefixHasher(smol.fingerprint))
    mmlu = MMLU.load(None)  # the packaged excerpt: quick and always there
    subjects = mmlu.subjects[:2]
    prompts: list[list[int]] = []
    warm = _Driver(smol, chunk=512)
    for k, subject in enumerate(subjects):
        prefix = smol.tokenize(five_shot_prefix(subject, mmlu.dev(subject)[:2]))
        questions = mmlu.test(subject)
        # An earlier request with another question caches the prefix.
        warm.submit(k, prefix + smol.tokenize(question_suffix(questions[3])), SamplingParams(max_tokens=1))
        prompts += [prefix + smol.tokenize(question_suffix(q)) for q in questions[:3]]
    warm.run()
    prompts.insert(2, smol.chat_tokens([ChatMessage("user", "Name three rivers in Europe.")]))
    lengths = [16, 9, 14, 16, 6, 12, 10]
    driver = _Driver(smol, chunk=64)
    flips = 0
    for step in range(400):
        k = step // 3
        if step % 3 == 0 and k < len(prompts):
            driver.submit(k, prompts[k], SamplingParams(max_tokens=lengths[k]))
        if step == 14 and 3 in driver.jobs:
            driver.jobs[3].cancel.set()
        if not driver.jobs and k >= len(prompts):
            break
        driver.step()
    assert not driver.jobs and max(driver.batch_sizes) >= 4
    assert sum(1 for j in driver.finished.values() if j.prefix.tokens) >= 4
    assert driver.finished[3].cancelled
    for k, prompt in enumerate(prompts):
        flips += _assert_exact(smol, prompt, driver.finished[k].tokens)


def test_through_the_batch_scheduler_is_exact(tiny):
    """The engine under the real BatchScheduler: staggered submits, a cancellation, requests
    ending at different lengths, hits and misses; every finished request is exact."""
    from peerinfer.engine import Finished
    from peerinfer.engine.batch import BatchScheduler
    from peerinfer.errors import PeerInferError

    shared = _prompt(70, 21)
    sched = BatchScheduler(tiny, max_running=3, prefill_chunk_tokens=8)
    prompts = {k: (shared if k % 2 else []) + _prompt(71 + k, 5 + 4 * k) for k in range(6)}
    lengths = {k: 6 + (k * 5) % 9 for k in prompts}
    got: dict[int, list[int]] = {k: [] for k in prompts}
    done: dict[int, Finished] = {}
    for step in range(300):
        if step < len(prompts):
            sched.submit(step, prompts[step], SamplingParams(max_tokens=lengths[step]))
        if len(got[2]) == 2 and 2 not in done:
            sched.cancel(2)
        for key, ev in sched.step():
            assert not isinstance(ev, PeerInferError), ev
            if isinstance(ev, Tokens):
                got[key].extend(ev.token_ids)
            elif isinstance(ev, Finished):
                done[key] = ev
        if sched.idle and step >= len(prompts):
            break
    assert sched.idle and set(done) == set(prompts)
    assert done[2].finish_reason == "cancelled"
    assert any(done[k].cached_tokens for k in (3, 5))
    assert max(n for n, _ in sched.statistics().batch_sizes) == 3
    for k, prompt in prompts.items():
        _assert_exact(tiny, prompt, got[k])


# --------------------------------------------------------------------------------------------
# Batched prefill: several newcomers' prompts in one forward pass.


def _open(engine: TransformersEngine, prompt: Sequence[int], max_tokens: int = 8) -> Any:
    """A RequestJob started on ``engine`` (its cached prefix matched and locked)."""
    from peerinfer.engine.base import NEVER_CANCELLED, RequestJob

    job = RequestJob(engine, tuple(prompt), SamplingParams(max_tokens=max_tokens), NEVER_CANCELLED)
    job.start()
    return job


@pytest.fixture(params=["packed", "padded"])
def prefill_layout(request: pytest.FixtureRequest, tiny: TransformersEngine) -> Iterator[str]:
    """Both batched prefill layouts: packed (Llama, the tiny model) and padded (the others)."""
    before = tiny._packed_prefill
    assert before, "the tiny Llama model packs its batched prefill"
    tiny._packed_prefill = request.param == "packed"
    yield request.param
    tiny._packed_prefill = before


def test_prefill_batch_runs_several_prompts_in_one_pass_exactly(tiny, prefill_layout, monkeypatch):
    """Different cached prefixes (a hit, a miss, a part-prefilled prompt), different suffix
    lengths: one forward pass, and each request's logits and greedy tokens are a lone run's."""
    shared = _prompt(90, 17)
    for _ in tiny.generate(shared + [5, 6, 7], SamplingParams(max_tokens=1)):
        pass  # caches 16 tokens of ``shared`` (4 blocks)
    prompts = [shared + _prompt(91, 9), _prompt(92, 13), shared + _prompt(93, 3), _prompt(94, 30)]
    jobs = [_open(tiny, p) for p in prompts]
    try:
        assert jobs[0].cached_tokens == 16 and jobs[1].cached_tokens == 0
        jobs[3].decoder.prefill(7)  # part-way: 7 of its 30 already run alone
        calls = []
        forward = tiny.model.forward

        def counting(*args: Any, **kwargs: Any) -> Any:
            calls.append(kwargs["input_ids"].shape)
            return forward(*args, **kwargs)

        monkeypatch.setattr(tiny.model, "forward", counting)
        done = tiny.prefill_batch([j.decoder for j in jobs], [64, 64, 64, 10])
        monkeypatch.undo()
        assert done == [True, True, True, False]
        # One pass: 4 rows padded to the longest share (13), or the 10 + 13 + 4 + 10 packed.
        expected_shape = (1, 37) if prefill_layout == "packed" else (4, 13)
        assert len(calls) == 1 and tuple(calls[0]) == expected_shape
        assert [j.decoder.prefill_remaining for j in jobs] == [0, 0, 0, 13]
        assert tiny.prefill_batch([jobs[3].decoder], [64]) == [True]
        for job, prompt in zip(jobs, prompts, strict=True):
            # The first token's logits equal a lone run's (within rounding).
            _, logits = _reference(tiny, prompt, 1)
            kept = job.decoder._logits
            assert kept is not None and torch.allclose(kept, logits[0], atol=1e-4), prompt
        tokens = [[] for _ in jobs]
        decoders = [j.decoder for j in jobs]
        for _ in range(8):
            for out, token in zip(tokens, tiny.decode_batch(decoders), strict=True):
                out.append(token)
        for prompt, got in zip(prompts, tokens, strict=True):
            _assert_exact(tiny, prompt, got)
    finally:
        for job in jobs:
            job.close()


def test_prefill_batch_raises_before_changing_any_decoder(tiny, prefill_layout, monkeypatch):
    jobs = [_open(tiny, _prompt(95 + k, 6 + k)) for k in range(3)]
    try:
        before = [(j.decoder.prefill_remaining, j.decoder.kv_tokens) for j in jobs]

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("out of memory, say")

        # It fails in the last layer: the earlier layers have already appended the new
        # tokens' states, which must not reach the decoders.
        monkeypatch.setattr(tiny.model.model.layers[-1].mlp, "forward", broken)
        with pytest.raises(RuntimeError, match="out of memory"):
            tiny.prefill_batch([j.decoder for j in jobs], [64] * 3)
        monkeypatch.undo()
        assert [(j.decoder.prefill_remaining, j.decoder.kv_tokens) for j in jobs] == before
        assert tiny.prefill_batch([j.decoder for j in jobs], [64] * 3) == [True] * 3
        for job in jobs:
            got = [job.decoder.step() for _ in range(5)]
            _assert_exact(tiny, job.prompt, got)
    finally:
        for job in jobs:
            job.close()


def test_the_scheduler_prefills_newcomers_together_on_the_engine_exactly(tiny, prefill_layout):
    """Under the BatchScheduler: newcomers arriving together are prefilled in one call (the
    statistics count fewer prefill batches than chunks), one is cancelled mid-prefill, and
    every other request is exact."""
    from peerinfer.engine import Finished
    from peerinfer.engine.batch import BatchScheduler
    from peerinfer.errors import PeerInferError

    shared = _prompt(80, 13)
    sched = BatchScheduler(tiny, max_running=3, prefill_chunk_tokens=24)
    prompts: dict[object, list[int]] = {"long": _prompt(88, 90)}  # admitted first
    prompts.update({k: (shared if k % 2 else []) + _prompt(81 + k, 4 + 3 * k) for k in range(5)})
    got: dict[object, list[int]] = {k: [] for k in prompts}
    done: dict[object, Finished] = {}
    for key, prompt in prompts.items():
        sched.submit(key, prompt, SamplingParams(max_tokens=6))
    cancelled_while_prefilling = False
    for _ in range(300):
        long = sched._running.get("long")  # noqa: SLF001 - is it running, mid-prefill?
        if long is not None and not long.ready and sched.statistics().prefill_batches >= 3:
            assert 0 < long.job.prefill_remaining < 90
            sched.cancel("long")
            cancelled_while_prefilling = True
        for key, ev in sched.step():
            assert not isinstance(ev, PeerInferError), ev
            if isinstance(ev, Tokens):
                got[key].extend(ev.token_ids)
            elif isinstance(ev, Finished):
                done[key] = ev
        if sched.idle:
            break
    assert cancelled_while_prefilling
    assert sched.idle and set(done) == set(prompts)
    stats = sched.statistics()
    assert stats.prefill_batches < stats.prefill_chunks  # several chunks per call
    assert done["long"].finish_reason == "cancelled" and got["long"] == []
    for k, prompt in prompts.items():
        if k != "long":
            assert done[k].finish_reason == "length"
            _assert_exact(tiny, prompt, got[k])
