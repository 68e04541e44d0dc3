"""The experiments behind docs/evaluation.md: sweeps of simulator runs, their tables and figures.

``python -m experiments NAME [--out DIR] [--jobs J]`` runs one experiment (or
``all``), writes ``DIR/NAME.json`` (every run's parameters and figures) and ``DIR/NAME*.png``,
and prints a table. Every run is an ordinary ``peerinfer sim`` run: the JSON records each run's
``params``, so any point can be re-run alone with the matching command line.

Experiments
    ``delay``    mean / p99 latency against the one-way link delay, for ``local`` (no routing),
                 ``longest_prefix`` (the paper) and ``cost``, on a Zipf and a uniform workload
    ``share``    per-node share of the most requested subject over time (300-request window,
                 stride 30), ``longest_prefix``, under Zipf and under uniform popularity
    ``cycle``    the specialization-eviction cycle: the same with caches too small for the
                 subjects a specialized node attracts
    ``hot``      tail latency on a hot-subject workload (``hot:K``) for the three policies
    ``admission`` the admission limit for forwarded requests (``max_queue`` 0, 1, 8) on the
                 Zipf, uniform and hot workloads
    ``scale``    from 4 to 1,024 nodes: TTFT, hit ratio, announcement bytes per node per
                 second, replica memory per node, and each run's CPU time and peak memory
    ``batch``    batched nodes (the ``batched`` cost model, 8 slots) against the same model on
                 one slot: the hot-subject tail, the delay sweep, and the arrival rate that
                 a node carries before its mean TTFT passes 5x the idle one
    ``churn``, ``mix``, ``mesh``  churn, mixed machines, gossipsub's mesh against broadcast
                 (``experiments.scenarios``; not part of ``all``)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from experiments.runner import run_all
from peerinfer.sim.config import COST_PRESETS, SimConfig

POLICIES = ("local", "longest_prefix", "cost")
PROFILE_RATE_DEFAULT = 0.25
DELAYS_MS = (0, 1, 2, 5, 10, 20, 50, 100)

#: The common setting of the experiments (see docs/evaluation.md for why).
BASE = SimConfig(
    nodes=16,
    requests=4000,
    cache_tokens=8192,
    rate=PROFILE_RATE_DEFAULT,
    delay_ms="5",
    skew="zipf:1.1",
    seed=1,
)
SKEWED = "zipf:1.1"
HOT = "hot:2"
PROFILES = ("default", "gpu")
#: Arrivals per node per second for each cost profile: about 40% utilization of a node that
#: serves its own requests with its own cache (no routing) on the Zipf workload.
PROFILE_RATE = {"default": 0.25, "gpu": 1.0}


def with_costs(config: SimConfig, profile: str) -> SimConfig:
    return replace(
        config, costs=COST_PRESETS[profile], costs_source=profile, rate=PROFILE_RATE[profile]
    )

def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _delay_axis(ax: Any, delays: Sequence[float]) -> None:
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks(list(delays))
    ax.set_xticklabels([f"{d:g}" for d in delays])
    ax.set_xlabel("one-way link delay (ms)")


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)


# ------------------------------------------------------------------------------ delay sweep


#: ``local`` never forwards, so the link delay cannot change its latency: it runs at these
#: delays only (the first stands for every delay; the others check that it does).
LOCAL_DELAYS_MS = (0, 100)


def delay_configs(base: SimConfig, delays: Sequence[float], skews: Sequence[str]) -> list[SimConfig]:
    return [
        replace(base, skew=skew, delay_ms=f"{d:g}", policy=policy)
        for skew in skews
        for d in delays
        for policy in POLICIES
        if policy != "local" or d in LOCAL_DELAYS_MS
    ]


def _local_stand_in(
    results: list[dict[str, Any]], log: Callable[[str], None], delays: Sequence[float] = DELAYS_MS
) -> list[dict[str, Any]]:
    """Give ``local`` a point at every delay: the 0-ms run's figures (after checking that the
    other ``local`` runs agree with it on latency)."""
    out = list(results)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        p = r["params"]
        if p["policy"] == "local":
            groups.setdefault((p["costs_source"], p["skew"]), []).append(r)
    for (profile, skew), runs in groups.items():
        ref = min(runs, key=lambda r: float(r["params"]["delay_ms"]))
        for r in runs:
            if r["latency_mean_s"] != ref["latency_mean_s"]:
                log(f"  note: local, {profile}, {skew}: latency differs with the delay "
                    f"({r['params']['delay_ms']} ms: {r['latency_mean_s']} vs {ref['latency_mean_s']})")
        have = {float(r["params"]["delay_ms"]) for r in runs}
        for d in delays:
            if d not in have:
                stand_in = dict(ref)
                stand_in["params"] = {**ref["params"], "delay_ms": f"{d:g}"}
                stand_in["stand_in_for"] = ref["command"]
                out.append(stand_in)
    out.sort(key=lambda r: (r["params"]["costs_source"], r["params"]["skew"],
                            float(r["params"]["delay_ms"]), POLICIES.index(r["params"]["policy"])))
    return out


def delay_experiment(out: Path, base: SimConfig, jobs: int, log: Callable[[str], None]) -> dict[str, Any]:
    skews = (SKEWED, "uniform")
    configs = [
        c for profile in PROFILES for c in delay_configs(with_costs(base, profile), DELAYS_MS, skews)
    ]
    results = _local_stand_in(run_all(configs, jobs=jobs, log=log), log)
    plt = _plt()
    for profile in PROFILES:
        mine = [r for r in results if r["params"]["costs_source"] == profile]
        fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
        for col, skew in enumerate(skews):
            for line, metric in enumerate(("latency_mean_s", "latency_p99_s")):
                ax = axes[line][col]
                for policy in POLICIES:
                    pts = [
                        (float(r["params"]["delay_ms"]), r[metric])
                        for r in mine
                        if r["params"]["skew"] == skew and r["params"]["policy"] == policy
                    ]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=policy,
                            markersize=4)
                _delay_axis(ax, DELAYS_MS)
                ax.set_ylabel(("mean" if line == 0 else "p99") + " latency (s)")
                ax.set_title(f"{skew} popularity, {base.nodes} nodes, costs '{profile}'",
                             fontsize=10)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
        _save(fig, out / f"delay_sweep_{profile}.png")
    table = []
    for profile in PROFILES:
        for skew in skews:
            for d in DELAYS_MS:
                row: dict[str, Any] = {"costs": profile, "skew": skew, "delay_ms": d}
                for r in results:
                    p = r["params"]
                    if (p["costs_source"], p["skew"], float(p["delay_ms"])) == (profile, skew, d):
                        row[p["policy"]] = {
                            k: r[k] for k in ("latency_mean_s", "latency_p99_s", "ttft_mean_s",
                                              "hit_ratio", "forwarded_fraction")
                        }
                table.append(row)
    return {"runs": results, "table": table}


def print_delay_table(data: dict[str, Any], log: Callable[[str], None]) -> None:
    log(f"{'costs':<8}{'skew':<10}{'delay':>6}  "
        + "".join(f"{p + ' mean/p99':>26}" for p in POLICIES) + "   cost<=min(local,lp)")
    for row in data["table"]:
        cells = []
        for p in POLICIES:
            r = row[p]
            cells.append(f"{r['latency_mean_s']:>12.4f} /{r['latency_p99_s']:>10.4f}  ")
        best = min(row["local"]["latency_mean_s"], row["longest_prefix"]["latency_mean_s"])
        ok = row["cost"]["latency_mean_s"] <= best
        log(f"{row['costs']:<8}{row['skew']:<10}{row['delay_ms']:>6}  " + "".join(cells)
            + f"   {ok}")


# ------------------------------------------------------------------------------ share and cycle


def prefix_evictions(holders: Sequence[Sequence[Any]]) -> int:
    """How many times a node that held a subject's whole prefix at one sample no longer held it
    at the next (``holders``: ``[request, [nodes]]`` samples)."""
    sets = [set(nodes) for _, nodes in holders]
    return sum(len(a - b) for a, b in zip(sets, sets[1:], strict=False))


def _most_evicted(result: dict[str, Any], k: int) -> list[str]:
    """The ``k`` subjects whose prefixes were evicted most often (ties: the more requested)."""
    series = result["share_series"]
    order = list(series)
    return sorted(
        order, key=lambda s: (-prefix_evictions(series[s].get("holders", [])), order.index(s))
    )[:k]


def _share_figure(
    results: list[dict[str, Any]], titles: Sequence[str], path: Path, subjects: Sequence[str] | None = None
) -> None:
    """Per result: a subject's per-node share over time (the most requested one unless
    ``subjects`` says) and, below it, which nodes cache that subject's whole 5-shot prefix
    (sampled every 30 requests)."""
    from peerinfer.sim.figures import plot_holders, plot_shares

    plt = _plt()
    fig, axes = plt.subplots(
        2 * len(results), 1, figsize=(9, 5.6 * len(results)), squeeze=False,
        gridspec_kw={"height_ratios": [3, 2] * len(results)},
    )
    for j, (r, title) in enumerate(zip(results, titles, strict=True)):
        subject = subjects[j] if subjects else next(iter(r["share_series"]))
        s = r["share_series"][subject]
        plot_shares(s["window_end"], s["share"], path, f"{title}: share of '{subject}'",
                    ax=axes[2 * j][0])
        plot_holders(s.get("holders", []), r["params"]["nodes"], axes[2 * j + 1][0],
                     f"nodes caching the whole '{subject}' prefix")
        axes[2 * j + 1][0].set_xlim(axes[2 * j][0].get_xlim())
    _save(fig, path)


def share_experiment(out: Path, base: SimConfig, jobs: int, log: Callable[[str], None]) -> dict[str, Any]:
    configs = [
        replace(base, policy="longest_prefix", delay_ms="1", skew=skew)
        for skew in (SKEWED, "uniform")
    ]
    results = run_all(configs, jobs=jobs, series=1, log=log)
    _share_figure(
        results,
        [f"longest_prefix, {c.skew}, delay {c.delay_ms} ms" for c in configs],
        out / "share_over_time.png",
    )
    return {"runs": results}


#: The cycle experiment's small cache, and how many of the most requested subjects it follows.
CYCLE_CACHE_TOKENS = 2048
CYCLE_SUBJECTS = 8


def cycle_experiment(out: Path, base: SimConfig, jobs: int, log: Callable[[str], None]) -> dict[str, Any]:
    # Caches of 2048 tokens hold three or four 5-shot prefixes: a node that specializes in the
    # top subject also attracts others, and the LRU evicts the top subject's prefix now and then.
    caps = (CYCLE_CACHE_TOKENS, base.cache_tokens)
    configs = [
        replace(base, policy="longest_prefix", delay_ms="1", skew=SKEWED, cache_tokens=c)
        for c in caps
    ]
    results = run_all(configs, jobs=jobs, series=CYCLE_SUBJECTS, log=log)
    # The subjects shown: of the most requested ones, the two whose prefixes the small caches
    # evicted most often.
    subjects = _most_evicted(results[0], 2)
    from peerinfer.sim.figures import plot_holders, plot_shares

    plt = _plt()
    fig, axes = plt.subplots(
        4, 2, figsize=(14, 11), squeeze=False, gridspec_kw={"height_ratios": [3, 2, 3, 2]}
    )
    path = out / "eviction_cycle.png"
    for col, (r, c) in enumerate(zip(results, configs, strict=True)):
        for row, subject in enumerate(subjects):
            s = r["share_series"][subject]
            ev = prefix_evictions(s.get("holders", []))
            plot_shares(s["window_end"], s["share"], path,
                        f"cache {c.cache_tokens} tokens/node: share of '{subject}'",
                        ax=axes[2 * row][col])
            plot_holders(s.get("holders", []), c.nodes, axes[2 * row + 1][col],
                         f"nodes caching its whole prefix ({ev} evictions seen)")
            axes[2 * row + 1][col].set_xlim(axes[2 * row][col].get_xlim())
    fig.suptitle(f"longest_prefix, {SKEWED}, delay 1 ms, {base.nodes} nodes", fontsize=11)
    _save(fig, path)
    summary = {
        r["params"]["cache_tokens"]: {
            subject: prefix_evictions(series.get("holders", []))
            for subject, series in r["share_series"].items()
        }
        for r in results
    }
    return {"runs": results, "subjects": subjects, "evictions": summary}


# ------------------------------------------------------------------------------ hot subjects


HOT_DELAYS_MS = (0, 1, 5, 20, 50)
#: Admission limits for forwarded requests compared on the hot workload (NodeConfig.max_queue).
ADMISSION = (0, 1, 8)


def hot_experiment(out: Path, base: SimConfig, jobs: int, log: Callable[[str], None]) -> dict[str, Any]:
    configs = [
        replace(with_costs(base, profile), skew=HOT, delay_ms=f"{d:g}", policy=p)
        for profile in PROFILES
        for d in HOT_DELAYS_MS
        for p in POLICIES
        if p != "local" or d in (HOT_DELAYS_MS[0], HOT_DELAYS_MS[-1])
    ]
    # The same at 5 ms with other admission limits for forwarded requests.
    configs += [
        replace(with_costs(base, profile), skew=HOT, delay_ms="5", policy=p, max_queue=q)
        for profile in PROFILES
        for q in ADMISSION
        if q != base.max_queue
        for p in ("longest_prefix", "cost")
    ]
    measured = run_all(configs, jobs=jobs, log=log)
    base_runs = [r for r in measured if r["params"]["max_queue"] == base.max_queue]
    results = _local_stand_in(base_runs, log, HOT_DELAYS_MS) + [
        r for r in measured if r["params"]["max_queue"] != base.max_queue
    ]
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, profile in zip(axes, PROFILES, strict=True):
        for policy in POLICIES:
            pts = [
                (float(r["params"]["delay_ms"]), r["latency_p99_s"])
                for r in results
                if r["params"]["policy"] == policy
                and r["params"]["costs_source"] == profile
                and r["params"]["max_queue"] == base.max_queue
            ]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=policy)
        _delay_axis(ax, HOT_DELAYS_MS)
        ax.set_ylabel("p99 latency (s)")
        ax.set_title(f"{HOT} (80% of requests on 2 subjects), costs '{profile}'", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
    _save(fig, out / "hot_p99.png")
    return {"runs": results}


def admission_experiment(out: Path, base: SimConfig, jobs: int, log: Callable[[str], None]) -> dict[str, Any]:
    """The admission limit for forwarded requests (``max_queue``) on all three workloads, 5 ms."""
    configs = [
        replace(with_costs(base, profile), skew=skew, delay_ms="5", policy=p, max_queue=q)
        for profile in PROFILES
        for skew in (SKEWED, "uniform", HOT)
        for q in ADMISSION
        for p in ("longest_prefix", "cost")
    ] + [
        replace(with_costs(base, profile), skew=skew, delay_ms="5", policy="local")
        for profile in PROFILES
        for skew in (SKEWED, "uniform", HOT)
    ]
    results = run_all(configs, jobs=jobs, log=log)
    table = []
    for profile in PROFILES:
        for skew in (SKEWED, "uniform", HOT):
            mine = [r for r in results
                    if (r["params"]["costs_source"], r["params"]["skew"]) == (profile, skew)]
            local = next(r for r in mine if r["params"]["policy"] == "local")
            for q in ADMISSION:
                row: dict[str, Any] = {"costs": profile, "skew": skew, "max_queue": q,
                                       "local": [local["latency_mean_s"], local["latency_p99_s"]]}
                for r in mine:
                    if r["params"]["policy"] != "local" and r["params"]["max_queue"] == q:
                        row[r["params"]["policy"]] = [r["latency_mean_s"], r["latency_p99_s"]]
                table.append(row)
    return {"runs": results, "table": table}


# ------------------------------------------------------------------------------ scaling


#: The sweep's node counts (the 1,024-node run: about 6 minutes and 3 GB on the 2-core
#: development machine; docs/evaluation.md, "From 4 to 1,024 nodes").
SCALE_NODES = (4, 16, 64, 256, 512, 1024)
#: Requests per node of the sweep: every swarm runs about 40 s of virtual time (0.25 requests
#: per node per second), and each node sees as many requests...
SCALE_REQUESTS_PER_NODE = 10
#: ...except the node counts given their own (``--scale-nodes N:R``).
SCALE_REQUESTS_PER_NODE_AT: dict[int, int] = {}
#: Seeds per node count: small swarms see few requests in all, so they are repeated.
SCALE_SEEDS = {4: 8, 16: 4, 64: 2}
#: Above this many nodes only ``cost`` runs (each run is minutes of CPU and gigabytes).
SCALE_ALL_POLICIES_UP_TO = 256


def scale_policies(nodes: int) -> tuple[str, ...]:
    return POLICIES if nodes <= SCALE_ALL_POLICIES_UP_TO else ("cost",)


def scale_configs(
    base: SimConfig,
    requests_per_node: int,
    nodes: Sequence[int] = SCALE_NODES,
    requests_per_node_at: Mapping[int, int] | None = None,
) -> list[SimConfig]:
    """The sweep's runs: ``requests_per_node`` x nodes requests each, unless
    ``requests_per_node_at`` gives a node count its own."""
    at = SCALE_REQUESTS_PER_NODE_AT if requests_per_node_at is None else requests_per_node_at
    return [
        replace(
            base, nodes=n, requests=at.get(n, requests_per_node) * n, skew=SKEWED, policy=p,
            seed=base.seed + k,
        )
        for n in nodes
        for k in range(SCALE_SEEDS.get(n, 1))
        for p in scale_policies(n)
    ]


def parse_scale_nodes(text: str) -> tuple[list[int], dict[int, int]]:
    """``"4,16,1024:1"``: the node counts, and the requests per node of those that say."""
    nodes: list[int] = []
    at: dict[int, int] = {}
    for part in text.split(","):
        n, _, per = part.partition(":")
        nodes.append(int(n))
        if per:
            at[int(n)] = int(per)
    return nodes, at


def _mean_of(runs: list[dict[str, Any]], get: Callable[[dict[str, Any]], Any], digits: int = 4) -> float | None:
    values = [v for v in (get(r) for r in runs) if v is not None]
    return round(sum(values) / len(values), digits) if values else None


def _figure(key: str, within: str | None = None) -> Callable[[dict[str, Any]], Any]:
    """A run's figure ``key`` (in its ``within`` dict, if given), None where it has none."""

    def get(run: dict[str, Any]) -> Any:
        return (run if within is None else run.get(within) or {}).get(key)

    return get


