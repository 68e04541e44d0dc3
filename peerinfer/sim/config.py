"""The simulator's one configuration object: every parameter of a run, seed included."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from peerinfer.core.costmodel import DEFAULT_COSTS, CostModel
from peerinfer.core.kvpull import PullSettings
from peerinfer.core.node import NodeConfig
from peerinfer.core.routing import POLICY_NAMES
from peerinfer.errors import ConfigError
from peerinfer.sim.costs import COST_PRESETS, load_costs
from peerinfer.sim.mix import node_costs, parse_mix
from peerinfer.sim.network import DelayModel
from peerinfer.types import PeerId

#: The policy name of the simulator-only oracle router (``peerinfer.sim.oracle``: exact,
#: instant knowledge of every node; the upper bound). Its nodes' own cores run ``cost``.
ORACLE = "oracle"
#: The policies a simulated node may run: the core's, and the oracle.
SIM_POLICY_NAMES = (*POLICY_NAMES, ORACLE)

#: A node configured by nothing but NodeConfig's own defaults: the simulated nodes are tuned
#: like real ones wherever the run does not say otherwise (SimConfig's defaults read it).
_NODE_DEFAULTS = NodeConfig(peer_id=PeerId(""))


def peer_name(index: int) -> PeerId:
    """A simulated node's peer id: as long as a real libp2p id (52 chars), so bytes are real."""
    return PeerId(f"12D3KooW{index:044d}")


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
    announce_interval_s: float = _NODE_DEFAULTS.announce_interval_s
    min_announce_gap_s: float = _NODE_DEFAULTS.min_announce_gap_s
    sync_timeout_s: float = _NODE_DEFAULTS.sync_timeout_s
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
    max_queue: int = _NODE_DEFAULTS.max_queue
    first_token_timeout_s: float = _NODE_DEFAULTS.first_token_timeout_s
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
    #: pulling KV from peers (issue 24): "" (off: every run as before), "auto" (the core's
    #: decision, ``peerinfer.core.routing.pull``) or "always" (pull from the longest holder
    #: whenever the policy serves here: a baseline). The swarm is private: every peer is
    #: trusted for pulls. ``link_mbps``: every link's bandwidth (megabits/s; a transfer takes
    #: a round trip plus bytes / bandwidth); ``kv_bytes_per_token``: the KV format's bytes;
    #: ``kv_disk``: holders serve pulls from a disk tier read at ``disk_read_mb_s`` (MB/s).
    #: ``pull_extra_work_weight``: ``PullSettings.extra_work_weight`` (the cost policy's
    #: extra-work charge while pulls are on; 0: the greedy choice).
    pull: str = ""
    link_mbps: float = 1000.0
    kv_bytes_per_token: int = 46_000
    kv_disk: bool = False
    disk_read_mb_s: float = 500.0
    pull_extra_work_weight: float = 1.0
    #: each node's disk tier in tokens (0: none): blocks its cache evicts spill to it (LRU,
    #: ``disk_cache_tokens * kv_bytes_per_token`` bytes) and a hit on them loads their KV at
    #: ``disk_read_mb_s`` instead of a prefill (``peerinfer.engine.simulated.SimDiskTier``);
    #: blocks on disk stay announced, and each node's load carries the tier's figures. With
    #: churn, a join is then the machine gone longest coming back warm from its tier (a
    #: restart: ``peerinfer.sim.churn``)
    disk_cache_tokens: int = 0
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
            parse_mix(self.mix, self.cache_tokens)  # a bad mix fails here, not mid-run
        if self.pull not in ("", "auto", "always"):
            raise ConfigError(f"pull must be '', 'auto' or 'always', got {self.pull!r}")
        for name in ("link_mbps", "disk_read_mb_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"{name} must be a positive number, got {v!r}")
        if self.disk_cache_tokens < 0:
            raise ConfigError(f"disk_cache_tokens must be >= 0, got {self.disk_cache_tokens}")
        if self.kv_bytes_per_token < 1:
            raise ConfigError(f"kv_bytes_per_token must be >= 1, got {self.kv_bytes_per_token}")
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

    def node_config(self, index: int, *, slots: int | None = None, **overrides: Any) -> NodeConfig:
        """Node ``index``'s ``NodeConfig``: what the run says of a node (its policy, its machine
        class's costs, announcement and timeout figures, admission limit), NodeConfig's own
        defaults for the rest. ``slots``: the run's node slots, churn's newcomers included (the
        peer table holds all of them); ``overrides``: further NodeConfig fields (tests and
        benchmarks compare ``lazy_announcements`` or ``route_among_holders`` off and on)."""
        node: dict[str, Any] = {
            "peer_id": peer_name(index),
            # An oracle node's own core runs ``cost``; the simulator swaps its policy.
            "policy": "cost" if self.policy == ORACLE else self.policy,
            "costs": node_costs(self, index),
            "announce_interval_s": self.announce_interval_s,
            "min_announce_gap_s": self.min_announce_gap_s,
            "sync_timeout_s": self.sync_timeout_s,
            "first_token_timeout_s": self.first_token_timeout_s,
            "max_queue": self.max_queue,
            "max_peers": max(_NODE_DEFAULTS.max_peers, self.nodes if slots is None else slots),
        }
        settings = self.pull_settings
        if settings is not None:
            node["kv_pull"] = settings
            node["private_swarm"] = True
        node.update(overrides)
        return NodeConfig(**node)

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_mbps * 1e6 / 8

    @property
    def pull_settings(self) -> PullSettings | None:
        """The nodes' ``NodeConfig.kv_pull`` (None: pulls off)."""
        if not self.pull:
            return None
        return PullSettings(
            mode=self.pull,
            kv_bytes_per_token=self.kv_bytes_per_token,
            peer_blocks_on_disk=self.kv_disk,
            peer_disk_read_bytes_per_s=self.disk_read_mb_s * 1e6,
            extra_work_weight=self.pull_extra_work_weight,
        )

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


__all__ = ["COST_PRESETS", "ORACLE", "SIM_POLICY_NAMES", "SimConfig", "load_costs", "peer_name"]
