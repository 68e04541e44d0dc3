"""The simulator: determinism, conservation, the core's rules in virtual time, hand-worked cases."""

from __future__ import annotations

import io
import json
import math
import random
from contextlib import redirect_stdout
from dataclasses import replace

import pytest

from peerinfer.core.costmodel import CostModel
from peerinfer.core.messages import SamplingParams
from peerinfer.errors import ConfigError
from peerinfer.sim import DelayModel, SimConfig, SimRequest, Simulation, simulate
from peerinfer.sim.cli import main as sim_main
from peerinfer.sim.metrics import percentile, specialization, subject_shares
from peerinfer.sim.run import engine_factory

#: Easy arithmetic: 1 ms per uncached prompt token, everything else free.
MS_PER_TOKEN = CostModel(
    prefill_s_per_token=0.001,
    cached_s_per_token=0.0,
    decode_s_per_token=0.0,
    overhead_s=0.0,
    slots=1,
)
ONE = SamplingParams(max_tokens=1)
#: Two unrelated prompts of 160 tokens (10 blocks of 16).
P = tuple(range(1000, 1160))
Q = tuple(range(5000, 5160))
WALL_KEYS = ("wall_s", "setup_s", "loop_s", "requests_per_wall_s")


def run_by_hand(config: SimConfig, prompts, arrivals) -> Simulation:
    """Run ``prompts`` (token tuples) arriving at ``arrivals`` [(time, node)], invariants checked."""
    config = replace(config, requests=len(prompts))
    hasher, make = engine_factory(config)
    requests = [SimRequest(p, ONE, label=str(i)) for i, p in enumerate(prompts)]
    return Simulation(config, requests, hasher, make, arrivals=arrivals, check=True).run()


def hand_config(**kw) -> SimConfig:
    base = dict(nodes=2, delay_ms="0", costs=MS_PER_TOKEN, cache_tokens=None, policy="cost")
    base.update(kw)
    return SimConfig(**base)


def without_wall(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in WALL_KEYS}


# ------------------------------------------------------------------------- hand-worked cases


def test_repeated_prefix_is_a_hit_on_the_node_that_served_it_first() -> None:
    # longest_prefix breaks the first request's tie (nothing cached anywhere) at random; wherever
    # it went, the second request, arriving at the other node later, must follow it and hit.
    for seed in range(4):
        for first_at in (0, 1):
            sim = run_by_hand(
                hand_config(policy="longest_prefix", seed=seed),
                [P, P],
                [(0.1, first_at), (2.0, 1 - first_at)],
            )
            assert sim.server[1] == sim.server[0]
            assert sim.cached[0] == 0
            # the last prompt token is never cached: 159 tokens -> 9 whole blocks
            assert sim.cached[1] == 144
            assert sim.status == [1, 1]


def test_forwarded_hit_timing_by_hand() -> None:
    # cost policy: request 0 has no cached prefix anywhere -> served where it arrives (node 0),
    # 160 ms. Request 1 arrives at node 1 at t=2: forwarding costs 2 x 10 ms but saves 144 ms.
    sim = run_by_hand(hand_config(delay_ms="10"), [P, P], [(0.1, 0), (2.0, 1)])
    assert sim.server == [0, 0]
    assert sim.first[0] - sim.arrival[0] == pytest.approx(0.160)
    assert sim.first[1] - sim.arrival[1] == pytest.approx(0.010 + 0.016 + 0.010)
    assert sim.finish[1] - sim.arrival[1] == pytest.approx(0.036)
    assert sim.cores[1].statistics().forwarded == 1
    # A per-forward overhead (a real node opens a stream) delays the forwarded request only.
    sim = run_by_hand(
        hand_config(delay_ms="10", forward_overhead_ms=15), [P, P], [(0.1, 0), (2.0, 1)]
    )
    assert sim.server == [0, 0]
    assert sim.first[0] - sim.arrival[0] == pytest.approx(0.160)
    assert sim.first[1] - sim.arrival[1] == pytest.approx(0.010 + 0.015 + 0.016 + 0.010)


