"""KV blocks as bytes: ``kv_format``, ``encode_block``/``decode_block``, ``encode_blocks`` and
``adopt_blocks``, on the three engines.

The round trip that matters: blocks exported as bytes from one cache, decoded and adopted into
an empty cache, make the next request hit them, and greedy generation from them gives the very
tokens a recompute gives. The decoders must refuse bytes that are not such a block (they may come
from a hostile peer or a damaged file) with ProtocolError, never with a wrong cache.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence

import pytest

from peerinfer.core.messages import SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.engine import Started, Tokens
from peerinfer.engine.base import Engine
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.errors import ProtocolError


def _greedy(engine: Engine, prompt: Sequence[int], n: int = 8) -> tuple[int, list[int]]:
    """(cached tokens reported at the start, the greedy tokens)."""
    cached, ids = -1, []
    for ev in engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0)):
        if isinstance(ev, Started):
            cached = ev.cached_tokens
        elif isinstance(ev, Tokens):
            ids.extend(ev.token_ids)
    return cached, ids


def _round_trip(engine: Engine, prompt: Sequence[int], block_size: int) -> tuple[list[int], list[bytes], int, list[int]]:
    """Recompute ``prompt`` on an empty cache, export its blocks as bytes, empty the cache,
    adopt the bytes and run the prompt again: (recomputed tokens, the encoded blocks, cached
    tokens of the second run, its tokens)."""
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=block_size))
    cached, first = _greedy(engine, prompt)
    assert cached == 0
    cache = engine.radix_cache
    assert cache is not None
    nodes = cache.match(prompt, touch=False).nodes
    assert len(nodes) >= 2
    blocks = engine.encode_blocks([n.hash for n in nodes])
    assert len(blocks) == len(nodes)
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=block_size))  # empty
    assert len(engine.radix_cache or ()) == 0
    adopted = engine.adopt_blocks(prompt, blocks)
    assert adopted == len(blocks) * block_size
    cached2, second = _greedy(engine, prompt)
    return first, blocks, cached2, second


# --------------------------------------------------------------------------------------------
# The simulated engine: synthetic blocks of the right size.


def test_simulated_blocks_round_trip_with_the_size_of_real_ones() -> None:
    engine = SimulatedEngine(kv_bytes_per_token=64, time_scale=0.0)
    prompt = engine.tokenize("one two three four five six seven eight nine ten " * 4)
    first, blocks, cached, second = _round_trip(engine, prompt, 4)
    assert all(len(b) == 64 * 4 == engine.encoded_block_bytes() for b in blocks)
    assert cached == min(len(blocks) * 4, (len(prompt) - 1) // 4 * 4) and cached > 0
    assert second == first
    fmt = engine.kv_format()
    assert fmt is not None and fmt.startswith("sim-kv1/64/") and fmt.endswith("/b4")
    with pytest.raises(ProtocolError):
        engine.decode_block(blocks[0][:-1], 0)
    with pytest.raises(ProtocolError):
        engine.decode_block(b"x" * len(blocks[0]), 0)


def test_adopt_of_a_run_with_a_bad_block_inserts_none_of_it() -> None:
    """All or nothing: the blocks before a bad one come from the peer that is banned for it
    (altered, perhaps, where the sampled check did not look) and must not stay cached."""
    engine = SimulatedEngine(kv_bytes_per_token=8, time_scale=0.0)
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4))
    prompt = list(range(100, 120))
    good = engine.encode_block(None)
    with pytest.raises(ProtocolError):
        engine.adopt_blocks(prompt, [good, good, b"junk", good])
    cache = engine.radix_cache
    assert cache is not None and cache.match(prompt, touch=False).tokens == 0
    assert len(cache) == 0
    # Blocks cached before stay (they are not the peer's); a good run is adopted whole.
    assert engine.adopt_blocks(prompt, [good]) == 4
    with pytest.raises(ProtocolError):
        engine.adopt_blocks(prompt, [good, good, good, b"junk"])
    assert cache.match(prompt, touch=False).tokens == 4
    assert engine.adopt_blocks(prompt, [good, good, good]) == 12
    with pytest.raises(ValueError):
        engine.adopt_blocks(prompt[:7], [good, good])


def test_encode_blocks_stops_at_the_first_hash_not_held() -> None:
    engine = SimulatedEngine(kv_bytes_per_token=8, time_scale=0.0)
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4))
    prompt = list(range(200, 217))
    _greedy(engine, prompt, 2)
    cache = engine.radix_cache
    assert cache is not None
    hashes = [n.hash for n in cache.match(prompt, touch=False).nodes]
    assert len(engine.encode_blocks(hashes)) == len(hashes) == 4
    assert len(engine.encode_blocks([hashes[0], 12345, hashes[2]])) == 1
    assert engine.encode_blocks([12345]) == []
    # A byte budget: the leading blocks that fit in it, never more.
    size = len(engine.encode_block(None))
    assert len(engine.encode_blocks(hashes, max_bytes=2 * size + size // 2)) == 2
    assert len(engine.encode_blocks(hashes, max_bytes=3 * size)) == 3
    assert engine.encode_blocks(hashes, max_bytes=size - 1) == []


# --------------------------------------------------------------------------------------------
# Transformers: raw tensor bytes behind a header.

torch = pytest.importorskip("torch")


def test_hf_blocks_round_trip_to_the_tokens_of_a_recompute(tiny_hf: Engine) -> None:
    prompt = [(i * 37 + 11) % 250 for i in range(42)]
    first, blocks, cached, second = _round_trip(tiny_hf, prompt, 4)
    assert cached == 40  # every full block of prompt[:-1]
    assert second == first
    fmt = tiny_hf.kv_format()
    assert fmt == f"hf-kv1/float32-cpu/{tiny_hf.fingerprint.hex()}/b4"
    # 2 layers x K,V x 2 heads x 4 tokens x 16 dims x 4 bytes, behind the header
    assert all(len(b) == len(blocks[0]) for b in blocks)
    assert len(blocks[0]) - 2 * 2 * 2 * 4 * 16 * 4 == 16 + 16 + 20


def test_hf_decoder_refuses_what_is_not_a_block_of_its_format(tiny_hf: Engine) -> None:
    prompt = [(i * 13 + 5) % 250 for i in range(20)]
    tiny_hf.configure_cache(PrefixHasher(tiny_hf.fingerprint, block_size=4))
    _greedy(tiny_hf, prompt, 2)
    cache = tiny_hf.radix_cache
    assert cache is not None
    block = tiny_hf.encode_blocks([cache.match(prompt, touch=False).nodes[0].hash])[0]
    seg = tiny_hf.decode_block(block, 0)
    assert seg.nbytes == 2 * 2 * 2 * 4 * 16 * 4
    assert tiny_hf.encoded_block_bytes() == len(block)
    assert torch.equal(seg.payload, cache.match(prompt, touch=False).nodes[0].payload)
    with pytest.raises(ProtocolError):
        tiny_hf.decode_block(block[:-4], 0)  # short
    with pytest.raises(ProtocolError):
        tiny_hf.decode_block(block + b"\0\0\0\0", 0)  # long
    bad_shape = bytearray(block)
    struct.pack_into("<I", bad_shape, 32, 3)  # claims 3 layers (same total: still refused)
    with pytest.raises(ProtocolError):
        tiny_hf.decode_block(bytes(bad_shape), 0)
    bad_dtype = bytearray(block)
    bad_dtype[16:32] = b"bfloat16".ljust(16, b"\0")
    with pytest.raises(ProtocolError):
        tiny_hf.decode_block(bytes(bad_dtype), 0)
    nan = bytearray(block)
    struct.pack_into("<f", nan, 52, float("nan"))
    with pytest.raises(ProtocolError):
        tiny_hf.decode_block(bytes(nan), 0)


def test_hf_decoder_refuses_every_non_finite_value_and_gives_the_block_s_scale(tiny_hf: Engine) -> None:
    """One ``aminmax`` pass decides finiteness: NaN, +inf and -inf are refused wherever they lie
    (the first value, one in the middle, the last), also beside the other kinds; a finite block
    is accepted, and its scale is exactly its largest magnitude, positive or negative."""
    prompt = [(i * 17 + 3) % 250 for i in range(20)]
    tiny_hf.configure_cache(PrefixHasher(tiny_hf.fingerprint, block_size=4))
    _greedy(tiny_hf, prompt, 2)
    cache = tiny_hf.radix_cache
    assert cache is not None
    block = tiny_hf.encode_blocks([cache.match(prompt, touch=False).nodes[0].hash])[0]
    head = len(block) - tiny_hf.decode_block(block, 0).nbytes
    values = (len(block) - head) // 4
    for bad in (float("nan"), float("inf"), float("-inf")):
        for index in (0, values // 2 + 1, values - 1):
            raw = bytearray(block)
            struct.pack_into("<f", raw, head + 4 * index, bad)
            with pytest.raises(ProtocolError, match="non-finite"):
                tiny_hf.decode_block(bytes(raw), 0)
    for pair in ((float("inf"), float("-inf")), (float("nan"), float("inf")), (float("-inf"), float("nan"))):
        raw = bytearray(block)
        struct.pack_into("<f", raw, head, pair[0])
        struct.pack_into("<f", raw, head + 4 * (values - 1), pair[1])
        with pytest.raises(ProtocolError, match="non-finite"):
            tiny_hf.decode_block(bytes(raw), 0)
    # The largest magnitude of either sign is the scale; the largest finite float32 is accepted.
    for big in (-1000.5, 1000.5, -3.4028234663852886e38):
        raw = bytearray(block)
        struct.pack_into("<f", raw, head + 4 * (values // 3), big)
        seg, scale = tiny_hf._decode_scaled(bytes(raw))  # type: ignore[attr-defined]
        assert scale == abs(big) == float(seg.payload.abs().max())
        assert tiny_hf.decode_block(bytes(raw), 0).payload.equal(seg.payload)
    seg, scale = tiny_hf._decode_scaled(block)  # type: ignore[attr-defined]
    assert bool(torch.isfinite(seg.payload).all()) and scale == float(seg.payload.abs().max()) > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_aminmax_ends_are_finite_exactly_when_every_value_is(dtype: str) -> None:
    """What the Transformers engine's ``_decode_scaled`` relies on, in every dtype it may hold
    KV in: a NaN anywhere makes an end NaN, an infinity is an end (vectorised reductions
    included: long tensors, the bad value in any lane)."""
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(5)
    for n in (1, 9, 257, 70_001):
        t = torch.randn(n, generator=gen).to(dt)
        lo, hi = torch.aminmax(t)
        assert max(-float(lo), float(hi)) == float(t.abs().max())
        for bad in (float("nan"), float("inf"), float("-inf")):
            for index in {0, n // 2, n - 1, (n * 7) // 11}:
                u = t.clone()
                u[index] = bad
                lo, hi = torch.aminmax(u)
                assert not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)))


# --------------------------------------------------------------------------------------------
# llama.cpp: saved sequence state, checked before llama.cpp reads it.


@pytest.fixture(scope="module")
def smol() -> Iterator[Engine]:
    pytest.importorskip("llama_cpp")
    from peerinfer.engine.llamacpp import LlamaCppEngine

    engine = LlamaCppEngine(threads=1, capacity_bytes=96 << 20, extra_buffers=False)
    yield engine
    engine.close()


def test_llamacpp_blocks_round_trip_to_the_tokens_of_a_recompute(smol: Engine) -> None:
    prompt = smol.tokenize(
        "The planets of the solar system, in order from the sun, are Mercury, Venus, Earth, "
        "Mars, Jupiter, Saturn, Uranus and Neptune. The largest of them is"
    )
    first, blocks, cached, second = _round_trip(smol, prompt, 16)
    assert cached == (len(prompt) - 1) // 16 * 16 > 0
    assert second == first
    fmt = smol.kv_format()
    assert fmt is not None and fmt.startswith("llamacpp-kv1/") and fmt.endswith(f"/{smol.fingerprint.hex()}/b16")


def test_llamacpp_decoder_checks_size_header_and_positions(smol: Engine) -> None:
    prompt = smol.tokenize("Once upon a time there was a small robot who liked to count the stars at night. " * 3)
    smol.configure_cache(PrefixHasher(smol.fingerprint, block_size=16))
    _greedy(smol, prompt, 2)
    cache = smol.radix_cache
    assert cache is not None
    nodes = cache.match(prompt, touch=False).nodes
    blocks = smol.encode_blocks([n.hash for n in nodes])
    assert len(blocks) >= 2
    assert smol.decode_block(blocks[1], 16).payload == blocks[1]
    with pytest.raises(ProtocolError):
        smol.decode_block(blocks[1], 0)  # saved for positions 16..31, not 0..15
    with pytest.raises(ProtocolError):
        smol.decode_block(blocks[0][:-1], 0)
    bad = bytearray(blocks[0])
    struct.pack_into("<I", bad, 0, 0)
    with pytest.raises(ProtocolError):
        smol.decode_block(bytes(bad), 0)
    two_seqs = bytearray(blocks[0])
    struct.pack_into("<I", two_seqs, 16 + 4, 2)  # first cell claims two sequences
    with pytest.raises(ProtocolError):
        smol.decode_block(bytes(two_seqs), 0)
    # The same size and cells, but the first layer's K claims another ggml type (q8_0): the
    # layers' layout is checked too, so llama.cpp never gets to refuse it in a request.
    other_type = bytearray(blocks[0])
    struct.pack_into("<i", other_type, 16 + 12 * 16 + 8, 8)
    with pytest.raises(ProtocolError):
        smol.decode_block(bytes(other_type), 0)
