"""This node's digest takes a request's cache changes in one call (``LocalDigest.blocks_changed``,
``MerkleDigest.apply_changes``), its periodic announcements seal epochs without changes
without sorting anything (``LocalDigest.seal``), the engine's change log hears each block in one
call (``ChangeLog``), and a flat digest counts a chain's held blocks in C
(``MerkleDigest.leading``). Each must do exactly what the step-by-step path it replaced
does, in the same order: the reference here is that path (``block_removed`` then
``block_added`` per hash, the former ``seal``, the former loops), and the comparison includes
the order the flat set iterates in (the order of the operations on it shows there, and a trie
built from the set lists its leaves in that order)."""

from __future__ import annotations

import random

import pytest

from peerinfer.core.digest import LocalDigest, MerkleDigest
from peerinfer.core.messages import MAX_DELTA
from peerinfer.engine.changelog import ChangeLog
from peerinfer.types import BlockHash


def _one_by_one(local: LocalDigest, added: list[BlockHash], removed: list[BlockHash]) -> None:
    """What ``NodeCore`` did with a request's changes before ``blocks_changed``."""
    for h in removed:
        local.block_removed(h)
    for h in added:
        local.block_added(h)


def _old_seal(local: LocalDigest) -> tuple[object, ...]:
    """``LocalDigest.seal`` as it was before its path for epochs without changes."""
    added = tuple(sorted(local._pending_added))
    removed = tuple(sorted(local._pending_removed))
    local._pending_added = set()
    local._pending_removed = set()
    prev = local.epoch
    local.epoch += 1
    local._log.append((local.epoch, added, removed))
    local._log_changes += len(added) + len(removed)
    while local._log and local._log_changes > local.max_log_changes:
        epoch, a, r = local._log.popleft()
        local._log_changes -= len(a) + len(r)
        local._log_floor = epoch
    truncated = len(added) > MAX_DELTA or len(removed) > MAX_DELTA
    if truncated:
        added, removed = (), ()
    return prev, local.epoch, local.digest.root, len(local.digest), added, removed, truncated


def _state(local: LocalDigest) -> tuple[object, ...]:
    digest = local.digest
    return (
        local.root, local.count, local.epoch, list(digest), sorted(local._pending_added),
        sorted(local._pending_removed), [e for e in local._log if e[1] or e[2]],
        local._log_changes, local._log_floor,
        digest.is_flat, local.has_pending_changes(),
    )


def _batch(rng: random.Random, pool: list[BlockHash]) -> tuple[list[BlockHash], list[BlockHash]]:
    """Changes as an engine reports them, and worse: repeats, a hash in both lists, hashes
    removed that are absent and added that are present, empty batches."""
    added = [rng.choice(pool) for _ in range(rng.randrange(0, 25))]
    removed = [rng.choice(pool) for _ in range(rng.randrange(0, 25))]
    if added and rng.random() < 0.3:
        removed.append(rng.choice(added))
    return added, removed


def test_blocks_changed_equals_the_calls_one_by_one() -> None:
    for seed in range(8):
        rng = random.Random(seed)
        pool = [BlockHash(rng.getrandbits(64)) for _ in range(300)]
        fast = LocalDigest(epoch_base=5, max_log_changes=150)
        slow = LocalDigest(epoch_base=5, max_log_changes=150)
        if seed % 2:  # the eager trie, and (below) a lazy one built by a subtree query
            fast.digest, slow.digest = MerkleDigest(), MerkleDigest()
        for step in range(600):
            added, removed = _batch(rng, pool)
            fast.blocks_changed(added, removed)
            _one_by_one(slow, added, removed)
            assert _state(fast) == _state(slow)
            if step % 7 == 0:
                assert fast.seal() == slow.seal()
            if step % 5 == 0:  # periodic announcements: nothing changed since the last
                assert fast.seal() == slow.seal()
            if step == 300 and seed % 4 == 0:
                fast.digest.children(0, 0, 2)
                slow.digest.children(0, 0, 2)
                assert not fast.digest.is_flat
            assert fast.delta_since(fast.epoch - 3) == slow.delta_since(slow.epoch - 3)
        fast.digest.check_invariants()


def test_apply_changes_returns_the_real_changes_in_order() -> None:
    rng = random.Random(11)
    pool = [BlockHash(rng.getrandbits(64)) for _ in range(200)]
    for lazy in (True, False):
        fast, slow = MerkleDigest(lazy=lazy), MerkleDigest(lazy=lazy)
        for _ in range(400):
            added, removed = _batch(rng, pool)
            new, gone = fast.apply_changes(added, removed)
            want_gone = [h for h in removed if slow.discard(h)]
            want_new = [h for h in added if slow.add(h)]
            assert (new, gone) == (want_new, want_gone)
            assert (fast.root, len(fast), list(fast)) == (slow.root, len(slow), list(slow))
        fast.check_invariants()


