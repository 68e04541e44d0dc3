"""Reputation (peerinfer.core.reputation) and its use by NodeCore: pure, no network, no clock.

The score table is checked against a naive model (a plain list of outcomes replayed with the
textbook formula) by Hypothesis, and the honest-peer property: random evictions (bounded),
delays and audit noise never get an honest peer banned or excluded.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from peerinfer.core.costmodel import CostModel
from peerinfer.core.node import (
    AnnounceReceived,
    AuditFinished,
    AuditForward,
    BanPeer,
    ClientRequest,
    DropPeer,
    Forward,
    ForwardFailed,
    ForwardFinished,
    ForwardFirstToken,
    NodeConfig,
    NodeCore,
    PeerSeen,
    RunLocal,
    SendSyncRequest,
    SyncResponseReceived,
)
from peerinfer.core.reputation import (
    OUTCOMES,
    Outcome,
    Reputation,
    ReputationConfig,
    judge_finished,
)
from peerinfer.types import PeerId, RequestId
from tests.core.test_node_core import (
    PARAMS,
    announcements,
    introduce,
    make,
    of,
    prompt,
    serve_locally,
)

CFG = ReputationConfig()
P = PeerId("P")

# --------------------------------------------------------------------------------------------
# The score table against a naive model


class NaiveReputation:
    """Replays every outcome from the start, the slow obvious way."""

    def __init__(self, cfg: ReputationConfig) -> None:
        self.cfg = cfg
        self.events: list[tuple[float, Outcome]] = []

    def record(self, outcome: Outcome, now: float) -> None:
        self.events.append((now, outcome))

    def state(self, now: float) -> tuple[float, float]:
        """(decayed score at now, banned until)."""
        cfg = self.cfg
        score, t, bans, banned_until, streak = 0.0, None, 0, -math.inf, 0
        for when, outcome in self.events:
            if t is not None and when > t:
                score *= 0.5 ** ((when - t) / cfg.half_life_s)
            t = when if t is None else max(t, when)
            if outcome == "audit_failed":
                banned_until = max(banned_until, when + min(cfg.max_ban_s, cfg.ban_s * 2**bans))
                bans += 1
                score = cfg.min_score
            else:
                weight = cfg.weight(outcome)
                if outcome in ("cache_short", "timeout", "contract"):
                    weight *= 2.0 ** min(streak, 8)  # repeat offences double
                score = min(cfg.max_score, max(cfg.min_score, score + weight))
            if outcome in ("cache_short", "timeout", "contract"):
                streak += 1
            elif outcome in ("served", "audit_passed"):
                streak = 0
        if t is not None and now > t:
            score *= 0.5 ** ((now - t) / cfg.half_life_s)
        return score, banned_until

    def standing(self, now: float) -> str:
        score, banned_until = self.state(now)
        if banned_until > now:
            return "banned"
        if score < self.cfg.exclude_below:
            return "excluded"
        if score < self.cfg.demote_below:
            return "demoted"
        return "good"


steps = st.lists(
    st.tuples(st.floats(0.0, 900.0), st.sampled_from(OUTCOMES), st.floats(0.0, 2000.0)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(steps)
def test_scores_and_standings_match_the_naive_model(script: list[tuple[float, Outcome, float]]) -> None:
    rep, naive = Reputation(CFG), NaiveReputation(CFG)
    now = 0.0
    for gap, outcome, probe in script:
        now += gap
        rep.record(P, outcome, now)
        naive.record(outcome, now)
        rep.check_invariants(now)
        for t in (now, now + probe):
            score, _ = naive.state(t)
            assert math.isclose(rep.score(P, t), score, rel_tol=1e-9, abs_tol=1e-9)
            want = naive.standing(t)
            got = rep.standing(P, t)
            # The blocked table is computed once per change: it must agree with the standing
            # at any later time (within float rounding at the exact crossing).
            if abs(score - CFG.exclude_below) > 1e-6:
                assert got == want, (t, score)
                assert rep.is_candidate(P, t) == (want in ("good", "demoted"))
            if abs(score - CFG.demote_below) > 1e-6 and want != "banned":
                assert rep.is_demoted(P, t) == (want in ("demoted", "excluded"))


def test_a_failed_audit_bans_for_a_period_that_doubles() -> None:
    rep = Reputation(CFG)
    assert rep.record(P, "audit_failed", 0.0) == "banned"
    first = rep.view(P, 0.0).banned_until
    assert first == CFG.ban_s
    assert not rep.is_candidate(P, first - 1)
    rep.record(P, "audit_failed", first + 1)
    assert rep.view(P, first + 1).banned_until == first + 1 + 2 * CFG.ban_s
    assert "banned" in rep.explain(P, first + 1)


def test_the_table_is_bounded_and_keeps_bans() -> None:
    rep = Reputation(replace(CFG, max_peers=10))
    rep.record(PeerId("liar"), "audit_failed", 0.0)
    for i in range(100):
        rep.record(PeerId(f"p{i}"), "served", float(i))
    assert len(rep) == 10
    assert rep.is_banned(PeerId("liar"), 100.0)
    rep.check_invariants(100.0)


def test_json_round_trip_keeps_standings_and_refuses_garbage() -> None:
    rep = Reputation(CFG)
    rep.record(PeerId("liar"), "audit_failed", 100.0)
    for _ in range(3):
        rep.record(PeerId("tarpit"), "timeout", 100.0)
    rep.record(PeerId("good"), "served", 100.0)
    data = json.loads(json.dumps(rep.to_json()))
    back = Reputation.from_json(data, 200.0)
    for peer in ("liar", "tarpit", "good"):
        assert back.standing(PeerId(peer), 200.0) == rep.standing(PeerId(peer), 200.0)
        assert back.is_candidate(PeerId(peer), 200.0) == rep.is_candidate(PeerId(peer), 200.0)
    assert len(json.dumps(data)) < 1000
    assert "3 offences in a row" in back.explain(PeerId("tarpit"), 200.0)  # the run is kept
    # A table saved before runs were kept (six fields) still loads, with no run.
    old = {"version": 1, "peers": {"x": [-5.0, 100.0, 0, None, "timeout", {"timeout": 1}]}}
    assert Reputation.from_json(old, 200.0).standing(PeerId("x"), 100.0) == "good"
    assert len(Reputation.from_json(old, 200.0)) == 1
    for garbage in (None, [], {"version": 99}, {"version": 1, "peers": {"x": [1, 2]}},
                    {"version": 1, "peers": {"x": ["a", 0, 0, None, "", {}]}}):
        assert len(Reputation.from_json(garbage, 0.0)) == 0


def test_judging_a_finished_forward() -> None:
    def judge(expected: int, cached: int | None, est: float | None, ttft: float | None) -> str:
        return judge_finished(
            CFG, expected_cached_tokens=expected, cached_tokens=cached, estimated_ttft_s=est, ttft_s=ttft
        )

    assert judge(640, 640, 0.1, 0.1) == "served"
    assert judge(640, 600, 0.1, 0.1) == "served"  # one evicted block is not a lie
    assert judge(640, 0, 0.1, 0.1) == "cache_short"
    assert judge(32, 0, 0.1, 0.1) == "served"  # within the slack
    assert judge(0, 0, 0.1, 5.0) == "slow"
    assert judge(0, 0, 0.1, 1.2) == "served"  # within factor x estimate + slack
    assert judge(640, None, None, None) == "served"


# --------------------------------------------------------------------------------------------
# An honest peer is never banned nor excluded


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.floats(0.0, 1 / 6),  # eviction probability
    st.floats(0.0, 1.0),  # delay scale: first tokens up to 2x the estimate, plus noise
)
def test_an_honest_peer_with_evictions_delays_and_noise_is_never_banned(
    seed: int, evict_p: float, delay: float
) -> None:
    """1,000 forwards to one honest peer: its cache is sometimes evicted (at most one forward in
    six, never two in a row), its first token is late by up to 2x plus noise, its audited
    answers differ from ours only within the tolerance (the audit passes), and once in a while
    it is busy (it said so) or a stream breaks."""
    rng = random.Random(seed)
    rep = Reputation(CFG)
    now, last_short = 0.0, -10
    for i in range(1000):
        now += rng.expovariate(1.0)
        est = 0.05 + rng.random()
        ttft = est * (1 + delay * rng.random()) + rng.gauss(0, 0.01)
        short = rng.random() < evict_p and i - last_short >= 6
        if short:
            last_short = i
        cached = rng.randrange(0, 64) if short else 640 - 16 * rng.randrange(0, 3)
        outcome = judge_finished(
            CFG, expected_cached_tokens=640, cached_tokens=cached, estimated_ttft_s=est, ttft_s=ttft
        )
        roll = rng.random()
        if roll < 0.01:
            outcome = "unavailable"
        elif roll < 0.03:
            outcome = "busy"
        rep.record(P, outcome, now)
        if rng.random() < 0.05:
            rep.record(P, "audit_passed", now)
        assert rep.standing(P, now) in ("good", "demoted"), (i, rep.explain(P, now))
        assert rep.is_candidate(P, now)
    assert not rep.is_banned(P, now)


# --------------------------------------------------------------------------------------------
# NodeCore: outcomes feed the table, the table shapes candidates


def reintroduce(a, b, now: float) -> None:  # type: ignore[no-untyped-def]
    """``a`` hears from ``b`` again, pulling its digest if it had forgotten it."""
    a.handle(PeerSeen(b.peer_id, rtt_s=0.001), now)
    pending = []
    for ann in announcements(b, now):
        pending += of(a.handle(AnnounceReceived(b.peer_id, ann), now), SendSyncRequest)
    for _ in range(100):
        if not pending:
            return
        req = pending.pop()
        pending += of(
            a.handle(SyncResponseReceived(b.peer_id, b.answer_sync(req.request)), now), SendSyncRequest
        )
    raise AssertionError("sync did not converge")


def forward_to_b(a, rid: str, tokens: tuple[int, ...], now: float) -> Forward | None:  # type: ignore[no-untyped-def]
    effects = a.handle(ClientRequest(RequestId(rid), tokens, PARAMS), now)
    forwards = of(effects, Forward)
    return forwards[0] if forwards else None


def test_a_tarpit_stops_being_chosen_after_its_first_timeouts() -> None:
    a, b = make("A", first_token_timeout_s=2.0), make("B")
    shared = prompt(1, 256)
    serve_locally(b, "warm", shared, 0.0)
    forwards = 0
    now = 1.0
    for i in range(6):
        reintroduce(a, b, now)  # the tarpit keeps announcing and answering pings
        fwd = forward_to_b(a, f"r{i}", shared + prompt(10 + i, 16), now)
        if fwd is not None:
            forwards += 1
            effects = a.tick(now + 2.01)  # no first token before the deadline
            assert of(effects, RunLocal)
        now += 3.0
    # One timeout demotes it (its cache claims stop counting), two would exclude it.
    assert 1 <= forwards <= 2
    assert a.reputation.standing(PeerId("B"), now) in ("demoted", "excluded")


def test_a_contract_breach_and_an_invalid_fail_over_and_cost_the_peer() -> None:
    a, b = make("A"), make("B")
    shared = prompt(1, 256)
    serve_locally(b, "warm", shared, 0.0)
    introduce(a, b, 1.0)
    fwd = forward_to_b(a, "r1", shared + prompt(3, 16), 1.0)
    assert fwd is not None
    effects = a.handle(ForwardFailed(RequestId("r1"), PeerId("B"), "invalid"), 1.1)
    assert of(effects, RunLocal)  # not refused to the client: served here instead
    assert a.reputation.score(PeerId("B"), 1.1) == CFG.contract


def test_a_failure_after_the_whole_budget_was_relayed_does_not_resume() -> None:
    a, b = make("A"), make("B")
    shared = prompt(1, 256)
    serve_locally(b, "warm", shared, 0.0)
    introduce(a, b, 1.0)
    forward_to_b(a, "r1", shared + prompt(3, 16), 1.0)
    a.handle(ForwardFirstToken(RequestId("r1"), PeerId("B")), 1.05)
    generated = tuple(range(10, 10 + PARAMS.max_tokens))
    effects = a.handle(ForwardFailed(RequestId("r1"), PeerId("B"), "contract", generated), 1.1)
    assert not of(effects, RunLocal)
    assert a.pending_requests() == []


def test_cache_shortfalls_demote_then_exclude_a_digest_liar() -> None:
    a, b = make("A"), make("B")
    shared = prompt(1, 256)
    serve_locally(b, "warm", shared, 0.0)
    introduce(a, b, 1.0)
    forwards = []
    for i in range(20):
        now = 1.0 + i * 0.1
        fwd = forward_to_b(a, f"r{i}", shared + prompt(10 + i, 16), now)
        if fwd is None:
            continue
        # Judged against what its digest claimed, even when demoted routing discounted it.
        forwards.append(fwd.decision.expected_cached_tokens)
        a.handle(ForwardFinished(RequestId(f"r{i}"), PeerId("B"), cached_tokens=0, ttft_s=0.01), now)
        if len(forwards) == 2:
            assert a.reputation.standing(PeerId("B"), now) == "demoted"
            assert a.route(shared + prompt(99, 16), PARAMS, now).expected_cached_tokens == 0
    assert forwards[:2] == [256, 256]
    assert 2 <= len(forwards) <= 3  # excluded at the third: -4, -8, -16
    assert a.reputation.standing(PeerId("B"), 3.0) in ("demoted", "excluded")


def test_a_failed_audit_bans_drops_and_stops_routing() -> None:
    a, b = make("A", audit_rate=1.0), make("B")
    shared = prompt(1, 256)
    serve_locally(b, "warm", shared, 0.0)
    introduce(a, b, 1.0)
    tokens = shared + prompt(3, 16)
    forward_to_b(a, "r1", tokens, 1.0)
    effects = a.handle(
        ForwardFinished(RequestId("r1"), PeerId("B"), cached_tokens=256, ttft_s=0.01, completion=(5, 6)), 1.1
    )
    (audit,) = of(effects, AuditForward)
    assert audit.tokens == tokens and audit.completion == (5, 6) and audit.peer == "B"
    effects = a.handle(AuditFinished(PeerId("B"), ok=False, detail="token 0"), 1.2)
    (ban,) = of(effects, BanPeer)
    assert ban.until == 1.2 + CFG.ban_s
    assert of(effects, DropPeer)
    reintroduce(a, b, 2.0)  # even if it announces again
    assert forward_to_b(a, "r2", shared + prompt(4, 16), 2.0) is None


def test_sampled_answers_are_audited_too_and_the_rate_is_respected() -> None:
    a, b = make("A", audit_rate=0.05), make("B")
    shared = prompt(1, 256)
    serve_locally(b, "warm", shared, 0.0)
    audits = 0
    for i in range(400):
        reintroduce(a, b, 1.0 + i)
        rid = RequestId(f"r{i}")
        fwd = forward_to_b(a, rid, shared + prompt(100 + i, 16), 1.0 + i)
        assert fwd is not None
        effects = a.handle(ForwardFinished(rid, PeerId("B"), 256, 0.01, (5,)), 1.0 + i)
        if of(effects, AuditForward):
            audits += 1
            a.handle(AuditFinished(PeerId("B"), ok=True), 1.0 + i)
    # The first answer (probation), then 5% of the other 399 (about 20).
    assert 9 <= audits <= 36
    c, b = make("C", audit_rate=1.0), make("B")
    serve_locally(b, "warm", shared, 0.0)
    introduce(c, b, 1.0)
    hot = replace(PARAMS, temperature=0.7, top_p=0.9)
    effects = c.handle(ClientRequest(RequestId("s"), shared + prompt(3, 16), hot), 1.0)
    assert of(effects, Forward)
    # The audit gets the request's sampling parameters: it checks the top-p nucleus.
    (audit,) = of(c.handle(ForwardFinished(RequestId("s"), PeerId("B"), 256, 0.01, (5,)), 1.1), AuditForward)
    assert audit.params == hot and audit.completion == (5,)


def test_trusted_peers_only() -> None:
    shared = prompt(1, 256)
    for trusted, expect in ((frozenset({PeerId("Z")}), None), (frozenset({PeerId("B")}), "B"), (None, "B")):
        a, b = make("A", trusted_peers=trusted), make("B")
        serve_locally(b, "warm", shared, 0.0)
        introduce(a, b, 1.0)
        fwd = forward_to_b(a, "r1", shared + prompt(3, 16), 1.0)
        assert (fwd.peer if fwd else None) == expect


def test_node_config_refuses_a_bad_audit_rate() -> None:
    import pytest

    from peerinfer.errors import ConfigError

    with pytest.raises(ConfigError):
        NodeConfig(peer_id=PeerId("A"), audit_rate=1.5)


def test_a_peer_is_held_to_its_own_digest_not_to_our_speculation() -> None:
    """Routing marks a peer as holding what it was just sent (speculation); the next request
    for that prefix may go there before the peer has cached it. That is our guess, not its
    claim: an honest peer that falls short of it is not penalised."""
    a, b = make("A"), make("B")
    serve_locally(b, "warm", prompt(9, 64), 0.0)  # B is known, but holds nothing we ask for
    introduce(a, b, 1.0)
    shared = prompt(1, 256)
    a.index.add_speculative(PeerId("B"), tuple(a.hasher.chain(shared)), 1.0)
    fwd = forward_to_b(a, "r1", shared + prompt(3, 16), 1.0)
    assert fwd is not None and fwd.decision.expected_cached_tokens == 256
    a.handle(ForwardFinished(RequestId("r1"), PeerId("B"), cached_tokens=0, ttft_s=0.01), 1.1)
    assert a.reputation.score(PeerId("B"), 1.1) == CFG.served


# --------------------------------------------------------------------------------------------
# A digest liar is excluded, not just demoted, within 20 of its failures (issue 12 target)


def busy_origin(name: str, now: float) -> NodeCore:
    """An origin (policy ``cost``) whose own engine is full: a peer with zero load beats it on
    load alone, so a demoted liar keeps being chosen (the case where demotion is not enough)."""
    a = make(name, policy="cost", max_queue=64)
    for i in range(12):  # local requests that stay queued: they never finish in these tests
        a.handle(ClientRequest(RequestId(f"local{i}"), prompt(500 + i, 64), PARAMS), now)
    assert a.load().queued + a.load().running >= 12
    return a


def failures_until_excluded(spacing_s: float) -> tuple[int, int]:
    """Forward to a digest liar (claims the prefix, zero load, serves with no cache) until it is
    not a candidate; its failures then, and the forwards it got in 30 requests after that."""
    now = 1.0
    a, b = busy_origin("A", now), make("B")
    shared = prompt(1, 256)
    serve_locally(b, "warm", shared, 0.0)
    failures = 0
    for i in range(100):
        reintroduce(a, b, now)  # it keeps announcing its (fake) digest and answering pings
        fwd = forward_to_b(a, f"r{i}", shared + prompt(10 + i, 16), now)
        assert fwd is not None, f"request {i}: not forwarded to the liar while it is a candidate"
        a.handle(ForwardFinished(RequestId(f"r{i}"), PeerId("B"), cached_tokens=0, ttft_s=0.01), now)
        failures += 1
        a.reputation.check_invariants(now)
        if not a.reputation.is_candidate(PeerId("B"), now):
            break
        now += spacing_s
    after = 0
    for j in range(30):
        now += 1.0
        reintroduce(a, b, now)
        if a.reputation.is_candidate(PeerId("B"), now):
            break  # decay lifted it (probation): not the question here
        rid = f"x{j}"
        effects = a.handle(ClientRequest(RequestId(rid), shared + prompt(200 + j, 16), PARAMS), now)
        after += sum(f.peer == "B" for f in of(effects, Forward))
        assert a.route(shared + prompt(300 + j, 16), PARAMS, now).target != "B"
    return failures, after


def test_a_digest_liar_that_wins_on_load_is_excluded_within_20_failures() -> None:
    # Back to back, and spaced so far apart (30 minutes: 3 half-lives) that decay alone would
    # forgive each shortfall before the next: repeat offences escalate, so both are excluded.
    for spacing_s in (0.1, 60.0, 1800.0):
        failures, after = failures_until_excluded(spacing_s)
        assert failures <= 20, (spacing_s, failures)
        assert failures == 3, (spacing_s, failures)  # -4, -8, -16: below -15 at the third
        assert after == 0, "an excluded peer was chosen by routing"


# --------------------------------------------------------------------------------------------
# Speed claims: a claim to be faster than this node counts only once proven


FAST_CLAIM = CostModel(
    prefill_s_per_token=1e-6, cached_s_per_token=1e-7, decode_s_per_token=1e-5, overhead_s=1e-4
)


def speed_claim_swarm(now: float) -> tuple[NodeCore, NodeCore, NodeCore, tuple[int, ...]]:
    """A busy origin (every remote beats it), an honest holder ``H`` of a 240-token prefix at the
    origin's own speed, and ``L`` that announces a speed thousands of times faster, no cache."""
    a = busy_origin("A", now)
    holder, claimer = make("H", policy="cost"), make("L", policy="cost", costs=FAST_CLAIM)
    shared = prompt(1, 240)
    serve_locally(holder, "warm", shared, now)
    introduce(a, holder, now)
    introduce(a, claimer, now)
    assert a.index.load(PeerId("L")).speed == FAST_CLAIM.speed()
    return a, holder, claimer, shared


