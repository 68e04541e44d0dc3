"""Figures of a finished run: latency percentiles, hit ratio, per-node load, anti-entropy cost,
the per-node share of each subject over time (the paper's moving window), and what the run
cost the machine: replica memory per node, CPU time and peak resident memory."""

from __future__ import annotations

import gc
import math
import resource
import sys
import time
import types
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
    churn = sim.churn  # with restarts, a node's counters over each core its machine ran
    stats = [c.statistics() for c in sim.cores] if churn is None else [
        churn.statistics(k) for k in range(len(sim.cores))]
    pull_bytes = sim.pull_request_bytes + sim.pull_response_bytes
    sync_bytes = sim.announce_bytes + pull_bytes

    entered = Counter(sim.origin)
    nodes: list[dict[str, Any]] = []
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
            "announce_bytes_per_node_per_s": _r(
                sim.announce_bytes / cfg.nodes / makespan if makespan else 0.0, 1
            ),
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
    if cfg.disk_cache_tokens:
        disk_tokens = sum(sim.disk_tokens[i] for i in done)
        out["disk"] = {
            "tokens_read": disk_tokens,
            # of the prompt tokens, those read from a disk tier (counted in hit_ratio too)
            "hit_ratio": _r(disk_tokens / prompt_tokens if prompt_tokens else 0.0, 4),
            "requests": sum(1 for i in done if sim.disk_tokens[i]),
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


# ------------------------------------------------------------------------------ memory and CPU

#: Objects a size walk does not enter: code and classes are shared by every node, not state.
_NOT_STATE = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.CodeType,
    types.FrameType,
)


def deep_size(
    root: object, *, stop: tuple[type, ...] = (), by_type: Counter[str] | None = None
) -> tuple[int, int]:
    """``(bytes, objects)`` reachable from ``root`` (``sys.getsizeof`` of each object once,
    following ``gc.get_referents``), not entering classes, modules, functions, code, frames
    or instances of ``stop``; ``by_type`` (if given) is added the bytes per type name. Objects
    ``root`` shares with others are counted in full: for a node's index that is the memory a
    node running alone would hold. Not counted: the keys of string-keyed dicts (CPython does
    not report them; they are attribute names, interned and shared) and the attribute values
    array of a plain instance (its values are). The walk is bounded by what ``root`` reaches;
    its own bookkeeping is one id per object."""
    seen: set[int] = set()
    stack: list[object] = [root]
    total = count = 0
    skip = _NOT_STATE + stop
    while stack:
        obj = stack.pop()
        key = id(obj)
        if key in seen:
            continue
        seen.add(key)
        if isinstance(obj, skip):
            continue
        size = sys.getsizeof(obj)
        total += size
        count += 1
        if by_type is not None:
            by_type[type(obj).__name__] += size
        stack.extend(gc.get_referents(obj))
    return total, count


def replica_memory(sim: Simulation, *, sample: int = 4) -> dict[str, Any]:
    """Replica memory per node (of the nodes live at the end) at the end of ``sim``'s run.

    *Counted* (exact, every node): replicas per node, replica entries per node (the block
    hashes all of a node's replicas hold, ``PeerIndex.replica_blocks``) and the index's own
    hash-keyed entries (``PeerIndex.memory_entries``: combined masks, speculative entries).
    *Measured* (``sample`` nodes spread over the swarm): the bytes reachable from a node's
    ``PeerIndex`` (its replicas with their digests and sets, the per-peer state, the mask dict
    and its big-integer masks, the routing byte tables), by ``deep_size``; block-hash ints that
    the simulator's nodes share are counted in every node, as a real node holds its own."""
    from peerinfer.core.node import NodeCore

    # With churn a slot of a node that left, crashed or has not joined holds a stand-in.
    indexes = [core.index for core in sim.cores if isinstance(core, NodeCore)]
    n = len(indexes)
    if n == 0:
        return {}
    replicas = [len(ix) for ix in indexes]
    entries = [ix.replica_blocks() for ix in indexes]
    index_entries = [ix.memory_entries() for ix in indexes]
    k = max(1, min(sample, n))
    picked = sorted({(j * n) // k for j in range(k)})
    kinds: Counter[str] = Counter()
    sizes = [deep_size(indexes[j], stop=(NodeCore,), by_type=kinds) for j in picked]
    walked = [b for b, _ in sizes]
    walked_entries = sum(entries[j] for j in picked)
    return {
        "nodes": n,
        "replicas_per_node": round(sum(replicas) / n, 1),
        "replica_entries_per_node": round(sum(entries) / n, 1),
        "replica_entries_max": max(entries),
        "index_entries_per_node": round(sum(index_entries) / n, 1),
        "sampled_nodes": picked,
        "index_bytes_per_node": round(sum(walked) / len(walked)),
        "index_bytes_max": max(walked),
        "index_objects_per_node": round(sum(c for _, c in sizes) / len(sizes)),
        "bytes_per_replica_entry": round(sum(walked) / walked_entries, 1)
        if walked_entries
        else None,
        # where the bytes are, per sampled node: sets (replica elements), dicts (the mask
        # dict, per-peer dicts), int (hashes and masks), tuple (the routing byte tables), ...
        "index_bytes_per_node_by_type": {
            name: round(b / len(picked)) for name, b in kinds.most_common(8)
        },
    }


def _peak_rss_kb() -> int | None:
    """This process's peak resident size in KiB since the last ``reset_peak_rss`` (Linux's
    ``VmHWM``; elsewhere ``ru_maxrss``, the peak since the process started)."""
    hwm = _proc_status_kb("VmHWM:")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if peak else None


def _rss_kb() -> int | None:
    return _proc_status_kb("VmRSS:")


def _proc_status_kb(field: str) -> int | None:
    """A KiB figure of /proc/self/status (``field`` with its colon), or None (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class ProcessUsage:
    """CPU time and resident memory of this process over a block (one run)::

        usage = ProcessUsage()          # resets the peak where Linux allows it
        ... run ...
        figures = usage.figures()      # cpu_s, rss_start_mb, rss_end_mb, peak_rss_mb

    ``peak_rss_reset`` says whether the peak is this block's (Linux: ``clear_refs`` resets
    ``VmHWM``) or the process's since it started (then an upper bound)."""

    def __init__(self) -> None:
        self.peak_rss_reset = False
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.peak_rss_reset = True
        except OSError:
            pass
        self._rss_start = _rss_kb()
        self._cpu_start = time.process_time()
        self._wall_start = time.perf_counter()

    def figures(self) -> dict[str, Any]:
        def mb(kb: int | None) -> float | None:
            return None if kb is None else round(kb / 1024, 1)

        return {
            "cpu_s": round(time.process_time() - self._cpu_start, 2),
            "wall_s": round(time.perf_counter() - self._wall_start, 2),
            "rss_start_mb": mb(self._rss_start),
            "rss_end_mb": mb(_rss_kb()),
            "peak_rss_mb": mb(_peak_rss_kb()),
            "peak_rss_reset": self.peak_rss_reset,
        }


__all__ = [
    "ProcessUsage",
    "deep_size",
    "percentile",
    "replica_memory",
    "specialization",
    "subject_shares",
    "summarize",
]
