"""``MerkleDigest``: a set of block hashes with its incrementally kept Merkle summary, and the
``DeltaMemo`` that a simulator's replicas share results through.

The algorithm (mixing, the tree, its storage, single-difference decoding, lazy tries, shared
deltas) is described in ``peerinfer.core.digest``, the package's front door for digests; the
arithmetic it uses is in ``peerinfer.core.merklehash``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import takewhile
from typing import Any, Protocol

from peerinfer.core.merklehash import (
    _BITS,
    _COUNT_ONE,
    _MASK,
    _PAIR_MASK,
    LEAF_MAX,
    LEAF_MIN,
    contribution,
    mix,
    root_of,
    under,
    unmix,
)
from peerinfer.types import BlockHash

__all__ = [
    "BatchCacheObserver", "CacheObserver", "DeltaMemo", "MerkleDigest", "NullObserver", "SizeWatch",
]


class CacheObserver(Protocol):
    """Told of every real change of a set (the same protocol as ``radix.CacheObserver``)."""

    def block_added(self, h: BlockHash) -> None: ...

    def block_removed(self, h: BlockHash) -> None: ...


class BatchCacheObserver(CacheObserver, Protocol):
    """An observer that also takes a whole delta's real changes at once (``apply_delta``)."""

    def blocks_changed(self, added: list[BlockHash], removed: list[BlockHash]) -> None: ...


class DeltaMemo:
    """Results shared by the flat digests given this memo (see "Shared deltas" in digest.py).

    ``deltas``: ``MerkleDigest.apply_delta``'s results, ``(pair, count, id(added), id(removed))``
    of the set before -> ``(added, removed, set after, pair after, elements added, elements
    removed)``; the entry holds the tuples, so their ids stay theirs while it lives. ``roots``:
    ``root_of`` by ``(pair, count)`` (a pure function). Each is cleared when it holds ``limit``
    entries. Whoever hands one memo to many digests owns it; ``clear`` drops what it holds
    (digests holding shared sets keep them, copying before any change).
    """

    __slots__ = ("deltas", "roots", "limit")

    def __init__(self, limit: int = 1 << 12) -> None:
        self.deltas: dict[tuple[int, int, int, int], tuple[Any, ...]] = {}
        self.roots: dict[tuple[int, int], int] = {}
        self.limit = limit

    def clear(self) -> None:
        self.deltas.clear()
        self.roots.clear()


#: ``type`` of every hash a set holds (``MerkleDigest.leading``)
_INT_ONLY = frozenset((int,))

#: Memo of ``contribution(mix(h))`` per element ``h`` (a pure function), cleared when full.
_CONTRIBUTIONS: dict[int, int] = {}
_CONTRIBUTIONS_MAX = 1 << 17


def _contribution_of(h: int) -> int:
    """``contribution(mix(h))``, memoized: the many replicas of one peer share the work."""
    c = _CONTRIBUTIONS.get(h)
    if c is None:
        if len(_CONTRIBUTIONS) >= _CONTRIBUTIONS_MAX:
            _CONTRIBUTIONS.clear()
        c = _CONTRIBUTIONS[h] = contribution(mix(h))
    return c


class NullObserver:
    """Hears every change and does nothing (a digest of no index, on the batch path)."""

    __slots__ = ()

    def block_added(self, h: BlockHash) -> None:
        pass

    def block_removed(self, h: BlockHash) -> None:
        pass

    def blocks_changed(self, added: list[BlockHash], removed: list[BlockHash]) -> None:
        pass


class SizeWatch:
    """A high-water mark over a group of sets (a peer index's replicas): ``high`` is at least
    the size of every ``MerkleDigest`` that holds it as its ``watch``, and every count their
    replicas claim (``Replica.claimed``). Whatever can grow either raises it (``add``,
    ``apply_delta``, ``adopt``; ``Replica.apply_announce``, ``take_unchanged`` and
    ``AnnounceRun.take_run`` for claims); nothing lowers it but its owner, after reading every
    set (``ReplicaBudget.wants_minimal``). Why: an index's rebalance asks whether every size and
    claim is small, every few seconds at every node; with the mark small it answers without
    reading any replica."""

    __slots__ = ("high",)

    def __init__(self) -> None:
        self.high = 0


