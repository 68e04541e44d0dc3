"""Audits by re-scoring: is a peer's greedy answer what this node's own model gives?

A greedy completion ``c`` of a prompt ``p`` is right when every ``c[i]`` is the model's argmax
after ``p + c[:i]``. One teacher-forced forward pass over ``p + c`` gives the logits at every
position at once (about the cost of prefilling the answer, since the prompt's positions are
cheap next to generating), so an audit costs far less than serving did. Honest peers differ
numerically (bf16 vs fp32, another device, another batch), so a returned token passes when its
logit is within ``tolerance + rel_tolerance * |best logit|`` of the best logit at that position
(a near tie may go either way; rounding error grows with the logits' magnitude: a tiny random
model in bfloat16 was measured 0.81 off at logits near 100), and an answer passes when at most
``max_off_fraction`` of its positions (rounded down) are off. A wrong answer is far from the
argmax almost everywhere; a liar that alters one token in ten stays under this bar, the price
of never banning an honest peer for its float arithmetic.

:func:`audit_greedy` dispatches on the engine:

* ``SimulatedEngine``: exact, the output is a pure function of the prompt.
* ``TransformersEngine``: the teacher-forced pass above, on ``engine.model`` directly (in the
  engine's thread, like every engine call; it does not touch the engine's prefix cache).
* any other engine: ``None`` (cannot audit; the node then does not count it either way).

The end of sequence: a completion that ends in an end-of-sequence id is checked like any other
token (the argmax must be EOS there); one cut short by ``max_tokens`` needs nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from peerinfer.core.messages import SamplingParams
from peerinfer.engine.base import Engine

#: Logit gap (nats) under which a returned token still counts as the argmax, plus a share of
#: the best logit's magnitude, and the share of positions that may be off.
DEFAULT_TOLERANCE = 0.5
DEFAULT_REL_TOLERANCE = 0.01
MAX_OFF_FRACTION = 0.1


@dataclass(frozen=True, slots=True)
class AuditVerdict:
    """``ok``, or the first position where the answer is not the model's (and by how much)."""

    ok: bool
    position: int = -1
    gap: float = 0.0
    #: tokens the audit's forward pass ran over (its compute, for the cost ratio)
    scored_tokens: int = 0

    def describe(self) -> str:
        if self.ok:
            return "the answer is the model's argmax everywhere"
        return f"token {self.position} is not the model's argmax (logit gap {self.gap:.2f})"


def audit_greedy(
    engine: Engine,
    prompt: Sequence[int],
    completion: Sequence[int],
    tolerance: float = DEFAULT_TOLERANCE,
) -> AuditVerdict | None:
    """Check a greedy ``completion`` of ``prompt`` against ``engine``'s model; None if this
    engine cannot audit. Call it in the engine's thread."""
    if not completion:
        return AuditVerdict(True)
    from peerinfer.engine.simulated import SimulatedEngine

    if isinstance(engine, SimulatedEngine):
        return _audit_simulated(engine, prompt, completion)
    if type(engine).__name__ == "TransformersEngine" and hasattr(engine, "model"):
        return _audit_transformers(engine, prompt, completion, tolerance)
    return None


def _audit_simulated(
    engine: Engine, prompt: Sequence[int], completion: Sequence[int]
) -> AuditVerdict:
    from peerinfer.engine.simulated import SimulatedEngine

    assert isinstance(engine, SimulatedEngine)
    expected = engine.completion_ids(tuple(prompt), SamplingParams(temperature=0.0), len(completion))
    for i, (got, want) in enumerate(zip(completion, expected, strict=True)):
        if got != want:
            return AuditVerdict(False, i, float("inf"), len(completion))
    return AuditVerdict(True, scored_tokens=len(completion))


def _audit_transformers(
    engine: Engine, prompt: Sequence[int], completion: Sequence[int], tolerance: float
) -> AuditVerdict:
    import torch

    model = engine.model  # type: ignore[attr-defined]
    device = engine.device  # type: ignore[attr-defined]
    seq = list(prompt) + list(completion)
    ids = torch.tensor([seq], dtype=torch.long, device=device)  # [1, P + C]
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[0]  # [P + C, vocab]
        # The logits that predicted completion[i] sit at position P - 1 + i.
        start = len(prompt) - 1
        scored = logits[start : start + len(completion)].float()  # [C, vocab]
        chosen = torch.tensor(list(completion), dtype=torch.long, device=scored.device)
        best = scored.max(dim=-1).values  # [C]
        got = scored.gather(1, chosen[:, None])[:, 0]  # [C]
        gaps = best - got
        off = torch.nonzero(gaps > tolerance + DEFAULT_REL_TOLERANCE * best.abs())[:, 0].tolist()
    if len(off) > int(MAX_OFF_FRACTION * len(completion)):
        i = int(off[0])
        return AuditVerdict(False, i, float(gaps[i]), len(seq))
    return AuditVerdict(True, scored_tokens=len(seq))


__all__ = ["DEFAULT_REL_TOLERANCE", "DEFAULT_TOLERANCE", "MAX_OFF_FRACTION", "AuditVerdict", "audit_greedy"]
