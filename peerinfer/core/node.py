"""The node's whole logic as one sans-IO state machine, shared by the real node and the simulator.

Theory of operation
-------------------
A ``NodeCore`` is fed *events* (a client request arrived, an announcement was received, a sync
response came back, the engine finished, a forwarded request failed, a timer is due) together
with the current time, and answers with a list of *effects* (publish this announcement, send
this sync request to that peer, run this request on the local engine, forward it to that peer,
reject it, ping that peer, forget that peer). It never awaits, never reads a clock and never
rolls its own dice: ``now`` is an argument and randomness comes from the ``random.Random`` it is
given. The trio + libp2p shell (``peerinfer.net.node``) executes the effects over the network;
the simulator (``peerinfer.sim``) executes the same effects in virtual time. No decision is
coded twice.

What it decides
~~~~~~~~~~~~~~~
* **Announce.** This node's cache digest (``LocalDigest``) changes when the engine reports
  blocks added or evicted. An announcement (epoch, root, count, load and the changes since the
  previous epoch when they fit) is published every ``announce_interval_s``, and sooner after a
  change, but never more often than ``min_announce_gap_s`` (gossipsub drops bursts).
* **Membership.** A peer is a *member* (it has state here, a replica, and may be a routing
  candidate) only once it answered this node directly: a ``PeerSeen`` with a measured round trip,
  which the shell feeds only for a ping answered over a direct, authenticated (and, in a private
  swarm, admitted) connection. A connection alone (``PeerSeen`` without a round trip) asks for
  that ping. Identities heard of only through relayed gossip are never members: their
  announcements are refused and allocate nothing, so forged identities over one connection cost
  nothing but the refusal (and a ping request the shell drops, having no connection to them).
* **Pull.** An announcement from a member is refused when its epoch is not newer than the last
  one seen from that peer (stale or replayed). Freshness never reads the sender's clock: a
  member is as fresh as the last time *we* received from it (``now``, the receiver's monotonic
  clock), so a skewed or stepped clock elsewhere changes nothing; the sender's epochs only have
  to grow, across its restarts too (the shell persists them). Otherwise the peer's replica
  applies the carried delta; if its root still differs, a pull runs the Merkle reconciliation
  state machine (one session per peer at a time, with a deadline). Each refusal is reported once
  per (peer, reason) through ``take_refusals()``, for the shell to log.
* **Replica budget.** All replicas together hold at most ``replica_budget_blocks`` hashes; the
  index splits that budget into per-peer allowances (``PeerIndex.rebalance``, every
  ``rebalance_interval_s``), favouring peers whose replicas help route this node's prompts. An
  announcement claiming more than the sender's allowance is refused; a replica that grew past it
  (a lying delta, a pull) is emptied.
* **Route.** A client request is hashed into its block chain, the peer index estimates every
  peer's match in one walk, and the routing policy picks a target among the local node and
  every live peer; the decision (target, expected cached tokens, reason) is returned in the
  effect so it can be logged. A forwarded request is always served where it lands (no loops).
  After routing, the target is recorded as speculatively holding the prompt's blocks.
* **Fail over.** A forward that fails, is refused as busy, or gives no first token before its
  deadline goes to the next candidate in the policy's ranking, and finally to the local engine.
  A failure after tokens were streamed resumes locally from the prompt plus the tokens already
  relayed, so the client's stream continues instead of being lost.
* **Admit.** The local engine runs ``slots`` requests at once; the rest wait in a FIFO queue.
  Forwarded requests are refused as busy when the queue is at ``max_queue`` (their origin has
  other options); the origin's own client requests are always queued (up to
  ``hard_max_queue``, then refused), so a client is never silently dropped.
* **Liveness.** Peers are pinged when quiet; a peer silent for ``peer_timeout_s`` leaves the
  index (and the candidate set); when it announces again it rejoins with an empty replica.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from peerinfer.core.antientropy import Reconciliation
from peerinfer.core.costmodel import DEFAULT_COSTS, CostModel
from peerinfer.core.digest import LocalDigest
from peerinfer.core.index import PeerIndex
from peerinfer.core.messages import (
    Announce,
    Load,
    SamplingParams,
    SyncRequest,
    SyncResponse,
)
from peerinfer.core.prefix import PrefixHasher
from peerinfer.core.routing import RouteDecision, RouteRequest, make_policy
from peerinfer.errors import ConfigError, ProtocolError
from peerinfer.types import BlockHash, PeerId, RequestId

# ---------------------------------------------------------------------------------------------
# Configuration


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
    #: how often the replica budget's allowances are recomputed
    rebalance_interval_s: float = 5.0
    #: a forwarded request must produce its first token within this budget, or we fail over
    first_token_timeout_s: float = 30.0
    max_forward_attempts: int = 3
    #: forwarded requests are refused as busy beyond this many queued locally
    max_queue: int = 8
    #: client requests are refused beyond this many queued locally
    hard_max_queue: int = 1024
    #: assumed round trip to a peer we have not measured yet
    default_rtt_s: float = 0.005
    #: a peer whose digest is older than this is not a routing candidate
    max_digest_age_s: float = 60.0
    max_peers: int = 4096

    def __post_init__(self) -> None:
        if self.announce_interval_s <= 0 or self.min_announce_gap_s < 0:
            raise ConfigError("announce intervals must be positive")
        if self.max_forward_attempts < 0 or self.max_queue < 0 or self.hard_max_queue < 1:
            raise ConfigError("queue and attempt limits must be non-negative")


# ---------------------------------------------------------------------------------------------
# Events (inputs)


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """A request to serve. ``forwarded`` requests came from a peer and are never forwarded again."""

    request_id: RequestId
    tokens: tuple[int, ...]
    params: SamplingParams
    forwarded: bool = False
    origin: PeerId | None = None
    #: a forwarded request is refused as busy if more requests than this are queued or
    #: running here when it arrives (the origin's routing assumed no more; None: no limit)
    max_outstanding: int | None = None


@dataclass(frozen=True, slots=True)
class AnnounceReceived:
    sender: PeerId
    announce: Announce


@dataclass(frozen=True, slots=True)
class SyncResponseReceived:
    peer: PeerId
    response: SyncResponse


@dataclass(frozen=True, slots=True)
class SyncFailed:
    peer: PeerId
    session: int
    reason: str


@dataclass(frozen=True, slots=True)
class LocalStarted:
    """The local engine began a request (it left the queue and took a slot)."""

    request_id: RequestId
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class LocalFinished:
    """The local engine finished (or failed) a request; ``cache_added``/``cache_removed`` are
    the engine's cache changes since its previous report."""

    request_id: RequestId
    ok: bool
    cache_added: tuple[BlockHash, ...] = ()
    cache_removed: tuple[BlockHash, ...] = ()
    error: str = ""


