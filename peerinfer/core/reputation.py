"""Peer reputation: one score per peer id, earned by what the peer does, not by what it says.

Theory of operation
-------------------
Routing sends a prompt to a peer on the strength of the peer's own claims (its digest, its load).
This module keeps, per peer id, a score of how those claims held up when tested, and turns the
score into a *standing* that routing obeys. It is pure: no clock (``now`` is an argument, the
node's wall clock so that saved records survive restarts), no dice, no I/O; the node saves
:meth:`Reputation.to_json` next to its identity and loads it back at start.

Outcomes and their weights (``ReputationConfig``; points, one outcome per forward):

================  ======  ====================================================================
``served``        +1      finished within the decision's estimate (cache and first-token time)
``audit_passed``  +2      an audit re-scored the answer and found it right
``busy``          0       refused as busy while it announced itself busy (honest)
``busy_lie``      -2      refused as busy while its last announcement said it had a free slot
                          (small: a stale announcement under herding looks the same once)
``unavailable``   -2      the stream failed or the peer reset it
``slow``          -2      first token later than ``ttft_factor`` x the estimate + ``ttft_slack_s``
``cache_short``   -4      cached far fewer tokens than its digest promised: below
                          ``cache_fraction`` of the promise and short by more than
                          ``cache_slack_tokens`` (an honest eviction between announcement and
                          request is rare and small; a fake digest falls short every time)
``timeout``       -8      no first token before the deadline (a tarpit)
``contract``      -10     a broken result: more tokens than asked, ids outside the vocabulary,
                          text after a stop sequence, wrong counts, a protocol error, "invalid"
                          for a request the origin had validated
``audit_failed``  ban     the answer is not what the model gives (see below)
================  ======  ====================================================================

Repeat offences escalate: an outcome in ``escalating`` (``cache_short``, ``timeout``,
``contract``: a claim that did not hold) right after others of them, with no ``served`` or
``audit_passed`` between, weighs ``escalation ** streak`` times its weight (``streak`` = the
offences before it in the run, at most ``max_streak``). Decay alone would let a liar that fails
rarely sit at a fixed point above the exclusion line (failing every 10 minutes at -4, a score
settles at -8 after each failure and -4 before the next: demoted for about 4 minutes of every
10, good again in time to be chosen, never excluded); doubling makes its 3rd consecutive shortfall
exclude it (-4 - 8 - 16 = -28) however far apart they come, and every offence after that exclude
it again. An honest peer whose cache is evicted now and then (never twice in a row, served in
between) never builds a streak.

Speed claims. A peer announces its speed (``Load.speed``: seconds per token of its machine), and
the ``cost`` policy estimates it at that speed, so a GPU beside CPUs gets the work it earns. A
claim to be *slower* than this node only costs the claimant and is always believed; a claim to
be *faster* is a lie that attracts traffic (announcing speed 0 beats a peer holding the prompt's
prefix, and an answer at honest CPU speed still passes as ``served`` within ``ttft_slack_s``).
So a faster claim counts only once proven: routing estimates an unproven peer at no more than
this node's own speed figures, and an answer whose first token came within
``speed_proof_fraction`` of that estimate counts as one proof; after ``speed_proofs`` of them,
and while its standing is good, the claim is believed. A liar at honest speed never proves it;
a real GPU proves it with its first few forwards (it is still chosen for its cache and when
this node is busy). Proofs are not saved with the table: a restart proves them again.

Scores are clamped to ``[min_score, max_score]`` (a long honest record cannot bank unlimited
credit for one big lie) and decay toward 0 with ``half_life_s``: old offences are forgiven, so
a peer excluded for honest trouble (a crash that looked like a tarpit) comes back on probation,
one more offence away from exclusion again.

Standing, from the decayed score ``s``:

* ``good`` (``s >= demote_below``): a candidate like any other.
* ``demoted`` (``exclude_below <= s < demote_below``): still a candidate, but its cache claims
  count for nothing (routing sees it as holding no prefix), so it only wins on load; chosen,
  it is still judged against what its digest claimed, so a fake digest keeps costing it.
* ``excluded`` (``s < exclude_below``): not a candidate. The time at which decay lifts it back
  above the threshold is computed once per change (``s * 0.5 ** (dt / h) = t`` solved for dt), so
  a routing decision asks "until > now?" and never recomputes scores.
* ``banned``: a failed audit. Not a candidate, disconnected and refused by the shell, for
  ``ban_s * 2 ** (previous bans)`` capped at ``max_ban_s``. The score drops to ``min_score``.

The table holds at most ``max_peers`` records; past that the least recently updated record that
is not banned is forgotten (an unknown peer starts at 0, which is what forgetting gives).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from peerinfer.errors import ConfigError
from peerinfer.types import PeerId

Outcome = Literal[
    "served",
    "audit_passed",
    "busy",
    "busy_lie",
    "unavailable",
    "slow",
    "cache_short",
    "timeout",
    "contract",
    "audit_failed",
]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)  # every outcome, in the order above
Standing = Literal["good", "demoted", "excluded", "banned"]

#: ForwardFailed reasons (peerinfer.core.node) as outcomes; "busy" is refined by the caller.
FAILURE_OUTCOMES: Mapping[str, Outcome] = {
    "busy": "busy",
    "timeout": "timeout",
    "unavailable": "unavailable",
    "protocol": "contract",
    "contract": "contract",
    "invalid": "contract",
    "internal": "unavailable",
}

JSON_VERSION = 1


@dataclass(frozen=True, slots=True)
class ReputationConfig:
    """The weights and thresholds (see the module docstring)."""

    served: float = 1.0
    audit_passed: float = 2.0
    busy_lie: float = -2.0
    unavailable: float = -2.0
    slow: float = -2.0
    cache_short: float = -4.0
    timeout: float = -8.0
    contract: float = -10.0
    max_score: float = 20.0
    min_score: float = -100.0
    demote_below: float = -6.0
    exclude_below: float = -15.0
    half_life_s: float = 600.0
    ban_s: float = 600.0
    max_ban_s: float = 7 * 86_400.0
    cache_fraction: float = 0.5
    cache_slack_tokens: int = 32
    ttft_factor: float = 3.0
    ttft_slack_s: float = 1.0
    max_peers: int = 4096
    escalating: tuple[Outcome, ...] = ("cache_short", "timeout", "contract")
    escalation: float = 2.0
    max_streak: int = 8
    #: a peer's claim to be faster than this node (``Load.speed``) counts in routing only after
    #: this many of its answers came at most ``speed_proof_fraction`` of the estimate made at
    #: this node's own speed (see "Speed claims" above)
    speed_proofs: int = 3
    speed_proof_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not self.min_score < self.exclude_below < self.demote_below <= 0 < self.max_score:
            raise ConfigError("reputation thresholds must satisfy min < exclude < demote <= 0 < max")
        if self.half_life_s <= 0 or self.ban_s <= 0 or self.max_ban_s < self.ban_s:
            raise ConfigError("reputation half-life and ban periods must be positive")
        if self.max_peers < 1:
            raise ConfigError("reputation max_peers must be >= 1")
        if self.escalation < 1 or self.max_streak < 0:
            raise ConfigError("reputation escalation must be >= 1 and max_streak >= 0")
        if self.speed_proofs < 0 or not 0 < self.speed_proof_fraction <= 1:
            raise ConfigError("reputation speed_proofs must be >= 0 and speed_proof_fraction in (0, 1]")

    def weight(self, outcome: Outcome) -> float:
        if outcome == "busy":
            return 0.0
        if outcome == "audit_failed":
            return -math.inf
        w: float = getattr(self, outcome)
        return w

    def weight_after(self, outcome: Outcome, streak: int) -> float:
        """``outcome``'s weight after ``streak`` consecutive escalating offences."""
        w = self.weight(outcome)
        if outcome in self.escalating:
            w *= self.escalation ** min(streak, self.max_streak)
        return w

    def streak_after(self, outcome: Outcome, streak: int) -> int:
        """The run of consecutive escalating offences once ``outcome`` is recorded."""
        if outcome in self.escalating:
            return streak + 1
        if outcome in ("served", "audit_passed"):
            return 0
        return streak  # neutral, or a lesser failure: the run goes on


