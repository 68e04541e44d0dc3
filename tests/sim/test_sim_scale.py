"""The scaling experiment's figures: replica memory per node, CPU and peak memory of a run, and
the scaling table built from runs (docs/evaluation.md, "From 4 to 1,024 nodes")."""

from __future__ import annotations

import io
import json
import sys
from contextlib import redirect_stdout
from dataclasses import replace

import pytest

from experiments.sweeps import (
    SCALE_ALL_POLICIES_UP_TO,
    parse_scale_nodes,
    scale_configs,
    scale_rows,
    scale_table,
)
from peerinfer.core.index import PeerIndex
from peerinfer.sim import SimConfig, simulate
from peerinfer.sim.cli import main as sim_main
from peerinfer.sim.metrics import ProcessUsage, deep_size, replica_memory

SMALL = SimConfig(nodes=6, requests=60, cache_tokens=2048, delay_ms="5", policy="cost", seed=3)


def test_deep_size_counts_each_object_once_and_not_classes() -> None:
    shared = [10**30 + 1, 10**30 + 2]  # ints of 28+ bytes, not cached by CPython
    root = {1: shared, 2: shared, 3: (shared,), 4: SimConfig}
    size, count = deep_size(root)
    expected = (
        sys.getsizeof(root)
        + sum(sys.getsizeof(k) for k in root)
        + sys.getsizeof(shared)
        + sum(sys.getsizeof(x) for x in shared)
        + sys.getsizeof(root[3])
    )
    assert size == expected  # the list and its ints once, though reached three times
    assert count == 1 + 4 + 1 + 2 + 1  # dict, its 4 keys, the list, 2 ints, the tuple
    # ``stop`` leaves an instance (and what only it reaches) out
    assert deep_size([SMALL], stop=(SimConfig,))[0] == sys.getsizeof([SMALL])


def test_replica_memory_counts_every_entry_and_measures_the_replicas() -> None:
    sim, _ = simulate(SMALL)
    mem = replica_memory(sim, sample=SMALL.nodes)  # every node walked
    assert mem["nodes"] == SMALL.nodes
    assert mem["sampled_nodes"] == list(range(SMALL.nodes))
    assert mem["replicas_per_node"] == SMALL.nodes - 1  # everyone knows everyone
    by_hand = [
        sum(len(core.index.replica(p).digest) for p in core.index.peers()) for core in sim.cores
    ]
    assert mem["replica_entries_per_node"] == round(sum(by_hand) / SMALL.nodes, 1)
    assert mem["replica_entries_max"] == max(by_hand) > 0
    # What the walk measured holds at least every replica of the node with the most bytes (each
    # walked alone up to its index, without the hash ints, which replicas share), and a few tens
    # of bytes per entry at least (a set slot is 16).
    per_node = []
    for core in sim.cores:
        alone = [deep_size(core.index.replica(p), stop=(PeerIndex, int))[0] for p in core.index.peers()]
        per_node.append(sum(alone))
    assert mem["index_bytes_max"] >= max(per_node)
    assert mem["bytes_per_replica_entry"] > 16
    assert mem["index_bytes_per_node_by_type"]["set"] > 0


def test_replica_memory_grows_with_what_the_replicas_hold() -> None:
    # Caches of 8,192 tokens, so that 240 requests do not fill every replica (2,048 filled
    # within 60 requests of the full MMLU, and then both counts were equal).
    small, _ = simulate(replace(SMALL, requests=12, cache_tokens=8192))
    big, _ = simulate(replace(SMALL, requests=240, cache_tokens=8192))
    a, b = replica_memory(small), replica_memory(big)
    assert b["replica_entries_per_node"] > a["replica_entries_per_node"]
    assert b["index_bytes_per_node"] > a["index_bytes_per_node"]


def test_process_usage_sees_an_allocation() -> None:
    usage = ProcessUsage()
    block = bytearray(b"\x01") * (64 << 20)  # written, so resident
    figures = usage.figures()
    assert block[-1] == 1
    assert figures["cpu_s"] >= 0.0
    if figures["peak_rss_mb"] is None:
        pytest.skip("no resident-memory figures on this platform")
    assert figures["peak_rss_mb"] >= figures["rss_start_mb"] + (48 if usage.peak_rss_reset else 0)


