"""NodeCore driven by random events (Hypothesis stateful), against a naive model of its requests.

After every step: ``check_invariants()`` holds, the core holds exactly the requests the model
says are open, each in the phase the model derived from the effects seen so far. Properties
checked on the way: every request ends exactly once (one Reject, or one finish) and none is
lost (the teardown drains the node and every request has ended); a request that arrived
forwarded is never forwarded, and no request is forwarded twice to one peer or more often
than the attempt limit; the local engine never runs more than its capacity; refusals happen
only at a limit, and admissions never pass one; a resumed request runs its prompt plus the
tokens already relayed; the fair share: a requester at or above its entitlement never starts
while one below its own waits, a request is asked to yield only while a requester below its
entitlement waits, it yields at most once per run (``PreemptLocal`` once, then
``LocalPreempted``) and resumes (``ResumeLocal``) exactly where the model paused it: no request
is lost to a preemption, and none is in two places (running and paused, or paused twice).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from peerinfer.core.fairshare import weight
from peerinfer.core.messages import SamplingParams
from peerinfer.core.node import (
    AnnounceReceived,
    CacheChanged,
    Cancel,
    CancelForward,
    CancelLocal,
    ClientRequest,
    Effect,
    Forward,
    ForwardFailed,
    ForwardFinished,
    ForwardFirstToken,
    LocalFinished,
    LocalPreempted,
    LocalStarted,
    NodeConfig,
    NodeCore,
    PeerLost,
    PeerSeen,
    Phase,
    PreemptLocal,
    Publish,
    Reject,
    ResumeLocal,
    RunLocal,
    SendSyncRequest,
    SyncResponseReceived,
)
from peerinfer.core.prefix import PrefixHasher
from peerinfer.types import PeerId, RequestId

HASHER = PrefixHasher(b"stateful-model", block_size=8)
SELF = PeerId("A")
PEERS = (PeerId("B"), PeerId("C"), PeerId("D"))
#: direct clients ("" = this node itself, an in-process caller)
CLIENTS = ("", "client-1", "client-2", "flooder")
PREFIXES = tuple(tuple(random.Random(s).randrange(1, 500) for _ in range(32)) for s in range(3))
REASONS = ("busy", "unavailable", "timeout", "protocol", "invalid", "internal")


@dataclass
class Req:
    """What the model knows of one request, from the events sent and the effects seen."""

    tokens: tuple[int, ...]
    max_tokens: int
    arrived_forwarded: bool
    share: tuple[bool, str]
    phase: Phase = Phase.QUEUED
    target: PeerId | None = None
    tried: list[PeerId] = field(default_factory=list)
    relayed: tuple[int, ...] = ()
    #: failed mid-stream and resumes here: queued past every limit (the client is reading)
    resumed: bool = False
    cancel_asked: bool = False
    #: RUNNING and asked to yield its slot (PreemptLocal seen, LocalPreempted not yet sent)
    yielding: bool = False
    preemptions: int = 0


class NodeCoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.next_id = 0
        self.open: dict[RequestId, Req] = {}
        self.ends: Counter[RequestId] = Counter()
        self.arrivals: list[RequestId] = []

    @initialize(
        policy=st.sampled_from(["random", "longest_prefix", "least_loaded", "cost"]),
        slots=st.integers(1, 3),
        max_queue=st.integers(0, 3),
        hard_max_queue=st.integers(1, 8),
        max_queued_per_peer=st.none() | st.integers(1, 3),
        preempt_after_tokens=st.none() | st.integers(1, 64),
        attempts=st.integers(0, 3),
        max_prompt_tokens=st.integers(40, 120),
        max_new_tokens=st.integers(8, 64),
        seed=st.integers(0, 2**16),
        known=st.lists(st.tuples(st.sampled_from(PEERS), st.integers(0, len(PREFIXES) - 1))),
    )
    def setup(
        self,
        policy: str,
        slots: int,
        max_queue: int,
        hard_max_queue: int,
        max_queued_per_peer: int | None,
        preempt_after_tokens: int | None,
        attempts: int,
        max_prompt_tokens: int,
        max_new_tokens: int,
        seed: int,
        known: list[tuple[PeerId, int]],
    ) -> None:
        base = NodeConfig(peer_id=SELF)
        self.cfg = NodeConfig(
            peer_id=SELF,
            policy=policy,
            costs=base.costs.with_slots(slots),
            max_queue=max_queue,
            hard_max_queue=hard_max_queue,
            max_queued_per_peer=max_queued_per_peer,
            preempt_after_tokens=preempt_after_tokens,
            max_forward_attempts=attempts,
            max_prompt_tokens=max_prompt_tokens,
            max_new_tokens=max_new_tokens,
            first_token_timeout_s=2.0,
            peer_timeout_s=6.0,
            ping_after_s=2.0,
        )
        self.core = NodeCore(self.cfg, HASHER, rng=random.Random(seed), now=0.0)
        self.peers = {
            p: NodeCore(NodeConfig(peer_id=p, policy="local"), HASHER, rng=random.Random(i), now=0.0)
            for i, p in enumerate(PEERS)
        }
        for peer, prefix in known:  # peers that hold prefixes from the start: forwards happen
            self.peer_caches(peer, prefix, deliver=True)

    # ------------------------------------------------------------------ the model's bookkeeping

    def feed(self, effects: Sequence[Effect], placed: RequestId | None = None) -> None:
        """Apply ``effects`` to the model, checking each. ``placed``: a request this event
        (re)places; without a Forward/RunLocal/Reject for it, it waits in the queue."""
        syncs: list[SendSyncRequest] = []
        if placed is not None:
            self._wait(placed)
        for eff in effects:
            if isinstance(eff, RunLocal):
                self._started(eff)
            elif isinstance(eff, Forward):
                req = self.open[eff.request_id]
                assert not req.arrived_forwarded, "a forwarded request was forwarded again"
                assert eff.peer != SELF and eff.peer not in req.tried, (eff.peer, req.tried)
                assert len(req.tried) < self.cfg.max_forward_attempts
                assert eff.tokens == req.tokens and eff.attempt == len(req.tried) + 1
                req.tried.append(eff.peer)
                event(f"forward attempt {eff.attempt}")
                req.phase, req.target = Phase.FORWARDED, eff.peer
            elif isinstance(eff, Reject):
                event(f"refused {eff.code}: {eff.message.split(' ')[-1]}")
                self._ended(eff.request_id)
            elif isinstance(eff, CancelLocal):
                assert self.open[eff.request_id].phase in (Phase.RUNNING, Phase.PREEMPTED)
            elif isinstance(eff, PreemptLocal):
                self._asked_to_yield(eff)
            elif isinstance(eff, ResumeLocal):
                self._resumed(eff.request_id)
            elif isinstance(eff, CancelForward):
                req = self.open[eff.request_id]
                assert req.phase in (Phase.FORWARDED, Phase.RELAYING) and req.target == eff.peer
                if req.cancel_asked:
                    self._ended(eff.request_id)
                else:  # timeout or peer lost: fails over; the effects that follow place it
                    req.resumed |= req.phase is Phase.RELAYING
                    self._wait(eff.request_id)
            elif isinstance(eff, SendSyncRequest):
                syncs.append(eff)
        for sync in syncs:
            self._pull(sync)

    def _wait(self, rid: RequestId) -> None:
        req = self.open[rid]
        req.phase, req.target = Phase.QUEUED, None

    def _entitled(self) -> dict[tuple[bool, str], float]:
        """Each requester's entitlement, recomputed naively from the open local requests."""
        local = (Phase.QUEUED, Phase.RUNNING, Phase.PREEMPTED)
        shares = {r.share for r in self.open.values() if r.phase in local}
        total = sum(weight(k) for k in shares)
        return {k: self.cfg.costs.slots * weight(k) / total for k in shares}

    def _check_turn(self, req: Req) -> None:
        """A requester at or above its entitlement does not start while one below waits."""
        entitled = self._entitled()
        running = Counter(r.share for r in self.open.values() if r.phase is Phase.RUNNING)
        if running[req.share] < entitled[req.share]:
            return
        for other in self.open.values():
            if other.phase in (Phase.QUEUED, Phase.PREEMPTED) and other.share != req.share:
                assert running[other.share] >= entitled[other.share], (
                    f"{req.share} (running {running[req.share]}, entitled "
                    f"{entitled[req.share]:.2f}) started while {other.share} (running "
                    f"{running[other.share]}, entitled {entitled[other.share]:.2f}) waited"
                )

    def _started(self, eff: RunLocal) -> None:
        rid = eff.request_id
        req = self.open[rid]
        assert req.phase is Phase.QUEUED, f"{rid} started from {req.phase}"
        assert eff.tokens == req.tokens + req.relayed and eff.resume_after == req.relayed
        assert eff.params.max_tokens == max(1, req.max_tokens - len(req.relayed))
        self._check_turn(req)
        event("started a resumed request" if req.relayed else "started a request")
        req.phase = Phase.RUNNING
        running = sum(r.phase is Phase.RUNNING for r in self.open.values())
        assert running <= self.cfg.costs.slots, "capacity exceeded"

    def _asked_to_yield(self, eff: PreemptLocal) -> None:
        req = self.open[eff.request_id]
        assert self.cfg.preempt_after_tokens is not None, "preempted with preemption off"
        assert eff.after_tokens == self.cfg.preempt_after_tokens
        assert req.phase is Phase.RUNNING and not req.yielding, (eff, req.phase, req.yielding)
        entitled = self._entitled()
        running = Counter(r.share for r in self.open.values() if r.phase is Phase.RUNNING)
        assert running[req.share] > entitled[req.share], "asked to yield within its share"
        assert any(
            r.phase in (Phase.QUEUED, Phase.PREEMPTED) and running[r.share] < entitled[r.share]
            for r in self.open.values()
        ), "asked to yield while nobody below its share waits"
        event("asked a request to yield")
        req.yielding = True

    def _resumed(self, rid: RequestId) -> None:
        req = self.open[rid]
        assert req.phase is Phase.PREEMPTED, f"{rid} resumed from {req.phase}"
        self._check_turn(req)
        event("resumed a preempted request")
        req.phase = Phase.RUNNING
        running = sum(r.phase is Phase.RUNNING for r in self.open.values())
        assert running <= self.cfg.costs.slots, "capacity exceeded"

    def _ended(self, rid: RequestId) -> None:
        req = self.open.pop(rid)
        if req.preemptions:
            event("a preempted request ended")
        self.ends[rid] += 1
        assert self.ends[rid] == 1, f"{rid} ended twice"

    def _pull(self, sync: SendSyncRequest) -> None:
        """Answer a pull from the peer's own core, in a bounded number of rounds."""
        pending = [sync]
        for _ in range(64):
            if not pending:
                return
            s = pending.pop()
            response = self.peers[s.peer].answer_sync(s.request)
            effects = self.core.handle(SyncResponseReceived(s.peer, response), self.now)
            assert not any(isinstance(e, RunLocal | Forward | Reject) for e in effects)
            pending.extend(e for e in effects if isinstance(e, SendSyncRequest))
        raise AssertionError("a pull did not converge in 64 rounds")

    def _pick(self, pick: int, *phases: Phase) -> RequestId | None:
        rids = sorted(r for r, q in self.open.items() if q.phase in phases)
        return rids[pick % len(rids)] if rids else None

    def _limits_hit(self, req: Req, max_outstanding: int | None) -> bool:
        """Whether a busy refusal of a new arrival ``req`` is justified by a limit."""
        cfg = self.cfg
        queued = [r for r in self.open.values() if r.phase in (Phase.QUEUED, Phase.PREEMPTED)]
        running = sum(r.phase is Phase.RUNNING for r in self.open.values())
        _, requester = req.share
        share_waiting = sum(r.share == req.share for r in queued)
        return (
            len(queued) >= cfg.hard_max_queue
            or (requester != SELF and share_waiting >= cfg.queued_per_requester)
            or (req.arrived_forwarded and len(queued) >= cfg.max_queue
                and running >= cfg.costs.slots)
            or (req.arrived_forwarded and max_outstanding is not None
                and len(queued) + running > max_outstanding)
        )

    # ------------------------------------------------------------------ rules: requests

    def _arrive(self, ev: ClientRequest, req: Req) -> None:
        before = {r: (q.phase, len(q.tried)) for r, q in self.open.items()}
        justified = self._limits_hit(req, ev.max_outstanding)
        effects = self.core.handle(ev, self.now)
        rid = ev.request_id
        self.arrivals.append(rid)
        too_long = len(req.tokens) > self.cfg.max_prompt_tokens
        too_many = req.max_tokens > self.cfg.max_new_tokens
        rejects = [e for e in effects if isinstance(e, Reject) and e.request_id == rid]
        if not req.tokens or too_long or too_many:
            assert [r.code for r in rejects] == ["invalid"] and len(effects) == 1, effects
            limit = "max_prompt_tokens" if req.tokens and too_long else "max_new_tokens"
            assert not req.tokens or limit in rejects[0].message
            self.ends[rid] += 1
            return
        self.open[rid] = req
        self.feed(effects, placed=rid)
        if rejects:
            assert rejects[0].code == "busy" and rid not in self.open
            assert justified, f"refused without reaching a limit: {rejects[0].message}"
        elif req.phase is not Phase.FORWARDED:
            assert not justified, "admitted past a limit"
        assert all(
            (q.phase, len(q.tried)) == before[r] or q.phase is Phase.RUNNING
            for r, q in self.open.items() if r in before
        ), "an arrival moved another request other than by starting it"

    def _new_id(self) -> RequestId:
        self.next_id += 1
        return RequestId(f"r{self.next_id}")

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        suffix=st.integers(0, 60),
        max_tokens=st.integers(1, 14),
        client=st.sampled_from(CLIENTS),
        local=st.booleans(),
    )
    def client_request(self, prefix: int, suffix: int, max_tokens: int, client: str, local: bool) -> None:
        tokens = (PREFIXES[prefix] + tuple(range(1000, 1000 + suffix)))[: 32 + suffix]
        if suffix == 0 and prefix == 0:
            tokens = ()  # the empty prompt, refused
        requester = client or SELF
        rid = self._new_id()
        ev = ClientRequest(
            rid, tokens, SamplingParams(max_tokens=max_tokens), requester=client, local=local
        )
        self._arrive(ev, Req(tokens, max_tokens, False, (local, requester)))

    @rule(client=st.sampled_from(CLIENTS), n=st.integers(2, 6), local=st.booleans())
    def flood(self, client: str, n: int, local: bool) -> None:
        """Several requests from one requester at once."""
        for i in range(n):
            self.client_request(i % len(PREFIXES), 8 + i, 4, client, local)

    @rule(
        origin=st.sampled_from(PEERS),
        prefix=st.integers(0, len(PREFIXES) - 1),
        suffix=st.integers(1, 40),
        max_tokens=st.integers(1, 14),
        max_outstanding=st.none() | st.integers(0, 4),
    )
    def forwarded_request(
        self, origin: PeerId, prefix: int, suffix: int, max_tokens: int, max_outstanding: int | None
    ) -> None:
        tokens = PREFIXES[prefix] + tuple(range(2000, 2000 + suffix))
        rid = self._new_id()
        ev = ClientRequest(
            rid, tokens, SamplingParams(max_tokens=max_tokens), True, origin, max_outstanding
        )
        self._arrive(ev, Req(tokens, max_tokens, True, (False, origin)))

    @rule(pick=st.integers(0, 1000))
    def duplicate_request(self, pick: int) -> None:
        if not self.open:
            return
        rid = sorted(self.open)[pick % len(self.open)]
        phase = self.core.phase(rid)
        effects = self.core.handle(ClientRequest(rid, (1, 2, 3), SamplingParams()), self.now)
        assert len(effects) == 1 and isinstance(effects[0], Reject) and effects[0].code == "invalid"
        assert self.core.phase(rid) is phase  # the original is untouched

    @rule(pick=st.integers(0, 1000), known=st.booleans())
    def cancel(self, pick: int, known: bool) -> None:
        rid = self._pick(pick, *Phase) if known else None
        if rid is None:
            assert self.core.handle(Cancel(RequestId("nobody")), self.now) == []
            return
        req = self.open[rid]
        req.cancel_asked = True
        phase = req.phase
        effects = self.core.handle(Cancel(rid), self.now)
        if phase is Phase.QUEUED:
            assert effects == []
            self._ended(rid)
        elif phase in (Phase.RUNNING, Phase.PREEMPTED):
            # Ends at LocalFinished (the engine holds a preempted request's state too).
            assert [type(e) for e in effects] == [CancelLocal]
        else:
            assert [type(e) for e in effects] == [CancelForward]
            self.feed(effects)

    # ------------------------------------------------------------------ rules: the engine

    @rule(pick=st.integers(0, 1000))
    def local_started(self, pick: int) -> None:
        rid = self._pick(pick, Phase.RUNNING)
        if rid is not None:
            assert self.core.handle(LocalStarted(rid, cached_tokens=0), self.now) == []

    @rule(pick=st.integers(0, 1000), ok=st.booleans(), cache=st.booleans(),
          generated=st.integers(0, 64))
    def local_finished(self, pick: int, ok: bool, cache: bool, generated: int) -> None:
        """The engine ends a running request (a yielding one may end before it yields), or
        a preempted one that was cancelled or failed."""
        rid = self._pick(pick, Phase.RUNNING, Phase.PREEMPTED)
        if rid is None:
            return
        ok = ok and self.open[rid].phase is Phase.RUNNING
        added = tuple(HASHER.chain(self.open[rid].tokens)) if cache and ok else ()
        effects = self.core.handle(
            LocalFinished(rid, ok, cache_added=added, generated=generated), self.now
        )
        self._ended(rid)
        self.feed(effects)

    @rule(pick=st.integers(0, 1000), generated=st.integers(1, 64))
    def stale_local_preempted(self, pick: int, generated: int) -> None:
        """A yield reported for a request not running any more: ignored."""
        rid = self._pick(pick, Phase.QUEUED, Phase.PREEMPTED, Phase.FORWARDED)
        if rid is not None:
            phase = self.open[rid].phase
            assert self.core.handle(LocalPreempted(rid, generated), self.now) == []
            assert self.core.phase(rid) is phase

    @precondition(lambda self: any(q.yielding for q in getattr(self, "open", {}).values()))
    @rule(pick=st.integers(0, 1000), generated=st.integers(1, 64))
    def local_preempted(self, pick: int, generated: int) -> None:
        """The engine yields a request it was asked to."""
        rids = sorted(r for r, q in self.open.items() if q.yielding)
        rid = rids[pick % len(rids)]
        req = self.open[rid]
        effects = self.core.handle(LocalPreempted(rid, generated), self.now)
        req.yielding = False
        req.preemptions += 1
        req.phase = Phase.PREEMPTED
        event("a request yielded its slot")
        self.feed(effects)

    # ------------------------------------------------------------------ rules: forwards

    @rule(pick=st.integers(0, 1000), stale=st.booleans())
    def forward_first_token(self, pick: int, stale: bool) -> None:
        rid = self._pick(pick, Phase.FORWARDED, Phase.RELAYING)
        if rid is None:
            return
        req = self.open[rid]
        assert req.target is not None
        peer = next(p for p in PEERS if p != req.target) if stale else req.target
        assert self.core.handle(ForwardFirstToken(rid, peer), self.now) == []
        if not stale:
            req.phase = Phase.RELAYING

    @rule(pick=st.integers(0, 1000), stale=st.booleans())
    def forward_finished(self, pick: int, stale: bool) -> None:
        rid = self._pick(pick, Phase.FORWARDED, Phase.RELAYING)
        if rid is None:
            return
        req = self.open[rid]
        assert req.target is not None
        peer = next(p for p in PEERS if p != req.target) if stale else req.target
        assert self.core.handle(ForwardFinished(rid, peer), self.now) == []
        if not stale:
            self._ended(rid)

    @rule(
        pick=st.integers(0, 1000),
        reason=st.sampled_from(REASONS),
        generated=st.lists(st.integers(1, 400), max_size=3).map(tuple),
        stale=st.booleans(),
    )
    def forward_failed(self, pick: int, reason: str, generated: tuple[int, ...], stale: bool) -> None:
        rid = self._pick(pick, Phase.FORWARDED, Phase.RELAYING)
        if rid is None:
            return
        req = self.open[rid]
        assert req.target is not None
        if stale:
            peer = next(p for p in PEERS if p != req.target)
            assert self.core.handle(ForwardFailed(rid, peer, reason, generated), self.now) == []
            return
        mid_stream = bool(generated) or req.phase is Phase.RELAYING
        req.resumed |= mid_stream
        effects = self.core.handle(ForwardFailed(rid, req.target, reason, generated), self.now)
        req.relayed += generated
        self.feed(effects, placed=rid)
        if mid_stream:  # resumes here, whatever the queue holds
            assert rid in self.open and req.phase in (Phase.QUEUED, Phase.RUNNING)

    # ------------------------------------------------------------------ rules: peers and time

    @rule(peer=st.sampled_from(PEERS), prefix=st.integers(0, len(PREFIXES) - 1), deliver=st.booleans())
    def peer_caches(self, peer: PeerId, prefix: int, deliver: bool) -> None:
        core = self.peers[peer]
        effects = core.handle(CacheChanged(added=tuple(HASHER.chain(PREFIXES[prefix]))), self.now)
        effects += core.tick(self.now)
        announces = [e.announce for e in effects if isinstance(e, Publish)]
        if deliver:  # else lost on the way: a later one is repaired by a pull
            for a in announces:
                self.feed(self.core.handle(AnnounceReceived(peer, a), self.now))

    @rule(peer=st.sampled_from(PEERS), rtt=st.none() | st.floats(0.0001, 0.05))
    def peer_seen(self, peer: PeerId, rtt: float | None) -> None:
        self.feed(self.core.handle(PeerSeen(peer, rtt_s=rtt), self.now))

    @rule(peer=st.sampled_from(PEERS))
    def peer_lost(self, peer: PeerId) -> None:
        self.feed(self.core.handle(PeerLost(peer), self.now))

    @rule(dt=st.sampled_from([0.0, 0.3, 1.0, 2.5, 7.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.feed(self.core.tick(self.now))

    # ------------------------------------------------------------------ checks

    @invariant()
    def agrees_with_the_model(self) -> None:
        if not hasattr(self, "core"):
            return
        core = self.core
        core.check_invariants()
        assert set(core.pending_requests()) == set(self.open), "a request was lost or invented"
        for rid, req in self.open.items():
            assert core.phase(rid) is req.phase, (rid, core.phase(rid), req.phase)
        load = core.load()
        assert load.running <= load.slots == self.cfg.costs.slots
        queued = Counter(
            r.share for r in self.open.values() if r.phase is Phase.QUEUED and not r.resumed
        )
        resumed = sum(r.phase is Phase.QUEUED and r.resumed for r in self.open.values())
        paused = sum(r.phase is Phase.PREEMPTED for r in self.open.values())
        assert load.queued == sum(queued.values()) + resumed + paused
        assert sum(queued.values()) <= self.cfg.hard_max_queue
        for (_, requester), n in queued.items():
            if requester != SELF:
                assert n <= self.cfg.queued_per_requester, (requester, n)
        # A request asked to yield is still running, until the engine says it yielded.
        for rid, req in self.open.items():
            assert not req.yielding or req.phase is Phase.RUNNING, (rid, req.phase)

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        # Drain: finish whatever runs or streams; waiting requests start as slots free.
        for _ in range(4 * len(self.open) + 8):
            if not self.open:
                break
            rid = self._pick(0, Phase.RUNNING)
            if rid is not None:
                effects = self.core.handle(LocalFinished(rid, ok=True), self.now)
                self._ended(rid)
                self.feed(effects)
                continue
            rid = self._pick(0, Phase.FORWARDED, Phase.RELAYING)
            assert rid is not None, "requests wait but nothing runs or streams"
            target = self.open[rid].target
            assert target is not None
            self.core.handle(ForwardFinished(rid, target), self.now)
            self._ended(rid)
        self.core.check_invariants()
        assert not self.open and self.core.pending_requests() == []
        assert all(self.ends[rid] == 1 for rid in self.arrivals), "a request did not end once"
        stats = self.core.statistics()
        assert stats.requests == stats.rejected + stats.completed
        assert stats.queued == stats.running == 0


NodeCoreMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_node_core_under_random_events = NodeCoreMachine.TestCase
