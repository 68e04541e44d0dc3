"""The cost policy's extra-work charge (``CostPolicy(extra_work_weight=...)``, on with KV pulls:
``PullSettings.extra_work_weight``): a placement that recomputes what another candidate holds
is charged that extra prefill times the requests outstanding where it goes, so a busy holder's
request is not shed onto a busy non-holder; spreading onto an idle node costs nothing."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerinfer.core.kvpull import PullSettings
from peerinfer.core.routing import Candidate, CostPolicy, RouteRequest, make_policy
from peerinfer.errors import ConfigError
from tests.core.test_node_core import make
from tests.core.test_routing import LOCAL, candidate_sets, local, remote

REQ = RouteRequest(prompt_tokens=512, max_tokens=32)


def _charge(policy: CostPolicy, c: Candidate, best_cached: float) -> float:
    """The charge by hand: (best - own expected cached) x saving per token x outstanding / slots."""
    n = max(c.load.queued + c.load.running, c.inflight)
    own = min(c.matched_tokens, REQ.prompt_tokens) * policy.confidence(c)
    saving = policy.costs.prefill_s_per_token - policy.costs.cached_s_per_token
    return policy.extra_work_weight * max(0.0, best_cached - own) * saving * n / max(1, c.load.slots)


def test_a_busy_holder_keeps_its_request_rather_than_a_busy_non_holder_recomputing_it() -> None:
    # Every node busy (past saturation): the holder has 3 outstanding, a non-holder 2.
    cands = [local(0, queued=5), remote("holder", 496, queued=2, running=1),
             remote("cold", queued=1, running=1)]
    greedy = CostPolicy()
    est = {c.peer: greedy.estimate(REQ, c)[0] for c in cands}
    # The premise: by this request's own first token, recomputing at "cold" is faster.
    assert est["cold"] < est["holder"] - 0.1 * est[LOCAL]
    assert greedy.choose(REQ, cands, random.Random(0)).target == "cold"
    # Charged for the 496 tokens' prefill that then delays the requests behind it at "cold".
    charged = CostPolicy(extra_work_weight=1.0)
    d = charged.choose(REQ, cands, random.Random(0))
    assert d.target == "holder"
    assert est["holder"] < est["cold"] + _charge(charged, cands[2], 496)
    # The estimate it carries is still the TTFT, not the score; the reason names the charge.
    assert d.estimated_ttft_s == pytest.approx(est["holder"])
    assert "extra-work charge" in d.reason


def test_an_idle_node_is_charged_nothing_so_a_hot_holder_still_sheds_onto_it() -> None:
    cands = [local(0, queued=8), remote("holder", 512, running=1, queued=3), remote("cold")]
    for weight in (0.0, 1.0, 5.0):
        assert make_policy("cost", extra_work_weight=weight).choose(
            REQ, cands, random.Random(0)).target == "cold"


def test_the_weight_is_checked() -> None:
    with pytest.raises(ConfigError):
        CostPolicy(extra_work_weight=-1.0)
    with pytest.raises(ConfigError):
        PullSettings(extra_work_weight=float("inf"))


def test_pulls_turn_the_charge_on_and_pulls_off_leave_it_off() -> None:
    assert make("A", policy="cost").choice.policy.extra_work_weight == 0.0  # type: ignore[attr-defined]
    on = make("A", policy="cost", kv_pull=PullSettings(), private_swarm=True)
    assert on.choice.policy.extra_work_weight == 1.0  # type: ignore[attr-defined]
    off = make("A", policy="cost", kv_pull=PullSettings(extra_work_weight=0.0), private_swarm=True)
    assert off.choice.policy.extra_work_weight == 0.0  # type: ignore[attr-defined]


@settings(max_examples=300, deadline=None)
@given(case=candidate_sets(), seed=st.integers(0, 2**32), weight=st.sampled_from([0.5, 1.0, 3.0]))
def test_the_charged_choice_takes_the_lowest_score_and_its_queue_limit_admits_it(
    case: tuple[RouteRequest, list[Candidate]], seed: int, weight: float
) -> None:
    request, cands = case
    policy = CostPolicy(extra_work_weight=weight)
    d = policy.choose(request, cands, random.Random(seed))
    charges = policy._charges(request, cands)
    prompt = request.prompt_tokens
    best = max(min(c.matched_tokens, prompt) * policy.confidence(c) for c in cands)
    per_token = policy.costs.prefill_s_per_token - policy.costs.cached_s_per_token
    for c, charge in zip(cands, charges, strict=True):  # (every load here at this node's speed)
        n = max(c.load.queued + c.load.running, c.inflight)
        own = min(c.matched_tokens, prompt) * policy.confidence(c)
        assert charge == pytest.approx(
            weight * max(0.0, best - own) * per_token * n / max(1, c.load.slots), abs=1e-12)
        if n == 0:
            assert charge == 0.0  # an idle node: nobody waits behind it
    score = {c.peer: policy.estimate(request, c)[0] + ch
             for c, ch in zip(cands, charges, strict=True)}
    assert d.estimated_ttft_s == pytest.approx(policy.estimate(
        request, next(c for c in cands if c.peer == d.target))[0])
    if not d.is_local:
        margin = max(policy.min_gain_s, policy.min_gain_fraction * score[LOCAL])
        assert score[d.target] < score[LOCAL] - margin
        assert score[d.target] == pytest.approx(min(score.values()))
        target = next(c for c in cands if c.peer == d.target)
        assumed = max(target.load.queued + target.load.running, target.inflight)
        assert d.max_outstanding is not None and d.max_outstanding >= assumed
    else:
        assert d.max_outstanding is None
    rest = [score[p] for p in d.ranked[1:]]
    assert rest == sorted(rest)