def test_cli_memory_flag_adds_the_figures() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = sim_main(["--nodes", "3", "--requests", "20", "--json", "--memory"])
    assert rc == 0
    data = json.loads(out.getvalue())
    assert data["memory"]["replicas_per_node"] == 2
    assert data["usage"]["cpu_s"] >= 0.0
    assert data["anti_entropy"]["announce_bytes_per_node_per_s"] == pytest.approx(
        data["anti_entropy"]["announce_bytes"] / 3 / data["virtual_s"], abs=0.1
    )


def test_scale_configs_run_every_policy_up_to_256_nodes_and_cost_beyond() -> None:
    configs = scale_configs(SMALL, 10, nodes=(4, 256, 1024), requests_per_node_at={})
    by_nodes: dict[int, set[str]] = {}
    for c in configs:
        by_nodes.setdefault(c.nodes, set()).add(c.policy)
        assert c.requests == 10 * c.nodes
    assert by_nodes[4] == by_nodes[256] == {"local", "longest_prefix", "cost"}
    assert 1024 > SCALE_ALL_POLICIES_UP_TO and by_nodes[1024] == {"cost"}
    assert len([c for c in configs if c.nodes == 4]) == 8 * 3  # 8 seeds for 4 nodes
    nodes, at = parse_scale_nodes("4,1024:1")
    assert (nodes, at) == ([4, 1024], {1024: 1})
    sized = {c.nodes: c.requests for c in scale_configs(SMALL, 10, nodes, at)}
    assert sized == {4: 40, 1024: 1024}


def _fake_run(nodes: int, policy: str, ttft: float, announce_bytes: int, entries: float) -> dict:
    return {
        "params": {"nodes": nodes, "policy": policy, "requests": 10 * nodes},
        "latency_mean_s": ttft + 0.5, "latency_p99_s": 2 * ttft + 0.5, "ttft_mean_s": ttft,
        "ttft_p99_s": 2 * ttft, "hit_ratio": 0.5, "forwarded_fraction": 0.5, "virtual_s": 40.0,
        "anti_entropy": {"bytes_per_node_per_s": 1.0, "announce_bytes": announce_bytes},
        "memory": {"replica_entries_per_node": entries, "index_bytes_per_node": 100 * entries,
                   "bytes_per_replica_entry": 100.0},
        "usage": {"cpu_s": 2.0, "peak_rss_mb": 50.0},
    }


def test_scale_table_averages_seeds_and_rows_show_the_four_figures() -> None:
    runs = [
        _fake_run(1024, "cost", 0.2, 1024 * 40 * 1000, 1000.0),
        _fake_run(1024, "cost", 0.4, 1024 * 40 * 3000, 3000.0),
    ]
    (row,) = scale_table(runs)
    assert row["seeds"] == 2
    assert row["ttft_mean_s"] == pytest.approx(0.3)
    assert row["announce_bytes_per_node_per_s"] == pytest.approx(2000.0)  # per node per s
    assert row["replica_entries_per_node"] == pytest.approx(2000.0)
    assert row["index_bytes_per_node"] == pytest.approx(200_000.0)
    _, _, line = scale_rows([row])
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[0] == "1,024" and cells[1] == "10,240"
    assert cells[5] == "0.300 / 0.600"  # cost's TTFT; local and longest_prefix did not run
    assert cells[3] == cells[4] == "-"
    assert cells[7] == "2.0"  # kB per node per s
    assert cells[9] == "0.20"  # MB per node


def test_replica_memory_under_churn_counts_the_live_nodes_only() -> None:
    config = replace(SMALL, nodes=12, requests=300, crash_rate=16.0, join_rate=16.0, seed=1)
    sim, summary = simulate(config)
    assert summary["churn"]["crashes"] > summary["churn"]["joins"]  # fewer live than slots
    mem = replica_memory(sim)
    live = summary["churn"]  # nodes live at the end: the first ones, less crashes, plus joins
    assert mem["nodes"] == config.nodes - live["crashes"] + live["joins"]
    assert mem["replica_entries_per_node"] > 0
