"""The batch scheduler's preemption: a request yields its slot, waits suspended, and resumes.

Preemption costs the preempted request time, never its answer: a greedy request that was
preempted (keeping its KV, or giving it up and recomputing it from the prefix cache) gives the
tokens it gives without the pause, on the simulated engine and on a real Transformers model
(a tiny Llama built here from a config). Nothing is lost: a suspended request that is
cancelled ends with its ``Finished``, and one preempted before it was admitted starts later.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from peerinfer.core.costmodel import CostModel
from peerinfer.core.messages import SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.engine import Finished, Tokens
from peerinfer.engine.base import Engine
from peerinfer.engine.batch import BatchScheduler, Preempted
from peerinfer.engine.simulated import SimulatedEngine

COSTS = CostModel(prefill_s_per_token=0.0, cached_s_per_token=0.0, decode_s_per_token=0.0,
                  overhead_s=0.0, slots=2)
GREEDY = SamplingParams(max_tokens=24)


def sim_engine(cache_tokens: int | None = None) -> SimulatedEngine:
    engine = SimulatedEngine(costs=COSTS, time_scale=0.0, kv_bytes_per_token=16)
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4),
                           capacity_bytes=None if cache_tokens is None else 16 * cache_tokens)
    return engine


def ids(items: list[object]) -> list[int]:
    return [t for ev in items if isinstance(ev, Tokens) for t in ev.token_ids]


def alone(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    """The tokens of ``prompt`` run alone through a scheduler, never preempted."""
    scheduler = BatchScheduler(engine, max_running=1)
    scheduler.submit("ref", prompt, params)
    events: list[object] = []
    for _ in range(500):
        if scheduler.idle:
            break
        events += [ev for _, ev in scheduler.step()]
    scheduler.close()
    return ids(events)


def preempted_run(engine: Engine, prompt: list[int], other: list[int], *, keep: bool,
                  after: int = 5) -> tuple[dict[str, list[object]], BatchScheduler]:
    """``a`` runs alone on one slot, is preempted after ``after`` tokens for ``b``, and
    resumes when ``b`` has finished: what each request's events were."""
    scheduler = BatchScheduler(engine, max_running=1, keep_preempted_kv=keep)
    scheduler.submit("a", prompt, GREEDY)
    events: dict[str, list[object]] = {"a": [(ev) for _, ev in scheduler.step()]}  # admitted
    events["b"] = []
    scheduler.preempt("a", after)
    for _ in range(500):
        if scheduler.idle:
            return events, scheduler
        for key, ev in scheduler.step():
            assert isinstance(key, str)
            events[key].append(ev)
            if key == "a" and isinstance(ev, Preempted):
                scheduler.submit("b", other, SamplingParams(max_tokens=6))
            if key == "b" and isinstance(ev, Finished):
                scheduler.resume("a")
    raise AssertionError("the scheduler did not become idle")


def check_preempted_like_alone(engine: Engine, prompt: list[int], other: list[int],
                               keep: bool, expected: list[int] | None = None) -> BatchScheduler:
    """``expected``: ``alone(engine, prompt)`` when already known."""
    expected = alone(engine, prompt) if expected is None else expected
    assert len(expected) == GREEDY.max_tokens
    events, scheduler = preempted_run(engine, prompt, other, keep=keep)
    (pause,) = [ev for ev in events["a"] if isinstance(ev, Preempted)]
    assert pause.generated == 5
    # It yielded after its 5 tokens, the other ran to its end in between, then it went on.
    order = [type(ev).__name__ for ev in events["a"]]
    assert order.index("Preempted") == 1 + 5  # Started, 5 Tokens, Preempted
    assert ids(events["a"]) == expected
    (done,) = [ev for ev in events["a"] if isinstance(ev, Finished)]
    assert done.finish_reason == "length" and done.completion_tokens == len(expected)
    assert [type(ev).__name__ for ev in events["b"]][-1] == "Finished"
    stats = scheduler.statistics()
    assert (stats.preempted, stats.resumed, stats.suspended) == (1, 1, 0)
    assert stats.spilled == (0 if keep else 1)
    assert stats.kv_reserved_bytes == 0
    return scheduler


@pytest.mark.parametrize("keep", [True, False], ids=["kv-kept", "recomputed"])
def test_a_preempted_greedy_request_gives_the_same_tokens_simulated(keep: bool) -> None:
    engine = sim_engine()
    prompt = [10 + i for i in range(18)]
    check_preempted_like_alone(engine, prompt, [200 + i for i in range(9)], keep)
    if not keep:
        # Recomputed from the prefix cache: the blocks it had made were stored when it spilled.
        assert engine.statistics().cache is not None


def test_suspended_requests_spill_when_memory_is_short() -> None:
    """A waiting request that does not fit takes a suspended request's KV: the suspended one
    spills (recomputed later), and both still give their own tokens."""
    # 34 tokens of budget: one request of 10 + 24 at a time.
    engine = sim_engine(cache_tokens=34)
    prompt, other = [10 + i for i in range(10)], [100 + i for i in range(10)]
    expected_a, expected_b = alone(engine, prompt), alone(engine, other)
    scheduler = BatchScheduler(engine, max_running=2)
    scheduler.submit("a", prompt, GREEDY)
    events: dict[str, list[object]] = {"a": [ev for _, ev in scheduler.step()], "b": []}
    scheduler.preempt("a", 3)
    for _ in range(500):
        if scheduler.idle:
            break
        for key, ev in scheduler.step():
            assert isinstance(key, str)
            events[key].append(ev)
            if isinstance(ev, Preempted):
                scheduler.submit("b", other, GREEDY)
            if key == "b" and isinstance(ev, Finished):
                scheduler.resume("a")
    assert ids(events["a"]) == expected_a and ids(events["b"]) == expected_b
    stats = scheduler.statistics()
    assert stats.spilled == 1 and stats.resumed == 1 and stats.kv_reserved_bytes == 0


