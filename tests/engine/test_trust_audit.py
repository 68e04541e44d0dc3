"""Audits by re-scoring (peerinfer.engine.audit), and reputation kept across a restart."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import trio

from peerinfer.core.messages import SamplingParams
from peerinfer.engine.audit import audit_answer, audit_greedy
from peerinfer.engine.base import Tokens
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.node import Node
from peerinfer.node.trust import REPUTATION_FILE
from peerinfer.types import PeerId


def _greedy(engine: object, prompt: Sequence[int], n: int) -> list[int]:
    return _generate(engine, prompt, SamplingParams(max_tokens=n))


def _generate(engine: object, prompt: Sequence[int], params: SamplingParams) -> list[int]:
    ids: list[int] = []
    for ev in engine.generate(prompt, params):  # type: ignore[attr-defined]
        if isinstance(ev, Tokens):
            ids.extend(ev.token_ids)
    return ids


@pytest.fixture
def tiny_model(tmp_path: Path) -> tuple[Any, Any]:
    """``(torch, engine)``: a TransformersEngine on a tiny random Llama of its own (the tests
    change its weights' precision), on the CPU with one thread."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from peerinfer.engine.hf import TransformersEngine
    from tests.engine.test_engine_hf import _make_tiny_model

    torch.set_num_threads(1)
    _make_tiny_model(tmp_path)
    return torch, TransformersEngine(tmp_path, device="cpu")


def test_the_simulated_engine_audits_exactly() -> None:
    engine = SimulatedEngine(time_scale=0.0)
    prompt = engine.tokenize("an audited question " * 20)
    answer = _greedy(engine, prompt, 12)
    verdict = audit_greedy(engine, prompt, answer)
    assert verdict is not None and verdict.ok, verdict
    for i in (0, 5, 11):
        wrong = list(answer)
        wrong[i] = (wrong[i] + 1) % engine.vocab_size
        verdict = audit_greedy(engine, prompt, wrong)
        assert verdict is not None and not verdict.ok and verdict.position == i
    assert audit_greedy(engine, prompt, [])


def test_the_simulated_engine_audits_seeded_sampled_answers_exactly() -> None:
    engine = SimulatedEngine(time_scale=0.0)
    prompt = engine.tokenize("a sampled question " * 20)
    for seed in range(50):
        params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=seed)
        answer = _generate(engine, prompt, params)
        verdict = audit_answer(engine, prompt, params, answer)
        assert verdict is not None and verdict.ok and verdict.checked and verdict.sampled, (seed, verdict)
        wrong = list(answer)
        wrong[seed % 10] = (wrong[seed % 10] + 1) % engine.vocab_size
        verdict = audit_answer(engine, prompt, params, wrong)
        assert verdict is not None and not verdict.ok and verdict.position == seed % 10
        assert "nucleus" in verdict.describe()
        # Another seed's answer is not this seed's.
        other = _generate(engine, prompt, SamplingParams(10, 0.8, 0.9, seed + 1000))
        assert not audit_answer(engine, prompt, params, other).ok  # type: ignore[union-attr]
    # Unseeded: the peer drew its own seed, which the origin cannot know: not checked.
    unseeded = SamplingParams(max_tokens=10, temperature=0.8)
    verdict = audit_answer(engine, prompt, unseeded, _generate(engine, prompt, unseeded))
    assert verdict is not None and not verdict.checked


