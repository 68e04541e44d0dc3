"""A node's next deadline (``NodeCore.next_deadline``, which the simulator reads after every tick
and most events) is found without listing every candidate; it must be the minimum of the list:
the rebalance, ``Announcing.deadlines`` (the schedule, an early announcement's gap, running
pulls) and the forwards' first-token deadlines."""

from __future__ import annotations

import pytest

from peerinfer.core.node import NodeCore
from peerinfer.sim.config import SimConfig
from peerinfer.sim.run import simulate


def test_the_next_deadline_is_the_least_of_every_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    fast = NodeCore.next_deadline
    asked = {"calls": 0, "by a pull": 0, "by a forward": 0, "by the gap": 0}

    def checked(self: NodeCore) -> float:
        got = fast(self)
        pulls = [st.sync_deadline for st in self.announcing._pulls.values() if st.sync is not None]
        forwards = self.requests.deadlines()
        candidates = [self._next_rebalance, *self.announcing.deadlines(), *forwards]
        assert got == min(candidates), (got, candidates)
        asked["calls"] += 1
        asked["by a pull"] += bool(pulls) and got == min(pulls)
        asked["by a forward"] += bool(forwards) and got == min(forwards)
        gap = self.announcing._last_announce + self.config.min_announce_gap_s
        asked["by the gap"] += self.announcing.local.has_pending_changes() and got == gap
        return got

    monkeypatch.setattr(NodeCore, "next_deadline", checked)
    for seed, loss in ((1, 0.3), (2, 0.0)):
        simulate(SimConfig(nodes=6, requests=150, rate=2.0, cache_tokens=4096, gossip_loss=loss,
                           first_token_timeout_s=0.5, sync_timeout_s=0.1, seed=seed))
    # Not vacuous: each kind of candidate was the least some of the time.
    assert all(v > 20 for v in asked.values()), asked
