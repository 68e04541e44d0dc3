"""The Merkle digest and this node's digest with its epochs, against naive models.

The model of a ``MerkleDigest`` is a plain set: every node summary must equal the XOR of the
contributions of the model's elements under that node, recomputed from scratch, whatever sequence
of adds and discards built the trie (and however its leaves split and collapsed). The model of a
``LocalDigest`` is a list of snapshots of the set at each sealed epoch: a delta since an epoch
must turn that snapshot into the live set.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from peerinfer.core import digest as digest_module
from peerinfer.core.digest import (
    LEAF_MAX,
    LEAF_MIN,
    DeltaMemo,
    LocalDigest,
    MerkleDigest,
    bitmap_indices,
    contribution,
    fingerprint_bits,
    fingerprint_count,
    mix,
    pack_bitmap,
    pack_fixed,
    packed_length,
    position_of_contribution,
    root_of,
    summary_of,
    under,
    unmix,
    unpack_elements,
    unpack_fixed,
)
from peerinfer.core.messages import MAX_DELTA, SyncQuery, SyncRequest, decode, encode
from peerinfer.errors import ProtocolError
from peerinfer.types import BlockHash

U64 = 2**64 - 1
hashes = st.integers(0, U64)
# Small pools make adds and discards collide, so leaves split and collapse back.
_POOL_RNG = random.Random(7)
POOL = [BlockHash(_POOL_RNG.getrandbits(64)) for _ in range(200)]
THOUSAND = [BlockHash(_POOL_RNG.getrandbits(64)) for _ in range(1000)]


def naive_summary(elements: set[int], level: int, prefix: int) -> tuple[int, int]:
    acc = 0
    count = 0
    for h in elements:
        s = mix(h)
        if under(s, level, prefix):
            acc ^= contribution(s)
            count += 1
    return acc, count


def naive_root(elements: set[int]) -> int:
    return root_of(*naive_summary(elements, 0, 0))


class Recorder:
    """A CacheObserver that keeps the set it was told about."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.calls = 0

    def block_added(self, h: BlockHash) -> None:
        assert h not in self.seen, "told of an add that is no change"
        self.seen.add(h)
        self.calls += 1

    def block_removed(self, h: BlockHash) -> None:
        assert h in self.seen, "told of a removal that is no change"
        self.seen.remove(h)
        self.calls += 1


# --------------------------------------------------------------------------------------------
# Mixing and packing.


@given(hashes)
def test_mix_is_a_bijection(h: int) -> None:
    assert 0 <= mix(h) <= U64
    assert unmix(mix(h)) == h
    assert mix(unmix(h)) == h


@given(hashes)
def test_a_position_is_recovered_from_its_contribution(s: int) -> None:
    assert position_of_contribution(contribution(s) & U64) == s


def test_zero_contributes_like_any_element() -> None:
    # mix(0) == 0 would make the element 0 invisible to every hash: the constant prevents it.
    assert mix(0) != 0
    assert contribution(mix(0)) & U64 != 0 and contribution(mix(0)) >> 64 != 0


@given(st.integers(1, 32), st.data())
def test_fixed_width_packing_round_trips(bits: int, data: st.DataObject) -> None:
    values = data.draw(st.lists(st.integers(0, 2**bits - 1), max_size=40))
    packed = pack_fixed(values, bits)
    assert len(packed) == packed_length(len(values), bits)
    assert unpack_fixed(packed, bits, len(values)) == values


@given(st.lists(st.integers(0, 99), unique=True), st.integers(1, 100))
def test_bitmaps_round_trip(indices: list[int], extra: int) -> None:
    n = max(indices, default=0) + extra
    packed = pack_bitmap(indices, n)
    assert len(packed) == packed_length(n, 1)
    assert bitmap_indices(packed) == sorted(indices)


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 4095, 4096, 4097, 100_000])
def test_the_fingerprint_count_is_recovered_from_the_length(n: int) -> None:
    assert fingerprint_count(packed_length(n, fingerprint_bits(n))) == n


def test_lengths_between_the_fingerprint_bands_are_refused() -> None:
    assert fingerprint_count(130) is None  # 65 16-bit fingerprints: must have been 24-bit
    assert fingerprint_count(3 * 4334) is None  # 4334 24-bit fingerprints: must have been 32-bit
    assert fingerprint_count(7) is None


# --------------------------------------------------------------------------------------------
# MerkleDigest against a set.


class DigestMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.recorder = Recorder()
        self.digest = MerkleDigest(self.recorder)
        self.model: set[int] = set()

    @rule(h=st.sampled_from(POOL) | hashes)
    def add(self, h: int) -> None:
        assert self.digest.add(BlockHash(h)) == (h not in self.model)
        self.model.add(h)

    @rule(h=st.sampled_from(POOL) | hashes)
    def discard(self, h: int) -> None:
        assert self.digest.discard(BlockHash(h)) == (h in self.model)
        self.model.discard(h)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def discard_present(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.model)))
        assert self.digest.discard(BlockHash(h))
        self.model.remove(h)

    @rule(many=st.lists(st.sampled_from(POOL), max_size=60))
    def add_many(self, many: list[int]) -> None:
        for h in many:
            self.digest.block_added(BlockHash(h))
        self.model.update(many)

    @rule(h=hashes)
    def contains(self, h: int) -> None:
        assert (h in self.digest) == (h in self.model)

    @rule(level=st.integers(0, 12), raw_prefix=hashes, span=st.integers(1, 5))
    def summaries_match_the_model(self, level: int, raw_prefix: int, span: int) -> None:
        # Aim at a node that holds something half the time.
        if self.model and raw_prefix % 2:
            raw_prefix = mix(sorted(self.model)[raw_prefix % len(self.model)])
        prefix = raw_prefix >> (64 - level) if level else 0
        assert self.digest.node_summary(level, prefix) == naive_summary(self.model, level, prefix)
        pairs, counts = self.digest.children(level, prefix, span)
        for i in range(1 << span):
            child = naive_summary(self.model, level + span, prefix << span | i)
            assert (pairs[i], counts[i]) == child
        under_node = {unmix(s) for s in self.digest.positions_under(level, prefix)}
        assert under_node == {h for h in self.model if under(mix(h), level, prefix)}

    @invariant()
    def agrees_with_the_model(self) -> None:
        self.digest.check_invariants()
        assert len(self.digest) == len(self.model)
        assert set(self.digest) == self.model
        assert self.digest.root == naive_root(self.model)
        assert self.recorder.seen == self.model


TestDigestMachine = DigestMachine.TestCase
TestDigestMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class BatchRecorder(Recorder):
    """A recorder that also takes whole deltas, checking each change is real."""

    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def blocks_changed(self, added: list[BlockHash], removed: list[BlockHash]) -> None:
        assert added or removed, "told of an empty batch"
        self.batches += 1
        for h in removed:
            self.block_removed(h)
        for h in added:
            self.block_added(h)


class LazyDigestMachine(DigestMachine):
    """The same rules on a lazy digest, which also flattens and takes deltas: it must give the
    same answers whether its trie is built or not."""

    def __init__(self) -> None:
        super().__init__()
        self.recorder = BatchRecorder()
        self.digest = MerkleDigest(self.recorder, lazy=True)
        assert self.digest.is_flat

    @rule()
    def flatten(self) -> None:
        self.digest.flatten()
        assert self.digest.is_flat

    @rule(added=st.lists(st.sampled_from(POOL) | hashes, max_size=20),
          removed=st.lists(st.sampled_from(POOL), max_size=20))
    def apply_delta(self, added: list[int], removed: list[int]) -> None:
        self.digest.apply_delta(added, removed)
        self.model.difference_update(removed)
        self.model.update(added)


TestLazyDigestMachine = LazyDigestMachine.TestCase
TestLazyDigestMachine.settings = TestDigestMachine.settings


def test_a_lazy_digest_builds_its_trie_only_for_subtree_queries() -> None:
    digest = MerkleDigest(lazy=True)
    digest.update(range(1, 200))
    eager = MerkleDigest()
    eager.update(range(1, 200))
    assert digest.root == eager.root and digest.is_flat  # the root needs no trie
    assert digest.node_summary(0, 0) == eager.node_summary(0, 0) and digest.is_flat
    assert digest.children(0, 0, 3) == eager.children(0, 0, 3)
    assert not digest.is_flat  # built by the subtree query ...
    digest.discard(BlockHash(5))
    eager.discard(BlockHash(5))
    digest.check_invariants()
    digest.flatten()  # ... and dropped again, the same set and root
    assert digest.is_flat and digest.root == eager.root and set(digest) == set(eager)
    digest.check_invariants()
    eager.flatten()  # an eager digest keeps its trie
    assert not eager.is_flat


class _Changes:
    """A batch observer recording what it was told."""

    def __init__(self) -> None:
        self.added: list[int] = []
        self.removed: list[int] = []

    def block_added(self, h: BlockHash) -> None:
        self.added.append(h)

    def block_removed(self, h: BlockHash) -> None:
        self.removed.append(h)

    def blocks_changed(self, added: list[BlockHash], removed: list[BlockHash]) -> None:
        self.added += added
        self.removed += removed