def test_local_policy_never_forwards() -> None:
    sim, summary = simulate(SimConfig(nodes=4, requests=300, policy="local", rate=2.0, seed=3))
    assert summary["forwards"] == 0
    assert summary["forwarded_fraction"] == 0
    assert all(sim.server[i] == sim.origin[i] for i in range(sim.total))
    assert summary["completed"] == 300


def test_busy_peer_rejection_fails_over_to_the_origin() -> None:
    # Node 1 caches P first. Then three requests for P reach node 0 at once: longest_prefix
    # sends them to node 1, which admits one and refuses the others as busy (max_queue=0);
    # node 0 fails over and serves them itself.
    sim = run_by_hand(
        hand_config(policy="longest_prefix", max_queue=0, delay_ms="1"),
        [P, P, P, P],
        [(0.0, 1), (1.0, 0), (1.0001, 0), (1.0002, 0)],
    )
    assert sim.server[0] == 1
    assert sim.server[1] == 1  # admitted on the holder
    assert sim.cores[1].statistics().rejected >= 1
    assert sim.cores[0].statistics().failovers >= 1
    assert 0 in sim.server[2:]
    assert sim.status == [1, 1, 1, 1]


def test_a_herd_on_one_holder_is_cut_at_the_queue_its_origins_assumed() -> None:
    # Node 1 caches P. At t=1 three nodes get P at once; each sees node 1 idle and forwards
    # there (cost). With 0.1 s of overhead per request the policy's mean service time is
    # 0.1 + prefill(160, 80) = 0.18 s; serving locally costs 0.158 s of prefill more than at
    # the holder (2 tokens uncached), so a forward holds while at most floor(0.158 / 0.18 + 0.5)
    # = 1 request is outstanding there: the holder takes two and refuses the third (it would
    # have waited about 0.2 s), which its origin serves.
    costs = replace(MS_PER_TOKEN, overhead_s=0.1)
    sim = run_by_hand(
        hand_config(nodes=4, delay_ms="1", costs=costs),
        [P, P, P, P],
        [(0.0, 1), (1.0, 0), (1.0, 2), (1.0, 3)],
    )
    assert sim.forwards[1:] == [1, 1, 1]
    assert sim.server == [1, 1, 1, 3]
    assert sim.cores[1].statistics().rejected_over_limit == 1
    assert sim.cores[3].statistics().failovers == 1
    assert sim.status == [1, 1, 1, 1]


def test_peer_that_evicted_meanwhile_serves_a_miss_not_an_error() -> None:
    # Capacity: one prompt. Node 1 caches P and announces it (t=5, the minimum gap); it then
    # serves Q, which evicts P, but the eviction is not announced before t=10. Node 0 routes P
    # to node 1 at t=7 on its replica's word: node 1 serves it cold, and that is all.
    config = hand_config(
        delay_ms="1", cache_tokens=160, announce_interval_s=10.0, min_announce_gap_s=5.0
    )
    sim = run_by_hand(config, [P, Q, P], [(0.1, 1), (5.5, 1), (7.0, 0)])
    assert sim.server == [1, 1, 1]
    assert sim.cached == [0, 0, 0]  # the forwarded request found nothing: a miss
    assert sim.status == [1, 1, 1]
    assert sim.first[2] - sim.arrival[2] == pytest.approx(0.001 + 0.160 + 0.001)


def test_closed_loop_clients_never_have_more_in_flight_than_clients() -> None:
    sim, summary = simulate(
        SimConfig(nodes=3, requests=200, clients=4, think_s=0.05, seed=1), check=True
    )
    assert summary["completed"] == 200
    edges = sorted([(sim.arrival[i], 1) for i in range(200)] + [(sim.finish[i], -1) for i in range(200)])
    in_flight = peak = 0
    for _, step in edges:
        in_flight += step
        peak = max(peak, in_flight)
    assert peak <= 4
    # client c is attached to node c % nodes
    assert set(sim.origin) == {0, 1, 2}


