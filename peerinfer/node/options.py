"""How a node is configured (``NodeOptions``: the ``peerinfer node`` flags), its protocol
names and its limits.

``NodeOptions`` stays flat (one field per flag). The configs of the parts it configures are
built from it here, by pure functions beside the fields, each option read by exactly one of
them (tests/node/test_node_options.py checks it, and that the defaults agree):

* :func:`core_config` -> ``NodeConfig`` (the sans-IO core: routing, limits, trust), with the
  policy derived from the engine (its batch size, its cache budget);
* :func:`host_config` -> ``HostConfig`` (the libp2p host), with the liveness timing derived
  from the peer timeout.

The few options neither reads are listed, with where they are used, in ``READ_ELSEWHERE``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peerinfer.core.costmodel import DEFAULT_COSTS, CostModel, default_costs
from peerinfer.core.kvpull import PullSettings
from peerinfer.core.messages import MAX_NEW_TOKENS, MAX_PROMPT_TOKENS
from peerinfer.core.node import NodeConfig
from peerinfer.engine.base import Engine
from peerinfer.errors import ConfigError
from peerinfer.net.config import DEFAULT_PORT, HostConfig, default_data_dir
from peerinfer.types import PeerId

logger = logging.getLogger("peerinfer.node")
GENERATE_PROTOCOL = "/peerinfer/generate/1.0.0"
SYNC_PROTOCOL = "/peerinfer/sync/1.0.0"
STATUS_PROTOCOL = "/peerinfer/status/1.0.0"
PEERS_PROTOCOL = "/peerinfer/peers/1.0.0"
#: KV pulls between peers (issue 24; ``peerinfer.node.kvpull``)
KV_PROTOCOL = "/peerinfer/kv/1.0.0"
PROTOCOL_GENERATION = 1
#: How long a node waits for in-flight requests to finish on shutdown before failing them.
SHUTDOWN_GRACE_S = 30.0
#: Peers we tell a newcomer about, at most.
MAX_EXCHANGED_PEERS = 64
#: How often we ask a random connected peer whom it knows (peer exchange).
PEER_EXCHANGE_INTERVAL_S = 10.0
#: The client handler's wait for the next token of a request served here or relayed.
TOKEN_GAP_TIMEOUT_S = 120.0
#: Dials caused by peer exchange: at most this many per second (bursts of PEER_DIAL_BURST), and
#: one peer at most once per PEER_REDIAL_S; learned peers beyond the rate are dropped, not queued.
PEER_DIAL_RATE = 1.0
PEER_DIAL_BURST = 8
PEER_REDIAL_S = 10.0
#: A node we were connected to and lost (disconnected, unresponsive) is redialed, relay-aware,
#: after LOST_REDIAL_FIRST_S, the wait doubling up to PEER_REDIAL_S, for LOST_REDIAL_FOR_S; and
#: all of them at once when a connection to any node opens (the network may be back: a cut link
#: restored, a partition healed), rather than when peer exchange next names them (once per
#: PEER_REDIAL_S at most). At most MAX_LOST_REDIALED are remembered (the oldest dropped).
LOST_REDIAL_FIRST_S = 0.5
LOST_REDIAL_FOR_S = 120.0
MAX_LOST_REDIALED = 64
#: Members told at once when a relayed address appears or goes (peerinfer.net.reach).
SPREAD_ADDRS_PEERS = 8
#: Bound of the per-peer tables kept here (peer exchange, dial history).
MAX_PEER_TABLE = 4096
#: Replica budget, by default a share of the local cache budget (in bytes), at about this many
#: bytes per replica hash (measured: 1.69M hashes in 253 MB, issue 11); with no cache budget,
#: DEFAULT_REPLICA_BUDGET_BLOCKS (about 40 MB).
REPLICA_BUDGET_SHARE = 1 / 8
REPLICA_BYTES_PER_BLOCK = 150
DEFAULT_REPLICA_BUDGET_BLOCKS = 1 << 18
MIN_REPLICA_BUDGET_BLOCKS = 1 << 16
#: Epoch bases of two incarnations of one identity differ by at least this (epochs within one
#: incarnation grow by one per announcement, four per second at most: 34 years of room).
EPOCH_STRIDE = 1 << 32
#: How many routing decisions a node remembers for its dashboard.
RECENT_DECISIONS = 64
#: Per-request limits a home node can afford (``--max-tokens``, ``--max-prompt-tokens``; see
#: docs/security.md, "Limits"). The running requests' KV is reserved up front, (prompt +
#: max_tokens) x the model's KV per token: 6,144 tokens of SmolLM2-135M (46 KB per token in
#: float32) is 283 MB per request, 1.1 GB for a 4-slot batch, which a 8-16 GB machine holds
#: beside the model; 2,048 new tokens is a long answer (OpenAI-style clients ask for 256 when
#: they name no max_tokens here) and about a minute of decoding on a laptop CPU; 4,096 prompt
#: tokens hold a long conversation and stay within every supported model's context.
DEFAULT_MAX_TOKENS = 2048
DEFAULT_MAX_PROMPT_TOKENS = 4096
#: A running generation of a requester over its share yields its slot after this many tokens
#: when a requester below its share waits (peerinfer.core.fairshare): a few decode steps, so
#: an honest request waits at most about this many tokens' time for a slot, while the flooder
#: pays one pause per quantum.
DEFAULT_PREEMPT_AFTER_TOKENS = 32


def announce_topic(fingerprint: bytes, swarm_secret: bytes | None = None) -> str:
    """The gossip topic of one model (and, for a private swarm, one swarm key)."""
    tag = fingerprint.hex()[:16]
    if swarm_secret is not None:
        tag += "-" + hashlib.blake2b(swarm_secret, digest_size=6).hexdigest()
    return f"peerinfer/{PROTOCOL_GENERATION}/{tag}/announce"


@dataclass(frozen=True, slots=True)
class NodeOptions:
    """How to run a node (the ``peerinfer node`` flags)."""

    engine: str = "hf"
    model: str | None = None
    device: str | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)
    listen: tuple[str, ...] = (f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT}",)
    bootstrap: tuple[str, ...] = ()
    mdns: bool = True
    identity: Path | None = None
    persist_identity: bool = True
    cache_bytes: int | None = None
    cache_tokens: int | None = None
    #: the disk tier's bound (``--disk-cache-bytes``; 0: no disk tier) and its directory
    #: (None: ``kvcache`` beside the identity key, see ``disk_cache_path``)
    disk_cache_bytes: int = 0
    disk_cache_dir: Path | None = None
    policy: str = "cost"
    swarm_key: bytes | None = field(default=None, repr=False)  # a secret: never in a repr
    costs: CostModel = DEFAULT_COSTS
    announce_interval_s: float = 1.0
    first_token_timeout_s: float = 30.0
    #: a request served (running, or streaming from a peer) that gives its client no event
    #: this long ends with a timeout; waiting its turn does not count (NodeCore.silence)
    token_gap_timeout_s: float = TOKEN_GAP_TIMEOUT_S
    peer_timeout_s: float = 6.0
    max_queue: int = 8
    #: per-request limits: longer prompts, or more new tokens asked for, are refused as invalid
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    #: requests one requester may have waiting here (None: the engine's slots), and the tokens
    #: after which an over-share generation yields its slot (None: never preempt)
    max_queued_per_requester: int | None = None
    preempt_after_tokens: int | None = DEFAULT_PREEMPT_AFTER_TOKENS
    seed: int | None = None
    expected_peers: int = 64
    #: the HTTP API's HOST:PORT (port 0: any free one); None: no HTTP API. Served beside the
    #: node by ``peerinfer.serve.serve_node`` (``Node.serve`` alone runs no HTTP API)
    http: str | None = None
    #: bearer tokens the HTTP API accepts (required to bind a non-loopback address)
    api_keys: tuple[str, ...] = ()
    #: hashes all peers' replicas may hold together; None: a share of the cache budget
    replica_budget_blocks: int | None = None
    #: relay circuits for NATed peers once we prove reachable (peerinfer.net.reach)
    relay_service: bool = True
    #: ask the home router for a port mapping by UPnP (peerinfer.net.upnp); off: it opens a port
    upnp: bool = False
    #: bytes one relayed circuit through us may carry before we close it (None: the default)
    relay_circuit_bytes: int | None = None
    #: the wall clock, seconds (tests step it); it only seeds epochs, never a timer
    wall_clock: Callable[[], float] = time.time
    #: trust: the share of forwarded answers audited, and (if given) the only peers
    #: requests are forwarded to
    audit_rate: float = 0.05
    trusted_peers: tuple[str, ...] | None = None
    #: forward only to members of this private swarm (peers that proved ``swarm_key``); with
    #: ``trusted_peers`` too, only to listed members. Needs ``swarm_key`` (``--trust swarm``).
    trust_swarm: bool = False
    #: pull KV from peers (issue 24): None (off, the default), "auto" (when the core's estimate
    #: says a pull beats recomputing and forwarding; needs the cost policy) or "always" (from
    #: the trusted holder with the longest match: a benchmark baseline). A node with pulls on
    #: also serves pulls to the peers it would pull from. Peers trusted for pulls: the members
    #: of a private swarm (``swarm_key``), or any peer of an open swarm only with
    #: ``kv_pull_open_swarm``; ``trusted_peers`` narrows either.
    kv_pull: str | None = None
    kv_pull_open_swarm: bool = False
    #: pull only when it brings at least this many tokens (None: ``PullSettings``'s default)
    kv_pull_min_tokens: int | None = None
    #: the share of each pull's tokens recomputed to check it (None: ``PullSettings``'s, 0.05).
    #: A trade the operator makes: 0.05 catches a peer that alters whole blocks at its first
    #: pull and one that alters a single token within 20 pulls in about 64% of cases; 0.14
    #: raises the latter to 95%, at about a fifth of the compute a pull saves (docs/security.md).
    kv_pull_verify_rate: float | None = None

    def __post_init__(self) -> None:
        if type(self.disk_cache_bytes) is not int or self.disk_cache_bytes < 0:
            raise ConfigError(f"--disk-cache-bytes must be an integer >= 0, got {self.disk_cache_bytes!r}")
        for name in ("max_tokens", "max_prompt_tokens", "max_queued_per_requester",
                     "preempt_after_tokens"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        # Above the protocol's own limits a flag would silently change nothing.
        for name, most in (("max_tokens", MAX_NEW_TOKENS), ("max_prompt_tokens", MAX_PROMPT_TOKENS)):
            if getattr(self, name) > most:
                raise ConfigError(f"--{name.replace('_', '-')} must be at most {most} (the "
                                  f"protocol's limit), got {getattr(self, name)}")
        if self.kv_pull is not None and self.kv_pull not in ("auto", "always"):
            raise ConfigError(f"--kv-pull must be off, auto or always, got {self.kv_pull!r}")
        if self.kv_pull == "auto" and self.policy != "cost":
            raise ConfigError(f"--kv-pull auto weighs the cost policy's estimates; --policy is "
                              f"{self.policy!r} (use --kv-pull always, or --policy cost)")
        if self.kv_pull_open_swarm and self.kv_pull is None:
            raise ConfigError("--kv-pull-open-swarm needs --kv-pull auto or always")
        if self.kv_pull_verify_rate is not None:
            if self.kv_pull is None:
                raise ConfigError("--kv-pull-verify-rate needs --kv-pull auto or always")
            if not 0.0 < self.kv_pull_verify_rate <= 1.0:
                # 0 would take pulled KV unchecked: not a rate, a hole (use a private swarm of
                # trusted peers and the default, or turn pulls off).
                raise ConfigError(f"--kv-pull-verify-rate must be in (0, 1], got {self.kv_pull_verify_rate!r}")
        if self.trust_swarm and self.swarm_key is None:
            raise ConfigError(
                "--trust swarm needs a swarm key: in an open swarm anyone who connects is a member"
            )


def disk_cache_path(opts: NodeOptions) -> Path:
    """Where the disk tier keeps its files: ``--disk-cache-dir``, else ``kvcache`` in the
    node's data directory (the directory of ``--identity``, else ``default_data_dir()``), so a
    node restarted with the same identity finds its blocks again."""
    if opts.disk_cache_dir is not None:
        return opts.disk_cache_dir
    base = opts.identity.parent if opts.identity is not None else default_data_dir()
    return base / "kvcache"


def core_config(
    opts: NodeOptions, peer_id: PeerId, *, max_batch_size: int, cache_capacity_bytes: int | None,
    kv_bytes_per_token: int | None = None, engine_costs_default: CostModel | None = None,
) -> NodeConfig:
    """The core's configuration for a node run with ``opts`` whose engine batches
    ``max_batch_size`` requests and whose prefix cache holds ``cache_capacity_bytes`` (and whose
    KV takes ``kv_bytes_per_token`` a token: what a pull moves; None: ``PullSettings``'s).
    ``engine_costs_default`` (the engine's ``default_costs``) replaces the default cost model
    when ``--costs`` gave none: a llama.cpp node then announces llama.cpp's speed, not the
    Transformers engine's."""
    kv_pull = opts.kv_pull
    pull_open = opts.kv_pull_open_swarm
    pull_min = opts.kv_pull_min_tokens
    verify_rate = opts.kv_pull_verify_rate
    private = opts.swarm_key is not None
    pull: PullSettings | None = None
    if kv_pull is not None:
        figures: dict[str, Any] = {}
        if kv_bytes_per_token:
            figures["kv_bytes_per_token"] = kv_bytes_per_token
        if pull_min is not None:
            figures["min_pull_tokens"] = pull_min
        if verify_rate is not None:
            figures["verify_rate"] = verify_rate
        pull = PullSettings(mode=kv_pull, open_swarm=pull_open, **figures)
    return NodeConfig(
        peer_id=peer_id,
        policy=opts.policy,
        costs=engine_costs(
            engine_costs_default if engine_costs_default is not None and opts.costs == DEFAULT_COSTS
            else opts.costs,
            max_batch_size,
        ),
        announce_interval_s=opts.announce_interval_s,
        first_token_timeout_s=opts.first_token_timeout_s,
        token_gap_timeout_s=opts.token_gap_timeout_s,
        peer_timeout_s=opts.peer_timeout_s,
        ping_after_s=max(0.5, opts.peer_timeout_s / 3),
        max_queue=opts.max_queue,
        max_new_tokens=opts.max_tokens,
        max_prompt_tokens=opts.max_prompt_tokens,
        max_queued_per_peer=opts.max_queued_per_requester,
        preempt_after_tokens=opts.preempt_after_tokens,
        audit_rate=opts.audit_rate,
        trusted_peers=(
            None if opts.trusted_peers is None
            else frozenset(PeerId(p) for p in opts.trusted_peers)
        ),
        replica_budget_blocks=replica_budget(opts.replica_budget_blocks, cache_capacity_bytes),
        kv_pull=pull,
        private_swarm=private,
    )


def engine_costs(costs: CostModel, max_batch_size: int) -> CostModel:
    """One capacity for the core and the scheduler: the engine's ``max_batch_size``, unless
    the cost model names its own number of slots (the default model's is 1: "not set"). If the
    two differed, the scheduler would queue requests the core thinks are running, in its own
    FIFO order, behind the core's fair share. A node left on the default (single-slot) model
    whose engine batches gets the batched default, whose step times grow with the batch as
    measured (docs/performance.md)."""
    if costs == DEFAULT_COSTS and max_batch_size > 1:
        return default_costs(max_batch_size)
    if costs.slots == 1 and max_batch_size > 1:
        return costs.with_slots(max_batch_size)
    return costs


def replica_budget(blocks: int | None, cache_capacity_bytes: int | None) -> int:
    """The replica budget asked for, else a share of the cache budget (``REPLICA_BUDGET_SHARE``),
    else ``DEFAULT_REPLICA_BUDGET_BLOCKS``."""
    if blocks is not None:
        return blocks
    if not cache_capacity_bytes:
        return DEFAULT_REPLICA_BUDGET_BLOCKS
    return max(MIN_REPLICA_BUDGET_BLOCKS,
               int(cache_capacity_bytes * REPLICA_BUDGET_SHARE) // REPLICA_BYTES_PER_BLOCK)


def host_config(opts: NodeOptions, topic: str) -> HostConfig:
    """The libp2p host's configuration for a node run with ``opts``, gossiping on ``topic``."""
    return HostConfig(
        listen=opts.listen,
        identity_path=opts.identity,
        persist_identity=opts.persist_identity,
        bootstrap=opts.bootstrap,
        mdns=opts.mdns,
        gossip_topics=(topic,),
        expected_peers=opts.expected_peers,
        announce_interval_s=opts.announce_interval_s,
        liveness_interval_s=max(2.0, opts.peer_timeout_s / 2),
        # A failed ping starts the probe with a fresh connection (net.host, PROBE_EVERY_S):
        # the sooner it is known, the sooner a restored link is used again.
        liveness_timeout_s=max(3.0, opts.peer_timeout_s / 2),
        swarm_key=opts.swarm_key,
    )


#: Options both builders read: the core and the host act on the same figure.
READ_BY_BOTH = {
    "announce_interval_s": "the core announces at it; the host sizes its gossip rate limit for it",
    "peer_timeout_s": "the core's membership timeout; the host's liveness pings derive from it",
    "swarm_key": "the host admits members by it; the core trusts them for KV pulls",
}
#: Options neither builder reads, and where they are used.
READ_ELSEWHERE = {
    "engine": "_load_engine (peerinfer.engine.registry)",
    "model": "_load_engine",
    "device": "_load_engine",
    "engine_options": "_load_engine",
    "cache_bytes": "Node.serve: Engine.configure_cache",
    "cache_tokens": "Node.serve: Engine.configure_cache",
    "disk_cache_bytes": "Node.serve: Engine.configure_disk",
    "disk_cache_dir": "disk_cache_path (Node.serve hands its result to Engine.configure_disk)",
    "seed": "Node.serve: the core's random generator",
    "wall_clock": "Node._epoch_base",
    "relay_service": "Node.serve: ReachSettings.of",
    "relay_circuit_bytes": "Node.serve: ReachSettings.of",
    "upnp": "Node.serve: ReachSettings.of",
    "http": "peerinfer.serve (the HTTP API beside the node)",
    "api_keys": "peerinfer.serve",
    "trust_swarm": "NodeOptions.__post_init__ only: a guarantee, not a filter (docs/security.md)",
}


def _load_engine(options: NodeOptions) -> Engine:
    from peerinfer.engine.registry import load_engine

    kwargs = dict(options.engine_options)
    if options.model is not None:
        kwargs.setdefault("model", options.model)
    if options.device is not None:
        kwargs.setdefault("device", options.device)
    return load_engine(options.engine, **kwargs)
