"""The batch scheduler on the recording test engine: what it batched, chunked and isolated.

The conformance suite (tests/test_engine_conformance.py) checks results on every engine; here
the recording engine shows *how* they were produced: which requests decoded together, how the
prefill was cut, what happened to a batch with a failing request in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from peerinfer.core.messages import SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.engine import Finished, Started, Tokens
from peerinfer.engine.base import Decoder, DecodeRequest, Engine
from peerinfer.engine.batch import BatchScheduler
from peerinfer.errors import ConfigError, EngineError, InvalidRequestError, PeerInferError
from peerinfer.testing.engines import BatchRecordingEngine

POISON = 3  # a reserved id: never generated, so only a prompt can carry it
PREFILL_POISON = 2  # another: its request's prefill fails


def _engine(**kwargs: object) -> BatchRecordingEngine:
    engine = BatchRecordingEngine(**kwargs)  # type: ignore[arg-type]
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4))
    return engine


def _alone(engine: BatchRecordingEngine, prompt: list[int], max_tokens: int) -> list[int]:
    return [
        t
        for ev in engine.generate(prompt, SamplingParams(max_tokens=max_tokens))
        if isinstance(ev, Tokens)
        for t in ev.token_ids
    ]


def _drive(scheduler: BatchScheduler, max_steps: int = 500) -> dict[object, list[object]]:
    events: dict[object, list[object]] = {}
    for _ in range(max_steps):
        if scheduler.idle:
            return events
        for key, item in scheduler.step():
            events.setdefault(key, []).append(item)
    raise AssertionError("the scheduler did not become idle")


def _ids(items: list[object]) -> list[int]:
    return [t for ev in items if isinstance(ev, Tokens) for t in ev.token_ids]


def _prompt(i: int, n: int = 12) -> list[int]:
    return [10 + (i * 7 + j) % 200 for j in range(n)]


def test_requests_submitted_together_decode_in_one_batch() -> None:
    engine = _engine(max_batch_size=4, prefill_chunk_tokens=64)
    prompts = [_prompt(i) for i in range(4)]
    expected = [_alone(engine, p, 5) for p in prompts]
    engine.batch_sizes.clear()
    scheduler = BatchScheduler(engine)
    assert scheduler.max_running == 4
    for i, p in enumerate(prompts):
        scheduler.submit(i, p, SamplingParams(max_tokens=5))
    events = _drive(scheduler)
    assert [_ids(events[i]) for i in range(4)] == expected
    # Their 48 prompt tokens fit one step's budget of 64: step 1 prefills all four in one
    # prefill_batch call and hands back their four first tokens in one decode_batch (4); then
    # all four decode together (4 more tokens each).
    assert engine.prefill_batches == [4]
    assert engine.batch_sizes == [4, 4, 4, 4, 4]
    stats = scheduler.statistics()
    assert stats.prefill_batches == 1 and stats.prefill_chunks == 4
    assert stats.batch_sizes == ((4, 4),)
    assert stats.mean_batch == 4.0 and stats.decode_steps == 4
    assert engine.open_decoders == 0


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps() -> None:
    engine = _engine(max_batch_size=4, prefill_chunk_tokens=8)
    short = _prompt(0, 5)
    long = _prompt(1, 60)
    expected = [_alone(engine, short, 20), _alone(engine, long, 3)]
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4))  # no hits
    engine.batch_sizes.clear()
    engine.prefill_chunks.clear()
    scheduler = BatchScheduler(engine)
    scheduler.submit("short", short, SamplingParams(max_tokens=20))
    events: dict[object, list[object]] = {}
    for _ in range(2):
        for key, item in scheduler.step():
            events.setdefault(key, []).append(item)
    scheduler.submit("long", long, SamplingParams(max_tokens=3))
    decoded_while_prefilling = 0
    for _ in range(100):
        if scheduler.idle:
            break
        prefilling = scheduler.statistics().prefilling
        before = len(engine.batch_sizes)
        for key, item in scheduler.step():
            events.setdefault(key, []).append(item)
        if prefilling:
            decoded_while_prefilling += len(engine.batch_sizes) - before
    assert _ids(events["short"]) == expected[0]
    assert _ids(events["long"]) == expected[1]
    # 60 prompt tokens in chunks of at most 8; the short request kept decoding meanwhile.
    long_chunks = engine.prefill_chunks[1:]
    assert sum(long_chunks) == 60 and max(long_chunks) == 8 and len(long_chunks) == 8
    assert decoded_while_prefilling >= 7
    assert scheduler.statistics().prefill_chunks == len(engine.prefill_chunks)


def test_a_short_prompt_joining_behind_long_ones_is_prefilled_first() -> None:
    # A flooder's maximal prompts must not hold back another requester's first token: the
    # prefill chunk goes to the request with the fewest prompt tokens left.
    engine = _engine(max_batch_size=4, prefill_chunk_tokens=8)
    longs = [_prompt(i, 80) for i in range(3)]
    short = _prompt(9, 6)
    expected_short = _alone(engine, short, 2)
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4))  # no hits
    engine.prefill_chunks.clear()
    scheduler = BatchScheduler(engine)
    for i, p in enumerate(longs):
        scheduler.submit(("long", i), p, SamplingParams(max_tokens=2))
    events: dict[object, list[object]] = {}
    for key, item in scheduler.step():  # all three admitted, the first long chunk runs
        events.setdefault(key, []).append(item)
    scheduler.submit("short", short, SamplingParams(max_tokens=2))
    steps_to_first_token = None
    for n in range(1, 200):
        for key, item in scheduler.step():
            events.setdefault(key, []).append(item)
        if steps_to_first_token is None and _ids(events.get("short", [])):
            steps_to_first_token = n
        if scheduler.idle:
            break
    # Its 6 tokens fit one chunk: prefilled at the next step, first token at the one after
    # (the longs still have ~230 tokens, 29 chunks, left).
    assert steps_to_first_token is not None and steps_to_first_token <= 2
    assert _ids(events["short"]) == expected_short
    assert all(len(_ids(events[("long", i)])) == 2 for i in range(3))


def test_newcomers_are_prefilled_together_shortest_first_within_the_budget() -> None:
    engine = _engine(max_batch_size=4, prefill_chunk_tokens=16)
    prompts = {"a": _prompt(0, 30), "b": _prompt(1, 12), "c": _prompt(2, 5), "d": _prompt(3, 7)}
    expected = {k: _alone(engine, p, 3) for k, p in prompts.items()}
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4))  # no hits
    engine.prefill_chunks.clear()
    scheduler = BatchScheduler(engine)
    for key, p in prompts.items():
        scheduler.submit(key, p, SamplingParams(max_tokens=3))
    first = scheduler.step()
    # Fewest tokens left first: c (5) and d (7) whole, in one call, and their first tokens at
    # once. b would only get the 4 tokens left of the step's 16: it waits, so that c's and d's
    # first tokens do not wait for a chunk that completes nothing.
    assert engine.prefill_batches == [2] and engine.prefill_chunks == [5, 7]
    assert {key for key, ev in first if isinstance(ev, Tokens)} == {"c", "d"}
    # Next step: b's 12 whole, topped up with 4 of a's 30 (a chunk left out at one step is
    # never left out at the next), and the decode of c and d.
    second = scheduler.step()
    assert engine.prefill_batches == [2, 2] and engine.prefill_chunks[2:] == [12, 4]
    events: dict[object, list[object]] = {}
    for key, item in [*first, *second]:
        events.setdefault(key, []).append(item)
    for key, items in _drive(scheduler).items():
        events.setdefault(key, []).extend(items)
    assert {key: _ids(events[key]) for key in prompts} == expected
    stats = scheduler.statistics()
    assert stats.prefill_chunks == len(engine.prefill_chunks)
    assert stats.prefill_batches == len(engine.prefill_batches) < stats.prefill_chunks
    assert sum(engine.prefill_chunks) == 30 + 12 + 5 + 7
    assert max(sum(engine.prefill_chunks[i : i + n]) for i, n in _batch_starts(engine)) <= 16


def test_a_completing_prompt_does_not_wait_for_a_longer_prompts_chunk() -> None:
    # A short prompt joining while a long one prefills gets a step of its own (its first
    # token waits for its own tokens only), and a stream of them delays the long prompt's
    # chunks every other step at most: it is never starved.
    engine = _engine(max_batch_size=8, prefill_chunk_tokens=16)
    long = _prompt(0, 160)
    shorts = [_prompt(i, 4) for i in range(1, 7)]
    expected = {"long": _alone(engine, long, 2)} | {i: _alone(engine, p, 2) for i, p in enumerate(shorts)}
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4))  # no hits
    engine.prefill_chunks.clear()
    scheduler = BatchScheduler(engine)
    scheduler.submit("long", long, SamplingParams(max_tokens=2))
    events: dict[object, list[object]] = {}
    batches: list[list[int]] = []

    def step() -> None:
        before = len(engine.prefill_chunks)
        for key, item in scheduler.step():
            events.setdefault(key, []).append(item)
        batches.append(engine.prefill_chunks[before:])

    step()  # the long prompt's first chunk
    for i, p in enumerate(shorts):  # one short newcomer at every step
        scheduler.submit(i, p, SamplingParams(max_tokens=2))
        step()
    # Every other step the newcomer's 4 tokens run alone; at the others the long prompt's
    # chunk tops them up to the step's 16.
    assert batches == [[16], [4], [4, 12], [4], [4, 12], [4], [4, 12]]
    for key, items in _drive(scheduler).items():
        events.setdefault(key, []).extend(items)
    assert {key: _ids(events[key]) for key in expected} == expected


def test_a_request_sharing_a_prefix_in_prefill_waits_for_it_and_hits() -> None:
    """A request whose prompt shares blocks with one being prefilled is admitted once that
    prefill has stored them, and finds them cached, instead of computing them beside it (the
    node's core counts them as cached: ``Requests.local_match_blocks``). One that shares
    nothing is admitted at once; the same tokens either way."""
    engine = _engine(max_batch_size=4, prefill_chunk_tokens=8)
    shared = _prompt(1, 40)
    leader, follower, stranger = shared + [7, 8, 9, 11], shared + [12, 13], _prompt(2, 20)
    expected = {name: _alone(engine, p, 3) for name, p in
                (("leader", leader), ("follower", follower), ("stranger", stranger))}
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4))  # no hits
    scheduler = BatchScheduler(engine)
    scheduler.submit("leader", leader, SamplingParams(max_tokens=3))
    events: dict[object, list[object]] = {}
    for _ in range(2):  # the leader is in its prefill (44 tokens in chunks of 8)
        for key, item in scheduler.step():
            events.setdefault(key, []).append(item)
    assert scheduler.statistics().prefilling == 1
    scheduler.submit("follower", follower, SamplingParams(max_tokens=3))
    for key, item in scheduler.step():
        events.setdefault(key, []).append(item)
    assert "follower" not in events  # held: not started
    assert scheduler.statistics().waiting == 1
    for key, item in _drive(scheduler).items():
        events.setdefault(key, []).extend(item)
    started = {k: next(e for e in v if isinstance(e, Started)) for k, v in events.items()}
    assert started["follower"].cached_tokens == 40  # the shared 10 blocks, from the leader
    assert _ids(events["leader"]) == expected["leader"]
    assert _ids(events["follower"]) == expected["follower"]
    # A prompt that shares nothing is not held.
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4))
    scheduler = BatchScheduler(engine)
    scheduler.submit("leader", leader, SamplingParams(max_tokens=3))
    scheduler.step()
    scheduler.submit("stranger", stranger, SamplingParams(max_tokens=3))
    assert any(key == "stranger" for key, _ in scheduler.step())
    events = _drive(scheduler)
    assert _ids(events["stranger"]) == expected["stranger"]


def _batch_starts(engine: BatchRecordingEngine) -> list[tuple[int, int]]:
    """(first chunk index, chunk count) of every prefill batch the engine ran."""
    starts, i = [], 0
    for n in engine.prefill_batches:
        starts.append((i, n))
        i += n
    return starts


class _OneByOnePrefillEngine(BatchRecordingEngine):
    """Keeps the base class's prefill_batch (a loop over Decoder.prefill)."""

    prefill_batch = Engine.prefill_batch


@pytest.mark.parametrize("engine_class", [BatchRecordingEngine, _OneByOnePrefillEngine])
def test_a_failing_prefill_fails_only_its_request(engine_class: type[BatchRecordingEngine]) -> None:
    engine = engine_class(max_batch_size=4, prefill_chunk_tokens=64,
                          fail_prefill_tokens=frozenset({POISON}))
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4))
    prompts = [_prompt(i) for i in range(3)]
    prompts[1] = prompts[1][:-1] + [POISON]
    expected = [_alone(BatchRecordingEngine(), prompts[i], 4) for i in (0, 2)]
    scheduler = BatchScheduler(engine)
    for i, p in enumerate(prompts):
        scheduler.submit(i, p, SamplingParams(max_tokens=4))
    events = _drive(scheduler)
    (error,) = [ev for ev in events[1] if isinstance(ev, PeerInferError)]
    assert isinstance(error, EngineError) and "prefill fails" in str(error)
    assert [_ids(events[0]), _ids(events[2])] == expected
    stats = scheduler.statistics()
    assert stats.failed == 1 and stats.finished == 2
    if engine_class is BatchRecordingEngine:
        # The batch raised before advancing anyone; each was then prefilled alone, once.
        assert stats.prefill_batch_retries == 1 and engine.prefill_batches == []
    else:
        assert stats.prefill_batch_retries == 0
    assert sorted(engine.prefill_chunks) == [12, 12]  # nobody's prompt ran twice
    assert engine.open_decoders == 0
    assert engine.radix_cache is not None and engine.radix_cache.stats().locked_blocks == 0