def test_an_engine_that_cannot_audit_says_so() -> None:
    class Opaque:
        """Neither simulated nor transformers: no way to re-score."""

    assert audit_greedy(Opaque(), [5, 6], [7]) is None  # type: ignore[arg-type]
    hot = SamplingParams(temperature=0.7, top_p=0.9, seed=1)
    assert audit_answer(Opaque(), [5, 6], hot, [7]) is None  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_transformers_engine_audits_by_one_teacher_forced_pass(tiny_model: tuple[Any, Any]) -> None:
    torch, engine = tiny_model
    rng = random.Random(0)
    for trial in range(3):
        prompt = [rng.randrange(0, 256) for _ in range(20 + trial)]
        answer = _greedy(engine, prompt, 10)
        verdict = audit_greedy(engine, prompt, answer, tolerance=1e-3)
        assert verdict is not None and verdict.ok, verdict
        # One token off in ten (the last: an honest near-tie flip, after which the honest peer
        # continues from its own token, is just as isolated) is within the noise allowance;
        # a wrong token mid-answer puts the rest off too.
        wrong = list(answer)
        wrong[9] = (answer[9] + 1 + rng.randrange(255)) % 256
        verdict = audit_greedy(engine, prompt, wrong, tolerance=1e-3)
        assert verdict is not None and verdict.ok
        for i in (3, 7):
            wrong[i] = (answer[i] + 1 + rng.randrange(255)) % 256
        verdict = audit_greedy(engine, prompt, wrong, tolerance=1e-3)
        assert verdict is not None and not verdict.ok and verdict.position in (3, 7), verdict
    assert verdict.scored_tokens == len(prompt) + len(wrong)
    # Honest numeric noise: answers computed in float32, re-scored with bfloat16 weights (another
    # precision, as on another device), pass at the default tolerance.
    answers = [(p, _greedy(engine, p, 10)) for p in ([rng.randrange(0, 256) for _ in range(24)] for _ in range(5))]
    engine.model = engine.model.to(torch.bfloat16)
    for prompt, answer in answers:
        verdict = audit_greedy(engine, prompt, answer)
        assert verdict is not None and verdict.ok, verdict


@pytest.mark.slow
def test_a_transformers_engine_audits_sampled_answers_against_the_top_p_nucleus(
    tiny_model: tuple[Any, Any],
) -> None:
    torch, engine = tiny_model
    rng = random.Random(1)
    prompts = [[rng.randrange(0, 256) for _ in range(16 + k)] for k in range(4)]
    settings = [(0.7, 0.5), (1.0, 0.9), (1.5, 0.3)]
    honest = []
    # Honest sampled answers, many seeds: every one passes (they are drawn from the nucleus).
    for prompt in prompts:
        for temperature, top_p in settings:
            for seed in range(8):
                params = SamplingParams(max_tokens=10, temperature=temperature, top_p=top_p, seed=seed)
                answer = _generate(engine, prompt, params)
                verdict = audit_answer(engine, prompt, params, answer)
                assert verdict is not None and verdict.ok and verdict.sampled, (params, verdict)
                honest.append((prompt, params, answer))
    # A token outside the nucleus: the least likely one after the honest prefix, at two
    # positions (one alone would be within the noise allowance of one position in ten).
    for prompt, params, answer in honest[::7]:
        wrong = list(answer)
        for i in (2, 6):
            ids = torch.tensor([list(prompt) + wrong[:i]])
            with torch.inference_mode():
                logits = engine.model(input_ids=ids, use_cache=False).logits[0, -1]
            wrong[i] = int(torch.argmin(logits))
        verdict = audit_answer(engine, prompt, params, wrong)
        assert verdict is not None and not verdict.ok and verdict.position == 2, (params, verdict)
        assert "nucleus" in verdict.describe()
    # Honest numeric noise: the same answers re-scored with bfloat16 weights still pass.
    engine.model = engine.model.to(torch.bfloat16)
    for prompt, params, answer in honest:
        verdict = audit_answer(engine, prompt, params, answer)
        assert verdict is not None and verdict.ok, (params, verdict)


@pytest.mark.slow
async def test_reputation_is_kept_across_a_restart(tmp_path: Path) -> None:
    from tests.node.test_trust_liars import options

    identity = tmp_path / "identity.key"
    liar = PeerId("12D3KooWliarliarliarliarliarliarliarliarliarliarl")

    async def run_once(action: object) -> Node:
        async with trio.open_nursery() as nursery:
            node = Node(
                options(identity=identity, persist_identity=True),
                engine=SimulatedEngine(time_scale=0.0),
            )
            await nursery.start(node.serve)
            action(node)  # type: ignore[operator]
            nursery.cancel_scope.cancel()
        return node

    def offend(node: Node) -> None:
        assert node.core is not None
        node.core.reputation.record(liar, "audit_failed", trio.current_time())

    first = await run_once(offend)
    saved = json.loads((tmp_path / REPUTATION_FILE).read_text())
    assert liar in saved["peers"]
    seen: list[str] = []

    def look(node: Node) -> None:
        assert node.core is not None and node.host is not None
        seen.append(node.core.reputation.standing(liar, trio.current_time()))

    second = await run_once(look)
    assert first.peer_id == second.peer_id  # the same identity, and the same memory
    assert seen == ["banned"]
