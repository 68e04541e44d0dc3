"""The engine base class: validation, text streaming, events, and the prefix-cache hooks.

The cache hooks are driven through a fake KV backend whose "KV state" is the tokens themselves:
its decoder checks that the prefix it is handed really is the prompt's, and it accounts for every
segment it hands out, so leaks, double frees, unlocked reuse and wrong reports all fail here.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerinfer.core.messages import ChatMessage, SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.engine import (
    CachedPrefix,
    Decoder,
    DecodeRequest,
    Engine,
    Finished,
    KVSegment,
    Started,
    TextStream,
    Tokens,
)
from peerinfer.errors import ClosedError, ConfigError, EngineError, InvalidRequestError

BS = 4


# --------------------------------------------------------------------------------------------
# Fakes.


class _ByteEngine(Engine):
    """UTF-8 bytes as tokens; replays a fixed script of token ids."""

    fingerprint = b"test-bytes"
    vocab_size = 256

    def __init__(self, script: Sequence[int] = (), eos: int | None = None) -> None:
        self.script = list(script)
        self._eos_ids = frozenset() if eos is None else frozenset({eos})
        self.closed_iterators = 0

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_ids

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode())

    def detokenize(self, tokens: Sequence[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")

    def generate_tokens(self, request: DecodeRequest) -> Iterator[int]:
        try:
            yield from self.script
        finally:
            self.closed_iterators += 1


class _Segment:
    __slots__ = ("tokens", "alive")

    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.tokens = tokens
        self.alive = True


def _next_token(seq: Sequence[int], vocab: int) -> int:
    """A deterministic 'model': depends on the whole sequence and on token positions."""
    acc = 0
    for i, t in enumerate(seq):
        acc = (acc * 31 + (i + 1) * (t + 7)) % 1_000_003
    return acc % vocab


class _FakeKVEngine(Engine):
    supports_prefix_cache = True
    fingerprint = b"test-fake-kv"
    vocab_size = 12

    def __init__(self, capacity_bytes: int | None = None, max_context: int = 10_000) -> None:
        self.default_capacity_bytes = capacity_bytes
        self.default_block_size = BS
        self._max_context = max_context
        self.live: dict[int, _Segment] = {}
        self.exported = 0
        self.fail_on_step = False

    @property
    def max_context_tokens(self) -> int:
        return self._max_context

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return "".join(chr(97 + t) for t in tokens)

    def open_decoder(self, request: DecodeRequest) -> Decoder:
        return _FakeKVDecoder(self, request)

    def free_segment(self, payload: _Segment) -> None:
        assert payload.alive, "segment freed twice"
        payload.alive = False
        del self.live[id(payload)]


class _FakeKVDecoder(Decoder):
    def __init__(self, engine: _FakeKVEngine, request: DecodeRequest) -> None:
        prefix = request.prefix
        assert prefix.tokens % request.block_size == 0
        assert len(prefix.segments) * request.block_size == prefix.tokens
        assert prefix.tokens < len(request.tokens), "the last prompt token must always run"
        reused: list[int] = []
        for seg in prefix.segments:
            assert seg.alive, "reused a freed segment"
            reused.extend(seg.tokens)
        assert tuple(reused) == request.tokens[: prefix.tokens], "prefix is not the prompt's"
        self.engine = engine
        self.request = request
        self.seq = list(reused)
        self.pending = list(request.tokens[prefix.tokens :])

    def step(self) -> int | None:
        if self.engine.fail_on_step:
            raise RuntimeError("device on fire")
        self.seq.extend(self.pending)
        token = _next_token(self.seq, self.engine.vocab_size)
        self.pending = [token]
        return token

    @property
    def kv_tokens(self) -> int:
        return len(self.seq)

    def export_segments(self, first_block: int) -> list[KVSegment]:
        bs = self.request.block_size
        out = []
        for b in range(first_block, len(self.seq) // bs):
            seg = _Segment(tuple(self.seq[b * bs : (b + 1) * bs]))
            self.engine.live[id(seg)] = seg
            self.engine.exported += 1
            out.append(KVSegment(seg, 10))
        return out


def _reference(prompt: Sequence[int], n: int, vocab: int) -> list[int]:
    seq = list(prompt)
    out = []
    for _ in range(n):
        t = _next_token(seq, vocab)
        out.append(t)
        seq.append(t)
    return out


def _collect(events: Iterator[object]) -> tuple[Started, list[int], str, Finished]:
    started = None
    ids: list[int] = []
    text = ""
    finished = None
    for ev in events:
        if isinstance(ev, Started):
            assert started is None and not ids
            started = ev
        elif isinstance(ev, Tokens):
            assert started is not None and finished is None
            ids.extend(ev.token_ids)
            text += ev.text
        else:
            assert isinstance(ev, Finished) and finished is None
            finished = ev
    assert started is not None and finished is not None
    return started, ids, text, finished


def _check_cache_consistent(engine: _FakeKVEngine) -> None:
    cache = engine.radix_cache
    assert cache is not None
    cache.check_invariants()
    stack = list(cache.root.children.values())
    held = {}
    while stack:
        node = stack.pop()
        assert node.payload is not None and node.payload.alive
        assert node.payload.tokens == node.key
        held[id(node.payload)] = node.payload
        stack.extend(node.children.values())
    assert held.keys() == engine.live.keys(), "segments leaked or freed while cached"


# --------------------------------------------------------------------------------------------
# Validation.


@pytest.mark.parametrize(
    "tokens, message",
    [
        ([], "empty"),
        ("hello", "sequence of token ids"),
        ([1, 2, 256], "outside the model's vocabulary"),
        ([1, -1], "outside the model's vocabulary"),
        ([1, True], "integers"),
        ([1, 2.0], "integers"),
        (None, "sequence of token ids"),
        (list(range(200)) * 700, "context"),
    ],
)
def test_bad_prompts_are_refused_and_the_engine_keeps_serving(tokens, message):
    engine = _ByteEngine(script=[104, 105])
    with pytest.raises(InvalidRequestError, match=message):
        engine.generate(tokens, SamplingParams())
    _, ids, text, done = _collect(engine.generate([1, 2, 3], SamplingParams(max_tokens=2)))
    assert (ids, text, done.finish_reason) == ([104, 105], "hi", "length")


def _params(**kw: object) -> SamplingParams:
    return SamplingParams(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "params",
    [
        _params(max_tokens=0),
        _params(max_tokens=10**9),
        _params(max_tokens=2.5),
        _params(temperature=-1.0),
        _params(temperature=math.nan),
        _params(temperature=math.inf),
        _params(temperature=1e6),
        _params(top_p=0.0),
        _params(top_p=1.5),
        _params(top_p=math.nan),
        _params(seed=-1),
        _params(seed=2**64),
        _params(seed="7"),
        _params(stop=("",)),
        _params(stop=("x" * 1000,)),
        _params(stop=tuple("abcdefghijklmnopq")),
        _params(stop=(3,)),
        _params(stop="abc"),
    ],
)
def test_absurd_sampling_parameters_are_refused(params):
    engine = _ByteEngine(script=[104])
    with pytest.raises(InvalidRequestError):
        engine.generate([1, 2], params)
    assert _collect(engine.generate([1, 2], SamplingParams(max_tokens=1)))[1] == [104]


def test_params_must_be_sampling_params():
    with pytest.raises(InvalidRequestError):
        _ByteEngine().generate([1], {"max_tokens": 3})  # type: ignore[arg-type]


def test_generation_stops_at_the_context_limit():
    class Short(_ByteEngine):
        max_context_tokens = 6

    engine = Short(script=[65] * 50)
    _, ids, _, done = _collect(engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=50)))
    assert len(ids) == 2 and done.finish_reason == "length"
    with pytest.raises(InvalidRequestError, match="context"):
        engine.generate([1] * 6, SamplingParams())


# --------------------------------------------------------------------------------------------
# Events, stop sequences, EOS, cancellation, errors.


def test_event_stream_shape_and_counts():
    engine = _ByteEngine(script=list(b"hello world"))
    started, ids, text, done = _collect(engine.generate([1, 2, 3], SamplingParams(max_tokens=5)))
    assert started == Started(3, 0)
    assert ids == list(b"hello") and text == "hello"
    assert done == Finished("length", 3, 5, 0, (), ())
    assert engine.closed_iterators == 1


def test_backend_ending_its_iterator_means_stop():
    engine = _ByteEngine(script=list(b"ab"))
    _, ids, text, done = _collect(engine.generate([1], SamplingParams(max_tokens=10)))
    assert (ids, text, done.finish_reason, done.completion_tokens) == (list(b"ab"), "ab", "stop", 2)


def test_eos_token_is_reported_with_no_text_and_stops():
    engine = _ByteEngine(script=[104, 105, 0, 106], eos=0)
    _, ids, text, done = _collect(engine.generate([1], SamplingParams(max_tokens=10)))
    assert (ids, text, done.finish_reason) == ([104, 105, 0], "hi", "stop")


def test_stop_sequence_is_cut_and_not_emitted():
    engine = _ByteEngine(script=list("héllo, wörld! more".encode()))
    params = SamplingParams(max_tokens=100, stop=("rld", "zzz"))
    chunks = []
    for ev in engine.generate([1], params):
        if isinstance(ev, Tokens):
            chunks.append(ev.text)
        elif isinstance(ev, Finished):
            done = ev
    assert "".join(chunks) == "héllo, wö"
    assert "\ufffd" not in "".join(chunks)
    assert done.finish_reason == "stop"
    # Every token up to the one completing the stop sequence was generated and is counted.
    assert done.completion_tokens == len("héllo, wörld".encode())


def test_held_back_stop_prefix_is_flushed_when_generation_ends_otherwise():
    engine = _ByteEngine(script=list(b"abc ST"))
    _, _, text, done = _collect(engine.generate([1], SamplingParams(max_tokens=6, stop=("STOP",))))
    assert text == "abc ST" and done.finish_reason == "length"


def test_cancelled_before_start_generates_nothing():
    cancel = threading.Event()
    cancel.set()
    engine = _ByteEngine(script=list(b"abc"))
    _, ids, _, done = _collect(engine.generate([1], SamplingParams(max_tokens=3), cancel))
    assert ids == [] and done.finish_reason == "cancelled"


def test_cancel_between_tokens():
    cancel = threading.Event()
    engine = _ByteEngine(script=list(b"abcdef"))
    ids = []
    for ev in engine.generate([1], SamplingParams(max_tokens=6), cancel):
        if isinstance(ev, Tokens):
            ids.extend(ev.token_ids)
            if len(ids) == 2:
                cancel.set()
        elif isinstance(ev, Finished):
            done = ev
    assert ids == list(b"ab") and done.finish_reason == "cancelled"
    assert done.completion_tokens == 2


def test_backend_failure_becomes_engine_error_and_engine_keeps_serving():
    engine = _FakeKVEngine()
    engine.fail_on_step = True
    with pytest.raises(EngineError, match="device on fire") as info:
        _collect(engine.generate([1, 2, 3, 4, 5], SamplingParams(max_tokens=2)))
    assert isinstance(info.value.__cause__, RuntimeError)
    engine.fail_on_step = False
    _, ids, _, _ = _collect(engine.generate([1, 2, 3, 4, 5], SamplingParams(max_tokens=2)))
    assert ids == _reference([1, 2, 3, 4, 5], 2, engine.vocab_size)
    assert engine.radix_cache is not None and engine.radix_cache.stats().locked_blocks == 0
    assert engine.statistics().errors == 1


def test_default_chat_template_and_closed_engine():
    engine = _ByteEngine(script=[65])
    ids = engine.chat_tokens([ChatMessage("user", "hi")])
    assert bytes(ids).decode() == "user: hi\nassistant:"
    with pytest.raises(InvalidRequestError):
        engine.chat_tokens([])
    engine.close()
    with pytest.raises(ClosedError):
        engine.generate([1], SamplingParams())


def test_engine_without_cache_reports_nothing_cached():
    engine = _ByteEngine(script=[65, 66])
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=2))
    for _ in range(2):
        started, _, _, done = _collect(engine.generate([1, 2, 3, 4, 5], SamplingParams(max_tokens=2)))
        assert started.cached_tokens == 0 and done.cached_tokens == 0
        assert done.cache_added == () and done.cache_removed == ()
    assert engine.cached_block_hashes() == ()
    assert engine.statistics().cache is None


def test_configure_cache_refuses_a_hasher_for_another_model():
    engine = _FakeKVEngine()
    with pytest.raises(ConfigError):
        engine.configure_cache(PrefixHasher(b"another model"))


# --------------------------------------------------------------------------------------------
# Incremental detokenization.


def _utf8(tokens: Sequence[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="\ufffd", codec="utf-8"), max_size=40))
def test_text_stream_never_releases_half_characters(text):
    stream = TextStream(_utf8, prompt=list(b"ctx"))
    chunks = [stream.push(b) for b in text.encode()]
    chunks.append(stream.finish())
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)


@settings(max_examples=400, deadline=None)
@given(
    st.text(alphabet="abc é", max_size=30),
    st.lists(st.text(alphabet="abc é", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_text_stream_stops_where_a_stop_sequence_first_completes(text, stops):
    stream = TextStream(_utf8, stop=stops)
    out = []
    for b in text.encode():
        out.append(stream.push(b))
        if stream.stopped:
            break
    out.append(stream.finish())
    # Naive model: generation stops at the first character that completes any stop sequence;
    # the output is what precedes the earliest stop sequence in the text up to there.
    expected, stopped = text, False
    for end in range(1, len(text) + 1):
        hits = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if hits:
            expected, stopped = text[: min(hits)], True
            break
    assert "".join(out) == expected
    assert stream.stopped == stopped


# --------------------------------------------------------------------------------------------
# The prefix-cache hooks.


def test_full_prompt_hit_still_runs_the_last_token():
    engine = _FakeKVEngine()
    prompt = list(range(8))  # exactly two blocks
    _collect(engine.generate(prompt, SamplingParams(max_tokens=3)))
    started, ids, _, _ = _collect(engine.generate(prompt, SamplingParams(max_tokens=3)))
    assert started.cached_tokens == 4  # prompt[:-1] has one full block
    assert ids == _reference(prompt, 3, engine.vocab_size)
    _check_cache_consistent(engine)


def test_generated_tokens_are_cached_for_the_next_turn():
    engine = _FakeKVEngine()
    prompt = [1, 2, 3, 4, 5, 6]
    _, ids, _, done = _collect(engine.generate(prompt, SamplingParams(max_tokens=7)))
    hasher = engine.radix_cache.hasher
    kv = prompt + ids[:-1]  # the last generated token was never fed back
    assert set(done.cache_added) == set(hasher.chain(kv))
    next_turn = kv + [ids[-1], 9, 9]
    started, ids2, _, _ = _collect(engine.generate(next_turn, SamplingParams(max_tokens=2)))
    assert started.cached_tokens == len(kv) // BS * BS
    assert ids2 == _reference(next_turn, 2, engine.vocab_size)


def test_snapshot_then_changes_replay_to_the_cache():
    engine = _FakeKVEngine(capacity_bytes=30)  # three blocks of 10 bytes
    digest = set(engine.cached_block_hashes())
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [2, 2, 2, 2, 2, 2, 2, 2, 2], [1, 2, 3, 4, 0]):
        *_, done = _collect(engine.generate(prompt, SamplingParams(max_tokens=4)))
        assert not (set(done.cache_added) & set(done.cache_removed))
        digest |= set(done.cache_added)
        digest -= set(done.cache_removed)
        assert digest == set(engine.radix_cache.block_hashes())
    assert engine.radix_cache.stats().evicted_blocks > 0
    _check_cache_consistent(engine)


def test_locked_prefix_survives_eviction_pressure():
    engine = _FakeKVEngine(capacity_bytes=30)
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    _collect(engine.generate(first, SamplingParams(max_tokens=1)))
    running = engine.generate(first[:8] + [3, 3], SamplingParams(max_tokens=3))
    assert next(running) == Started(10, 8)
    locked = engine.radix_cache.match(first[:8], touch=False).nodes
    # Another request wants all the room; the running request's prefix is pinned.
    _collect(engine.generate([7] * 20, SamplingParams(max_tokens=2)))
    assert all(not n.evicted for n in locked)
    _, ids, _, _ = _collect(iter([Started(10, 8), *running]))
    assert ids == _reference(first[:8] + [3, 3], 3, engine.vocab_size)
    _check_cache_consistent(engine)
    assert engine.radix_cache.stats().locked_blocks == 0


def test_abandoned_generation_unlocks_and_reports_later():
    engine = _FakeKVEngine()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    _collect(engine.generate(prompt, SamplingParams(max_tokens=1)))
    gen = engine.generate(prompt, SamplingParams(max_tokens=5))
    next(gen)
    next(gen)
    gen.close()
    assert engine.radix_cache.stats().locked_blocks == 0
    _check_cache_consistent(engine)
    assert engine.take_cache_changes().added == ()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    prompts=st.lists(
        st.tuples(
            st.sampled_from([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (5, 5, 5, 5, 1)]),
            st.lists(st.integers(0, 3), min_size=1, max_size=9),
            st.integers(1, 6),
        ),
        min_size=1,
        max_size=6,
    ),
    schedule=st.lists(st.integers(0, 5), max_size=60),
    abandon=st.sets(st.integers(0, 5), max_size=2),
    capacity_blocks=st.one_of(st.none(), st.integers(0, 8)),
)
def test_interleaved_requests_match_the_uncached_model(prompts, schedule, abandon, capacity_blocks):
    """Any interleaving of requests, any budget: exact outputs, no leaks, exact reports."""
    engine = _FakeKVEngine(capacity_bytes=None if capacity_blocks is None else 10 * capacity_blocks)
    digest = set(engine.cached_block_hashes())
    gens = []
    for head, tail, n in prompts:
        prompt = list(head) + tail
        gens.append((prompt, n, engine.generate(prompt, SamplingParams(max_tokens=n)), []))
    done = [False] * len(gens)

    def advance(i: int) -> None:
        nonlocal digest
        prompt, n, gen, events = gens[i]
        ev = next(gen, None)
        if ev is None:
            done[i] = True
            _, ids, _, fin = _collect(iter(events))
            assert ids == _reference(prompt, n, engine.vocab_size)
            assert fin.cached_tokens == events[0].cached_tokens
            return
        if isinstance(ev, Finished):  # reports apply in the order they are made
            digest |= set(ev.cache_added)
            digest -= set(ev.cache_removed)
        events.append(ev)

    for i in schedule:
        i %= len(gens)
        if done[i]:
            continue
        if i in abandon and len(gens[i][3]) >= 2:
            gens[i][2].close()
            done[i] = True
            continue
        advance(i)
        engine.radix_cache.check_invariants(verify_hashes=False)
    for i in range(len(gens)):
        while not done[i]:
            advance(i)
    changes = engine.take_cache_changes()
    digest |= set(changes.added)
    digest -= set(changes.removed)
    assert digest == set(engine.radix_cache.block_hashes())
    _check_cache_consistent(engine)
    assert engine.radix_cache.stats().locked_blocks == 0
    engine.close()
    assert engine.live == {}, "close() must free every cached segment"


def test_cached_prefix_default_is_empty():
    assert CachedPrefix() == CachedPrefix(0, ())
