"""Assembling a run: the workload as token sequences, one simulated engine per node, the figures."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from peerinfer.core.messages import SamplingParams
from peerinfer.core.prefix import (
    DEFAULT_BLOCK_SIZE,
    SIM_PROMPT_MEMO_SIZE,
    PrefixHasher,
    scaffold_messages,
)
from peerinfer.engine.simulated import PlanMemo, SimulatedEngine
from peerinfer.errors import ConfigError
from peerinfer.sim.config import SimConfig
from peerinfer.sim.inputs import EngineLike, PlanLike, SimRequest
from peerinfer.sim.metrics import summarize
from peerinfer.sim.mix import node_cache_tokens, node_costs
from peerinfer.sim.simulator import Simulation
from peerinfer.types import BlockHash
from peerinfer.workload import (
    MMLU,
    WorkloadItem,
    default_data_dir,
    load_workload,
    mmlu_workload,
    multiturn_workload,
    rag_workload,
)

#: Synthetic multi-turn conversations open at once, and turns per conversation.
MULTITURN_CONVERSATIONS = 64
MULTITURN_TURNS = 8
#: Synthetic RAG: documents in the pool (drawn by the run's skew) under the four system prompts.
RAG_DOCUMENTS = 200
#: Each node's context: no prompt of a workload is cut.
SIM_MAX_CONTEXT = 1 << 20

_MMLU_CACHE: dict[str | None, MMLU] = {}


def _mmlu(data: str | None) -> MMLU:
    key = data
    if key not in _MMLU_CACHE:
        path = data if data is not None else default_data_dir()
        _MMLU_CACHE[key] = MMLU.load(path)
    return _MMLU_CACHE[key]


def workload_items(config: SimConfig) -> list[WorkloadItem]:
    """The run's workload items (prompts as text), from ``config.workload`` and its seed."""
    n = config.requests
    kw: dict[str, Any] = {}
    if config.max_tokens is not None:
        kw["max_tokens"] = config.max_tokens
    if config.workload == "mmlu":
        return mmlu_workload(_mmlu(config.data), n, skew=config.skew, seed=config.seed, **kw)
    if config.workload == "multiturn":
        return multiturn_workload(
            n,
            conversations=MULTITURN_CONVERSATIONS,
            turns=MULTITURN_TURNS,
            seed=config.seed,
            **kw,
        )
    if config.workload == "rag":
        return rag_workload(n, documents=RAG_DOCUMENTS, skew=config.skew, seed=config.seed, **kw)
    items = load_workload(config.workload)
    if config.max_tokens is not None:
        from dataclasses import replace

        items = [replace(it, max_tokens=config.max_tokens) for it in items]
    return items


def _label(item: WorkloadItem) -> str:
    if item.conversation is not None:
        return f"conversation {item.conversation}"
    key = item.prefix_key
    return key.split(":", 1)[1] if key.startswith("mmlu:") else key


class _Tokens:
    """Tokenizes prompts once each: the shared prefix and the suffix separately, joined when that
    equals tokenizing the whole prompt (the prefix ends in whitespace and the suffix does not
    start with it, so no token spans the seam)."""

    def __init__(self, engine: SimulatedEngine) -> None:
        self.engine = engine
        self._parts: dict[str, tuple[int, ...]] = {}
        self._prompts: dict[tuple[str, str], tuple[tuple[int, ...], int]] = {}

    def part(self, text: str) -> tuple[int, ...]:
        got = self._parts.get(text)
        if got is None:
            got = self._parts[text] = tuple(self.engine.tokenize(text))
        return got

    def __call__(self, prefix: str, suffix: str) -> tuple[tuple[int, ...], int]:
        """The prompt's tokens, and how many whole blocks of them are the prefix's (0 when the
        prefix's tokens are not the prompt's first ones: then no residency probe)."""
        key = (prefix, suffix)
        got = self._prompts.get(key)
        if got is None:
            seam_safe = (
                prefix and suffix and prefix[-1].isspace() and not suffix[0].isspace()
            )
            head = self.part(prefix) if prefix else ()
            if seam_safe:  # (so the prompt starts with the prefix's tokens)
                prompt = head + self.part(suffix)
                shared = len(head) // DEFAULT_BLOCK_SIZE
            else:
                prompt = tuple(self.engine.tokenize(prefix + suffix))
                shared = len(head) // DEFAULT_BLOCK_SIZE if prompt[: len(head)] == head else 0
            got = self._prompts[key] = (prompt, shared)
        return got


