"""``RadixCache.match_insert`` (one walk) against ``match`` then ``insert`` (two walks).

Two caches take the same random requests, pins, reservations and evictions; one serves each
request with ``match(tokens[:head])`` and ``insert(tokens)``, the other with ``match_insert``
(with the prompt's whole chain, a part of it, a chain longer than the request, or none; the
request whole, or cut anywhere into ``tokens`` and ``tail``, the prompt and completion as the
simulated engine passes them among the cuts). After
every step they must hold the same blocks with the same ticks, sizes and pins, report the same
statistics, and have evicted and announced the same blocks in the same order; at the end both
are drained, which must evict in the same order (the lazy heaps agree on the LRU order).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from peerinfer.core.prefix import PrefixHasher
from peerinfer.core.radix import RadixCache, RadixNode
from peerinfer.types import BlockHash

BS = 2


class Log:
    """An observer and eviction callback recording every call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def block_added(self, h: BlockHash) -> None:
        self.calls.append(("added", h))

    def block_removed(self, h: BlockHash) -> None:
        self.calls.append(("removed", h))

    def evicted(self, node: RadixNode) -> None:
        self.calls.append(("evict", node.hash))


def make(hasher: PrefixHasher, cap_tokens: int | None, cap_bytes: int | None) -> tuple[RadixCache, Log]:
    log = Log()
    cache = RadixCache(hasher, capacity_tokens=cap_tokens, capacity_bytes=cap_bytes, on_evict=log.evicted)
    cache.add_observer(log)
    return cache, log


def state(cache: RadixCache) -> list[tuple[Any, ...]]:
    out = []
    stack: list[tuple[tuple[int, ...], RadixNode]] = [((), cache.root)]
    while stack:
        prefix, node = stack.pop()
        out.append((prefix, node.hash, node.last_access, node.nbytes, node.lock_ref, node.depth))
        for key, child in node.children.items():
            stack.append((prefix + key, child))
    return sorted(out)


