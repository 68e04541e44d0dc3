"""The experiments of issue 14 (parts 2-4): churn, mixed machines, gossip mesh against broadcast.

Run through ``python -m experiments churn|mix|mesh`` (registered in ``experiments.__main__``): each
writes ``DIR/NAME.json`` (every run's parameters and figures, with its ``peerinfer sim``
command) and prints a markdown table (``table_lines``), the one in docs/evaluation.md. The runs
are small (16-64 nodes, 4,000-20,000 requests) because they were measured on a 2-core machine
shared with other sessions.

``churn``  crashes per node-hour 0, 1, 4 and 16 (each with as many joins, so the swarm keeps
           its size), one with graceful leaves instead, and the same with ``silent`` crashes:
           32 nodes x 8,000 requests; then the target, 64 nodes x 20,000 requests at 1 crash
           (and 1 join) per node-hour, in both crash modes. Lost requests, orphaned ones (their
           entry node crashed), failovers, hit ratio, TTFT, how soon a newcomer is routed to.
``mix``    16 nodes, a quarter of them GPUs (``gpu:0.25,default:0.75``), against 16 CPUs, at
           the CPU profile's rate and 4x it: where the traffic goes under ``local``,
           ``least_loaded`` (blind to speed) and ``cost`` (estimates each peer at its
           announced speed); 4,000 requests each.
``mesh``   broadcast against gossipsub's mesh (degree 6), 16 and 32 nodes, without loss and
           with 5% of transmissions lost: announcement delay, hops, duplicates, bytes per node
           per second, and what the swarm's TTFT and hit ratio make of it; 4,000 requests each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from experiments.runner import run_all
from peerinfer.sim.config import SimConfig

CHURN_RATES = (0.0, 1.0, 4.0, 16.0)
CHURN_NODES, CHURN_REQUESTS = 32, 8000
CHURN_TARGET_NODES, CHURN_TARGET_REQUESTS = 64, 20_000
MIX = "gpu:0.25,default:0.75"
MIX_POLICIES = ("local", "least_loaded", "cost")
MIX_RATES = (0.25, 1.0)
MIX_NODES, MIX_REQUESTS = 16, 4000
MESH_NODES = (16, 32)
MESH_LOSS = (0.0, 0.05)
MESH_REQUESTS = 4000


def churn_configs(base: SimConfig) -> list[SimConfig]:
    common = replace(base, nodes=CHURN_NODES, requests=CHURN_REQUESTS, skew="zipf:1.0")
    out = [replace(common, crash_rate=r, join_rate=r) for r in CHURN_RATES]
    out.append(replace(common, leave_rate=4.0, join_rate=4.0))
    out.append(replace(common, crash_rate=4.0, join_rate=4.0, crash_mode="silent"))
    target = replace(
        common, nodes=CHURN_TARGET_NODES, requests=CHURN_TARGET_REQUESTS, crash_rate=1.0,
        join_rate=1.0,
    )
    out += [target, replace(target, crash_mode="silent")]
    return out


def mix_configs(base: SimConfig) -> list[SimConfig]:
    common = replace(base, nodes=MIX_NODES, requests=MIX_REQUESTS, skew="zipf:1.0")
    out = []
    for rate in MIX_RATES:
        out.append(replace(common, rate=rate, policy="cost"))  # all CPUs
        out += [replace(common, rate=rate, policy=p, mix=MIX) for p in MIX_POLICIES]
    return out


def mesh_configs(base: SimConfig) -> list[SimConfig]:
    common = replace(base, requests=MESH_REQUESTS, skew="zipf:1.0")
    return [
        replace(common, nodes=n, gossip=g, gossip_loss=loss)
        for n in MESH_NODES
        for loss in MESH_LOSS
        for g in ("broadcast", "mesh")
    ]


def _f(x: Any, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def churn_rows(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| nodes x requests | crashes / leaves / joins per node-hour | mode | crashes | leaves "
        "| joins | lost | orphaned | failovers | hit ratio | TTFT mean / p99 (s) "
        "| newcomer first routed to (s, mean / max) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        p, c = r["params"], r.get("churn") or {}
        lines.append(
            f"| {p['nodes']} x {p['requests']:,} | {p['crash_rate']:g} / {p['leave_rate']:g} / "
            f"{p['join_rate']:g} | {p['crash_mode'] if p['crash_rate'] else '-'} "
            f"| {c.get('crashes', 0)} | {c.get('leaves', 0)} | {c.get('joins', 0)} "
            f"| {c.get('lost', r['rejected'])} | {c.get('orphaned', 0)} | {r['failovers']} "
            f"| {_f(r['hit_ratio'])} | {_f(r['ttft_mean_s'])} / {_f(r['ttft_p99_s'])} "
            f"| {_f(c.get('newcomer_first_routed_s_mean'), 1)} / "
            f"{_f(c.get('newcomer_first_routed_s_max'), 1)} |"
        )
    return lines


def mix_rows(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| rate (/node/s) | machines | policy | TTFT mean / p99 (s) | latency mean (s) | hit ratio "
        "| GPU nodes' share of requests served | GPU utilization | CPU utilization "
        "| TTFT of requests served by GPU / CPU (s) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        p = r["params"]
        mix = r.get("mix") or {}
        gpu, cpu = mix.get("gpu") or {}, mix.get("default") or {}
        machines = (
            f"{p['nodes']} CPUs" if not p["mix"]
            else f"{gpu.get('nodes', 0)} GPUs + {cpu.get('nodes', 0)} CPUs"
        )
        lines.append(
            f"| {p['rate']:g} | {machines} "
            f"| {p['policy']} | {_f(r['ttft_mean_s'])} / {_f(r['ttft_p99_s'])} "
            f"| {_f(r['latency_mean_s'])} | {_f(r['hit_ratio'])} "
            f"| {_f(gpu.get('served_share'))} | {_f(gpu.get('utilization_mean'))} "
            f"| {_f(cpu.get('utilization_mean'), 3)} "
            f"| {_f(gpu.get('ttft_mean_s'))} / {_f(cpu.get('ttft_mean_s'))} |"
        )
    return lines


def mesh_rows(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| nodes | loss | gossip | delay mean / p99 (ms) | hops mean | duplicates per delivery "
        "| repaired by IWANT | coverage | announcement kB per node per s | pulls "
        "| TTFT mean (s) | hit ratio |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        p = r["params"]
        m = r.get("mesh")
        ae = r["anti_entropy"]
        if m is None:  # broadcast: one hop at the pair's delay, one copy per recipient
            delay = f"{float(p['delay_ms']):g} / {float(p['delay_ms']):g}"
            hops, dup, rep, cov = "1", "0", "-", "-"
            kb = ae["announce_bytes"] / p["nodes"] / r["virtual_s"] / 1000
        else:
            delay = f"{m['delay_mean_s'] * 1000:.1f} / {m['delay_p99_s'] * 1000:.1f}"
            hops, dup = _f(m["hops_mean"], 2), _f(m["duplicates_per_delivery"], 2)
            rep, cov = str(m["repaired_by_iwant"]), _f(m["coverage"], 4)
            kb = m["bytes_per_node_per_s"] / 1000
        lines.append(
            f"| {p['nodes']} | {p['gossip_loss']:g} | {p['gossip']} | {delay} | {hops} | {dup} "
            f"| {rep} | {cov} | {kb:.1f} | {ae['pulls_started']} | {_f(r['ttft_mean_s'])} "
            f"| {_f(r['hit_ratio'])} |"
        )
    return lines


def _experiment(
    configs: Callable[[SimConfig], list[SimConfig]], rows: Callable[[list[dict[str, Any]]], list[str]]
) -> Callable[..., dict[str, Any]]:
    def run(out: Path, base: SimConfig, jobs: int, log: Callable[[str], None]) -> dict[str, Any]:
        results = run_all(configs(base), jobs=jobs, log=log)
        table = rows(results)
        for line in table:
            log(line)
        return {"runs": results, "table_lines": table}

    return run


churn_experiment = _experiment(churn_configs, churn_rows)
mix_experiment = _experiment(mix_configs, mix_rows)
mesh_experiment = _experiment(mesh_configs, mesh_rows)

__all__ = ["churn_experiment", "mesh_experiment", "mix_experiment"]
