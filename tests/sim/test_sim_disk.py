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


# --------------------------------------------------------------------------------------------
# A warm restart: a machine that went away comes back with its disk tier (churn).


def test_a_restarted_engine_keeps_its_disk_tier_and_loses_its_memory() -> None:
    a, b = _prompt(100), _prompt(5_000)
    for saved in (False, True):
        engine = _engine(160, 4096)
        engine.cached_block_hashes()
        engine.plan(a, PARAMS)
        engine.plan(b, PARAMS)  # a's blocks spill to disk; b's stay in memory
        cache, disk = engine.radix_cache, engine.disk_tier
        assert cache is not None and disk is not None
        chain_a, chain_b = (engine.radix_cache.hasher.chain(p[:160]) for p in (a, b))  # type: ignore[union-attr]
        engine.restart(saved=saved)
        assert len(cache) == 0  # the memory is lost
        # A crash keeps what had spilled; a graceful stop saved its memory first.
        held = set(chain_a) | (set(chain_b) if saved else set())
        assert set(disk.hashes()) == held
        assert set(engine.cached_block_hashes()) == held
        assert engine.take_cache_changes().added == ()  # the snapshot is where it starts
        warm = engine.plan(a, PARAMS)
        assert warm.cached_tokens == warm.disk_tokens == 160
        assert engine.plan(b, PARAMS).disk_tokens == (160 if saved else 0)


def _restart_run(disk_tokens: int, stop: str) -> Simulation:
    """Node 0 serves prompt A, then B (A's blocks spill to its disk tier when there is one);
    it goes away at t=1 (``stop``: crash or leave) and a machine joins at t=2; then node 0's
    users ask for A and B again (t=3 and 3.5), and node 1's for A (t=4)."""
    from peerinfer.core.costmodel import CostModel
    from peerinfer.sim.inputs import SimRequest
    from peerinfer.sim.run import engine_factory

    costs = CostModel(prefill_s_per_token=0.001, cached_s_per_token=0.0, decode_s_per_token=0.05,
                      overhead_s=0.0, slots=1)
    config = SimConfig(nodes=3, delay_ms="5", costs=costs, cache_tokens=160, policy="cost",
                       kv_bytes_per_token=KV, disk_cache_tokens=disk_tokens,
                       disk_read_mb_s=RATE / 1e6, requests=5)
    a, b = tuple(_prompt(100)), tuple(_prompt(5_000))
    hasher, make = engine_factory(config)
    requests = [SimRequest(p, PARAMS, label=str(i)) for i, p in enumerate((a, b, a, b, a))]
    arrivals = [(0.1, 0), (0.5, 0), (3.0, 0), (3.5, 0), (4.0, 1)]
    schedule = [(1.0, stop, 0), (2.0, "join", -1)]
    return _Watched(config, requests, hasher, make, arrivals=arrivals, check=True,
                    churn_schedule=schedule).run()


class _Watched(Simulation):
    """Records the last epoch of a node's core when its machine stops, and what a restarted
    node's core holds just after it came back."""

    restarted: dict[int, tuple[set[object], int]]
    stopped_epoch: dict[int, int]

    def stop_engine(self, n: int) -> None:
        core = self.cores[n]
        assert isinstance(core, NodeCore)
        self.stopped_epoch = {n: core.local.epoch}
        super().stop_engine(n)

    def restart_engine(self, n: int, now: float, saved: bool) -> None:
        super().restart_engine(n, now, saved)
        core = self.cores[n]
        assert isinstance(core, NodeCore)
        self.restarted = {n: (set(core.local.digest), core.local.epoch)}


@pytest.mark.parametrize("stop", ["crash", "leave"])
def test_a_node_that_comes_back_announces_and_hits_its_disk_tier(stop: str) -> None:
    sim = _restart_run(4096, stop)
    assert isinstance(sim, _Watched)
    churn = sim.churn
    assert churn is not None and churn.restarts == 1 and churn.joins == 0
    assert churn.restarted_at == {0: [2.0]} and churn.live(0) and not churn.live(3)
    chain_a, chain_b = (set(sim.hasher.chain(_prompt(base)[:160])) for base in (100, 5_000))
    core = sim.cores[0]
    assert isinstance(core, NodeCore)
    # Its digest is its disk tier's: A (spilled before it went); B only where a graceful stop
    # saved its memory. A crash lost B's blocks with the memory.
    saved = stop == "leave"
    digest, epoch = sim.restarted[0]
    assert digest == chain_a | (chain_b if saved else set())
    # Its users' requests hit its disk: A read back from disk; B too after a graceful stop.
    assert sim.status == [1] * 5
    assert sim.server[2] == 0 and sim.cached[2] == 160 and sim.disk_tokens[2] == 160
    assert sim.server[3] == 0 and sim.disk_tokens[3] == (160 if saved else 0)
    # Its epochs went on above its earlier ones, so the others took its new digest in.
    # (as the runtime's epoch base does: the others may still hold its earlier digest)
    assert epoch > sim.stopped_epoch[0] > 0 and core.local.epoch > epoch
    assert chain_a | chain_b <= set(core.local.digest)  # B served again after it came back
    replica = sim.cores[1].index.replica(sim.peer_ids[0])  # type: ignore[union-attr]
    assert replica is not None and set(replica.digest) == set(core.local.digest)
    # And node 1 sends its user's A to node 0, which holds it.
    assert sim.server[4] == 0 and sim.cached[4] == 160
    assert churn.summary()["restarts"] == 1
    # Its counters are summed over both of its cores (the first took requests 0 and 1).
    assert churn.statistics(0).requests == core.statistics().requests + 2
    assert churn.statistics(1) == sim.cores[1].statistics()


def test_without_a_disk_tier_a_join_is_a_newcomer() -> None:
    sim = _restart_run(0, "crash")
    churn = sim.churn
    assert churn is not None and churn.joins == 1 and churn.restarts == 0
    assert churn.joined_at == {3: 2.0} and not churn.up(0)
    assert "restarts" not in churn.summary()
    assert sim.cached[2] == 0  # node 0's users went elsewhere: nothing of A there


@pytest.mark.parametrize("gossip", ["broadcast", "mesh"])
def test_random_churn_with_a_disk_tier_restarts_nodes_whose_digest_is_their_engine_s(gossip: str) -> None:
    config = SimConfig(nodes=8, requests=600, cache_tokens=1024, delay_ms="5", policy="cost", seed=2,
                       crash_rate=40, leave_rate=40, join_rate=80, disk_cache_tokens=65_536,
                       gossip=gossip)
    sim, summary = simulate(config, check=True)
    churn = sim.churn
    assert churn is not None and churn.restarts >= 3 and summary["churn"]["lost"] == 0
    restarted = [k for k in churn.restarted_at if churn.live(k)]
    assert restarted
    for k in restarted:
        core = sim.cores[k]
        assert isinstance(core, NodeCore)
        engine = sim.engines[k].engine  # type: ignore[attr-defined]
        # What it announces is what its engine holds, memory and disk (nothing pending).
        assert set(core.local.digest) == set(engine.cached_block_hashes())
    assert summary["disk"]["tokens_read"] > 0
