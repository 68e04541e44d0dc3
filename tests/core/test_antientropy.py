"""Anti-entropy: replicas follow announcements, and pulls converge from any starting replica.

Every pull runs through the real wire codec (``reconcile_in_memory`` encodes and decodes each
message), and convergence means the replica holds exactly the responder's set, not merely an
equal root. The byte bound asserted on random pairs of sets is linear in the size of the
difference and independent of the size of the sets: a protocol that shipped the tree (8 bytes an
element, or anything proportional to N) fails it as soon as N is large and the difference small.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerinfer.core import antientropy, pullstate
from peerinfer.core.antientropy import (
    DEFAULT_MAX_ROUNDS,
    Reconciliation,
    Replica,
)
from peerinfer.core.digest import (
    LIST_CAP,
    LocalDigest,
    contribution,
    fingerprint,
    mix,
    pack_bitmap,
    pack_elements,
    pack_fixed,
    unmix,
)
from peerinfer.core.messages import (
    SyncNode,
    SyncQuery,
    SyncRequest,
    SyncResponse,
    decode,
    encode,
)
from peerinfer.core.pull_in_memory import reconcile_in_memory
from peerinfer.core.pullstate import PullPhase
from peerinfer.errors import ClosedError, ProtocolError
from peerinfer.types import BlockHash
from tests.sourcedoc import source_docstring

#: The stated bounds (see the module docstring of peerinfer.core.antientropy): every pull of a
#: random pair below converges within ROUND_BOUND round trips, exchanging at most
#: BYTES_BASE + BYTES_PER_DIFFERENCE * |difference| bytes in both directions.
ROUND_BOUND = 8
BYTES_BASE = 400
BYTES_PER_DIFFERENCE = 40


def random_hashes(rng: random.Random, n: int) -> list[BlockHash]:
    return [BlockHash(rng.getrandbits(64)) for _ in range(n)]


def local_with(elements: list[BlockHash], epoch_base: int = 0) -> LocalDigest:
    local = LocalDigest(epoch_base=epoch_base)
    for h in elements:
        local.block_added(h)
    return local


def replica_with(elements: list[BlockHash]) -> Replica:
    replica = Replica()
    replica.digest.update(elements)
    return replica


def assert_converged(replica: Replica, local: LocalDigest) -> None:
    assert set(replica.digest) == set(local.digest)
    replica.digest.check_invariants()
    assert (replica.root, replica.count) == (local.root, local.count)


# --------------------------------------------------------------------------------------------
# Convergence from any starting replica.

KINDS = ["identical", "empty replica", "empty responder", "subset", "superset", "disjoint", "mixed"]


@st.composite
def set_pairs(draw: st.DrawFn) -> tuple[list[BlockHash], list[BlockHash]]:
    """(responder's set, replica's set) of one of the shapes in KINDS."""
    kind = draw(st.sampled_from(KINDS))
    n = draw(st.sampled_from([0, 1, 2, 7, 40, 300, 2000]))
    rng = random.Random(draw(st.integers(0, 2**32)))
    base = random_hashes(rng, n)
    small = draw(st.sampled_from([0, 1, 2, 3, 10, 50]))
    extra = random_hashes(rng, small)
    if kind == "identical":
        return base, list(base)
    if kind == "empty replica":
        return base, []
    if kind == "empty responder":
        return [], base
    if kind == "subset":  # the replica missed some additions
        return base + extra, base
    if kind == "superset":  # the replica holds content the peer has since evicted
        return base, base + extra
    if kind == "disjoint":
        return base, random_hashes(rng, draw(st.sampled_from([1, 5, 300])))
    evicted = rng.sample(base, min(len(base), small))
    kept = [h for h in base if h not in set(evicted)]
    return kept + extra, base + random_hashes(rng, draw(st.sampled_from([0, 1, 4])))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(set_pairs(), st.integers(0, 3))
def test_a_pull_converges_exactly_within_the_stated_bounds(
    pair: tuple[list[BlockHash], list[BlockHash]], attempt: int
) -> None:
    theirs, ours = pair
    local = local_with(theirs)
    local.seal_epoch()
    replica = replica_with(ours)
    difference = len(set(theirs) ^ set(ours))
    stats = reconcile_in_memory(replica, local, attempt=attempt, session=7)
    assert stats.state == "converged"
    assert_converged(replica, local)
    assert replica.epoch == local.epoch
    assert 1 <= stats.rounds <= ROUND_BOUND
    assert stats.bytes_total <= BYTES_BASE + BYTES_PER_DIFFERENCE * difference


def test_the_byte_bound_is_far_below_the_tree() -> None:
    rng = random.Random(11)
    base = random_hashes(rng, 20_000)
    local = local_with(base[20:] + random_hashes(rng, 20))
    replica = replica_with(base)
    stats = reconcile_in_memory(replica, local)
    assert_converged(replica, local)
    tree = 8 * 20_000
    assert stats.bytes_total <= BYTES_BASE + BYTES_PER_DIFFERENCE * 40 < tree // 50
    assert stats.rounds <= 4


@pytest.mark.parametrize("changed", [10, 100])
def test_a_good_estimate_of_the_difference_saves_bytes(changed: int) -> None:
    rng = random.Random(changed)
    base = random_hashes(rng, 10_000)
    local = local_with(base[changed // 2 :] + random_hashes(rng, changed // 2))
    blind = reconcile_in_memory(replica_with(base), local)
    told = reconcile_in_memory(replica_with(base), local, estimated_difference=changed)
    assert blind.state == told.state == "converged"
    assert told.bytes_total <= 24 * changed + 200
    assert told.bytes_total <= blind.bytes_total * 1.1


def test_an_empty_replica_is_filled_by_one_listing() -> None:
    elements = random_hashes(random.Random(1), 5000)
    local = local_with(elements)
    replica = replica_with([])
    stats = reconcile_in_memory(replica, local)
    assert_converged(replica, local)
    assert stats.rounds == 1
    assert 8 * 5000 < stats.bytes_total < 8 * 5000 + 100


def test_a_set_too_large_for_one_answer_is_listed_in_parts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from peerinfer.core import digest

    monkeypatch.setattr(digest, "LIST_CAP", 64)
    monkeypatch.setattr(antientropy, "LIST_CAP", 64)
    monkeypatch.setattr(digest, "RESPONSE_ELEMENT_BUDGET", 300)
    elements = random_hashes(random.Random(2), 1000)
    local = local_with(elements)
    replica = replica_with([])
    stats = reconcile_in_memory(replica, local)
    assert stats.state == "converged"
    assert_converged(replica, local)
    assert stats.rounds >= 1000 // 300


# --------------------------------------------------------------------------------------------
# Announcements and the delta path.


def announce(replica: Replica, local: LocalDigest) -> bool:
    d = local.seal_epoch()
    return replica.apply_announce(
        d.prev_epoch, d.epoch, d.root, d.count, d.added, d.removed, d.truncated
    )


def churn(local: LocalDigest, rng: random.Random, evict: int, add: int) -> None:
    for h in rng.sample(sorted(local.digest), min(evict, local.count)):
        local.block_removed(h)
    for h in random_hashes(rng, add):
        local.block_added(h)


def test_a_replica_follows_announcements_without_pulling() -> None:
    rng = random.Random(5)
    local = local_with(random_hashes(rng, 100), epoch_base=1_000)
    replica = Replica()
    assert announce(replica, local)  # the first announcement: the replica never matched
    stats = reconcile_in_memory(replica, local)
    assert stats.state == "converged" and replica.epoch == 1_001
    for _ in range(20):
        churn(local, rng, evict=rng.randint(0, 10), add=rng.randint(0, 10))
        assert not announce(replica, local)
        assert replica.epoch == local.epoch
        assert_converged(replica, local)


def test_a_missed_epoch_is_repaired_by_a_delta_in_one_round_trip() -> None:
    rng = random.Random(6)
    local = local_with(random_hashes(rng, 2000), epoch_base=50)
    replica = Replica()
    announce(replica, local)
    reconcile_in_memory(replica, local)
    for _ in range(3):  # three announcements lost
        churn(local, rng, evict=20, add=20)
        local.seal_epoch()
    churn(local, rng, evict=5, add=5)
    assert announce(replica, local)  # prev_epoch is not the replica's: a pull is needed
    churn(local, rng, evict=1, add=1)  # and the responder moved on meanwhile
    stats = reconcile_in_memory(replica, local)
    assert stats.state == "converged" and stats.rounds == 1
    assert_converged(replica, local)
    assert stats.bytes_total <= 8 * (3 * 40 + 10 + 2) + 100


def test_a_truncated_change_log_falls_back_to_merkle_and_converges() -> None:
    rng = random.Random(7)
    local = LocalDigest(epoch_base=0, max_log_changes=30)
    for h in random_hashes(rng, 3000):
        local.block_added(h)
    replica = Replica()
    announce(replica, local)
    reconcile_in_memory(replica, local)
    for _ in range(4):
        churn(local, rng, evict=10, add=10)  # 80 changes: beyond the log's 30
        local.seal_epoch()
    assert local.delta_since(replica.epoch) is None
    stats = reconcile_in_memory(replica, local)
    assert stats.state == "converged"
    assert_converged(replica, local)
    assert stats.rounds >= 2  # the delta offer, then the Merkle descent
    assert stats.bytes_total <= BYTES_BASE + BYTES_PER_DIFFERENCE * 80


def test_a_truncated_announcement_needs_a_pull() -> None:
    rng = random.Random(8)
    local = local_with(random_hashes(rng, 100))
    replica = Replica()
    announce(replica, local)
    reconcile_in_memory(replica, local)
    churn(local, rng, evict=3, add=3)
    d = local.seal_epoch()
    assert replica.apply_announce(d.prev_epoch, d.epoch, d.root, d.count, (), (), True)
    assert replica.epoch == d.prev_epoch
    reconcile_in_memory(replica, local)
    assert_converged(replica, local)


def test_a_stale_or_replayed_announcement_is_ignored() -> None:
    rng = random.Random(9)
    local = local_with(random_hashes(rng, 50))
    replica = Replica()
    first = local.seal_epoch()
    args = (first.prev_epoch, first.epoch, first.root, first.count, first.added, first.removed)
    assert not replica.apply_announce(*args, first.truncated)
    churn(local, rng, evict=5, add=5)
    assert not announce(replica, local)
    before = set(replica.digest)
    assert not replica.apply_announce(*args, first.truncated)  # a replay of epoch 1
    assert set(replica.digest) == before and replica.epoch == local.epoch


def test_a_claim_larger_than_the_cap_is_refused_without_a_pull() -> None:
    rng = random.Random(11)
    local = local_with(random_hashes(rng, 40))
    replica = Replica(max_elements=50)
    assert not announce(replica, local)  # 40 elements: within the cap, followed
    before, epoch = set(replica.digest), replica.epoch
    for h in random_hashes(rng, 20):  # 60 > 50: refused, no pull, nothing applied
        local.block_added(h)
    delta = local.seal_epoch()
    assert delta.count == 60 and delta.added
    refused = replica.apply_announce(
        delta.prev_epoch, delta.epoch, delta.root, delta.count, delta.added, delta.removed,
        delta.truncated,
    )
    assert refused is False and replica.refused == 1
    assert set(replica.digest) == before and replica.epoch == epoch
    with pytest.raises(ValueError):
        Replica(max_elements=-1)


def test_an_announcement_that_does_not_verify_asks_for_a_pull() -> None:
    rng = random.Random(10)
    local = local_with(random_hashes(rng, 100))
    replica = Replica()
    announce(replica, local)
    replica.digest.add(BlockHash(12345))  # the replica went wrong somehow
    churn(local, rng, evict=2, add=2)
    assert announce(replica, local)  # the delta applies, but the root does not match
    reconcile_in_memory(replica, local)
    assert_converged(replica, local)


def test_steady_state_cost_is_peers_times_changes() -> None:
    """Every peer follows every other by announcements alone: the bytes per interval are the
    deltas (about 8 per change per receiver), whatever the size of the caches."""
    rng = random.Random(12)
    peers = 5
    locals_ = [local_with(random_hashes(rng, 3000), epoch_base=100) for _ in range(peers)]
    replicas = {(i, j): Replica() for i in range(peers) for j in range(peers) if i != j}
    deltas = [p.seal_epoch() for p in locals_]
    for (_, j), replica in replicas.items():
        d = deltas[j]
        replica.apply_announce(d.prev_epoch, d.epoch, d.root, d.count, d.added, d.removed, d.truncated)
        if not replica.matches(d.root, d.count):
            reconcile_in_memory(replica, locals_[j])
    changes = 12
    for _ in range(3):
        traffic = 0
        for p in locals_:
            churn(p, rng, evict=changes // 2, add=changes // 2)
        deltas = [p.seal_epoch() for p in locals_]
        for (_, j), replica in replicas.items():
            d = deltas[j]
            traffic += 8 * (len(d.added) + len(d.removed))
            pull = replica.apply_announce(
                d.prev_epoch, d.epoch, d.root, d.count, d.added, d.removed, d.truncated
            )
            assert not pull
            assert replica.matches(locals_[j].root, locals_[j].count)
        assert traffic == 8 * changes * peers * (peers - 1)


# --------------------------------------------------------------------------------------------
# A responder that changes mid-pull, and retries.


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 6), st.integers(0, 30))
def test_a_responder_changing_mid_pull_is_followed_or_the_pull_fails(
    seed: int, until: int, churn_size: int
) -> None:
    rng = random.Random(seed)
    base = random_hashes(rng, 1500)
    local = local_with(base)
    replica = replica_with(base[100:] + random_hashes(rng, 60))
    answered: list[set[int]] = []  # the responder's set as each answer saw it

    def change(round_number: int) -> None:
        answered.append(set(local.digest))
        if round_number <= until:
            churn(local, rng, evict=churn_size, add=churn_size)

    stats = reconcile_in_memory(replica, local, between_rounds=change)
    assert stats.rounds <= DEFAULT_MAX_ROUNDS
    assert stats.state in ("converged", "failed")
    if stats.state == "converged":  # to the newest state it was told of
        assert set(replica.digest) == answered[-1]
    stats = reconcile_in_memory(replica, local, attempt=1)  # the next pull catches up
    assert stats.state == "converged"
    assert_converged(replica, local)


def test_a_responder_that_changed_once_early_is_caught_up_with() -> None:
    rng = random.Random(18)
    base = random_hashes(rng, 3000)
    local = local_with(base)
    replica = replica_with(base[30:])

    def change(round_number: int) -> None:
        if round_number == 1:
            churn(local, rng, evict=20, add=20)

    stats = reconcile_in_memory(replica, local, between_rounds=change)
    assert stats.state == "converged"
    assert_converged(replica, local)


def test_a_pull_towards_a_stale_target_converges_to_the_current_set() -> None:
    rng = random.Random(13)
    base = random_hashes(rng, 500)
    local = local_with(base)
    old = local.seal_epoch()
    churn(local, rng, evict=30, add=30)
    replica = replica_with(base[50:])
    pull = replica.start_pull(3, old.epoch, old.root, target_count=old.count)
    request: SyncRequest | None = pull.first_request()
    while request is not None:
        request = pull.handle_response(local.answer(request))
    assert pull.state == "converged"
    assert_converged(replica, local)


def test_each_attempt_and_pass_compares_other_slices() -> None:
    rng = random.Random(14)
    base = random_hashes(rng, 2000)
    local = local_with(base)
    firsts = []
    for attempt in range(3):
        replica = replica_with(base[10:])
        pull = replica.start_pull(1, local.epoch, local.root, attempt, target_count=local.count)
        firsts.append(pull.first_request())
    assert len({r.slice for r in firsts}) == 3
    assert len({r.queries[0].summaries for r in firsts}) == 3


def test_the_replica_observer_sees_every_change() -> None:
    class Model:
        def __init__(self) -> None:
            self.held: set[int] = set()

        def block_added(self, h: BlockHash) -> None:
            self.held.add(h)

        def block_removed(self, h: BlockHash) -> None:
            self.held.remove(h)

    rng = random.Random(15)
    base = random_hashes(rng, 800)
    model = Model()
    replica = Replica(observer=model)
    replica.digest.update(base[:700] + random_hashes(rng, 40))
    local = local_with(base[20:])
    reconcile_in_memory(replica, local)
    assert model.held == set(replica.digest) == set(local.digest)


# --------------------------------------------------------------------------------------------
# Forged and hostile responses.


def started(replica: Replica, request: SyncRequest) -> Reconciliation:
    """A pull whose outstanding request is ``request`` (to forge answers to known queries)."""
    pull = replica.start_pull(request.session, 1, 1, target_count=1)
    pull.first_request()
    pull._sent = request  # white box: the forged answers below are to these queries
    return pull


NO_ANSWERS = SyncNode()


def response(answers: SyncNode = NO_ANSWERS, **fields: object) -> SyncResponse:
    base: dict[str, object] = {"session": 1, "epoch": 1, "root": 1, "count": 1, "answers": answers}
    base.update(fields)
    return SyncResponse(**base)  # type: ignore[arg-type]


def position_under(level: int, prefix: int, rng: random.Random) -> int:
    """An element whose position lies under node (level, prefix)."""
    s = prefix << (64 - level) | rng.getrandbits(64 - level)
    return unmix(s)


RNG = random.Random(16)
FOUR = [BlockHash(RNG.getrandbits(64)) for _ in range(4)]
OUTSIDE = next(h for h in (RNG.getrandbits(64) for _ in range(100)) if mix(h) >> 60 != 3)
INSIDE = [position_under(4, 3, RNG) for _ in range(3)]
LISTING = SyncRequest(1, 0, 0, (SyncQuery(4, 3),))
# Two descendants whose count residues are 0 and 1 (their slices are whatever the forger says).
COMPARE = SyncRequest(
    1, 0, 0, (SyncQuery(0, 0, 1, pack_fixed([0x3FC, 0x3FD], SyncQuery.SUMMARY_BITS)),)
)
OFFER = SyncRequest(1, 9, 0, ())


def fingerprint_request(replica: Replica) -> SyncRequest:
    own = replica.digest.positions_under(0, 0)
    fps = b"".join(fingerprint(p, 0, 16).to_bytes(2, "big") for p in own)
    return SyncRequest(1, 0, 0, (SyncQuery(0, 0, 0, fps),))


FORGERIES: dict[str, tuple[SyncRequest, SyncResponse]] = {
    "wrong session": (LISTING, response(SyncNode(1, (0, 0)), session=2)),
    "answers more queries than asked": (LISTING, response(SyncNode(2, (0, 0, 0, 0)))),
    "answers none": (LISTING, response(SyncNode(0))),
    "too few counts": (LISTING, response(SyncNode(1, (1,)))),
    "trailing counts": (LISTING, response(SyncNode(1, (0, 0, 0)))),
    "listing short of its count": (
        LISTING, response(SyncNode(1, (3, 2), elements=pack_elements(INSIDE[:2])))
    ),
    "listing repeats an element": (
        LISTING, response(SyncNode(1, (2, 2), elements=pack_elements([INSIDE[0]] * 2)))
    ),
    "listed element outside the node": (
        LISTING, response(SyncNode(1, (1, 1), elements=pack_elements([OUTSIDE])))
    ),
    "small listing refused as too large": (LISTING, response(SyncNode(1, (5, 0)))),
    "listing with a bitmap": (LISTING, response(SyncNode(1, (0, 0), bitmaps=b"\x00"))),
    "exchange claims too many elements": (LISTING, response(SyncNode(1, (LIST_CAP + 1, LIST_CAP + 1)))),
    "bitmap too short": (COMPARE, response(SyncNode(1, (4,)))),
    "bitmap marks past its end": (COMPARE, response(SyncNode(1, (4,), bitmaps=b"\x20"))),
    "trailing bitmap bytes": (COMPARE, response(SyncNode(1, (4,), bitmaps=b"\x00\x00"))),
    "counts of descendants exceed the node's": (
        COMPARE, response(SyncNode(1, (4, 3, 3), bitmaps=pack_bitmap([0, 1], 2)))
    ),
    # Descendant 0: residue 0, so a count of 1 means one more (+1): an 8-byte hash is due.
    "missing hash": (COMPARE, response(SyncNode(1, (4, 1), bitmaps=pack_bitmap([0], 2)))),
    "trailing hash bytes": (
        COMPARE, response(SyncNode(1, (4, 2), bitmaps=pack_bitmap([0], 2), hashes=b"\x01" * 8))
    ),
    # Descendant 1: residue 1, so a count of 0 means one fewer (-1): a 4-byte hash is due.
    "empty node with a hash": (
        COMPARE, response(SyncNode(1, (0, 0), bitmaps=pack_bitmap([1], 2), hashes=b"\x01" * 4))
    ),
    "one-element node whose hash lies elsewhere": (
        COMPARE,
        response(
            SyncNode(
                1, (1, 1), bitmaps=pack_bitmap([0], 2),
                hashes=(contribution(mix(OUTSIDE) | 1 << 63) & (2**64 - 1)).to_bytes(8, "big"),
            )
        ),
    ),
    "delta that was not offered": (LISTING, response(delta=True)),
    "delta of a partial hash": (OFFER, response(delta=True, added=b"\x00" * 9)),
    "delta with answers": (OFFER, response(SyncNode(1, (0, 0)), delta=True)),
    "elements outside a delta": (LISTING, response(SyncNode(1, (0, 0)), added=b"\x00" * 8)),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_a_forged_response_is_a_protocol_error_and_ends_the_pull(name: str) -> None:
    request, forged = FORGERIES[name]
    # Through the codec first: every forgery is a well-formed frame, refused by the protocol.
    forged = decode(encode(forged), SyncResponse)  # type: ignore[assignment]
    replica = replica_with([])
    pull = started(replica, request)
    with pytest.raises(ProtocolError):
        pull.handle_response(forged)
    assert pull.state == "failed"
    with pytest.raises(ClosedError):
        pull.handle_response(forged)


def test_an_exchange_that_sends_an_element_we_hold_is_refused() -> None:
    replica = replica_with(FOUR)
    request = fingerprint_request(replica)
    forged = response(
        SyncNode(1, (5, 1), bitmaps=b"\x00", elements=pack_elements([FOUR[0]]))
    )
    with pytest.raises(ProtocolError):
        started(replica, request).handle_response(forged)


def test_the_forgeries_are_near_misses_of_valid_answers() -> None:
    """The same shapes, correctly filled in, are accepted: the refusals above are specific."""
    replica = replica_with([])
    listing = response(SyncNode(1, (3, 3), elements=pack_elements(INSIDE)))
    started(replica, LISTING).handle_response(listing)
    assert set(replica.digest) == set(INSIDE)
    replica = replica_with(FOUR)
    exchange = response(SyncNode(1, (4, 0), bitmaps=b"\x00"))
    started(replica, fingerprint_request(replica)).handle_response(exchange)
    assert set(replica.digest) == set(FOUR)


def hostile_answer(request: SyncRequest) -> SyncResponse:
    """Well-formed answers that claim ever more: huge nodes, every descendant different."""
    counts: list[int] = []
    bitmaps: list[bytes] = []
    for q in request.queries:
        if q.span == 0:
            counts += [2**60, 0]
            n_fps = len(q.summaries) // 2 if len(q.summaries) <= 128 else 0
            bitmaps.append(bytes((n_fps + 7) // 8))
        else:
            n = 1 << q.span
            counts += [2**62] + [2**50] * n
            bitmaps.append(b"\xff" * ((n + 7) // 8))
    answers = SyncNode(len(request.queries), tuple(counts), b"".join(bitmaps))
    return SyncResponse(request.session, 5, 12345, 2**62, answers)


@pytest.mark.parametrize("start", [[], FOUR])
def test_a_hostile_responder_cannot_make_a_pull_grow_without_bound(start: list[BlockHash]) -> None:
    replica = replica_with(start)
    pull = replica.start_pull(1, 5, 12345, max_rounds=DEFAULT_MAX_ROUNDS)
    request: SyncRequest | None = pull.first_request()
    biggest = 0
    try:
        while request is not None:
            biggest = max(biggest, len(encode(request)))
            request = pull.handle_response(hostile_answer(request))
    except ProtocolError:
        pass
    assert pull.state == "failed"
    assert pull.rounds <= DEFAULT_MAX_ROUNDS
    assert len(pull._pending) <= antientropy.MAX_PENDING
    assert biggest <= 8 * 1024 * 1024
    assert len(replica.digest) <= len(start)  # nothing was ever sent, so nothing was added


def test_a_finished_or_unstarted_pull_refuses_events() -> None:
    local = local_with(FOUR)
    replica = Replica()
    pull = replica.start_pull(1, local.epoch, local.root)
    with pytest.raises(ClosedError):
        pull.handle_response(local.answer(SyncRequest(1, 0, 0)))
    request = pull.first_request()
    with pytest.raises(ClosedError):
        pull.first_request()
    assert pull.handle_response(local.answer(request)) is None
    assert pull.state == "converged"
    with pytest.raises(ClosedError):
        pull.handle_response(local.answer(request))


def test_the_state_table_in_code_is_the_one_in_the_docstring() -> None:
    """Each row of the docstring's table (phase, event, next phase) is allowed by
    ``pullstate.TRANSITIONS``, and each transition the code allows has a row."""
    lines = source_docstring(antientropy).splitlines()  # (a compiled module keeps none)
    column = next(line.index("next phase") for line in lines if "next phase" in line)
    rows = set()
    for line in lines:
        words = line.split()
        if len(words) >= 3 and words[0] in {p.value for p in PullPhase}:
            event = "first_request()" if words[1] == "first_request()" else "handle_response()"
            rows.add((words[0], event, line[column:].split()[0]))
    in_code = {
        (phase.value, event.value, to.value)
        for (phase, event), targets in pullstate.TRANSITIONS.items()
        for to in targets
    }
    assert rows == in_code


def test_a_pull_walks_its_phases() -> None:
    local = local_with(FOUR)
    pull = Replica().start_pull(1, local.epoch, local.root)
    assert (pull.phase, pull.state) == (PullPhase.READY, "pulling")
    request = pull.first_request()
    assert (pull.phase, pull.state) == (PullPhase.AWAITING, "pulling")
    assert pull.handle_response(local.answer(request)) is None
    assert (pull.phase, pull.state) == (PullPhase.CONVERGED, "converged")


def test_rounds_are_capped() -> None:
    rng = random.Random(17)
    base = random_hashes(rng, 3000)
    local = local_with(base)
    replica = replica_with(base[300:])
    replica_digest_before = len(replica.digest)
    stats = reconcile_in_memory(replica, local, max_rounds=1, estimated_difference=1)
    assert stats.rounds == 1
    assert stats.state in ("converged", "failed")
    assert len(replica.digest) >= replica_digest_before  # what it learnt, it kept