# ------------------------------------------------------------------------- whole runs


def test_same_seed_same_result_and_another_seed_differs() -> None:
    config = SimConfig(nodes=4, requests=250, delay_ms="uniform:1:20", skew="zipf:1.2", seed=7)
    _, a = simulate(config, series=2)
    _, b = simulate(config, series=2)
    assert json.dumps(without_wall(a), sort_keys=True) == json.dumps(without_wall(b), sort_keys=True)
    _, c = simulate(replace(config, seed=8))
    assert without_wall(c) != without_wall(a)


@pytest.mark.parametrize("policy", ["cost", "longest_prefix", "random", "least_loaded"])
def test_every_request_completes_exactly_once_under_overload_and_timeouts(policy: str) -> None:
    # Overloaded nodes, a short first-token budget and small admission queues: forwards time
    # out, are cancelled and fail over; peers refuse as busy. Nothing may be lost or doubled
    # (Simulation raises if a request completes twice; check=True verifies the rest).
    config = SimConfig(
        nodes=4,
        requests=250,
        policy=policy,
        rate=2.0,
        delay_ms="uniform:1:30",
        first_token_timeout_s=1.0,
        max_queue=1,
        cache_tokens=4096,
        seed=11,
    )
    sim, summary = simulate(config, check=True)
    assert summary["completed"] + summary["rejected"] == 250
    assert all(s in (1, 2) for s in sim.status)
    served = [i for i in range(sim.total) if sim.status[i] == 1]
    assert all(sim.server[i] >= 0 and sim.first[i] <= sim.finish[i] for i in served)
    assert all(sim.first[i] >= sim.arrival[i] for i in served)
    # a forwarded request is never forwarded again, and attempts are bounded
    assert max(sim.forwards) <= sim.cores[0].config.max_forward_attempts
    if policy != "least_loaded":
        assert summary["failovers"] > 0


def test_gossip_loss_is_repaired_by_pulls() -> None:
    config = SimConfig(nodes=4, requests=300, gossip_loss=0.3, rate=2.0, seed=5)
    _, summary = simulate(config, check=True)
    ae = summary["anti_entropy"]
    assert ae["announces_lost"] > 0
    assert ae["pulls_started"] > 0
    assert ae["pulls_converged"] > 0
    assert ae["pull_bytes"] > 0
    assert summary["sync_bytes"] == ae["announce_bytes"] + ae["pull_bytes"]


def test_routing_beats_no_routing_on_a_skewed_workload_at_low_delay() -> None:
    common = dict(nodes=6, requests=600, delay_ms="1", skew="zipf:1.2", seed=2)
    _, local = simulate(SimConfig(policy="local", **common))
    _, routed = simulate(SimConfig(policy="longest_prefix", **common))
    assert routed["hit_ratio"] > local["hit_ratio"]
    assert routed["latency_mean_s"] < local["latency_mean_s"]


def test_multiturn_workload_runs_and_a_conversation_keeps_its_entry_node() -> None:
    sim, summary = simulate(
        SimConfig(nodes=3, requests=150, workload="multiturn", seed=4), check=True
    )
    assert summary["completed"] == 150
    assert summary["hit_ratio"] > 0
    entry: dict[str, set[int]] = {}
    for i in range(sim.total):
        entry.setdefault(sim.workload[i].label, set()).add(sim.origin[i])
    assert all(len(nodes) == 1 for nodes in entry.values())
    assert len(set().union(*entry.values())) == 3


