"""One conformance suite that every engine passes: the example backend, the simulated engine and
the Transformers engine (on a tiny random model). A new backend can add itself to ENGINES."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from peerinfer.core.messages import SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.engine import Engine, Finished, Started, Tokens, load_engine
from peerinfer.errors import InvalidRequestError

ROOT = Path(__file__).resolve().parent.parent


def _echo() -> Engine:
    return load_engine(f"{ROOT / 'examples' / 'custom_backend.py'}:EchoEngine")


def _simulated() -> Engine:
    return load_engine("simulated", time_scale=0.0)


_TINY: list[Path] = []


def _tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    pytest.importorskip("torch")
    from test_engine_hf import _make_tiny_model

    if not _TINY:  # build the model once per session
        directory = tmp_path_factory.mktemp("conformance-tiny")
        _make_tiny_model(directory)
        _TINY.append(directory)
    return load_engine("hf", model=str(_TINY[0]), device="cpu")


ENGINES: dict[str, Callable[[pytest.TempPathFactory], Engine]] = {
    "echo": lambda _: _echo(),
    "simulated": lambda _: _simulated(),
    "hf-tiny": _tiny_hf,
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
