"""PeerIndex: one walk over a chain agrees with asking every peer's replica in turn."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from peerinfer.core.digest import MerkleDigest
from peerinfer.core.index import PeerIndex
from peerinfer.core.messages import Load
from peerinfer.errors import ConfigError
from peerinfer.types import BlockHash, PeerId


def make_index(**kwargs: Any) -> PeerIndex:
    return PeerIndex(**kwargs)


def digest_of(index: PeerIndex, peer: PeerId) -> MerkleDigest:
    replica = index.replica(peer)
    assert replica is not None
    return replica.digest


def H(*xs: int) -> list[BlockHash]:
    return [BlockHash(x) for x in xs]


P = [PeerId(f"peer-{i}") for i in range(12)]

# ------------------------------------------------------------------------ examples


def test_match_counts_leading_blocks_per_peer() -> None:
    index = make_index()
    for peer, held in [(P[0], H(1, 2, 3)), (P[1], H(1, 2)), (P[2], H(2, 3)), (P[3], H())]:
        index.add_peer(peer)
        for h in held:
            digest_of(index, peer).add(h)
    assert index.match_blocks(H(1, 2, 3, 4)) == {P[0]: 3, P[1]: 2}
    assert index.match_blocks(H(1, 2, 3)) == {P[0]: 3, P[1]: 2}
    assert index.match_blocks(H(2, 3)) == {P[2]: 2, P[0]: 2, P[1]: 1}
    assert index.match_blocks(H(9, 1)) == {}
    assert index.match_blocks([]) == {}
    index.check_invariants()


def test_add_peer_is_idempotent_and_returns_the_same_replica() -> None:
    index = make_index()
    first = index.add_peer(P[0])
    assert index.add_peer(P[0]) is first
    assert index.peers() == [P[0]] and P[0] in index and P[1] not in index
    assert index.replica(P[1]) is None


def test_removed_peer_slot_is_reused_without_stale_bits() -> None:
    index = make_index()
    index.add_peer(P[0])
    index.add_peer(P[1])
    digest_of(index, P[0]).add(BlockHash(7))
    index.add_speculative(P[0], H(7, 8), now=0.0)
    old_replica = digest_of(index, P[0])
    index.remove_peer(P[0])
    index.check_invariants()
    assert index.match_blocks(H(7, 8)) == {}
    # The anti-entropy code may still hold the old replica: changes to it must go nowhere.
    old_replica.add(BlockHash(9))
    index.add_peer(P[2])  # takes P[0]'s freed slot
    index.check_invariants()
    assert index.match_blocks(H(7, 8)) == {}
    assert index.match_blocks(H(9)) == {}
    digest_of(index, P[2]).add(BlockHash(7))
    assert index.match_blocks(H(7, 8)) == {P[2]: 1}
    assert index.speculative_holders(BlockHash(8)) == []


def test_full_index_drops_the_least_recently_fresh_peer() -> None:
    index = make_index(max_peers=3)
    for i in range(3):
        index.add_peer(P[i])
    index.mark_fresh(P[0], now=5.0)
    index.mark_fresh(P[1], now=1.0)
    index.mark_fresh(P[2], now=3.0)
    index.add_peer(P[3])
    assert sorted(index.peers()) == sorted([P[0], P[2], P[3]])
    index.add_peer(P[4])  # P[3] was never fresh: it goes first
    assert sorted(index.peers()) == sorted([P[0], P[2], P[4]])
    index.check_invariants()


def test_freshness_and_load_bookkeeping() -> None:
    index = make_index()
    index.add_peer(P[0])
    assert index.digest_age(P[0], now=10.0) == math.inf
    assert index.digest_age(P[5], now=10.0) == math.inf
    index.mark_fresh(P[0], now=4.0)
    assert index.digest_age(P[0], now=10.0) == 6.0
    index.mark_fresh(P[0], now=2.0)  # an older confirmation does not make it staler
    assert index.digest_age(P[0], now=10.0) == 6.0
    assert index.load(P[0]) == Load()
    index.set_load(P[0], Load(queued=3, running=1, slots=2), now=4.0)
    assert index.load(P[0]) == Load(queued=3, running=1, slots=2)
    index.set_load(P[5], Load(queued=9), now=4.0)  # unknown: ignored
    assert P[5] not in index and index.load(P[5]) == Load()


def test_an_announcement_sets_the_load_and_freshness_only_when_the_replica_matched() -> None:
    index = make_index(confirm_grace_s=1.0)
    index.add_peer(P[0])
    index.add_speculative(P[0], H(1, 2, 3), now=0.0)
    index.announced(P[0], Load(queued=2), now=3.0, fresh=False)  # the replica lags: pull
    assert index.load(P[0]) == Load(queued=2) and index.load_age(P[0], now=4.0) == 1.0
    assert index.digest_age(P[0], now=4.0) == math.inf
    assert index.match_blocks(H(1, 2, 3)) == {P[0]: 3}  # not confirmed yet
    index.announced(P[0], Load(running=1), now=5.0, fresh=True)
    assert index.load(P[0]) == Load(running=1) and index.digest_age(P[0], now=6.0) == 1.0
    assert index.match_blocks(H(1, 2, 3)) == {}  # the speculative entry was confirmed away
    index.announced(P[5], Load(queued=9), now=5.0, fresh=True)  # unknown: ignored
    assert P[5] not in index
    index.check_invariants()


def test_speculative_entries_confirm_and_expire() -> None:
    index = make_index(speculative_ttl_s=10.0, confirm_grace_s=1.0)
    index.add_peer(P[0])
    index.add_speculative(P[0], H(1, 2, 3), now=0.0)
    index.add_speculative(P[0], H(1, 2), now=5.0)
    assert index.match_blocks(H(1, 2, 3)) == {P[0]: 3}
    index.confirm(P[0], now=5.5)  # drops the entry from t=0, keeps the one within the grace
    assert index.match_blocks(H(1, 2, 3)) == {P[0]: 2}
    index.check_invariants()
    index.expire(now=15.0)
    assert index.match_blocks(H(1, 2, 3)) == {}
    assert index.speculative_blocks() == 0
    index.add_speculative(P[7], H(1), now=16.0)  # unknown peer: ignored
    assert index.match_blocks(H(1)) == {}
    index.check_invariants()


def test_speculative_budget_drops_the_oldest_entries() -> None:
    index = make_index(max_speculative_blocks=5)
    index.add_peer(P[0])
    index.add_peer(P[1])
    index.add_speculative(P[0], H(1, 2, 3), now=0.0)
    index.add_speculative(P[1], H(1, 2), now=1.0)
    assert index.match_blocks(H(1, 2, 3)) == {P[0]: 3, P[1]: 2}
    index.add_speculative(P[1], H(4), now=2.0)
    assert index.match_blocks(H(1, 2, 3)) == {P[1]: 2}
    index.add_speculative(P[0], H(10, 11, 12, 13, 14, 15, 16), now=3.0)  # longer than the budget
    assert index.match_blocks(H(10, 11, 12, 13, 14, 15, 16)) == {P[0]: 5}
    assert index.speculative_blocks() == 5
    index.check_invariants()


def test_replica_over_the_cap_is_underestimated_then_rescanned() -> None:
    index = make_index(max_replica_blocks=4)
    index.add_peer(P[0])
    digest = digest_of(index, P[0])
    for h in range(1, 7):
        digest.add(BlockHash(h))
    assert index.overflowed(P[0])
    assert index.memory_entries() == 4
    assert index.match_blocks(H(1, 2, 3, 4, 5, 6)) == {P[0]: 4}
    index.check_invariants()
    for h in (1, 2, 3):  # down to 3 elements: the rescan indexes 5 and 6 again
        digest.discard(BlockHash(h))
    assert not index.overflowed(P[0])
    assert index.match_blocks(H(4, 5, 6)) == {P[0]: 3}
    index.check_invariants()


def test_memory_stays_bounded_with_many_peers_and_prefixes() -> None:
    index = make_index(max_peers=8, max_replica_blocks=50, max_speculative_blocks=100)
    for i in range(40):
        peer = PeerId(f"churn-{i}")
        index.add_peer(peer)
        index.mark_fresh(peer, now=float(i))
        digest = digest_of(index, peer)
        for j in range(80):
            digest.add(BlockHash(i * 1000 + j))
        index.add_speculative(peer, H(*range(i * 1000, i * 1000 + 30)), now=float(i))
        assert len(index) <= 8
        assert index.memory_entries() <= 8 * 50 + 2 * 100
    index.check_invariants()
    # Removing everyone leaves nothing behind.
    for peer in index.peers():
        index.remove_peer(peer)
    assert index.memory_entries() == 0
    index.check_invariants()


def test_candidates_put_local_first_and_convert_blocks_to_tokens() -> None:
    index = make_index()
    index.add_peer(P[1])
    index.add_peer(P[2])
    digest_of(index, P[1]).add(BlockHash(1))
    index.mark_fresh(P[1], now=2.0)
    index.set_load(P[2], Load(queued=2), now=2.0)
    cands = index.candidates(
        H(1, 2),
        block_size=16,
        local_peer=P[0],
        local_matched_tokens=20,
        local_load=Load(running=1),
        now=3.0,
        rtt_s={P[1]: 0.02},
        default_rtt_s=0.1,
        inflight={P[2]: 4},
    )
    assert [c.peer for c in cands] == [P[0], P[1], P[2]]
    local, one, two = cands
    assert local.is_local and local.matched_tokens == 20 and local.digest_age_s == 0.0
    assert not one.is_local and one.matched_tokens == 16 and one.rtt_s == 0.02
    assert one.digest_age_s == 1.0
    assert two.matched_tokens == 0 and two.rtt_s == 0.1 and two.inflight == 4
    assert two.load == Load(queued=2) and two.digest_age_s == math.inf


def test_candidates_filter_and_cap() -> None:
    index = make_index()
    for peer in P[1:5]:
        index.add_peer(peer)
        digest_of(index, peer).add(BlockHash(1))
        digest_of(index, peer).add(BlockHash(2))
    index.mark_fresh(P[1], now=9.0)
    index.mark_fresh(P[2], now=1.0)
    index.mark_fresh(P[3], now=9.5)
    cands = index.candidates(
        H(1, 2),
        block_size=16,
        local_peer=P[0],
        local_matched_tokens=32,
        local_load=Load(),
        now=10.0,
        rtt_s={},
        exclude={P[3]},
        max_digest_age_s=5.0,
        max_matched_tokens=31,
    )
    # P[2] is too stale, P[3] excluded, P[4] never confirmed; P[1] stays, capped at 31.
    assert [(c.peer, c.matched_tokens) for c in cands] == [(P[0], 31), (P[1], 31)]


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigError):
        PeerIndex(max_peers=0)
    with pytest.raises(ConfigError):
        PeerIndex(speculative_ttl_s=0.0)
    with pytest.raises(ConfigError):
        PeerIndex(max_replica_blocks=0)


# ---------------------------------------------------------------- against a brute force

hashes = st.integers(min_value=0, max_value=11).map(BlockHash)
chains = st.lists(hashes, max_size=6)


def brute_match(holdings: dict[PeerId, set[BlockHash]], chain: list[BlockHash]) -> dict[PeerId, int]:
    out: dict[PeerId, int] = {}
    for peer, held in holdings.items():
        n = 0
        while n < len(chain) and chain[n] in held:
            n += 1
        if n:
            out[peer] = n
    return out


@given(
    replicas=st.dictionaries(st.sampled_from(P), st.sets(hashes), max_size=len(P)),
    chain=chains,
)
def test_one_walk_agrees_with_asking_each_replica(
    replicas: dict[PeerId, set[BlockHash]], chain: list[BlockHash]
) -> None:
    index = make_index()
    for peer, held in replicas.items():
        index.add_peer(peer)
        for h in held:
            digest_of(index, peer).add(h)
    assert index.match_blocks(chain) == brute_match(replicas, chain)


MANY = [PeerId(f"many-{i}") for i in range(200)]


def test_a_few_high_slots_in_a_wide_mask() -> None:
    """Sparse wide masks (a few peers among many slots) are read bit by bit."""
    index = make_index()
    for peer in MANY:
        index.add_peer(peer)
    for h in H(1, 2, 3):
        digest_of(index, MANY[190]).add(h)
    for h in H(1, 2):
        digest_of(index, MANY[77]).add(h)
    digest_of(index, MANY[33]).add(BlockHash(1))
    assert index.match_blocks(H(1, 2, 3, 4)) == {MANY[190]: 3, MANY[77]: 2, MANY[33]: 1}


@settings(max_examples=40, deadline=None)
@given(
    holdings=st.lists(st.sets(hashes, max_size=8), min_size=1, max_size=len(MANY)),
    removed=st.sets(st.integers(0, len(MANY) - 1), max_size=60),
    chain=chains,
)
def test_many_peers_sparse_and_dense_masks_agree_with_brute_force(
    holdings: list[set[BlockHash]], removed: set[int], chain: list[BlockHash]
) -> None:
    """Up to 200 slots: masks wide enough for both ways of reading bits out of a mask."""
    index = make_index()
    replicas = {}
    for peer, held in zip(MANY, holdings, strict=False):
        index.add_peer(peer)
        for h in held:
            digest_of(index, peer).add(h)
        replicas[peer] = held
    for i in removed:
        if MANY[i] in replicas:
            index.remove_peer(MANY[i])
            del replicas[MANY[i]]
    assert index.match_blocks(chain) == brute_match(replicas, chain)
    cands = index.candidates(
        chain, block_size=4, local_peer=P[0], local_matched_tokens=0, local_load=Load(),
        now=0.0, rtt_s={},
    )
    want = brute_match(replicas, chain)
    assert {c.peer: c.matched_tokens for c in cands[1:]} == {
        p: 4 * want.get(p, 0) for p in replicas
    }


class IndexModel(RuleBasedStateMachine):
    """Random operations on the index and on a plain model; they must always agree.

    The model: per peer a set (its replica) plus a list of live speculative entries
    ``(peer, blocks, time)``; the index's speculative rules restated naively.
    """

    MAX_PEERS = 4
    MAX_SPEC = 8
    TTL = 5.0
    GRACE = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.index = make_index(
            max_peers=self.MAX_PEERS,
            max_speculative_blocks=self.MAX_SPEC,
            speculative_ttl_s=self.TTL,
            confirm_grace_s=self.GRACE,
        )
        self.replicas: dict[PeerId, set[BlockHash]] = {}
        self.fresh: dict[PeerId, float] = {}
        self.order: dict[PeerId, int] = {}
        self.seq = 0
        self.spec: list[tuple[PeerId, tuple[BlockHash, ...], float]] = []
        self.clock = 0.0
        self.spec_clock = -math.inf

    @initialize()
    def start(self) -> None:
        self.index.check_invariants()

    def _drop_peer(self, peer: PeerId) -> None:
        del self.replicas[peer]
        self.fresh.pop(peer, None)
        self.spec = [e for e in self.spec if e[0] != peer]

    @rule(peer=st.sampled_from(P))
    def add_peer(self, peer: PeerId) -> None:
        self.index.add_peer(peer)
        if peer in self.replicas:
            return
        if len(self.replicas) >= self.MAX_PEERS:
            victim = min(self.replicas, key=lambda p: (self.fresh.get(p, -math.inf), self.order[p]))
            self._drop_peer(victim)
        self.seq += 1
        self.order[peer] = self.seq
        self.replicas[peer] = set()

    @rule(peer=st.sampled_from(P))
    def remove_peer(self, peer: PeerId) -> None:
        self.index.remove_peer(peer)
        if peer in self.replicas:
            self._drop_peer(peer)

    @precondition(lambda self: self.replicas)
    @rule(data=st.data(), blocks=st.lists(hashes, max_size=4))
    def replica_add(self, data: st.DataObject, blocks: list[BlockHash]) -> None:
        peer = data.draw(st.sampled_from(sorted(self.replicas)))
        for h in blocks:
            digest_of(self.index, peer).add(h)
            self.replicas[peer].add(h)

    @precondition(lambda self: self.replicas)
    @rule(data=st.data(), blocks=st.lists(hashes, max_size=4))
    def replica_discard(self, data: st.DataObject, blocks: list[BlockHash]) -> None:
        peer = data.draw(st.sampled_from(sorted(self.replicas)))
        for h in blocks:
            digest_of(self.index, peer).discard(h)
            self.replicas[peer].discard(h)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    def tick(self, dt: float) -> None:
        self.clock += dt

    @rule(peer=st.sampled_from(P), chain=chains)
    def add_speculative(self, peer: PeerId, chain: list[BlockHash]) -> None:
        self.index.add_speculative(peer, chain, self.clock)
        if peer not in self.replicas or not chain:
            return
        t = max(self.clock, self.spec_clock)
        self.spec_clock = t
        self._expire(t)
        blocks = tuple(chain[: self.MAX_SPEC])
        while sum(len(e[1]) for e in self.spec) + len(blocks) > self.MAX_SPEC:
            self.spec.pop(0)
        self.spec.append((peer, blocks, t))

    def _expire(self, now: float) -> None:
        self.spec = [e for e in self.spec if e[2] > now - self.TTL]

    @rule(peer=st.sampled_from(P), fresh=st.booleans())
    def confirm(self, peer: PeerId, fresh: bool) -> None:
        if fresh:
            self.index.mark_fresh(peer, self.clock)
            if peer in self.replicas:
                self.fresh[peer] = max(self.fresh.get(peer, -math.inf), self.clock)
        else:
            self.index.confirm(peer, self.clock)
        cutoff = self.clock - self.GRACE
        self.spec = [e for e in self.spec if not (e[0] == peer and e[2] < cutoff)]

    @rule()
    def expire(self) -> None:
        self.index.expire(self.clock)
        self._expire(self.clock)

    @rule(chain=chains)
    def match(self, chain: list[BlockHash]) -> None:
        holdings = {p: set(s) for p, s in self.replicas.items()}
        for peer, blocks, _ in self.spec:
            holdings[peer] |= set(blocks)
        assert self.index.match_blocks(chain) == brute_match(holdings, chain)

    @invariant()
    def agrees(self) -> None:
        self.index.check_invariants()
        assert sorted(self.index.peers()) == sorted(self.replicas)
        assert self.index.speculative_blocks() == sum(len(e[1]) for e in self.spec)
        for peer in self.replicas:
            age = self.index.digest_age(peer, self.clock)
            expected = self.clock - self.fresh[peer] if peer in self.fresh else math.inf
            assert age == expected


IndexModel.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_index_agrees_with_a_naive_model = IndexModel.TestCase


class OverflowModel(RuleBasedStateMachine):
    """With a tiny per-peer cap, matches may only be underestimated, never overestimated."""

    CAP = 3

    def __init__(self) -> None:
        super().__init__()
        self.index = make_index(max_replica_blocks=self.CAP)
        self.replicas: dict[PeerId, set[BlockHash]] = {}

    @rule(peer=st.sampled_from(P[:3]), blocks=st.lists(hashes, max_size=4), add=st.booleans())
    def change(self, peer: PeerId, blocks: list[BlockHash], add: bool) -> None:
        self.index.add_peer(peer)
        held = self.replicas.setdefault(peer, set())
        digest = digest_of(self.index, peer)
        for h in blocks:
            if add:
                digest.add(h)
                held.add(h)
            else:
                digest.discard(h)
                held.discard(h)

    @rule(chain=chains)
    def match(self, chain: list[BlockHash]) -> None:
        got = self.index.match_blocks(chain)
        want = brute_match(self.replicas, chain)
        for peer, n in got.items():
            assert n <= want[peer]
        for peer, n in want.items():
            if not self.index.overflowed(peer):
                assert got.get(peer) == n

    @invariant()
    def valid(self) -> None:
        self.index.check_invariants()
        assert self.index.memory_entries() <= self.CAP * len(P[:3])


OverflowModel.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None
)
test_overflow_only_underestimates = OverflowModel.TestCase


def test_prompt_chain_is_the_chain_memoized_and_refuses_what_chain_refuses() -> None:
    """``PrefixHasher.prompt_chain`` answers ``tuple(chain(tokens))`` whether or not the prompt
    was hashed before; an equal tuple holding a float is refused as ``chain`` refuses it, even
    after the int tuple it equals was memoized; lists are not memo keys."""
    from peerinfer.core import prefix

    hasher = prefix.PrefixHasher(b"memo-test")
    other = prefix.PrefixHasher(b"memo-test")
    prompts = [tuple(range(k, k + 16 * k + 5)) for k in range(1, 40)]
    for rounds in range(2):
        for p in prompts:
            assert hasher.prompt_chain(p) == tuple(other.chain(p)), (rounds, len(p))
    assert hasher.prompt_chain(list(prompts[3])) == tuple(other.chain(prompts[3]))
    floats = tuple(float(t) for t in prompts[3])
    assert floats == prompts[3]
    with pytest.raises(ValueError):
        other.chain(floats)
    with pytest.raises(ValueError):
        hasher.prompt_chain(floats)
    # Bounded: past the memo's size it starts over, and still answers right.
    many = [tuple(range(i, i + 20)) for i in range(prefix.PROMPT_MEMO_SIZE + 10)]
    for p in many:
        assert hasher.prompt_chain(p) == tuple(other.chain(p))
    assert len(hasher._prompt_memo) <= prefix.PROMPT_MEMO_SIZE


@pytest.mark.pure_python
@pytest.mark.parametrize("colliding", [False, True])
def test_prompt_chain_extends_a_shared_prefix_to_the_same_chain(
    colliding: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt new to the memo that shares a prefix with ones hashed before (MMLU's: one
    subject's 5-shot examples, then the question) gets exactly ``chain``'s hashes: prefixes
    shared up to, just before and just past a ``PREFIX_STRIDE_BLOCKS`` boundary, with and
    without a partial last block, at two block sizes; a prompt equal to a memo prompt's prefix
    but holding a float is refused as ``chain`` refuses it; the memo's start-over forgets the
    prefixes too (fails if a new prompt takes one hash too many or too few from the prefix it
    shares, or extends from the wrong place). ``colliding``: every prefix key is the same
    (a hash that collides always): the prefixes are told apart by their tokens (fails if a
    prefix is taken on its key alone)."""
    import random

    from peerinfer.core import prefix

    if colliding:
        monkeypatch.setattr(prefix, "hash", lambda _: 7, raising=False)

    class Counting(prefix.PrefixHasher):
        """Notes where each chain starts: a prompt extended from a shared prefix starts past 0."""

        starts: list[int] = []

        def chain(self, tokens: Any, parent: BlockHash | None = None, start: int = 0) -> list[BlockHash]:
            Counting.starts.append(start)
            return super().chain(tokens, parent, start)

    rng = random.Random(25)
    for bs in (16, 4):
        step = prefix.PREFIX_STRIDE_BLOCKS * bs
        hasher = Counting(b"prefix-test", block_size=bs, memo_size=64)
        Counting.starts = []
        other = prefix.PrefixHasher(b"prefix-test", block_size=bs)
        shots = [tuple(rng.randrange(32_000) for _ in range(rng.randrange(3 * step, 6 * step)))
                 for _ in range(3)]
        for i in range(300):
            shot = rng.choice(shots)
            cut = rng.choice((len(shot), len(shot) // step * step, len(shot) // step * step - 1,
                              len(shot) // step * step + 1, rng.randrange(len(shot))))
            tail = tuple(rng.randrange(32_000) for _ in range(rng.randrange(0, 2 * step)))
            p = shot[:cut] + tail
            assert hasher.prompt_chain(p) == tuple(other.chain(p)), (bs, i, cut, len(tail))
        # The same tuples asked again: answered from the memo (by identity), nothing hashed;
        # an equal tuple that is another object too (by value).
        again = list(hasher._prompt_memo)
        Counting.starts, before = [], list(Counting.starts)
        for p in again:
            assert hasher.prompt_chain(p) is hasher._prompt_memo[p][1]
            assert hasher.prompt_chain(tuple(list(p))) == tuple(other.chain(p))
        assert Counting.starts == []
        Counting.starts = before
        extended = [s for s in Counting.starts if s]
        assert len(extended) > (5 if colliding else 100), bs
        assert all(s % step == 0 for s in extended), bs
        assert len(hasher._prompt_memo) <= 64 and len(hasher._by_id) == len(hasher._prompt_memo)
        assert len(hasher._prefix_memo) <= 64 * 6 * 2  # started over with the memo
    # A prompt equal to a memo prompt's prefix, and longer than it, holding a float: refused.
    plain = prefix.PrefixHasher(b"prefix-test")
    base = tuple(range(100, 100 + 5 * 16 * prefix.PREFIX_STRIDE_BLOCKS))
    plain.prompt_chain(base)
    floats: Any = tuple(float(t) for t in base[: 2 * 16 * prefix.PREFIX_STRIDE_BLOCKS]) + (7,) * 40
    with pytest.raises(ValueError):
        plain.prompt_chain(floats)
    # Its int twin extends from the shared prefix.
    ints = tuple(int(t) for t in floats)
    assert plain.prompt_chain(ints) == tuple(plain.chain(ints))


def test_the_touched_record_names_changed_peers_and_stays_bounded() -> None:
    """``take_touched`` names the peers whose allowance or replica changed (a node rechecks
    only the runs of those it follows), and an index nobody takes it from keeps it bounded by
    answering "every peer" (None) instead."""
    index = make_index(max_peers=2)
    index.add_peer(PeerId("a"))
    index.add_peer(PeerId("b"))
    assert list(index.take_touched() or {}) == [PeerId("a"), PeerId("b")]
    assert index.take_touched() == {}
    for k in range(20):  # a full index: each newcomer evicts one, nobody takes the record
        index.add_peer(PeerId(f"c{k}"))
    assert index.take_touched() is None
    assert index.take_touched() == {}


def test_speculative_entries_without_masks_answer_as_with_them() -> None:
    """Without masks the index keeps no combined speculative masks (a walk asks each peer's
    counts alone): driven through the same random adds, confirmations, expiries, budget drops
    and removals, an index without masks must answer as one with them: the speculative
    holders of every hash, the blocks held, the memory entries and every match."""
    import random

    rng = random.Random(25)
    params = dict(max_peers=4, max_speculative_blocks=40, speculative_ttl_s=6.0,
                  confirm_grace_s=1.0)
    indexes = [make_index(masks=True, **params), make_index(masks=False, **params)]
    universe = [BlockHash(h) for h in range(1, 30)]
    clock = 0.0
    added = shared = 0
    for _ in range(600):
        op = rng.random()
        peer = rng.choice(P[:6])
        if op < 0.1:
            for index in indexes:
                index.add_peer(peer)
        elif op < 0.15:
            for index in indexes:
                index.remove_peer(peer)
        elif op < 0.3:
            h = rng.choice(universe)
            for index in indexes:
                if peer in index:
                    digest_of(index, peer).add(h)
        elif op < 0.65:
            chain = universe[rng.randrange(3):][: rng.randrange(1, 20)]
            for index in indexes:
                index.add_speculative(peer, chain, clock)
            added += peer in indexes[0]
        elif op < 0.8:
            for index in indexes:
                index.confirm(peer, clock)
        elif op < 0.85:
            for index in indexes:
                index.expire(clock)
        else:
            clock += rng.choice([0.5, 1.0, 2.0])
        with_masks, without = indexes
        for index in indexes:
            index.check_invariants()
        assert not without._spec_masks
        assert without.speculative_blocks() == with_masks.speculative_blocks()
        # (less the replicas' combined masks, which only the index with masks keeps)
        assert without.memory_entries() == with_masks.memory_entries() - len(with_masks._masks)
        for h in universe:
            holders = with_masks.speculative_holders(h)
            assert without.speculative_holders(h) == holders
            shared += len(holders) > 1
        chain = universe[rng.randrange(5):]
        assert without.match_blocks(chain) == with_masks.match_blocks(chain)
    # Not vacuous: many entries, often several peers' holding one hash.
    assert added > 80 and shared > 500, (added, shared)


def test_speculative_counts_without_masks_equal_the_counting_ones() -> None:
    """Without masks, a peer's first live entry is counted at once and its last one dropped at
    once (``add_speculative``, ``_drop_entry``: the fast paths); an index with masks counts
    every block up and down (the reference). Through random adds (some chains repeating a
    block, some several entries to a peer), confirmations, expiries, budget drops and
    removals, every peer's counts must be the reference's."""
    import random

    rng = random.Random(7)
    params = dict(max_peers=4, max_speculative_blocks=30, speculative_ttl_s=6.0,
                  confirm_grace_s=1.0)
    reference, fast = make_index(masks=True, **params), make_index(masks=False, **params)
    universe = [BlockHash(h) for h in range(1, 12)]
    clock = 0.0
    first = last = repeats = 0
    for _ in range(1500):
        op = rng.random()
        peer = rng.choice(P[:5])
        state = fast._states.get(peer)
        if op < 0.1:
            for index in (reference, fast):
                index.add_peer(peer)
        elif op < 0.13:
            for index in (reference, fast):
                index.remove_peer(peer)
        elif op < 0.6:
            if rng.random() < 0.3:  # a block repeated: counted one by one
                chain = [rng.choice(universe) for _ in range(rng.randrange(2, 8))]
                repeats += len(set(chain)) < len(chain)
            else:
                chain = universe[rng.randrange(3):][: rng.randrange(1, 9)]
            first += state is not None and not state.spec_refs
            for index in (reference, fast):
                index.add_speculative(peer, chain, clock)
        elif op < 0.8:
            last += state is not None and state.spec_live == 1
            for index in (reference, fast):
                index.confirm(peer, clock)
        elif op < 0.85:
            for index in (reference, fast):
                index.expire(clock)
        else:
            clock += rng.choice([0.5, 1.0, 2.0])
        for index in (reference, fast):
            index.check_invariants()
        assert {p: s.spec_refs for p, s in fast._states.items()} == \
            {p: s.spec_refs for p, s in reference._states.items()}
    # Not vacuous: both fast paths taken often, and repeated blocks added.
    assert first > 100 and last > 30 and repeats > 50, (first, last, repeats)


def test_the_peers_not_followed_are_kept_until_the_peers_or_those_followed_change() -> None:
    """``FollowTables.not_followed`` (a route's peers asked alone) keeps its answer between routes: through
    random peers added and removed and peers followed and left (each counted), it must equal
    the difference made anew, in the same order (the order the peers are asked in)."""
    import random

    rng = random.Random(11)
    index = make_index(masks=False)
    following: dict[PeerId, object] = {}
    changes = 0
    kept = 0
    for _ in range(600):
        op = rng.random()
        peer = rng.choice(P[:10])
        if op < 0.2:
            index.add_peer(peer)
        elif op < 0.3:
            index.remove_peer(peer)
        elif op < 0.5:
            if peer not in following:
                following[peer] = object()
                changes += 1
        elif op < 0.6:
            if following.pop(peer, None) is not None:
                changes += 1
        tables = index._follow_tables
        before = tables.kept_not_followed
        got = tables.not_followed(index._states, following, changes, index._membership_changes)
        kept += got is before
        anew = index._states.keys() - following.keys()
        assert got == anew and list(got) == list(anew)
    assert kept > 200, kept  # not vacuous: often kept