def scale_table(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (nodes, policy): means over seeds of the headline figures: TTFT, hit ratio,
    announcement bytes per node per second, replica entries and bytes per node, and what each
    run cost the machine (CPU seconds, peak resident memory of its process)."""
    rows = []
    for n in sorted({r["params"]["nodes"] for r in results}):
        for policy in POLICIES:
            mine = [r for r in results if (r["params"]["nodes"], r["params"]["policy"]) == (n, policy)]
            if not mine:
                continue
            row: dict[str, Any] = {"nodes": n, "policy": policy, "seeds": len(mine),
                                   "requests": mine[0]["params"]["requests"]}
            for k in ("latency_mean_s", "latency_p99_s", "ttft_mean_s", "ttft_p99_s", "hit_ratio",
                      "forwarded_fraction", "virtual_s"):
                row[k] = _mean_of(mine, _figure(k))
            row["sync_bytes_per_node_per_s"] = _mean_of(
                mine, lambda r: r["anti_entropy"]["bytes_per_node_per_s"], 1
            )
            row["announce_bytes_per_node_per_s"] = _mean_of(
                mine, lambda r: r["anti_entropy"]["announce_bytes"] / r["params"]["nodes"] / r["virtual_s"],
                1,
            )
            for k in ("replica_entries_per_node", "index_bytes_per_node", "bytes_per_replica_entry"):
                row[k] = _mean_of(mine, _figure(k, within="memory"), 1)
            for k in ("cpu_s", "peak_rss_mb"):
                row[k] = _mean_of(mine, _figure(k, within="usage"), 1)
            rows.append(row)
    return rows


def scale_experiment(
    out: Path,
    base: SimConfig,
    jobs: int,
    log: Callable[[str], None],
    requests_per_node: int = SCALE_REQUESTS_PER_NODE,
    nodes: Sequence[int] = SCALE_NODES,
    requests_per_node_at: Mapping[int, int] | None = None,
) -> dict[str, Any]:
    configs = scale_configs(base, requests_per_node, nodes, requests_per_node_at)
    results = run_all(configs, jobs=jobs, log=log)
    table = scale_table(results)
    for line in scale_rows(table):
        log(line)
    counts = sorted({r["nodes"] for r in table})
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for policy in POLICIES:
        pts = [r for r in table if r["policy"] == policy]
        ns = [r["nodes"] for r in pts]
        axes[0].plot(ns, [r["ttft_mean_s"] for r in pts], "o-", label=policy)
        axes[1].plot(ns, [r["hit_ratio"] for r in pts], "o-", label=policy)
        axes[2].plot(ns, [(r["announce_bytes_per_node_per_s"] or 0) / 1000 for r in pts], "o-",
                     label=policy)
        mem = [(r["nodes"], r["index_bytes_per_node"]) for r in pts if r["index_bytes_per_node"]]
        axes[3].plot([m[0] for m in mem], [m[1] / 1e6 for m in mem], "o-", label=policy)
    labels = ("mean TTFT (s)", "token hit ratio", "announcement kB received per node per s",
              "replica memory per node (MB, measured)")
    for ax, label in zip(axes, labels, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts)
        ax.set_xticklabels([str(n) for n in counts])
        ax.set_xlabel("nodes")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    for ax in axes[2:]:
        ax.set_yscale("log")
    at = SCALE_REQUESTS_PER_NODE_AT if requests_per_node_at is None else requests_per_node_at
    others = "".join(f", {at[n]} at {n} nodes" for n in counts if n in at)
    fig.suptitle(
        f"{SKEWED}, delay {base.delay_ms} ms, {requests_per_node} requests per node{others}",
        fontsize=10,
    )
    _save(fig, out / "scaling.png")
    return {"runs": results, "table": table}


def scale_rows(table: list[dict[str, Any]]) -> list[str]:
    """The scaling table of docs/evaluation.md (markdown), one row per node count."""
    lines = [
        "| nodes | requests | seeds | TTFT mean / p99 (s): local | longest_prefix | cost "
        "| hit (local / lp / cost) | announcement kB per node per s (cost) "
        "| replica entries per node (cost) | replica MB per node (cost, measured) "
        "| CPU s / peak RSS MB per run (cost) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sorted({r["nodes"] for r in table}):
        by = {r["policy"]: r for r in table if r["nodes"] == n}
        c = by.get("cost")
        if c is None:
            continue

        def ttft(p: str, by: dict[str, dict[str, Any]] = by) -> str:
            r = by.get(p)
            return "-" if r is None else f"{_f(r['ttft_mean_s'])} / {_f(r['ttft_p99_s'])}"

        hits = " / ".join(_f(by[p]["hit_ratio"], 2) if p in by else "-" for p in POLICIES)
        mb = c["index_bytes_per_node"]
        lines.append(
            f"| {n:,} | {c['requests']:,} | {c['seeds']} | {ttft('local')} | "
            f"{ttft('longest_prefix')} | {ttft('cost')} | {hits} | "
            f"{(c['announce_bytes_per_node_per_s'] or 0) / 1000:.1f} | "
            f"{_f(c['replica_entries_per_node'], 0)} | {'-' if mb is None else f'{mb / 1e6:.2f}'} | "
            f"{_f(c['cpu_s'], 1)} / {_f(c['peak_rss_mb'], 0)} |"
        )
    return lines


# ------------------------------------------------------------------------------ markdown


# ------------------------------------------------------------------------------ batching

BATCH_PROFILE = "batched"
#: single-slot against batched nodes, the same cost model otherwise
BATCH_SLOTS = (1, 8)
#: arrivals per node per second for the load sweep (hot:2, cost, 5 ms); the first is "idle"
BATCH_RATES = (0.02, 0.1, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0, 1.2)
#: requests per run of the load sweep and of the delay sweep with batched nodes (a quarter of
#: the base: the 2-core machine runs the 76 runs of this experiment in about half an hour)
BATCH_RATE_REQUESTS = 1000
BATCH_SWEEP_REQUESTS = 1000
#: delays of the hot-subject runs (a subset of HOT_DELAYS_MS)
BATCH_HOT_DELAYS_MS = (0, 5, 50)
#: the hot-subject tail also at this multiple of the profile's rate (5 ms)
BATCH_HOT_LOAD = 2.0
#: mean TTFT this many times the idle one marks the rate a swarm carries
TTFT_KNEE = 5.0


def batched(config: SimConfig, slots: int) -> SimConfig:
    """``config`` on the ``batched`` cost model with ``slots`` per node, at the default
    profile's rate (the same machine and model as ``default``)."""
    return replace(
        config,
        costs=COST_PRESETS[BATCH_PROFILE].with_slots(slots),
        costs_source=BATCH_PROFILE,
        rate=PROFILE_RATE["default"],
    )


def knee_rate(points: Sequence[tuple[float, float]], factor: float = TTFT_KNEE) -> float | None:
    """The arrival rate at which mean TTFT first exceeds ``factor`` x its value at the lowest
    rate, interpolated linearly between the two sweep points around it (None: never)."""
    points = sorted(points)
    idle = points[0][1]
    limit = factor * idle
    for (r0, t0), (r1, t1) in zip(points, points[1:], strict=False):
        if t1 > limit:
            return r0 + (r1 - r0) * (limit - t0) / (t1 - t0) if t1 != t0 else r1
    return None


def batch_experiment(out: Path, base: SimConfig, jobs: int, log: Callable[[str], None]) -> dict[str, Any]:
    hot = [
        replace(batched(base, k), skew=HOT, delay_ms=f"{d:g}", policy=p)
        for k in BATCH_SLOTS
        for d in BATCH_HOT_DELAYS_MS
        for p in POLICIES
        if p != "local" or d in (BATCH_HOT_DELAYS_MS[0], BATCH_HOT_DELAYS_MS[-1])
    ]
    hot_loaded = [
        replace(batched(base, k), skew=HOT, delay_ms="5", policy=p,
                rate=PROFILE_RATE["default"] * BATCH_HOT_LOAD)
        for k in BATCH_SLOTS
        for p in ("longest_prefix", "cost")
    ]
    sweep = delay_configs(
        replace(batched(base, BATCH_SLOTS[-1]), requests=min(base.requests, BATCH_SWEEP_REQUESTS)),
        DELAYS_MS,
        (SKEWED, "uniform"),
    )
    rates = [
        replace(batched(base, k), skew=HOT, delay_ms="5", policy="cost", rate=r,
                requests=min(base.requests, BATCH_RATE_REQUESTS))
        for k in BATCH_SLOTS
        for r in BATCH_RATES
    ]
    results = run_all(hot + hot_loaded + sweep + rates, jobs=jobs, log=log)
    hot_runs = results[: len(hot)]
    loaded_runs = results[len(hot) : len(hot) + len(hot_loaded)]
    rest = results[len(hot) + len(hot_loaded) :]
    sweep_runs = rest[: len(sweep)]
    rate_runs = rest[len(sweep) :]

    def slots_of(r: dict[str, Any]) -> int:
        return int(r["params"]["costs"]["slots"])

    # hot:2 tail, per slots and delay
    hot_table = []
    for k in BATCH_SLOTS:
        mine = [r for r in hot_runs if slots_of(r) == k]
        for d in BATCH_HOT_DELAYS_MS:
            by = {r["params"]["policy"]: r for r in mine if float(r["params"]["delay_ms"]) == d}
            if "local" not in by:
                by["local"] = next(r for r in mine if r["params"]["policy"] == "local")
            row: dict[str, Any] = {"slots": k, "delay_ms": d}
            for p in POLICIES:
                row[p] = {m: by[p][m] for m in ("ttft_mean_s", "ttft_p99_s", "latency_mean_s",
                                                 "latency_p99_s", "hit_ratio", "forwarded_fraction")}
            row["p99_ttft_cost_over_lp"] = row["cost"]["ttft_p99_s"] / row["longest_prefix"]["ttft_p99_s"]
            hot_table.append(row)
    loaded_table = []
    for k in BATCH_SLOTS:
        by = {r["params"]["policy"]: r for r in loaded_runs if slots_of(r) == k}
        loaded_table.append({
            "slots": k, "rate": PROFILE_RATE["default"] * BATCH_HOT_LOAD,
            **{p: {m: by[p][m] for m in ("ttft_mean_s", "ttft_p99_s", "latency_mean_s",
                                         "latency_p99_s", "hit_ratio")} for p in by},
            "p99_ttft_cost_over_lp": by["cost"]["ttft_p99_s"] / by["longest_prefix"]["ttft_p99_s"],
        })
    # delay sweep, batched
    sweep_runs = _local_stand_in(sweep_runs, log)
    sweep_table = []
    for skew in (SKEWED, "uniform"):
        for d in DELAYS_MS:
            row = {"skew": skew, "delay_ms": d}
            for r in sweep_runs:
                p = r["params"]
                if (p["skew"], float(p["delay_ms"])) == (skew, d):
                    row[p["policy"]] = {m: r[m] for m in ("latency_mean_s", "latency_p99_s",
                                                           "ttft_mean_s", "ttft_p99_s", "hit_ratio",
                                                           "forwarded_fraction")}
            best = min(row["local"]["latency_mean_s"], row["longest_prefix"]["latency_mean_s"])
            row["cost_le_best"] = row["cost"]["latency_mean_s"] <= best
            row["cost_margin"] = 1 - row["cost"]["latency_mean_s"] / best
            sweep_table.append(row)
    # load sweep
    knees: dict[str, Any] = {}
    curves: dict[int, list[tuple[float, float]]] = {}
    for k in BATCH_SLOTS:
        pts = sorted((float(r["params"]["rate"]), r["ttft_mean_s"]) for r in rate_runs
                     if slots_of(r) == k)
        curves[k] = pts
        knees[str(k)] = {"idle_ttft_s": pts[0][1], "knee_rate": knee_rate(pts), "curve": pts}
    single, multi = (knees[str(k)]["knee_rate"] for k in BATCH_SLOTS)
    knees["ratio"] = multi / single if single and multi else None

    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for k, style in zip(BATCH_SLOTS, ("--", "-"), strict=True):
        for policy in POLICIES:
            pts = [(row["delay_ms"], row[policy]["ttft_p99_s"]) for row in hot_table
                   if row["slots"] == k]
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], "o" + style,
                         label=f"{policy}, {k} slot(s)", markersize=4)
    _delay_axis(axes[0], BATCH_HOT_DELAYS_MS)
    axes[0].set_ylabel("p99 TTFT (s)")
    axes[0].set_title(f"{HOT}, {base.nodes} nodes, costs '{BATCH_PROFILE}'", fontsize=10)
    for skew, style in ((SKEWED, "-"), ("uniform", "--")):
        for policy in POLICIES:
            pts = [(row["delay_ms"], row[policy]["latency_mean_s"]) for row in sweep_table
                   if row["skew"] == skew]
            axes[1].plot([p[0] for p in pts], [p[1] for p in pts], "o" + style,
                         label=f"{policy}, {skew}", markersize=4)
    _delay_axis(axes[1], DELAYS_MS)
    axes[1].set_ylabel("mean latency (s)")
    axes[1].set_title(f"{BATCH_SLOTS[-1]} slots: latency against delay", fontsize=10)
    for k in BATCH_SLOTS:
        pts = curves[k]
        axes[2].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{k} slot(s)")
        axes[2].axhline(TTFT_KNEE * pts[0][1], linestyle=":", linewidth=0.8)
    axes[2].set_yscale("log")
    axes[2].set_xlabel("arrivals per node per second")
    axes[2].set_ylabel("mean TTFT (s)")
    axes[2].set_title(f"{HOT}, cost, 5 ms: load against TTFT", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(fig, out / "batch.png")
    return {"runs": results, "hot_table": hot_table, "loaded_table": loaded_table,
            "sweep_table": sweep_table, "knees": knees}


def print_batch_tables(data: dict[str, Any], log: Callable[[str], None]) -> None:
    log("hot:2: TTFT mean / p99 (s) per policy; cost p99 / longest_prefix p99")
    for row in data["hot_table"]:
        cells = "".join(
            f"  {p} {row[p]['ttft_mean_s']:.3f}/{row[p]['ttft_p99_s']:.3f}" for p in POLICIES
        )
        log(f"  slots {row['slots']} delay {row['delay_ms']:>3g}:{cells}  "
            f"ratio {row['p99_ttft_cost_over_lp']:.3f}")
    for row in data["loaded_table"]:
        log(f"  slots {row['slots']} rate {row['rate']:g}, 5 ms: " + "  ".join(
            f"{p} {row[p]['ttft_mean_s']:.3f}/{row[p]['ttft_p99_s']:.3f}"
            for p in ("longest_prefix", "cost")) + f"  ratio {row['p99_ttft_cost_over_lp']:.3f}")
    log("delay sweep (8 slots): mean latency; cost <= min(local, longest_prefix)")
    for row in data["sweep_table"]:
        log(f"  {row['skew']:<9} {row['delay_ms']:>4g} ms: " + "  ".join(
            f"{p} {row[p]['latency_mean_s']:.3f}" for p in POLICIES)
            + f"  {row['cost_le_best']} ({row['cost_margin']:+.1%})")
    k = data["knees"]
    log(f"load: knee rate (mean TTFT > {TTFT_KNEE:g}x idle) "
        + "  ".join(f"{s} slot(s): {k[str(s)]['knee_rate']}" for s in BATCH_SLOTS)
        + f"  ratio {k['ratio']}")


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"
