"""The simulated engine's fast paths give what the plain ones give: ``PlanMemo`` (a plan that
validates each distinct prompt, and hashes its completion, once for a swarm) and the tokenizer."""

from __future__ import annotations

import random

import pytest

from peerinfer.core.costmodel import CostModel
from peerinfer.core.messages import SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.engine.simulated import _MAX_PIECE_CHARS, _PIECES, PlanMemo, SimulatedEngine
from peerinfer.errors import ConfigError, InvalidRequestError

COSTS = CostModel(
    prefill_s_per_token=0.001, cached_s_per_token=0.0001, decode_s_per_token=0.01, overhead_s=0.005
)


def _engine(vocab: int = 1000, context: int = 4096) -> SimulatedEngine:
    engine = SimulatedEngine(
        costs=COSTS, time_scale=0.0, vocab_size=vocab, max_context_tokens=context
    )
    engine.configure_cache(PrefixHasher(engine.fingerprint), capacity_tokens=640)
    return engine


def _outcome(engine: SimulatedEngine, tokens: object, params: SamplingParams) -> object:
    try:
        return engine.plan(tokens, params)  # type: ignore[arg-type]
    except InvalidRequestError as exc:
        return ("refused", str(exc))


def test_plans_with_a_shared_memo_are_the_plans_without_one() -> None:
    rng = random.Random("plan-memo")
    tuples = [tuple(rng.randrange(4, 1000) for _ in range(rng.randint(1, 200))) for _ in range(30)]
    prompts: list[object] = [
        *tuples,
        list(tuples[0]),  # not a tuple: validated each time, never kept
        (5, 6, 1000),  # outside the vocabulary
        (5, 6, True),  # a bool is not a token id
        tuple(range(4, 4100)),  # longer than the context
        (),
    ]
    params = [
        SamplingParams(max_tokens=8),
        SamplingParams(max_tokens=3),
        SamplingParams(max_tokens=5, temperature=0.7, seed=11),
        SamplingParams(max_tokens=5, temperature=0.7, seed=12),
        SamplingParams(max_tokens=4, temperature=0.7),  # unseeded: a seed per call
    ]
    memo = PlanMemo(1000, 4096, max_prompts=8)  # small: prompts dropped and asked again
    plain = [_engine(), _engine()]
    memoized = [_engine(), _engine()]
    for engine in memoized:
        engine.share_plan_memo(memo)
    outcomes = 0
    for _ in range(1_500):
        tokens = rng.choice(prompts) if rng.random() < 0.3 else rng.choice(prompts[:6])
        p = rng.choice(params)
        if rng.random() < 0.05:  # an equal parameters object, not the same one
            p = SamplingParams(p.max_tokens, p.temperature, p.top_p, p.seed)
        node = rng.randrange(2)
        a, b = _outcome(plain[node], tokens, p), _outcome(memoized[node], tokens, p)
        assert a == b
        outcomes += 1
    # The memo did its work: far fewer validations and completions than plans.
    assert 0 < memo.validations < outcomes / 2
    assert 0 < memo.completions < outcomes  # (one (seed, length) kept per prompt)
    done = memo.completions, memo.validations
    for _ in range(5):
        memoized[1].plan(prompts[1], params[0])  # type: ignore[arg-type]
    assert (memo.completions, memo.validations) <= (done[0] + 1, done[1] + 1)
    bad = SamplingParams(max_tokens=0)  # refused before the prompt is looked at
    assert _outcome(plain[0], prompts[0], bad) == _outcome(memoized[0], prompts[0], bad)
    assert _outcome(memoized[0], prompts[0], bad)[0] == "refused"  # type: ignore[index]


def test_a_memo_serves_only_engines_of_its_vocabulary_and_context() -> None:
    with pytest.raises(ConfigError):
        _engine(vocab=1000).share_plan_memo(PlanMemo(2000, 4096))
    with pytest.raises(ConfigError):
        _engine(context=4096).share_plan_memo(PlanMemo(1000, 8192))


def _reference_tokenize(engine: SimulatedEngine, text: str) -> list[int]:
    # The tokenizer as first written: every regex piece cut into pieces of at most 8 chars.
    out: list[int] = []
    for match in _PIECES.finditer(text):
        piece = match.group()
        for i in range(0, len(piece), _MAX_PIECE_CHARS):
            out.append(engine._piece_id(piece[i : i + _MAX_PIECE_CHARS]))
    return out


def test_the_tokenizer_cuts_and_numbers_pieces_as_the_reference() -> None:
    rng = random.Random("tokenize")
    alphabet = "abcdefghij ABC 0123456789 .,;:!?-_()[] \n\t éüß 中文 😀"
    fast, reference = SimulatedEngine(), SimulatedEngine()
    for _ in range(400):
        words = []
        for _ in range(rng.randint(0, 40)):
            n = rng.choice((1, 3, 7, 8, 9, 16, 17, 25))
            words.append("".join(rng.choice(alphabet) for _ in range(n)))
        text = rng.choice(("", " ", "\n")).join(words)
        assert fast.tokenize(text) == _reference_tokenize(reference, text)
        assert fast.tokenize(text) == _reference_tokenize(reference, text)  # known pieces
