"""The replica budget's short rebalance (``ReplicaBudget._size_short``): where the equal share
is below ``MIN_ALLOWANCE``, every peer is given the share and the spare goes by hits alone, with
no want computed but the spare's takers'. It must size every allowance as the rebalance over
every peer's want does (``_size_every``), whatever the hits, freshness, pending announcements
and followed runs."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from peerinfer.core import replicabudget
from peerinfer.core.index import MIN_ALLOWANCE, PeerIndex
from peerinfer.types import BlockHash, PeerId


@dataclass
class _Run:
    epoch: int
    count: int
    at: float
    length: int
    changed_at: int  # the run's length after its last announcement with changes (0: none)

    def changed_since(self, cursor: int) -> bool:
        return self.changed_at > cursor


@dataclass
class _Record:
    run: _Run | None
    cursor: int


def _trial(rng: random.Random) -> tuple[PeerIndex, dict[PeerId, tuple[int, int, float, int]],
                                        dict[PeerId, _Record]]:
    n = rng.randint(2, 40)
    share = rng.choice([MIN_ALLOWANCE - 40, MIN_ALLOWANCE - 3, MIN_ALLOWANCE - 1])
    index = PeerIndex(replica_budget_blocks=n * share + rng.randrange(n), masks=False)
    peers = [PeerId(f"P{i}") for i in range(n)]
    for p in peers:
        index.add_peer(p)
    pending: dict[PeerId, tuple[int, int, float, int]] = {}
    followed: dict[PeerId, _Record] = {}
    levels = [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0]  # few levels: ties in hits, broken by freshness, then age
    for i, p in enumerate(peers):
        state = index._states[p]
        state.hits = rng.choice(levels)
        state.fresh_at = rng.choice([-1.0, 1.0, 2.0])
        replica = index.replica(p)
        assert replica is not None
        size = rng.choice([0, 10, 2040, 2050, 2500])
        replica.digest.apply_delta([BlockHash(i * 10_000 + h) for h in range(1, size + 1)], [])
        if rng.random() < 0.5:
            replica._announced = (rng.randint(1, 5), 0, rng.choice([0, 2047, 2049, 3000]))
        if rng.random() < 0.4:
            pending[p] = (rng.randint(0, 6), rng.choice([5, 2049, 2600]), rng.choice([0.5, 1.5, 3.0]),
                          rng.choice([-1, 7, 2049, 2600, 4500]))
        if rng.random() < 0.5:
            length = rng.randint(1, 4)
            run = _Run(rng.randint(0, 6), rng.choice([5, 2049, 2600]), rng.choice([0.5, 1.5, 3.0]),
                       length, rng.choice([0, length]))
            followed[p] = _Record(run if rng.random() < 0.9 else None, rng.randint(0, length))
    index.claims_changed()  # (the claims were set by hand)
    return index, pending, followed


def test_the_short_rebalance_sizes_as_the_rebalance_over_every_want(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each short rebalance also sizes the long way and asserts the same (the hook).
    monkeypatch.setattr(replicabudget.ReplicaBudget, "check_rebalances", True)
    rng = random.Random(25)
    short = replicabudget.ReplicaBudget.rebalance_counts.short_rebalances
    beyond_the_head = 0
    for _ in range(150):
        index, pending, followed = _trial(rng)
        share = index.replica_budget_blocks // len(index)
        top = max(s.hits for s in index._states.values())
        heads = sum(1 for s in index._states.values() if s.hits == top)
        index.rebalance(pending=pending, followed=followed)
        index.check_invariants()
        assert sum(index.allowance(p) for p in index.peers()) <= index.replica_budget_blocks
        # The spare went past the peers with the most hits: the rest of the order was read.
        beyond_the_head += sum(1 for p in index.peers() if index.allowance(p) > share) > heads
    assert replicabudget.ReplicaBudget.rebalance_counts.short_rebalances - short >= 150  # (and newcomers')
    assert beyond_the_head > 8, beyond_the_head  # 15 measured


@pytest.mark.pure_python
def test_the_cross_check_catches_a_wrong_short_rebalance(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not vacuous: a short rebalance that reads neither pending announcements nor followed
    runs (sizes, claims and freshness as if nothing waited) fails the hook's comparison. (So
    did, by hand: the followed run's size ignored, and the spare stopped after the peers with
    the most hits.)"""
    monkeypatch.setattr(replicabudget.ReplicaBudget, "check_rebalances", True)
    original = replicabudget.ReplicaBudget._size_short

    def stale(self: replicabudget.ReplicaBudget, states: list[replicabudget._PeerState],
              share: int, reserve: int, pending: object, followed: object) -> object:
        return original(self, states, share, reserve, None, None)

    monkeypatch.setattr(replicabudget.ReplicaBudget, "_size_short", stale)
    rng = random.Random(25)
    with pytest.raises(AssertionError, match="short rebalance"):
        for _ in range(150):
            index, pending, followed = _trial(rng)
            index.rebalance(pending=pending, followed=followed)


