"""Mixed machines: each simulated node's cost model and cache size, drawn from a mix of classes.

A mix is text, ``CLASS:SHARE[:CACHE_TOKENS],...``, each class a cost preset of
``peerinfer.sim.costs.COST_PRESETS`` (``gpu:0.25,default:0.75``: a quarter of the nodes are
home GPUs, the rest CPUs; ``gpu:0.25:32768,default:0.75``: the GPUs also cache 32,768 tokens),
or the path of a JSON file holding a list of classes::

    [{"name": "gpu", "share": 0.25, "costs": "gpu", "cache_tokens": 32768},
     {"name": "cpu", "share": 0.75, "costs": {"prefill_s_per_token": 0.003, ...}}]

(``costs``: a preset name, a cost-model dict, or a file ``load_costs`` reads; ``cache_tokens``
defaults to the run's ``cache_tokens``). Shares are normalized. The starting nodes get the
classes in exact proportions (largest remainders), in an order shuffled by the run's seed; a
newcomer (churn) draws its class by the shares, from its slot's own seeded draw. The same
config gives every node the same class in every run.

Each node's ``NodeCore`` runs with its class's cost model, and so announces its speed
(``Load.speed``): the ``cost`` policy of every other node estimates it at that speed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from peerinfer.core.costmodel import CostModel
from peerinfer.errors import ConfigError
from peerinfer.sim.costs import COST_PRESETS, load_costs


@dataclass(frozen=True, slots=True)
class MachineClass:
    """One kind of machine of a mix: its name, share of the nodes, costs and cache size."""

    name: str
    share: float
    costs: CostModel
    cache_tokens: int | None


def parse_mix(spec: str, default_cache: int | None) -> tuple[MachineClass, ...]:
    """The classes of a mix spec or file (see the module docstring); ConfigError if bad."""
    text = spec.strip()
    if not text:
        raise ConfigError("an empty mix")
    raw: list[dict[str, Any]]
    if text.endswith(".json") or Path(text).is_file():
        try:
            data = json.loads(Path(text).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the mix {text}: {exc}") from exc
        if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
            raise ConfigError(f"{text}: a mix file holds a list of classes (objects)")
        raw = data
    else:
        raw = []
        for part in text.split(","):
            fields = part.strip().split(":")
            if len(fields) not in (2, 3):
                raise ConfigError(f"bad mix entry {part!r}: use CLASS:SHARE[:CACHE_TOKENS]")
            entry: dict[str, Any] = {"name": fields[0], "costs": fields[0], "share": fields[1]}
            if len(fields) == 3:
                entry["cache_tokens"] = fields[2]
            if fields[0] not in COST_PRESETS:
                raise ConfigError(
                    f"unknown machine class {fields[0]!r} in the mix; presets: "
                    f"{', '.join(COST_PRESETS)} (or give a JSON file)"
                )
            raw.append(entry)
    classes = []
    for d in raw:
        name = str(d.get("name", ""))
        if not name:
            raise ConfigError("a mix class needs a name")
        try:
            share = float(d.get("share", 0))
            cache = d.get("cache_tokens", default_cache)
            cache = None if cache is None else int(cache)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"mix class {name!r}: {exc}") from exc
        if not share > 0 or share == float("inf"):
            raise ConfigError(f"mix class {name!r}: the share must be a positive number")
        if cache is not None and cache < 0:
            raise ConfigError(f"mix class {name!r}: cache_tokens must be >= 0")
        costs_spec = d.get("costs", name)
        costs = (
            CostModel.from_dict(costs_spec) if isinstance(costs_spec, dict) else load_costs(str(costs_spec))
        )
        classes.append(MachineClass(name, share, costs, cache))
    if len({c.name for c in classes}) != len(classes):
        raise ConfigError("the mix names a class twice")
    total = sum(c.share for c in classes)
    return tuple(MachineClass(c.name, c.share / total, c.costs, c.cache_tokens) for c in classes)


@lru_cache(maxsize=16)
def _assignment(spec: str, default_cache: int | None, nodes: int, seed: int) -> tuple[
    tuple[MachineClass, ...], tuple[int, ...]
]:
    classes = parse_mix(spec, default_cache)
    exact = [c.share * nodes for c in classes]
    counts = [int(x) for x in exact]
    # Largest remainders (ties: the class listed first) take the nodes left.
    order = sorted(range(len(classes)), key=lambda k: (-(exact[k] - counts[k]), k))
    for k in order[: nodes - sum(counts)]:
        counts[k] += 1
    of_node = [k for k, n in enumerate(counts) for _ in range(n)]
    random.Random(f"{seed}:mix").shuffle(of_node)
    return classes, tuple(of_node)


def node_class(config: Any, index: int) -> MachineClass | None:
    """Node ``index``'s machine class under ``config.mix`` (None: no mix, every node is
    ``config.costs`` with ``config.cache_tokens``)."""
    if not config.mix:
        return None
    classes, of_node = _assignment(config.mix, config.cache_tokens, config.nodes, config.seed)
    if index < len(of_node):
        return classes[of_node[index]]
    draw = random.Random(f"{config.seed}:mix:{index}").random()
    acc = 0.0
    for c in classes:
        acc += c.share
        if draw < acc:
            return c
    return classes[-1]


def node_costs(config: Any, index: int) -> CostModel:
    """Node ``index``'s cost model."""
    c = node_class(config, index)
    return config.costs if c is None else c.costs


