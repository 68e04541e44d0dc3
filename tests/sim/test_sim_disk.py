"""The disk tier in the simulator (issue 24): the simulated engine spills evicted blocks to a
bounded LRU tier and reads them back on a hit at the disk's rate, blocks on disk stay
announced, and each node's load carries the tier's figures; with no tier, or one that never
fills, every run is the run without it."""

from __future__ import annotations

import pytest

from peerinfer.core.messages import SamplingParams
from peerinfer.core.node import NodeCore
from peerinfer.core.prefix import PrefixHasher
from peerinfer.engine.disktier import DEFAULT_READ_BYTES_PER_S
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.errors import ConfigError
from peerinfer.sim.config import SimConfig
from peerinfer.sim.run import simulate
from peerinfer.sim.simulator import Simulation

KV = 1_000  # bytes per token
RATE = 2e6  # bytes per second: 2,000 tokens' KV a second
PARAMS = SamplingParams(max_tokens=1)


def _engine(cache_tokens: int, disk_tokens: int) -> SimulatedEngine:
    engine = SimulatedEngine(kv_bytes_per_token=KV)
    engine.configure_cache(PrefixHasher(engine.fingerprint, block_size=16), capacity_tokens=cache_tokens)
    if disk_tokens:
        engine.configure_sim_disk(disk_tokens * KV, RATE)
    return engine


def _prompt(base: int, n: int = 161) -> list[int]:
    return [base + i for i in range(n)]  # 161 tokens: a match of 160, ten whole blocks


def test_an_evicted_prefix_comes_back_from_disk_at_the_disk_rate() -> None:
    a, b = _prompt(100), _prompt(5_000)
    without, with_disk = _engine(160, 0), _engine(160, 4096)
    for engine in (without, with_disk):
        engine.plan(a, PARAMS)
        engine.plan(b, PARAMS)  # evicts a's blocks: the memory holds ten
    cold = without.plan(a, PARAMS)
    warm = with_disk.plan(a, PARAMS)
    assert cold.cached_tokens == 0 and cold.disk_tokens == 0 and cold.disk_s == 0.0
    assert warm.cached_tokens == 160 and warm.disk_tokens == 160
    assert warm.disk_s == pytest.approx(160 * KV / RATE)
    # A read at this rate is cheaper than the prefill it replaces, and the TTFT says so.
    assert warm.ttft_s == pytest.approx(with_disk.costs.prefill_s(161, 160) + warm.disk_s)
    assert warm.ttft_s < cold.ttft_s
    # Now in memory again: the next hit reads nothing.
    again = with_disk.plan(a, PARAMS)
    assert again.cached_tokens == 160 and again.disk_tokens == 0 and again.disk_s == 0.0


def test_blocks_on_disk_stay_announced_until_the_disk_evicts_them() -> None:
    engine = _engine(160, 240)  # the disk holds fifteen blocks
    engine.cached_block_hashes()
    first = engine.plan(_prompt(100), PARAMS)
    assert len(first.cache_added) == 10
    spilled = engine.plan(_prompt(5_000), PARAMS)
    assert spilled.cache_removed == ()  # a's blocks moved to disk: no change to announce
    held = set(first.cache_added) | set(spilled.cache_added)
    assert len(held) == 20
    # A third prompt evicts b's blocks to disk, and the full disk drops five of a's (its LRU
    # ones): those, and only those, are gone.
    third = engine.plan(_prompt(9_000), PARAMS)
    assert len(third.cache_removed) == 5 and set(third.cache_removed) <= set(first.cache_added)
    disk = engine.disk_statistics()
    assert disk is not None and disk.blocks == 15 and disk.evicted == 5
    assert set(engine.cached_block_hashes()) == (held | set(third.cache_added)) - set(third.cache_removed)


def test_the_load_figure_is_the_real_nodes() -> None:
    engine = _engine(160, 4096)
    assert _engine(160, 0).disk_figure(10) is None
    engine.plan(_prompt(100), PARAMS)
    engine.plan(_prompt(5_000), PARAMS)
    # Twenty blocks announced, ten in memory: half on disk. Before any read, a token's load
    # time is the real tier's default rate, as a real node announces it.
    assert engine.disk_figure(20) == (500, int(KV / DEFAULT_READ_BYTES_PER_S * 1e9))
    engine.plan(_prompt(100), PARAMS)  # a hit on disk: now the rate read at, KV / RATE s
    assert engine.disk_figure(20) == (500, int(KV / RATE * 1e9))
    assert engine.disk_figure(0)[0] == 0  # type: ignore[index]


def test_a_disk_tier_needs_a_cache_and_a_rate() -> None:
    with pytest.raises(ConfigError):
        _engine(160, 0).configure_sim_disk(1000, 0.0)
    with pytest.raises(ConfigError):
        SimConfig(disk_cache_tokens=-1)


BASE = dict(nodes=8, requests=600, seed=5, rate=0.3)


def test_a_small_cache_with_a_disk_tier_hits_more_and_answers_sooner() -> None:
    small = dict(BASE, cache_tokens=1024)
    off_sim, off = simulate(SimConfig(**small), check=True)  # type: ignore[arg-type]
    on_sim, on = simulate(SimConfig(disk_cache_tokens=65_536, **small), check=True)  # type: ignore[arg-type]
    assert "disk" not in off and on["disk"]["tokens_read"] > 0
    assert on["hit_ratio"] >= off["hit_ratio"] + 0.1
    assert on["ttft_mean_s"] <= 0.8 * off["ttft_mean_s"]
    assert on["completed"] == off["completed"] == 600
    # Every node announces its tier's figures in its load: a share on disk, and a token's
    # load time at the 500 MB/s it read at (to a nanosecond: the rate is a sum of reads).
    for core in on_sim.cores:
        assert isinstance(core, NodeCore)
        figure = core.load().disk
        assert len(figure) == 2 and 0 < figure[0] <= 1000
        assert abs(figure[1] - 46_000 / 500e6 * 1e9) <= 1
    assert all(isinstance(c, NodeCore) and c.load().disk == () for c in off_sim.cores)


def _record(sim: Simulation) -> tuple[object, ...]:
    return (sim.server, sim.forwards, sim.decided, sim.estimate, sim.expected_cached,
            sim.cached, sim.status, sim.first, sim.finish)


def test_a_tier_that_never_fills_leaves_every_decision_unchanged() -> None:
    # An unbounded memory cache evicts nothing, so nothing spills: the announced share on disk
    # stays 0 and costs nothing in any estimate.
    roomy = dict(BASE, cache_tokens=None)
    off, _ = simulate(SimConfig(**roomy), check=True)  # type: ignore[arg-type]
    on, summary = simulate(SimConfig(disk_cache_tokens=4096, **roomy), check=True)  # type: ignore[arg-type]
    assert summary["disk"]["tokens_read"] == 0
    assert _record(on) == _record(off)
