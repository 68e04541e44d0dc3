"""A rebalance that sizes nothing (``ReplicaBudget.wants_minimal``: every size, claim and
waiting count at most half of ``MIN_ALLOWANCE``) must give what sizing every want gives, also in
a simulation whose caches grow past that bound: the rebalances before it sized nothing, those
after it size every want (the hook compares each minimal one with sizing every want)."""

from __future__ import annotations

import pytest

from peerinfer.core import replicabudget
from peerinfer.core.index import MIN_ALLOWANCE
from peerinfer.sim.config import SimConfig
from peerinfer.sim.run import simulate


@pytest.mark.pure_python
def test_rebalances_size_nothing_until_a_cache_grows_past_half_the_minimum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(replicabudget.ReplicaBudget, "check_rebalances", True)
    budget = replicabudget.ReplicaBudget
    minimal_before = budget.rebalance_counts.minimal_rebalances
    seen = {"minimal": 0, "sized": 0}
    rebalance = budget.rebalance

    def counting(self: replicabudget.ReplicaBudget, **kw: object) -> list[object]:
        if kw.get("reserve", 0) == 0 and kw.get("decay", True):
            seen["minimal" if kw.get("minimal") else "sized"] += 1
        return rebalance(self, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(budget, "rebalance", counting)
    block = 16
    sim, _ = simulate(SimConfig(nodes=4, requests=700, rate=4.0, skew="uniform",
                                cache_tokens=block * 3 * MIN_ALLOWANCE, seed=3))
    assert budget.rebalance_counts.minimal_rebalances - minimal_before == seen["minimal"]
    # Both kinds ran: small caches first, then past half the minimum.
    assert seen["minimal"] > 5 and seen["sized"] > 5, seen
    assert max(len(core.local.digest) for core in sim.cores) > MIN_ALLOWANCE // 2
