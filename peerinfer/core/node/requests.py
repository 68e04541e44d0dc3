"""Requests: every request this node holds, its phase, the fair share of the local engine, and
the counts that depend on phases (see "Request lifecycle", "Admit, fair share" and "Fail over"
in ``peerinfer.core.node``).

``Requests.transition`` is the only mutator of phases and of every count that depends on them;
``check_invariants`` recounts all of it from the requests. Where a request goes (routing), who
is trusted and when peers are gone is decided elsewhere and handed in as values.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from peerinfer.core.fairshare import (
    Share,
    ShareKey,
    newcomer_service,
    next_turn,
    yields_needed,
)
from peerinfer.core.merkle import MerkleDigest
from peerinfer.core.messages import SamplingParams
from peerinfer.core.node.config import NodeConfig
from peerinfer.core.node.events import (
    ClientRequest,
    Effect,
    LocalPreempted,
    PreemptLocal,
    Reject,
    ResumeLocal,
    RunLocal,
    Silence,
)
from peerinfer.core.routing import RouteDecision
from peerinfer.types import BlockHash, PeerId, RequestId

__all__ = ["FORWARD_PHASES", "LOCAL_PHASES", "HeldRequest", "Phase", "Requests"]

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

    # Members are singletons compared by identity (``Enum`` keeps ``object.__eq__``), so the
    # identity hash agrees with ``==``. ``Enum.__hash__`` is a Python function (``hash`` of the
    # name): each lookup of ``_TRANSITIONS`` paid a Python call, about 12 a request in the
    # simulator. Nothing iterates a set of phases, so no order depends on the hash.
    __hash__ = object.__hash__


# The members as module constants, for the hot paths below: reading ``Phase.QUEUED`` goes
# through ``EnumType``'s ``__getattr__`` hook, which makes CPython 3.11 look every attribute of
# the class up the slow way (about 0.1 us a read, against a global's 0.01, and a move reads a
# dozen); the same objects.
_ROUTING = Phase.ROUTING
_QUEUED = Phase.QUEUED
_RUNNING = Phase.RUNNING
_PREEMPTED = Phase.PREEMPTED
_FORWARDED = Phase.FORWARDED
_RELAYING = Phase.RELAYING
_DONE = Phase.DONE

#: Every allowed move: phase -> {next phase: the cause}. Anything else is a bug (``Requests.transition``
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

LOCAL_PHASES = (Phase.QUEUED, Phase.RUNNING, Phase.PREEMPTED)
FORWARD_PHASES = (Phase.FORWARDED, Phase.RELAYING)


@dataclass(slots=True)
class HeldRequest:
    """A request this node holds, in its phase (see "Request lifecycle")."""

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


def _after(params: SamplingParams, generated: tuple[int, ...]) -> SamplingParams:
    """``params`` for the rest of an answer whose first ``generated`` tokens were served
    elsewhere: fewer tokens left, and a constraint that starts after them."""
    constraint = params.constraint
    if constraint is not None:
        constraint = replace(constraint, consumed=constraint.consumed + generated)
    return replace(params, max_tokens=max(1, params.max_tokens - len(generated)),
                   constraint=constraint)


def _common_prefix(a: Sequence[BlockHash], b: Sequence[BlockHash]) -> int:
    """How many leading hashes two chains share. Chains agree at place ``i`` exactly when
    they agree at every place up to ``i`` (a chain hash names its whole prefix), so this
    searches the first place where they differ by halving (a few probes, not a walk)."""
    hi = min(len(a), len(b))
    if not hi or a[0] != b[0]:
        return 0
    if a[hi - 1] == b[hi - 1]:
        return hi
    lo = 1  # a[lo - 1] == b[lo - 1] and a[hi - 1] != b[hi - 1]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid
    return lo


class Requests:
    """The requests this node holds (by id), its requesters' shares of the engine, and the
    counts that follow from their phases: waiting (``queued``), ``running``, local starts,
    blocks pending locally, forwards in flight per peer. ``me``: this node's peer id."""

    def __init__(self, config: NodeConfig, me: PeerId, *, now: float) -> None:
        self.config = config
        self._me = me
        self._requests: dict[RequestId, HeldRequest] = {}
        #: requesters with requests waiting or running here (peerinfer.core.fairshare), and
        #: the totals over them (``queued``: waiting, new or preempted)
        self._shares: dict[ShareKey, Share] = {}
        self.queued = 0
        self.running = 0
        self.local_starts = 0
        #: the time of the event (or tick) being handled: when a phase change happens
        self.clock = now
        #: the chains of the requests queued or running here, whose blocks the local engine
        #: will hold soon: id(chain) -> [chain, requests]. Kept per chain, not per block: a
        #: request's chain is taken in and let go as one entry, and a block is pending when
        #: some pending chain has it at its place (``local_match_blocks``)
        self._pending_chains: dict[int, list[Any]] = {}
        #: requests forwarded and not finished, per peer
        self.inflight: dict[PeerId, int] = {}
        #: the FORWARDED requests (those with a first-token deadline) in the order they were
        #: held: a request enters FORWARDED right after it is held, or stays in it (a
        #: failover), so this is ``_requests``' order (the timers read it, not every request)
        self._forwarded: dict[RequestId, HeldRequest] = {}
        self.stats = dict.fromkeys(
            (
                "requests",
                "served_locally",
                "forwarded",
                "failovers",
                "rejected",
                "rejected_over_limit",
                "completed",
                "preempted",
                "resumed",
            ),
            0,
        )

    # ------------------------------------------------------------------ reading

    def get(self, request_id: RequestId) -> HeldRequest | None:
        return self._requests.get(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __iter__(self) -> Iterator[RequestId]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def held(self) -> list[HeldRequest]:
        """Every request held, in arrival order (a copy: handling one may end others)."""
        return list(self._requests.values())

    @property
    def shares(self) -> dict[ShareKey, Share]:
        """The requesters' shares of the engine (read-only; for tests and benchmarks)."""
        return self._shares

    def phase(self, request_id: RequestId) -> Phase | None:
        """The phase of a request this node holds (None: not held, e.g. done)."""
        req = self._requests.get(request_id)
        return None if req is None else req.phase

    def deadlines(self) -> list[float]:
        """The first-token deadlines of the forwarded requests."""
        return [r.deadline for r in self._forwarded.values() if r.deadline is not None]

    def earliest_deadline(self, floor: float) -> float:
        """``min(floor, *self.deadlines())``, without the list (the simulator asks after
        every tick and most events)."""
        for r in self._forwarded.values():
            d = r.deadline
            if d is not None and d < floor:
                floor = d
        return floor

    def expired_forwards(self, now: float) -> list[HeldRequest]:
        """The requests forwarded whose first token did not come by ``now``."""
        if not self._forwarded:  # (every tick asks)
            return []
        return [
            r for r in self._forwarded.values() if r.deadline is not None and r.deadline <= now
        ]

    @property
    def pending_local(self) -> dict[BlockHash, int]:
        """The blocks of the requests queued or running here, each with how many of them
        hold it (made from the pending chains: for checks and tests)."""
        out: dict[BlockHash, int] = {}
        for chain, count in self._pending_chains.values():
            for h in chain:
                out[h] = out.get(h, 0) + count
        return out

    def local_match_blocks(self, chain: Sequence[BlockHash], digest: MerkleDigest) -> int:
        """The leading blocks of ``chain`` the local engine holds (``digest``) or will soon
        (requests queued or running here).

        Block by block, a block counts when the digest holds it or a pending chain has it.
        A chain hash names its whole prefix, so a pending chain has block ``i`` exactly where
        it has block ``i`` at place ``i`` (the chains agree up to there), and that holds for
        the blocks before ``i`` too: the pending blocks of ``chain`` are its longest common
        prefix with a pending chain, and only the blocks after it are asked of the digest."""
        m = 0
        for other, _ in self._pending_chains.values():
            if other is chain:
                m = len(chain)
                break
            k = _common_prefix(chain, other)
            if k > m:
                m = k
        n = m
        for h in chain[m:]:
            if h in digest:
                n += 1
            else:
                break
        return n

    # ------------------------------------------------------------------ arrival

    def refusal(self, ev: ClientRequest) -> list[Effect] | None:
        """Count the arrival ``ev``; its refusal if it is refused before being held (invalid,
        or a forwarded request while this node is full or has more outstanding than its origin
        assumed), else None."""
        self.stats["requests"] += 1
        cfg = self.config
        rid = ev.request_id
        if rid in self._requests:
            return self.refuse(rid, "invalid", f"duplicate request id {rid!r}")
        if not ev.tokens:
            return self.refuse(rid, "invalid", "the prompt is empty")
        if len(ev.tokens) > cfg.max_prompt_tokens:
            return self.refuse(
                rid,
                "invalid",
                f"the prompt has {len(ev.tokens)} tokens, more than this node's "
                f"max_prompt_tokens of {cfg.max_prompt_tokens}",
            )
        if ev.params.max_tokens > cfg.max_new_tokens:
            return self.refuse(
                rid,
                "invalid",
                f"max_tokens {ev.params.max_tokens} is more than this node's max_new_tokens "
                f"of {cfg.max_new_tokens}",
            )
        if ev.forwarded:
            # Served where it lands: a forwarded request is never forwarded again. Refused
            # before its prompt is hashed: a refusal costs little.
            outstanding = self.queued + self.running
            if self.queued >= cfg.max_queue and self.running >= cfg.costs.slots:
                return self.refuse(rid, "busy", f"{self._me} is at capacity",
                                   self.retry_hint(len(ev.tokens), ev.params))
            limit = ev.max_outstanding
            if limit is not None and outstanding > limit:
                self.stats["rejected_over_limit"] += 1
                return self.refuse(
                    rid,
                    "busy",
                    f"{self._me} has {outstanding} requests outstanding, more than the "
                    f"{limit} the origin's routing assumed",
                    self.retry_hint(len(ev.tokens), ev.params),
                )
        return None

    def hold(self, ev: ClientRequest, chain: tuple[BlockHash, ...]) -> HeldRequest:
        """Hold the arrival ``ev`` (not refused), its prompt hashed into ``chain``."""
        requester = ev.requester or (ev.origin if ev.forwarded and ev.origin else self._me)
        req = HeldRequest(ev.request_id, ev.tokens, ev.params, ev.forwarded, chain,
                       (ev.local, requester))
        req.scaffold = ev.scaffold
        self._requests[ev.request_id] = req
        return req

    def refuse(
        self, request_id: RequestId, code: str, message: str, retry_after_s: float = 0.0
    ) -> list[Effect]:
        """Refuse an arrival before it is held."""
        self.stats["rejected"] += 1
        return [Reject(request_id, code, message, retry_after_s)]

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
                raise AssertionError(f"node {self._me} invariant violated: {msg}")

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
        check(self.queued == waiting, f"waiting count {self.queued} != {waiting}")
        check(self.running == phases[Phase.RUNNING], f"running count {self.running} != "
              f"{phases[Phase.RUNNING]} RUNNING requests")
        check(self.running <= slots, f"{self.running} running on {slots} slots")
        check(not self.queued or self.running == slots, "a request waits while a slot is free")
        inflight: Counter[PeerId] = Counter()
        pending: Counter[BlockHash] = Counter()
        outstanding: Counter[ShareKey] = Counter()
        running: Counter[ShareKey] = Counter()
        yielding: Counter[ShareKey] = Counter()
        attempts = self.config.max_forward_attempts
        for rid, req in self._requests.items():
            check(rid == req.request_id, f"request {rid!r} is filed under another id")
            check(len(req.tried) <= attempts, f"{rid!r} was forwarded {len(req.tried)} times")
            if req.phase in FORWARD_PHASES:
                check(not req.forwarded, f"{rid!r} arrived forwarded and was forwarded again")
                check(req.target is not None and req.target != self._me
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
                    check(0 < req.started_at <= self.local_starts, f"{rid!r} started at "
                          f"{req.started_at}, after the last start {self.local_starts}")
                else:
                    check(not req.yielding, f"{rid!r} yields but is {req.phase.value}")
                if req.share in self._shares:
                    share = self._shares[req.share]
                    check(req.phase is not Phase.QUEUED or rid in share.queue,
                          f"{rid!r} waits in another requester's queue")
                    check(req.phase is not Phase.PREEMPTED or rid in share.paused,
                          f"{rid!r} is paused in another requester's share")
        check(dict(inflight) == self.inflight, f"in-flight per peer {self.inflight} != {dict(inflight)}")
        check(list(self._forwarded) == [rid for rid, r in self._requests.items()
                                        if r.phase is Phase.FORWARDED],
              "the forwarded requests kept for the timers are not the FORWARDED ones in order")
        check(dict(pending) == self.pending_local, "blocks pending locally != the local chains")
        check({k: s.outstanding for k, s in self._shares.items()} == dict(outstanding),
              "a share does not count its requests (or an empty share is kept)")
        check({k: s.running for k, s in self._shares.items() if s.running} == dict(running),
              "a share does not count its running requests")
        check({k: s.yielding for k, s in self._shares.items() if s.yielding} == dict(yielding),
              "a share does not count its yielding requests")
        if self.config.preempt_after_tokens is not None:
            check(not yields_needed(self._shares, slots, self.running),
                  "a requester below its share waits with no slot coming")
        check(all(0 <= s.last_start <= self.local_starts for s in self._shares.values()),
              "a share started after the last start")
        st = self.stats
        check(st["requests"] == st["rejected"] + st["completed"] + len(self._requests),
              f"requests {st['requests']} != rejected {st['rejected']} + completed "
              f"{st['completed']} + held {len(self._requests)}")
        check(st["rejected_over_limit"] <= st["rejected"], "more over-limit refusals than refusals")
        check(st["forwarded"] >= st["failovers"] + sum(self.inflight.values()),
              "more forwards failed or in flight than were made")
        check(st["served_locally"] + st["resumed"] == self.local_starts >= self.running,
              "local starts disagree with served_locally, resumed or the running count")
        check(st["resumed"] <= st["preempted"], "more resumes than preemptions")

    def retry_hint(self, prompt_tokens: int, params: SamplingParams) -> float:
        """When retrying a busy refusal is worth it: about the time for one slot's worth of
        the waiting work ahead to be served (by the cost model), at least 1 s, at most 10
        minutes. A hint, not a promise: it says "not at once" without telling a stranger more
        than the load it announces anyway."""
        costs = self.config.costs
        one = costs.service_s(prompt_tokens, 0, params.max_tokens)
        ahead = (self.queued + 1) / max(1, costs.slots)
        return float(min(600.0, max(1.0, math.ceil(one * ahead))))

    def admit(
        self, req: HeldRequest, decision: RouteDecision | None, effects: list[Effect]
    ) -> bool:
        """Queue ``req`` here (True: the node then fills free slots, ``start_queued``), or
        refuse it as busy when the queue, or its requester's share of it, is full."""
        cfg = self.config
        if self.queued >= cfg.hard_max_queue:
            hint = self.retry_hint(len(req.tokens), req.params)
            self.end(req, effects, Reject(
                req.request_id, "busy",
                f"the local queue is full (hard_max_queue {cfg.hard_max_queue}); retry in "
                f"about {hint:.0f} s", hint,
            ))
            return False
        _, requester = req.share
        share = self._shares.get(req.share)
        waiting = share.waiting if share is not None else 0
        bound = cfg.queued_per_requester
        if requester != self._me and waiting >= bound:
            hint = self.retry_hint(len(req.tokens), req.params)
            message = (
                f"{requester} already has {waiting} requests waiting at {self._me}, its "
                f"fair share (max_queued_per_peer {bound}); retry in about {hint:.0f} s"
            )
            self.end(req, effects, Reject(req.request_id, "busy", message, hint))
            return False
        req.decision = decision
        self.transition(req, _QUEUED)
        return True

    def start_queued(self, effects: list[Effect]) -> None:
        """Fill free slots, each with the request whose requester's turn it is (a preempted
        one resumes before its requester's new ones); then ask for the yields the fair share
        needs."""
        slots = self.config.costs.slots
        while self.queued and self.running < slots:
            share = self._shares[next_turn(self._shares, slots)]
            if share.paused:
                req = self._requests[share.paused[0]]
                self.transition(req, _RUNNING)
                self.stats["resumed"] += 1
                effects.append(ResumeLocal(req.request_id))
                continue
            req = self._requests[share.queue[0]]
            self.transition(req, _RUNNING)
            self.stats["served_locally"] += 1
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
        if after is None or not self.queued:
            return
        for key in yields_needed(self._shares, self.config.costs.slots, self.running):
            victim: HeldRequest | None = None
            for req in self._requests.values():
                if (req.share == key and req.phase is _RUNNING and not req.yielding
                        and (victim is None or req.started_at < victim.started_at)):
                    victim = req
            assert victim is not None, f"{key} runs more than it is asked to yield"
            victim.yielding = True
            self._shares[key].yielding += 1
            effects.append(PreemptLocal(victim.request_id, after))

    def local_finished(self, request_id: RequestId, generated: int, effects: list[Effect]) -> None:
        """The local engine finished (or failed) ``request_id`` after ``generated`` tokens
        since it last (re)started: its requester is credited with them and it ends."""
        req = self._requests.get(request_id)
        if req is not None and req.phase in LOCAL_PHASES:
            self._shares[req.share].served += generated
            self.end(req, effects)

    def on_local_preempted(self, ev: LocalPreempted) -> list[Effect]:
        effects: list[Effect] = []
        req = self._requests.get(ev.request_id)
        if req is None or req.phase is not _RUNNING:
            return effects  # it ended meanwhile (LocalFinished came first)
        self._shares[req.share].served += ev.generated
        self.stats["preempted"] += 1
        self.transition(req, _PREEMPTED)
        self.start_queued(effects)
        return effects

    def transition(
        self,
        req: HeldRequest,
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
        if new is _FORWARDED and (req.forwarded or target is None or target == self._me):
            raise AssertionError(f"request {rid!r}: forwarding it to {target!r} is not allowed")
        # Leave the old phase.
        if old is _QUEUED or old is _PREEMPTED:
            share = self._shares[req.share]
            queue = share.queue if old is _QUEUED else share.paused
            if queue[0] == rid:
                queue.popleft()
            else:
                queue.remove(rid)
            self.queued -= 1
        elif old is _RUNNING:
            self.running -= 1
            share = self._shares[req.share]
            share.running -= 1
            if req.yielding:
                req.yielding = False
                share.yielding -= 1
        elif old in FORWARD_PHASES and new is not _RELAYING:
            assert req.target is not None
            self._forward_done(req.target)
            req.target = None
        req.deadline = None
        if old is _FORWARDED and new is not _FORWARDED:
            del self._forwarded[rid]
        was_local, is_local = old in LOCAL_PHASES, new in LOCAL_PHASES
        if was_local and not is_local:
            self._release_pending(req)
            share = self._shares[req.share]
            share.outstanding -= 1
            if share.outstanding == 0:
                del self._shares[req.share]
        elif is_local and not was_local:
            entry = self._pending_chains.get(id(req.chain))
            if entry is None:  # (the entry holds the chain: its id is not reused meanwhile)
                self._pending_chains[id(req.chain)] = [req.chain, 1]
            else:
                entry[1] += 1
            joined = self._shares.get(req.share)
            if joined is None:
                joined = Share(served=newcomer_service(self._shares.values()))
                self._shares[req.share] = joined
            joined.outstanding += 1
        # Enter the new one.
        req.phase = new
        req.phase_since = self.clock
        if new is _QUEUED:
            self._shares[req.share].queue.append(rid)
            self.queued += 1
        elif new is _PREEMPTED:
            self._shares[req.share].paused.append(rid)
            self.queued += 1
        elif new is _RUNNING:
            self.running += 1
            self.local_starts += 1
            req.started_at = self.local_starts
            share = self._shares[req.share]
            share.running += 1
            share.last_start = self.local_starts
        elif new is _FORWARDED:
            assert target is not None
            req.target = target
            req.deadline = deadline
            self.inflight[target] = self.inflight.get(target, 0) + 1
            self._forwarded[rid] = req  # (a failover keeps its place)
        elif new is _DONE:
            del self._requests[rid]

    def end(self, req: HeldRequest, effects: list[Effect], refusal: Reject | None = None) -> None:
        """The request ended: served, failed or cancelled, or refused with ``refusal``."""
        if refusal is None:
            self.stats["completed"] += 1
        else:
            self.stats["rejected"] += 1
            effects.append(refusal)
        self.transition(req, _DONE)

    def _release_pending(self, req: HeldRequest) -> None:
        key = id(req.chain)
        entry = self._pending_chains[key]
        if entry[1] == 1:
            del self._pending_chains[key]
        else:
            entry[1] -= 1

    def _forward_done(self, peer: PeerId) -> None:
        n = self.inflight.get(peer, 0) - 1
        if n > 0:
            self.inflight[peer] = n
        else:
            self.inflight.pop(peer, None)
