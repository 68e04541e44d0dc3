"""A node's own digest takes its engine's cache changes in one call per report
(``LocalDigest.apply_changes``, through ``MerkleDigest.change``): it must leave the digest,
its pending changes and every epoch sealed after it as ``block_removed`` for each removed
hash and then ``block_added`` for each added one do, flat or with the trie built, with a flat
set shared with another digest or not, and with an observer."""

from __future__ import annotations

import random

from peerinfer.core.digest import LocalDigest, MerkleDigest
from peerinfer.types import BlockHash


class _Log:
    """An observer that records what it hears, in order."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, int]] = []

    def block_added(self, h: BlockHash) -> None:
        self.heard.append(("+", h))

    def block_removed(self, h: BlockHash) -> None:
        self.heard.append(("-", h))


def _state(local: LocalDigest) -> tuple[object, ...]:
    d = local.digest
    return (
        local.epoch, d.root, len(d), sorted(d), d.flat_summary(),
        sorted(local._pending_added), sorted(local._pending_removed),
    )


def _report(rng: random.Random, pool: list[int], held: set[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An engine's report: some new hashes and some held ones as added (a repeat changes
    nothing), some held, some absent, and some of the added as removed (a block that came and
    went within the report)."""
    added = [rng.choice(pool) for _ in range(rng.randrange(8))]
    removed = [rng.choice(sorted(held)) for _ in range(rng.randrange(4)) if held]
    removed += [rng.choice(pool) for _ in range(rng.randrange(2))]
    removed += [h for h in added if rng.random() < 0.2]
    rng.shuffle(removed)
    return tuple(BlockHash(h) for h in added), tuple(BlockHash(h) for h in removed)


def test_apply_changes_is_the_calls_one_by_one() -> None:
    rng = random.Random(25)
    for trial in range(60):
        pool = [rng.getrandbits(64) for _ in range(40)]
        one, batch = LocalDigest(epoch_base=trial), LocalDigest(epoch_base=trial)
        if trial % 3 == 1:  # the eager digest: the trie kept all along
            one.digest, batch.digest = MerkleDigest(), MerkleDigest()
        twin = None
        sealed_one: list[object] = []
        sealed_batch: list[object] = []
        for step in range(40):
            added, removed = _report(rng, pool, set(one.digest))
            if trial % 3 == 2 and step % 7 == 3 and batch.digest.is_flat:
                twin = batch.digest.twin()  # the flat set is shared now: copied on change
                one.digest.twin()
            for h in removed:
                one.block_removed(h)
            for h in added:
                one.block_added(h)
            batch.apply_changes(added, removed)
            assert _state(batch) == _state(one)
            if rng.random() < 0.3:
                sealed_one.append(one.seal())
                sealed_batch.append(batch.seal())
            if trial % 3 == 2 and step % 11 == 5:  # a pull's query builds the trie
                one.digest.children(0, 0, 2)
                batch.digest.children(0, 0, 2)
        assert sealed_batch == sealed_one
        if twin is not None:
            # The twin kept the set it was given: the batch never changed a shared set.
            assert twin.flat_summary() is not None
            twin.check_invariants()
        one.digest.check_invariants()
        batch.digest.check_invariants()


def test_change_tells_an_observer_each_change_in_order() -> None:
    rng = random.Random(3)
    for _ in range(30):
        pool = [rng.getrandbits(64) for _ in range(30)]
        log_one, log_batch = _Log(), _Log()
        one = MerkleDigest(log_one, lazy=True)
        batch = MerkleDigest(log_batch, lazy=True)
        for _ in range(20):
            added, removed = _report(rng, pool, set(one))
            real_gone = [h for h in removed if one.discard(h)]
            real_new = [h for h in added if one.add(h)]
            assert batch.change(added, removed) == (real_new, real_gone)
            assert log_batch.heard == log_one.heard
            assert (batch.root, len(batch), batch.flat_summary()) == (
                one.root, len(one), one.flat_summary()
            )


def test_change_on_a_flat_digest_returns_the_real_changes() -> None:
    rng = random.Random(8)
    for _ in range(30):
        pool = [rng.getrandbits(64) for _ in range(30)]
        one, batch = MerkleDigest(lazy=True), MerkleDigest(lazy=True)
        for _ in range(20):
            added, removed = _report(rng, pool, set(one))
            real_gone = [h for h in removed if one.discard(h)]
            real_new = [h for h in added if one.add(h)]
            assert batch.change(added, removed) == (real_new, real_gone)
            assert batch.flat_summary() == one.flat_summary() and batch.root == one.root
