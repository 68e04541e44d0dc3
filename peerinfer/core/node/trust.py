"""Trust: judging every forward's outcome into the peers' reputation, sampling answers for an
audit, and banning a peer whose audit failed (see "Trust" in ``peerinfer.core.node`` and
``peerinfer.core.reputation``)."""

from __future__ import annotations

import random
from dataclasses import replace

from peerinfer.core.kvpull import PullVerifier
from peerinfer.core.messages import Load, SamplingParams
from peerinfer.core.node.config import NodeConfig
from peerinfer.core.node.events import (
    AuditFinished,
    AuditForward,
    BanPeer,
    ForwardFinished,
    PullChecked,
)
from peerinfer.core.reputation import FAILURE_OUTCOMES, Outcome, Reputation, judge_finished
from peerinfer.core.routing import RouteDecision
from peerinfer.types import PeerId

__all__ = ["Trust"]


class Trust:
    """The peers' ``reputation`` and the audit sampling's own dice."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.reputation = Reputation(config.reputation)
        # Audit sampling has its own dice, so enabling audits leaves routing's draws unchanged.
        self.audit_rng = random.Random(f"audit/{config.peer_id}")
        #: pulls on: which pulled blocks to recompute (its own dice, seeded by the peer id)
        self.pull_verifier: PullVerifier | None = (
            PullVerifier.for_settings(config.kv_pull, config.peer_id)
            if config.kv_pull is not None else None
        )

    def judge_finished(
        self,
        ev: ForwardFinished,
        decision: RouteDecision,
        *,
        claimed_tokens: int,
        speed_on_probation: bool,
        now: float,
    ) -> None:
        """Score a forward that ended well against ``decision``'s promise: the tokens the
        peer's digest claimed, and the first token's estimate (a proof of speed, when the peer
        claims more speed than this node)."""
        outcome = judge_finished(
            self.reputation.config,
            expected_cached_tokens=claimed_tokens,
            cached_tokens=ev.cached_tokens,
            estimated_ttft_s=decision.estimated_ttft_s,
            ttft_s=ev.ttft_s,
        )
        self.reputation.record(ev.peer, outcome, now)
        estimate = decision.estimated_ttft_s
        if speed_on_probation and outcome == "served" and ev.ttft_s is not None and estimate is not None:
            self.reputation.note_answer_speed(
                ev.peer, estimated_at_own_speed_s=estimate, ttft_s=ev.ttft_s
            )

    def audit(
        self,
        ev: ForwardFinished,
        tokens: tuple[int, ...],
        params: SamplingParams,
        resume_after: tuple[int, ...],
    ) -> AuditForward | None:
        """An audit of the answer ``ev`` relayed, if this one is sampled: a peer's first
        ``audit_first`` answers, then ``audit_rate`` of them."""
        rate = self.config.audit_rate
        if not (
            ev.completion
            and rate > 0
            and (
                self.audit_rng.random() < rate
                or self.reputation.audits(ev.peer) < self.config.audit_first
            )
        ):
            return None
        # Greedy answers must be the argmax, sampled ones inside the top-p nucleus
        # (peerinfer.engine.audit); the params say which.
        # A constrained answer is re-scored under its constraint, from where it began.
        if resume_after and params.constraint is not None:
            params = replace(params, constraint=replace(
                params.constraint,
                consumed=params.constraint.consumed + resume_after,
            ))
        return AuditForward(ev.peer, tokens + resume_after, params, ev.completion)

    @staticmethod
    def failure_outcome(reason: str) -> Outcome:
        """The reputation outcome of a forward that failed for ``reason`` ("busy" is refined
        by ``refine_busy`` where the peer's load is known)."""
        return FAILURE_OUTCOMES.get(reason, "unavailable")

    @staticmethod
    def refine_busy(load: Load) -> Outcome:
        """A busy refusal, judged against the peer's last announced ``load``."""
        if load.queued + load.running < load.slots:
            return "busy_lie"  # refused while its last announcement had a free slot
        return "busy"

    def record(self, peer: PeerId, outcome: Outcome, now: float) -> None:
        self.reputation.record(peer, outcome, now)

    def on_audit_finished(self, ev: AuditFinished, now: float) -> BanPeer | None:
        """Record an audit's verdict; the ban when it failed."""
        if ev.ok:
            self.reputation.record(ev.peer, "audit_passed", now)
            return None
        self.reputation.record(ev.peer, "audit_failed", now)
        until = self.reputation.view(ev.peer, now).banned_until
        return BanPeer(ev.peer, until, f"failed an audit: {ev.detail}"[:200])

    def on_pull_checked(self, ev: PullChecked, now: float) -> BanPeer | None:
        """Record a pull's check: altered KV is a lie about the model's output, judged as a
        failed audit (a ban, doubling with each); a pull that matched, as a passed one."""
        if ev.ok:
            self.reputation.record(ev.peer, "audit_passed", now)
            return None
        self.reputation.record(ev.peer, "audit_failed", now)
        until = self.reputation.view(ev.peer, now).banned_until
        return BanPeer(ev.peer, until, f"served altered KV: {ev.detail}"[:200])
