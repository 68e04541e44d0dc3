"""``NodeCore``: the sans-IO node (see ``peerinfer.core.node`` for its theory of operation)."""

from __future__ import annotations

import enum
import functools
import math
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from peerinfer.core.antientropy import Reconciliation, Replica
from peerinfer.core.digest import DeltaMemo, LocalDigest
from peerinfer.core.fairshare import (
    Share,
    ShareKey,
    newcomer_service,
    next_turn,
    yields_needed,
)
from peerinfer.core.index import PeerIndex
from peerinfer.core.messages import (
    Announce,
    Load,
    SamplingParams,
    SyncRequest,
    SyncResponse,
)
from peerinfer.core.node.config import NodeConfig
from peerinfer.core.node.events import (
    AnnounceReceived,
    AuditFinished,
    AuditForward,
    BanPeer,
    CacheChanged,
    Cancel,
    CancelForward,
    CancelLocal,
    ClientRequest,
    DropPeer,
    Effect,
    Event,
    Forward,
    ForwardFailed,
    ForwardFinished,
    ForwardFirstToken,
    LocalFinished,
    LocalPreempted,
    LocalStarted,
    NodeStatistics,
    PeerLost,
    PeerSeen,
    PeerSnapshot,
    PingPeer,
    PreemptLocal,
    Publish,
    Reject,
    ResumeLocal,
    RunLocal,
    SendSyncRequest,
    Silence,
    SyncFailed,
    SyncResponseReceived,
)
from peerinfer.core.peerview import _Heard, _Kept
from peerinfer.core.prefix import PrefixHasher
from peerinfer.core.reputation import FAILURE_OUTCOMES, Reputation, judge_finished
from peerinfer.core.routing import (
    Candidate,
    RouteDecision,
    RouteRequest,
    ScaffoldHints,
    make_policy,
)
from peerinfer.errors import ProtocolError
from peerinfer.types import BlockHash, PeerId, RequestId

# ---------------------------------------------------------------------------------------------
# Request lifecycle


class Phase(enum.Enum):
    """Where a request this node holds is (see "Request lifecycle" above)."""

    #: arrived; the handler is deciding where it goes (never seen between events)
    ROUTING = "routing"
    #: waiting in its requester's queue for a local slot
    QUEUED = "queued"
    #: on the local engine (holds a slot)
    RUNNING = "running"
    #: yielded its slot mid-generation (over its requester's share while another waited);
    #: waits in its requester's share to resume where it stopped (the engine keeps its state)
    PREEMPTED = "preempted"
    #: sent to ``target``, no first token yet (``deadline`` set)
    FORWARDED = "forwarded"
    #: ``target`` streams tokens, relayed to the client
    RELAYING = "relaying"
    #: ended (served, failed, cancelled or refused) and forgotten
    DONE = "done"


#: Every allowed move: phase -> {next phase: the cause}. Anything else is a bug (``_transition``
#: raises).
_TRANSITIONS: dict[Phase, dict[Phase, str]] = {
    Phase.ROUTING: {
        Phase.QUEUED: "routed here (always, for a forwarded request)",
        Phase.FORWARDED: "routed to a peer",
        Phase.DONE: "refused: busy (queue or share full)",
    },
    Phase.QUEUED: {
        Phase.RUNNING: "a slot freed and its requester's turn came",
        Phase.DONE: "cancelled while waiting",
    },
    Phase.RUNNING: {
        Phase.DONE: "the engine finished, failed or was cancelled (LocalFinished)",
        Phase.PREEMPTED: "over its share while another requester waits: yielded its slot "
                         "after preempt_after_tokens tokens (LocalPreempted)",
    },
    Phase.PREEMPTED: {
        Phase.RUNNING: "a slot freed and its requester's turn came: resumes (ResumeLocal)",
        Phase.DONE: "cancelled or failed while preempted (LocalFinished)",
    },
    Phase.FORWARDED: {
        Phase.RELAYING: "the peer's first token",
        Phase.FORWARDED: "failed before a token: fail over to the next peer",
        Phase.QUEUED: "failed: fail over to the local engine (or resume after relayed tokens)",
        Phase.DONE: "finished, cancelled, or failed over into a full queue (refused)",
    },
    Phase.RELAYING: {
        Phase.QUEUED: "failed mid-stream: resume locally after the relayed tokens",
        Phase.DONE: "finished or cancelled",
    },
    Phase.DONE: {},
}

_LOCAL_PHASES = (Phase.QUEUED, Phase.RUNNING, Phase.PREEMPTED)
_FORWARD_PHASES = (Phase.FORWARDED, Phase.RELAYING)

# ---------------------------------------------------------------------------------------------
# Internal state


@dataclass(slots=True)
class _Request:
    request_id: RequestId
    tokens: tuple[int, ...]
    params: SamplingParams
    forwarded: bool
    chain: tuple[BlockHash, ...]
    share: ShareKey
    phase: Phase = Phase.ROUTING
    decision: RouteDecision | None = None
    #: peers tried so far, in order
    tried: list[PeerId] = field(default_factory=list)
    #: the peer serving it, in the forward phases only
    target: PeerId | None = None
    #: first-token deadline, in FORWARDED only
    deadline: float | None = None
    resume_after: tuple[int, ...] = ()
    #: the prompt tokens the target's own digest claimed when it was chosen (what it is held to)
    claimed_tokens: int = 0
    #: the target claims to be faster than this node, not proven yet: it was estimated at no
    #: more than our speed, and a first token well inside that estimate counts as a proof
    speed_on_probation: bool = False
    #: RUNNING: the local start count when it last (re)started (the smallest runs longest),
    #: and whether it was asked to yield its slot (``PreemptLocal``) and has not yet
    started_at: int = 0
    yielding: bool = False
    #: the prompt's scaffold hash (``ClientRequest.scaffold``)
    scaffold: int | None = None
    #: when it entered its phase (the time of the event that moved it)
    phase_since: float = 0.0


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


