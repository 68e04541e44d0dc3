"""Audits by re-scoring: is a peer's answer one this node's own model could have given?

**Greedy** (temperature 0). A completion ``c`` of a prompt ``p`` is right when every ``c[i]``
is the model's argmax after ``p + c[:i]``. One teacher-forced forward pass over ``p + c`` gives
the logits at every position at once (about the cost of prefilling the answer, since the
prompt's positions are cheap next to generating), so an audit costs far less than serving did.
Honest peers differ numerically (bf16 vs fp32, another device, another batch), so a returned
token passes when its logit is within ``tolerance + rel_tolerance * |best logit|`` of the best
logit at that position (a near tie may go either way; rounding error grows with the logits'
magnitude: a tiny random model in bfloat16 was measured 0.81 off at logits near 100), and an
answer passes when at most ``max_off_fraction`` of its positions (rounded down) are off. A
wrong answer is far from the argmax almost everywhere; a liar that alters one token in ten
stays under this bar, the price of never banning an honest peer for its float arithmetic.

**Sampled** (temperature ``T`` > 0, top-p ``p``). Every returned token must lie inside the
nucleus the sampler draws from: at ``softmax(logits / T)``, sorted by probability, a token is in
the nucleus when the mass of the tokens ranked above it is below ``p`` (the engines' rule,
``peerinfer.engine.hf.sample_token``). Temperature never reorders tokens, so the nucleus is the
``k`` most likely tokens for some ``k``; honest noise moves its edge, so the audit computes it
with ``p + NUCLEUS_P_SLACK`` (capped at 1) and lets a token through whose logit is within the
greedy tolerance of the edge token's. The same share of positions may be off. With ``p = 1`` the
nucleus is the whole vocabulary and every token passes: sampling without top-p cannot be told
from lying token by token.

:func:`audit_answer` dispatches on the engine and the request:

* ``SimulatedEngine``: exact. Its output is a pure function of the prompt (and, when sampling,
  the seed: a seeded sampled answer is recomputed; an unseeded one cannot be, the peer drew its
  own seed, so it is *not checked*: ``AuditVerdict.checked`` is False).
* ``TransformersEngine``: the teacher-forced pass above, on ``engine.model`` directly (in the
  engine's thread, like every engine call; it does not touch the engine's prefix cache).
* ``LlamaCppEngine``: the same pass through llama.cpp (``LlamaCppEngine.scored_logits``, in a
  sequence of its own, removed afterwards), judged by the same rules in NumPy.
* any other engine: ``None`` (cannot audit; the node then does not count it either way).

The end of sequence: a completion that ends in an end-of-sequence id is checked like any other
token (the argmax, or inside the nucleus, there); one cut short by ``max_tokens`` needs nothing
more.

**Constrained** answers (``params.constraint``: a JSON schema, a tool-call grammar) are
re-scored under the same constraint, as the engine sampled them: the constraint's state is
walked along the completion, each position's logits are masked to the tokens it allows, and
the rules above apply to the masked logits. A token the grammar forced is then the only
candidate, so it is never judged a lie however unlikely the bare model finds it; a token the
constraint forbids fails the audit outright (no share of positions is forgiven for that: no
rounding makes an honest peer break a grammar).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from peerinfer.core.messages import SamplingParams
from peerinfer.engine.base import Engine

#: Logit gap (nats) under which a returned token still counts as the argmax, plus a share of
#: the best logit's magnitude, and the share of positions that may be off.
DEFAULT_TOLERANCE = 0.5
DEFAULT_REL_TOLERANCE = 0.01
MAX_OFF_FRACTION = 0.1
#: How much the top-p mass is enlarged when the audit recomputes a sampled answer's nucleus.
NUCLEUS_P_SLACK = 0.05


@dataclass(frozen=True, slots=True)
class AuditVerdict:
    """``ok``, or the first position where the answer is not the model's (and by how much).
    ``checked`` False: this answer could not be checked (it counts neither way)."""

    ok: bool
    position: int = -1
    gap: float = 0.0
    #: tokens the audit's forward pass ran over (its compute, for the cost ratio)
    scored_tokens: int = 0
    sampled: bool = False
    checked: bool = True
    #: the answer holds a token its constraint forbids (at ``position``)
    broke_constraint: bool = False

    def describe(self) -> str:
        if not self.checked:
            return "not checked: a sampled answer from a seed this node does not know"
        if self.broke_constraint:
            return f"token {self.position} breaks the request's constraint"
        where = "inside the model's top-p nucleus" if self.sampled else "the model's argmax"
        if self.ok:
            return f"every token is {where}" if self.sampled else f"the answer is {where} everywhere"
        return f"token {self.position} is not {where} (logit gap {self.gap:.2f})"


def audit_answer(
    engine: Engine,
    prompt: Sequence[int],
    params: SamplingParams,
    completion: Sequence[int],
    tolerance: float = DEFAULT_TOLERANCE,
) -> AuditVerdict | None:
    """Check ``completion`` of ``prompt``, generated with ``params`` (greedy or sampled),
    against ``engine``'s model; None if this engine cannot audit. Call it in the engine's
    thread."""
    sampled = params.temperature > 0
    if not completion:
        return AuditVerdict(True, sampled=sampled)
    from peerinfer.engine.simulated import SimulatedEngine

    if isinstance(engine, SimulatedEngine):
        if sampled and params.seed is None:
            return AuditVerdict(True, sampled=True, checked=False)
        return _audit_simulated(engine, prompt, params, completion)
    if type(engine).__name__ == "TransformersEngine" and hasattr(engine, "model"):
        return _audit_transformers(engine, prompt, completion, tolerance, params)
    if type(engine).__name__ == "LlamaCppEngine" and hasattr(engine, "scored_logits"):
        return _audit_llamacpp(engine, prompt, completion, tolerance, params)
    return None


def audit_greedy(
    engine: Engine,
    prompt: Sequence[int],
    completion: Sequence[int],
    tolerance: float = DEFAULT_TOLERANCE,
) -> AuditVerdict | None:
    """Check a greedy ``completion`` of ``prompt`` against ``engine``'s model; None if this
    engine cannot audit. Call it in the engine's thread."""
    return audit_answer(engine, prompt, _GREEDY, completion, tolerance)


