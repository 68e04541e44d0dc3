"""Lazy announcement application decides exactly as eager application (issue 14, item 1).

A node keeps announcements that change nothing but a peer's epoch, load and freshness and takes
them in when that peer's state is next read (``NodeCore._defer_unchanged``). These tests run
the same simulations twice, once with ``lazy_announcements=False`` (every announcement taken in
at once), and require the same per-request decisions and outcomes, to the bit.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest

import peerinfer
from peerinfer.core import antientropy, node
from peerinfer.sim import SimConfig, simulate
from peerinfer.sim import simulator as sim_module


def _random_config(seed: int) -> SimConfig:
    rng = random.Random(f"lazy-equivalence:{seed}")
    return SimConfig(
        nodes=rng.randint(3, 10),
        requests=rng.randint(60, 140),
        policy=rng.choice(["cost", "cost", "longest_prefix", "least_loaded", "random"]),
        delay_ms=rng.choice(["5", "uniform:1:30", "lognormal:10:0.5"]),
        cache_tokens=rng.choice([2048, 4096, 8192]),  # small caches evict: deltas both ways
        skew=rng.choice(["zipf:1.0", "zipf:1.1", "hot:2"]),
        rate=rng.choice([0.25, 0.5, 1.0]),
        gossip_loss=rng.choice([0.0, 0.0, 0.1, 0.3]),  # lost deliveries: replicas behind, pulls
        announce_interval_s=rng.choice([0.5, 1.0]),
        seed=seed,
    )


def _decisions(sim: sim_module.Simulation) -> dict[str, object]:
    return {
        "server": sim.server,
        "forwards": sim.forwards,
        "decided": sim.decided,
        "estimate": sim.estimate,
        "expected_cached": sim.expected_cached,
        "cached": sim.cached,
        "status": sim.status,
        "first": sim.first,
        "finish": sim.finish,
        "pulls": sim.pull_requests,
        "pull_bytes": sim.pull_response_bytes,
        "stats": [c.statistics() for c in sim.cores],
        "loads": [[(p, c.index.load(p), c.index.digest_age(p, sim.now)) for p in c.index.peers()]
                  for c in sim.cores],
        # Each replica's own state as well, what only later pulls would show (their sizing).
        "replicas": [[_replica_state(c, p) for p in c.index.peers()] for c in sim.cores],
    }


def _replica_state(core: node.NodeCore, peer: object) -> tuple[object, ...]:
    r = core.index.replica(peer)  # type: ignore[arg-type]
    assert r is not None
    return (r.epoch, r.root, r.count, r.refused, r._rate, r._announced)


def _run(config: SimConfig, lazy: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    with monkeypatch.context() as m:
        m.setattr(sim_module, "NodeConfig",
                  functools.partial(node.NodeConfig, lazy_announcements=lazy))
        sim, _ = simulate(config, check=True)
    return _decisions(sim)


def test_lazy_gives_the_eager_decisions_on_20_random_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    deferred = 0
    original = antientropy.Replica.take_unchanged

    def counting(self: antientropy.Replica, times: int, *args: int) -> None:
        nonlocal deferred
        deferred += times
        original(self, times, *args)

    monkeypatch.setattr(antientropy.Replica, "take_unchanged", counting)
    for seed in range(20):
        config = _random_config(seed)
        eager = _run(config, False, monkeypatch)
        lazy = _run(config, True, monkeypatch)
        for key in eager:
            assert lazy[key] == eager[key], f"seed {seed} ({config}): {key} differs"
    # Not vacuous: most announcements change nothing, and those were kept for later.
    assert deferred > 1000


def test_lazy_nodes_keep_most_announcements_for_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """Most deliveries change nothing and wait; each wait ends in one take-in of many."""
    # The packaged excerpt, whatever ../shared holds: how often an index is read between two
    # announcements depends on the prompts.
    excerpt = str(Path(peerinfer.__file__).parent / "data" / "mmlu_excerpt.json")
    config = SimConfig(nodes=16, requests=300, seed=3, data=excerpt)
    taken_in: list[int] = []
    original = antientropy.Replica.take_unchanged

    def counting(self: antientropy.Replica, times: int, *args: int) -> None:
        taken_in.append(times)
        original(self, times, *args)

    monkeypatch.setattr(antientropy.Replica, "take_unchanged", counting)
    sim, _ = simulate(config)
    waiting = sum(k.times for c in sim.cores for k in c._unapplied.values())
    kept = sum(taken_in) + waiting
    assert kept > 0.6 * sim.announce_deliveries
    assert kept > 2 * len(taken_in)  # several announcements per take-in, on average