def judge_finished(
    config: ReputationConfig,
    *,
    expected_cached_tokens: int,
    cached_tokens: int | None,
    estimated_ttft_s: float | None,
    ttft_s: float | None,
) -> Outcome:
    """The outcome of a forward that finished: ``served`` unless it fell far short of the
    decision's expectation (cache first: a short cache also makes the first token late)."""
    if cached_tokens is not None:
        promised = expected_cached_tokens
        if (
            cached_tokens < config.cache_fraction * promised
            and promised - cached_tokens > config.cache_slack_tokens
        ):
            return "cache_short"
    if ttft_s is not None and estimated_ttft_s is not None and math.isfinite(estimated_ttft_s):
        if ttft_s > config.ttft_factor * estimated_ttft_s + config.ttft_slack_s:
            return "slow"
    return "served"


@dataclass(slots=True)
class _Record:
    score: float = 0.0
    updated: float = 0.0
    bans: int = 0
    banned_until: float = -math.inf
    last: str = ""
    counts: dict[str, int] = field(default_factory=dict)
    #: consecutive escalating offences (``ReputationConfig.escalating``) with no success between
    streak: int = 0
    #: answers that came much sooner than this node's own speed would give (speed claims)
    fast_answers: int = 0


@dataclass(frozen=True, slots=True)
class PeerReputation:
    """A frozen view of one peer's record at some time (for status and tests)."""

    peer: PeerId
    score: float
    standing: Standing
    bans: int
    banned_until: float
    why: str