_GREEDY = SamplingParams(temperature=0.0)


def _audit_simulated(
    engine: Engine, prompt: Sequence[int], params: SamplingParams, completion: Sequence[int]
) -> AuditVerdict:
    """Exact: the simulated engine's answer is a pure function of the prompt (and, sampling,
    of the seed), so it is recomputed and must match token for token."""
    from peerinfer.engine.simulated import SimulatedEngine

    assert isinstance(engine, SimulatedEngine)
    sampled = params.temperature > 0
    expected = engine.completion_ids(tuple(prompt), params, len(completion))
    for i, (got, want) in enumerate(zip(completion, expected, strict=True)):
        if got != want:
            return AuditVerdict(False, i, float("inf"), len(completion), sampled=sampled)
    return AuditVerdict(True, scored_tokens=len(completion), sampled=sampled)


def _audit_transformers(
    engine: Engine,
    prompt: Sequence[int],
    completion: Sequence[int],
    tolerance: float,
    params: SamplingParams | None = None,
) -> AuditVerdict:
    import torch

    model = engine.model  # type: ignore[attr-defined]
    device = engine.device  # type: ignore[attr-defined]
    seq = list(prompt) + list(completion)
    sampled = params is not None and params.temperature > 0
    allowed = None
    if params is not None and params.constraint is not None:
        walked = _walk_constraint(engine, params, completion)
        if isinstance(walked, int):
            return AuditVerdict(False, walked, float("inf"), 0, sampled=sampled,
                                broke_constraint=True)
        allowed = walked
    ids = torch.tensor([seq], dtype=torch.long, device=device)  # [1, P + C]
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[0]  # [P + C, vocab]
        # The logits that predicted completion[i] sit at position P - 1 + i.
        start = len(prompt) - 1
        scored = logits[start : start + len(completion)].float()  # [C, vocab]
        if allowed is not None:  # what the engine sampled from: the constraint's mask applied
            keep = torch.from_numpy(allowed).to(scored.device)
            scored = scored.masked_fill(~keep[:, : scored.shape[1]], float("-inf"))
        chosen = torch.tensor(list(completion), dtype=torch.long, device=scored.device)
        best = scored.max(dim=-1).values  # [C]
        got = scored.gather(1, chosen[:, None])[:, 0]  # [C]
        if sampled:
            assert params is not None
            edge = _nucleus_edge(torch, scored, params)  # [C] the nucleus's lowest logit
        else:
            edge = best
        gaps = edge - got
        off = torch.nonzero(gaps > tolerance + DEFAULT_REL_TOLERANCE * best.abs())[:, 0].tolist()
    if len(off) > int(MAX_OFF_FRACTION * len(completion)):
        i = int(off[0])
        return AuditVerdict(False, i, float(gaps[i]), len(seq), sampled=sampled)
    return AuditVerdict(True, scored_tokens=len(seq), sampled=sampled)