def test_shared_delta_results_are_the_unshared_sets_and_copied_before_any_change() -> None:
    """Given one memo, replicas holding the same set take one announcement's delta into one
    shared set (each observer still told of the changes); a change to one of them (a delta,
    an add, a pull's trie) leaves the others as they were."""
    rng = random.Random(3)
    base = [rng.getrandbits(64) for _ in range(300)]
    added = tuple(rng.getrandbits(64) for _ in range(40))
    removed = tuple(base[:25]) + (rng.getrandbits(64),)  # one that none holds
    plain = MerkleDigest(lazy=True)
    plain.update(base)
    plain.apply_delta(added, removed)
    observers = [_Changes() for _ in range(3)]
    memo = DeltaMemo()
    replicas = [MerkleDigest(o, lazy=True, memo=memo) for o in observers]
    for r in replicas:
        r.update(base)
    for o in observers:
        o.added.clear()
    for r in replicas:
        r.apply_delta(added, removed)
    flats = {id(r._flat) for r in replicas}
    assert len(flats) == 1  # one set for the three
    for r, o in zip(replicas, observers, strict=True):
        assert set(r) == set(plain) and r.root == plain.root
        assert sorted(o.added) == sorted(added) and sorted(o.removed) == sorted(base[:25])
        r.check_invariants()
    replicas[0].apply_delta((), (added[0],))  # another delta: its own new set
    replicas[1].add(BlockHash(7))  # copy on write
    replicas[2].children(0, 0, 3)  # builds its trie from the set, leaving the set alone
    replicas[2].discard(BlockHash(added[1]))
    assert memo.deltas and memo.roots  # the results were shared through the memo
    memo.clear()
    assert set(replicas[0]) == set(plain) - {added[0]}
    assert set(replicas[1]) == set(plain) | {7}
    assert set(replicas[2]) == set(plain) - {added[1]}
    for r in replicas:
        r.check_invariants()
    third = MerkleDigest(lazy=True)  # sharing off: no memo, in place as before
    third.update(base)
    third.apply_delta(added, removed)
    assert set(third) == set(plain) and not third._flat_shared


@given(st.lists(hashes, max_size=300), st.randoms(use_true_random=False))
@settings(max_examples=40, deadline=None)
def test_the_root_is_a_function_of_the_set_not_of_the_history(
    elements: list[int], rnd: random.Random
) -> None:
    forward = MerkleDigest()
    forward.update(elements)
    extras = [rnd.getrandbits(64) for _ in range(50)]
    shuffled = list(elements) + extras
    rnd.shuffle(shuffled)
    other = MerkleDigest()
    other.update(shuffled)
    for h in extras:
        if h not in set(elements):
            other.discard(BlockHash(h))
    other.check_invariants()
    assert other.root == forward.root
    assert other.node_summary(3, 5) == forward.node_summary(3, 5)


def test_leaves_split_and_collapse_with_hysteresis() -> None:
    digest = MerkleDigest()
    rng = random.Random(3)
    elements = [BlockHash(rng.getrandbits(64)) for _ in range(5000)]
    digest.update(elements)
    digest.check_invariants()
    stored = len(digest._inner) + len(digest._leaves)
    # About one stored node per LEAF_MIN..LEAF_MAX elements, not one per element.
    assert 5000 / LEAF_MAX <= stored <= 4 * 5000 / LEAF_MIN
    for h in elements[: 4990]:
        assert digest.discard(h)
    digest.check_invariants()
    assert len(digest) == 10
    for h in elements[4990:]:
        digest.discard(h)
    digest.check_invariants()
    assert (digest.root, len(digest), digest._inner, digest._leaves) == (0, 0, {}, {1: []})


def test_an_add_and_discard_at_the_split_boundary_does_not_thrash() -> None:
    digest = MerkleDigest()
    rng = random.Random(4)
    base = [BlockHash(rng.getrandbits(64)) for _ in range(LEAF_MAX)]
    digest.update(base)
    extra = BlockHash(rng.getrandbits(64))
    digest.add(extra)  # splits the root leaf
    assert digest._inner
    digest.discard(extra)
    assert digest._inner, "removing one element must not collapse straight back"
    digest.check_invariants()


def test_check_invariants_catches_a_corrupted_summary() -> None:
    digest = MerkleDigest()
    digest.update(POOL)
    key = next(iter(digest._inner))
    digest._inner[key] ^= 1
    with pytest.raises(AssertionError):
        digest.check_invariants()