def _minimal_trial(rng: random.Random) -> tuple[PeerIndex, dict[PeerId, tuple[int, int, float, int]],
                                                dict[PeerId, _Record], int]:
    """An index whose share is at least ``MIN_ALLOWANCE``, with sizes, claims, pending news and
    followed runs at and around half of it, and the bound of the news as ``PeerView`` takes it."""
    n = rng.randint(1, 30)
    index = PeerIndex(replica_budget_blocks=n * rng.choice(
        [MIN_ALLOWANCE - 1, MIN_ALLOWANCE, MIN_ALLOWANCE + 7, 4 * MIN_ALLOWANCE]), masks=False)
    peers = [PeerId(f"P{i}") for i in range(n)]
    for p in peers:
        index.add_peer(p)
    half = MIN_ALLOWANCE // 2
    # At most one kind of figure may go past half (else nearly every trial has some over).
    over = rng.choice(["none", "size", "claim", "pending", "run"])

    def near(kind: str) -> list[int]:
        return [0, 5, half - 1, half, half] + [half + 1] * (kind == over)

    pending: dict[PeerId, tuple[int, int, float, int]] = {}
    followed: dict[PeerId, _Record] = {}
    bound = 0
    for i, p in enumerate(peers):
        state = index._states[p]
        state.hits = rng.choice([0.0, 1.0, 3.0])
        replica = index.replica(p)
        assert replica is not None
        size = rng.choice(near("size"))
        replica.digest.apply_delta([BlockHash(i * 10_000 + h) for h in range(1, size + 1)], [])
        if rng.random() < 0.5:
            replica._announced = (rng.randint(1, 5), 0, rng.choice(near("claim")))
        if rng.random() < 0.2:  # an allowance not yet the minimal one
            index._set_allowance(state, rng.choice([MIN_ALLOWANCE + 1, MIN_ALLOWANCE * 2]))
        if rng.random() < 0.4:
            count = rng.choice(near("pending"))
            pending[p] = (rng.randint(0, 6), count, 1.0, rng.choice([-1, count]))
            bound = max(bound, count)
        if rng.random() < 0.4:
            length = rng.randint(1, 4)
            run = _Run(rng.randint(0, 6), rng.choice(near("run")), 2.0, length, rng.choice([0, length]))
            followed[p] = _Record(run, rng.randint(0, length))
            bound = max(bound, run.count)
    index.claims_changed()  # (the claims were set by hand)
    return index, pending, followed, bound


def test_a_rebalance_with_every_want_minimal_sizes_as_the_rebalance_over_every_want(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``wants_minimal`` (every size, claim and waiting count at most half of
    ``MIN_ALLOWANCE``, the share at least that): the rebalance that sizes nothing gives every
    peer what sizing every want gives (the hook compares), and leaves the index as that does."""
    monkeypatch.setattr(replicabudget.ReplicaBudget, "check_rebalances", True)
    rng = random.Random(64)
    minimal = replicabudget.ReplicaBudget.rebalance_counts.minimal_rebalances
    fast = slow = 0
    for _ in range(300):
        index, pending, followed, bound = _minimal_trial(rng)
        if index.wants_minimal(bound):
            fast += 1
            assert index.rebalance(pending=pending, followed=followed, minimal=True) == []
            assert all(index.allowance(p) == MIN_ALLOWANCE for p in index.peers())
        else:
            slow += 1
            index.rebalance(pending=pending, followed=followed)
        index.check_invariants()
    assert replicabudget.ReplicaBudget.rebalance_counts.minimal_rebalances - minimal == fast
    assert fast > 60 and slow > 60, (fast, slow)


def test_the_cross_check_catches_a_wrong_minimal_rebalance(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not vacuous: a ``wants_minimal`` that reads no news waiting (only the replicas) passes
    rebalances whose pending or followed counts want more; the hook's comparison fails."""
    monkeypatch.setattr(replicabudget.ReplicaBudget, "check_rebalances", True)
    original = replicabudget.ReplicaBudget.wants_minimal

    def blind(self: replicabudget.ReplicaBudget, news_bound: int) -> bool:
        return original(self, 0)

    monkeypatch.setattr(replicabudget.ReplicaBudget, "wants_minimal", blind)
    rng = random.Random(64)
    with pytest.raises(AssertionError, match="minimal rebalance"):
        for _ in range(300):
            index, pending, followed, bound = _minimal_trial(rng)
            index.rebalance(pending=pending, followed=followed, minimal=index.wants_minimal(bound))