def test_a_cancelled_suspended_request_ends_and_gives_everything_back() -> None:
    engine = sim_engine()
    scheduler = BatchScheduler(engine, max_running=1)
    scheduler.submit("a", [5, 6, 7, 8, 9], GREEDY)
    events: list[object] = [ev for _, ev in scheduler.step()]
    scheduler.preempt("a", 2)
    for _ in range(20):
        events += [ev for _, ev in scheduler.step()]
        if any(isinstance(ev, Preempted) for ev in events):
            break
    assert scheduler.suspended == 1 and scheduler.idle  # nothing to step while it waits
    scheduler.cancel("a")
    assert not scheduler.idle
    events += [ev for _, ev in scheduler.step()]
    (done,) = [ev for ev in events if isinstance(ev, Finished)]
    assert done.finish_reason == "cancelled"
    stats = scheduler.statistics()
    assert scheduler.idle and stats.suspended == 0 and stats.kv_reserved_bytes == 0


def test_a_yield_asked_before_admission_or_resume_counts_once_it_runs() -> None:
    """The caller may ask a request to yield before the scheduler admitted it, or right after
    asking for its resume (both in one step): it still runs its tokens first, then yields."""
    engine = sim_engine()
    scheduler = BatchScheduler(engine, max_running=1)
    prompt = [30 + i for i in range(7)]
    scheduler.submit("a", prompt, GREEDY)
    scheduler.preempt("a", 4)  # not admitted yet
    events: list[object] = []
    resumed = False
    for _ in range(200):
        if scheduler.idle:
            break
        for _key, ev in scheduler.step():
            events.append(ev)
            if isinstance(ev, Preempted) and not resumed:
                resumed = True
                scheduler.resume("a")
                scheduler.preempt("a", 6)  # asked again before the resume took effect
            elif isinstance(ev, Preempted):
                scheduler.resume("a")
    pauses = [ev for ev in events if isinstance(ev, Preempted)]
    assert pauses == [Preempted(4), Preempted(6)]
    assert ids(events) == alone(engine, prompt)


def test_a_request_that_ends_before_its_quantum_just_ends() -> None:
    engine = sim_engine()
    scheduler = BatchScheduler(engine, max_running=1)
    scheduler.submit("a", [5, 6, 7], SamplingParams(max_tokens=3))
    events: list[object] = [ev for _, ev in scheduler.step()]
    scheduler.preempt("a", 10)
    for _ in range(50):
        if scheduler.idle:
            break
        events += [ev for _, ev in scheduler.step()]
    assert not any(isinstance(ev, Preempted) for ev in events)
    assert isinstance(events[-1], Finished) and scheduler.statistics().preempted == 0


# --------------------------------------------------------------------------------------------
# A real model.


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from peerinfer.engine.hf import TransformersEngine
    from tests.engine.test_engine_hf import _make_tiny_model

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    directory: Path = tmp_path_factory.mktemp("tiny-llama-preempt")
    _make_tiny_model(directory)
    engine = TransformersEngine(directory, device="cpu", dtype="float32", max_batch_size=2)
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4))
    yield engine
    engine.close()
    torch.set_num_threads(before)


@pytest.mark.parametrize("keep", [True, False], ids=["kv-kept", "recomputed"])
def test_a_preempted_greedy_request_gives_the_same_tokens_on_a_real_model(
    tiny: Engine, keep: bool
) -> None:
    prompt = [40 + (7 * i) % 200 for i in range(21)]
    other = [33 + (11 * i) % 200 for i in range(13)]
    check_preempted_like_alone(tiny, prompt, other, keep)


@pytest.fixture(scope="module")
def smol() -> Iterator[Engine]:
    """The default model, SmolLM2-135M-Instruct (its packaged GGUF), float32 on the CPU."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from peerinfer.engine.hf import TransformersEngine

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = TransformersEngine(device="cpu", dtype="float32", max_batch_size=2)
    engine.configure_cache(PrefixHasher(engine.fingerprint))
    yield engine
    engine.close()
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize("keep", [True, False], ids=["kv-kept", "recomputed"])
def test_a_preempted_greedy_request_gives_the_same_tokens_on_the_default_model(
    smol: Engine, keep: bool
) -> None:
    """Issue 21's target on the model a node serves by default: preempted mid-generation
    (its KV kept, or spilled to the prefix cache and recomputed), a greedy request gives
    exactly the tokens it gives unpreempted."""
    from peerinfer.core.messages import ChatMessage

    assert str(smol.dtype) == "torch.float32"  # type: ignore[attr-defined]
    prompt = smol.chat_tokens([ChatMessage("user", "Name three rivers in Europe and say why.")])
    other = smol.chat_tokens([ChatMessage("user", "What is two plus two?")])
    key = tuple(prompt)
    if key not in _SMOL_ALONE:  # one unpreempted reference for both ways of preempting
        _SMOL_ALONE[key] = alone(smol, prompt)
    check_preempted_like_alone(smol, prompt, other, keep, expected=_SMOL_ALONE[key])


_SMOL_ALONE: dict[tuple[int, ...], list[int]] = {}