class MerkleDigest:
    """A set of ``BlockHash`` with its incrementally maintained Merkle summary.

    ``observer`` (if any) is told of every real change, after it is made. ``block_added`` and
    ``block_removed`` make the digest itself a ``CacheObserver`` of a radix cache. Methods
    named ``*_position*`` or taking ``level, prefix`` work on positions (``mix`` of elements).
    With ``lazy=True`` the trie is built only when a subtree is queried and dropped again by
    ``flatten`` (see "Lazy tries" in the module docstring); nothing else differs.
    """

    __slots__ = (
        "_inner", "_leaves", "_observer", "_batch_observer", "_lazy", "_flat", "_flat_pair",
        "_flat_shared", "_root_memo", "_memo", "watch",
    )

    def __init__(
        self, observer: CacheObserver | None = None, *, lazy: bool = False,
        memo: DeltaMemo | None = None,
    ) -> None:
        self._inner: dict[int, int] = {}
        self._leaves: dict[int, list[int]] = {1: []}  # the root is a leaf while the set is small
        self._observer = observer
        self._batch_observer = getattr(observer, "blocks_changed", None)
        self._lazy = lazy
        # While flat: the elements, and the root summary (XOR of their contributions).
        self._flat: set[int] | None = set() if lazy else None
        self._flat_pair = 0
        self._flat_shared = False  # ``_flat`` is a shared delta result: copy before changing it
        self._root_memo = (0, 0, 0)  # (pair, count, root) of the last root computed
        self._memo = memo  # shared delta results (a simulator's replicas), or None
        #: raised to this set's size whenever it grows (``SizeWatch``), if set
        self.watch: SizeWatch | None = None

    @property
    def is_flat(self) -> bool:
        """Whether the trie is not built (a lazy digest between subtree queries)."""
        return self._flat is not None

    def flat_summary(self) -> tuple[int, int] | None:
        """``(pair, count)`` of a flat digest, which determine its root; None while the trie is
        built. Two equal summaries of one digest: nothing changed its root in between (the
        cheap check a node makes before letting an unchanged announcement wait)."""
        flat = self._flat
        return None if flat is None else (self._flat_pair, len(flat))

    def flatten(self) -> None:
        """Drop the trie of a lazy digest (it is rebuilt by the next subtree query); an eager
        digest keeps its trie."""
        if self._flat is not None or not self._lazy:
            return
        pair, _ = self.node_summary(0, 0)
        flat: set[int] = set()
        for members in self._leaves.values():
            flat.update(unmix(s) for s in members)
        self._flat = flat
        self._flat_pair = pair
        self._flat_shared = False
        self._inner = {}
        self._leaves = {1: []}

    def _build(self) -> None:
        """Build the trie of a flat digest from its elements."""
        flat = self._flat
        if flat is None:
            return
        self._flat = None
        self._flat_pair = 0
        self._flat_shared = False
        self._inner = {}
        self._leaves = {1: [mix(h) for h in flat]}
        if len(flat) > LEAF_MAX:
            self._split(1, 0)

    # ---------------------------------------------------------------------- the set

    def add(self, h: BlockHash) -> bool:
        """Insert ``h``; False if it was already present."""
        flat = self._flat
        if flat is not None:
            if h in flat:
                return False
            if self._flat_shared:
                flat = self._own_flat()
            flat.add(h)
            self._flat_pair ^= _contribution_of(h)
        elif not self._add_position(mix(h)):
            return False
        watch = self.watch
        if watch is not None and len(self) > watch.high:
            watch.high = len(self)
        if self._observer is not None:
            self._observer.block_added(h)
        return True

    def discard(self, h: BlockHash) -> bool:
        """Remove ``h``; False if it was absent."""
        flat = self._flat
        if flat is not None:
            if h not in flat:
                return False
            if self._flat_shared:
                flat = self._own_flat()
            flat.discard(h)
            self._flat_pair ^= _contribution_of(h)
        elif not self._discard_position(mix(h)):
            return False
        if self._observer is not None:
            self._observer.block_removed(h)
        return True

    def apply_delta(
        self, added: Iterable[int], removed: Iterable[int], share: bool = True
    ) -> None:
        """Discard every element of ``removed``, then add every element of ``added``.

        The same as those calls one by one, but a flat digest does it in one loop each and an
        observer with ``blocks_changed`` hears of all the real changes in one call. With a
        memo, a result another digest left there is taken; ``share=False``: no other digest
        will apply this delta after this one, so the result is not left there (an entry holds
        its set, stale once this digest moves on, until the memo is cleared).
        """
        flat = self._flat
        batch = self._batch_observer
        if flat is None or batch is None:
            for h in removed:
                self.discard(BlockHash(h))
            for h in added:
                self.add(BlockHash(h))
            return
        key = None
        shared = self._memo
        if shared is not None and type(added) is tuple and type(removed) is tuple:
            key = (self._flat_pair, len(flat), id(added), id(removed))
            hit = shared.deltas.get(key)
            if hit is not None and hit[0] is added and hit[1] is removed:
                self._flat, self._flat_pair = hit[2], hit[3]
                self._flat_shared = True
                watch = self.watch
                if watch is not None and len(hit[2]) > watch.high:
                    watch.high = len(hit[2])
                if hit[4] or hit[5]:
                    batch(hit[4], hit[5])
                return
            if not share:
                key = None
        if key is not None:
            flat = set(flat)  # the result will be shared: never the set we hold
        elif self._flat_shared:
            flat = self._own_flat()
        new, gone = self._change_flat(flat, added, removed)
        if key is not None:
            assert shared is not None
            deltas = shared.deltas
            if len(deltas) >= shared.limit:
                deltas.clear()
            deltas[key] = (added, removed, flat, self._flat_pair, new, gone)
            self._flat = flat
            self._flat_shared = True
        if gone or new:
            batch(new, gone)

    def apply_changes(
        self, added: Iterable[int], removed: Iterable[int]
    ) -> tuple[list[BlockHash], list[BlockHash]]:
        """Discard every element of ``removed``, then add every element of ``added``, as those
        calls one by one (an observer hears of each), and return the real changes ``(added,
        removed)``, each in the order given. A flat digest without an observer does it in one
        loop each (this node's own digest takes in every request's cache changes so: the calls
        one by one were three per block); never through the memo (the set is nobody else's)."""
        flat = self._flat
        if flat is None or self._observer is not None:
            were = [BlockHash(h) for h in removed if self.discard(BlockHash(h))]
            return [BlockHash(h) for h in added if self.add(BlockHash(h))], were
        if self._flat_shared:
            flat = self._own_flat()
        return self._change_flat(flat, added, removed)

    def _change_flat(
        self, flat: set[int], added: Iterable[int], removed: Iterable[int]
    ) -> tuple[list[Any], list[Any]]:
        """Discard ``removed`` from ``flat`` (the set this digest is to hold), then add
        ``added``, keeping the pair hash and the size watch: the real changes ``(added,
        removed)``, each in the order given (``apply_delta``'s and ``apply_changes``' loop)."""
        # ``_contribution_of`` inlined: this loop runs for every hash of every announcement at
        # every peer, and the call was a tenth of a 64-node simulation's announcement cost.
        pair = self._flat_pair
        memo = _CONTRIBUTIONS
        # (the hashes as given: ``BlockHash`` is ``int`` at run time, and a call per element)
        gone: list[Any] = []
        new: list[Any] = []
        for h in removed:
            if h in flat:
                flat.discard(h)
                c = memo.get(h)
                pair ^= c if c is not None else _contribution_of(h)
                gone.append(h)
        for h in added:
            if h not in flat:
                flat.add(h)
                c = memo.get(h)
                pair ^= c if c is not None else _contribution_of(h)
                new.append(h)
        self._flat_pair = pair
        watch = self.watch
        if watch is not None and len(flat) > watch.high:
            watch.high = len(flat)
        return new, gone

    def twin(self) -> MerkleDigest:
        """A new flat digest of this one's flat set (shared: either copies before changing it),
        with the same memo and no observer: a shared run's own copy of its sender's set
        (``peerinfer.core.announcerun``), which applies each delta once for all followers."""
        flat = self._flat
        if flat is None:
            raise ValueError("twin: the digest is not flat")
        twin = MerkleDigest(NullObserver(), lazy=True, memo=self._memo)
        twin._flat, twin._flat_pair, twin._flat_shared = flat, self._flat_pair, True
        self._flat_shared = True
        return twin

    def adopt(self, other: MerkleDigest) -> None:
        """Hold ``other``'s flat set (shared: either copies before changing it), as if the
        elements in one and not the other had been added and removed here: an observer with
        ``blocks_changed`` hears of them in one call (a ``NullObserver``, which keeps nothing,
        is not told: then nothing is compared)."""
        flat = other._flat
        mine = self._flat
        if flat is None or mine is None:
            raise ValueError("adopt: both digests must be flat")
        batch = self._batch_observer
        if batch is None:
            raise ValueError("adopt: the observer must take whole changes (blocks_changed)")
        if flat is not mine and not isinstance(self._observer, NullObserver):
            gone = list(mine - flat)
            new = list(flat - mine)
        else:
            gone = new = []
        self._flat, self._flat_pair, self._flat_shared = flat, other._flat_pair, True
        other._flat_shared = True
        self._root_memo = other._root_memo
        watch = self.watch
        if watch is not None and len(flat) > watch.high:
            watch.high = len(flat)
        if gone or new:
            batch(new, gone)

    def _own_flat(self) -> set[int]:
        """Replace a shared flat set by this digest's own copy (copy on write), and return it."""
        assert self._flat is not None
        flat = self._flat = set(self._flat)
        self._flat_shared = False
        return flat

    def block_added(self, h: BlockHash) -> None:
        self.add(h)

    def block_removed(self, h: BlockHash) -> None:
        self.discard(h)

    def update(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self.add(BlockHash(h))

    def __contains__(self, h: object) -> bool:
        if type(h) is not int or not 0 <= h <= _MASK:
            return False
        if self._flat is not None:
            return h in self._flat
        return self.contains_position(mix(h))

    def leading(self, chain: Iterable[int]) -> int:
        """How many of ``chain``'s first hashes are elements (``h in self`` for each, up to
        the first that is not), with one set lookup each while the digest is flat."""
        flat = self._flat
        n = 0
        if flat is not None:
            # The held prefix taken in C; an element of the set is an int in range, so what
            # equals one is in range, and only its type is left to check (a float equal to a
            # held hash is no element: ``__contains__``). A route asks this of a peer's digest
            # for a whole prompt's chain, tens of blocks.
            try:
                held = tuple(takewhile(flat.__contains__, chain))
            except TypeError:  # an unhashable element: block by block below
                held = None
            if held is not None and set(map(type, held)) <= _INT_ONLY:
                return len(held)
            for h in chain:
                if type(h) is not int or not 0 <= h <= _MASK or h not in flat:
                    break
                n += 1
            return n
        for h in chain:
            if h not in self:
                break
            n += 1
        return n

    def __len__(self) -> int:
        if self._flat is not None:
            return len(self._flat)
        v = self._inner.get(1)
        return v >> 128 if v is not None else len(self._leaves[1])

    def __iter__(self) -> Iterator[BlockHash]:
        if self._flat is not None:
            for h in list(self._flat):
                yield BlockHash(h)
            return
        for members in list(self._leaves.values()):
            for s in members:
                yield BlockHash(unmix(s))

    @property
    def root(self) -> int:
        """The 64-bit root hash (0 for the empty set); see ``root_of``."""
        flat = self._flat
        if flat is not None:  # ``node_summary(0, 0)`` of a flat digest, without the call
            pair, count = self._flat_pair, len(flat)
        else:
            pair, count = self.node_summary(0, 0)
        memo = self._root_memo
        if memo[0] == pair and memo[1] == count:
            return memo[2]
        shared = self._memo
        if shared is not None:  # the replicas holding one shared set ask for the same root
            key = (pair, count)
            roots = shared.roots
            found = roots.get(key)
            if found is None:
                if len(roots) >= shared.limit:
                    roots.clear()
                found = roots[key] = root_of(pair, count)
            root = found
        else:
            root = root_of(pair, count)
        self._root_memo = (pair, count, root)
        return root

    # ---------------------------------------------------------------------- position-level core

    def _path(self, s: int) -> tuple[list[int], int]:
        """The inner nodes from the root down, and the key of the node below the last of them."""
        inner = self._inner
        path: list[int] = []
        k = 1
        shift = _BITS - 1
        while k in inner:
            path.append(k)
            k = (k << 1) | ((s >> shift) & 1)
            shift -= 1
        return path, k

    def contains_position(self, s: int) -> bool:
        if self._flat is not None:
            return unmix(s) in self._flat
        leaf = self._leaves.get(self._path(s)[1])
        return leaf is not None and s in leaf

    def _add_position(self, s: int) -> bool:
        path, k = self._path(s)
        leaf = self._leaves.get(k)
        if leaf is not None and s in leaf:
            return False
        if path:
            delta = contribution(s)
            inner = self._inner
            for p in path:
                inner[p] = (inner[p] ^ delta) + _COUNT_ONE
        if leaf is None:
            self._leaves[k] = [s]
        else:
            leaf.append(s)
            if len(leaf) > LEAF_MAX:
                self._split(k, len(path))
        return True

    def _discard_position(self, s: int) -> bool:
        path, k = self._path(s)
        leaf = self._leaves.get(k)
        if leaf is None or s not in leaf:
            return False
        leaf.remove(s)
        if not leaf and k != 1:
            del self._leaves[k]
        if path:
            delta = contribution(s)
            inner = self._inner
            collapse = 0
            for p in path:
                v = (inner[p] - _COUNT_ONE) ^ delta
                inner[p] = v
                if not collapse and v >> 128 <= LEAF_MIN:
                    collapse = p  # the topmost: every node below it is at least as small
            if collapse:
                self._collapse(collapse)
        return True

    def _split(self, k: int, level: int) -> None:
        members = self._leaves.pop(k)
        acc = 0
        for s in members:
            acc ^= contribution(s)
        self._inner[k] = len(members) << 128 | acc
        shift = _BITS - 1 - level
        low = [s for s in members if not (s >> shift) & 1]
        high = [s for s in members if (s >> shift) & 1]
        for child, part in ((k << 1, low), (k << 1 | 1, high)):
            if part:
                self._leaves[child] = part
                # Distinct 64-bit values cannot all share a 64-bit prefix: this terminates.
                if len(part) > LEAF_MAX:
                    self._split(child, level + 1)

    def _collapse(self, k: int) -> None:
        members: list[int] = []
        stack = [k]
        inner, leaves = self._inner, self._leaves
        while stack:
            key = stack.pop()
            if key in inner:
                del inner[key]
                stack.append(key << 1)
                stack.append(key << 1 | 1)
            else:
                leaf = leaves.pop(key, None)
                if leaf is not None:
                    members.extend(leaf)
        if members or k == 1:
            leaves[k] = members

    def _locate(self, level: int, prefix: int) -> tuple[int, list[int] | None]:
        """Node ``(level, prefix)``: its key, and None if it is an inner node, else the
        positions under it (a leaf's members, or those of the leaf above it, maybe none)."""
        k = 1 << level | prefix
        if k in self._inner:
            return k, None
        leaf = self._leaves.get(k)
        if leaf is not None:
            return k, leaf
        a = k >> 1
        while a:
            if a in self._inner:
                return k, []
            leaf = self._leaves.get(a)
            if leaf is not None:
                return k, [s for s in leaf if under(s, level, prefix)]
            a >>= 1
        raise AssertionError("the root is always stored")  # pragma: no cover

    def node_summary(self, level: int, prefix: int) -> tuple[int, int]:
        """``(G << 64 | H, count)`` of node ``(level, prefix)``."""
        if self._flat is not None:
            if level == 0:
                return self._flat_pair, len(self._flat)
            self._build()
        k, members = self._locate(level, prefix)
        if members is None:
            v = self._inner[k]
            return v & _PAIR_MASK, v >> 128
        acc = 0
        for s in members:
            acc ^= contribution(s)
        return acc, len(members)

    def children(self, level: int, prefix: int, span: int) -> tuple[list[int], list[int]]:
        """``(pairs, counts)`` of the ``2**span`` descendants of a node at ``level + span``."""
        n = 1 << span
        pairs = [0] * n
        counts = [0] * n
        target = level + span
        base = prefix << span
        shift = _BITS - target
        self._build()
        inner, leaves = self._inner, self._leaves
        k, members = self._locate(level, prefix)
        if members is not None:
            for s in members:
                i = (s >> shift) - base
                pairs[i] ^= contribution(s)
                counts[i] += 1
            return pairs, counts
        stack = [(k, level)]
        while stack:
            key, depth = stack.pop()
            v = inner.get(key)
            if v is not None:
                if depth == target:
                    i = (key ^ (1 << depth)) - base
                    pairs[i] = v & _PAIR_MASK
                    counts[i] = v >> 128
                else:
                    for child in (key << 1, key << 1 | 1):
                        if child in inner or child in leaves:
                            stack.append((child, depth + 1))
                continue
            for s in leaves[key]:
                i = (s >> shift) - base
                pairs[i] ^= contribution(s)
                counts[i] += 1
        return pairs, counts

    def positions_under(self, level: int, prefix: int) -> list[int]:
        """The positions of the elements under node ``(level, prefix)``."""
        self._build()
        k, members = self._locate(level, prefix)
        if members is not None:
            return list(members)
        out: list[int] = []
        inner, leaves = self._inner, self._leaves
        stack = [k]
        while stack:
            key = stack.pop()
            if key in inner:
                stack.append(key << 1)
                stack.append(key << 1 | 1)
            else:
                leaf = leaves.get(key)
                if leaf is not None:
                    out.extend(leaf)
        return out

    def add_position(self, s: int) -> bool:
        """Insert the element at position ``s`` (notifying the observer)."""
        return self.add(BlockHash(unmix(s)))

    def discard_position(self, s: int) -> bool:
        return self.discard(BlockHash(unmix(s)))

    # ---------------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Recompute every stored summary from the members and compare; raise AssertionError."""
        if self._flat is not None:
            acc = 0
            for h in self._flat:
                assert type(h) is int and 0 <= h <= _MASK, f"{h!r} is not a block hash"
                acc ^= contribution(mix(h))
            assert acc == self._flat_pair, "the flat root summary differs from the elements"
            assert not self._inner and self._leaves == {1: []}, "a flat digest stores a trie"
            return
        inner, leaves = self._inner, self._leaves
        seen: set[int] = set()
        visited = 0

        def visit(k: int, level: int) -> tuple[int, int]:
            nonlocal visited
            visited += 1
            prefix = k ^ (1 << level)
            if k in leaves:
                assert k not in inner, f"node {k} is both a leaf and an inner node"
                members = leaves[k]
                assert members or k == 1, f"empty leaf {k} kept"
                assert len(members) <= LEAF_MAX, f"leaf {k} holds more than LEAF_MAX"
                acc = 0
                for s in members:
                    assert 0 <= s <= _MASK and under(s, level, prefix), f"{s:#x} misplaced in {k}"
                    assert s not in seen, f"{s:#x} stored twice"
                    seen.add(s)
                    acc ^= contribution(s)
                return acc, len(members)
            assert k in inner, f"node {k} missing"
            acc = 0
            count = 0
            for child in (k << 1, k << 1 | 1):
                if child in inner or child in leaves:
                    pair, c = visit(child, level + 1)
                    acc ^= pair
                    count += c
            v = inner[k]
            assert v == count << 128 | acc, f"inner node {k}: stored summary differs from members"
            assert count > LEAF_MIN, f"inner node {k} holds {count} <= LEAF_MIN"
            return acc, count

        visit(1, 0)
        assert visited == len(inner) + len(leaves), "unreachable nodes are stored"
        assert len(self) == len(seen)