def node_cache_tokens(config: Any, index: int) -> int | None:
    """Node ``index``'s prefix cache capacity in tokens."""
    c = node_class(config, index)
    return config.cache_tokens if c is None else c.cache_tokens


def traffic_by_class(sim: Any, nodes: list[int], makespan: float) -> dict[str, Any]:
    """Where the traffic went, per machine class: nodes, the share of requests served (and of
    the users' requests that entered there), mean utilization, token hit ratio, and the mean
    TTFT of the requests each class served."""
    cfg = sim.config
    served_total = sum(sim.served[k] for k in nodes) or 1
    entered: dict[int, int] = {}
    for o in sim.origin:
        entered[o] = entered.get(o, 0) + 1
    ttft_by_server: dict[int, list[float]] = {}
    for i in range(sim.total):
        if sim.status[i] == 1:
            ttft_by_server.setdefault(sim.server[i], []).append(sim.first[i] - sim.arrival[i])
    out: dict[str, Any] = {}
    for k in nodes:
        c = node_class(cfg, k)
        name = c.name if c is not None else "all"
        row = out.setdefault(
            name, {"nodes": 0, "served": 0, "entered": 0, "busy_s": 0.0, "cached": 0, "prompt": 0, "ttft": []}
        )
        row["nodes"] += 1
        row["served"] += sim.served[k]
        row["entered"] += entered.get(k, 0)
        row["busy_s"] += sim.busy_s[k]
        row["cached"] += sim.node_cached[k]
        row["prompt"] += sim.node_prompt[k]
        row["ttft"].extend(ttft_by_server.get(k, ()))
    total_entered = sum(r["entered"] for r in out.values()) or 1
    result = {}
    for name, r in sorted(out.items()):
        ttft = r["ttft"]
        result[name] = {
            "nodes": r["nodes"],
            "served_share": round(r["served"] / served_total, 4),
            "entered_share": round(r["entered"] / total_entered, 4),
            "served_per_node": round(r["served"] / r["nodes"], 1),
            "utilization_mean": round(r["busy_s"] / r["nodes"] / makespan, 4) if makespan else None,
            "hit_ratio": round(r["cached"] / r["prompt"], 4) if r["prompt"] else None,
            "ttft_mean_s": round(sum(ttft) / len(ttft), 4) if ttft else None,
        }
    return result


__all__ = [
    "MachineClass",
    "node_cache_tokens",
    "node_class",
    "node_costs",
    "parse_mix",
    "traffic_by_class",
]
