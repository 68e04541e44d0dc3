"""Audits by re-scoring (peerinfer.engine.audit), and reputation kept across a restart."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import trio

from peerinfer.core.messages import SamplingParams
from peerinfer.engine.audit import audit_greedy
from peerinfer.engine.base import Tokens
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.node import Node
from peerinfer.trust import REPUTATION_FILE
from peerinfer.types import PeerId


def _greedy(engine: object, prompt: Sequence[int], n: int) -> list[int]:
    ids: list[int] = []
    for ev in engine.generate(prompt, SamplingParams(max_tokens=n)):  # type: ignore[attr-defined]
        if isinstance(ev, Tokens):
            ids.extend(ev.token_ids)
    return ids


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


def test_an_engine_that_cannot_audit_says_so() -> None:
    class Opaque:
        """Neither simulated nor transformers: no way to re-score."""

    assert audit_greedy(Opaque(), [5, 6], [7]) is None  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_transformers_engine_audits_by_one_teacher_forced_pass(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_engine_hf import _make_tiny_model

    from peerinfer.engine.hf import TransformersEngine

    torch.set_num_threads(1)
    _make_tiny_model(tmp_path)
    engine = TransformersEngine(tmp_path, device="cpu")
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
async def test_reputation_is_kept_across_a_restart(tmp_path: Path) -> None:
    from test_trust_liars import options

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
