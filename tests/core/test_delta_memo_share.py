"""A delta applied with ``share=False`` leaves nothing in the shared memo
(``MerkleDigest.apply_delta``): issue 25, memory held that nobody reads."""

from __future__ import annotations

from peerinfer.core.merkle import DeltaMemo, MerkleDigest, NullObserver
from peerinfer.types import BlockHash


def _digest(hashes: set[int], memo: DeltaMemo | None = None) -> MerkleDigest:
    d = MerkleDigest(NullObserver(), lazy=True, memo=memo)
    for h in hashes:
        d.add(BlockHash(h))
    return d


def test_a_delta_applied_without_sharing_leaves_nothing_in_the_memo() -> None:
    """``share=False`` (no other set will apply it: ``Broadcast`` when every recipient follows
    the run) stores nothing, yet takes a result another digest left, and gives the same set."""
    memo = DeltaMemo()
    base = set(range(1, 100))
    added, removed = (200, 201), (5, 6)
    first, second, third = _digest(base, memo), _digest(base, memo), _digest(base, memo)
    first.apply_delta(added, removed, share=False)
    assert not memo.deltas
    assert first._flat == (base | {200, 201}) - {5, 6}
    second.apply_delta(added, removed)
    assert len(memo.deltas) == 1
    third.apply_delta(added, removed, share=False)  # a hit: the very set the second holds
    assert third._flat is second._flat and third.root == first.root == second.root