def answer_fresh_prompts(a: NodeCore, ttft_s: float, now: float, requests: int = 30) -> int:
    """Fresh prompts (no cache anywhere) at the busy origin: each forward is answered, the
    claimer's in ``ttft_s`` and the holder's at its estimate; the forwards the claimer got."""
    to_claimer = 0
    for i in range(requests):
        rid = RequestId(f"fresh{i}")
        fwd = forward_to_b(a, rid, prompt(900 + i, 64), now)
        assert fwd is not None
        answered_in = ttft_s if fwd.peer == "L" else fwd.decision.estimated_ttft_s
        a.handle(ForwardFinished(rid, fwd.peer, cached_tokens=0, ttft_s=answered_in), now + 0.5)
        to_claimer += fwd.peer == "L"
        now += 1.0
    return to_claimer


def test_an_unproven_claim_to_be_faster_does_not_win_over_the_prefix_holder() -> None:
    a, _, _, shared = speed_claim_swarm(1.0)
    # The claim believed, L's estimate (no cache, at its claimed speed) beats H's (240 cached
    # tokens at our speed): the attack. Unproven, L is estimated at our speed: H wins.
    fwd = forward_to_b(a, "r1", shared + prompt(2, 16), 1.0)
    assert fwd is not None and fwd.peer == "H"
    assert not a.reputation.speed_proven(PeerId("L"), 1.0)


