"""Running the experiments' simulator runs: in parallel, each kept in a cache file, each with
the ``peerinfer sim`` command line that repeats it.

Every run is an ordinary ``peerinfer sim`` run (``peerinfer.sim.simulate``); its result keeps
the summary figures the tables and plots read (``_KEEP``), the process's CPU time and memory,
the replicas' memory, its ``params`` and its ``command``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from peerinfer.sim.config import COST_PRESETS, SimConfig

_KEEP = (
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "latency_mean_s",
    "latency_p50_s",
    "latency_p99_s",
    "hit_ratio",
    "forwarded_fraction",
    "failovers",
    "rejected",
    "sync_bytes",
    "virtual_s",
    "wall_s",
    "requests_per_wall_s",
    "load",
    "churn",
    "mix",
    "mesh",
    "anti_entropy",
    "specialization",
    "route_estimates",
)


def command_line(config: SimConfig) -> str:
    """The ``peerinfer sim`` command that repeats ``config``'s run."""
    d = SimConfig()
    parts = ["peerinfer sim"]
    flags = (
        ("nodes", "--nodes"),
        ("requests", "--requests"),
        ("policy", "--policy"),
        ("delay_ms", "--delay-ms"),
        ("workload", "--workload"),
        ("skew", "--skew"),
        ("cache_tokens", "--cache-tokens"),
        ("rate", "--rate"),
        ("clients", "--clients"),
        ("announce_interval_s", "--announce-interval"),
        ("min_announce_gap_s", "--min-announce-gap"),
        ("max_queue", "--max-queue"),
        ("costs_source", "--costs"),
        ("slots", "--slots"),
        ("gossip_loss", "--gossip-loss"),
        ("crash_rate", "--crash-rate"),
        ("leave_rate", "--leave-rate"),
        ("join_rate", "--join-rate"),
        ("crash_mode", "--crash-mode"),
        ("mix", "--mix"),
        ("gossip", "--gossip"),
        ("mesh_degree", "--mesh-degree"),
        ("entries", "--entries"),
        ("data", "--data"),
        ("max_tokens", "--max-tokens"),
        ("seed", "--seed"),
    )
    for attr, flag in flags:
        if attr == "slots":
            preset = COST_PRESETS.get(config.costs_source)
            if preset is not None and preset.slots != config.costs.slots:
                parts.append(f"{flag} {config.costs.slots}")
            continue
        value = getattr(config, attr)
        always = ("nodes", "requests", "policy", "delay_ms", "skew", "cache_tokens", "seed")
        if value != getattr(d, attr) or attr in always:
            parts.append(f"{flag} {'none' if value is None else value}")
    return " ".join(parts)


def _run_one(config: SimConfig, series: int) -> dict[str, Any]:
    from peerinfer.sim.metrics import ProcessUsage, replica_memory
    from peerinfer.sim.run import simulate

    usage = ProcessUsage()
    sim, summary = simulate(config, series=series)
    out = {k: summary[k] for k in _KEEP if k in summary}
    out["usage"] = usage.figures()  # the run alone, before the memory walk below
    out["memory"] = replica_memory(sim)
    if series:
        out["share_series"] = summary.get("share_series", {})
    out["params"] = summary["params"]
    out["command"] = command_line(config)
    return out


#: Where finished runs are kept (``--cache``), so an interrupted experiment resumes.
_CACHE: Path | None = None


def _cache_key(config: SimConfig, series: int) -> str:
    return json.dumps({"config": config.to_dict(), "series": series}, sort_keys=True)


def _cached(config: SimConfig, series: int) -> dict[str, Any] | None:
    if _CACHE is None or not _CACHE.exists():
        return None
    key = _cache_key(config, series)
    for line in _CACHE.read_text().splitlines():
        entry = json.loads(line)
        if entry["key"] == key:
            result: dict[str, Any] = entry["result"]
            return result
    return None


def _store(config: SimConfig, series: int, result: dict[str, Any]) -> None:
    if _CACHE is not None:
        with _CACHE.open("a") as f:
            f.write(json.dumps({"key": _cache_key(config, series), "result": result}) + "\n")


def use_cache(path: Path | None) -> None:
    """Keep finished runs in ``path`` (JSON lines) and reuse them; None: keep nothing."""
    global _CACHE
    _CACHE = path


def run_all(
    configs: Sequence[SimConfig], *, jobs: int = 2, series: int = 0, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Run ``configs`` on ``jobs`` processes; results in the same order."""
    started = time.perf_counter()
    results: list[dict[str, Any] | None] = [_cached(c, series) for c in configs]
    todo = [i for i, r in enumerate(results) if r is None]
    if len(todo) < len(configs):
        log(f"  {len(configs) - len(todo)} runs taken from the cache {_CACHE}")

    def done(i: int, result: dict[str, Any]) -> None:
        results[i] = result
        _store(configs[i], series, result)
        log(f"  [{i + 1}/{len(configs)}] {command_line(configs[i])}  ({result['wall_s']} s)")

    if jobs <= 1:
        for i in todo:
            done(i, _run_one(configs[i], series))
    elif todo:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {i: pool.submit(_run_one, configs[i], series) for i in todo}
            for i, f in futures.items():
                done(i, f.result())
    log(f"  {len(configs)} runs in {time.perf_counter() - started:.0f} s")
    return [r for r in results if r is not None]


__all__ = ["command_line", "run_all", "use_cache"]