def test_workload_file(tmp_path) -> None:
    from peerinfer.workload import multiturn_workload, save_workload

    path = tmp_path / "w.jsonl"
    save_workload(multiturn_workload(40, conversations=4, turns=3, seed=0), path)
    _, summary = simulate(SimConfig(nodes=2, requests=60, workload=str(path)), check=True)
    assert summary["completed"] == 60  # a shorter file is cycled


# ------------------------------------------------------------------------- the command line


def test_cli_json_has_the_documented_keys() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = sim_main(["--nodes", "2", "--requests", "30", "--seed", "9", "--json", "--check"])
    assert rc == 0
    data = json.loads(out.getvalue())
    for key in (
        "ttft_mean_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "latency_mean_s",
        "latency_p99_s",
        "hit_ratio",
        "sync_bytes",
        "requests",
        "wall_s",
        "params",
    ):
        assert key in data
    assert data["params"]["seed"] == 9
    assert data["params"]["nodes"] == 2
    assert SimConfig.from_dict(data["params"]) == SimConfig(nodes=2, requests=30, seed=9)


def test_python_dash_m_runs_standalone() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "peerinfer.sim", "--nodes", "2", "--requests", "5", "--json"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["completed"] == 5


def test_peerinfer_sim_program_ends_with_its_output_and_status(tmp_path) -> None:
    """``peerinfer sim`` ends without the interpreter's teardown (``exit_skipping_teardown``):
    what it printed to a pipe (block-buffered) and the figures it wrote are complete, and an
    error still exits 2 with its one line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    # (a pipe is block-buffered unless PYTHONUNBUFFERED says otherwise: the case to check)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    base = [sys.executable, "-m", "peerinfer", "sim", "--nodes", "3", "--requests", "40"]
    done = subprocess.run([*base, "--json", "--figures", str(tmp_path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["completed"] == 40
    assert summary["figures"] and all(
        Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and Path(p).read_bytes()[-8:-4] == b"IEND"
        for p in summary["figures"]
    )
    bad = subprocess.run([*base, "--skew", "zipf:-1"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "zipf" in bad.stderr and "Traceback" not in bad.stderr


def test_cli_reports_bad_options() -> None:
    assert sim_main(["--nodes", "2", "--requests", "5", "--delay-ms", "gauss:1"]) == 2
    assert sim_main(["--nodes", "2", "--requests", "5", "--skew", "zipf:-1"]) == 2


def test_cli_figures(tmp_path) -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = sim_main(["--nodes", "3", "--requests", "80", "--figures", str(tmp_path)])
    assert rc == 0
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert "latency_cdf.png" in pngs and "node_load.png" in pngs
    assert any(name.startswith("share_") for name in pngs)
    assert all((tmp_path / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in pngs)


# ------------------------------------------------------------------------- pieces


def test_delay_specs() -> None:
    rng = random.Random(0)
    assert DelayModel.parse("5").matrix_s(3, rng) == [[0, 0.005, 0.005], [0.005, 0, 0.005],
                                                      [0.005, 0.005, 0]]
    m = DelayModel.parse("uniform:2:20").matrix_s(6, rng)
    off = [m[i][j] for i in range(6) for j in range(6) if i != j]
    assert all(0.002 <= d <= 0.020 for d in off)
    assert all(m[i][j] == m[j][i] for i in range(6) for j in range(6))
    assert len(set(off)) > 1
    assert all(d > 0 for d in DelayModel.parse("lognormal:10:0.5").matrix_s(4, rng)[0][1:])
    assert DelayModel.parse("exp:3").spec() == "exp:3"
    for bad in ("", "-1", "uniform:5:1", "uniform:1", "gauss:1:2", "lognormal:x:1", "nan"):
        with pytest.raises(ConfigError):
            DelayModel.parse(bad)


def test_percentile_matches_linear_interpolation() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    assert math.isnan(percentile([], 50))


def test_subject_shares_by_hand() -> None:
    labels = ["a", "b", "a", "a", "b", "a"]
    servers = [0, 1, 0, 1, 1, 1]
    ends, shares = subject_shares(labels, servers, 2, "a", window=4, stride=2)
    # windows [0,4): a served by 0,0,1 -> 2/3, 1/3 ; [2,6): a by 0,1,1 -> 1/3, 2/3
    assert ends == [4, 6]
    assert shares[0] == pytest.approx([2 / 3, 1 / 3])
    assert shares[1] == pytest.approx([1 / 3, 2 / 3])
    spec = specialization(shares)
    assert spec["leader_changes"] == 1
    assert spec["top_share_mean"] == pytest.approx(2 / 3, abs=1e-4)


def test_config_validation() -> None:
    with pytest.raises(ConfigError):
        SimConfig(nodes=0)
    with pytest.raises(ConfigError):
        SimConfig(policy="nearest")
    with pytest.raises(ConfigError):
        SimConfig(rate=0)
    with pytest.raises(ConfigError):
        SimConfig(gossip_loss=1.0)


def test_node_config_is_the_runs_figures_over_the_nodes_own_defaults() -> None:
    from dataclasses import fields

    from peerinfer.core.node import NodeConfig
    from peerinfer.sim.config import peer_name
    from peerinfer.sim.mix import node_costs
    from peerinfer.types import PeerId

    node_default = NodeConfig(peer_id=PeerId("any"))
    carried = ("announce_interval_s", "min_announce_gap_s", "sync_timeout_s",
               "first_token_timeout_s", "max_queue")
    # A run that says nothing tunes its nodes as a real node is tuned.
    for name in carried:
        assert getattr(SimConfig(), name) == getattr(node_default, name), name
    run = SimConfig(announce_interval_s=2.5, min_announce_gap_s=0.5, sync_timeout_s=7.0,
                    first_token_timeout_s=11.0, max_queue=3, policy="oracle",
                    mix="gpu:0.5,default:0.5", nodes=4)
    made = run.node_config(3, slots=5000)
    for name in carried:
        assert getattr(made, name) == getattr(run, name), name
    assert made.peer_id == peer_name(3)
    assert made.policy == "cost"  # the oracle's own core runs cost; the simulator swaps it
    assert made.costs == node_costs(run, 3)
    assert {node_costs(run, i) for i in range(4)} == {run.node_config(i).costs for i in range(4)}
    assert made.max_peers == 5000 and run.node_config(0).max_peers == node_default.max_peers
    # Every field the run does not set is the node's own default.
    set_by_run = {*carried, "peer_id", "policy", "costs", "max_peers"}
    for f in fields(NodeConfig):
        if f.name not in set_by_run:
            assert getattr(made, f.name) == getattr(node_default, f.name), f.name
    overridden = run.node_config(0, lazy_announcements=False, max_queue=1)
    assert overridden.lazy_announcements is False and overridden.max_queue == 1


def test_churn_and_the_mesh_use_only_what_the_kernel_declares() -> None:
    """Churn and the gossipsub mesh extend a run through ``SimKernel`` (sim/kernel.py): they
    never import the simulator, and every name they use of the run they are handed is one the
    kernel declares (no private names of the simulation)."""
    import ast
    import typing
    from pathlib import Path

    from peerinfer.sim import churn, gossip
    from peerinfer.sim.kernel import SimKernel

    declared = set(typing.get_type_hints(SimKernel)) | {n for n in dir(SimKernel) if not n.startswith("_")}

    def is_the_run(node: ast.expr) -> bool:  # ``sim`` or ``self.sim``
        return (isinstance(node, ast.Name) and node.id == "sim") or (
            isinstance(node, ast.Attribute) and node.attr == "sim"
        )

    for module in (churn, gossip):
        tree = ast.parse(Path(module.__file__ or "").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "peerinfer.sim.simulator" not in imported, module.__name__
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and is_the_run(n.value)}
        assert used, module.__name__
        assert used <= declared, (module.__name__, sorted(used - declared))
