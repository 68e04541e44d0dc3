"""Gossip as gossipsub spreads it (peerinfer.sim.gossip): the mesh delivers every announcement,
the delay grows with the hops, and IHAVE/IWANT repairs what loss took."""

from __future__ import annotations

from dataclasses import replace

import pytest

from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.errors import ConfigError
from peerinfer.sim import SimConfig, Simulation, simulate
from peerinfer.sim.metrics import summarize
from peerinfer.sim.run import engine_factory, sim_requests


def mesh_config(**kw) -> SimConfig:
    base = dict(nodes=24, requests=300, rate=0.5, delay_ms="5", gossip="mesh", mesh_degree=4,
                seed=1, skew="zipf:1.0")
    base.update(kw)
    return SimConfig(**base)


def run(config: SimConfig, *, lazy: bool = True) -> dict:
    hasher, make = engine_factory(config)
    sim = Simulation(config, sim_requests(config, SimulatedEngine(costs=config.costs)), hasher,
                     make, check=True)
    assert (sim.mesh is not None) == (config.gossip == "mesh")
    if not lazy and sim.mesh is not None:
        sim.mesh.d_lazy = 0  # no IHAVE: eager push alone
    sim.run()
    return summarize(sim)


def test_without_loss_every_node_receives_every_announcement() -> None:
    summary = run(mesh_config())
    mesh = summary["mesh"]
    assert mesh["lost"] == 0 and mesh["published"] > 100
    assert mesh["coverage"] == 1.0
    assert mesh["duplicates_per_delivery"] > 0  # several mesh peers forward the same copy
    assert summary["anti_entropy"]["pulls_started"] == 0  # nothing for the pulls to repair


def test_the_delay_grows_with_the_hops() -> None:
    # A constant 5 ms link: an eager copy that took h hops arrives exactly h x 5 ms after it
    # was published, and with 24 nodes on a mesh of degree 4 most take more than one.
    mesh = run(mesh_config())["mesh"]
    by_hops = {int(h): d for h, d in mesh["delay_by_hops_s"].items()}
    assert max(by_hops) >= 3
    for h, d in by_hops.items():
        assert d == pytest.approx(0.005 * h)
    assert mesh["hops_mean"] > 1.5
    broadcast = run(replace(mesh_config(), gossip="broadcast"))
    assert "mesh" not in broadcast


def test_with_loss_lazy_repair_delivers() -> None:
    lossy = mesh_config(gossip_loss=0.25)
    eager_only = run(lossy, lazy=False)["mesh"]
    repaired = run(lossy)["mesh"]
    assert eager_only["coverage"] < 0.999
    assert repaired["repaired_by_iwant"] > 0
    assert repaired["coverage"] > eager_only["coverage"]
    assert repaired["coverage"] >= 0.999


def test_mesh_runs_with_churn_and_reports_bytes() -> None:
    cfg = mesh_config(nodes=12, crash_rate=60.0, join_rate=60.0)
    _, summary = simulate(cfg, check=True)
    assert summary["churn"]["lost"] == 0
    mesh = summary["mesh"]
    assert mesh["bytes_per_node_per_s"] > 0 and mesh["control_bytes"] > 0


def test_mesh_config_is_checked() -> None:
    with pytest.raises(ConfigError):
        SimConfig(gossip="carrier-pigeon")
    with pytest.raises(ConfigError):
        SimConfig(gossip="mesh", mesh_degree=0)