def test_a_request_cancelled_mid_prefill_leaves_alone() -> None:
    engine = _engine(max_batch_size=4, prefill_chunk_tokens=8)
    long, short = _prompt(1, 60), _prompt(2, 6)
    expected_short = _alone(engine, short, 6)
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4))  # no hits
    engine.prefill_chunks.clear()
    scheduler = BatchScheduler(engine)
    scheduler.submit("long", long, SamplingParams(max_tokens=3))
    scheduler.submit("short", short, SamplingParams(max_tokens=6))
    events: dict[object, list[object]] = {}
    for _ in range(3):
        for key, item in scheduler.step():
            events.setdefault(key, []).append(item)
    assert scheduler.statistics().prefilling == 1  # the long one, part-way
    scheduler.cancel("long")
    for key, item in _drive(scheduler).items():
        events.setdefault(key, []).extend(item)
    assert isinstance(events["long"][-1], Finished)
    assert events["long"][-1].finish_reason == "cancelled"
    assert _ids(events["long"]) == []
    assert 0 < sum(engine.prefill_chunks) - 6 < 60  # it stopped part-way through its prompt
    assert _ids(events["short"]) == expected_short
    assert engine.open_decoders == 0


class _LatePoisonEngine(BatchRecordingEngine):
    """A poisoned request gets its first token (taken alone, right after its prefill), then
    makes every batch it is in fail: the failure happens mid-batch."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._first_taken: set[int] = set()

    def decode_batch(self, decoders: Sequence[Decoder]) -> list[int | None]:
        for d in decoders:
            if getattr(d, "poisoned", False) and id(d) not in self._first_taken:
                self._first_taken.add(id(d))
                d.poisoned = False  # type: ignore[attr-defined]
                try:
                    return super().decode_batch(decoders)
                finally:
                    d.poisoned = True  # type: ignore[attr-defined]
        return super().decode_batch(decoders)


def test_a_failing_batch_is_retried_one_by_one_and_only_the_culprit_fails() -> None:
    engine = _LatePoisonEngine(max_batch_size=4, fail_tokens=frozenset({POISON}))
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4))
    prompts = [_prompt(i) for i in range(3)]
    prompts[1] = prompts[1][:-1] + [POISON]
    expected = [_alone(engine, prompts[i], 4) for i in (0, 2)]
    scheduler = BatchScheduler(engine)
    for i, p in enumerate(prompts):
        scheduler.submit(i, p, SamplingParams(max_tokens=4))
    events = _drive(scheduler)
    (error,) = [ev for ev in events[1] if isinstance(ev, PeerInferError)]
    assert isinstance(error, EngineError) and "poisoned" in str(error)
    assert isinstance(error.__cause__, RuntimeError)
    assert not any(isinstance(ev, Finished) for ev in events[1])
    assert [_ids(events[0]), _ids(events[2])] == expected
    stats = scheduler.statistics()
    assert stats.failed == 1 and stats.finished == 2 and stats.batch_retries >= 1
    assert engine.open_decoders == 0
    assert engine.radix_cache is not None and engine.radix_cache.stats().locked_blocks == 0


class _BrokenOpenEngine(BatchRecordingEngine):
    def open_decoder(self, request: DecodeRequest) -> Decoder:
        if POISON in request.tokens:
            raise MemoryError("no room for this one")
        return super().open_decoder(request)


def test_a_request_that_cannot_start_fails_alone() -> None:
    engine = _BrokenOpenEngine(max_batch_size=4)
    scheduler = BatchScheduler(engine)
    scheduler.submit("ok", _prompt(0), SamplingParams(max_tokens=3))
    scheduler.submit("bad", [POISON, *_prompt(1)], SamplingParams(max_tokens=3))
    events = _drive(scheduler)
    assert isinstance(events["bad"][-1], EngineError) and "MemoryError" in str(events["bad"][-1])
    assert isinstance(events["ok"][0], Started) and isinstance(events["ok"][-1], Finished)
    assert len(_ids(events["ok"])) == 3


def test_submit_validates_at_once() -> None:
    engine = _engine(kv_bytes_per_token=10)
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4), capacity_bytes=1000)
    scheduler = BatchScheduler(engine)
    with pytest.raises(InvalidRequestError):
        scheduler.submit("empty", [], SamplingParams())
    with pytest.raises(InvalidRequestError):
        scheduler.submit("bad-params", [5, 6], SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequestError, match="more than the cache's whole budget"):
        scheduler.submit("huge", _prompt(0), SamplingParams(max_tokens=100))  # (12+100)*10
    scheduler.submit("fits", _prompt(0), SamplingParams(max_tokens=80))  # (12+80)*10 = 920
    with pytest.raises(InvalidRequestError, match="already submitted"):
        scheduler.submit("fits", _prompt(1), SamplingParams())
    assert scheduler.waiting == 1 and scheduler.running == 0 and not scheduler.idle
    with pytest.raises(ConfigError):
        BatchScheduler(engine, max_running=0)
    with pytest.raises(ConfigError):
        BatchScheduler(engine, prefill_chunk_tokens=0)


def test_admission_is_fifo_and_waits_for_memory() -> None:
    engine = _engine(max_batch_size=8, kv_bytes_per_token=10)
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4), capacity_bytes=400)
    scheduler = BatchScheduler(engine)
    scheduler.submit("a", _prompt(0), SamplingParams(max_tokens=8))  # 200 bytes
    scheduler.submit("big", _prompt(1), SamplingParams(max_tokens=28))  # 400 bytes: alone
    scheduler.submit("c", _prompt(2), SamplingParams(max_tokens=8))  # would fit beside "a"
    order: list[object] = []
    for _ in range(200):
        if scheduler.idle:
            break
        for key, item in scheduler.step():
            if isinstance(item, Started):
                order.append(key)
        stats = scheduler.statistics()
        assert stats.kv_reserved_bytes <= 400 and stats.kv_budget_bytes == 400
        assert engine.radix_cache is not None
        assert engine.radix_cache.stats().bytes + stats.kv_reserved_bytes <= 400
    # "c" did not overtake "big", which waited until "a" was done and then ran alone.
    assert order == ["a", "big", "c"]


def test_close_gives_everything_back() -> None:
    engine = _engine(kv_bytes_per_token=10)
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4), capacity_bytes=10_000)
    scheduler = BatchScheduler(engine, max_running=2)
    for i in range(4):
        scheduler.submit(i, _prompt(0) + [50 + i], SamplingParams(max_tokens=20))
    _alone(engine, _prompt(0) + [99], 2)  # something to hit in the cache
    scheduler.step()
    scheduler.step()
    assert scheduler.running == 2 and engine.open_decoders == 2
    scheduler.close()
    cache = engine.radix_cache
    assert cache is not None
    assert engine.open_decoders == 0 and scheduler.idle
    assert cache.stats().locked_blocks == 0 and cache.reserved_bytes == 0
    cache.check_invariants()


# --------------------------------------------------------------------------------------------
# Random schedules against requests run alone.


class SchedulerMachine(RuleBasedStateMachine):
    """Random submits, cancellations, failing requests and steps; after every step the cache,
    the KV budget and the engine's open decoders are consistent, and at the end every request
    got exactly what it gets alone (a prefix of it if cancelled; an error if poisoned)."""

    @initialize(
        max_running=st.integers(1, 4),
        chunk=st.integers(1, 16),
        budget_requests=st.sampled_from([None, 1, 2, 3]),
    )
    def setup(self, max_running: int, chunk: int, budget_requests: int | None) -> None:
        self.engine = BatchRecordingEngine(
            max_batch_size=max_running,
            prefill_chunk_tokens=chunk,
            kv_bytes_per_token=10,
            fail_tokens=frozenset({POISON}),
            fail_prefill_tokens=frozenset({PREFILL_POISON}),
        )
        # Requests here need at most (24 + 8) * 10 bytes.
        self.budget = None if budget_requests is None else budget_requests * 320
        self.engine.configure_cache(
            PrefixHasher(self.engine.fingerprint, block_size=4), capacity_bytes=self.budget
        )
        self.reference = BatchRecordingEngine()
        self.scheduler = BatchScheduler(self.engine)
        self.requests: dict[int, tuple[list[int], int, bool | int]] = {}
        self.cancelled: set[int] = set()
        self.events: dict[object, list[object]] = {}

    @rule(
        base=st.integers(0, 3),
        length=st.integers(1, 24),
        max_tokens=st.integers(1, 8),
        poisoned=st.sampled_from([False, False, False, False, True, PREFILL_POISON]),
    )
    def submit(self, base: int, length: int, max_tokens: int, poisoned: bool | int) -> None:
        # Few distinct bases, so requests share cached prefixes.
        prompt = _prompt(base, 24)[:length]
        if poisoned:
            prompt = [*prompt[:-1], POISON if poisoned is True else PREFILL_POISON]
        key = len(self.requests)
        self.requests[key] = (prompt, max_tokens, poisoned)
        self.scheduler.submit(key, prompt, SamplingParams(max_tokens=max_tokens))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.requests)))
        self.cancelled.add(key)
        self.scheduler.cancel(key)

    @rule()
    def step(self) -> None:
        for key, item in self.scheduler.step():
            self.events.setdefault(key, []).append(item)
        self.check_step()

    def check_step(self) -> None:
        cache = self.engine.radix_cache
        assert cache is not None
        cache.check_invariants(verify_hashes=False)
        stats = self.scheduler.statistics()
        assert stats.running <= stats.max_running
        assert stats.kv_reserved_bytes == cache.reserved_bytes
        if self.budget is not None:
            assert cache.stats().bytes + cache.reserved_bytes <= self.budget
        assert self.engine.open_decoders == stats.running

    def teardown(self) -> None:
        for _ in range(5000):  # 30 requests x (24 prefill + 8 decode steps) one at a time
            if self.scheduler.idle:
                break
            self.step()
        assert self.scheduler.idle
        cache = self.engine.radix_cache
        assert cache is not None
        assert cache.stats().locked_blocks == 0 and cache.reserved_bytes == 0
        assert self.engine.open_decoders == 0
        for key, (prompt, max_tokens, poisoned) in self.requests.items():
            items = self.events[key]
            ids = _ids(items)
            last = items[-1]
            if poisoned:
                # It fails at its first decode step (or prefill), unless cancelled before that.
                assert ids == []
                assert isinstance(last, EngineError) or (
                    key in self.cancelled
                    and isinstance(last, Finished)
                    and last.finish_reason == "cancelled"
                )
                continue
            assert not any(isinstance(item, PeerInferError) for item in items)
            alone = _alone(self.reference, prompt, max_tokens)
            assert isinstance(items[0], Started) and isinstance(items[-1], Finished)
            if key in self.cancelled:
                assert ids == alone[: len(ids)]
            else:
                assert ids == alone and items[-1].finish_reason == "length"


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerMachine = SchedulerMachine.TestCase