@dataclass(frozen=True, slots=True)
class CacheChanged:
    """Cache changes reported outside a request (start-up snapshot, a cleared cache)."""

    added: tuple[BlockHash, ...] = ()
    removed: tuple[BlockHash, ...] = ()


@dataclass(frozen=True, slots=True)
class ForwardFirstToken:
    request_id: RequestId
    peer: PeerId


@dataclass(frozen=True, slots=True)
class ForwardFinished:
    request_id: RequestId
    peer: PeerId


@dataclass(frozen=True, slots=True)
class ForwardFailed:
    """A forward failed. ``reason`` is one of busy, unavailable, timeout, protocol, invalid,
    internal. ``generated`` holds the token ids already relayed to the client (mid-stream
    failure); the request then resumes locally after them."""

    request_id: RequestId
    peer: PeerId
    reason: str
    generated: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PeerSeen:
    """The shell heard from (or connected to) a peer; ``rtt_s`` when a ping measured it."""

    peer: PeerId
    rtt_s: float | None = None
    load: Load | None = None


@dataclass(frozen=True, slots=True)
class PeerLost:
    """The shell lost the connection to a peer, or a ping failed."""

    peer: PeerId


@dataclass(frozen=True, slots=True)
class Cancel:
    """The client went away; stop the request wherever it is."""

    request_id: RequestId


Event = (
    ClientRequest
    | AnnounceReceived
    | SyncResponseReceived
    | SyncFailed
    | LocalStarted
    | LocalFinished
    | CacheChanged
    | ForwardFirstToken
    | ForwardFinished
    | ForwardFailed
    | PeerSeen
    | PeerLost
    | Cancel
)

# ---------------------------------------------------------------------------------------------
# Effects (outputs)


@dataclass(frozen=True, slots=True)
class Publish:
    announce: Announce


@dataclass(frozen=True, slots=True)
class SendSyncRequest:
    """Send ``request`` to ``peer`` on the sync protocol and feed back its response (or a
    ``SyncFailed``) within ``timeout_s``."""

    peer: PeerId
    request: SyncRequest
    timeout_s: float


@dataclass(frozen=True, slots=True)
class RunLocal:
    """Run ``tokens`` on the local engine and stream the result to the request's client. When
    ``resume_after`` is non-empty the request was partly served elsewhere: those tokens were
    already relayed and are part of ``tokens``; only the new ones go to the client."""

    request_id: RequestId
    tokens: tuple[int, ...]
    params: SamplingParams
    decision: RouteDecision | None
    resume_after: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Forward:
    """Forward the request to ``peer`` and relay its token stream to the client; report the first
    token, the end or a failure back. ``first_token_timeout_s`` bounds the wait."""

    request_id: RequestId
    peer: PeerId
    tokens: tuple[int, ...]
    params: SamplingParams
    decision: RouteDecision
    first_token_timeout_s: float
    attempt: int


