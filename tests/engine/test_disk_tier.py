"""The disk tier: blocks evicted from memory spill to files, load back on a hit, survive a
restart, stay within their byte bound in LRU order, and a damaged file is a miss.

The store alone (``DiskTier``) is tested on its own; then through engines: the simulated one
(output a function of the prompt, so only hits are checked) and the tiny Transformers model,
whose greedy tokens after a disk hit must equal a recompute's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from peerinfer.core.messages import SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.engine import Finished, Started, Tokens
from peerinfer.engine.base import Engine
from peerinfer.engine.disktier import DiskTier, format_id
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.errors import ConfigError
from peerinfer.types import BlockHash

FMT = "test-kv/1/b4"


def _block_files(directory: Path, fmt: str, hash_key: bytes = b"") -> list[Path]:
    return sorted((directory / format_id(fmt, hash_key)).glob("*.kv"))


# --------------------------------------------------------------------------------------------
# The store.


def test_store_round_trip_lru_bound_and_restart(tmp_path: Path) -> None:
    payload = bytes(range(200))
    one = len(DiskTierProbe.file_bytes(tmp_path, payload))
    tier = DiskTier(tmp_path, FMT, 3 * one)
    for h in (1, 2, 3):
        assert tier.put(BlockHash(h), (h, h, h, h), payload) == []
    assert tier.get(BlockHash(1), (1, 1, 1, 1)) == payload  # 1 is now the most recent
    assert tier.put(BlockHash(4), (4, 4, 4, 4), payload) == [2]  # the LRU file goes
    assert sorted(tier.hashes()) == [1, 3, 4] and tier.nbytes == 3 * one
    assert len(_block_files(tmp_path, FMT)) == 3
    # A restart reads the index back in the same LRU order (file modification times).
    os.utime(tier._path(BlockHash(3)), ns=(1, 1))
    os.utime(tier._path(BlockHash(4)), ns=(2, 2))
    os.utime(tier._path(BlockHash(1)), ns=(3, 3))
    again = DiskTier(tmp_path, FMT, 3 * one)
    assert list(again.hashes()) == [3, 4, 1]
    assert again.get(BlockHash(4), (4, 4, 4, 4)) == payload
    assert again.put(BlockHash(5), (5, 5, 5, 5), payload) == [3]
    # A smaller bound on restart evicts down to it.
    small = DiskTier(tmp_path, FMT, one)
    assert len(small) == 1 and small.nbytes == one


class DiskTierProbe:
    @staticmethod
    def file_bytes(tmp_path: Path, payload: bytes) -> bytes:
        probe = DiskTier(tmp_path / "probe", FMT, 1 << 20)
        probe.put(BlockHash(9), (9, 9, 9, 9), payload)
        return probe._path(BlockHash(9)).read_bytes()


@pytest.mark.parametrize("where", ["magic", "checksum", "hash", "tokens", "payload", "truncate"])
def test_a_damaged_file_is_a_miss_and_is_deleted(tmp_path: Path, where: str) -> None:
    tier = DiskTier(tmp_path, FMT, 1 << 20)
    tier.put(BlockHash(7), (1, 2, 3, 4), b"kv-bytes" * 10)
    path = tier._path(BlockHash(7))
    data = bytearray(path.read_bytes())
    offset = {"magic": 0, "checksum": 8, "hash": 40, "tokens": 52, "payload": len(data) - 1}
    if where == "truncate":
        data = data[: len(data) - 5]
    else:
        data[offset[where]] ^= 0x01
    path.write_bytes(bytes(data))
    assert tier.get(BlockHash(7), (1, 2, 3, 4)) is None
    assert 7 not in tier and not path.exists()
    assert tier.statistics().damaged == 1


def test_other_tokens_under_the_same_hash_are_a_miss(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FMT, 1 << 20)
    tier.put(BlockHash(7), (1, 2, 3, 4), b"kv")
    assert tier.get(BlockHash(7), (1, 2, 3, 5)) is None
    tier.put(BlockHash(8), (1, 2, 3, 4), b"kv")
    assert tier.get(BlockHash(8), None) == b"kv"  # by hash alone (a peer's pull)


def test_too_big_or_unwritable_loses_the_block_not_the_node(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FMT, 100)
    assert tier.put(BlockHash(1), (1,), b"x" * 200) == [1]
    assert len(tier) == 0
    # A write that fails (a full or read-only disk): a directory where the block's temporary
    # file goes makes open() fail for every user, root included.
    blocker = tier._path(BlockHash(2)).with_suffix(".tmp")
    blocker.mkdir()
    assert tier.put(BlockHash(2), (1,), b"x") == [2]
    assert len(tier) == 0
    blocker.rmdir()
    assert tier.put(BlockHash(2), (1,), b"x") == []
    assert len(tier) == 1


def test_interrupted_writes_are_cleaned_and_formats_kept_apart(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FMT, 1 << 20)
    (tier.directory / "00000000000000aa.tmp").write_bytes(b"half")
    DiskTier(tmp_path, FMT, 1 << 20)
    assert not (tier.directory / "00000000000000aa.tmp").exists()
    (tier.directory / "FORMAT").write_text("another format")
    with pytest.raises(ConfigError):
        DiskTier(tmp_path, FMT, 1 << 20)
    with pytest.raises(ConfigError):
        DiskTier(tmp_path, "x", -1)


# --------------------------------------------------------------------------------------------
# Through an engine.


def _run(engine: Engine, prompt: Sequence[int], n: int = 6) -> tuple[int, list[int], Finished]:
    cached, ids, done = -1, [], None
    for ev in engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0)):
        if isinstance(ev, Started):
            cached = ev.cached_tokens
        elif isinstance(ev, Tokens):
            ids.extend(ev.token_ids)
        elif isinstance(ev, Finished):
            done = ev
    assert done is not None
    return cached, ids, done


def _sim(capacity_blocks: int) -> SimulatedEngine:
    engine = SimulatedEngine(kv_bytes_per_token=32, time_scale=0.0)
    engine.configure_cache(
        PrefixHasher(engine.fingerprint, block_size=4), capacity_bytes=capacity_blocks * 4 * 32
    )
    return engine


def test_evicted_blocks_spill_and_a_disk_hit_loads_them(tmp_path: Path) -> None:
    engine = _sim(capacity_blocks=6)
    engine.configure_disk(tmp_path, 1 << 20)
    a = list(range(100, 121))  # 5 full blocks of a[:-1]
    b = list(range(300, 321))
    assert _run(engine, a)[0] == 0
    snapshot = set(engine.cached_block_hashes())
    assert _run(engine, b)[0] == 0  # evicts most of a's blocks from memory
    cache = engine.radix_cache
    assert cache is not None and cache.match(a, touch=False).tokens < 20
    changes = engine.take_cache_changes()
    assert not (set(changes.removed) & snapshot), "a block moved to disk is still held"
    disk = engine.disk_statistics()
    assert disk is not None and disk.writes > 0
    cached, _, done = _run(engine, a)
    assert cached == 20  # every full block of a[:-1], from memory and disk
    assert engine.disk_statistics().hits > 0  # type: ignore[union-attr]
    assert not (set(done.cache_removed) & snapshot)


def test_a_damaged_block_file_is_recomputed(tmp_path: Path) -> None:
    engine = _sim(capacity_blocks=5)
    engine.configure_disk(tmp_path, 1 << 20)
    a = list(range(100, 121))
    _run(engine, a)
    _run(engine, list(range(300, 321)))
    fmt, cache = engine.kv_format(), engine.radix_cache
    assert fmt is not None and cache is not None
    files = _block_files(tmp_path, fmt, cache.hasher.key)
    assert files
    for f in files:  # damage every spilled block
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    cache = engine.radix_cache
    assert cache is not None
    in_memory = cache.match(a[:-1], touch=False).tokens
    cached, _, done = _run(engine, a)
    assert cached == in_memory < 20  # the damaged blocks were a miss, not a hit
    assert engine.disk_statistics().damaged >= 1  # type: ignore[union-attr]


def test_blocks_hashed_under_another_swarm_key_are_not_found(tmp_path: Path) -> None:
    a = list(range(100, 121))
    first = _sim(capacity_blocks=2)
    first.configure_disk(tmp_path, 1 << 20)
    _run(first, a)
    _run(first, list(range(300, 321)))
    assert first.disk_statistics().blocks > 0  # type: ignore[union-attr]
    first.close()
    # The same model and directory, another swarm key: none of those blocks is reported held.
    other = SimulatedEngine(kv_bytes_per_token=32, time_scale=0.0)
    other.configure_cache(
        PrefixHasher(other.fingerprint, key=b"another swarm", block_size=4), capacity_bytes=2 * 4 * 32
    )
    other.configure_disk(tmp_path, 1 << 20)
    assert other.disk_statistics().blocks == 0  # type: ignore[union-attr]
    assert other.cached_block_hashes() == ()
    other.close()
    # Back under the first key, they are found again.
    again = _sim(capacity_blocks=2)
    again.configure_disk(tmp_path, 1 << 20)
    assert again.disk_statistics().blocks > 0  # type: ignore[union-attr]


def test_disk_eviction_is_reported_and_bounded(tmp_path: Path) -> None:
    engine = _sim(capacity_blocks=2)
    block_file = 40 + 4 * 4 + 4 * 32  # header + 4 tokens + one block's synthetic payload
    engine.configure_disk(tmp_path, 3 * block_file)
    engine.cached_block_hashes()
    seen: set[int] = set()
    for k in range(4):
        _run(engine, list(range(100 * (k + 1), 100 * (k + 1) + 13)), 2)
        seen |= set(engine.take_cache_changes().added)
    disk = engine.disk_statistics()
    assert disk is not None and disk.bytes <= 3 * block_file and disk.evicted > 0
    cache = engine.radix_cache
    assert cache is not None
    held = set(engine.cached_block_hashes())
    assert held == set(cache.block_hashes()) | set(engine._disk.hashes())  # type: ignore[union-attr]
    assert len(held) <= 2 + 3


def test_restart_reads_the_tier_back(tmp_path: Path) -> None:
    first = _sim(capacity_blocks=64)
    first.configure_disk(tmp_path, 1 << 20)
    a = list(range(100, 121))
    _run(first, a)
    before = set(first.cached_block_hashes())
    first.close()  # everything in memory spills
    second = _sim(capacity_blocks=64)
    second.configure_disk(tmp_path, 1 << 20)
    assert set(second.cached_block_hashes()) == before
    cached, _, _ = _run(second, a)
    assert cached == 20


# --------------------------------------------------------------------------------------------
# The Transformers engine: a disk hit gives the recompute's tokens.

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    pytest.importorskip("transformers")
    from tests.engine.test_engine_hf import _make_tiny_model

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    directory = tmp_path_factory.mktemp("tiny-llama-disk")
    _make_tiny_model(directory)
    yield directory
    torch.set_num_threads(before)


def test_hf_disk_hit_after_restart_gives_the_recompute_tokens(tiny_dir: Path, tmp_path: Path) -> None:
    from peerinfer.engine.hf import TransformersEngine

    a = [(i * 37 + 11) % 250 for i in range(41)]
    b = [(i * 11 + 3) % 250 for i in range(41)]
    engine = TransformersEngine(tiny_dir, device="cpu")
    block = engine.kv_bytes_per_token * 4
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=4), capacity_bytes=12 * block)
    engine.configure_disk(tmp_path, 1 << 24)
    cold, recomputed, _ = _run(engine, a)
    assert cold == 0
    _run(engine, b)  # pushes a's blocks to disk
    cached, from_disk, _ = _run(engine, a)
    assert cached == 40 and from_disk == recomputed
    engine.close()
    again = TransformersEngine(tiny_dir, device="cpu")
    again.configure_cache(PrefixHasher(again.fingerprint, block_size=4), capacity_bytes=12 * block)
    again.configure_disk(tmp_path, 1 << 24)
    cached, after_restart, _ = _run(again, a)
    assert cached == 40 and after_restart == recomputed
    again.close()


# --------------------------------------------------------------------------------------------
# llama.cpp: saved sequence state on disk.


def test_llamacpp_disk_hit_gives_the_recompute_tokens(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from peerinfer.engine.llamacpp import LlamaCppEngine

    engine = LlamaCppEngine(threads=1, capacity_bytes=96 << 20, extra_buffers=False)
    try:
        hasher = PrefixHasher(engine.fingerprint, block_size=16)
        engine.configure_cache(hasher)
        engine.configure_disk(tmp_path, 1 << 30)
        prompt = engine.tokenize(
            "A short history of the lighthouse: the keeper climbed the stairs every evening, "
            "trimmed the wick, polished the lens and watched the ships pass in the dark. " * 2
        )
        cold, recomputed, _ = _run(engine, prompt, 8)
        assert cold == 0
        engine.configure_cache(hasher)  # memory emptied: every block spills to disk
        assert len(engine.radix_cache or ()) == 0
        assert engine.disk_statistics().blocks >= (len(prompt) - 1) // 16  # type: ignore[union-attr]
        cached, from_disk, _ = _run(engine, prompt, 8)
        assert cached == (len(prompt) - 1) // 16 * 16 > 0
        assert from_disk == recomputed
    finally:
        engine.close()


def test_the_disk_tier_shows_in_the_metrics(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    from peerinfer.http.metrics import _engine_metrics

    def values(engine: Engine) -> dict[str, float]:
        return {s.name: s.value for m in _engine_metrics(engine, None, 0, 1) for s in m.samples}

    engine = _sim(capacity_blocks=5)
    assert not any(k.startswith("peerinfer_disk") for k in values(engine))
    engine.configure_disk(tmp_path, 1 << 20)
    a = list(range(100, 121))
    _run(engine, a)
    _run(engine, list(range(300, 321)))
    _run(engine, a)
    got = values(engine)
    disk = engine.disk_statistics()
    assert disk is not None and disk.hits > 0
    assert got["peerinfer_disk_cache_bytes"] == disk.bytes > 0
    assert got["peerinfer_disk_cache_blocks"] == disk.blocks
    assert got["peerinfer_disk_cache_capacity_bytes"] == 1 << 20
    assert got["peerinfer_disk_cache_hits_total"] == disk.hits
    assert got["peerinfer_disk_cache_writes_total"] == disk.writes
    assert got["peerinfer_disk_cache_damaged_total"] == 0


def test_saving_on_stop_keeps_to_its_time_budget(tmp_path: Path) -> None:
    engine = _sim(capacity_blocks=8)
    engine.configure_disk(tmp_path, 1 << 20)
    _run(engine, list(range(100, 121)))
    assert engine.save_to_disk(budget_s=-1.0) == 0  # out of time before the first block
    held = engine.radix_cache.stats().blocks  # type: ignore[union-attr]
    assert held >= 5 and engine.save_to_disk(budget_s=60.0) == held  # every block in memory
    assert engine.save_to_disk() == 0  # all there already