class Reputation:
    """The per-peer score table. ``record`` an outcome; ask ``standing`` or ``blocked``."""

    def __init__(self, config: ReputationConfig | None = None) -> None:
        self.config = config if config is not None else ReputationConfig()
        self._records: dict[PeerId, _Record] = {}
        #: peers that are not candidates, and until when (ban or decay back over the threshold)
        self._blocked: dict[PeerId, float] = {}
        #: peers whose cache claims routing ignores, and until when
        self._demoted: dict[PeerId, float] = {}

    def __len__(self) -> int:
        return len(self._records)

    # ------------------------------------------------------------------ queries

    def score(self, peer: PeerId, now: float) -> float:
        rec = self._records.get(peer)
        return 0.0 if rec is None else self._decayed(rec, now)

    def standing(self, peer: PeerId, now: float) -> Standing:
        rec = self._records.get(peer)
        if rec is None:
            return "good"
        if rec.banned_until > now:
            return "banned"
        s = self._decayed(rec, now)
        cfg = self.config
        if s < cfg.exclude_below:
            return "excluded"
        if s < cfg.demote_below:
            return "demoted"
        return "good"

    def is_candidate(self, peer: PeerId, now: float) -> bool:
        until = self._blocked.get(peer)
        return until is None or until <= now

    def is_demoted(self, peer: PeerId, now: float) -> bool:
        until = self._demoted.get(peer)
        return until is not None and until > now

    def is_banned(self, peer: PeerId, now: float) -> bool:
        rec = self._records.get(peer)
        return rec is not None and rec.banned_until > now

    def audits(self, peer: PeerId) -> int:
        """How many audits of ``peer``'s answers have been recorded (passed or failed)."""
        rec = self._records.get(peer)
        if rec is None:
            return 0
        return rec.counts.get("audit_passed", 0) + rec.counts.get("audit_failed", 0)

    def speed_proven(self, peer: PeerId, now: float) -> bool:
        """Whether ``peer``'s claim to be faster than this node counts: enough fast answers
        (``note_answer_speed``), and its standing good."""
        rec = self._records.get(peer)
        if rec is None or rec.fast_answers < self.config.speed_proofs:
            return self.config.speed_proofs == 0
        return self.standing(peer, now) == "good"

    def note_answer_speed(self, peer: PeerId, *, estimated_at_own_speed_s: float, ttft_s: float) -> None:
        """Count one answer of ``peer`` (which claims to be faster than this node, unproven)
        towards its speed proof if its first token came within ``speed_proof_fraction`` of the
        estimate at this node's own speed. Only a peer with a record counts (this runs after
        the forward's outcome was recorded)."""
        rec = self._records.get(peer)
        if rec is not None and ttft_s <= self.config.speed_proof_fraction * estimated_at_own_speed_s:
            rec.fast_answers += 1

    def blocked(self) -> Mapping[PeerId, float]:
        """Peers that are not candidates until the time given (compare with ``now``)."""
        return self._blocked

    def demoted(self) -> Mapping[PeerId, float]:
        """Peers whose cache claims do not count until the time given."""
        return self._demoted

    def view(self, peer: PeerId, now: float) -> PeerReputation:
        rec = self._records.get(peer) or _Record(updated=now)
        return PeerReputation(
            peer=peer,
            score=self._decayed(rec, now),
            standing=self.standing(peer, now),
            bans=rec.bans,
            banned_until=rec.banned_until,
            why=self.explain(peer, now),
        )

    def explain(self, peer: PeerId, now: float) -> str:
        """One line: standing, and the outcomes that made the score (for ``peerinfer status``)."""
        rec = self._records.get(peer)
        if rec is None:
            return "good: no record yet"
        standing = self.standing(peer, now)
        counts = ", ".join(f"{n} {k}" for k, n in sorted(rec.counts.items(), key=lambda kv: -kv[1]))
        in_a_row = f"; {rec.streak} offences in a row" if rec.streak > 1 else ""
        line = f"{standing}: {counts}{in_a_row}; last {rec.last}"
        if standing == "banned":
            line += f"; banned {rec.banned_until - now:.0f}s more (ban #{rec.bans})"
        return line

    # ------------------------------------------------------------------ updates

    def record(self, peer: PeerId, outcome: Outcome, now: float) -> Standing:
        """Apply one outcome at ``now``; return the peer's standing after it."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown reputation outcome {outcome!r}")
        cfg = self.config
        rec = self._records.pop(peer, None)
        if rec is None:
            rec = _Record(updated=now)
        self._records[peer] = rec  # most recently updated last (eviction order)
        rec.score = self._decayed(rec, now)
        rec.updated = max(now, rec.updated)
        rec.last = outcome
        rec.counts[outcome] = rec.counts.get(outcome, 0) + 1
        if len(rec.counts) > len(OUTCOMES):  # cannot happen; keeps the record's size obvious
            raise AssertionError("reputation counts out of range")
        if outcome == "audit_failed":
            period = min(cfg.max_ban_s, cfg.ban_s * 2.0 ** min(rec.bans, 60))
            rec.bans += 1
            rec.banned_until = max(rec.banned_until, now + period)
            rec.score = cfg.min_score
        else:
            weight = cfg.weight_after(outcome, rec.streak)
            rec.score = min(cfg.max_score, max(cfg.min_score, rec.score + weight))
        rec.streak = cfg.streak_after(outcome, rec.streak)
        self._refresh(peer, rec, now)
        self._bound()
        return self.standing(peer, now)

    def forget_expired(self, now: float) -> None:
        """Drop the lapsed entries of the blocked and demoted tables (bounded housekeeping)."""
        for table in (self._blocked, self._demoted):
            for peer in [p for p, until in table.items() if until <= now]:
                del table[peer]

    # ------------------------------------------------------------------ persistence

    def to_json(self, time_offset: float = 0.0) -> dict[str, Any]:
        """A small JSON-able dict (a few dozen bytes per peer, at most ``max_peers`` peers).

        ``time_offset`` is added to every time: the node keeps this table on a monotonic clock
        and saves it on the wall clock (offset = wall - monotonic), so it survives a restart.
        """
        return {
            "version": JSON_VERSION,
            "peers": {
                peer: [
                    round(rec.score, 3),
                    rec.updated + time_offset,
                    rec.bans,
                    rec.banned_until + time_offset if math.isfinite(rec.banned_until) else None,
                    rec.last,
                    dict(rec.counts),
                    rec.streak,
                ]
                for peer, rec in self._records.items()
            },
        }

    @classmethod
    def from_json(
        cls, data: Any, now: float, config: ReputationConfig | None = None,
        time_offset: float = 0.0,
    ) -> Reputation:
        """Rebuild a table saved by ``to_json``; malformed entries are skipped, never trusted
        to raise the table past its bounds. ``time_offset`` is subtracted from every saved time
        (the ``to_json`` offset of the clock ``now`` is on)."""
        rep = cls(config)
        if not isinstance(data, dict) or data.get("version") != JSON_VERSION:
            return rep
        peers = data.get("peers")
        if not isinstance(peers, dict):
            return rep
        cfg = rep.config
        for peer, entry in list(peers.items())[-cfg.max_peers :]:
            try:
                # Six fields before streaks were kept (the same version: a streak of 0).
                score, updated, bans, banned_until, last, counts, *rest = entry
                if len(rest) > 1:
                    raise ValueError("too many fields")
                streak = max(0, min(int(rest[0]), 64)) if rest else 0
                rec = _Record(
                    score=min(cfg.max_score, max(cfg.min_score, float(score))),
                    updated=min(float(updated) - time_offset, now),
                    bans=max(0, min(int(bans), 64)),
                    banned_until=(
                        -math.inf if banned_until is None else float(banned_until) - time_offset
                    ),
                    last=str(last)[:32],
                    counts={
                        str(k): int(v) for k, v in dict(counts).items() if k in OUTCOMES
                    },
                    streak=streak,
                )
            except (TypeError, ValueError):
                continue
            if not (isinstance(peer, str) and math.isfinite(rec.score) and math.isfinite(rec.updated)):
                continue
            rep._records[PeerId(peer)] = rec
            rep._refresh(PeerId(peer), rec, now)
        return rep

    # ------------------------------------------------------------------ internals

    def _decayed(self, rec: _Record, now: float) -> float:
        dt = now - rec.updated
        if dt <= 0:
            return rec.score
        decay: float = 0.5 ** (dt / self.config.half_life_s)
        return rec.score * decay

    def _until_above(self, rec: _Record, threshold: float, now: float) -> float:
        """When the decayed score rises to ``threshold`` (< 0), or ``now`` if it is there."""
        s = self._decayed(rec, now)
        if s >= threshold:
            return now
        return now + self.config.half_life_s * math.log2(s / threshold)

    def _refresh(self, peer: PeerId, rec: _Record, now: float) -> None:
        cfg = self.config
        until = max(rec.banned_until, self._until_above(rec, cfg.exclude_below, now))
        if until > now:
            self._blocked[peer] = until
        else:
            self._blocked.pop(peer, None)
        demoted_until = self._until_above(rec, cfg.demote_below, now)
        if demoted_until > now:
            self._demoted[peer] = demoted_until
        else:
            self._demoted.pop(peer, None)

    def _bound(self) -> None:
        records = self._records
        while len(records) > self.config.max_peers:
            victim = next((p for p, r in records.items() if r.banned_until == -math.inf), None)
            if victim is None:
                victim = next(iter(records))
            del records[victim]
            self._blocked.pop(victim, None)
            self._demoted.pop(victim, None)

    def check_invariants(self, now: float) -> None:
        cfg = self.config
        assert len(self._records) <= cfg.max_peers
        assert set(self._blocked) <= set(self._records)
        assert set(self._demoted) <= set(self._records)
        for peer, rec in self._records.items():
            assert cfg.min_score <= rec.score <= cfg.max_score, (peer, rec.score)
            if self.standing(peer, now) in ("banned", "excluded"):
                assert not self.is_candidate(peer, now), peer


__all__ = [
    "FAILURE_OUTCOMES",
    "OUTCOMES",
    "Outcome",
    "PeerReputation",
    "Reputation",
    "ReputationConfig",
    "Standing",
    "judge_finished",
]