def _after(params: SamplingParams, generated: tuple[int, ...]) -> SamplingParams:
    """``params`` for the rest of an answer whose first ``generated`` tokens were served
    elsewhere: fewer tokens left, and a constraint that starts after them."""
    constraint = params.constraint
    if constraint is not None:
        constraint = replace(constraint, consumed=constraint.consumed + generated)
    return replace(params, max_tokens=max(1, params.max_tokens - len(generated)),
                   constraint=constraint)


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
        delta_memo: DeltaMemo | None = None,
    ) -> None:
        self.config = config
        self.hasher = hasher
        self.rng = rng
        self.policy = make_policy(config.policy, costs=config.costs)
        #: the scaffolds this node served lately, advertised in its load (only for the
        #: ``scaffold_hash`` policy, whose hints they are), and the live ones as last read
        self._hints = ScaffoldHints() if config.policy == "scaffold_hash" else None
        self._scaffolds: tuple[int, ...] = ()
        #: announced in every load, so that peers estimate this node at its own speed
        self._speed: tuple[int, ...] = config.costs.speed()
        self.local = LocalDigest(epoch_base=epoch_base)
        # ``delta_memo``: the replicas of a simulator's cores share delta results (digest.py).
        self._index = PeerIndex(
            max_peers=config.max_peers, replica_budget_blocks=config.replica_budget_blocks,
            replica_factory=None if delta_memo is None else functools.partial(Replica, memo=delta_memo),
        )
        #: per peer, the last check that its unchanged announcements may wait, and those of
        #: them not taken in yet (only with ``config.lazy_announcements``)
        self._kept: dict[PeerId, _Kept] = {}
        self._unapplied: dict[PeerId, _Kept] = {}
        #: per peer, the kept record of the shared run this node follows (``AnnounceRun``)
        self._following: dict[PeerId, _Kept] = {}
        #: no peer can be due for a ping or be forgotten before this time (``_check_liveness``
        #: skips its loop until then), and whether some peer may have a pull running
        self._liveness_due = -math.inf
        self._pulls_may_run = False
        self._peers: dict[PeerId, _PeerState] = {}
        self._requests: dict[RequestId, _Request] = {}
        #: requesters with requests waiting or running here (peerinfer.core.fairshare), and
        #: the totals over them (``_queued``: waiting, new or preempted)
        self._shares: dict[ShareKey, Share] = {}
        self._queued = 0
        self._running = 0
        self._local_starts = 0
        #: the time of the event (or tick) being handled: when a phase change happens
        self._clock = now
        # Blocks of requests queued or running here: the local engine will hold them soon.
        self._pending_local: dict[BlockHash, int] = {}
        self._next_announce = now
        self._last_announce = -1e18
        self._next_session = 1
        self._last_epochs: dict[PeerId, int] = {}
        #: smoothed round trips, and requests we forwarded that have not finished, per peer
        self._rtt: dict[PeerId, float] = {}
        #: grows whenever ``_rtt`` changes (the index keeps peers in rtt order for routing)
        self._rtt_version = 0
        #: no peer has announced another speed than this node's or more than one slot (then
        #: routing finds the best non-holders among the nearest: ``PeerIndex.holder_candidates``)
        self._plain_loads = True
        self._inflight: dict[PeerId, int] = {}
        self.reputation = Reputation(config.reputation)
        # Audit sampling has its own dice, so enabling audits leaves routing's draws unchanged.
        self._audit_rng = random.Random(f"audit/{config.peer_id}")
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
                "completed",
                "announces_sent",
                "announces_refused",
                "announces_unverified",
                "replicas_emptied",
                "syncs_started",
                "syncs_converged",
                "syncs_failed",
                "preempted",
                "resumed",
            ),
            0,
        )

    # ------------------------------------------------------------------ public surface

    @property
    def peer_id(self) -> PeerId:
        return self.config.peer_id

    @property
    def index(self) -> PeerIndex:
        """The peer index, every announcement received taken in (``_take_unapplied``)."""
        if self._following:
            for peer, kept in self._following.items():
                if kept.run is not None and kept.run.length != kept.cursor:
                    self._catch_up(peer, kept)
        if self._unapplied:
            self._take_all_unapplied()
        return self._index

    def _take_all_unapplied(self) -> None:
        """Take in every kept announcement (``_take_unapplied`` for every peer, in one call)."""
        if self._unapplied:
            pending, self._unapplied = self._unapplied, {}
            for kept in pending.values():
                kept.replica.take_unchanged(kept.times, kept.epoch, kept.root, kept.count)
                kept.replica_epoch = kept.epoch
                kept.times = 0
            # Peers' states are disjoint: their replicas first, then their index entries.
            self._index.announced_fresh([(p, k.load, k.at) for p, k in pending.items()])

    def load(self) -> Load:
        return Load(
            queued=self._queued, running=self._running, slots=self.config.costs.slots,
            speed=self._speed, scaffolds=self._scaffolds,
        )

    def _refresh_hints(self, now: float) -> None:
        """Forget the scaffold hints that aged out by ``now`` (``load()`` advertises the rest)."""
        if self._hints is not None:
            self._scaffolds = self._hints.current(now)

    def handle(self, event: Event, now: float) -> list[Effect]:
        """Process one event; return the effects to execute, in order."""
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"NodeCore cannot handle {type(event).__name__}")
        changes = self._index.allowance_changes
        self._clock = now
        effects: list[Effect] = handler(self, event, now)
        if self._following and self._index.allowance_changes != changes:
            self._recheck_following()
        return effects

    def tick(self, now: float) -> list[Effect]:
        """Timers: announcements, sync deadlines, forward deadlines, liveness."""
        effects: list[Effect] = []
        changes = self._index.allowance_changes
        self._clock = now
        self._check_forward_deadlines(now, effects)
        self._check_sync_deadlines(now, effects)
        self._check_liveness(now, effects)
        self._maybe_announce(now, effects)
        # Expiry only drops speculative entries, which only their own peer's announcements
        # also drop: the other peers' announcements may wait.
        index = self._index
        if self._unapplied and index.speculative_blocks():
            unapplied = self._unapplied
            for peer in [p for p in index.speculative_peers() if p in unapplied]:
                self._take_unapplied(peer)
        index.expire(now)
        if now >= self._next_rebalance:
            self._next_rebalance = now + self.config.rebalance_interval_s
            for peer in self._rebalance():
                self._replica_emptied(peer)
        if self._following and self._index.allowance_changes != changes:
            self._recheck_following()
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
        if self._pulls_may_run:
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
        return NodeStatistics(queued=self._queued, running=self._running, **self._stats)

    def pending_requests(self) -> list[RequestId]:
        return list(self._requests)

    def phase(self, request_id: RequestId) -> Phase | None:
        """The phase of a request this node holds (None: not held, e.g. done)."""
        req = self._requests.get(request_id)
        return None if req is None else req.phase

    def silence(self, request_id: RequestId, last_event: float, engine_progress: float) -> Silence:
        """How long the client of ``request_id``, which had its last event at ``last_event``,
        may go on hearing nothing; ``engine_progress``: when the local engine last completed
        a step. Silence counts only while the request is served, never while it waits its
        turn (the shell's gap clock asks this whenever its deadline passes):

        * running here (or not held: ending): ``token_gap_timeout_s`` after the later of its
          last event and its (re)start;
        * waiting here, new or preempted: as long as its turn takes, provided the engine makes
          progress (the slots' holders stream, finish, yield): ``token_gap_timeout_s`` after
          the later of its last event, its entry and the engine's last step. An engine stuck
          in a step, or a queue that no longer moves, still ends it;
        * with a peer: the forward's own deadlines (first token, token gap) bound each wait
          and fail over rather than end the request; the backstop is twice
          ``token_gap_timeout_s``, so it never races them.
        """
        gap = self.config.token_gap_timeout_s
        req = self._requests.get(request_id)
        if req is None or req.phase in (Phase.ROUTING, Phase.RUNNING):
            since = last_event if req is None else max(last_event, req.phase_since)
            return Silence(since + gap, False, f"no token for {gap:.0f} s while running")
        if req.phase in (Phase.QUEUED, Phase.PREEMPTED):
            since = max(last_event, req.phase_since, engine_progress)
            return Silence(
                since + gap, True,
                f"waited for a slot ({req.phase.value}) while the engine made no progress "
                f"for {gap:.0f} s",
            )
        since = max(last_event, req.phase_since)
        return Silence(since + 2 * gap, False,
                       f"no token from {req.target} for {2 * gap:.0f} s")

    def check_invariants(self) -> None:
        """Raise AssertionError if any count disagrees with the requests it counts.

        Recounted from the requests: every request is in one phase and one place (the queues
        hold exactly the QUEUED ones and the paused queues the PREEMPTED ones, each once, in
        its requester's share), the running count is the RUNNING ones and within capacity, no
        request waits while a slot is free, with preemption on no requester below its share
        waits without a slot coming (free or yielding), only RUNNING requests yield, the
        in-flight count per peer is the FORWARDED/RELAYING ones sent there, the blocks pending
        locally are those of the local chains, each share counts its requests, no done
        request is kept, and the statistics add up. O(requests + their blocks).
        """

        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise AssertionError(f"node {self.peer_id} invariant violated: {msg}")

        slots = self.config.costs.slots
        phases = Counter(r.phase for r in self._requests.values())
        check(not phases[Phase.ROUTING] and not phases[Phase.DONE], f"transient phases kept: {phases}")
        queued_ids = [rid for share in self._shares.values() for rid in share.queue]
        paused_ids = [rid for share in self._shares.values() for rid in share.paused]
        held_queued = {rid for rid, r in self._requests.items() if r.phase is Phase.QUEUED}
        held_paused = {rid for rid, r in self._requests.items() if r.phase is Phase.PREEMPTED}
        check(len(queued_ids) + len(paused_ids) == len(set(queued_ids) | set(paused_ids)),
              "a request waits twice")
        check(set(queued_ids) == held_queued, "the queue does not hold exactly the QUEUED requests")
        check(set(paused_ids) == held_paused,
              "the paused queues do not hold exactly the PREEMPTED requests")
        waiting = len(held_queued) + len(held_paused)
        check(self._queued == waiting, f"waiting count {self._queued} != {waiting}")
        check(self._running == phases[Phase.RUNNING], f"running count {self._running} != "
              f"{phases[Phase.RUNNING]} RUNNING requests")
        check(self._running <= slots, f"{self._running} running on {slots} slots")
        check(not self._queued or self._running == slots, "a request waits while a slot is free")
        inflight: Counter[PeerId] = Counter()
        pending: Counter[BlockHash] = Counter()
        outstanding: Counter[ShareKey] = Counter()
        running: Counter[ShareKey] = Counter()
        yielding: Counter[ShareKey] = Counter()
        attempts = self.config.max_forward_attempts
        for rid, req in self._requests.items():
            check(rid == req.request_id, f"request {rid!r} is filed under another id")
            check(len(req.tried) <= attempts, f"{rid!r} was forwarded {len(req.tried)} times")
            if req.phase in _FORWARD_PHASES:
                check(not req.forwarded, f"{rid!r} arrived forwarded and was forwarded again")
                check(req.target is not None and req.target != self.peer_id
                      and req.target == req.tried[-1], f"{rid!r} forwarded to {req.target!r}")
                assert req.target is not None
                inflight[req.target] += 1
                check((req.deadline is not None) == (req.phase is Phase.FORWARDED),
                      f"{rid!r} in {req.phase.value} with deadline {req.deadline}")
            else:
                check(req.target is None and req.deadline is None,
                      f"{rid!r} is {req.phase.value} but has a target or deadline")
                for h in req.chain:
                    pending[h] += 1
                outstanding[req.share] += 1
                if req.phase is Phase.RUNNING:
                    running[req.share] += 1
                    if req.yielding:
                        yielding[req.share] += 1
                    check(0 < req.started_at <= self._local_starts, f"{rid!r} started at "
                          f"{req.started_at}, after the last start {self._local_starts}")
                else:
                    check(not req.yielding, f"{rid!r} yields but is {req.phase.value}")
                if req.share in self._shares:
                    share = self._shares[req.share]
                    check(req.phase is not Phase.QUEUED or rid in share.queue,
                          f"{rid!r} waits in another requester's queue")
                    check(req.phase is not Phase.PREEMPTED or rid in share.paused,
                          f"{rid!r} is paused in another requester's share")
        check(dict(inflight) == self._inflight, f"in-flight per peer {self._inflight} != {dict(inflight)}")
        check(dict(pending) == self._pending_local, "blocks pending locally != the local chains")
        check({k: s.outstanding for k, s in self._shares.items()} == dict(outstanding),
              "a share does not count its requests (or an empty share is kept)")
        check({k: s.running for k, s in self._shares.items() if s.running} == dict(running),
              "a share does not count its running requests")
        check({k: s.yielding for k, s in self._shares.items() if s.yielding} == dict(yielding),
              "a share does not count its yielding requests")
        if self.config.preempt_after_tokens is not None:
            check(not yields_needed(self._shares, slots, self._running),
                  "a requester below its share waits with no slot coming")
        check(all(0 <= s.last_start <= self._local_starts for s in self._shares.values()),
              "a share started after the last start")
        st = self._stats
        check(st["requests"] == st["rejected"] + st["completed"] + len(self._requests),
              f"requests {st['requests']} != rejected {st['rejected']} + completed "
              f"{st['completed']} + held {len(self._requests)}")
        check(st["rejected_over_limit"] <= st["rejected"], "more over-limit refusals than refusals")
        check(st["forwarded"] >= st["failovers"] + sum(self._inflight.values()),
              "more forwards failed or in flight than were made")
        check(st["served_locally"] + st["resumed"] == self._local_starts >= self._running,
              "local starts disagree with served_locally, resumed or the running count")
        check(st["resumed"] <= st["preempted"], "more resumes than preemptions")

    def route(self, tokens: Sequence[int], params: SamplingParams, now: float,
              exclude: Sequence[PeerId] = (), scaffold: int | None = None) -> RouteDecision:
        """Ask the routing policy where ``tokens`` would go now (no side effects but the
        expiry of this node's own scaffold hints)."""
        chain = self.hasher.prompt_chain(tokens)
        return self._decide(len(tokens), params, chain, now, exclude, scaffold)

    # ------------------------------------------------------------------ requests

    def _on_client_request(self, ev: ClientRequest, now: float) -> list[Effect]:
        self._stats["requests"] += 1
        effects: list[Effect] = []
        cfg = self.config
        rid = ev.request_id
        if rid in self._requests:
            return self._refuse(rid, "invalid", f"duplicate request id {rid!r}")
        if not ev.tokens:
            return self._refuse(rid, "invalid", "the prompt is empty")
        if len(ev.tokens) > cfg.max_prompt_tokens:
            return self._refuse(
                rid,
                "invalid",
                f"the prompt has {len(ev.tokens)} tokens, more than this node's "
                f"max_prompt_tokens of {cfg.max_prompt_tokens}",
            )
        if ev.params.max_tokens > cfg.max_new_tokens:
            return self._refuse(
                rid,
                "invalid",
                f"max_tokens {ev.params.max_tokens} is more than this node's max_new_tokens "
                f"of {cfg.max_new_tokens}",
            )
        requester = ev.requester or (ev.origin if ev.forwarded and ev.origin else self.peer_id)
        if ev.forwarded:
            # Served where it lands: a forwarded request is never forwarded again. Refused
            # before its prompt is hashed: a refusal costs little.
            outstanding = self._queued + self._running
            if self._queued >= cfg.max_queue and self._running >= cfg.costs.slots:
                return self._refuse(rid, "busy", f"{self.peer_id} is at capacity",
                                    self._retry_hint(len(ev.tokens), ev.params))
            limit = ev.max_outstanding
            if limit is not None and outstanding > limit:
                self._stats["rejected_over_limit"] += 1
                return self._refuse(
                    rid,
                    "busy",
                    f"{self.peer_id} has {outstanding} requests outstanding, more than the "
                    f"{limit} the origin's routing assumed",
                    self._retry_hint(len(ev.tokens), ev.params),
                )
        chain = self.hasher.prompt_chain(ev.tokens)
        req = _Request(rid, ev.tokens, ev.params, ev.forwarded, chain, (ev.local, requester))
        req.scaffold = ev.scaffold
        self._requests[rid] = req
        if ev.forwarded:
            self._admit_local(req, None, effects, now)
            return effects
        self._route_and_dispatch(req, now, effects)
        return effects

    def _refuse(
        self, request_id: RequestId, code: str, message: str, retry_after_s: float = 0.0
    ) -> list[Effect]:
        """Refuse an arrival before it is held."""
        self._stats["rejected"] += 1
        return [Reject(request_id, code, message, retry_after_s)]

    def _retry_hint(self, prompt_tokens: int, params: SamplingParams) -> float:
        """When retrying a busy refusal is worth it: about the time for one slot's worth of
        the waiting work ahead to be served (by the cost model), at least 1 s, at most 10
        minutes. A hint, not a promise: it says "not at once" without telling a stranger more
        than the load it announces anyway."""
        costs = self.config.costs
        one = costs.service_s(prompt_tokens, 0, params.max_tokens)
        ahead = (self._queued + 1) / max(1, costs.slots)
        return float(min(600.0, max(1.0, math.ceil(one * ahead))))

    def _decide(
        self,
        prompt_tokens: int,
        params: SamplingParams,
        chain: tuple[BlockHash, ...],
        now: float,
        exclude: Sequence[PeerId],
        scaffold: int | None = None,
    ) -> RouteDecision:
        bs = self.hasher.block_size
        cfg = self.config
        if self._hints is not None:
            self._refresh_hints(now)  # the local candidate's load: its live hints
        index, heard = self._routing_index()
        request = RouteRequest(
            prompt_tokens=prompt_tokens, max_tokens=params.max_tokens, chain=chain, scaffold=scaffold
        )
        options = dict(
            block_size=bs,
            local_peer=self.peer_id,
            local_matched_tokens=self._local_match_blocks(chain) * bs,
            local_load=self.load(),
            now=now,
            rtt_s=self._rtt,
            default_rtt_s=cfg.default_rtt_s,
            inflight=self._inflight,
            exclude=_Excluded(exclude, self.reputation.blocked(), cfg.trusted_peers, now),
            max_digest_age_s=cfg.max_digest_age_s,
            # Never count the last prompt token as cached: the engine must run it for logits.
            max_matched_tokens=max(0, prompt_tokens - 1),
            heard=heard,
        )
        among_holders = getattr(self.policy, "choose_among_holders", None)
        if among_holders is None or not self.config.route_among_holders:
            candidates = index.candidates(chain, **options)  # type: ignore[arg-type]
            return self.policy.choose(request, self._believed(candidates, now), self.rng)
        # Only the peers holding part of the prompt, and the plain non-holders' stand-ins
        # (PeerIndex.holder_candidates); every candidate only when a stand-in could win.
        pruned = index.holder_candidates(
            chain, own_speed=self._speed, plain_loads=self._plain_loads,
            rtt_version=self._rtt_version, **options,  # type: ignore[arg-type]
        )
        decision: RouteDecision | None = among_holders(
            request, self._believed(pruned.candidates, now), self.rng, pruned.stand_ins
        )
        if decision is None:
            decision = self.policy.choose(request, self._believed(pruned.every(), now), self.rng)
        return decision

    def _believed(self, candidates: list[Candidate], now: float) -> list[Candidate]:
        """``candidates`` as routing believes them: a demoted peer's cache promises count for
        nothing, and a claim to be faster than this node only once proven."""
        demoted = self.reputation.demoted()
        if demoted:
            # A peer whose claims did not hold: its cache promises count for nothing in the
            # choice (it still answers for them if chosen on load: see _digest_claim).
            candidates = [
                replace(c, matched_tokens=0) if demoted.get(c.peer, now) > now else c
                for c in candidates
            ]
        own = self._speed
        if any(c.load.speed and c.load.speed != own for c in candidates):
            # A claim to be faster than this node is believed only once proven (reputation.py,
            # "Speed claims"): announcing speed 0 would otherwise win every choice.
            candidates = [self._with_believed_speed(c, now) for c in candidates]
        return candidates

    def _believed_speed(self, peer: PeerId, speed: tuple[int, ...], now: float) -> tuple[int, ...] | None:
        """What routing believes of ``peer``'s announced ``speed`` when that differs from the
        claim (None: the claim is believed): until ``peer`` has proven to be faster than this
        node, each figure is at least this node's own (slower claims are always believed)."""
        own = self._speed
        if not speed or speed == own or len(speed) != len(own):
            return None
        believed = tuple(max(a, b) for a, b in zip(speed, own, strict=True))
        if believed == speed or self.reputation.speed_proven(peer, now):
            return None
        return believed

    def _with_believed_speed(self, c: Candidate, now: float) -> Candidate:
        believed = None if c.is_local else self._believed_speed(c.peer, c.load.speed, now)
        if believed is None:
            return c
        # () is "as this node" to the cost policy.
        return replace(c, load=replace(c.load, speed=() if believed == self._speed else believed))

    def _route_and_dispatch(self, req: _Request, now: float, effects: list[Effect]) -> None:
        attempts_left = self.config.max_forward_attempts - len(req.tried)
        if attempts_left > 0:
            decision = self._decide(
                len(req.tokens), req.params, req.chain, now, req.tried, req.scaffold
            )
        else:
            decision = self._local_decision(req, "failover: forward attempts exhausted")
        req.decision = decision
        if decision.is_local:
            self._admit_local(req, decision, effects, now)
            return
        peer = decision.target
        req.tried.append(peer)
        self._transition(
            req, Phase.FORWARDED, target=peer, deadline=now + self.config.first_token_timeout_s
        )
        req.claimed_tokens = self._digest_claim(peer, req.chain, len(req.tokens))
        req.speed_on_probation = self._believed_speed(peer, self._index.load(peer).speed, now) is not None
        # Right after _decide's _routing_index: the peers with speculative entries are taken
        # in, and a new entry is younger than whatever the others' followed runs confirm.
        self._index.add_speculative(peer, req.chain, now)
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
                scaffold=req.scaffold,
            )
        )

    def _digest_claim(self, peer: PeerId, chain: Sequence[BlockHash], prompt_tokens: int) -> int:
        """The prompt tokens ``peer``'s own announced digest says it holds: what it is held to
        (not this node's speculative entries, nor routing's discounts)."""
        replica = self._index.replica(peer)  # unchanged announcements leave the digest alone
        if replica is None:
            return 0
        n = replica.digest.leading(chain)
        return min(n * self.hasher.block_size, max(0, prompt_tokens - 1))

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

    def _admit_local(
        self, req: _Request, decision: RouteDecision | None, effects: list[Effect], now: float
    ) -> None:
        """Queue ``req`` here (it starts at once if a slot is free), or refuse it as busy when
        the queue, or its requester's share of it, is full."""
        cfg = self.config
        if self._queued >= cfg.hard_max_queue:
            hint = self._retry_hint(len(req.tokens), req.params)
            self._end(req, effects, Reject(
                req.request_id, "busy",
                f"the local queue is full (hard_max_queue {cfg.hard_max_queue}); retry in "
                f"about {hint:.0f} s", hint,
            ))
            return
        _, requester = req.share
        share = self._shares.get(req.share)
        waiting = share.waiting if share is not None else 0
        bound = cfg.queued_per_requester
        if requester != self.peer_id and waiting >= bound:
            hint = self._retry_hint(len(req.tokens), req.params)
            message = (
                f"{requester} already has {waiting} requests waiting at {self.peer_id}, its "
                f"fair share (max_queued_per_peer {bound}); retry in about {hint:.0f} s"
            )
            self._end(req, effects, Reject(req.request_id, "busy", message, hint))
            return
        req.decision = decision
        self._transition(req, Phase.QUEUED)
        if self._hints is not None and req.scaffold is not None:
            # Served here from now on: advertised as a hint (Mesh LLM's, at admission).
            self._hints.served(req.scaffold, now)
            self._refresh_hints(now)
        self._start_queued(effects)

    # ------------------------------------------------------------------ fair share of the engine
    # Which requester's request runs, waits or yields: decided by peerinfer.core.fairshare
    # from the shares' counts; here only the requests are moved (see "Admit, fair share").

    def _start_queued(self, effects: list[Effect]) -> None:
        """Fill free slots, each with the request whose requester's turn it is (a preempted
        one resumes before its requester's new ones); then ask for the yields the fair share
        needs."""
        slots = self.config.costs.slots
        while self._queued and self._running < slots:
            share = self._shares[next_turn(self._shares, slots)]
            if share.paused:
                req = self._requests[share.paused[0]]
                self._transition(req, Phase.RUNNING)
                self._stats["resumed"] += 1
                effects.append(ResumeLocal(req.request_id))
                continue
            req = self._requests[share.queue[0]]
            self._transition(req, Phase.RUNNING)
            self._stats["served_locally"] += 1
            params = req.params
            if req.resume_after:
                params = _after(params, req.resume_after)
            effects.append(
                RunLocal(
                    request_id=req.request_id,
                    tokens=req.tokens + req.resume_after,
                    params=params,
                    decision=req.decision,
                    resume_after=req.resume_after,
                )
            )
        self._ask_yields(effects)

    def _ask_yields(self, effects: list[Effect]) -> None:
        """While a requester below its share waits with no slot coming, the requester furthest
        above its own yields one: its longest-running generation not yet asked to."""
        after = self.config.preempt_after_tokens
        if after is None or not self._queued:
            return
        for key in yields_needed(self._shares, self.config.costs.slots, self._running):
            victim: _Request | None = None
            for req in self._requests.values():
                if (req.share == key and req.phase is Phase.RUNNING and not req.yielding
                        and (victim is None or req.started_at < victim.started_at)):
                    victim = req
            assert victim is not None, f"{key} runs more than it is asked to yield"
            victim.yielding = True
            self._shares[key].yielding += 1
            effects.append(PreemptLocal(victim.request_id, after))

    def _on_local_preempted(self, ev: LocalPreempted, now: float) -> list[Effect]:
        effects: list[Effect] = []
        req = self._requests.get(ev.request_id)
        if req is None or req.phase is not Phase.RUNNING:
            return effects  # it ended meanwhile (LocalFinished came first)
        self._shares[req.share].served += ev.generated
        self._stats["preempted"] += 1
        self._transition(req, Phase.PREEMPTED)
        self._start_queued(effects)
        return effects

    def _transition(
        self,
        req: _Request,
        new: Phase,
        *,
        target: PeerId | None = None,
        deadline: float | None = None,
    ) -> None:
        """Move ``req`` to ``new`` (``target`` and ``deadline``: entering FORWARDED), keeping
        every count that depends on phases. A move not in ``_TRANSITIONS`` is a bug in this
        module: AssertionError."""
        old = req.phase
        rid = req.request_id
        if new not in _TRANSITIONS[old]:
            raise AssertionError(f"request {rid!r}: no transition from {old.value} to {new.value}")
        if new is Phase.FORWARDED and (req.forwarded or target is None or target == self.peer_id):
            raise AssertionError(f"request {rid!r}: forwarding it to {target!r} is not allowed")
        # Leave the old phase.
        if old is Phase.QUEUED or old is Phase.PREEMPTED:
            share = self._shares[req.share]
            queue = share.queue if old is Phase.QUEUED else share.paused
            if queue[0] == rid:
                queue.popleft()
            else:
                queue.remove(rid)
            self._queued -= 1
        elif old is Phase.RUNNING:
            self._running -= 1
            share = self._shares[req.share]
            share.running -= 1
            if req.yielding:
                req.yielding = False
                share.yielding -= 1
        elif old in _FORWARD_PHASES and new is not Phase.RELAYING:
            assert req.target is not None
            self._forward_done(req.target)
            req.target = None
        req.deadline = None
        was_local, is_local = old in _LOCAL_PHASES, new in _LOCAL_PHASES
        if was_local and not is_local:
            self._release_pending(req)
            share = self._shares[req.share]
            share.outstanding -= 1
            if share.outstanding == 0:
                del self._shares[req.share]
        elif is_local and not was_local:
            pending = self._pending_local
            for h in req.chain:
                pending[h] = pending.get(h, 0) + 1
            joined = self._shares.get(req.share)
            if joined is None:
                joined = Share(served=newcomer_service(self._shares.values()))
                self._shares[req.share] = joined
            joined.outstanding += 1
        # Enter the new one.
        req.phase = new
        req.phase_since = self._clock
        if new is Phase.QUEUED:
            self._shares[req.share].queue.append(rid)
            self._queued += 1
        elif new is Phase.PREEMPTED:
            self._shares[req.share].paused.append(rid)
            self._queued += 1
        elif new is Phase.RUNNING:
            self._running += 1
            self._local_starts += 1
            req.started_at = self._local_starts
            share = self._shares[req.share]
            share.running += 1
            share.last_start = self._local_starts
        elif new is Phase.FORWARDED:
            assert target is not None
            req.target = target
            req.deadline = deadline
            self._inflight[target] = self._inflight.get(target, 0) + 1
        elif new is Phase.DONE:
            del self._requests[rid]

    def _end(self, req: _Request, effects: list[Effect], refusal: Reject | None = None) -> None:
        """The request ended: served, failed or cancelled, or refused with ``refusal``."""
        if refusal is None:
            self._stats["completed"] += 1
        else:
            self._stats["rejected"] += 1
            effects.append(refusal)
        self._transition(req, Phase.DONE)

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
        req = self._requests.get(ev.request_id)
        if req is not None and req.phase in _LOCAL_PHASES:
            self._shares[req.share].served += ev.generated
            self._end(req, effects)
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
        if req is not None and req.phase is Phase.FORWARDED and req.target == ev.peer:
            self._transition(req, Phase.RELAYING)
        return []

    def _on_forward_finished(self, ev: ForwardFinished, now: float) -> list[Effect]:
        effects: list[Effect] = []
        req = self._requests.get(ev.request_id)
        if req is not None and req.phase in _FORWARD_PHASES and req.target == ev.peer:
            self._end(req, effects)
            decision = req.decision
            if decision is not None:
                outcome = judge_finished(
                    self.reputation.config,
                    expected_cached_tokens=req.claimed_tokens,
                    cached_tokens=ev.cached_tokens,
                    estimated_ttft_s=decision.estimated_ttft_s,
                    ttft_s=ev.ttft_s,
                )
                self.reputation.record(ev.peer, outcome, now)
                estimate = decision.estimated_ttft_s
                if req.speed_on_probation and outcome == "served" and ev.ttft_s is not None and estimate is not None:
                    self.reputation.note_answer_speed(
                        ev.peer, estimated_at_own_speed_s=estimate, ttft_s=ev.ttft_s
                    )
            rate = self.config.audit_rate
            if (
                ev.completion
                and rate > 0
                and (
                    self._audit_rng.random() < rate
                    or self.reputation.audits(ev.peer) < self.config.audit_first
                )
            ):
                # Greedy answers must be the argmax, sampled ones inside the top-p nucleus
                # (peerinfer.engine.audit); the params say which.
                # A constrained answer is re-scored under its constraint, from where it began.
                params = req.params
                if req.resume_after and params.constraint is not None:
                    params = replace(params, constraint=replace(
                        params.constraint,
                        consumed=params.constraint.consumed + req.resume_after,
                    ))
                effects.append(
                    AuditForward(ev.peer, req.tokens + req.resume_after, params, ev.completion)
                )
        return effects

    def _on_audit_finished(self, ev: AuditFinished, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if ev.ok:
            self.reputation.record(ev.peer, "audit_passed", now)
            return effects
        self.reputation.record(ev.peer, "audit_failed", now)
        until = self.reputation.view(ev.peer, now).banned_until
        effects.append(BanPeer(ev.peer, until, f"failed an audit: {ev.detail}"[:200]))
        if ev.peer in self._peers:
            self._forget_peer(ev.peer, now, effects)
        return effects

    def _forward_done(self, peer: PeerId) -> None:
        n = self._inflight.get(peer, 0) - 1
        if n > 0:
            self._inflight[peer] = n
        else:
            self._inflight.pop(peer, None)

    def _on_forward_failed(self, ev: ForwardFailed, now: float) -> list[Effect]:
        req = self._requests.get(ev.request_id)
        if req is None or req.phase not in _FORWARD_PHASES or req.target != ev.peer:
            return []
        self._stats["failovers"] += 1
        effects: list[Effect] = []
        outcome = FAILURE_OUTCOMES.get(ev.reason, "unavailable")
        if outcome == "busy" and ev.peer in self.index:
            load = self.index.load(ev.peer)
            if load.queued + load.running < load.slots:
                outcome = "busy_lie"  # refused while its last announcement had a free slot
        self.reputation.record(ev.peer, outcome, now)
        if ev.reason in ("unavailable", "timeout") and ev.peer in self._peers:
            # It may be gone: stop routing to it until it is heard from again.
            self._catch_up_peer(ev.peer)
            self._peers[ev.peer].last_seen = -1e18
            self._liveness_due = -math.inf
        if len(req.resume_after) + len(ev.generated) >= req.params.max_tokens:
            # The whole budget reached the client before the peer failed: the shell ends the
            # answer there, nothing is left to resume.
            self._end(req, effects)
            return effects
        if ev.generated or req.phase is Phase.RELAYING:
            # Tokens already reached the client: finish here, after them, whatever the queue
            # holds (refusing now would cut a stream the client is reading).
            req.resume_after = req.resume_after + ev.generated
            req.decision = self._local_decision(req, f"resume after {ev.peer} failed mid-stream")
            self._transition(req, Phase.QUEUED)
            self._start_queued(effects)
            return effects
        self._route_and_dispatch(req, now, effects)
        return effects

    def _on_cancel(self, ev: Cancel, now: float) -> list[Effect]:
        req = self._requests.get(ev.request_id)
        if req is None:
            return []
        effects: list[Effect] = []
        if req.phase is Phase.RUNNING or req.phase is Phase.PREEMPTED:
            # LocalFinished ends it (the engine holds a preempted one's state too).
            effects.append(CancelLocal(req.request_id))
        elif req.phase is Phase.QUEUED:
            self._end(req, effects)
        elif req.phase in _FORWARD_PHASES:
            assert req.target is not None
            effects.append(CancelForward(req.request_id, req.target))
            self._end(req, effects)
        return effects

    def _check_forward_deadlines(self, now: float, effects: list[Effect]) -> None:
        expired = [
            r
            for r in self._requests.values()
            if r.phase is Phase.FORWARDED and r.deadline is not None and r.deadline <= now
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
        self._refresh_hints(now)
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
            self._liveness_due = -math.inf
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
        if ev.sender in self._following:
            # A new run (a follower is not handed its own run's announcements).
            self._unfollow(ev.sender)
        last_epoch = self._last_epochs.get(ev.sender, 0)
        if a.epoch <= last_epoch:
            self._refuse_announce(ev.sender, "stale epoch", f"epoch {a.epoch} <= {last_epoch} (a replay?)")
            return []
        self._remember_epoch(ev.sender, a.epoch)
        load = a.load
        if load.slots > 1 or load.speed and load.speed != self._speed:
            self._plain_loads = False
        st.last_announce_epoch = a.epoch
        st.announced_root = a.root
        st.last_seen = now
        if self.config.lazy_announcements:
            kept = self._kept.get(ev.sender)
            if kept is None or not (
                a.prev_epoch == kept.epoch < a.epoch
                and a.root == kept.root
                and a.count == kept.count
                and not (a.added or a.removed or a.truncated)
                and st.sync is None
                and not st.pull_wanted
                and a.count <= kept.replica.max_elements  # the allowance (rebalanced or not)
                and kept.replica.epoch == kept.replica_epoch
                and kept.replica.digest.flat_summary() == kept.summary
                and self._index.replica(ev.sender) is kept.replica
            ):
                kept = self._defer_unchanged(ev.sender, a, st)
            if kept is not None:
                kept.epoch, kept.load, kept.at = a.epoch, a.load, now
                kept.times += 1
                self._unapplied[ev.sender] = kept
                run = ev.run
                if run is not None and run.epoch == a.epoch and run.sender == ev.sender:
                    # Its next announcements that change nothing wait in the run.
                    kept.run, kept.cursor = run, run.length
                    run.followers.add(self.peer_id)
                    self._following[ev.sender] = kept
                return []
            if ev.sender in self._index:
                self._take_unapplied(ev.sender)
                index = self._index
            else:
                index = self.index  # adding a peer may evict the least recently fresh one
        else:
            index = self._index
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
        if len(replica.digest) > index.allowance(ev.sender):
            index = self.index  # emptying it may rebalance every peer's allowance
        if index.enforce_allowance(ev.sender):
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

    def _defer_unchanged(self, peer: PeerId, a: Announce, st: _PeerState) -> _Kept | None:
        """A record to keep ``a`` for later, if taking it in now could do nothing but move the
        replica to its epoch and record its load and freshness: no change, it chains from the
        replica's epoch, announces the replica's own root and count within its allowance, no
        pull is running or wanted (then it starts no pull, is not refused, empties nothing).
        Taking it in later (``_take_unapplied``) before anything reads this peer's state gives
        the same state: every read goes through ``index``, which takes everything in first,
        and so does any other announcement of the peer.

        Why: a node hears every peer about once a second, almost always with no change, and
        reads the index when it routes or rebalances, every few seconds; the announcements
        in between then cost a few attribute updates instead of a replica and index update."""
        if a.added or a.removed or a.truncated or st.sync is not None or st.pull_wanted:
            return None
        pending = self._unapplied.get(peer)
        if pending is not None:
            return None  # a kept one that this one does not follow: take both in now
        index = self._index
        replica = index.replica(peer)
        if replica is None:
            return None
        digest = replica.digest
        summary = digest.flat_summary()
        epoch = replica.epoch
        if (
            summary is None
            or a.prev_epoch != epoch
            or a.epoch <= epoch
            or a.count != summary[1]
            or a.count > replica.max_elements
            or a.count > index.allowance(peer)
            or a.root != digest.root
        ):
            return None
        kept = _Kept(replica, summary, epoch, a.root, a.count, epoch, a.load, 0.0)
        self._kept[peer] = kept
        return kept

    def _routing_index(self) -> tuple[PeerIndex, Mapping[PeerId, tuple[Load, float]] | None]:
        """The index for a routing decision, and the newer loads and freshness of the peers
        with announcements received but not taken in (kept ones, and followed runs'
        announcements since this node last looked: ``heard`` of ``PeerIndex.candidates``):
        what routing reads of them, without taking the rest in. Peers with speculative
        entries are taken in first (their confirmation drops entries the walk would see)."""
        index = self._index
        following = self._following
        unapplied = self._unapplied
        if (following or unapplied) and index.speculative_blocks() > 0:
            # Few peers hold speculative entries (those routed to lately): ask for them.
            for peer in index.speculative_peers():
                if peer in following or peer in unapplied:
                    self._take_unapplied(peer)
        if not (following or unapplied):
            return index, None
        return index, _Heard(following, unapplied)

    def _rebalance(self) -> list[PeerId]:
        """``self.index.rebalance()`` without taking in first what waits (kept announcements,
        followed runs): the index sizes the allowances as if it had been (``pending``), and
        takes it in only before it empties a replica. Like routing, a rebalance (every few
        seconds, over every peer) then leaves the runs to be read when something needs more."""
        pending: dict[PeerId, tuple[int, int, float]] = {
            p: (k.epoch, k.count, k.at) for p, k in self._unapplied.items()
        }
        for peer, kept in self._following.items():
            run = kept.run
            if run is not None and run.length != kept.cursor:
                pending[peer] = (run.epoch, run.count, run.at)
        return self._index.rebalance(pending=pending, before_emptying=self._take_everything)

    def _take_everything(self) -> None:
        self.index  # noqa: B018 - the property takes every announcement received in

    def _catch_up(self, peer: PeerId, kept: _Kept) -> None:
        """Move the announcements ``peer``'s followed run got since ``kept`` last looked into
        ``kept`` (to be taken in with the others kept), and record what receiving each does
        at once: the epoch remembered, the peer's announced epoch and root, when it was heard."""
        run = kept.run
        if run is None or run.length == kept.cursor:
            return
        kept.times += run.length - kept.cursor
        kept.cursor = run.length
        kept.epoch, kept.load, kept.at = run.epoch, run.load, run.at
        self._unapplied[peer] = kept
        st = self._peers[peer]
        st.last_announce_epoch = run.epoch
        st.announced_root = run.root
        st.last_seen = run.at
        self._remember_epoch(peer, run.epoch)

    def _catch_up_peer(self, peer: PeerId) -> None:
        kept = self._following.get(peer)
        if kept is not None:
            self._catch_up(peer, kept)

    def _unfollow(self, peer: PeerId) -> None:
        """Stop following ``peer``'s run (what it got so far is kept, to be taken in)."""
        kept = self._following.pop(peer, None)
        if kept is None or kept.run is None:
            return
        self._catch_up(peer, kept)
        kept.run.followers.discard(self.peer_id)
        kept.run = None

    def _recheck_following(self) -> None:
        """After an allowance or a replica object changed: leave every run whose next
        announcement would no longer wait (the check of ``_on_announce``, for the run)."""
        index = self._index
        for peer, kept in list(self._following.items()):
            st = self._peers.get(peer)
            run = kept.run
            replica = kept.replica
            if not (
                st is not None
                and run is not None
                and st.sync is None
                and not st.pull_wanted
                and run.count <= replica.max_elements
                and run.count <= index.allowance(peer)
                and replica.epoch == kept.replica_epoch
                and replica.digest.flat_summary() == kept.summary
                and index.replica(peer) is replica
            ):
                self._unfollow(peer)

    def _note_load(self, load: Load) -> None:
        if load.slots > 1 or load.speed and load.speed != self._speed:
            self._plain_loads = False

    def _take_unapplied(self, peer: PeerId) -> None:
        """Take in ``peer``'s kept announcements: what taking each in at once would have done."""
        self._catch_up_peer(peer)
        kept = self._unapplied.pop(peer, None)
        if kept is None:
            return
        kept.replica.take_unchanged(kept.times, kept.epoch, kept.root, kept.count)
        kept.replica_epoch = kept.epoch
        kept.times = 0
        # Loads and times only ever replace the older ones; confirming at the newest time drops
        # what confirming at each would have.
        self._index.announced(peer, kept.load, kept.at, fresh=True)

    def _start_pull(self, peer: PeerId, st: _PeerState, now: float, effects: list[Effect]) -> None:
        replica = self.index.replica(peer)
        if replica is None:
            return
        self._unfollow(peer)  # a pull running: its announcements no longer wait
        session = self._next_session
        self._next_session += 1
        st.pull_wanted = False
        st.sync_session = session
        st.sync_deadline = now + self.config.sync_timeout_s
        st.sync_target_epoch = st.last_announce_epoch
        st.sync = replica.start_pull(
            session, st.last_announce_epoch, st.announced_root, attempt=st.sync_attempt
        )
        self._pulls_may_run = True
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
        if not self._pulls_may_run:
            return
        running = False
        for peer, st in list(self._peers.items()):
            if st.sync is not None and st.sync_deadline <= now:
                st.pull_wanted = False
                self._finish_sync(peer, st, now, ok=False, effects=effects)
            running = running or st.sync is not None
        self._pulls_may_run = running

    # ------------------------------------------------------------------ liveness

    def _on_peer_seen(self, ev: PeerSeen, now: float) -> list[Effect]:
        if ev.peer == self.peer_id:
            return []
        if ev.rtt_s is None and ev.peer not in self._peers:
            # Connected, not yet answered: a member once a ping comes back. A ping asked
            # earlier (for gossip heard from it) went nowhere without a direct connection, so
            # it does not hold this one back (else a newcomer heard of through gossip first
            # waited ping_after_s for its membership).
            self._ping_asked.pop(ev.peer, None)
            effects: list[Effect] = []
            self._ask_ping(ev.peer, now, effects)
            return effects
        self._catch_up_peer(ev.peer)  # before it is heard from now
        self._ping_asked.pop(ev.peer, None)
        if ev.rtt_s is not None and ev.peer not in self._peers:
            # A new member holds no digest of ours: it refused what we announced before it
            # made us a member, which its own ping of us (crossing ours) does about now.
            # Announce again one gap from now rather than a whole interval later.
            self._next_announce = min(self._next_announce, now + self.config.min_announce_gap_s)
        st = self._peer(ev.peer, now)
        st.last_seen = now
        if ev.rtt_s is not None:
            # Smoothed like TCP's SRTT so one slow ping does not swing routing.
            old = self._rtt.get(ev.peer)
            self._rtt[ev.peer] = ev.rtt_s if old is None else 0.8 * old + 0.2 * ev.rtt_s
            self._rtt_version += 1
        if ev.load is not None:
            self._note_load(ev.load)
        if ev.load is not None and ev.peer in self.index:
            self.index.set_load(ev.peer, ev.load, now)
        return []

    def _on_peer_lost(self, ev: PeerLost, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if ev.peer in self._peers:
            self._forget_peer(ev.peer, now, effects)
        return effects

    def _forget_peer(self, peer: PeerId, now: float, effects: list[Effect]) -> None:
        self._unfollow(peer)
        del self._peers[peer]
        self._rtt.pop(peer, None)
        self._rtt_version += 1
        self.index.remove_peer(peer)
        self._kept.pop(peer, None)
        effects.append(DropPeer(peer))
        # Requests in flight to it fail over now rather than at their deadline.
        for req in list(self._requests.values()):
            if req.target == peer:
                effects.append(CancelForward(req.request_id, peer))
                effects.extend(
                    self._on_forward_failed(ForwardFailed(req.request_id, peer, "unavailable"), now)
                )

    def _check_liveness(self, now: float, effects: list[Effect]) -> None:
        if now < self._liveness_due:
            return
        cfg = self.config
        following = self._following
        # The earliest time any peer can be due again (peers are only heard later; a -1e18
        # "gone" mark or a new peer resets it to -inf meanwhile): the loop is skipped until then.
        self._liveness_due = due = math.inf
        ping_after, timeout = cfg.ping_after_s, cfg.peer_timeout_s
        for peer, st in list(self._peers.items()):
            last_seen = st.last_seen
            if following:
                # Heard since through a followed run (read, not taken in: no state moves).
                kept = following.get(peer)
                if kept is not None and kept.run is not None and kept.run.length != kept.cursor:
                    last_seen = kept.run.at
            silent = now - last_seen
            if silent >= timeout:
                self._forget_peer(peer, now, effects)
                continue
            if silent >= ping_after and now - st.last_ping >= ping_after:
                st.last_ping = now
                effects.append(PingPeer(peer))
            # Due again at the first of: forgotten, or pinged (silent, and not pinged lately).
            last_ping = st.last_ping
            nxt = (last_seen if last_seen > last_ping else last_ping) + ping_after
            if last_seen + timeout < nxt:
                nxt = last_seen + timeout
            if nxt < due:
                due = nxt
        # A margin: ``now - last_seen >= limit`` may hold a rounding error before the sum.
        if due < math.inf:
            due -= 1e-6 * (1.0 + abs(due))
        self._liveness_due = min(self._liveness_due, due)


_HANDLERS: dict[type, Callable[[NodeCore, object, float], list[Effect]]] = {
    ClientRequest: NodeCore._on_client_request,  # type: ignore[dict-item]
    AnnounceReceived: NodeCore._on_announce,  # type: ignore[dict-item]
    SyncResponseReceived: NodeCore._on_sync_response,  # type: ignore[dict-item]
    SyncFailed: NodeCore._on_sync_failed,  # type: ignore[dict-item]
    LocalStarted: NodeCore._on_local_started,  # type: ignore[dict-item]
    LocalFinished: NodeCore._on_local_finished,  # type: ignore[dict-item]
    LocalPreempted: NodeCore._on_local_preempted,  # type: ignore[dict-item]
    CacheChanged: NodeCore._on_cache_changed,  # type: ignore[dict-item]
    ForwardFirstToken: NodeCore._on_forward_first_token,  # type: ignore[dict-item]
    ForwardFinished: NodeCore._on_forward_finished,  # type: ignore[dict-item]
    ForwardFailed: NodeCore._on_forward_failed,  # type: ignore[dict-item]
    PeerSeen: NodeCore._on_peer_seen,  # type: ignore[dict-item]
    PeerLost: NodeCore._on_peer_lost,  # type: ignore[dict-item]
    Cancel: NodeCore._on_cancel,  # type: ignore[dict-item]
    AuditFinished: NodeCore._on_audit_finished,  # type: ignore[dict-item]
}


class _Excluded:
    """The peers a routing decision leaves out: those already tried, those reputation blocks
    (banned, or scored below the candidate threshold) until a later time, and, when the node
    trusts only some peers, every other one. A container, so the index asks ``peer in it``."""

    __slots__ = ("_tried", "_blocked", "_trusted", "_now")

    def __init__(
        self,
        tried: Sequence[PeerId],
        blocked: Mapping[PeerId, float],
        trusted: frozenset[PeerId] | None,
        now: float,
    ) -> None:
        self._tried, self._blocked, self._trusted, self._now = tried, blocked, trusted, now

    def __bool__(self) -> bool:
        return bool(self._tried or self._blocked or self._trusted is not None)

    def __contains__(self, peer: object) -> bool:
        if peer in self._tried:
            return True
        trusted = self._trusted
        if trusted is not None and peer not in trusted:
            return True
        until = self._blocked.get(peer)  # type: ignore[call-overload]
        return until is not None and bool(until > self._now)