@dataclass(frozen=True, slots=True)
class Reject:
    """Answer the request with an error (``code`` as in messages.ERROR_CODES)."""

    request_id: RequestId
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class CancelLocal:
    request_id: RequestId


@dataclass(frozen=True, slots=True)
class CancelForward:
    request_id: RequestId
    peer: PeerId


@dataclass(frozen=True, slots=True)
class PingPeer:
    peer: PeerId


@dataclass(frozen=True, slots=True)
class DropPeer:
    """The peer left the candidate set (silent too long). The shell may disconnect it."""

    peer: PeerId


Effect = (
    Publish
    | SendSyncRequest
    | RunLocal
    | Forward
    | Reject
    | CancelLocal
    | CancelForward
    | PingPeer
    | DropPeer
)

# ---------------------------------------------------------------------------------------------
# Internal state


@dataclass(slots=True)
class _Request:
    request_id: RequestId
    tokens: tuple[int, ...]
    params: SamplingParams
    forwarded: bool
    chain: tuple[BlockHash, ...]
    decision: RouteDecision | None = None
    #: peers tried so far, in order
    tried: list[PeerId] = field(default_factory=list)
    target: PeerId | None = None
    streaming: bool = False
    deadline: float | None = None
    local_queued: bool = False
    local_running: bool = False
    resume_after: tuple[int, ...] = ()


@dataclass(slots=True)
class _PeerState:
    last_seen: float
    last_announce_epoch: int = 0
    last_ping: float = -1e18
    sync: Reconciliation | None = None
    sync_session: int = 0
    sync_deadline: float = 0.0
    sync_target_epoch: int = 0
    sync_attempt: int = 0
    pull_wanted: bool = False
    announced_root: int = 0


@dataclass(frozen=True, slots=True)
class PeerSnapshot:
    peer_id: PeerId
    digest_age_s: float
    load: Load
    cached_tokens: int
    rtt_s: float | None


@dataclass(frozen=True, slots=True)
class NodeStatistics:
    """A frozen snapshot of counters (trio's ``statistics()`` habit)."""

    requests: int
    served_locally: int
    forwarded: int
    failovers: int
    rejected: int
    #: forwarded requests refused because more were outstanding than the origin assumed
    rejected_over_limit: int
    announces_sent: int
    announces_refused: int
    #: announcements refused because the sender is not a member (never answered us directly)
    announces_unverified: int
    #: replicas emptied for growing past their allowance of the replica budget
    replicas_emptied: int
    syncs_started: int
    syncs_converged: int
    syncs_failed: int
    queued: int
    running: int


