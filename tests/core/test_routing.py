"""Routing policies: each one's contract, on hand-made cases and on random candidate sets."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerinfer.core.costmodel import CostModel
from peerinfer.core.messages import Load
from peerinfer.core.routing import (
    POLICY_NAMES,
    Candidate,
    CostPolicy,
    RouteDecision,
    RouteRequest,
    make_candidate,
    make_policy,
)
from peerinfer.errors import ConfigError
from peerinfer.types import PeerId

LOCAL = PeerId("local-node")


def remote(
    name: str,
    matched: int = 0,
    *,
    queued: int = 0,
    running: int = 0,
    slots: int = 1,
    rtt: float = 0.02,
    age: float = 0.0,
    inflight: int = 0,
) -> Candidate:
    return Candidate(
        PeerId(name), False, matched, Load(queued, running, slots), rtt, age, inflight
    )


def local(matched: int = 0, *, queued: int = 0, running: int = 0, slots: int = 1) -> Candidate:
    return Candidate(LOCAL, True, matched, Load(queued, running, slots), 0.0, 0.0)


REQ = RouteRequest(prompt_tokens=512, max_tokens=32)


def choose(name: str, cands: list[Candidate], seed: int = 0, **options: float) -> RouteDecision:
    return make_policy(name, **options).choose(REQ, cands, random.Random(seed))


# ------------------------------------------------------------------------ examples


def test_local_policy_always_serves_locally() -> None:
    cands = [remote("a", 512), local(0, queued=50), remote("b", 256)]
    d = choose("local", cands)
    assert d.target == LOCAL and d.is_local and d.ranked[0] == LOCAL
    assert d.reason.startswith("local:")


def test_longest_prefix_picks_the_longest_match_with_age_in_the_reason() -> None:
    cands = [local(64), remote("peer-a", 480, age=1.2), remote("peer-b", 256)]
    d = choose("longest_prefix", cands)
    assert d.target == "peer-a" and not d.is_local and d.expected_cached_tokens == 480
    assert d.reason == "longest_prefix: peer peer-a holds 480/512 tokens (digest 1.2 s old)"
    assert d.ranked == ("peer-a", "peer-b", LOCAL)


def test_longest_prefix_breaks_ties_by_load_then_at_random() -> None:
    cands = [local(0), remote("a", 320, queued=3), remote("b", 320, running=1), remote("c", 320)]
    assert choose("longest_prefix", cands).target == "c"
    tied = [local(0), remote("a", 320), remote("b", 320), remote("c", 320)]
    picks = {choose("longest_prefix", tied, seed=s).target for s in range(40)}
    assert picks == {"a", "b", "c"}


def test_longest_prefix_with_no_match_anywhere_takes_the_least_loaded() -> None:
    d = choose("longest_prefix", [local(0, running=1), remote("a", 0, running=1), remote("b")])
    assert d.target == "b" and "no candidate holds" in d.reason


def test_least_loaded_prefers_local_on_a_tie() -> None:
    d = choose("least_loaded", [remote("a"), local(), remote("b", queued=2)])
    assert d.target == LOCAL
    d = choose("least_loaded", [remote("a"), local(running=1), remote("b", inflight=1)])
    assert d.target == "a"
    # Slots count: 3 running on 4 slots is a lighter load than 1 on 1.
    d = choose("least_loaded", [local(running=1), remote("a", running=3, slots=4)])
    assert d.target == "a"


def test_round_robin_visits_every_candidate_in_turn() -> None:
    policy = make_policy("round_robin")
    cands = [remote("c"), local(), remote("a"), remote("b")]
    targets = [policy.choose(REQ, cands, random.Random(0)).target for _ in range(8)]
    assert targets[:4] == ["a", "b", "c", LOCAL] and targets[4:] == targets[:4]


def test_random_is_repeatable_with_the_same_rng_and_reaches_everyone() -> None:
    cands = [local(), remote("a"), remote("b")]
    assert choose("random", cands, seed=3) == choose("random", cands, seed=3)
    assert {choose("random", cands, seed=s).target for s in range(60)} == {LOCAL, "a", "b"}


def test_cost_forwards_to_a_fresh_idle_holder_of_a_long_prefix() -> None:
    d = choose("cost", [local(0), remote("a", 512, age=0.5), remote("b", 0)])
    assert d.target == "a" and d.estimated_ttft_s is not None
    assert d.reason.startswith("cost: peer a est. TTFT")
    assert d.ranked[-1] == LOCAL or d.ranked[-1] == "b"


def test_cost_stays_local_when_local_is_as_good() -> None:
    # Same cache, same load: the remote only adds a round trip.
    d = choose("cost", [local(256), remote("a", 256, rtt=0.0)])
    assert d.target == LOCAL and "does not beat it" in d.reason
    # A small gain is not worth forwarding (hysteresis).
    d = choose("cost", [local(256), remote("a", 272, rtt=0.0)])
    assert d.target == LOCAL


def test_cost_discounts_a_stale_digest() -> None:
    policy = CostPolicy(staleness_half_life_s=10.0)
    fresh = policy.estimate(REQ, remote("a", 400, age=0.0))
    old = policy.estimate(REQ, remote("a", 400, age=10.0))
    never = policy.estimate(REQ, remote("a", 400, age=math.inf))
    assert fresh[1] == 400 and old[1] == pytest.approx(200) and never[1] == 0
    assert fresh[0] < old[0] < never[0]
    # A long match behind a digest never confirmed loses to a shorter fresh one.
    d = policy.choose(
        REQ, [local(0), remote("a", 512, age=math.inf), remote("b", 384)], random.Random(0)
    )
    assert d.target == "b"


def test_cost_sheds_a_hot_holder() -> None:
    # The holder has a queue; an idle node recomputing the prompt is faster than waiting.
    cands = [local(0, queued=8), remote("holder", 512, running=1, queued=3), remote("cold")]
    d = choose("cost", cands)
    assert d.target == "cold"
    # The same holder, idle, wins.
    cands = [local(0, queued=8), remote("holder", 512), remote("cold")]
    assert choose("cost", cands).target == "holder"


def test_a_forward_carries_the_queue_its_decision_assumed() -> None:
    """By hand: 512-token prompt, 1 token out, default costs. Local holds nothing; the holder
    holds 448 tokens and runs one request. Serving locally, TTFT = prefill(512, 0); at the
    holder, rtt + wait(n) + prefill(512, 448). The forward pays off while the holder's wait stays
    under prefill(512, 0) - prefill(512, 448) (the round trip is spent either way)."""
    policy = CostPolicy()
    costs = policy.costs
    request = RouteRequest(prompt_tokens=512, max_tokens=1)
    holder = remote("holder", 448, running=1, rtt=0.02)
    d = policy.choose(request, [local(0), holder], random.Random(0))
    assert d.target == "holder"
    service = costs.service_s(512, 256, 1)  # the policy's mean service time
    budget = costs.prefill_s(512, 0) - costs.prefill_s(512, 448)
    # wait(n) = (n - 1 + 0.5) * service on one slot: the largest n within the budget
    assert d.max_outstanding == math.floor(budget / service + 0.5) == 2
    assert (2 - 0.5) * service <= budget < (3 - 0.5) * service
    # Local decisions and the other policies carry no limit.
    assert policy.choose(request, [local(448), holder], random.Random(0)).max_outstanding is None
    assert choose("longest_prefix", [local(0), holder]).max_outstanding is None


def test_the_queue_limit_is_set_by_the_runner_up_not_only_by_local() -> None:
    # A second holder almost as good: the first may not queue much before the second wins.
    request = RouteRequest(prompt_tokens=512, max_tokens=1)
    policy = CostPolicy()
    alone = policy.choose(request, [local(0), remote("a", 496)], random.Random(0))
    near = policy.choose(
        request, [local(0), remote("a", 496), remote("b", 480)], random.Random(0)
    )
    assert alone.target == near.target == "a"
    assert near.max_outstanding is not None and alone.max_outstanding is not None
    assert near.max_outstanding < alone.max_outstanding


def test_a_popular_prefix_spreads_over_several_nodes() -> None:
    """A burst of one prefix: each request sent raises the target's inflight count and makes it
    a (speculative) holder. The burst must not all go to the first holder."""
    policy = make_policy("cost")
    rng = random.Random(7)
    inflight: Counter[str] = Counter()
    holders = {"h"}
    names = ["h", "x", "y", "z"]
    targets = []
    for _ in range(12):
        cands = [local(0, queued=20)] + [
            remote(n, 512 if n in holders else 0, inflight=inflight[n]) for n in names
        ]
        d = policy.choose(REQ, cands, rng)
        targets.append(d.target)
        inflight[d.target] += 1
        holders.add(d.target)
    counts = Counter(targets)
    assert len(counts) >= 3, counts
    assert max(counts.values()) - min(counts[n] for n in names) <= 2, counts


def test_policies_refuse_candidate_lists_without_exactly_one_local() -> None:
    for name in POLICY_NAMES:
        with pytest.raises(ValueError):
            choose(name, [remote("a"), remote("b")])
        with pytest.raises(ValueError):
            choose(name, [local(), remote("a"), local()])


def test_make_policy_names_options_and_errors() -> None:
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    with pytest.raises(ConfigError, match="unknown routing policy"):
        make_policy("fastest")
    with pytest.raises(ConfigError):
        make_policy("cost", staleness=3.0)
    with pytest.raises(ConfigError):
        make_policy("random", min_gain_s=0.1)
    with pytest.raises(ConfigError):
        make_policy("cost", staleness_half_life_s=0.0)
    policy = make_policy("cost", costs=CostModel(slots=2), min_gain_s=0.5)
    assert isinstance(policy, CostPolicy) and policy.min_gain_s == 0.5


# ---------------------------------------------------------------- random candidate sets

loads = st.builds(
    Load,
    queued=st.integers(0, 20),
    running=st.integers(0, 8),
    slots=st.integers(1, 4),
)
ages = st.one_of(st.floats(0.0, 600.0), st.just(math.inf))


@st.composite
def candidate_sets(draw: st.DrawFn) -> tuple[RouteRequest, list[Candidate]]:
    prompt = draw(st.integers(1, 4096))
    request = RouteRequest(prompt_tokens=prompt, max_tokens=draw(st.integers(1, 512)))
    names = draw(st.lists(st.text("abcdef", min_size=1, max_size=4), unique=True, max_size=8))
    matched = st.integers(0, prompt + 64)
    cands = [
        Candidate(
            PeerId(n),
            False,
            draw(matched),
            draw(loads),
            draw(st.floats(0.0, 0.5)),
            draw(ages),
            draw(st.integers(0, 5)),
        )
        for n in names
    ]
    mine = Candidate(LOCAL, True, draw(matched), draw(loads), 0.0, 0.0, draw(st.integers(0, 5)))
    cands.insert(draw(st.integers(0, len(cands))), mine)
    return request, cands


@settings(max_examples=300, deadline=None)
@given(case=candidate_sets(), name=st.sampled_from(POLICY_NAMES), seed=st.integers(0, 2**32))
def test_every_decision_is_well_formed(
    case: tuple[RouteRequest, list[Candidate]], name: str, seed: int
) -> None:
    request, cands = case
    d = make_policy(name).choose(request, cands, random.Random(seed))
    by_peer = {c.peer: c for c in cands}
    assert sorted(d.ranked) == sorted(by_peer)  # every candidate exactly once
    assert d.ranked[0] == d.target
    assert d.is_local == by_peer[d.target].is_local
    assert 0 <= d.expected_cached_tokens <= request.prompt_tokens
    assert d.reason.startswith(f"{name}:") and len(d.reason) > len(name) + 2
    if name == "local":
        assert d.is_local


def _load_ratio(c: Candidate) -> float:
    return max(c.load.queued + c.load.running, c.inflight) / c.load.slots


@settings(max_examples=300, deadline=None)
@given(case=candidate_sets(), seed=st.integers(0, 2**32))
def test_longest_prefix_picks_a_maximal_match_then_the_lightest_load(
    case: tuple[RouteRequest, list[Candidate]], seed: int
) -> None:
    request, cands = case
    d = make_policy("longest_prefix").choose(request, cands, random.Random(seed))
    target = next(c for c in cands if c.peer == d.target)
    best = max(min(c.matched_tokens, request.prompt_tokens) for c in cands)
    assert min(target.matched_tokens, request.prompt_tokens) == best
    tied = [c for c in cands if min(c.matched_tokens, request.prompt_tokens) == best]
    assert _load_ratio(target) == min(_load_ratio(c) for c in tied)


@settings(max_examples=300, deadline=None)
@given(case=candidate_sets(), seed=st.integers(0, 2**32))
def test_cost_never_forwards_unless_it_beats_local_by_the_margin(
    case: tuple[RouteRequest, list[Candidate]], seed: int
) -> None:
    request, cands = case
    policy = CostPolicy()
    d = policy.choose(request, cands, random.Random(seed))
    estimates = {c.peer: policy.estimate(request, c)[0] for c in cands}
    local_ttft = estimates[LOCAL]
    assert d.estimated_ttft_s == pytest.approx(estimates[d.target])
    if not d.is_local:
        margin = max(policy.min_gain_s, policy.min_gain_fraction * local_ttft)
        assert estimates[d.target] < local_ttft - margin
        assert estimates[d.target] == min(estimates.values())
    if all(local_ttft <= t for t in estimates.values()):
        assert d.is_local
    # The failover order follows the estimates after the target.
    rest = [estimates[p] for p in d.ranked[1:]]
    assert rest == sorted(rest)
    # A forward's queue limit admits at least the queue its own estimate assumed.
    if d.is_local:
        assert d.max_outstanding is None
    else:
        target = next(c for c in cands if c.peer == d.target)
        assumed = max(target.load.queued + target.load.running, target.inflight)
        assert d.max_outstanding is not None and d.max_outstanding >= assumed


@given(case=candidate_sets())
def test_make_candidate_is_exactly_the_constructor(
    case: tuple[RouteRequest, list[Candidate]],
) -> None:
    for c in case[1]:
        fast = make_candidate(
            c.peer, c.is_local, c.matched_tokens, c.load, c.rtt_s, c.digest_age_s, c.inflight
        )
        assert type(fast) is Candidate and fast == c and hash(fast) == hash(c)
        with pytest.raises(AttributeError):
            fast.peer = PeerId("other")  # type: ignore[misc]