def test_the_empty_digest() -> None:
    digest = MerkleDigest()
    assert (digest.root, len(digest), list(digest)) == (0, 0, [])
    assert 5 not in digest and "x" not in digest and -1 not in digest
    assert not digest.discard(BlockHash(5))
    digest.check_invariants()


@given(st.sets(hashes, min_size=1, max_size=40), hashes)
def test_one_difference_is_decoded_from_two_hashes(elements: set[int], extra: int) -> None:
    if extra in elements:
        return
    small, big = MerkleDigest(), MerkleDigest()
    small.update(elements)
    big.update(elements | {extra})
    x = (small.node_summary(0, 0)[0] ^ big.node_summary(0, 0)[0]) & U64
    assert unmix(position_of_contribution(x)) == extra


# --------------------------------------------------------------------------------------------
# LocalDigest: epochs, deltas and the change log.


def test_epochs_start_after_the_base_and_deltas_are_net() -> None:
    local = LocalDigest(epoch_base=1000)
    assert local.epoch == 1000 and not local.has_pending_changes()
    a, b, c = BlockHash(1), BlockHash(2), BlockHash(3)
    local.block_added(a)
    local.block_added(b)
    local.block_added(b)  # no change
    local.block_removed(c)  # no change
    assert local.has_pending_changes()
    delta = local.seal_epoch()
    assert (delta.prev_epoch, delta.epoch) == (1000, 1001)
    assert (set(delta.added), delta.removed, delta.truncated) == ({a, b}, (), False)
    assert (delta.root, delta.count) == (local.root, 2)
    local.block_removed(a)
    local.block_added(c)
    local.block_removed(c)  # added and removed within the epoch: no net change
    local.block_added(a)  # removed and re-added: no net change either
    local.block_removed(b)
    delta = local.seal_epoch()
    assert (delta.epoch, delta.added, delta.removed) == (1002, (), (b,))
    assert not local.has_pending_changes()
    assert local.seal_epoch().epoch == 1003  # an empty epoch still moves on


def test_a_delta_too_large_for_an_announcement_is_truncated() -> None:
    local = LocalDigest()
    for h in range(MAX_DELTA + 1):
        local.block_added(BlockHash(h))
    delta = local.seal_epoch()
    assert delta.truncated and delta.added == () and delta.removed == ()
    assert delta.count == MAX_DELTA + 1
    assert local.delta_since(0) is not None  # the log keeps it all the same


@given(
    st.lists(
        st.lists(st.tuples(st.booleans(), st.sampled_from(POOL[:30])), max_size=12), max_size=8
    ),
    st.integers(0, 40),
)
def test_delta_since_turns_any_logged_epoch_into_the_live_set(
    epochs: list[list[tuple[bool, int]]], max_log: int
) -> None:
    local = LocalDigest(epoch_base=10, max_log_changes=max_log)
    snapshots = {10: set[int]()}
    model: set[int] = set()
    for i, changes in enumerate(epochs):
        for add, h in changes:
            if add:
                local.block_added(BlockHash(h))
                model.add(h)
            else:
                local.block_removed(BlockHash(h))
                model.discard(h)
        if i < len(epochs) - 1:  # the last epoch stays pending: deltas include it
            snapshots[local.seal_epoch().epoch] = set(model)
    assert set(local.digest) == model
    for epoch, snapshot in snapshots.items():
        delta = local.delta_since(epoch)
        if delta is None:
            continue
        added, removed = delta
        assert set(added).isdisjoint(removed)
        assert (snapshot - set(removed)) | set(added) == model
        assert set(removed) <= snapshot and not set(added) & snapshot
    # The log reaches back at least as far as its budget allows.
    assert local.delta_since(local.epoch) is not None
    assert local.delta_since(local.epoch + 1) is None
    assert local.delta_since(9) is None


def test_the_log_forgets_old_epochs_beyond_its_budget() -> None:
    local = LocalDigest(max_log_changes=10)
    for i in range(5):
        for j in range(4):
            local.block_added(BlockHash(100 * i + j))
        local.seal_epoch()
    assert local.delta_since(5) == ([], [])
    assert local.delta_since(3) is not None  # epochs 4 and 5: 8 changes
    assert local.delta_since(2) is None  # would need epoch 3 as well: 12 > 10


# --------------------------------------------------------------------------------------------
# The responder: malformed queries and budgets.


def answer(local: LocalDigest, *queries: SyncQuery, since: int = 0) -> object:
    request = decode(encode(SyncRequest(1, since, 0, queries)), SyncRequest)
    assert isinstance(request, SyncRequest)
    return local.answer(request)