def test_a_claimer_that_answers_at_honest_speed_never_proves_its_claim() -> None:
    a, _, _, shared = speed_claim_swarm(1.0)
    to_claimer = answer_fresh_prompts(a, ttft_s=0.3, now=2.0)  # our speed: about 0.3 s
    assert to_claimer >= 5  # chosen on load, served: standing good, claim still unproven
    assert a.reputation.standing(PeerId("L"), 40.0) == "good"
    assert not a.reputation.speed_proven(PeerId("L"), 40.0)
    fwd = forward_to_b(a, "after", shared + prompt(2, 16), 40.0)
    assert fwd is not None and fwd.peer == "H"


def test_a_really_faster_peer_proves_its_claim_and_then_wins_on_speed() -> None:
    a, _, _, shared = speed_claim_swarm(1.0)
    to_claimer = answer_fresh_prompts(a, ttft_s=0.01, now=2.0)
    assert to_claimer >= CFG.speed_proofs
    assert a.reputation.speed_proven(PeerId("L"), 40.0)
    # Believed now: its estimate beats the holder's cache.
    fwd = forward_to_b(a, "after", shared + prompt(2, 16), 40.0)
    assert fwd is not None and fwd.peer == "L"
    # And a demotion takes the belief away again.
    for _ in range(20):  # its served answers banked some credit
        if a.reputation.record(PeerId("L"), "slow", 41.0) == "demoted":
            break
    assert a.reputation.standing(PeerId("L"), 41.0) == "demoted"
    assert not a.reputation.speed_proven(PeerId("L"), 41.0)