def test_a_shared_flat_set_is_copied_before_apply_changes_changes_it() -> None:
    digest = MerkleDigest(lazy=True)
    digest.apply_changes([BlockHash(1), BlockHash(2)], [])
    twin = digest.twin()  # shares the set
    digest.apply_changes([BlockHash(3)], [BlockHash(1)])
    assert sorted(twin) == [1, 2] and sorted(digest) == [2, 3]
    twin.check_invariants()
    digest.check_invariants()


def test_seal_without_changes_equals_the_former_seal() -> None:
    rng = random.Random(3)
    pool = [BlockHash(rng.getrandbits(64)) for _ in range(100)]
    fast = LocalDigest(epoch_base=9, max_log_changes=40)
    slow = LocalDigest(epoch_base=9, max_log_changes=40)
    for step in range(500):
        if rng.random() < 0.4:
            added, removed = _batch(rng, pool)
            _one_by_one(fast, added, removed)
            _one_by_one(slow, added, removed)
        if step == 250:  # a log limit lowered meanwhile: the next seal trims, changes or not
            fast.max_log_changes = slow.max_log_changes = 5
        assert fast.seal() == _old_seal(slow)
        assert _state(fast) == _state(slow)
        since = fast.epoch - rng.randrange(0, 6)
        assert fast.delta_since(since) == slow.delta_since(since)



def test_an_empty_seal_after_the_log_limit_was_lowered_trims_as_before() -> None:
    fast = LocalDigest(epoch_base=1, max_log_changes=100)
    slow = LocalDigest(epoch_base=1, max_log_changes=100)
    for i in range(6):  # epochs with changes, each followed by two without
        for local in (fast, slow):
            local.blocks_changed([BlockHash(1000 + 10 * i + k) for k in range(5)], [])
        assert fast.seal() == _old_seal(slow)
        for _ in range(2):
            assert fast.seal() == _old_seal(slow)
    fast.max_log_changes = slow.max_log_changes = 12
    assert fast.seal() == _old_seal(slow)  # nothing changed: it trims all the same
    assert _state(fast) == _state(slow)
    for since in range(fast.epoch + 2):
        assert fast.delta_since(since) == slow.delta_since(since)

def test_the_change_log_hears_the_cache_as_its_own_steps_do() -> None:
    """``ChangeLog.block_added``/``block_removed`` (the cache's calls, ``_added``/``_removed``
    inlined) against those steps, with blocks on disk ("elsewhere") no change."""
    rng = random.Random(4)
    pool = [BlockHash(rng.getrandbits(64)) for _ in range(60)]
    fast, slow = ChangeLog(), ChangeLog()
    fast.elsewhere = slow.elsewhere = set(pool[:10])
    for step in range(2000):
        h = rng.choice(pool)
        if rng.random() < 0.5:
            fast.block_added(h)
            if h not in slow.elsewhere:
                slow._added(h)
        else:
            fast.block_removed(h)
            if h not in slow.elsewhere:
                slow._removed(h)
        assert (fast.added, fast.removed) == (slow.added, slow.removed)
        if step % 50 == 0:
            assert fast.take() == slow.take()


def _leading_block_by_block(digest: MerkleDigest, chain: list[object]) -> int:
    """``MerkleDigest.leading`` as it was: ``h in digest`` for each, up to the first that is not."""
    n = 0
    for h in chain:
        if h not in digest:
            break
        n += 1
    return n


@pytest.mark.pure_python
def test_leading_of_a_flat_digest_equals_the_walk_block_by_block() -> None:
    rng = random.Random(9)
    members = [BlockHash(rng.getrandbits(64)) for _ in range(60)]
    digest = MerkleDigest(lazy=True)
    digest.update(members[:50])
    assert digest.is_flat
    junk: list[object] = [1.0 * members[0], float(members[3]), True, -1, 1 << 70, [1], "x", None]
    digest.add(BlockHash(1))  # (True == 1.0 == 1: held, but no block hash but the int)
    for _ in range(500):
        chain: list[object] = list(rng.sample(members, rng.randrange(0, 60)))
        if rng.random() < 0.5:
            chain.sort(key=lambda h: h not in digest)  # a long held prefix
        if rng.random() < 0.4:
            chain.insert(rng.randrange(len(chain) + 1), rng.choice(junk))
        want = _leading_block_by_block(digest, chain)
        assert digest.leading(chain) == want  # type: ignore[arg-type]
        assert digest.leading(tuple(chain)) == want  # type: ignore[arg-type]
