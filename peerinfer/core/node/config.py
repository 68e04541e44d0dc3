"""``NodeConfig``: everything a node's logic is tuned by."""

from __future__ import annotations

from dataclasses import dataclass, field

from peerinfer.core.costmodel import DEFAULT_COSTS, CostModel
from peerinfer.core.kvpull import PullSettings
from peerinfer.core.messages import MAX_NEW_TOKENS, MAX_PROMPT_TOKENS
from peerinfer.core.reputation import ReputationConfig
from peerinfer.errors import ConfigError
from peerinfer.types import PeerId

__all__ = ["NodeConfig"]


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Everything a node's logic is tuned by. Times are seconds."""

    peer_id: PeerId
    policy: str = "cost"
    costs: CostModel = DEFAULT_COSTS
    announce_interval_s: float = 1.0
    min_announce_gap_s: float = 0.25
    sync_timeout_s: float = 5.0
    #: a peer silent (no announcement, no pong) this long leaves the candidate set
    peer_timeout_s: float = 6.0
    #: ping a peer we have not heard from for this long
    ping_after_s: float = 2.0
    #: hashes all replicas together may hold (see PeerIndex: the replica budget)
    replica_budget_blocks: int = 1 << 20
    #: keep the peer index's combined masks (one bit per peer per block hash: a route walks
    #: the prompt once); False: no masks, a route asks each replica (``PeerIndex(masks=False)``;
    #: the simulator's shared runs then leave announcements with changes to be taken in later)
    index_masks: bool = True
    #: how often the replica budget's allowances are recomputed
    rebalance_interval_s: float = 5.0
    #: a forwarded request must produce its first token within this budget, or we fail over
    first_token_timeout_s: float = 30.0
    #: a request being served (running here, or with a peer once it streams) that gives its
    #: client no event this long ends with a timeout; waiting its turn does not count (see
    #: ``NodeCore.silence``)
    token_gap_timeout_s: float = 120.0
    max_forward_attempts: int = 3
    #: forwarded requests are refused as busy beyond this many queued locally
    max_queue: int = 8
    #: client requests are refused beyond this many queued locally
    hard_max_queue: int = 1024
    #: a requester (other than this node itself) with this many requests waiting here is
    #: refused as busy: its fair share of the queue (None: the engine's ``slots``, so that a
    #: requester has at most twice the slots admitted, running plus waiting: what a node
    #: runs, peerinfer.node.options; the simulator keeps the older 32)
    max_queued_per_peer: int | None = 32
    #: a running generation of a requester over its share yields its slot to a requester
    #: below its share once it made this many tokens since it (re)started (None: never; the
    #: shell must then execute ``PreemptLocal`` and ``ResumeLocal``; see core.fairshare)
    preempt_after_tokens: int | None = None
    #: per-request limits: longer prompts, or more tokens asked for, are refused as invalid
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    max_new_tokens: int = MAX_NEW_TOKENS
    #: assumed round trip to a peer we have not measured yet
    default_rtt_s: float = 0.005
    #: a peer whose digest is older than this is not a routing candidate
    max_digest_age_s: float = 60.0
    max_peers: int = 4096
    #: trust (peerinfer.core.reputation): how peers are scored, the share of forwarded
    #: answers re-scored by the local model, and the only peers forwarded to (None: any peer)
    reputation: ReputationConfig = field(default_factory=ReputationConfig)
    audit_rate: float = 0.05
    #: a peer's first answers are all audited (probation), before sampling at ``audit_rate``
    audit_first: int = 1
    trusted_peers: frozenset[PeerId] | None = None
    #: take in announcements that change nothing but a peer's epoch, load and freshness only
    #: when that peer's state is next read (same decisions as at once; see ``PeerView._defer_unchanged``)
    lazy_announcements: bool = True
    #: route over the peers holding part of the prompt and stand-ins for the rest, where the
    #: policy can (``CostPolicy.choose_among_holders``: the same decisions as over every peer)
    route_among_holders: bool = True
    #: pulling KV from peers (issue 24, ``peerinfer.core.kvpull``): None, never (the default:
    #: every decision is the routing policy's); else how. Pulls are only from peers trusted
    #: for them: members of a private swarm (``private_swarm``), or, in an open swarm, any
    #: peer when ``kv_pull.open_swarm`` says so explicitly.
    kv_pull: PullSettings | None = None
    #: this node runs in a private swarm (a swarm key: every member proved it); the shell sets
    #: it. It only widens what ``kv_pull`` may pull from.
    private_swarm: bool = False

    def __post_init__(self) -> None:
        if self.announce_interval_s <= 0 or self.min_announce_gap_s < 0:
            raise ConfigError("announce intervals must be positive")
        if self.max_forward_attempts < 0 or self.max_queue < 0 or self.hard_max_queue < 1:
            raise ConfigError("queue and attempt limits must be non-negative")
        if not 0.0 <= self.audit_rate <= 1.0:
            raise ConfigError(f"audit_rate must be in [0, 1], got {self.audit_rate}")
        if (self.max_queued_per_peer is not None and self.max_queued_per_peer < 1) or (
            self.max_prompt_tokens < 1 or self.max_new_tokens < 1
        ):
            raise ConfigError("max_queued_per_peer, max_prompt_tokens and max_new_tokens must be >= 1")
        if not self.token_gap_timeout_s > 0:
            raise ConfigError(f"token_gap_timeout_s must be > 0, got {self.token_gap_timeout_s}")
        if self.kv_pull is not None and self.kv_pull.mode == "auto" and self.policy != "cost":
            raise ConfigError(
                f"kv_pull mode 'auto' compares the cost policy's estimates; policy is {self.policy!r}"
            )
        if self.preempt_after_tokens is not None and self.preempt_after_tokens < 1:
            raise ConfigError(f"preempt_after_tokens must be >= 1, got {self.preempt_after_tokens}")

    @property
    def queued_per_requester(self) -> int:
        """``max_queued_per_peer``, its default resolved."""
        return self.costs.slots if self.max_queued_per_peer is None else self.max_queued_per_peer
