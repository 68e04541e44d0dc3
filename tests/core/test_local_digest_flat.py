"""This node's digest (``LocalDigest``) starts flat: a set and its root summary, the trie built
only when a pull's subtree query asks for it (``MerkleDigest(lazy=True)``). Every answer must be
the one the eager digest (the trie kept element by element, as before) gives: the epochs'
deltas, roots and counts, membership and ``leading``, and the sync responses, before and after a
query builds the trie. The engine's adds and removals were a tenth of a 64-node simulation's
CPU when each walked the trie."""

from __future__ import annotations

import random

from peerinfer.core.digest import LocalDigest, MerkleDigest, summary_of
from peerinfer.core.merklehash import pack_fixed
from peerinfer.core.messages import SyncQuery, SyncRequest, decode, encode
from peerinfer.types import BlockHash


def _eager(epoch_base: int) -> LocalDigest:
    """A LocalDigest holding the eager digest it held before it started flat."""
    local = LocalDigest(epoch_base=epoch_base, max_log_changes=200)
    local.digest = MerkleDigest()
    return local


def _ask(local: LocalDigest, since: int, queries: tuple[SyncQuery, ...]) -> tuple[object, ...]:
    """The answer, every field as sent but the elements listed, which come as a sorted list:
    within one exchange they are sent in the trie's leaf order, which for a trie built from the
    set (a flat digest's, as for every lazy replica's) is not the order of the adds. The
    requester reads them as a set (``Replica._take_exchange``)."""
    request = decode(encode(SyncRequest(7, since, 1, queries)), SyncRequest)
    assert isinstance(request, SyncRequest)
    response = local.answer(request)
    a = response.answers
    data = a.elements
    listed = sorted(data[i : i + 8] for i in range(0, len(data), 8))
    header = (response.session, response.epoch, response.root, response.count, response.delta)
    return header, (a.answered, a.counts, a.bitmaps, a.hashes), listed


def _queries(rng: random.Random, theirs: MerkleDigest) -> tuple[SyncQuery, ...]:
    """A comparison of the root's 16 descendants against ``theirs``, and plain listings."""
    pairs, counts = theirs.children(0, 0, 4)
    summaries = pack_fixed(
        [summary_of(p, c, 1) for p, c in zip(pairs, counts, strict=True)],
        SyncQuery.SUMMARY_BITS,
    )
    level = rng.randrange(1, 6)
    return (
        SyncQuery(0, 0, 4, summaries),
        SyncQuery(level, rng.randrange(1 << level)),
        SyncQuery(4, rng.randrange(16)),
    )


def test_the_flat_local_digest_answers_as_the_eager_one() -> None:
    for seed in range(6):
        rng = random.Random(seed)
        pool = [BlockHash(rng.getrandbits(64)) for _ in range(400)]
        fast, eager = LocalDigest(epoch_base=3, max_log_changes=200), _eager(3)
        assert fast.digest.is_flat and not eager.digest.is_flat
        queried = False
        flat_ops = 0
        for step in range(1500):
            h = rng.choice(pool)
            if rng.random() < 0.55:
                fast.block_added(h)
                eager.block_added(h)
            else:
                fast.block_removed(h)
                eager.block_removed(h)
            if fast.digest.is_flat:
                flat_ops += 1
            else:
                assert queried, "the trie was built without a subtree query"
            if step % 37 == 0:
                assert fast.seal_epoch() == eager.seal_epoch()
            if step % 53 == 0:
                assert (fast.root, fast.count) == (eager.root, eager.count)
                chain = rng.sample(pool, 20)
                assert [c in fast.digest for c in chain] == [c in eager.digest for c in chain]
                assert fast.digest.leading(chain) == eager.digest.leading(chain)
                since = fast.epoch - rng.randrange(0, 12)
                assert fast.delta_since(since) == eager.delta_since(since)
            if step in (700, 1100) or (seed % 2 and step == 300):
                theirs = MerkleDigest()
                theirs.update(rng.sample(pool, 150))
                queries = _queries(rng, theirs)
                # since 1: beyond the log, so the queries are answered (subtree queries)
                assert _ask(fast, 1, queries) == _ask(eager, 1, queries)
                queried = True
                assert not fast.digest.is_flat  # the query built the trie; it stays
        assert flat_ops >= 300  # the flat form did the work before the first query
        assert fast.seal_epoch() == eager.seal_epoch()
        assert set(fast.digest) == set(eager.digest)
        fast.digest.check_invariants()


def test_a_node_core_starts_with_a_flat_digest() -> None:
    """What the node (and the simulator's nodes) hold: ``Announcing``'s ``LocalDigest``."""
    local = LocalDigest(epoch_base=100)
    assert local.digest.is_flat
    local.block_added(BlockHash(5))
    assert local.digest.is_flat and local.count == 1