@pytest.mark.parametrize(
    "query",
    [
        SyncQuery(3, 8, 1, bytes(packed_length(2, SyncQuery.SUMMARY_BITS))),  # prefix too big
        SyncQuery(60, 0, 5, bytes(packed_length(32, SyncQuery.SUMMARY_BITS))),  # past 64 bits
        SyncQuery(0, 0, 17, b""),  # wider than MAX_SPAN
        SyncQuery(0, 0, 3, b"\x00"),  # summaries of the wrong length
        SyncQuery(0, 0, 0, b"\x00" * 7),  # fingerprints of no width
    ],
)
def test_a_malformed_query_is_refused(query: SyncQuery) -> None:
    local = LocalDigest()
    local.digest.update(POOL)
    with pytest.raises(ProtocolError):
        answer(local, query)


def test_a_delta_offer_beyond_the_log_is_answered_without_a_delta() -> None:
    local = LocalDigest(epoch_base=5, max_log_changes=2)
    for h in POOL[:3]:
        local.block_added(h)
    local.seal_epoch()  # three changes: more than the log keeps
    response = answer(local, since=5)
    assert not response.delta  # type: ignore[attr-defined]
    assert answer(local, since=6).delta  # type: ignore[attr-defined]
    local2 = LocalDigest()
    local2.block_added(POOL[0])
    local2.seal_epoch()
    local2.block_added(POOL[1])  # pending changes are part of the delta
    response = answer(local2, since=1)
    assert response.delta and unpack_elements(response.added) == [POOL[1]]  # type: ignore[attr-defined]


def test_the_responder_answers_a_prefix_within_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(digest_module, "LIST_CAP", 300)
    monkeypatch.setattr(digest_module, "RESPONSE_ELEMENT_BUDGET", 500)
    local = LocalDigest()
    local.digest.update(THOUSAND)
    # The root is too large to list (its count alone comes back); its eighths are listed until
    # the element budget runs out.
    queries = [SyncQuery(0, 0), *(SyncQuery(3, i) for i in range(8))]
    answers = answer(local, *queries).answers  # type: ignore[attr-defined]
    assert answers.counts[:2] == (1000, 0)
    eighths = [local.digest.node_summary(3, i)[1] for i in range(8)]
    fit = 0
    while sum(eighths[: fit + 1]) <= 500:
        fit += 1
    assert answers.answered == 1 + fit
    assert len(answers.elements) // 8 == sum(eighths[:fit])
    # However small the budget, the first query is answered.
    monkeypatch.setattr(digest_module, "RESPONSE_ELEMENT_BUDGET", 1)
    assert answer(local, *queries[1:]).answers.answered == 1  # type: ignore[attr-defined]


def test_a_comparison_marks_exactly_the_differing_descendants() -> None:
    local = LocalDigest()
    local.digest.update(POOL)
    mine = MerkleDigest()
    mine.update(POOL[:-3])
    pairs, counts = mine.children(0, 0, 4)
    summaries = pack_fixed(
        [summary_of(p, c, 0) for p, c in zip(pairs, counts, strict=True)], SyncQuery.SUMMARY_BITS
    )
    response = answer(local, SyncQuery(0, 0, 4, summaries))
    answers = response.answers  # type: ignore[attr-defined]
    expected = sorted({mix(h) >> 60 for h in POOL[-3:]})
    assert bitmap_indices(answers.bitmaps) == expected
    assert answers.counts[0] == len(POOL)


@pytest.mark.pure_python
def test_leading_counts_the_first_elements_of_a_chain_flat_or_not() -> None:
    """``leading(chain)`` is the count of ``h in digest`` up to the first miss, whether the
    digest is flat or holds its trie, and refuses what ``in`` refuses (floats, negatives)."""
    rng = random.Random(5)
    members = [BlockHash(rng.getrandbits(64)) for _ in range(50)]
    for lazy in (True, False):
        digest = MerkleDigest(lazy=lazy)
        digest.update(members[:30])
        for flat in (True, False):
            if not flat:
                digest.children(0, 0, 3)  # builds a lazy digest's trie
            assert digest.is_flat == (lazy and flat)
            for k in range(0, 50, 7):
                chain = members[k:] + [BlockHash(1)]
                expected = 0
                for h in chain:
                    if h not in digest:
                        break
                    expected += 1
                assert digest.leading(chain) == expected == max(0, 30 - k)
            assert digest.leading([float(members[0]), members[1]]) == 0  # type: ignore[list-item]
            assert digest.leading([-1, members[0]]) == 0
