"""``NodeCore``: the sans-IO node, a composer of sub-machines (see ``peerinfer.core.node`` for the
theory of operation).

Each concern owns its state and its invariants in a module of its own, and none imports another:

* ``requests`` (``Requests``): the requests held, their phases, the engine's fair share;
* ``choice`` (``Choice``): the routing policy over the peer view, reputation and round trips;
* ``announcing`` (``Announcing``): this node's announcements, the ones received, pulls;
* ``members`` (``Members``): membership, pings, round trips, liveness;
* ``trust`` (``Trust``): judging outcomes, audits, bans.

Below them, ``peerinfer.core.peerview.PeerView`` holds the peer index with the announcements
not yet taken in. This module feeds each event to the parts it concerns, in an order written
out in the handlers: the sequencing across concerns (a forward failed: trust judges it, members
may mark the peer gone, requests fail it over, choice picks the next peer) is all here.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence

from peerinfer.core.antientropy import Replica
from peerinfer.core.digest import DeltaMemo, LocalDigest
from peerinfer.core.fairshare import Share, ShareKey
from peerinfer.core.index import PeerIndex
from peerinfer.core.messages import Load, SamplingParams, SyncRequest, SyncResponse
from peerinfer.core.node.announcing import Announcing
from peerinfer.core.node.choice import Choice
from peerinfer.core.node.config import NodeConfig
from peerinfer.core.node.events import (
    AnnounceReceived,
    AuditFinished,
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
    ProbeLink,
    PullChecked,
    PullFailed,
    PullLimit,
    Silence,
    SyncFailed,
    SyncResponseReceived,
    TransferMeasured,
)
from peerinfer.core.node.members import Members
from peerinfer.core.node.requests import FORWARD_PHASES, HeldRequest, Phase, Requests
from peerinfer.core.node.trust import Trust
from peerinfer.core.peerview import AnnounceRun, PeerView
from peerinfer.core.prefix import PrefixHasher
from peerinfer.core.reputation import Reputation
from peerinfer.core.routing import RouteDecision, RoutingPolicy
from peerinfer.types import BlockHash, PeerId, RequestId

__all__ = ["NodeCore"]

# (module constants: ``Phase.X`` is a slow read on CPython 3.11, see ``requests._QUEUED``)
_QUEUED = Phase.QUEUED
_RUNNING = Phase.RUNNING
_PREEMPTED = Phase.PREEMPTED
_FORWARDED = Phase.FORWARDED
_RELAYING = Phase.RELAYING


class NodeCore:
    """The sans-IO node. Feed it ``handle(event, now)`` and ``tick(now)``; execute what they return.

    ``tick`` must be called no later than ``next_deadline()`` (the shell sleeps until then or
    until the next event; the simulator schedules it). ``delta_memo``: shared with the other
    cores of one process whose replicas take in the same announcement objects (a simulator's;
    see "Shared deltas" in ``peerinfer.core.digest``).
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
        self._config = config
        self.hasher = hasher
        index = PeerIndex(
            max_peers=config.max_peers, replica_budget_blocks=config.replica_budget_blocks,
            masks=config.index_masks,
            replica_factory=None if delta_memo is None else functools.partial(Replica, memo=delta_memo),
        )
        # The view's index (it never replaces it): ``handle`` reads its allowance counter on
        # every event, without the view's property in between.
        self._peer_index = index
        self.members = Members(config)
        self.view = PeerView(
            index, config.peer_id, lazy=config.lazy_announcements,
            heard_through_run=self._heard_through_run, pull_idle=self._pull_idle,
        )
        self.announcing = Announcing(config, self.view, epoch_base=epoch_base, now=now)
        self.requests = Requests(config, config.peer_id, now=now)
        self.trust = Trust(config)
        self.choice = Choice(config, self.view, self.trust.reputation, rng,
                             block_size=hasher.block_size)
        self._next_rebalance = now + config.rebalance_interval_s

    # ------------------------------------------------------------------ values shared between parts

    def _heard_through_run(self, peer: PeerId, run: AnnounceRun) -> None:
        """The peer view takes in a followed run's announcements: what receiving each does."""
        self.announcing.heard_through_run(peer, run)
        self.members.heard(peer, run.at)

    def _pull_idle(self, peer: PeerId) -> bool:
        """Whether ``peer`` is a member with no pull running or wanted (the peer view's test of
        whether its unchanged announcements may wait)."""
        return peer in self.members and self.announcing.pull_idle(peer)

    # ------------------------------------------------------------------ public surface

    @property
    def config(self) -> NodeConfig:
        return self._config

    @config.setter
    def config(self, config: NodeConfig) -> None:
        """Retune the node (a shell or a test changing e.g. ``trusted_peers`` while it runs):
        every part reads the new config from its next event on. The policy, this node's peer
        id and its announced speed stay those it started with."""
        self._config = config
        for part in (self.members, self.announcing, self.requests, self.trust, self.choice):
            part.config = config
        self.view.lazy = config.lazy_announcements

    @property
    def peer_id(self) -> PeerId:
        return self.config.peer_id

    @property
    def index(self) -> PeerIndex:
        """The peer index, every announcement received taken in (``PeerView.index``)."""
        return self.view.index

    @property
    def local(self) -> LocalDigest:
        """This node's own digest."""
        return self.announcing.local

    @property
    def reputation(self) -> Reputation:
        return self.trust.reputation

    @reputation.setter
    def reputation(self, reputation: Reputation) -> None:
        """Replace the peers' reputation (a shell restoring it from disk): trust records into
        it and choice reads it."""
        self.trust.reputation = reputation
        self.choice.reputation = reputation

    @property
    def rng(self) -> random.Random:
        """Routing's dice (audits have their own: ``Trust.audit_rng``)."""
        return self.choice.rng

    @rng.setter
    def rng(self, rng: random.Random) -> None:
        self.choice.rng = rng

    @property
    def policy(self) -> RoutingPolicy:
        return self.choice.policy

    @policy.setter
    def policy(self, policy: RoutingPolicy) -> None:
        self.choice.policy = policy

    @property
    def shares(self) -> dict[ShareKey, Share]:
        """The requesters' shares of the local engine (read-only; for tests and benchmarks)."""
        return self.requests.shares

    def load(self) -> Load:
        return self.choice.load(self.requests.queued, self.requests.running)

    def handle(self, event: Event, now: float) -> list[Effect]:
        """Process one event; return the effects to execute, in order."""
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"NodeCore cannot handle {type(event).__name__}")
        index = self._peer_index
        changes = index.allowance_changes
        self.requests.clock = now
        effects: list[Effect] = handler(self, event, now)
        if index.allowance_changes != changes:  # (else ``recheck_following`` has nothing to do)
            self.view.recheck_following(changes)
        return effects

    def tick(self, now: float) -> list[Effect]:
        """Timers: announcements, sync deadlines, forward deadlines, liveness."""
        effects: list[Effect] = []
        index = self._peer_index
        changes = index.allowance_changes
        self.requests.clock = now
        self._check_forward_deadlines(now, effects)
        self.announcing.check_deadlines(now, effects)
        self.members.check(
            now, effects,
            forget=lambda peer: self._forget_peer(peer, now, effects),
            followed=self.view.following, clock=self.view.run_clock,
        )
        self._maybe_announce(now, effects)
        self.view.expire(now)
        if now >= self._next_rebalance:
            self._next_rebalance = now + self._config.rebalance_interval_s
            for peer in self.view.rebalance():
                self.announcing.replica_emptied(peer)
        if index.allowance_changes != changes:
            self.view.recheck_following(changes)
        return effects

    def take_refusals(self) -> list[tuple[PeerId, str, str]]:
        """Refused announcements not reported before, as ``(peer, reason, detail)``: each
        (peer, reason) pair once (the table of reported pairs is bounded), for the shell's log."""
        return self.announcing.take_refusals()

    def is_member(self, peer: PeerId) -> bool:
        """Whether ``peer`` answered us directly and has not been forgotten since."""
        return peer in self.members

    def next_deadline(self) -> float:
        """The latest time by which ``tick`` must run again."""
        # (no list of every candidate: the simulator asks after every tick and most events)
        return self.requests.earliest_deadline(self.announcing.next_deadline(self._next_rebalance))

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
                    rtt_s=self.members.rtt.get(peer),
                )
            )
        return out

    def statistics(self) -> NodeStatistics:
        req = self.requests
        return NodeStatistics(queued=req.queued, running=req.running,
                              **req.stats, **self.announcing.stats)

    def pending_requests(self) -> list[RequestId]:
        return list(self.requests)

    def phase(self, request_id: RequestId) -> Phase | None:
        """The phase of a request this node holds (None: not held, e.g. done)."""
        return self.requests.phase(request_id)

    def silence(self, request_id: RequestId, last_event: float, engine_progress: float) -> Silence:
        """How long the client of ``request_id`` may go on hearing nothing
        (``Requests.silence``)."""
        return self.requests.silence(request_id, last_event, engine_progress)

    def check_invariants(self) -> None:
        """Raise AssertionError if any part's state disagrees with itself (each part's
        ``check_invariants``; the requests' recount is ``Requests.check_invariants``), or
        membership and the announcement state disagree on who the members are."""
        self.requests.check_invariants()
        self.members.check_invariants()
        self.announcing.check_invariants()
        self.view.check_invariants()
        members = set(self.members)
        if members != self.announcing.members():
            raise AssertionError(
                f"node {self.peer_id} invariant violated: members "
                f"{sorted(members ^ self.announcing.members())} are known to one part only"
            )

    def route(self, tokens: Sequence[int], params: SamplingParams, now: float,
              exclude: Sequence[PeerId] = (), scaffold: int | None = None) -> RouteDecision:
        """Ask the routing policy where ``tokens`` would go now (no side effects but the
        expiry of this node's own scaffold hints)."""
        chain = self.hasher.prompt_chain(tokens)
        return self._decide(len(tokens), params, chain, now, exclude, scaffold)

    # ------------------------------------------------------------------ requests

    def _decide(
        self,
        prompt_tokens: int,
        params: SamplingParams,
        chain: tuple[BlockHash, ...],
        now: float,
        exclude: Sequence[PeerId],
        scaffold: int | None = None,
    ) -> RouteDecision:
        req = self.requests
        return self.choice.decide(
            prompt_tokens, params, chain, now, exclude, scaffold,
            local_matched_blocks=req.local_match_blocks(chain, self.announcing.local.digest),
            queued=req.queued, running=req.running,
            rtt=self.members.rtt, rtt_version=self.members.rtt_version, inflight=req.inflight,
        )

    def _local_decision(self, req: HeldRequest, reason: str) -> RouteDecision:
        bs = self.hasher.block_size
        matched = self.requests.local_match_blocks(req.chain, self.announcing.local.digest)
        cached = min(matched * bs, max(0, len(req.tokens) - 1))
        return RouteDecision(
            target=self._config.peer_id, is_local=True, expected_cached_tokens=cached, reason=reason
        )

    def _on_client_request(self, ev: ClientRequest, now: float) -> list[Effect]:
        refusal = self.requests.refusal(ev)
        if refusal is not None:
            return refusal
        effects: list[Effect] = []
        req = self.requests.hold(ev, self.hasher.prompt_chain(ev.tokens))
        if ev.forwarded:
            self._admit_local(req, None, effects, now)
            return effects
        self._route_and_dispatch(req, now, effects)
        return effects

    def _admit_local(
        self, req: HeldRequest, decision: RouteDecision | None, effects: list[Effect], now: float
    ) -> None:
        """Queue ``req`` here (it starts at once if a slot is free), or refuse it as busy."""
        if self.requests.admit(req, decision, effects):
            self.choice.served_scaffold(req.scaffold, now)
            self.requests.start_queued(effects)

    def _route_and_dispatch(self, req: HeldRequest, now: float, effects: list[Effect]) -> None:
        attempts_left = self._config.max_forward_attempts - len(req.tried)
        if attempts_left > 0:
            decision = self._decide(
                len(req.tokens), req.params, req.chain, now, req.tried, req.scaffold
            )
        else:
            decision = self._local_decision(req, "failover: forward attempts exhausted")
        req.decision = decision
        if self.choice.links is not None:
            # Pulls on: the links the decision had no bandwidth figure for are measured.
            for probe_peer, nbytes in self.choice.take_probes():
                effects.append(ProbeLink(probe_peer, nbytes))
        if decision.is_local:
            self._admit_local(req, decision, effects, now)
            return
        peer = decision.target
        req.tried.append(peer)
        self.requests.transition(
            req, _FORWARDED, target=peer, deadline=now + self._config.first_token_timeout_s
        )
        # The claim reads the target's set, and the probation its speed: with changes waiting
        # for it, those taking them in would leave (read without taking them in, as routing
        # reads them: nothing else takes a followed peer's changes in, the run keeps them).
        index = self._peer_index  # (``view.as_is``, without the property)
        waiting = self.view.waiting_changes_of(peer)
        if waiting is None:
            claimed = self.choice.digest_claim(peer, req.chain, len(req.tokens))
            speed = index.load(peer).speed
        else:
            newest_set, newest_load = waiting
            claimed = self.choice.digest_claim(peer, req.chain, len(req.tokens), newest_set)
            speed = newest_load.speed
        req.claimed_tokens = claimed
        req.speed_on_probation = self.choice.believed_speed(peer, speed, now) is not None
        # Right after _decide's PeerView.for_routing: the entries that what waits for their
        # peers would confirm are dropped (``PeerView._confirm_waiting``), and a new entry is
        # younger than whatever the peers' waiting announcements confirm.
        index.add_speculative(peer, req.chain, now)
        self.requests.stats["forwarded"] += 1
        effects.append(
            Forward(
                request_id=req.request_id,
                peer=peer,
                tokens=req.tokens,
                params=req.params,
                decision=decision,
                first_token_timeout_s=self._config.first_token_timeout_s,
                attempt=len(req.tried),
                scaffold=req.scaffold,
            )
        )

    def _on_local_started(self, ev: LocalStarted, now: float) -> list[Effect]:
        return []

    def _on_local_preempted(self, ev: LocalPreempted, now: float) -> list[Effect]:
        return self.requests.on_local_preempted(ev)

    def _on_local_finished(self, ev: LocalFinished, now: float) -> list[Effect]:
        effects: list[Effect] = []
        self._apply_local_changes(ev.cache_added, ev.cache_removed)
        self.requests.local_finished(ev.request_id, ev.generated, effects)
        self.requests.start_queued(effects)
        self._maybe_announce(now, effects)
        return effects

    def _on_cache_changed(self, ev: CacheChanged, now: float) -> list[Effect]:
        self._apply_local_changes(ev.added, ev.removed)
        if ev.disk is not None:
            self.choice.disk = ev.disk
        effects: list[Effect] = []
        self._maybe_announce(now, effects)
        return effects

    def _apply_local_changes(
        self, added: Sequence[BlockHash], removed: Sequence[BlockHash]
    ) -> None:
        self.announcing.local.blocks_changed(added, removed)

    def _on_forward_first_token(self, ev: ForwardFirstToken, now: float) -> list[Effect]:
        req = self.requests.get(ev.request_id)
        if req is not None and req.phase is _FORWARDED and req.target == ev.peer:
            self.requests.transition(req, _RELAYING)
        return []

    def _on_forward_finished(self, ev: ForwardFinished, now: float) -> list[Effect]:
        effects: list[Effect] = []
        req = self.requests.get(ev.request_id)
        if req is not None and req.phase in FORWARD_PHASES and req.target == ev.peer:
            self.requests.end(req, effects)
            if req.decision is not None:
                self.trust.judge_finished(
                    ev, req.decision, claimed_tokens=req.claimed_tokens,
                    speed_on_probation=req.speed_on_probation, now=now,
                )
            audit = self.trust.audit(ev, req.tokens, req.params, req.resume_after)
            if audit is not None:
                effects.append(audit)
        return effects

    def _on_transfer_measured(self, ev: TransferMeasured, now: float) -> list[Effect]:
        self.choice.note_transfer(ev.peer, ev.nbytes, ev.seconds, now, ev.rtt_s)
        return []

    def pull_sample(self, blocks: int, block_size: int = 1, run: int = 1) -> tuple[int, ...]:
        """Which of a pull's ``blocks`` pulled blocks' tokens to recompute and compare (indexes
        into the pulled tokens, ascending; ``PullVerifier.sample``), before the pull is used.
        Report the verdict as ``PullChecked``. Empty when pulls are off."""
        verifier = self.trust.pull_verifier
        return () if verifier is None else verifier.sample(blocks, block_size, run)

    def _on_pull_checked(self, ev: PullChecked, now: float) -> list[Effect]:
        return self._banned(ev.peer, self.trust.on_pull_checked(ev, now), now)

    def _on_pull_failed(self, ev: PullFailed, now: float) -> list[Effect]:
        self.choice.note_pull_failed(ev.peer, ev.reason, now)
        return []

    def _on_pull_limit(self, ev: PullLimit, now: float) -> list[Effect]:
        self.choice.note_pull_limit(ev.peer, ev.nbytes)
        return []

    def _on_audit_finished(self, ev: AuditFinished, now: float) -> list[Effect]:
        return self._banned(ev.peer, self.trust.on_audit_finished(ev, now), now)

    def _banned(self, peer: PeerId, ban: BanPeer | None, now: float) -> list[Effect]:
        """A failed check's outcome: nothing, or the ban, and a member banned is forgotten."""
        effects: list[Effect] = []
        if ban is None:
            return effects
        effects.append(ban)
        if peer in self.members:
            self._forget_peer(peer, now, effects)
        return effects

    def _on_forward_failed(self, ev: ForwardFailed, now: float) -> list[Effect]:
        req = self.requests.get(ev.request_id)
        if req is None or req.phase not in FORWARD_PHASES or req.target != ev.peer:
            return []
        self.requests.stats["failovers"] += 1
        effects: list[Effect] = []
        # Trust: the outcome, against the peer's last announced load for a busy refusal.
        outcome = self.trust.failure_outcome(ev.reason)
        if outcome == "busy" and ev.peer in self.view.as_is:
            # Its load: what it announced last (taken in for it alone; the other peers wait).
            self.view.take(ev.peer)
            outcome = self.trust.refine_busy(self.view.as_is.load(ev.peer))
        self.trust.record(ev.peer, outcome, now)
        # Members: it may be gone; stop routing to it until it is heard from again.
        if ev.reason in ("unavailable", "timeout") and ev.peer in self.members:
            self.view.catch_up(ev.peer)
            self.members.mark_gone(ev.peer)
        # Requests: end it, resume it here after what was relayed, or fail it over.
        if len(req.resume_after) + len(ev.generated) >= req.params.max_tokens:
            # The whole budget reached the client before the peer failed: the shell ends the
            # answer there, nothing is left to resume.
            self.requests.end(req, effects)
            return effects
        if ev.generated or req.phase is _RELAYING:
            # Tokens already reached the client: finish here, after them, whatever the queue
            # holds (refusing now would cut a stream the client is reading).
            req.resume_after = req.resume_after + ev.generated
            req.decision = self._local_decision(req, f"resume after {ev.peer} failed mid-stream")
            self.requests.transition(req, _QUEUED)
            self.requests.start_queued(effects)
            return effects
        self._route_and_dispatch(req, now, effects)
        return effects

    def _on_cancel(self, ev: Cancel, now: float) -> list[Effect]:
        req = self.requests.get(ev.request_id)
        if req is None:
            return []
        effects: list[Effect] = []
        if req.phase is _RUNNING or req.phase is _PREEMPTED:
            # LocalFinished ends it (the engine holds a preempted one's state too).
            effects.append(CancelLocal(req.request_id))
        elif req.phase is _QUEUED:
            self.requests.end(req, effects)
        elif req.phase in FORWARD_PHASES:
            assert req.target is not None
            effects.append(CancelForward(req.request_id, req.target))
            self.requests.end(req, effects)
        return effects

    def _check_forward_deadlines(self, now: float, effects: list[Effect]) -> None:
        for req in self.requests.expired_forwards(now):
            peer = req.target
            assert peer is not None
            effects.append(CancelForward(req.request_id, peer))
            effects.extend(
                self._on_forward_failed(ForwardFailed(req.request_id, peer, "timeout"), now)
            )

    # ------------------------------------------------------------------ announcements

    def _maybe_announce(self, now: float, effects: list[Effect]) -> None:
        announcing = self.announcing
        if not announcing.due(now):
            return
        choice = self.choice
        choice.refresh_hints(now)
        requests = self.requests
        load = choice.load(requests.queued, requests.running)  # (``self.load()``)
        effects.append(announcing.publish(now, load, self._config.peer_id))

    def _on_announce(self, ev: AnnounceReceived, now: float) -> list[Effect]:
        a = ev.announce
        sender = ev.sender
        if sender == self._config.peer_id or a.sender != sender:
            # Our own echo, or a forwarded claim to speak for someone else.
            if a.sender != sender:
                self.announcing.refuse(sender, "speaks for another peer", f"claims to be {a.sender}")
            return []
        if sender not in self.members:
            # Not a member: heard only through gossip, or connected but not answered yet.
            self.announcing.refuse_unverified(sender)
            asked: list[Effect] = []
            self.members.ask_ping(sender, now, asked)
            return asked
        self.view.leave_run(sender)  # a new run (a follower is not handed its own run's)
        if not self.announcing.accept_epoch(sender, a):
            return []
        self.choice.note_load(a.load)
        self.members.heard(sender, now)
        index = self.view.offer(sender, a, ev.run, now, self.announcing.pull_idle(sender))
        if index is None:
            return []  # it waits (``PeerView.offer``)
        effects: list[Effect] = []
        self.announcing.apply(sender, a, index, now, effects)
        if ev.run is not None and not effects:
            self.view.follow_from(sender, a, ev.run, now, self.announcing.pull_idle(sender))
        return effects

    def _on_sync_response(self, ev: SyncResponseReceived, now: float) -> list[Effect]:
        effects: list[Effect] = []
        self.announcing.on_sync_response(ev, now, effects, self.members.heard)
        return effects

    def _on_sync_failed(self, ev: SyncFailed, now: float) -> list[Effect]:
        effects: list[Effect] = []
        self.announcing.on_sync_failed(ev, now, effects)
        return effects

    # ------------------------------------------------------------------ membership

    def _on_peer_seen(self, ev: PeerSeen, now: float) -> list[Effect]:
        peer = ev.peer
        if peer == self._config.peer_id:
            return []
        members = self.members
        if ev.rtt_s is None and peer not in members:
            # Connected, not yet answered: a member once a ping comes back. A ping asked
            # earlier (for gossip heard from it) went nowhere without a direct connection, so
            # it does not hold this one back (else a newcomer heard of through gossip first
            # waited ping_after_s for its membership).
            members.forget_ping_ask(peer)
            effects: list[Effect] = []
            members.ask_ping(peer, now, effects)
            return effects
        self.view.catch_up(peer)  # before it is heard from now
        members.forget_ping_ask(peer)
        if ev.rtt_s is not None and peer not in members:
            # A new member holds no digest of ours: it refused what we announced before it
            # made us a member, which its own ping of us (crossing ours) does about now.
            self.announcing.announce_soon(now)
        if members.join(peer, now):
            self.announcing.join(peer)
        members.heard(peer, now)
        if ev.rtt_s is not None:
            members.note_rtt(peer, ev.rtt_s)
        if ev.load is not None:
            self.choice.note_load(ev.load)
        if ev.load is not None and peer in self.index:
            self.index.set_load(peer, ev.load, now)
        return []

    def _on_peer_lost(self, ev: PeerLost, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if ev.peer in self.members:
            self._forget_peer(ev.peer, now, effects)
        return effects

    def _forget_peer(self, peer: PeerId, now: float, effects: list[Effect]) -> None:
        """``peer`` leaves: membership, its announcement state and replica go, and requests in
        flight to it fail over now rather than at their deadline."""
        self.view.leave_run(peer)
        self.members.leave(peer)
        self.announcing.leave(peer)
        self.index.remove_peer(peer)
        self.view.forget(peer)
        effects.append(DropPeer(peer))
        for req in self.requests.held():
            if req.target == peer:
                effects.append(CancelForward(req.request_id, peer))
                effects.extend(
                    self._on_forward_failed(ForwardFailed(req.request_id, peer, "unavailable"), now)
                )


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
    TransferMeasured: NodeCore._on_transfer_measured,  # type: ignore[dict-item]
    PullChecked: NodeCore._on_pull_checked,  # type: ignore[dict-item]
    PullFailed: NodeCore._on_pull_failed,  # type: ignore[dict-item]
    PullLimit: NodeCore._on_pull_limit,  # type: ignore[dict-item]
}