def run(seed: int, chain_kind: str, cap_tokens: int | None, cap_bytes: int | None) -> int:
    """Drive both caches through one random history; returns how many blocks were evicted."""
    rng = random.Random(seed)
    cuts = random.Random(f"cut-{seed}")  # (apart, so that the histories stay those of ``rng``)
    hasher = PrefixHasher(b"test-radix-match-insert", block_size=BS, memo_size=64)
    two, two_log = make(hasher, cap_tokens, cap_bytes)
    one, one_log = make(hasher, cap_tokens, cap_bytes)
    pins: list[tuple[RadixNode | None, RadixNode | None]] = []
    for _ in range(250):
        op = rng.random()
        if op < 0.70:
            prompt = tuple(rng.randrange(3) for _ in range(rng.randrange(0, 14)))
            completion = tuple(rng.randrange(3) for _ in range(rng.randrange(0, 5)))
            seq = prompt + completion
            head = rng.choice([max(0, len(prompt) - 1), len(prompt), len(seq), 0])
            size = rng.choice([0, 1, 3])
            want = two.match(seq[:head]).tokens
            two.insert(seq, nbytes=size)
            chain: tuple[BlockHash, ...] | list[BlockHash]
            if chain_kind == "prompt":
                chain = hasher.prompt_chain(prompt)
            elif chain_kind == "part":
                chain = hasher.chain(prompt)[: rng.randrange(0, len(prompt) // BS + 1)]
            elif chain_kind == "longer":
                chain = hasher.chain(seq + (1,) * (2 * BS))
            else:
                chain = ()
            cut = cuts.choice([len(seq), len(prompt), cuts.randrange(len(seq) + 1)])
            tail = seq[cut:] if cuts.random() < 0.5 else list(seq[cut:])
            got = one.match_insert(seq[:cut], head, size, chain, tail, ints=cuts.random() < 0.5)
            assert got == want
        elif op < 0.80:
            prompt = tuple(rng.randrange(3) for _ in range(rng.randrange(0, 10)))
            a, b = two.match(prompt, touch=False), one.match(prompt, touch=False)
            assert a.tokens == b.tokens
            two.lock(a.last_node)
            one.lock(b.last_node)
            pins.append((a.last_node, b.last_node))
        elif op < 0.88 and pins:
            a_node, b_node = pins.pop(rng.randrange(len(pins)))
            two.unlock(a_node)
            one.unlock(b_node)
        elif op < 0.93:
            n = rng.randrange(0, 6)
            assert two.reserve(n) == one.reserve(n)
        elif op < 0.96 and two.reserved_bytes:
            n = rng.randrange(0, two.reserved_bytes + 1)
            two.release(n)
            one.release(n)
        else:
            n = rng.randrange(0, 3 * BS)
            assert two.evict(tokens=n) == one.evict(tokens=n)
        assert one.tick == two.tick
        assert one.stats() == two.stats()
        assert state(one) == state(two)
        assert one_log.calls == two_log.calls
        one.check_invariants(verify_hashes=False)
    two.check_invariants()
    for a_node, b_node in pins:
        two.unlock(a_node)
        one.unlock(b_node)
    two.clear()
    one.clear()
    assert one_log.calls == two_log.calls
    assert len(one) == len(two) == 0
    return sum(1 for kind, _ in one_log.calls if kind == "evict")


@pytest.mark.parametrize("chain_kind", ["prompt", "part", "longer", "none"])
@pytest.mark.parametrize(("cap_tokens", "cap_bytes"), [(12, None), (None, 9), (20, 14), (None, None)])
def test_match_insert_does_what_match_then_insert_do(
    chain_kind: str, cap_tokens: int | None, cap_bytes: int | None
) -> None:
    evicted = sum(run(seed, chain_kind, cap_tokens, cap_bytes) for seed in range(4))
    if cap_tokens is not None or cap_bytes is not None:
        assert evicted > 100  # the histories reach the capacity: evictions are compared too


def test_match_insert_refuses_what_insert_refuses() -> None:
    hasher = PrefixHasher(b"test-radix-match-insert", block_size=BS)
    cache, _ = make(hasher, None, None)
    with pytest.raises(ValueError):
        cache.match_insert((1, 2, 3), 4)
    with pytest.raises(ValueError):
        cache.match_insert((1, 2), 1, -1)
    with pytest.raises(ValueError):
        cache.match_insert((1, -2), 1)
    with pytest.raises(ValueError):
        cache.match_insert((1,), 3, 0, (), (2,))
    with pytest.raises(ValueError):
        cache.match_insert((1,), 1, 0, (), (-2,))
    assert len(cache) == 0
    assert cache.match_insert((1, 2, 3, 4), 3, 5) == 0
    assert cache.match_insert((1, 2, 3, 4, 5), 4, 5, hasher.prompt_chain((1, 2, 3, 4))) == 4
    assert cache.match_insert((1, 2, 3), 4, 5, hasher.prompt_chain((1, 2)), (4, 5, 6)) == 4
    cache.check_invariants()


def test_match_insert_takes_the_keys_of_ints_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``ints`` a new block's key is its slice (no ``operator.index`` per token), and the
    tree is the one made by converting each token."""
    from peerinfer.core import radix

    converted: list[object] = []

    def counted(token: object) -> int:
        converted.append(token)
        return index(token)  # type: ignore[arg-type]

    index = radix.index
    monkeypatch.setattr(radix, "index", counted)
    hasher = PrefixHasher(b"test-radix-match-insert", block_size=BS)
    as_is, one_by_one = make(hasher, None, None)[0], make(hasher, None, None)[0]
    prompt, tail = (1, 2, 3, 4, 5), (6, 7, 8)
    assert as_is.match_insert(prompt, 4, 1, hasher.prompt_chain(prompt), tail, ints=True) == 0
    assert not converted
    assert one_by_one.match_insert(prompt, 4, 1, hasher.prompt_chain(prompt), tail) == 0
    assert len(converted) == len(prompt + tail) // BS * BS
    assert state(as_is) == state(one_by_one)
    as_is.check_invariants()
