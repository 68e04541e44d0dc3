"""Figures of a finished run: latency percentiles, hit ratio, per-node load, anti-entropy cost,
and the per-node share of each subject over time (the paper's moving window)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from peerinfer.sim.simulator import Simulation


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values, linearly interpolated (as
    numpy's default); NaN when there are none."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def _r(x: float, digits: int = 6) -> float | None:
    """Rounded for JSON (NaN becomes null)."""
    return None if math.isnan(x) else round(x, digits)


def subject_shares(
    labels: Sequence[str],
    servers: Sequence[int],
    nodes: int,
    subject: str,
    window: int = 300,
    stride: int = 30,
) -> tuple[list[int], list[list[float]]]:
    """Per-node share of ``subject``'s requests in moving windows of ``window`` consecutive
    requests (arrival order), every ``stride`` requests: ``(window_ends, shares)`` where
    ``shares[w][k]`` is the fraction of the subject's requests in window ``w`` that node ``k``
    served (all zero when the window holds none)."""
    total = len(labels)
    # prefix sums per node of "request j is of the subject and served by k"
    counts = [0] * nodes
    prefix: list[list[int]] = [[0] * nodes]
    for j in range(total):
        if labels[j] == subject and servers[j] >= 0:
            counts[servers[j]] += 1
        prefix.append(list(counts))
    ends: list[int] = []
    shares: list[list[float]] = []
    if total < window:
        window = total
    if window == 0:
        return ends, shares
    for end in range(window, total + 1, stride):
        a, b = prefix[end - window], prefix[end]
        diff = [b[k] - a[k] for k in range(nodes)]
        s = sum(diff)
        ends.append(end)
        shares.append([d / s for d in diff] if s else [0.0] * nodes)
    return ends, shares


def specialization(shares: Sequence[Sequence[float]]) -> dict[str, float | int | None]:
    """How concentrated a subject is: the mean over windows of the largest node share, and how
    often the node holding the largest share changes from one window to the next."""
    if not shares:
        return {"top_share_mean": None, "leader_changes": 0}
    tops = [max(w) for w in shares if any(w)]
    leaders = [max(range(len(w)), key=w.__getitem__) for w in shares if any(w)]
    changes = sum(1 for a, b in zip(leaders, leaders[1:], strict=False) if a != b)
    return {"top_share_mean": _r(_mean(tops), 4), "leader_changes": changes}


def estimate_accuracy(sim: Simulation, done: Sequence[int]) -> dict[str, Any]:
    """How the routing policy's own TTFT estimates (``cost`` makes them) compare with the TTFT
    that followed, split by first decision (served locally / forwarded)."""
    out: dict[str, Any] = {}
    for name, code in (("local", 1), ("remote", 2)):
        chosen = [i for i in done if sim.decided[i] == code and not math.isnan(sim.estimate[i])]
        pairs = [(sim.estimate[i], sim.first[i] - sim.arrival[i]) for i in chosen]
        if not pairs:
            continue
        errors = sorted(actual - est for est, actual in pairs)
        out[name] = {
            "requests": len(pairs),
            "estimated_ttft_mean_s": _r(_mean([e for e, _ in pairs])),
            "actual_ttft_mean_s": _r(_mean([a for _, a in pairs])),
            "error_mean_s": _r(_mean(errors)),
            "error_p90_s": _r(percentile(errors, 90)),
            "underestimated_by_100ms": _r(sum(1 for e in errors if e > 0.1) / len(errors), 4),
            "expected_cached_tokens_mean": _r(_mean([sim.expected_cached[i] for i in chosen]), 1),
            "cached_tokens_mean": _r(_mean([sim.cached[i] for i in chosen]), 1),
            "queue_wait_mean_s": _r(_mean([sim.queue_wait[i] for i in chosen])),
        }
    return out


def summarize(sim: Simulation, *, series: int = 0) -> dict[str, Any]:
    """The run's figures as one JSON-ready dict (``series`` > 0 adds the share series of the
    ``series`` most frequent labels)."""
    cfg = sim.config
    done = [i for i in range(sim.total) if sim.status[i] == 1]
    ttft = sorted(sim.first[i] - sim.arrival[i] for i in done)
    latency = sorted(sim.finish[i] - sim.arrival[i] for i in done)
    prompt_tokens = sum(sim.prompt[i] for i in done)
    cached_tokens = sum(sim.cached[i] for i in done)
    forwarded = sum(1 for i in done if sim.server[i] != sim.origin[i])
    makespan = max((sim.finish[i] for i in range(sim.total)), default=0.0)
    stats = [c.statistics() for c in sim.cores]
    pull_bytes = sim.pull_request_bytes + sim.pull_response_bytes
    sync_bytes = sim.announce_bytes + pull_bytes

    entered = Counter(sim.origin)
    nodes = []
    # With churn: the newcomers that joined too (not the slots left for joins that never came).
    ever = range(cfg.nodes) if sim.churn is None else sorted({*range(cfg.nodes), *sim.churn.joined_at})
    for k in ever:
        waits = sorted(sim.waits[k])
        st = stats[k]
        nodes.append(
            {
                "node": k,
                "served": sim.served[k],
                "entered": entered[k],
                "utilization": _r(sim.busy_s[k] / makespan if makespan else 0.0, 4),
                "hit_ratio": _r(sim.node_cached[k] / sim.node_prompt[k], 4)
                if sim.node_prompt[k]
                else None,
                "queue_wait_mean_s": _r(_mean(waits)),
                "queue_wait_p99_s": _r(percentile(waits, 99)),
                # Little's law: the time-averaged number of requests waiting in the queue
                "queue_length_mean": _r(math.fsum(waits) / makespan if makespan else 0.0, 4),
                "forwarded": st.forwarded,
                "failovers": st.failovers,
                "rejected": st.rejected,
            }
        )
    served = [x["served"] for x in nodes]
    mean_served = sum(served) / len(served) if served else 0.0
    out: dict[str, Any] = {
        "ttft_mean_s": _r(_mean(ttft)),
        "ttft_p50_s": _r(percentile(ttft, 50)),
        "ttft_p99_s": _r(percentile(ttft, 99)),
        "latency_mean_s": _r(_mean(latency)),
        "latency_p50_s": _r(percentile(latency, 50)),
        "latency_p99_s": _r(percentile(latency, 99)),
        "hit_ratio": _r(cached_tokens / prompt_tokens if prompt_tokens else 0.0, 4),
        "sync_bytes": sync_bytes,
        "requests": sim.total,
        "completed": len(done),
        "rejected": sim.rejected,
        "forwarded_fraction": _r(forwarded / len(done) if done else 0.0, 4),
        "forwards": sum(st.forwarded for st in stats),
        "failovers": sum(st.failovers for st in stats),
        "virtual_s": _r(makespan, 3),
        "events": sim.events,
        "wall_s": round(sim.wall_s, 3),
        "requests_per_wall_s": round(sim.total / sim.wall_s, 1) if sim.wall_s > 0 else None,
        "anti_entropy": {
            "bytes": sync_bytes,
            "bytes_per_request": _r(sync_bytes / sim.total if sim.total else 0.0, 1),
            "bytes_per_node_per_s": _r(sync_bytes / cfg.nodes / makespan if makespan else 0.0, 1),
            "announces": sim.announces,
            "announce_deliveries": sim.announce_deliveries,
            "announces_lost": sim.announces_lost,
            "announce_bytes": sim.announce_bytes,
            "announces_refused": sum(st.announces_refused for st in stats),
            "pulls_started": sum(st.syncs_started for st in stats),
            "pulls_converged": sum(st.syncs_converged for st in stats),
            "pulls_failed": sum(st.syncs_failed for st in stats),
            "pull_round_trips": sim.pull_requests,
            "pull_bytes": pull_bytes,
            "messages": sim.announce_deliveries + 2 * sim.pull_requests,
        },
        "load": {
            "served_max_over_mean": _r(max(served) / mean_served if mean_served else 0.0, 3),
            "utilization_max": max((x["utilization"] or 0.0 for x in nodes), default=0.0),
            "queue_wait_mean_s": _r(_mean([w for ws in sim.waits for w in ws])),
        },
        "nodes": nodes,
    }
    if sim.churn is not None:
        out["churn"] = sim.churn.summary()
    if sim.mesh is not None:
        out["mesh"] = sim.mesh.summary(makespan)
    if cfg.mix:
        from peerinfer.sim.mix import traffic_by_class

        out["mix"] = traffic_by_class(sim, list(ever), makespan)
    out["route_estimates"] = estimate_accuracy(sim, done)
    labels = [sim.workload[i % len(sim.workload)].label for i in range(sim.total)] if sim.total else []
    freq = Counter(labels)
    top = [label for label, _ in freq.most_common(max(1, series))] if labels else []
    spec: dict[str, Any] = {}
    for label in top[:1]:
        _, shares = subject_shares(
            labels, sim.server, len(sim.cores), label, cfg.share_window, cfg.share_stride
        )
        spec = {"subject": label, **specialization(shares)}
    out["specialization"] = spec
    if series:
        out["share_series"] = {}
        for label in top[:series]:
            ends, shares = subject_shares(
                labels, sim.server, len(sim.cores), label, cfg.share_window, cfg.share_stride
            )
            out["share_series"][label] = {
                "window_end": ends,
                "share": [[round(x, 4) for x in w] for w in shares],
            }
            if label in sim.residency:
                # which nodes held the label's whole shared prefix, sampled every stride
                out["share_series"][label]["holders"] = [
                    [i, nodes] for i, nodes in sim.residency[label]
                ]
    out["params"] = cfg.to_dict()
    return out


__all__ = ["percentile", "specialization", "subject_shares", "summarize"]
