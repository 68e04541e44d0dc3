"""The radix prefix cache, against a naive model and on focused examples.

The model is a plain dict from cached prefixes (tuples of blocks) to their tick, payload and
size, plus a counter of pins per prefix. It evicts by scanning every entry for the unpinned leaf
with the smallest tick, which is what the cache's lazy heap must reproduce exactly (ticks of
evictable leaves are unique, so the order is fully determined).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from peerinfer.core.prefix import PrefixHasher
from peerinfer.core.radix import RadixCache, RadixNode
from peerinfer.errors import ConfigError
from peerinfer.types import BlockHash

BS = 2
HASHER = PrefixHasher(b"test-radix-model", block_size=BS)

Prefix = tuple[tuple[int, ...], ...]


def blocks_of(tokens: list[int] | tuple[int, ...]) -> Prefix:
    return tuple(tuple(tokens[i : i + BS]) for i in range(0, len(tokens) - BS + 1, BS))


def flat(prefix: Prefix) -> list[int]:
    return [t for block in prefix for t in block]


def hash_of(prefix: Prefix) -> BlockHash:
    return HASHER.chain(flat(prefix))[-1]


class Payload:
    """A distinct object per block offered, so identity tells which payload went where."""

    ids = itertools.count()

    def __init__(self) -> None:
        self.id = next(Payload.ids)

    def __repr__(self) -> str:
        return f"P{self.id}"


class SetObserver:
    def __init__(self) -> None:
        self.hashes: set[BlockHash] = set()

    def block_added(self, h: BlockHash) -> None:
        assert h not in self.hashes, "block added twice"
        self.hashes.add(h)

    def block_removed(self, h: BlockHash) -> None:
        assert h in self.hashes, "removal of a block never added"
        self.hashes.remove(h)


@dataclass
class Entry:
    tick: int
    payload: Any
    nbytes: int


@dataclass
class Model:
    capacity_tokens: int | None
    capacity_bytes: int | None
    entries: dict[Prefix, Entry] = field(default_factory=dict)
    pins: Counter[Prefix] = field(default_factory=Counter)
    tick: int = 0
    evicted: list[Prefix] = field(default_factory=list)
    queries: int = 0
    hit_queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    inserted: int = 0
    reserved: int = 0

    def pin_count(self, prefix: Prefix) -> int:
        """Pins held on ``prefix`` or below it (what the node's lock_ref must be)."""
        n = len(prefix)
        return sum(c for p, c in self.pins.items() if p[:n] == prefix)

    def is_leaf(self, prefix: Prefix) -> bool:
        n = len(prefix) + 1
        return not any(len(p) == n and p[:-1] == prefix for p in self.entries)

    def lru_victim(self, protect: Prefix | None) -> Prefix | None:
        candidates = [
            p
            for p in self.entries
            if p != protect and self.is_leaf(p) and self.pin_count(p) == 0
        ]
        return min(candidates, key=lambda p: self.entries[p].tick, default=None)

    def evict_one(self, prefix: Prefix) -> None:
        del self.entries[prefix]
        self.evicted.append(prefix)

    def used(self) -> tuple[int, int]:
        return len(self.entries) * BS, sum(e.nbytes for e in self.entries.values())

    def fits(self, nbytes: int) -> bool:
        tokens, used_bytes = self.used()
        return (self.capacity_tokens is None or tokens + BS <= self.capacity_tokens) and (
            self.capacity_bytes is None
            or used_bytes + self.reserved + nbytes <= self.capacity_bytes
        )

    def make_room(self, nbytes: int, protect: Prefix) -> bool:
        if (self.capacity_tokens is not None and BS > self.capacity_tokens) or (
            self.capacity_bytes is not None and nbytes > self.capacity_bytes - self.reserved
        ):
            return False
        while not self.fits(nbytes):
            victim = self.lru_victim(protect)
            if victim is None:
                return False
            self.evict_one(victim)
        return True

    def match(self, tokens: list[int], touch: bool) -> int:
        blocks = blocks_of(tokens)
        k = 0
        while k < len(blocks) and blocks[: k + 1] in self.entries:
            k += 1
        if touch:
            self.tick += 1
            for i in range(1, k + 1):
                self.entries[blocks[:i]].tick = self.tick
            self.queries += 1
            self.query_tokens += len(tokens)
            if k:
                self.hit_queries += 1
                self.hit_tokens += k * BS
        return k

    def insert(
        self, tokens: list[int], payloads: list[Any] | None, sizes: list[int]
    ) -> tuple[int, int, list[Any]]:
        blocks = blocks_of(tokens)
        self.tick += 1
        unused: list[Any] = []
        inserted = 0
        k = 0
        for i in range(len(blocks)):
            prefix = blocks[: i + 1]
            entry = self.entries.get(prefix)
            if entry is not None:
                entry.tick = self.tick
                if payloads is not None and payloads[i] is not entry.payload:
                    unused.append(payloads[i])
                k += 1
                continue
            if not self.make_room(sizes[i], protect=blocks[:i]):
                if payloads is not None:
                    unused.extend(payloads[i : len(blocks)])
                break
            payload = None if payloads is None else payloads[i]
            self.entries[prefix] = Entry(self.tick, payload, sizes[i])
            inserted += 1
            k += 1
        if payloads is not None and len(payloads) > len(blocks):
            unused.append(payloads[len(blocks)])
        self.inserted += inserted
        return inserted, k, unused

    def evict(self, tokens: int, nbytes: int) -> int:
        freed_tokens = freed_bytes = n = 0
        while freed_tokens < tokens or freed_bytes < nbytes:
            victim = self.lru_victim(None)
            if victim is None:
                break
            freed_tokens += BS
            freed_bytes += self.entries[victim].nbytes
            self.evict_one(victim)
            n += 1
        return n

    def clear(self) -> None:
        while (victim := self.lru_victim(None)) is not None:
            self.evict_one(victim)

    def reserve(self, nbytes: int) -> bool:
        if self.capacity_bytes is not None:
            pinned = sum(e.nbytes for p, e in self.entries.items() if self.pin_count(p))
            if pinned + self.reserved + nbytes > self.capacity_bytes:
                return False
            while self.used()[1] + self.reserved + nbytes > self.capacity_bytes:
                victim = self.lru_victim(None)
                assert victim is not None
                self.evict_one(victim)
        self.reserved += nbytes
        return True


def tree_nodes(cache: RadixCache) -> dict[Prefix, RadixNode]:
    out: dict[Prefix, RadixNode] = {}
    stack: list[tuple[Prefix, RadixNode]] = [((), cache.root)]
    while stack:
        prefix, node = stack.pop()
        for key, child in node.children.items():
            out[prefix + (key,)] = child
            stack.append((prefix + (key,), child))
    return out


token_lists = st.lists(st.integers(0, 2), max_size=4 * BS + 1)


def prompts(machine: RadixMachine, data: st.DataObject) -> list[int]:
    """Mostly a prompt sharing a prefix with one seen before (so paths hit and branch)."""
    fresh = data.draw(token_lists)
    mode = data.draw(st.integers(0, 3))
    if not machine.history or mode == 3:
        return fresh
    known = data.draw(st.sampled_from(machine.history))
    # Drop a few whole blocks from the end (drawing the drop, not the length kept, biases
    # towards long shared prefixes), then maybe go on with fresh tokens; mode 1 branches off
    # inside the known path.
    n_blocks = len(known) // BS
    drop = data.draw(st.integers(1 if mode == 1 and n_blocks else 0, n_blocks)) * BS
    tail = fresh if mode >= 1 else []
    return (known[: len(known) - drop] + tail)[: 4 * BS + 1]


# Small enough that inserts meet a full cache, large enough that paths branch before eviction
# (capacities too small for one block are covered by the examples below).
capacities = st.one_of(st.none(), st.integers(2 * BS, 8 * BS))
byte_capacities = st.one_of(st.none(), st.integers(4, 12))
# Uneven sizes: evicting a small sibling may not make room for a large block.
block_sizes = st.sampled_from([0, 1, 2, 4, 7])


class RadixMachine(RuleBasedStateMachine):
    """Random operations on a RadixCache and the model; observable behaviour must agree."""

    @initialize(
        capacity_tokens=capacities,
        capacity_bytes=byte_capacities,
        late=st.booleans(),
        warm=st.lists(token_lists, max_size=4),
    )
    def setup(
        self,
        capacity_tokens: int | None,
        capacity_bytes: int | None,
        late: bool,
        warm: list[list[int]],
    ) -> None:
        self.model = Model(capacity_tokens, capacity_bytes)
        self.evicted: list[BlockHash] = []
        self.cache = RadixCache(
            HASHER,
            capacity_tokens=capacity_tokens,
            capacity_bytes=capacity_bytes,
            on_evict=lambda node: self.evicted.append(node.hash),
        )
        self.observer = SetObserver()
        self.late_observer = late
        if not late:
            self.cache.add_observer(self.observer)
        self.held: list[tuple[RadixNode, Prefix]] = []
        self.seen_nodes: list[RadixNode] = []
        self.history: list[list[int]] = []
        # Start most runs from a populated cache, so matches hit and inserts meet a full one
        # even in runs where rule selection rarely picks `insert`.
        for tokens in warm:
            self.insert_and_compare(tokens, [Payload() for _ in blocks_of(tokens)], 1)

    @precondition(lambda self: self.late_observer)
    @rule()
    def attach_observer_late(self) -> None:
        # Joining a non-empty cache: the observer is told of the blocks already there.
        self.late_observer = False
        self.cache.add_observer(self.observer)

    @rule(data=st.data(), touch=st.booleans(), as_tuple=st.booleans())
    def match(self, data: st.DataObject, touch: bool, as_tuple: bool) -> None:
        tokens = prompts(self, data)
        result = self.cache.match(tuple(tokens) if as_tuple else tokens, touch=touch)
        k = self.model.match(tokens, touch)
        blocks = blocks_of(tokens)
        assert result.tokens == k * BS
        assert [n.key for n in result.nodes] == list(blocks[:k])
        assert result.payloads == [self.model.entries[blocks[: i + 1]].payload for i in range(k)]
        if k:
            assert result.last_node is result.nodes[-1]
            assert result.last_hash == hash_of(blocks[:k])
        else:
            assert result.last_node is None
            assert result.last_hash == HASHER.root
        self.seen_nodes.extend(result.nodes)

    @rule(
        data=st.data(),
        with_payloads=st.booleans(),
        reuse=st.booleans(),
        partial_entry=st.booleans(),
        sizes=st.one_of(block_sizes, st.lists(block_sizes, min_size=5, max_size=5)),
    )
    def insert(
        self,
        data: st.DataObject,
        with_payloads: bool,
        reuse: bool,
        partial_entry: bool,
        sizes: int | list[int],
    ) -> None:
        tokens = prompts(self, data)
        blocks = blocks_of(tokens)
        n = len(blocks) + (1 if partial_entry and len(tokens) % BS else 0)
        payloads: list[Any] | None = None
        if with_payloads:
            payloads = []
            for i in range(n):
                entry = self.model.entries.get(blocks[: i + 1]) if i < len(blocks) else None
                # With `reuse` the caller hands back what the cache already holds (as an
                # engine re-inserting a matched path does): that must not come back unused.
                payloads.append(entry.payload if reuse and entry is not None else Payload())
        self.insert_and_compare(tokens, payloads, sizes if isinstance(sizes, int) else sizes[:n])

    @precondition(lambda self: any(not self.model.is_leaf(p) for p in self.model.entries))
    @rule(data=st.data(), block=st.tuples(*[st.integers(0, 2)] * BS), size=st.integers(0, 12))
    def branch_off_with_a_large_block(
        self, data: st.DataObject, block: tuple[int, ...], size: int
    ) -> None:
        # Branching off an inner node under byte pressure: making room may evict that node's
        # children and then find the node itself evictable, yet it must be spared.
        inner = sorted(p for p in self.model.entries if not self.model.is_leaf(p))
        prefix = data.draw(st.sampled_from(inner))
        n = len(prefix)
        self.insert_and_compare(flat(prefix) + list(block), [Payload() for _ in range(n + 1)],
                                [0] * n + [size])

    def insert_and_compare(
        self, tokens: list[int], payloads: list[Any] | None, nbytes: int | list[int]
    ) -> None:
        self.history.append(tokens)
        blocks = blocks_of(tokens)
        per_block = [nbytes] * (len(blocks) + 1) if isinstance(nbytes, int) else nbytes
        result = self.cache.insert(tokens, payloads, nbytes)
        inserted, k, unused = self.model.insert(tokens, payloads, per_block)
        assert result.inserted_blocks == inserted
        assert result.cached_tokens == k * BS
        assert [n.key for n in result.nodes] == list(blocks[:k])
        assert len(result.unused_payloads) == len(unused)
        assert all(a is b for a, b in zip(result.unused_payloads, unused, strict=True))
        self.seen_nodes.extend(result.nodes)

    @precondition(lambda self: self.model.entries)
    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        prefix = data.draw(st.sampled_from(sorted(self.model.entries)))
        node = self.cache.match(flat(prefix), touch=False).last_node
        assert node is not None
        self.cache.lock(node)
        self.model.pins[prefix] += 1
        self.held.append((node, prefix))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node, prefix = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.cache.unlock(node)
        self.model.pins[prefix] -= 1

    @precondition(lambda self: any(n.evicted for n in self.seen_nodes))
    @rule()
    def lock_evicted_node_is_refused(self) -> None:
        node = next(n for n in self.seen_nodes if n.evicted)
        with pytest.raises(ValueError):
            self.cache.lock(node)
        with pytest.raises(ValueError):
            self.cache.unlock(node)

    @rule(tokens=st.integers(0, 3 * BS), nbytes=st.integers(0, 6), roll=st.integers(0, 2))
    def evict(self, tokens: int, nbytes: int, roll: int) -> None:
        if roll:  # explicit eviction on one draw in three, so the cache gets to fill up
            return
        assert self.cache.evict(tokens=tokens, bytes=nbytes) == self.model.evict(tokens, nbytes)

    @rule(nbytes=st.integers(0, 12))
    def reserve(self, nbytes: int) -> None:
        assert self.cache.reserve(nbytes) == self.model.reserve(nbytes)

    @precondition(lambda self: self.model.reserved)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        nbytes = data.draw(st.integers(0, self.model.reserved))
        self.cache.release(nbytes)
        self.model.reserved -= nbytes

    @rule(roll=st.integers(0, 9))
    def clear(self, roll: int) -> None:
        if roll:  # clearing is drastic: do it on one draw in ten
            return
        self.cache.clear()
        self.model.clear()

    @invariant()
    def agrees_with_model(self) -> None:
        self.cache.check_invariants()
        model = self.model
        nodes = tree_nodes(self.cache)
        assert set(nodes) == set(model.entries)
        for prefix in model.entries:  # prefix-closed
            assert all(prefix[:i] in model.entries for i in range(1, len(prefix)))
        for prefix, node in nodes.items():
            entry = model.entries[prefix]
            assert node.payload is entry.payload
            assert node.nbytes == entry.nbytes
            assert node.last_access == entry.tick
            assert node.lock_ref == model.pin_count(prefix)
            assert node.hash == hash_of(prefix)
            assert node.depth == len(prefix)
        # Locked paths survive: every pinned prefix is still cached.
        assert all(p in model.entries for p, c in model.pins.items() if c > 0)
        hashes = set(self.cache.block_hashes())
        assert hashes == {hash_of(p) for p in model.entries}
        assert len(self.cache) == len(model.entries)
        if not self.late_observer:
            assert self.observer.hashes == hashes
        assert self.evicted == [hash_of(p) for p in model.evicted]
        tokens, used_bytes = model.used()
        stats = self.cache.stats()
        assert (stats.blocks, stats.tokens, stats.bytes) == (len(model.entries), tokens, used_bytes)
        assert stats.capacity_tokens == model.capacity_tokens
        assert stats.capacity_bytes == model.capacity_bytes
        assert stats.locked_blocks == sum(1 for p in model.entries if model.pin_count(p))
        assert (stats.queries, stats.hit_queries) == (model.queries, model.hit_queries)
        assert (stats.query_tokens, stats.hit_tokens) == (model.query_tokens, model.hit_tokens)
        assert stats.inserted_blocks == model.inserted
        assert stats.evicted_blocks == len(model.evicted)
        assert stats.reserved_bytes == self.cache.reserved_bytes == model.reserved
        assert self.cache.tick == model.tick


RadixMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixMachine = RadixMachine.TestCase


# ------------------------------------------------------------------------- focused examples


def toks(*blocks: tuple[int, ...]) -> list[int]:
    return [t for b in blocks for t in b]


A, B, C, D, E = (0, 0), (1, 1), (2, 2), (3, 3), (4, 4)


def make(**kwargs: Any) -> tuple[RadixCache, list[RadixNode]]:
    evicted: list[RadixNode] = []
    return RadixCache(HASHER, on_evict=evicted.append, **kwargs), evicted


def test_eviction_order_is_lru_among_leaves() -> None:
    cache, evicted = make()
    cache.insert(toks(A))
    cache.insert(toks(B))
    cache.insert(toks(C))
    cache.match(toks(A))  # A is now the most recently used
    assert cache.evict(tokens=BS) == 1
    assert [n.key for n in evicted] == [B]
    assert cache.evict(tokens=2 * BS) == 2
    assert [n.key for n in evicted] == [B, C, A]
    assert len(cache) == 0
    cache.check_invariants()


def test_only_leaves_are_evicted_and_parents_follow_their_children() -> None:
    cache, evicted = make()
    cache.insert(toks(A, B, C))
    cache.insert(toks(D))
    assert cache.evict(tokens=BS) == 1
    assert [n.key for n in evicted] == [C]  # the leaf of the older path, not its root A
    cache.evict(tokens=2 * BS)
    assert [n.key for n in evicted] == [C, B, A]
    assert cache.match(toks(D)).tokens == BS
    cache.check_invariants()


def test_insert_under_a_fully_locked_cache_returns_unused_payloads() -> None:
    cache, evicted = make(capacity_tokens=3 * BS)
    held = cache.insert(toks(A, B, C))
    cache.lock(held.nodes[-1])
    payloads = [Payload(), Payload()]
    result = cache.insert(toks(D, E), payloads)
    assert result.inserted_blocks == 0
    assert result.cached_tokens == 0
    assert result.nodes == ()
    assert list(result.unused_payloads) == payloads
    assert evicted == []
    assert cache.match(toks(A, B, C)).tokens == 3 * BS
    cache.check_invariants()


def test_insert_stores_what_fits_then_stops() -> None:
    cache, evicted = make(capacity_tokens=4 * BS)
    held = cache.insert(toks(A, B, C))
    cache.lock(held.nodes[-1])
    payloads = [Payload(), Payload(), Payload()]
    result = cache.insert(toks(D, E, A), payloads)
    assert result.inserted_blocks == 1
    assert result.cached_tokens == BS
    assert result.nodes[0].payload is payloads[0]
    assert list(result.unused_payloads) == payloads[1:]
    assert evicted == []
    cache.unlock(held.nodes[-1])
    cache.check_invariants()


def test_insert_never_evicts_its_own_path() -> None:
    cache, evicted = make(capacity_tokens=3 * BS)
    cache.insert(toks(E))  # the oldest block: the only thing insert may evict
    cache.insert(toks(A, B))
    payloads = [Payload() for _ in range(4)]
    result = cache.insert(toks(A, B, C, D), payloads)
    # C evicts E; D would need A, B or C evicted, which are the path itself.
    assert [n.key for n in evicted] == [E]
    assert result.inserted_blocks == 1
    assert result.cached_tokens == 3 * BS
    assert list(result.unused_payloads) == [payloads[0], payloads[1], payloads[3]]
    cache.check_invariants()


def test_insert_spares_the_node_it_extends_when_it_becomes_a_leaf() -> None:
    cache, evicted = make(capacity_bytes=10)
    cache.insert(toks(A, C), nbytes=[5, 1])
    offered = [Payload(), Payload()]
    # B (6 bytes) needs C (1 byte) evicted, which leaves A an evictable leaf with a fresh tick,
    # and still more room: A must not be evicted, since B would be attached to it.
    result = cache.insert(toks(A, B), offered, nbytes=6)
    assert [n.key for n in evicted] == [C]
    assert [n.key for n in result.nodes] == [A]
    assert not any(n.evicted for n in result.nodes)
    assert list(result.unused_payloads) == offered
    assert cache.stats().bytes == 5
    cache.check_invariants()


def test_a_block_larger_than_the_byte_capacity_is_refused() -> None:
    cache, evicted = make(capacity_bytes=10)
    cache.insert(toks(A), nbytes=4)
    payload = Payload()
    result = cache.insert(toks(B), [payload], nbytes=11)
    assert result.inserted_blocks == 0
    assert result.unused_payloads == (payload,)
    assert evicted == []  # nothing was evicted in vain
    assert cache.stats().bytes == 4


def test_byte_capacity_evicts_as_much_as_needed() -> None:
    cache, evicted = make(capacity_bytes=10)
    cache.insert(toks(A), nbytes=4)
    cache.insert(toks(B), nbytes=4)
    cache.insert(toks(C), nbytes=[9])
    assert [n.key for n in evicted] == [A, B]
    assert cache.stats().bytes == 9
    cache.check_invariants()


def test_reserve_evicts_lru_unpinned_blocks_and_inserts_stay_within_the_rest() -> None:
    cache, evicted = make(capacity_bytes=12)
    cache.insert(toks(A, B), nbytes=3)  # A <- B, 6 bytes
    cache.insert(toks(C), nbytes=3)
    cache.insert(toks(D), nbytes=3)
    cache.lock(cache.match(toks(D), touch=False).last_node)  # D is pinned, 3 bytes
    assert cache.reserve(5)  # 12 + 5 > 12: evicts the LRU leaves B, then A
    assert [n.key for n in evicted] == [B, A]
    assert cache.stats().bytes == 6 and cache.reserved_bytes == 5
    cache.check_invariants()
    # Inserts now have 12 - 5 = 7 bytes: C goes (LRU) for the new block, D (pinned) stays.
    result = cache.insert(toks(E), nbytes=4)
    assert result.inserted_blocks == 1 and [n.key for n in evicted] == [B, A, C]
    assert cache.stats().bytes == 7
    cache.check_invariants()


def test_reserve_that_cannot_fit_evicts_nothing_and_release_gives_room_back() -> None:
    cache, evicted = make(capacity_bytes=10)
    cache.insert(toks(A), nbytes=4)
    cache.insert(toks(B), nbytes=4)
    cache.lock(cache.match(toks(A), touch=False).last_node)
    assert cache.reserve(3)  # evicts B only
    assert [n.key for n in evicted] == [B]
    assert not cache.reserve(4)  # pinned 4 + reserved 3 + 4 > 10, even with all else evicted
    assert [n.key for n in evicted] == [B] and cache.reserved_bytes == 3
    cache.release(3)
    assert cache.reserve(6)
    with pytest.raises(ValueError):
        cache.release(7)
    with pytest.raises(ValueError):
        cache.reserve(-1)
    cache.check_invariants()
    # A cache without a byte bound counts reservations but never refuses them.
    unbounded, _ = make()
    assert unbounded.reserve(10**12) and unbounded.stats().reserved_bytes == 10**12


def test_partial_trailing_block_is_ignored() -> None:
    cache, _ = make()
    payloads = [Payload(), Payload(), Payload()]
    result = cache.insert(toks(A, B) + [1], payloads, nbytes=[1, 2, 3])
    assert result.inserted_blocks == 2
    assert result.cached_tokens == 2 * BS
    assert result.unused_payloads == (payloads[2],)
    assert cache.stats().bytes == 3
    assert cache.match(toks(A, B) + [1]).tokens == 2 * BS
    assert cache.match([0]).tokens == 0


def test_existing_blocks_keep_their_payload() -> None:
    cache, _ = make()
    first = [Payload(), Payload()]
    cache.insert(toks(A, B), first, nbytes=5)
    second = [Payload(), Payload(), Payload()]
    result = cache.insert(toks(A, B, C), second, nbytes=7)
    assert result.inserted_blocks == 1
    assert list(result.unused_payloads) == second[:2]
    assert cache.match(toks(A, B, C)).payloads == [first[0], first[1], second[2]]
    assert cache.stats().bytes == 5 + 5 + 7
    # Handing back the stored payloads is not offering new ones.
    again = cache.insert(toks(A, B, C), cache.match(toks(A, B, C)).payloads)
    assert again.unused_payloads == ()


def test_locked_path_survives_clear() -> None:
    cache, evicted = make()
    locked = cache.insert(toks(A, B, C)).nodes
    cache.insert(toks(A, D))
    cache.insert(toks(E))
    cache.lock(locked[1])  # pins A and B, not C
    cache.lock(locked[1])
    assert cache.stats().locked_blocks == 2
    cache.clear()
    assert {n.key for n in evicted} == {C, D, E}
    assert cache.match(toks(A, B, C)).tokens == 2 * BS
    cache.unlock(locked[1])
    cache.clear()
    assert len(cache) == 2
    cache.unlock(locked[1])
    assert cache.stats().locked_blocks == 0
    cache.clear()
    assert len(cache) == 0
    cache.check_invariants()


def test_lock_misuse_is_refused() -> None:
    cache, _ = make()
    node = cache.insert(toks(A)).nodes[0]
    with pytest.raises(ValueError):
        cache.unlock(node)
    cache.lock(None)  # nothing matched: nothing to pin
    cache.unlock(None)
    cache.clear()
    assert node.evicted
    with pytest.raises(ValueError):
        cache.lock(node)
    other = RadixCache(HASHER)
    foreign = other.insert(toks(A)).nodes[0]
    with pytest.raises(ValueError):
        cache.lock(foreign)
    assert foreign.lock_ref == 0


def test_match_touch_false_is_a_pure_peek() -> None:
    cache, evicted = make()
    cache.insert(toks(A))
    cache.insert(toks(B))
    tick = cache.tick
    assert cache.match(toks(A), touch=False).tokens == BS
    assert cache.tick == tick
    assert cache.stats().queries == 0
    cache.evict(tokens=BS)
    assert [n.key for n in evicted] == [A]  # the peek did not refresh A


def test_hashes_are_the_hasher_chain() -> None:
    cache, _ = make()
    tokens = toks(A, B, C, D)
    result = cache.insert(tokens)
    assert [n.hash for n in result.nodes] == HASHER.chain(tokens)
    match = cache.match(tokens[:5])
    assert match.last_hash == HASHER.chain(tokens)[1]
    assert cache.match([]).last_hash == HASHER.root
    assert HASHER.chain(tokens)[2] in cache
    assert cache.node_by_hash(HASHER.chain(tokens)[2]) is result.nodes[2]


def test_observers_see_every_change_and_late_ones_catch_up() -> None:
    cache, _ = make(capacity_tokens=2 * BS)
    early = SetObserver()
    cache.add_observer(early)
    cache.insert(toks(A, B))
    late = SetObserver()
    cache.add_observer(late)
    cache.insert(toks(C))
    assert early.hashes == late.hashes == set(cache.block_hashes())
    assert len(early.hashes) == 2


def test_bad_tokens_leave_the_cache_consistent() -> None:
    cache, _ = make()
    with pytest.raises(ValueError):
        cache.insert([0, 0, -1, 2])
    cache.check_invariants()
    assert cache.match([0, 0]).tokens == BS
    with pytest.raises(ValueError):
        cache.insert(toks(A), payloads=[Payload(), Payload()])
    with pytest.raises(ValueError):
        cache.insert(toks(A), nbytes=-1)
    with pytest.raises(ConfigError):
        RadixCache(HASHER, capacity_tokens=-1)


def test_stats_count_queries_and_hits() -> None:
    cache, _ = make()
    cache.insert(toks(A, B))
    cache.match(toks(A, C) + [9])
    cache.match(toks(C))
    stats = cache.stats()
    assert (stats.queries, stats.hit_queries) == (2, 1)
    assert (stats.query_tokens, stats.hit_tokens) == (2 * BS + 1 + BS, BS)
    assert (stats.inserted_blocks, stats.evicted_blocks) == (2, 0)


def test_lazy_heap_stays_bounded_under_repeated_touches() -> None:
    cache, _ = make()
    cache.insert(toks(A, B))
    cache.insert(toks(C))
    for _ in range(5000):
        cache.match(toks(A, B))
        cache.match(toks(C))
    cache.check_invariants()  # includes: the heap is within its compaction limit
    assert len(cache._heap) < 3000


def test_many_requests_under_pressure_keep_invariants() -> None:
    import random

    rng = random.Random(7)
    hasher = PrefixHasher(b"pressure", block_size=4)
    freed: list[RadixNode] = []
    cache = RadixCache(hasher, capacity_tokens=400, capacity_bytes=300, on_evict=freed.append)
    stems = [[rng.randrange(100) for _ in range(rng.randrange(4, 40))] for _ in range(20)]
    for _ in range(3000):
        prompt = rng.choice(stems) + [rng.randrange(100) for _ in range(rng.randrange(0, 20))]
        match = cache.match(prompt)
        cache.lock(match.last_node)
        n = len(prompt) // 4
        result = cache.insert(prompt, [object() for _ in range(n)], [rng.randrange(4) for _ in range(n)])
        assert result.cached_tokens >= match.tokens  # the pinned match is never lost
        cache.unlock(match.last_node)
    cache.check_invariants()
    stats = cache.stats()
    assert stats.tokens <= 400 and stats.bytes <= 300
    assert stats.evicted_blocks == len(freed) == stats.inserted_blocks - stats.blocks


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda c, n: setattr(n[1], "nbytes", n[1].nbytes + 1),  # accounting drifts
        lambda c, n: setattr(n[0], "last_access", n[1].last_access - 1),  # child newer
        lambda c, n: setattr(n[1], "lock_ref", 1),  # a pin not counted on the parent
        lambda c, n: setattr(n[1], "hash", BlockHash(n[1].hash ^ 1)),  # wrong chain hash
        lambda c, n: c._heap.clear(),  # an evictable leaf the heap forgot
        lambda c, n: n[0].children.pop(n[1].key),  # a block detached behind the cache's back
    ],
)
def test_check_invariants_detects_corruption(corrupt: Any) -> None:
    cache, _ = make()
    nodes = cache.insert(toks(A, B), nbytes=3).nodes
    cache.match(toks(A, B))
    cache.check_invariants()
    corrupt(cache, nodes)
    with pytest.raises(AssertionError):
        cache.check_invariants()