def _audit_llamacpp(
    engine: Engine,
    prompt: Sequence[int],
    completion: Sequence[int],
    tolerance: float,
    params: SamplingParams,
) -> AuditVerdict:
    import numpy as np

    seq = list(prompt) + list(completion)
    sampled = params.temperature > 0
    allowed = None
    if params.constraint is not None:
        walked = _walk_constraint(engine, params, completion)
        if isinstance(walked, int):
            return AuditVerdict(False, walked, float("inf"), 0, sampled=sampled,
                                broke_constraint=True)
        allowed = walked
    # The logits that predicted completion[i] sit at position P - 1 + i.
    scored = engine.scored_logits(seq, len(prompt)).astype(np.float64)  # type: ignore[attr-defined]
    if allowed is not None:  # what the engine sampled from: the constraint's mask applied
        n = min(scored.shape[1], allowed.shape[1])
        keep = np.zeros(scored.shape, dtype=bool)
        keep[:, :n] = allowed[:, :n]
        scored[~keep] = -np.inf
    chosen = np.asarray(completion, dtype=np.int64)
    best = scored.max(axis=-1)  # [C]
    got = scored[np.arange(len(chosen)), chosen]  # [C]
    edge = _nucleus_edge_numpy(scored, params) if sampled else best
    with np.errstate(invalid="ignore"):
        gaps = edge - got
    off = np.nonzero(~(gaps <= tolerance + DEFAULT_REL_TOLERANCE * np.abs(best)))[0].tolist()
    if len(off) > int(MAX_OFF_FRACTION * len(completion)):
        i = int(off[0])
        return AuditVerdict(False, i, float(gaps[i]), len(seq), sampled=sampled)
    return AuditVerdict(True, scored_tokens=len(seq), sampled=sampled)


def _nucleus_edge_numpy(logits: Any, params: SamplingParams) -> Any:
    """``_nucleus_edge`` for NumPy logits ``[C, vocab]`` (masked entries at -inf)."""
    import numpy as np

    top_p = min(1.0, params.top_p + NUCLEUS_P_SLACK)
    sorted_logits = -np.sort(-logits, axis=-1)  # descending
    if top_p >= 1.0:
        return sorted_logits[:, -1]
    z = sorted_logits / params.temperature
    z = z - z[:, :1]
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    inside = (np.cumsum(probs, axis=-1) - probs) < top_p
    last = np.maximum(inside.sum(axis=-1), 1) - 1
    return sorted_logits[np.arange(len(last)), last]


def _walk_constraint(engine: Engine, params: SamplingParams,
                     completion: Sequence[int]) -> Any:
    """The constraint's allowed tokens at each position of ``completion`` (a boolean array
    ``[C, vocab]``), or the first position whose token it forbids (an int)."""
    import numpy as np

    grammar = engine.grammar_tokenizer()
    assert grammar is not None and params.constraint is not None
    state = grammar.matcher(params.constraint)
    rows = []
    for i, token in enumerate(completion):
        if not state.allows(token):
            return i
        rows.append(state.allowed())
        state.advance(token)
    return np.stack(rows)


def _nucleus_edge(torch: Any, logits: Any, params: SamplingParams) -> Any:
    """Per position, the logit of the least likely token in the top-p nucleus at the request's
    temperature, with ``p`` enlarged by ``NUCLEUS_P_SLACK`` (``logits``: [C, vocab] float)."""
    top_p = min(1.0, params.top_p + NUCLEUS_P_SLACK)
    sorted_logits, _ = torch.sort(logits, dim=-1, descending=True)  # [C, vocab]
    if top_p >= 1.0:
        return sorted_logits[:, -1]  # the whole vocabulary
    probs = torch.softmax(sorted_logits / params.temperature, dim=-1)
    # In the nucleus: the mass ranked above the token is below top_p (at least the first).
    inside = (torch.cumsum(probs, dim=-1) - probs) < top_p  # [C, vocab], a prefix of Trues
    last = inside.sum(dim=-1).clamp(min=1) - 1  # [C]
    return sorted_logits.gather(1, last[:, None])[:, 0]


__all__ = [
    "DEFAULT_REL_TOLERANCE",
    "DEFAULT_TOLERANCE",
    "MAX_OFF_FRACTION",
    "NUCLEUS_P_SLACK",
    "AuditVerdict",
    "audit_answer",
    "audit_greedy",
]
