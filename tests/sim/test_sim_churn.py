"""Churn in the simulator: crashes fail over without losing a request, newcomers pull every
digest and are routed to, graceful leaves drain (peerinfer.sim.churn)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from peerinfer.core.costmodel import CostModel
from peerinfer.core.messages import SamplingParams
from peerinfer.errors import ConfigError
from peerinfer.sim import SimConfig, SimRequest, Simulation, simulate
from peerinfer.sim.run import engine_factory

#: 1 ms per uncached prompt token, 50 ms per generated token: a request runs long enough to be
#: caught in flight.
SLOW_DECODE = CostModel(
    prefill_s_per_token=0.001,
    cached_s_per_token=0.0,
    decode_s_per_token=0.05,
    overhead_s=0.0,
    slots=1,
)
EIGHT = SamplingParams(max_tokens=8)
P = tuple(range(1000, 1160))


def churn_run(config: SimConfig, prompts, arrivals, schedule) -> Simulation:
    config = replace(config, requests=len(prompts))
    hasher, make = engine_factory(config)
    requests = [SimRequest(p, EIGHT, label=str(i)) for i, p in enumerate(prompts)]
    return Simulation(
        config, requests, hasher, make, arrivals=arrivals, check=True, churn_schedule=schedule
    ).run()


def config(**kw) -> SimConfig:
    base = dict(nodes=4, delay_ms="5", costs=SLOW_DECODE, cache_tokens=None, policy="cost")
    base.update(kw)
    return SimConfig(**base)


@pytest.mark.parametrize("mode", ["reset", "silent"])
def test_a_crash_with_requests_in_flight_loses_none(mode: str) -> None:
    # Node 0 serves P first and caches it; then nodes 1-3 each get four requests for P, which
    # `cost` forwards to node 0 (a 144-token hit beats the round trip). Node 0 crashes while
    # they queue and run there: each origin must fail over (the core decides where) and serve
    # every one of them; none ends unserved.
    arrivals = [(0.1, 0)] + [(1.0 + 0.01 * k, 1 + k % 3) for k in range(12)]
    prompts = [P] * len(arrivals)
    sim = churn_run(config(crash_mode=mode), prompts, arrivals, [(1.3, "crash", 0)])
    churn = sim.churn
    assert churn is not None and churn.crashes == 1
    assert sim.status[0] == 1 and sim.server[0] == 0  # served before the crash
    caught = [i for i in range(1, len(arrivals)) if sim.forwards[i] >= 2]
    assert caught, "no request was in flight at node 0 when it crashed"
    for i in range(1, len(arrivals)):
        assert sim.status[i] == 1, f"request {i} was not served (status {sim.status[i]})"
    for i in caught:
        assert sim.server[i] != 0
        assert sim.finish[i] > 1.3
    assert sim.rejected == 0 and churn.orphaned == 0
    assert sum(sim.cores[k].statistics().failovers for k in (1, 2, 3)) >= len(caught)
    # The survivors forgot the crashed node (a failed ping, or the core's liveness).
    for k in (1, 2, 3):
        assert not sim.cores[k].is_member(sim.peer_ids[0])


def test_requests_of_a_crashed_entry_node_are_orphaned_not_lost() -> None:
    # Node 0's own users' requests in flight when it crashes die with it (their client was on
    # that machine): ended and counted apart, never served twice, never counted as lost.
    arrivals = [(0.1, 0), (0.11, 0), (0.12, 0)]
    sim = churn_run(config(), [P, P, P], arrivals, [(0.2, "crash", 0)])
    assert sim.churn is not None
    assert sim.churn.orphaned == 3 and sim.status == [3, 3, 3]
    assert sim.rejected == 0


def test_a_newcomer_pulls_every_digest_and_is_routed_to_after_it_joins() -> None:
    # Nodes 0-2 each serve a distinct prompt (their caches differ), then a newcomer joins at
    # t=2; then a burst of distinct prompts at node 0 queues there, and `cost` spreads it over
    # the idle nodes, the newcomer among them.
    distinct = [tuple(range(1_000 * (k + 1), 1_000 * (k + 1) + 160)) for k in range(24)]
    arrivals = [(0.1, 0), (0.1, 1), (0.1, 2)] + [(4.0 + 0.001 * k, 0) for k in range(21)]
    sim = churn_run(config(nodes=3), distinct, arrivals, [(2.0, "join", -1)])
    churn = sim.churn
    assert churn is not None and churn.joins == 1
    newcomer = 3
    assert churn.joined_at[newcomer] == 2.0
    # It pulled the digests the others held before it came: its replica of each holds the
    # blocks of the prompt that node served then.
    core = sim.cores[newcomer]
    for k in range(3):
        replica = core.index.replica(sim.peer_ids[k])
        assert replica is not None
        before = set(sim.hasher.chain(distinct[k])[:9])
        assert before <= set(sim.cores[k].local.digest)
        assert before <= set(replica.digest)
    assert core.statistics().syncs_converged >= 3
    # The others took it as a member and routed to it, after it joined.
    assert all(sim.cores[k].is_member(sim.peer_ids[newcomer]) for k in range(3))
    assert newcomer in churn.first_routed_at
    assert churn.first_routed_at[newcomer] >= 4.0
    assert sim.served[newcomer] >= 1
    assert all(s == 1 for s in sim.status)
    summary = churn.summary()
    assert summary["newcomers_routed_to"] == 1 and summary["lost"] == 0


def test_a_graceful_leave_drains_before_going() -> None:
    # Node 0 starts leaving while requests forwarded to it run: it finishes what it holds (no
    # failover needed for those), refuses new forwards, and goes once it holds nothing.
    arrivals = [(0.1, 0)] + [(1.0 + 0.01 * k, 1 + k % 3) for k in range(6)]
    arrivals += [(1.5 + 0.01 * k, 1 + k % 3) for k in range(6)]
    prompts = [P] * len(arrivals)
    sim = churn_run(config(), prompts, arrivals, [(1.05, "leave", 0)])
    churn = sim.churn
    assert churn is not None and churn.leaves == 1 and churn.crashes == 0
    assert all(s == 1 for s in sim.status)
    assert not any(sim.server[i] == 0 and sim.arrival[i] > 1.05 and sim.forwards[i] == 1
                   for i in range(len(arrivals)) if sim.arrival[i] > 1.2)
    assert churn.gone_at[0] >= 1.05
    assert sim.rejected == 0 and churn.orphaned == 0


@pytest.mark.parametrize("mode", ["reset", "silent"])
def test_random_churn_loses_no_request(mode: str) -> None:
    # A shorter stand-in for the target (64 nodes at 1 crash per node-hour: bench/sim_bench.py
    # --churn): 12 nodes, far more churn per node, crashes, leaves and joins together.
    cfg = SimConfig(
        nodes=12, requests=600, rate=0.5, crash_rate=40.0, leave_rate=20.0, join_rate=60.0,
        crash_mode=mode, seed=3, workload="mmlu", skew="zipf:1.0",
    )
    sim, summary = simulate(cfg, check=True)
    churn = summary["churn"]
    assert churn["crashes"] >= 3 and churn["joins"] >= 3 and churn["leaves"] >= 1
    assert churn["lost"] == 0
    assert summary["completed"] + churn["orphaned"] == cfg.requests
    assert summary["failovers"] >= 1
    assert churn["newcomers_routed_to"] >= 1


def test_churn_is_deterministic_and_off_by_default() -> None:
    cfg = SimConfig(nodes=6, requests=200, rate=0.5, crash_rate=60.0, join_rate=60.0, seed=2)
    a = simulate(cfg)[1]
    b = simulate(cfg)[1]
    for s in (a, b):
        for k in ("wall_s", "setup_s", "loop_s", "requests_per_wall_s"):
            s.pop(k)
    assert a == b
    plain = simulate(replace(cfg, crash_rate=0.0, join_rate=0.0))[1]
    assert "churn" not in plain


def test_churn_config_is_checked() -> None:
    with pytest.raises(ConfigError):
        SimConfig(crash_rate=-1.0)
    with pytest.raises(ConfigError):
        SimConfig(crash_mode="meteor")
    with pytest.raises(ConfigError):
        SimConfig(crash_rate=1.0, clients=4)


def test_the_churn_model_keeps_the_real_nodes_shutdown_grace() -> None:
    # The simulator may not import the node (it loads libp2p), so churn copies the node's
    # shutdown grace; this keeps the copy from drifting away from what the node does.
    from peerinfer.node.options import SHUTDOWN_GRACE_S
    from peerinfer.sim.churn import LEAVE_GRACE_S

    assert LEAVE_GRACE_S == SHUTDOWN_GRACE_S