class NodeCore:
    """The sans-IO node. Feed it ``handle(event, now)`` and ``tick(now)``; execute what they return.

    ``tick`` must be called no later than ``next_deadline()`` (the shell sleeps until then or
    until the next event; the simulator schedules it).
    """

    def __init__(
        self,
        config: NodeConfig,
        hasher: PrefixHasher,
        *,
        rng: random.Random,
        epoch_base: int = 0,
        now: float = 0.0,
    ) -> None:
        self.config = config
        self.hasher = hasher
        self.rng = rng
        self.policy = make_policy(config.policy, costs=config.costs)
        self.local = LocalDigest(epoch_base=epoch_base)
        self.index = PeerIndex(
            max_peers=config.max_peers, replica_budget_blocks=config.replica_budget_blocks
        )
        self._peers: dict[PeerId, _PeerState] = {}
        self._requests: dict[RequestId, _Request] = {}
        self._queue: deque[RequestId] = deque()
        self._running = 0
        # Blocks of requests queued or running here: the local engine will hold them soon.
        self._pending_local: dict[BlockHash, int] = {}
        self._next_announce = now
        self._last_announce = -1e18
        self._next_session = 1
        self._last_epochs: dict[PeerId, int] = {}
        #: smoothed round trips, and requests we forwarded that have not finished, per peer
        self._rtt: dict[PeerId, float] = {}
        self._inflight: dict[PeerId, int] = {}
        #: when we last asked the shell to ping a non-member (bounded, oldest forgotten)
        self._ping_asked: dict[PeerId, float] = {}
        #: (peer, reason) pairs already reported, and those not yet taken by the shell
        self._refusals_seen: dict[tuple[PeerId, str], None] = {}
        self._refusals: list[tuple[PeerId, str, str]] = []
        self._next_rebalance = now + config.rebalance_interval_s
        self._stats = dict.fromkeys(
            (
                "requests",
                "served_locally",
                "forwarded",
                "failovers",
                "rejected",
                "rejected_over_limit",
                "announces_sent",
                "announces_refused",
                "announces_unverified",
                "replicas_emptied",
                "syncs_started",
                "syncs_converged",
                "syncs_failed",
            ),
            0,
        )

    # ------------------------------------------------------------------ public surface

    @property
    def peer_id(self) -> PeerId:
        return self.config.peer_id

    def load(self) -> Load:
        return Load(queued=len(self._queue), running=self._running, slots=self.config.costs.slots)

    def handle(self, event: Event, now: float) -> list[Effect]:
        """Process one event; return the effects to execute, in order."""
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"NodeCore cannot handle {type(event).__name__}")
        effects: list[Effect] = handler(self, event, now)
        return effects

    def tick(self, now: float) -> list[Effect]:
        """Timers: announcements, sync deadlines, forward deadlines, liveness."""
        effects: list[Effect] = []
        self._check_forward_deadlines(now, effects)
        self._check_sync_deadlines(now, effects)
        self._check_liveness(now, effects)
        self._maybe_announce(now, effects)
        self.index.expire(now)
        if now >= self._next_rebalance:
            self._next_rebalance = now + self.config.rebalance_interval_s
            for peer in self.index.rebalance():
                self._replica_emptied(peer)
        return effects

    def take_refusals(self) -> list[tuple[PeerId, str, str]]:
        """Refused announcements not reported before, as ``(peer, reason, detail)``: each
        (peer, reason) pair once (the table of reported pairs is bounded), for the shell's log."""
        out, self._refusals = self._refusals, []
        return out

    def is_member(self, peer: PeerId) -> bool:
        """Whether ``peer`` answered us directly and has not been forgotten since."""
        return peer in self._peers

    def next_deadline(self) -> float:
        """The latest time by which ``tick`` must run again."""
        candidates = [self._next_announce, self._next_rebalance]
        if self.local.has_pending_changes():
            candidates.append(self._last_announce + self.config.min_announce_gap_s)
        for req in self._requests.values():
            if req.deadline is not None:
                candidates.append(req.deadline)
        for st in self._peers.values():
            if st.sync is not None:
                candidates.append(st.sync_deadline)
        return min(candidates)

    def answer_sync(self, request: SyncRequest) -> SyncResponse:
        """The responder side of a pull: a pure function of this node's digest."""
        return self.local.answer(request)

    def peers(self, now: float) -> list[PeerSnapshot]:
        out = []
        for peer in self.index.peers():
            replica = self.index.replica(peer)
            out.append(
                PeerSnapshot(
                    peer_id=peer,
                    digest_age_s=self.index.digest_age(peer, now),
                    load=self.index.load(peer),
                    cached_tokens=(len(replica.digest) if replica else 0) * self.hasher.block_size,
                    rtt_s=self._rtt.get(peer),
                )
            )
        return out

    def statistics(self) -> NodeStatistics:
        return NodeStatistics(queued=len(self._queue), running=self._running, **self._stats)

    def pending_requests(self) -> list[RequestId]:
        return list(self._requests)

    def route(self, tokens: Sequence[int], params: SamplingParams, now: float,
              exclude: Sequence[PeerId] = ()) -> RouteDecision:
        """Ask the routing policy where ``tokens`` would go now (no side effects)."""
        chain = tuple(self.hasher.chain(tokens))
        return self._decide(len(tokens), params, chain, now, exclude)

    # ------------------------------------------------------------------ requests

    def _on_client_request(self, ev: ClientRequest, now: float) -> list[Effect]:
        self._stats["requests"] += 1
        effects: list[Effect] = []
        if ev.request_id in self._requests:
            self._stats["rejected"] += 1
            return [Reject(ev.request_id, "invalid", f"duplicate request id {ev.request_id!r}")]
        if not ev.tokens:
            self._stats["rejected"] += 1
            return [Reject(ev.request_id, "invalid", "the prompt is empty")]
        chain = tuple(self.hasher.chain(ev.tokens))
        req = _Request(ev.request_id, ev.tokens, ev.params, ev.forwarded, chain)
        if ev.forwarded:
            # Served where it lands: a forwarded request is never forwarded again.
            if len(self._queue) >= self.config.max_queue and self._running >= self.config.costs.slots:
                self._stats["rejected"] += 1
                return [Reject(ev.request_id, "busy", f"{self.peer_id} is at capacity")]
            limit = ev.max_outstanding
            if limit is not None and len(self._queue) + self._running > limit:
                self._stats["rejected"] += 1
                self._stats["rejected_over_limit"] += 1
                return [
                    Reject(
                        ev.request_id,
                        "busy",
                        f"{self.peer_id} has {len(self._queue) + self._running} requests "
                        f"outstanding, more than the {limit} the origin's routing assumed",
                    )
                ]
            self._requests[req.request_id] = req
            self._enqueue_local(req, None, effects)
            self._start_queued(effects)
            return effects
        self._requests[req.request_id] = req
        self._route_and_dispatch(req, now, effects)
        return effects

    def _decide(
        self,
        prompt_tokens: int,
        params: SamplingParams,
        chain: tuple[BlockHash, ...],
        now: float,
        exclude: Sequence[PeerId],
    ) -> RouteDecision:
        bs = self.hasher.block_size
        cfg = self.config
        candidates = self.index.candidates(
            chain,
            block_size=bs,
            local_peer=self.peer_id,
            local_matched_tokens=self._local_match_blocks(chain) * bs,
            local_load=self.load(),
            now=now,
            rtt_s=self._rtt,
            default_rtt_s=cfg.default_rtt_s,
            inflight=self._inflight,
            exclude=exclude,
            max_digest_age_s=cfg.max_digest_age_s,
            # Never count the last prompt token as cached: the engine must run it for logits.
            max_matched_tokens=max(0, prompt_tokens - 1),
        )
        request = RouteRequest(prompt_tokens=prompt_tokens, max_tokens=params.max_tokens, chain=chain)
        return self.policy.choose(request, candidates, self.rng)

    def _route_and_dispatch(self, req: _Request, now: float, effects: list[Effect]) -> None:
        attempts_left = self.config.max_forward_attempts - len(req.tried)
        if attempts_left > 0:
            decision = self._decide(len(req.tokens), req.params, req.chain, now, req.tried)
        else:
            decision = self._local_decision(req, "failover: forward attempts exhausted")
        req.decision = decision
        if decision.is_local:
            if len(self._queue) >= self.config.hard_max_queue:
                self._stats["rejected"] += 1
                del self._requests[req.request_id]
                effects.append(Reject(req.request_id, "busy", "the local queue is full"))
                return
            self._enqueue_local(req, decision, effects)
            self._start_queued(effects)
            return
        peer = decision.target
        req.target = peer
        req.tried.append(peer)
        req.deadline = now + self.config.first_token_timeout_s
        self._inflight[peer] = self._inflight.get(peer, 0) + 1
        self.index.add_speculative(peer, req.chain, now)
        self._stats["forwarded"] += 1
        effects.append(
            Forward(
                request_id=req.request_id,
                peer=peer,
                tokens=req.tokens,
                params=req.params,
                decision=decision,
                first_token_timeout_s=self.config.first_token_timeout_s,
                attempt=len(req.tried),
            )
        )

    def _local_decision(self, req: _Request, reason: str) -> RouteDecision:
        bs = self.hasher.block_size
        cached = min(self._local_match_blocks(req.chain) * bs, max(0, len(req.tokens) - 1))
        return RouteDecision(
            target=self.peer_id, is_local=True, expected_cached_tokens=cached, reason=reason
        )

    def _local_match_blocks(self, chain: Sequence[BlockHash]) -> int:
        digest = self.local.digest
        pending = self._pending_local
        n = 0
        for h in chain:
            if h in digest or h in pending:
                n += 1
            else:
                break
        return n

    def _enqueue_local(
        self, req: _Request, decision: RouteDecision | None, effects: list[Effect]
    ) -> None:
        req.decision = decision
        req.local_queued = True
        req.target = self.peer_id
        req.deadline = None
        self._queue.append(req.request_id)
        pending = self._pending_local
        for h in req.chain:
            pending[h] = pending.get(h, 0) + 1

    def _start_queued(self, effects: list[Effect]) -> None:
        while self._queue and self._running < self.config.costs.slots:
            rid = self._queue.popleft()
            req = self._requests.get(rid)
            if req is None or not req.local_queued:
                continue
            req.local_queued = False
            req.local_running = True
            self._running += 1
            self._stats["served_locally"] += 1
            params = req.params
            if req.resume_after:
                params = replace(params, max_tokens=max(1, params.max_tokens - len(req.resume_after)))
            effects.append(
                RunLocal(
                    request_id=rid,
                    tokens=req.tokens + req.resume_after,
                    params=params,
                    decision=req.decision,
                    resume_after=req.resume_after,
                )
            )

    def _release_pending(self, req: _Request) -> None:
        pending = self._pending_local
        for h in req.chain:
            c = pending.get(h, 0) - 1
            if c <= 0:
                pending.pop(h, None)
            else:
                pending[h] = c

    def _on_local_started(self, ev: LocalStarted, now: float) -> list[Effect]:
        return []

    def _on_local_finished(self, ev: LocalFinished, now: float) -> list[Effect]:
        effects: list[Effect] = []
        self._apply_local_changes(ev.cache_added, ev.cache_removed)
        req = self._requests.pop(ev.request_id, None)
        if req is not None:
            self._release_pending(req)
            if req.local_running:
                self._running -= 1
            elif req.local_queued:
                req.local_queued = False
        self._start_queued(effects)
        self._maybe_announce(now, effects)
        return effects

    def _on_cache_changed(self, ev: CacheChanged, now: float) -> list[Effect]:
        self._apply_local_changes(ev.added, ev.removed)
        effects: list[Effect] = []
        self._maybe_announce(now, effects)
        return effects

    def _apply_local_changes(
        self, added: Sequence[BlockHash], removed: Sequence[BlockHash]
    ) -> None:
        local = self.local
        for h in removed:
            local.block_removed(h)
        for h in added:
            local.block_added(h)

    def _on_forward_first_token(self, ev: ForwardFirstToken, now: float) -> list[Effect]:
        req = self._requests.get(ev.request_id)
        if req is not None and req.target == ev.peer:
            req.streaming = True
            req.deadline = None
        return []

    def _on_forward_finished(self, ev: ForwardFinished, now: float) -> list[Effect]:
        req = self._requests.get(ev.request_id)
        if req is not None and req.target == ev.peer:
            del self._requests[ev.request_id]
            self._forward_done(ev.peer)
        return []

    def _forward_done(self, peer: PeerId) -> None:
        n = self._inflight.get(peer, 0) - 1
        if n > 0:
            self._inflight[peer] = n
        else:
            self._inflight.pop(peer, None)

    def _on_forward_failed(self, ev: ForwardFailed, now: float) -> list[Effect]:
        req = self._requests.get(ev.request_id)
        if req is None or req.target != ev.peer:
            return []
        self._forward_done(ev.peer)
        self._stats["failovers"] += 1
        effects: list[Effect] = []
        req.target = None
        req.deadline = None
        if ev.reason in ("unavailable", "timeout") and ev.peer in self._peers:
            # It may be gone: stop routing to it until it is heard from again.
            self._peers[ev.peer].last_seen = -1e18
        if ev.generated or req.streaming:
            # Tokens already reached the client: finish here, after them.
            req.resume_after = req.resume_after + ev.generated
            self._enqueue_local(
                req, self._local_decision(req, f"resume after {ev.peer} failed mid-stream"), effects
            )
            self._start_queued(effects)
            return effects
        self._route_and_dispatch(req, now, effects)
        return effects

    def _on_cancel(self, ev: Cancel, now: float) -> list[Effect]:
        req = self._requests.get(ev.request_id)
        if req is None:
            return []
        effects: list[Effect] = []
        if req.local_running:
            effects.append(CancelLocal(req.request_id))  # LocalFinished will clean up
        elif req.local_queued:
            del self._requests[req.request_id]
            self._release_pending(req)
            req.local_queued = False
        elif req.target is not None:
            effects.append(CancelForward(req.request_id, req.target))
            del self._requests[req.request_id]
            self._forward_done(req.target)
        return effects

    def _check_forward_deadlines(self, now: float, effects: list[Effect]) -> None:
        expired = [
            r
            for r in self._requests.values()
            if r.deadline is not None and r.deadline <= now and r.target not in (None, self.peer_id)
        ]
        for req in expired:
            peer = req.target
            assert peer is not None
            effects.append(CancelForward(req.request_id, peer))
            effects.extend(
                self._on_forward_failed(ForwardFailed(req.request_id, peer, "timeout"), now)
            )

    # ------------------------------------------------------------------ anti-entropy

    def _maybe_announce(self, now: float, effects: list[Effect]) -> None:
        cfg = self.config
        changed = self.local.has_pending_changes()
        due = now >= self._next_announce
        early = changed and now >= self._last_announce + cfg.min_announce_gap_s
        if not (due or early):
            return
        delta = self.local.seal_epoch()
        self._last_announce = now
        self._next_announce = now + cfg.announce_interval_s
        self._stats["announces_sent"] += 1
        effects.append(
            Publish(
                Announce(
                    sender=self.peer_id,
                    epoch=delta.epoch,
                    prev_epoch=delta.prev_epoch,
                    root=delta.root,
                    count=delta.count,
                    load=self.load(),
                    added=tuple(delta.added),
                    removed=tuple(delta.removed),
                    truncated=delta.truncated,
                    time_ms=max(0, int(now * 1000)),
                )
            )
        )

    def _peer(self, peer: PeerId, now: float) -> _PeerState:
        st = self._peers.get(peer)
        if st is None:
            st = _PeerState(last_seen=now)
            self._peers[peer] = st
        return st

    def _refuse_announce(self, peer: PeerId, reason: str, detail: str) -> None:
        self._stats["announces_refused"] += 1
        key = (peer, reason)
        seen = self._refusals_seen
        if key in seen:
            return
        seen[key] = None
        if len(seen) > 4 * self.config.max_peers:
            del seen[next(iter(seen))]
        if len(self._refusals) < 1024:
            self._refusals.append((peer, reason, detail))

    def _ask_ping(self, peer: PeerId, now: float, effects: list[Effect]) -> None:
        """Ask the shell to ping a non-member (it will, over a direct connection only)."""
        asked = self._ping_asked
        last = asked.get(peer)
        if last is not None and now - last < self.config.ping_after_s:
            return
        asked.pop(peer, None)
        asked[peer] = now
        if len(asked) > 4 * self.config.max_peers:
            del asked[next(iter(asked))]
        effects.append(PingPeer(peer))

    def _on_announce(self, ev: AnnounceReceived, now: float) -> list[Effect]:
        a = ev.announce
        if ev.sender == self.peer_id or a.sender != ev.sender:
            # Our own echo, or a forwarded claim to speak for someone else.
            if a.sender != ev.sender:
                self._refuse_announce(ev.sender, "speaks for another peer", f"claims to be {a.sender}")
            return []
        st = self._peers.get(ev.sender)
        if st is None:
            # Not a member: heard only through gossip, or connected but not answered yet.
            self._stats["announces_unverified"] += 1
            self._refuse_announce(ev.sender, "not a member", "it has not answered this node directly yet")
            asked: list[Effect] = []
            self._ask_ping(ev.sender, now, asked)
            return asked
        last_epoch = self._last_epochs.get(ev.sender, 0)
        if a.epoch <= last_epoch:
            self._refuse_announce(ev.sender, "stale epoch", f"epoch {a.epoch} <= {last_epoch} (a replay?)")
            return []
        self._remember_epoch(ev.sender, a.epoch)
        st.last_announce_epoch = a.epoch
        st.announced_root = a.root
        st.last_seen = now
        index = self.index
        replica = index.add_peer(ev.sender)
        refused = replica.refused
        needs_pull = replica.apply_announce(
            a.prev_epoch, a.epoch, a.root, a.count, a.added, a.removed, a.truncated
        )
        if replica.refused != refused:
            # Claims a set larger than its allowance of the replica budget.
            self._refuse_announce(
                ev.sender, "over its replica allowance",
                f"claims {a.count} blocks, allowance {replica.max_elements}",
            )
        if self.index.enforce_allowance(ev.sender):
            self._replica_emptied(ev.sender)
            return []
        # The load, and if the replica now matches, its freshness (which also confirms the
        # speculative entries for the peer).
        index.announced(ev.sender, a.load, now, fresh=replica.epoch == a.epoch)
        effects: list[Effect] = []
        if not needs_pull:
            return effects
        st.pull_wanted = True
        if st.sync is None:
            self._start_pull(ev.sender, st, now, effects)
        return effects

    def _start_pull(self, peer: PeerId, st: _PeerState, now: float, effects: list[Effect]) -> None:
        replica = self.index.replica(peer)
        if replica is None:
            return
        session = self._next_session
        self._next_session += 1
        st.pull_wanted = False
        st.sync_session = session
        st.sync_deadline = now + self.config.sync_timeout_s
        st.sync_target_epoch = st.last_announce_epoch
        st.sync = replica.start_pull(
            session, st.last_announce_epoch, st.announced_root, attempt=st.sync_attempt
        )
        self._stats["syncs_started"] += 1
        effects.append(SendSyncRequest(peer, st.sync.first_request(), self.config.sync_timeout_s))

    def _remember_epoch(self, peer: PeerId, epoch: int) -> None:
        # Kept apart from the peer state, which is dropped when a peer goes quiet, so that a
        # replay of an old announcement cannot resurrect a forgotten peer's stale digest.
        epochs = self._last_epochs
        epochs.pop(peer, None)
        epochs[peer] = epoch
        if len(epochs) > 4 * self.config.max_peers:
            del epochs[next(iter(epochs))]

    def _replica_emptied(self, peer: PeerId) -> None:
        """The index emptied ``peer``'s replica (over its allowance): drop its pull."""
        self._stats["replicas_emptied"] += 1
        st = self._peers.get(peer)
        if st is not None:
            st.sync = None
            st.pull_wanted = False

    def _on_sync_response(self, ev: SyncResponseReceived, now: float) -> list[Effect]:
        st = self._peers.get(ev.peer)
        effects: list[Effect] = []
        if st is None or st.sync is None or ev.response.session != st.sync_session:
            return effects
        if st.sync.replica is not self.index.replica(ev.peer):
            st.sync = None  # the replica was emptied (replica budget) while the pull ran
            return effects
        try:
            nxt = st.sync.handle_response(ev.response)
        except ProtocolError:
            self._finish_sync(ev.peer, st, now, ok=False, effects=effects)
            return effects
        if self.index.enforce_allowance(ev.peer):
            self._replica_emptied(ev.peer)
            return effects
        st.last_seen = now
        if nxt is not None:
            st.sync_deadline = now + self.config.sync_timeout_s
            effects.append(SendSyncRequest(ev.peer, nxt, self.config.sync_timeout_s))
            return effects
        self._finish_sync(ev.peer, st, now, ok=st.sync.state == "converged", effects=effects)
        return effects

    def _finish_sync(
        self, peer: PeerId, st: _PeerState, now: float, *, ok: bool, effects: list[Effect]
    ) -> None:
        st.sync = None
        if ok:
            self._stats["syncs_converged"] += 1
            st.sync_attempt = 0
            self.index.mark_fresh(peer, now)
            self.index.confirm(peer, now)
        else:
            self._stats["syncs_failed"] += 1
            st.sync_attempt += 1  # the next pull uses another hash slice
        if st.pull_wanted:
            self._start_pull(peer, st, now, effects)

    def _on_sync_failed(self, ev: SyncFailed, now: float) -> list[Effect]:
        st = self._peers.get(ev.peer)
        effects: list[Effect] = []
        if st is not None and st.sync is not None and st.sync_session == ev.session:
            st.pull_wanted = False  # retry on the next announcement, not in a tight loop
            self._finish_sync(ev.peer, st, now, ok=False, effects=effects)
        return effects

    def _check_sync_deadlines(self, now: float, effects: list[Effect]) -> None:
        for peer, st in list(self._peers.items()):
            if st.sync is not None and st.sync_deadline <= now:
                st.pull_wanted = False
                self._finish_sync(peer, st, now, ok=False, effects=effects)

    # ------------------------------------------------------------------ liveness

    def _on_peer_seen(self, ev: PeerSeen, now: float) -> list[Effect]:
        if ev.peer == self.peer_id:
            return []
        if ev.rtt_s is None and ev.peer not in self._peers:
            # Connected, not yet answered: a member once a ping comes back.
            effects: list[Effect] = []
            self._ask_ping(ev.peer, now, effects)
            return effects
        self._ping_asked.pop(ev.peer, None)
        st = self._peer(ev.peer, now)
        st.last_seen = now
        if ev.rtt_s is not None:
            # Smoothed like TCP's SRTT so one slow ping does not swing routing.
            old = self._rtt.get(ev.peer)
            self._rtt[ev.peer] = ev.rtt_s if old is None else 0.8 * old + 0.2 * ev.rtt_s
        if ev.load is not None and ev.peer in self.index:
            self.index.set_load(ev.peer, ev.load, now)
        return []

    def _on_peer_lost(self, ev: PeerLost, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if ev.peer in self._peers:
            self._forget_peer(ev.peer, now, effects)
        return effects

    def _forget_peer(self, peer: PeerId, now: float, effects: list[Effect]) -> None:
        del self._peers[peer]
        self._rtt.pop(peer, None)
        self.index.remove_peer(peer)
        effects.append(DropPeer(peer))
        # Requests in flight to it fail over now rather than at their deadline.
        for req in list(self._requests.values()):
            if req.target == peer:
                effects.append(CancelForward(req.request_id, peer))
                effects.extend(
                    self._on_forward_failed(ForwardFailed(req.request_id, peer, "unavailable"), now)
                )

    def _check_liveness(self, now: float, effects: list[Effect]) -> None:
        cfg = self.config
        for peer, st in list(self._peers.items()):
            silent = now - st.last_seen
            if silent >= cfg.peer_timeout_s:
                self._forget_peer(peer, now, effects)
            elif silent >= cfg.ping_after_s and now - st.last_ping >= cfg.ping_after_s:
                st.last_ping = now
                effects.append(PingPeer(peer))


_HANDLERS: dict[type, Callable[[NodeCore, object, float], list[Effect]]] = {
    ClientRequest: NodeCore._on_client_request,  # type: ignore[dict-item]
    AnnounceReceived: NodeCore._on_announce,  # type: ignore[dict-item]
    SyncResponseReceived: NodeCore._on_sync_response,  # type: ignore[dict-item]
    SyncFailed: NodeCore._on_sync_failed,  # type: ignore[dict-item]
    LocalStarted: NodeCore._on_local_started,  # type: ignore[dict-item]
    LocalFinished: NodeCore._on_local_finished,  # type: ignore[dict-item]
    CacheChanged: NodeCore._on_cache_changed,  # type: ignore[dict-item]
    ForwardFirstToken: NodeCore._on_forward_first_token,  # type: ignore[dict-item]
    ForwardFinished: NodeCore._on_forward_finished,  # type: ignore[dict-item]
    ForwardFailed: NodeCore._on_forward_failed,  # type: ignore[dict-item]
    PeerSeen: NodeCore._on_peer_seen,  # type: ignore[dict-item]
    PeerLost: NodeCore._on_peer_lost,  # type: ignore[dict-item]
    Cancel: NodeCore._on_cancel,  # type: ignore[dict-item]
}
