"""``Engine.block_errors``: the recompute a node runs on a sample of pulled KV blocks (issue 24).

Honest blocks (exported from another run of the same engine) come out within the verifier's
tolerance; a block whose values were altered comes out far beyond it; bytes that are not a
block are refused as a protocol error, never judged.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest

from peerinfer.core.kvpull import DEFAULT_VERIFY_TOLERANCE
from peerinfer.core.messages import SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.engine.base import Engine
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.errors import EngineError, ProtocolError


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


def test_simulated_block_errors_tell_a_synthetic_block_from_an_altered_one() -> None:
    engine = SimulatedEngine(kv_bytes_per_token=8, time_scale=0.0)
    prompt = list(range(100, 121))
    blocks = _blocks_of(engine, prompt, 4)
    assert len(blocks) == 5
    altered = list(blocks)
    altered[3] = altered[3][:-1] + b"\x01"
    assert engine.block_errors(prompt, 0, blocks, [0, 3]) == [(0, 0.0), (3, 0.0)]
    errors = dict(engine.block_errors(prompt, 0, altered, [0, 3]))
    assert errors[0] == 0.0 and errors[3] > DEFAULT_VERIFY_TOLERANCE
    with pytest.raises(ProtocolError):
        engine.block_errors(prompt, 0, [b"junk"], [0])


torch = pytest.importorskip("torch")


def test_hf_block_errors_pass_honest_blocks_and_catch_altered_ones(tiny_hf: Engine) -> None:
    prompt = [5 + (i * 7) % 50 for i in range(26)]
    blocks = _blocks_of(tiny_hf, prompt, 4)
    assert len(blocks) == 6
    honest = dict(tiny_hf.block_errors(prompt, 0, blocks, [0, 2, 5]))
    assert set(honest) == {0, 2, 5}
    assert max(honest.values()) < DEFAULT_VERIFY_TOLERANCE / 100
    # Alter one value of block 2's payload (a float32 after the header) by a visible amount.
    raw = bytearray(blocks[2])
    offset = len(raw) - 4 * 10
    (value,) = struct.unpack_from("<f", raw, offset)
    struct.pack_into("<f", raw, offset, value + 5.0)
    altered = [*blocks[:2], bytes(raw), *blocks[3:]]
    errors = dict(tiny_hf.block_errors(prompt, 0, altered, [2]))
    assert errors[2] > DEFAULT_VERIFY_TOLERANCE, errors


def test_hf_block_errors_start_after_cached_blocks(tiny_hf: Engine) -> None:
    """Blocks 0..1 local, 2..5 pulled: block 3 is recomputed over two cached and one pulled."""
    prompt = [7 + (i * 11) % 50 for i in range(26)]
    blocks = _blocks_of(tiny_hf, prompt, 4)
    assert tiny_hf.adopt_blocks(prompt, blocks[:2]) == 8
    errors = dict(tiny_hf.block_errors(prompt, 2, blocks[2:], [1]))
    assert errors[1] < DEFAULT_VERIFY_TOLERANCE / 100
    tiny_hf.configure_cache(PrefixHasher(tiny_hf.fingerprint, block_size=4))  # empty
    with pytest.raises(EngineError):
        tiny_hf.block_errors(prompt, 2, blocks[2:], [1])


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


def _shift_last_value(block: bytes, by: float) -> bytes:
    """The block with its last float16 K/V value (the last layer's V) moved by ``by``."""
    np = pytest.importorskip("numpy")
    raw = bytearray(block)
    value = np.frombuffer(bytes(raw[-2:]), dtype="<f2")[0]
    raw[-2:] = np.array([float(value) + by], dtype="<f2").tobytes()
    return bytes(raw)


def test_llamacpp_block_errors_pass_honest_blocks_and_catch_altered_ones(smol: Engine) -> None:
    assert smol.verifies_kv_blocks
    prompt = _smol_prompt(smol, "rivers")
    blocks = _blocks_of(smol, prompt, 16)
    assert len(blocks) >= 5
    last = len(blocks) - 1
    honest = dict(smol.block_errors(prompt, 0, blocks, [0, 2, last]))
    assert set(honest) == {0, 2, last}
    assert max(honest.values()) < DEFAULT_VERIFY_TOLERANCE / 100, honest
    altered = list(blocks)
    altered[2] = _shift_last_value(blocks[2], 100.0)
    errors = dict(smol.block_errors(prompt, 0, altered, [1, 2]))
    assert errors[1] < DEFAULT_VERIFY_TOLERANCE / 100  # block 1 comes before the altered one
    assert errors[2] > DEFAULT_VERIFY_TOLERANCE, errors
    # Bytes that are not a block of this model's format are refused, never judged.
    with pytest.raises(ProtocolError):
        smol.block_errors(prompt, 0, [b"junk", *blocks[1:]], [0])
    with pytest.raises(ProtocolError):
        smol.block_errors(prompt, 0, [blocks[1], *blocks[1:]], [0])  # positions 16..31 at 0
    # Every sequence the checks took was given back.
    assert len(smol._free_seqs) == smol._max_sequences  # type: ignore[attr-defined]


def test_llamacpp_block_errors_start_after_cached_blocks(smol: Engine) -> None:
    """Blocks 0..1 local, 2.. pulled: block 3 is recomputed over two cached and one pulled."""
    prompt = _smol_prompt(smol, "mountains")
    blocks = _blocks_of(smol, prompt, 16)
    assert smol.adopt_blocks(prompt, blocks[:2]) == 32
    errors = dict(smol.block_errors(prompt, 2, blocks[2:], [0, 1]))
    assert max(errors.values()) < DEFAULT_VERIFY_TOLERANCE / 100, errors
    smol.configure_cache(PrefixHasher(smol.fingerprint, block_size=16))  # empty
    with pytest.raises(EngineError):
        smol.block_errors(prompt, 2, blocks[2:], [1])
