"""The markdown tables of docs/evaluation.md, from the experiments' JSON files
(``python -m experiments tables --out docs/figures``)."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.sweeps import BATCH_SLOTS, DELAYS_MS, POLICIES, PROFILES, SKEWED, _f, scale_rows


def markdown_tables(out: Path) -> str:
    """The tables of docs/evaluation.md, from the experiments' JSON files in ``out``."""
    parts: list[str] = []
    delay = out / "delay.json"
    if delay.exists():
        data = json.loads(delay.read_text())
        for profile in PROFILES:
            for skew in (SKEWED, "uniform"):
                rows = [r for r in data["table"] if (r["costs"], r["skew"]) == (profile, skew)]
                if not rows:
                    continue
                parts.append(f"costs `{profile}`, {skew}: mean / p99 latency (s), "
                             "and cost's margin over the better of the other two\n")
                parts.append("| delay (ms) | local | longest_prefix | cost | cost vs best other |")
                parts.append("|---:|---:|---:|---:|---:|")
                for r in rows:
                    best = min(r["local"]["latency_mean_s"], r["longest_prefix"]["latency_mean_s"])
                    gain = 1 - r["cost"]["latency_mean_s"] / best
                    cells = " | ".join(
                        f"{_f(r[p]['latency_mean_s'])} / {_f(r[p]['latency_p99_s'])}"
                        for p in POLICIES
                    )
                    parts.append(f"| {r['delay_ms']:g} | {cells} | {gain:+.1%} |")
                parts.append("")
    hot = out / "hot.json"
    if hot.exists():
        runs = json.loads(hot.read_text())["runs"]
        parts.append("hot:2: mean / p99 latency (s); p99 ratio longest_prefix / cost\n")
        parts.append("| costs | delay (ms) | max_queue | local | longest_prefix | cost | "
                     "p99 LP / cost |")
        parts.append("|---|---:|---:|---:|---:|---:|---:|")
        keys = sorted({(r["params"]["costs_source"], float(r["params"]["delay_ms"]),
                        r["params"]["max_queue"]) for r in runs},
                      key=lambda k: (PROFILES.index(k[0]), k[2] != 8, k[1], k[2]))
        for profile, d, q in keys:
            by = {r["params"]["policy"]: r for r in runs
                  if (r["params"]["costs_source"], float(r["params"]["delay_ms"]),
                      r["params"]["max_queue"]) == (profile, d, q)}
            cells = " | ".join(
                f"{_f(by[p]['latency_mean_s'])} / {_f(by[p]['latency_p99_s'])}" if p in by else "-"
                for p in POLICIES
            )
            ratio = (by["longest_prefix"]["latency_p99_s"] / by["cost"]["latency_p99_s"]
                     if "longest_prefix" in by and "cost" in by else None)
            parts.append(f"| {profile} | {d:g} | {q} | {cells} | {_f(ratio, 2)} |")
        parts.append("")
    adm = out / "admission.json"
    if adm.exists():
        table = json.loads(adm.read_text())["table"]
        parts.append("admission limit for forwarded requests, 5 ms: mean / p99 latency (s)\n")
        parts.append("| costs | workload | max_queue | local | longest_prefix | cost |")
        parts.append("|---|---|---:|---:|---:|---:|")
        for r in table:
            cells = " | ".join(f"{_f(r[p][0])} / {_f(r[p][1])}" for p in POLICIES)
            parts.append(f"| {r['costs']} | {r['skew']} | {r['max_queue']} | {cells} |")
        parts.append("")
    scale = out / "scale.json"
    if scale.exists():
        data = json.loads(scale.read_text())
        parts.append("scaling: TTFT, hit ratio, announcement bytes and replica memory per node\n")
        parts += scale_rows(data["table"])
        parts.append("")
    batch = out / "batch.json"
    if batch.exists():
        data = json.loads(batch.read_text())
        parts.append("batched nodes, hot:2: TTFT mean / p99 (s); p99 cost / longest_prefix\n")
        parts.append("| slots | delay (ms) | local | longest_prefix | cost | p99 cost / LP |")
        parts.append("|---:|---:|---:|---:|---:|---:|")
        for row in data["hot_table"]:
            cells = " | ".join(
                f"{_f(row[p]['ttft_mean_s'])} / {_f(row[p]['ttft_p99_s'])}" for p in POLICIES
            )
            parts.append(f"| {row['slots']} | {row['delay_ms']:g} | {cells} | "
                         f"{_f(row['p99_ttft_cost_over_lp'])} |")
        for row in data["loaded_table"]:
            cells = " | ".join(
                f"{_f(row[p]['ttft_mean_s'])} / {_f(row[p]['ttft_p99_s'])}"
                for p in ("longest_prefix", "cost")
            )
            parts.append(f"| {row['slots']}, rate {row['rate']:g} | 5 | - | {cells} | "
                         f"{_f(row['p99_ttft_cost_over_lp'])} |")
        parts.append("")
        parts.append("batched nodes: mean latency (s), local / LP / cost, and cost's margin\n")
        parts.append("| delay (ms) | zipf:1.1 | margin | uniform | margin |")
        parts.append("|---:|---:|---:|---:|---:|")
        for d in DELAYS_MS:
            columns: list[str] = []
            for skew in (SKEWED, "uniform"):
                row = next(r for r in data["sweep_table"]
                           if r["skew"] == skew and r["delay_ms"] == d)
                columns.append(" / ".join(_f(row[p]["latency_mean_s"]) for p in POLICIES))
                columns.append(f"{row['cost_margin']:+.1%}")
            parts.append(f"| {d:g} | " + " | ".join(columns) + " |")
        parts.append("")
        k = data["knees"]
        parts.append("batched nodes: knee rate (mean TTFT > 5x idle), hot:2, cost, 5 ms\n")
        parts.append("| slots | idle TTFT (s) | knee rate | curve (rate: mean TTFT s) |")
        parts.append("|---:|---:|---:|---|")
        for slots in BATCH_SLOTS:
            e = k[str(slots)]
            curve = ", ".join(f"{r:g}: {t:.2f}" for r, t in e["curve"])
            parts.append(f"| {slots} | {_f(e['idle_ttft_s'])} | {_f(e['knee_rate'])} | {curve} |")
        parts.append(f"\nratio {_f(k['ratio'], 2)}\n")
    return "\n".join(parts)


__all__ = ["markdown_tables"]
