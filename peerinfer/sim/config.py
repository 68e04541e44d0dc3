"""The simulator's one configuration object: every parameter of a run, seed included."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from peerinfer.core.costmodel import BATCHED_COSTS, DEFAULT_COSTS, CostModel
from peerinfer.core.node import NodeConfig
from peerinfer.core.routing import POLICY_NAMES
from peerinfer.errors import ConfigError
from peerinfer.sim.network import DelayModel

#: The policies a simulated node may run: the core's, and the simulator-only oracle router
#: (``peerinfer.sim.oracle``: exact, instant knowledge of every node; the upper bound).
SIM_POLICY_NAMES = (*POLICY_NAMES, "oracle")


def _node_default(name: str) -> Any:
    """NodeConfig's default for ``name``: the simulated nodes are tuned like real ones."""
    return NodeConfig.__dataclass_fields__[name].default


@dataclass(frozen=True, slots=True)
class SimConfig:
    """A simulation run. Two runs with equal configs produce equal results (``wall_s`` aside).

    Arrivals are Poisson at ``rate`` requests per second *per node* (each node is one home
    user's entry point, so the offered load per node stays the same as the swarm grows), each
    request entering at a node drawn uniformly (a conversation's turns all enter at the same
    node, ``conversation % nodes``), unless ``clients`` > 0: then that many closed-loop clients,
    client ``c`` attached to node ``c % nodes``, each sending its next request ``think_s``
    (exponential mean) after the previous one completed.
    """

    nodes: int = 8
    requests: int = 2000
    policy: str = "cost"
    #: one-way link delay spec in ms (see ``peerinfer.sim.network``)
    delay_ms: str = "5"
    #: added to the link delay of every forwarded request: opening a stream to the peer and
    #: handing it the request (measured by bench/cluster_bench.py on the real shell)
    forward_overhead_ms: float = 0.0
    announce_interval_s: float = _node_default("announce_interval_s")
    min_announce_gap_s: float = _node_default("min_announce_gap_s")
    sync_timeout_s: float = _node_default("sync_timeout_s")
    #: per-node prefix cache capacity in tokens (None: unbounded)
    cache_tokens: int | None = 8192
    costs: CostModel = DEFAULT_COSTS
    #: where the cost model came from ("default" or a file path), for the record
    costs_source: str = "default"
    #: about 40% utilization of a node serving its own requests with the default costs
    rate: float = 0.25
    clients: int = 0
    think_s: float = 0.0
    workload: str = "mmlu"
    skew: str = "zipf:1.1"
    #: MMLU directory (``dev/`` and ``test/`` CSVs); None: the packaged excerpt
    data: str | None = None
    max_tokens: int | None = None
    #: forwarded requests are refused as busy beyond this many queued on the target
    max_queue: int = _node_default("max_queue")
    first_token_timeout_s: float = _node_default("first_token_timeout_s")
    #: probability that one delivery of an announcement is lost (gossipsub may drop)
    gossip_loss: float = 0.0
    #: churn (peerinfer.sim.churn), per node-hour: crashes, graceful leaves, and joins of new
    #: nodes (each live node "brings" newcomers at ``join_rate``); all 0: a fixed swarm
    crash_rate: float = 0.0
    leave_rate: float = 0.0
    join_rate: float = 0.0
    #: how a crash shows: "reset" (the process died, its machine resets the connections, so
    #: streams to it fail at once) or "silent" (the machine vanished: timeouts and pings tell)
    crash_mode: str = "reset"
    #: mixed machines (peerinfer.sim.mix): "" (every node ``costs`` and ``cache_tokens``), a
    #: spec ``gpu:0.25,default:0.75`` or a JSON file of classes
    mix: str = ""
    #: how announcements spread: "broadcast" (direct to every node, what the real node's
    #: measurements match) or "mesh" (gossipsub's mesh, peerinfer.sim.gossip)
    gossip: str = "broadcast"
    #: the mesh's degree D and heartbeat interval (gossipsub's defaults: 6 and 1 s)
    mesh_degree: int = 6
    mesh_heartbeat_s: float = 1.0
    #: arrivals enter at the first ``entries`` nodes only (0: at every node): fewer entry
    #: nodes, fewer routers; the dilution experiment (bench/policy_bench.py dilution)
    entries: int = 0
    seed: int = 0
    #: moving window (requests) and stride for the per-node subject share series
    share_window: int = 300
    share_stride: int = 30

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"nodes must be >= 1, got {self.nodes}")
        if self.requests < 0:
            raise ConfigError(f"requests must be >= 0, got {self.requests}")
        if self.policy not in SIM_POLICY_NAMES:
            raise ConfigError(f"unknown policy {self.policy!r}; choose one of {SIM_POLICY_NAMES}")
        if not 0 <= self.entries <= self.nodes:
            raise ConfigError(f"entries must be in [0, nodes={self.nodes}], got {self.entries}")
        if self.policy == "oracle" and self.churn:
            raise ConfigError("the oracle router does not support churn")
        if self.entries and self.churn:
            raise ConfigError("entries (arrivals at the first nodes only) does not support churn")
        DelayModel.parse(self.delay_ms)
        if not (0.0 <= self.forward_overhead_ms < math.inf):
            raise ConfigError(
                f"forward_overhead_ms must be a non-negative number, got {self.forward_overhead_ms!r}"
            )
        for name in ("announce_interval_s", "sync_timeout_s", "first_token_timeout_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"{name} must be a positive number, got {v!r}")
        if not (self.min_announce_gap_s >= 0):
            raise ConfigError("min_announce_gap_s must be >= 0")
        if self.cache_tokens is not None and self.cache_tokens < 0:
            raise ConfigError("cache_tokens must be >= 0")
        if self.clients < 0:
            raise ConfigError("clients must be >= 0")
        if self.clients == 0 and not (self.rate > 0 and math.isfinite(self.rate)):
            raise ConfigError(f"rate must be a positive number, got {self.rate!r}")
        if self.think_s < 0:
            raise ConfigError("think_s must be >= 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError("max_tokens must be >= 1")
        if self.share_window < 1 or self.share_stride < 1:
            raise ConfigError("share window and stride must be >= 1")
        if not (0.0 <= self.gossip_loss < 1.0):
            raise ConfigError(f"gossip_loss must be in [0, 1), got {self.gossip_loss!r}")
        if self.max_queue < 0:
            raise ConfigError("max_queue must be >= 0")
        for name in ("crash_rate", "leave_rate", "join_rate"):
            v = getattr(self, name)
            if not (0.0 <= v < math.inf):
                raise ConfigError(f"{name} must be a non-negative number (per node-hour), got {v!r}")
        if self.crash_mode not in ("reset", "silent"):
            raise ConfigError(f"crash_mode must be 'reset' or 'silent', got {self.crash_mode!r}")
        if self.churn and self.clients:
            raise ConfigError("churn needs open-loop arrivals (--rate), not --clients")
        if self.mix:
            from peerinfer.sim.mix import parse_mix

            parse_mix(self.mix, self.cache_tokens)  # a bad mix fails here, not mid-run
        if self.gossip not in ("broadcast", "mesh"):
            raise ConfigError(f"gossip must be 'broadcast' or 'mesh', got {self.gossip!r}")
        if self.mesh_degree < 1:
            raise ConfigError(f"mesh_degree must be >= 1, got {self.mesh_degree}")
        if not (self.mesh_heartbeat_s > 0 and math.isfinite(self.mesh_heartbeat_s)):
            raise ConfigError(f"mesh_heartbeat_s must be a positive number, got {self.mesh_heartbeat_s!r}")

    @property
    def churn(self) -> bool:
        """Whether nodes join, leave or crash during the run."""
        return bool(self.crash_rate or self.leave_rate or self.join_rate)

    @property
    def delay(self) -> DelayModel:
        return DelayModel.parse(self.delay_ms)

    def to_dict(self) -> dict[str, Any]:
        """Every parameter, JSON-ready (the cost model as its figures)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if isinstance(v, CostModel) else v
        out["delay_ms"] = self.delay.spec()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SimConfig:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if isinstance(kw.get("costs"), dict):
            kw["costs"] = CostModel.from_dict(kw["costs"])
        return cls(**kw)


#: Named cost models for ``--costs``. ``default`` is ``DEFAULT_COSTS`` (a small model on a CPU:
#: prefill dominates and is slow next to any network delay). ``gpu`` is a home GPU serving a
#: 7-8B model (about 6,700 prompt tokens/s, 45 generated tokens/s): prefill is cheap enough that
#: a few tens of milliseconds of network delay cost as much as a cache hit saves. ``batched``
#: is ``BATCHED_COSTS``: the small model on the CPU, calibrated with its decode step time by
#: batch size, served 8 at a time.
COST_PRESETS: dict[str, CostModel] = {
    "default": DEFAULT_COSTS,
    "batched": BATCHED_COSTS,
    "gpu": CostModel(
        prefill_s_per_token=0.00015,
        cached_s_per_token=0.000005,
        decode_s_per_token=0.022,
        overhead_s=0.015,
        slots=1,
    ),
    # Issue 25's mixed engines: SmolLM2-135M-Instruct on one CPU thread, from the probes of
    # /work/shared/probes/README.md and issue 20 (llama.cpp, Q4_1 GGUF: ~150 prompt tokens/s,
    # ~45 generated tokens/s; Transformers, float32: ~380 prompt tokens/s, 15.7 generated
    # tokens/s). To be replaced by ``peerinfer calibrate --engine llamacpp`` figures once that
    # engine lands. The per-request overhead and cached-token cost are the default model's.
    "llamacpp": CostModel(
        prefill_s_per_token=1 / 150,
        cached_s_per_token=DEFAULT_COSTS.cached_s_per_token,
        decode_s_per_token=1 / 45,
        overhead_s=DEFAULT_COSTS.overhead_s,
        slots=1,
    ),
    "transformers": CostModel(
        prefill_s_per_token=1 / 380,
        cached_s_per_token=DEFAULT_COSTS.cached_s_per_token,
        decode_s_per_token=1 / 15.7,
        overhead_s=DEFAULT_COSTS.overhead_s,
        slots=1,
    ),
}


def load_costs(path: str | Path) -> CostModel:
    """A cost model from a preset name (``COST_PRESETS``) or a JSON file: ``peerinfer
    calibrate``'s output, or a bare CostModel dict.

    The figures may sit at the top level or under a ``"costs"`` / ``"cost_model"`` key.
    """
    if str(path) in COST_PRESETS:
        return COST_PRESETS[str(path)]
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the cost model {path}: {exc}") from exc
    if isinstance(data, dict):
        for key in ("costs", "cost_model"):
            if isinstance(data.get(key), dict):
                data = data[key]
                break
    if not isinstance(data, dict) or "prefill_s_per_token" not in data:
        raise ConfigError(f"{path} holds no cost model (no prefill_s_per_token)")
    return CostModel.from_dict(data)


__all__ = ["COST_PRESETS", "SIM_POLICY_NAMES", "SimConfig", "load_costs"]
