"""Prometheus metrics of one node (``GET /metrics``), on a registry of its own.

Two sources. Per-request figures (outcome, where served, TTFT, latency, cached vs computed
prompt tokens) are observed at the door: the node calls :meth:`NodeMetrics.observe` when a
request submitted through ``Node.submit`` ends. Everything else is read when scraped, from
the snapshots the node already keeps (``Node.statistics()``: the core's counters, load and
peers, the batch scheduler's counters, the traffic counters; and the engine's
``statistics()``), so there is no second copy of a counter to drift. A per-node ``CollectorRegistry`` (not the
process-global one) lets several in-process nodes export side by side.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from peerinfer.core.messages import ErrorMessage, GenerateDone
from peerinfer.engine.base import Engine
from peerinfer.engine.batch import SchedulerStatistics

if TYPE_CHECKING:
    from peerinfer.node import Node, Submission

logger = logging.getLogger("peerinfer.http")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: TTFT and latency buckets (seconds): a cached prompt on a GPU answers in milliseconds, a long
#: prefill on a CPU in tens of seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0)


class NodeMetrics:
    """The metrics of one node; ``render()`` is the ``/metrics`` body."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "peerinfer_requests", "Requests submitted through this node's door, by outcome "
            "(ok, cancelled, or the error code), where they were served (local, remote, none) "
            "and where they came from (local: this node's HTTP users; network: peers, clients)",
            ["outcome", "served", "source"], registry=self.registry,
        )
        self.ttft = Histogram(
            "peerinfer_ttft_seconds", "Time to first token of successful requests, at this "
            "node's door", ["source"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.latency = Histogram(
            "peerinfer_request_latency_seconds", "Whole-request latency of successful "
            "requests, at this node's door", ["source"], buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "peerinfer_prompt_tokens", "Prompt tokens of successful requests, by whether the "
            "serving peer's cache held them (cached) or it computed them (computed)", ["kind"],
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "peerinfer_completion_tokens", "Tokens generated for successful requests",
            registry=self.registry,
        )
        self.registry.register(_NodeCollector(node))

    def observe(self, submission: Submission, local: bool) -> None:
        """One request ended (a ``Node.request_listeners`` callback)."""
        source = "local" if local else "network"
        final = submission.final
        if isinstance(final, GenerateDone):
            served = "local" if final.served_by == self.node.peer_id else "remote"
            self.requests.labels("ok", served, source).inc()
            self.ttft.labels(source).observe(max(0.0, final.ttft_s))
            self.latency.labels(source).observe(max(0.0, final.latency_s))
            self.prompt_tokens.labels("cached").inc(final.cached_tokens)
            self.prompt_tokens.labels("computed").inc(
                max(0, final.prompt_tokens - final.cached_tokens)
            )
            self.completion_tokens.inc(final.completion_tokens)
        elif isinstance(final, ErrorMessage):
            self.requests.labels(final.code, "none", source).inc()
        else:
            self.requests.labels("cancelled", "none", source).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class _NodeCollector(Collector):
    """Reads the node's own snapshots at scrape time."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        node = self.node
        engine = node.engine
        if node.core is None or engine is None:
            return
        snapshot = node.statistics()
        stats = snapshot.core
        yield _counter("peerinfer_routing_requests", "Requests the core routed", stats.requests)
        yield _counter("peerinfer_served_locally", "Requests this node's engine served",
                       stats.served_locally)
        yield _counter("peerinfer_forwards", "Forwards to a peer (each attempt)", stats.forwarded)
        yield _counter("peerinfer_failovers", "Forwards that failed and were routed again",
                       stats.failovers)
        yield _counter("peerinfer_rejected", "Requests refused (busy, invalid)", stats.rejected)
        yield _counter("peerinfer_announces_sent", "Digest announcements published",
                       stats.announces_sent)
        yield _counter("peerinfer_syncs_started", "Anti-entropy sync sessions started",
                       stats.syncs_started)
        yield _counter("peerinfer_syncs_failed", "Anti-entropy sync sessions that failed",
                       stats.syncs_failed)
        load = snapshot.load
        yield _gauge("peerinfer_requests_queued", "Requests waiting for the local engine",
                     load.queued)
        yield _gauge("peerinfer_requests_running", "Requests the local engine runs now",
                     load.running)
        yield _gauge("peerinfer_engine_slots", "Requests the local engine runs at once",
                     load.slots)
        peers = snapshot.peers
        yield _gauge("peerinfer_peers_known", "Peers in the routing index", len(peers))
        ages = GaugeMetricFamily("peerinfer_peer_digest_age_seconds",
                                 "Age of each peer's digest replica", labels=["peer"])
        for p in peers:
            ages.add_metric([str(p.peer_id)], min(p.digest_age_s, 1e11))
        yield ages
        traffic = CounterMetricFamily(
            "peerinfer_traffic_bytes", "Anti-entropy bytes: announcements (gossip) and sync "
            "rounds, sent and received", labels=["kind", "direction"],
        )
        for (kind, direction), value in snapshot.traffic:
            traffic.add_metric([kind, direction], value)
        yield traffic
        yield from _engine_metrics(engine, snapshot.scheduler, load.running, load.slots)


def _engine_metrics(
    engine: Engine, sched: SchedulerStatistics | None, running: int, slots: int
) -> Iterator[Metric]:
    try:
        stats = engine.statistics()
    except Exception:  # a backend bug must not break the scrape
        logger.exception("engine statistics failed")
        return
    cache = stats.cache
    if cache is not None:
        yield _gauge("peerinfer_cache_bytes", "KV bytes the prefix cache holds", cache.bytes)
        yield _gauge("peerinfer_cache_tokens", "Tokens the prefix cache holds", cache.tokens)
        if cache.capacity_bytes:
            yield _gauge("peerinfer_cache_capacity_bytes", "The prefix cache's byte budget",
                         cache.capacity_bytes)
    disk = engine.disk_statistics()
    if disk is not None:
        yield _gauge("peerinfer_disk_cache_bytes", "Bytes of KV block files the disk tier holds",
                     disk.bytes)
        yield _gauge("peerinfer_disk_cache_blocks", "KV blocks the disk tier holds", disk.blocks)
        yield _gauge("peerinfer_disk_cache_capacity_bytes", "The disk tier's byte bound",
                     disk.capacity_bytes)
        yield _counter("peerinfer_disk_cache_hits", "Blocks loaded from the disk tier", disk.hits)
        yield _counter("peerinfer_disk_cache_writes", "Blocks written to the disk tier",
                       disk.writes)
        yield _counter("peerinfer_disk_cache_damaged",
                       "Damaged block files found (deleted and recomputed)", disk.damaged)
    yield _counter("peerinfer_engine_errors", "Requests the engine failed", stats.errors)
    per_token = int(getattr(engine, "kv_bytes_per_token", 0) or 0)
    if per_token:
        yield _gauge("peerinfer_kv_bytes_per_token", "KV bytes one token takes", per_token)
    if sched is None:
        yield _gauge("peerinfer_batch_occupancy", "Requests in the engine's running batch",
                     running)
        yield _gauge("peerinfer_batch_occupancy_ratio", "Running batch over its capacity",
                     running / max(1, slots))
        return
    yield _gauge("peerinfer_batch_occupancy", "Requests in the engine's running batch",
                 sched.running)
    yield _gauge("peerinfer_batch_occupancy_ratio", "Running batch over its capacity",
                 sched.running / max(1, sched.max_running))
    yield _gauge("peerinfer_batch_waiting", "Requests admitted by the core, waiting in the "
                 "scheduler for a batch place or KV memory", sched.waiting)
    yield _gauge("peerinfer_batch_prefilling", "Running requests still in prefill",
                 sched.prefilling)
    yield _gauge("peerinfer_batch_max_running", "The scheduler's batch capacity",
                 sched.max_running)
    yield _gauge("peerinfer_batch_mean_size", "Decoders per decode step, lifetime mean",
                 sched.mean_batch)
    yield _counter("peerinfer_batch_decode_steps", "Batched decode steps run", sched.decode_steps)
    yield _counter("peerinfer_batch_prefill_chunks", "Prefill chunks run", sched.prefill_chunks)
    yield _counter("peerinfer_batch_prefill_batches", "Prefill batches run (several newcomers' "
                   "chunks each where the engine batches its prefill)", sched.prefill_batches)
    yield _counter("peerinfer_batch_cancelled", "Requests the scheduler stopped on a cancel",
                   sched.cancelled)
    yield _counter("peerinfer_batch_retries", "Decode batches that failed and were retried "
                   "one by one", sched.batch_retries)
    yield _gauge("peerinfer_running_kv_bytes", "KV bytes reserved by the running requests",
                 sched.kv_reserved_bytes)
    if sched.kv_budget_bytes is not None:
        yield _gauge("peerinfer_kv_budget_bytes", "The byte budget running requests share "
                     "with the prefix cache", sched.kv_budget_bytes)


__all__ = ["CONTENT_TYPE", "NodeMetrics"]