def sim_requests(config: SimConfig, engine: SimulatedEngine) -> list[SimRequest]:
    """The workload as the simulator's requests (token ids, sampling, label, scaffold hash)."""
    tokens = _Tokens(engine)
    # The swarm's hasher (engine_factory builds the same from the same fingerprint): the
    # scaffold hashes are salted with its key, as a real node's door salts them.
    hasher = PrefixHasher(engine.fingerprint)
    scaffolds: dict[tuple[tuple[str, str], ...], int | None] = {}
    params: dict[int, SamplingParams] = {}
    labels: dict[tuple[int | None, str], str] = {}
    out = []
    for item in workload_items(config):
        if item.scaffold in scaffolds:
            scaffold = scaffolds[item.scaffold]
        else:
            scaffold = scaffolds[item.scaffold] = hasher.scaffold_hash(
                scaffold_messages(item.scaffold)
            )
        p = params.get(item.max_tokens)
        if p is None:
            p = params[item.max_tokens] = SamplingParams(max_tokens=item.max_tokens)
        # The prefix's whole blocks (its tokens are a prefix of the prompt's when the seam is
        # safe; otherwise the residency probe is skipped for it).
        prompt, shared = tokens(item.prefix, item.suffix)
        label = labels.get((item.conversation, item.prefix_key))
        if label is None:
            label = labels[item.conversation, item.prefix_key] = _label(item)
        out.append(SimRequest(prompt, p, label, item.conversation, shared, scaffold))
    if config.requests and not out:
        raise ConfigError(f"the workload {config.workload!r} holds no requests")
    return out


class _EngineAdapter:
    """A node's ``SimulatedEngine`` as the simulator uses it."""

    __slots__ = ("engine", "plan", "cached", "disk_figure")

    def __init__(self, engine: SimulatedEngine) -> None:
        self.engine = engine
        self.plan: Callable[[Sequence[int], SamplingParams], PlanLike] = engine.plan
        cache = engine.radix_cache
        assert cache is not None
        disk = engine.disk_tier
        # Held means in memory or on disk, as the engine reports and a peer's pull is served.
        self.cached: Callable[[BlockHash], bool] = (
            cache.membership() if disk is None else lambda h: h in cache or h in disk
        )
        self.disk_figure: Callable[[int], tuple[int, int] | None] | None = (
            None if disk is None else engine.disk_figure
        )

    def restart(self, saved: bool) -> tuple[BlockHash, ...]:
        """The machine comes back (churn): the engine's memory is lost, its disk tier kept
        (``SimulatedEngine.restart``); what it holds now, as the node's runtime takes it at
        start (``cached_block_hashes``: the disk tier's blocks)."""
        self.engine.restart(saved=saved)
        return self.engine.cached_block_hashes()


def engine_factory(config: SimConfig) -> tuple[PrefixHasher, Callable[[int], EngineLike]]:
    """The swarm's prefix hasher and a builder of each node's simulated engine."""
    probe = SimulatedEngine(costs=config.costs)
    # One hasher for the swarm, with a memo for every distinct prompt of the workload (the
    # prompts repeat: each chain is hashed once, not once per request).
    hasher = PrefixHasher(probe.fingerprint, memo_size=SIM_PROMPT_MEMO_SIZE)
    # Likewise each distinct prompt is validated, and its completion hashed, once for the swarm.
    memo = PlanMemo(probe.vocab_size, SIM_MAX_CONTEXT, max_prompts=SIM_PROMPT_MEMO_SIZE)

    def make(index: int) -> EngineLike:
        # A mix (peerinfer.sim.mix) gives each node its machine's costs and cache size.
        engine = SimulatedEngine(
            costs=node_costs(config, index),
            max_context_tokens=SIM_MAX_CONTEXT,
            kv_bytes_per_token=config.kv_bytes_per_token,
        )
        engine.share_plan_memo(memo)
        engine.configure_cache(hasher, capacity_tokens=node_cache_tokens(config, index))
        if config.disk_cache_tokens:
            engine.configure_sim_disk(
                config.disk_cache_tokens * config.kv_bytes_per_token, config.disk_read_mb_s * 1e6
            )
        return _EngineAdapter(engine)

    return hasher, make


@contextmanager
def _no_collections() -> Iterator[None]:
    """The set-up allocates the workload's prompts and requests, which live for the whole run,
    and hardly any garbage: the collector's passes over them find nothing to free (0.15-0.3 s
    of the set-up's ~1.7 s of CPU at 100,000 requests). It is paused until the set-up ends (the
    run's loop then freezes what the set-up made: ``SimKernel._run``), and left as the caller
    had it. No decision reads an object's lifetime."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def simulate(
    config: SimConfig,
    *,
    series: int = 0,
    check: bool = False,
    requests: Sequence[SimRequest] | None = None,
) -> tuple[Simulation, dict[str, Any]]:
    """Build and run one simulation; returns it and its summary (``summarize``)."""
    started = time.perf_counter()
    with _no_collections():
        hasher, make = engine_factory(config)
        if requests is None:
            requests = sim_requests(config, SimulatedEngine(costs=config.costs))
        sim = Simulation(config, requests, hasher, make, check=check, probe_top=series)
    setup_s = time.perf_counter() - started
    sim.run()
    summary = summarize(sim, series=series)
    summary["setup_s"] = round(setup_s, 3)
    summary["loop_s"] = round(sim.wall_s, 3)
    summary["wall_s"] = round(time.perf_counter() - started, 3)
    summary["requests_per_wall_s"] = (
        round(sim.total / summary["wall_s"], 1) if summary["wall_s"] > 0 else None
    )
    return sim, summary


__all__ = ["engine_factory", "sim_requests", "simulate", "workload_items"]
