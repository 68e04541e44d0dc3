"""Merkle summary of a set of block hashes, and this node's digest with its change log.

Algorithm
---------
*Mixing.* Every element ``h`` (a 64-bit ``BlockHash``) is mapped through ``mix``, a fixed
bijection of the 64-bit integers (the splitmix64 finaliser after adding a constant; ``unmix`` is
its inverse), giving its *position* ``s = mix(h)``: positions are uniform even if the elements
are not. An element contributes two 64-bit values to the hashes below: ``c(s)``, another
bijection (so an element can be recovered from its contribution, ``s = c_inverse(x)``), and
``g(s)``, an independent non-linear check value.

*The tree.* The summary is a Merkle tree over the 64-bit space of positions, fixed in shape and
identical at every peer: node ``(level, prefix)`` holds the elements whose position has
``prefix`` as its top ``level`` bits (``0 <= level <= 64``; the root is ``(0, 0)``, children add
one bit). A node's summary is ``(H, G, count)``: ``H`` the XOR of the ``c`` values under it,
``G`` the XOR of their ``g`` values, ``count`` their number. XOR makes the summary
set-homomorphic: an insert or an evict XORs the element into the summary of every node on its
path and adjusts the counts, O(depth), never a recomputation. Because the shape is fixed by the
bits alone, a replica and the original align node by node whatever each holds.

*Storage.* Only the non-empty top of the tree is stored, as a binary trie with bucketed leaves
(an adaptive hash trie): an *inner* node stores ``count << 128 | G << 64 | H`` in one int; a
*leaf* stores the list of its members' positions. A leaf splits into its two children when it
grows past ``LEAF_MAX`` members, and an inner node collapses back into one leaf when its count
falls to ``LEAF_MIN`` (hysteresis, so an add/discard pair at the boundary does not thrash). Nodes
are keyed ``1 << level | prefix`` (heap numbering: the children of ``k`` are ``2k`` and
``2k + 1``). The summary of a node below a leaf, or between stored nodes, is computed from the
leaf's few members. Where a node is stored is a private, history-dependent choice; what a node's
summary *is* depends only on the set, which is all the protocol relies on. Memory is about one
int and a list slot per element plus one trie node per ~``LEAF_MAX / 2`` elements.

*Single-difference decoding.* If two sets differ under a node by exactly one element, the XOR of
their two ``H`` is that element's contribution: the difference is *decoded* from the hashes,
checked by its position (it must lie under the node; ``c`` and the position are independent, so
a node with several differences passes with probability ``2**-level``) and by the count
difference (+1 or -1). The reconciliation in ``peerinfer.core.antientropy`` resolves most
differences this way, from one 8-byte hash, with no listing and no descent to a leaf.

*Why G.* ``H`` alone is linear: a wrong decode (three differences whose XOR happens to pass the
checks) adds exactly the element that makes ``H`` and ``count`` agree while the sets differ. The
independent ``G`` breaks that: the 64-bit ``root`` and the compared slices are non-linear
functions of both ``H`` and ``G``, so any remaining difference shows, and the next pass repairs
it.

*Truncated summaries.* Comparisons send ``slice_of(H, G, j)``: ``SLICE_BITS`` bits of a keyed
mix of the node's ``H`` and ``G``, where the pass number ``j`` picks the key, so a rare equal
slice of two different summaries (probability ``2**-SLICE_BITS``) is not repeated next pass.

*Lazy tries.* A replica of a peer needs its root to check every announcement but its trie only
while a pull compares subtrees, and every announcement of every peer updates every other peer's
replica: keeping each trie current element by element was most of a large swarm's work. A
``MerkleDigest(lazy=True)`` therefore starts *flat*: a plain set of elements and the root summary
(the XOR of their contributions, which is all the root needs). The first subtree query builds the
trie from the set (O(n log n), once per pull); ``flatten`` drops it again once the replica is
verified current. Both forms hold the same set and give the same summaries. Contributions are
memoized per element (``_contribution_of``, bounded): every replica of a peer takes in the same
announced hashes, so all but the first compute nothing.

*Shared deltas (a simulator's many replicas).* A simulator runs every node in one process, and
hands one announcement object to each of a peer's replicas, most of which hold the same set.
With ``share_applied_deltas(True)`` a flat digest's ``apply_delta`` memoizes its result, keyed by
the set's root summary and size and the identity of the delta's tuples: the first replica builds
a new set (a copy, then the delta), the next ones holding the same set (the same summary and
size: a 128-bit XOR of hashed contributions, which random block hashes do not collide in) adopt
that set object. A digest holding a shared set copies it before changing it in place (copy on
write). Replicas that took the same announcements in then share one set in memory instead of
one each. Off by default: a real node hands each announcement to one replica, where the memo
could only cost a copy per announcement.

*This node's digest.* ``LocalDigest`` wraps the digest of this node's own cache with *epochs*: the
engine's changes accumulate as pending net changes until ``seal_epoch`` closes them into a new
epoch, returning the delta that an announcement carries. A bounded log of past epochs' deltas
lets ``answer`` serve a requester whose replica matched a recent epoch with the net delta alone;
otherwise it answers the requester's Merkle queries (see ``answer``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from peerinfer.core.messages import MAX_DELTA, SyncNode, SyncQuery, SyncRequest, SyncResponse
from peerinfer.errors import ProtocolError
from peerinfer.types import BlockHash

__all__ = [
    "BatchCacheObserver",
    "CacheObserver",
    "DELTA_CAP",
    "LEAF_MAX",
    "LEAF_MIN",
    "HASH_DENSITY",
    "LIST_CAP",
    "RESPONSE_COUNTS_BUDGET",
    "RESPONSE_ELEMENT_BUDGET",
    "RESPONSE_WORK_BUDGET",
    "EpochDelta",
    "LocalDigest",
    "MerkleDigest",
    "bitmap_indices",
    "contribution",
    "fingerprint",
    "fingerprint_bits",
    "fingerprint_count",
    "mix",
    "pack_bitmap",
    "pack_elements",
    "pack_fixed",
    "packed_length",
    "position_of_contribution",
    "root_of",
    "slice_of",
    "summary_of",
    "under",
    "unmix",
    "unpack_elements",
    "unpack_fixed",
]


class CacheObserver(Protocol):
    """Told of every real change of a set (the same protocol as ``radix.CacheObserver``)."""

    def block_added(self, h: BlockHash) -> None: ...

    def block_removed(self, h: BlockHash) -> None: ...


class BatchCacheObserver(CacheObserver, Protocol):
    """An observer that also takes a whole delta's real changes at once (``apply_delta``)."""

    def blocks_changed(self, added: list[BlockHash], removed: list[BlockHash]) -> None: ...


_BITS = 64
_ONE = 1 << 64
_MASK = _ONE - 1
_COUNT_ONE = 1 << 128  # one unit of count in a packed inner node
_PAIR_MASK = _COUNT_ONE - 1

#: A leaf splits when it holds more than this many elements...
LEAF_MAX = 8
#: ...and an inner node collapses into a leaf when its count falls to this.
LEAF_MIN = 4

#: The largest node an exchange answers; a larger one is answered with its count alone.
LIST_CAP = 65_536
#: The most elements one response may carry in all (about 2 MiB).
RESPONSE_ELEMENT_BUDGET = 262_144
#: The most work (descendants compared plus elements scanned) one response may take.
RESPONSE_WORK_BUDGET = 262_144
#: The most entries of ``SyncNode.counts`` (decode() refuses longer arrays).
RESPONSE_COUNTS_BUDGET = 131_072
#: The most net changes a delta response may carry (added + removed).
DELTA_CAP = 262_144

#: A comparison carries hashes (only ever for differing descendants whose count difference is
#: odd, the only ones a hash may decode) while at most this fraction of its descendants differ:
#: past it most differing nodes hold several differences, and the requester descends instead.
HASH_DENSITY = 0.9

# splitmix64's finaliser, after adding the golden-ratio increment so that mix(0) != 0.
_C0 = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_C1_INV = pow(_C1, -1, _ONE)
_C2_INV = pow(_C2, -1, _ONE)
# Keys that make the contribution, the check value, the slices and the root independent.
_K_CONTRIB = 0x5851F42D4C957F2D
_K_SLICE = 0xD6E8FEB86659FD93
_K_ROOT = 0x2545F4914F6CDD1D
# murmur3's fmix64, for the check value g.
_M1 = 0xFF51AFD7ED558CCD
_M2 = 0xC4CEB9FE1A85EC53
_K_CHECK = 0x9FB21C651E98DF25
_K_FINGERPRINT = 0xA0761D6478BD642F
_LOW32 = (1 << 32) - 1


def mix(h: int) -> int:
    """The position of element ``h``: a bijection of the 64-bit integers."""
    z = (h + _C0) & _MASK
    z = ((z ^ (z >> 30)) * _C1) & _MASK
    z = ((z ^ (z >> 27)) * _C2) & _MASK
    return z ^ (z >> 31)


def unmix(s: int) -> int:
    """The inverse of ``mix``."""
    z = s ^ (s >> 31) ^ (s >> 62)
    z = (z * _C2_INV) & _MASK
    z = z ^ (z >> 27) ^ (z >> 54)
    z = (z * _C1_INV) & _MASK
    z = z ^ (z >> 30) ^ (z >> 60)
    return (z - _C0) & _MASK


def contribution(s: int) -> int:
    """The pair ``g(s) << 64 | c(s)`` that the element at position ``s`` XORs into summaries."""
    c = mix(s ^ _K_CONTRIB)
    z = s ^ _K_CHECK
    z = ((z ^ (z >> 33)) * _M1) & _MASK
    z = ((z ^ (z >> 33)) * _M2) & _MASK
    return (z ^ (z >> 33)) << 64 | c


def position_of_contribution(x: int) -> int:
    """The position ``s`` whose ``c(s)`` is ``x`` (``c`` is a bijection)."""
    return unmix(x) ^ _K_CONTRIB


def slice_of(pair: int, slice_index: int, bits: int) -> int:
    """``bits`` bits of a keyed mix of a node's ``G << 64 | H``; ``slice_index`` picks the key."""
    key = (slice_index + 1) * _K_SLICE & _MASK
    return mix(mix((pair & _MASK) ^ key) ^ (pair >> 64)) >> (_BITS - bits)


def summary_of(pair: int, count: int, slice_index: int) -> int:
    """What a comparison carries for one descendant: a hash slice and the count modulo 4."""
    return slice_of(pair, slice_index, SyncQuery.SUMMARY_BITS - 2) << 2 | (count & 3)


def root_of(pair: int, count: int) -> int:
    """The 64-bit root hash announced for a set with root summary ``pair``: 0 when empty."""
    return mix(mix((pair & _MASK) ^ _K_ROOT) ^ (pair >> 64)) if count else 0


def fingerprint_bits(n: int) -> int:
    """The fingerprint width of an exchange carrying ``n`` fingerprints.

    Wider for more elements, so that the chance that one of the responder's elements matches one
    of the requester's by accident stays small. The three bands give disjoint byte lengths
    (at most 128; 195 to 12,288; at least 16,388), so the responder recovers ``n`` from the
    length alone (``fingerprint_count``).
    """
    return 16 if n <= 64 else 24 if n <= 4096 else 32


def fingerprint_count(length: int) -> int | None:
    """The number of fingerprints packed in ``length`` bytes, or None if no band fits."""
    if length % 2 == 0 and length // 2 <= 64:
        return length // 2
    if length % 3 == 0 and 64 < length // 3 <= 4096:
        return length // 3
    if length % 4 == 0 and length // 4 > 4096:
        return length // 4
    return None


def fingerprint(position: int, slice_index: int, bits: int) -> int:
    """``bits`` bits naming the element at ``position`` in an exchange; the pass picks the key."""
    key = (slice_index + 1) * _K_FINGERPRINT & _MASK
    return mix(position ^ key) >> (_BITS - bits)


def pack_fixed(values: Iterable[int], bits: int) -> bytes:
    """Fixed-width big-endian bit packing, zero-padded to a whole byte."""
    if bits == 8:
        return bytes(values)
    if bits % 8 == 0:
        width = bits // 8
        return b"".join(v.to_bytes(width, "big") for v in values)
    # Eight values make a whole number of bytes: pack them eight at a time.
    items = list(values)
    n = len(items)
    items += [0] * (-n % 8)
    out = []
    for i in range(0, len(items), 8):
        acc = 0
        for v in items[i : i + 8]:
            acc = acc << bits | v
        out.append(acc.to_bytes(bits, "big"))
    return b"".join(out)[: packed_length(n, bits)]


def unpack_fixed(data: bytes, bits: int, n: int) -> list[int]:
    """The first ``n`` values of ``bits`` bits packed in ``data`` (long enough)."""
    if bits == 8:
        return list(data[:n])
    if bits % 8 == 0:
        width = bits // 8
        return [int.from_bytes(data[i : i + width], "big") for i in range(0, n * width, width)]
    mask = (1 << bits) - 1
    padded = data + bytes(-len(data) % bits)
    out: list[int] = []
    for i in range(0, packed_length(n, bits), bits):
        acc = int.from_bytes(padded[i : i + bits], "big")
        out += [(acc >> (bits * (7 - k))) & mask for k in range(8)]
    return out[:n]


def packed_length(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def pack_elements(values: Iterable[int]) -> bytes:
    return b"".join(v.to_bytes(8, "big") for v in values)


def unpack_elements(data: bytes) -> list[int]:
    """8-byte big-endian integers; the caller has checked ``len(data) % 8 == 0``."""
    return [int.from_bytes(data[i : i + 8], "big") for i in range(0, len(data), 8)]


def pack_bitmap(indices: Iterable[int], n: int) -> bytes:
    out = bytearray((n + 7) // 8)
    for i in indices:
        out[i >> 3] |= 0x80 >> (i & 7)
    return bytes(out)


def bitmap_indices(bitmap: bytes) -> list[int]:
    """The set bits of a bitmap in increasing order (bit ``i`` is ``0x80 >> i % 8`` of byte
    ``i // 8``)."""
    out = []
    for byte_index, byte in enumerate(bitmap):
        if byte:
            base = byte_index << 3
            for bit in range(8):
                if byte & (0x80 >> bit):
                    out.append(base + bit)
    return out


def under(s: int, level: int, prefix: int) -> bool:
    """Whether position ``s`` lies under node ``(level, prefix)``."""
    return (s >> (_BITS - level)) == prefix if level else True


#: ``MerkleDigest.apply_delta``'s results while sharing is on (``share_applied_deltas``):
#: ``(pair, count, id(added), id(removed))`` of the set before -> ``(added, removed, set after,
#: pair after, elements added, elements removed)``; the entry holds the tuples, so their ids
#: stay theirs while it lives. Cleared when full.
_SHARED_DELTAS: dict[tuple[int, int, int, int], tuple[Any, ...]] = {}
_SHARED_DELTAS_MAX = 1 << 12
#: ``root_of`` by ``(pair, count)`` while sharing is on (a pure function; cleared when full)
_SHARED_ROOTS: dict[tuple[int, int], int] = {}
_sharing = False


def share_applied_deltas(on: bool) -> None:
    """Turn the memo of flat digests' delta results on or off for the process (see "Shared
    deltas" above; the simulator turns it on for its run). Turning it off drops the memo;
    digests holding shared sets keep them, copying before any change."""
    global _sharing
    _sharing = on
    if not on:
        _SHARED_DELTAS.clear()
        _SHARED_ROOTS.clear()


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
        "_flat_shared", "_root_memo",
    )

    def __init__(self, observer: CacheObserver | None = None, *, lazy: bool = False) -> None:
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

    def apply_delta(self, added: Iterable[int], removed: Iterable[int]) -> None:
        """Discard every element of ``removed``, then add every element of ``added``.

        The same as those calls one by one, but a flat digest does it in one loop each and an
        observer with ``blocks_changed`` hears of all the real changes in one call.
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
        if _sharing and type(added) is tuple and type(removed) is tuple:
            key = (self._flat_pair, len(flat), id(added), id(removed))
            hit = _SHARED_DELTAS.get(key)
            if hit is not None and hit[0] is added and hit[1] is removed:
                self._flat, self._flat_pair = hit[2], hit[3]
                self._flat_shared = True
                if hit[4] or hit[5]:
                    batch(hit[4], hit[5])
                return
            flat = set(flat)  # the result will be shared: never the set we hold
        elif self._flat_shared:
            flat = self._own_flat()
        # ``_contribution_of`` inlined: this loop runs for every hash of every announcement at
        # every peer, and the call was a tenth of a 64-node simulation's announcement cost.
        pair = self._flat_pair
        memo = _CONTRIBUTIONS
        gone: list[BlockHash] = []
        new: list[BlockHash] = []
        for h in removed:
            if h in flat:
                flat.discard(h)
                c = memo.get(h)
                pair ^= c if c is not None else _contribution_of(h)
                gone.append(BlockHash(h))
        for h in added:
            if h not in flat:
                flat.add(h)
                c = memo.get(h)
                pair ^= c if c is not None else _contribution_of(h)
                new.append(BlockHash(h))
        self._flat_pair = pair
        if key is not None:
            if len(_SHARED_DELTAS) >= _SHARED_DELTAS_MAX:
                _SHARED_DELTAS.clear()
            _SHARED_DELTAS[key] = (added, removed, flat, pair, new, gone)
            self._flat = flat
            self._flat_shared = True
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
        pair, count = self.node_summary(0, 0)
        memo = self._root_memo
        if memo[0] == pair and memo[1] == count:
            return memo[2]
        if _sharing:  # the replicas holding one shared set ask for the same root
            key = (pair, count)
            found = _SHARED_ROOTS.get(key)
            if found is None:
                if len(_SHARED_ROOTS) >= _SHARED_DELTAS_MAX:
                    _SHARED_ROOTS.clear()
                found = _SHARED_ROOTS[key] = root_of(pair, count)
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


@dataclass(frozen=True, slots=True)
class EpochDelta:
    """What ``LocalDigest.seal_epoch`` closed: the net changes from ``prev_epoch`` to ``epoch``.

    ``added``/``removed`` are empty and ``truncated`` is True when either would exceed
    ``messages.MAX_DELTA`` (a partial delta is useless: the receiver checks the root).
    """

    prev_epoch: int
    epoch: int
    root: int
    count: int
    added: tuple[BlockHash, ...]
    removed: tuple[BlockHash, ...]
    truncated: bool


class LocalDigest:
    """This node's own cache digest, its epochs and a bounded log of their deltas.

    Epochs start at ``epoch_base + 1`` and only grow (pass e.g. the boot time in seconds so that
    a restarted node's epochs stay above those it announced before). The log keeps the deltas of
    the most recent epochs while they hold at most ``max_log_changes`` changes in all.
    """

    __slots__ = (
        "digest",
        "epoch",
        "max_log_changes",
        "_pending_added",
        "_pending_removed",
        "_log",
        "_log_changes",
        "_log_floor",
    )

    def __init__(self, epoch_base: int = 0, max_log_changes: int = 65_536) -> None:
        if epoch_base < 0 or max_log_changes < 0:
            raise ValueError("epoch_base and max_log_changes must be >= 0")
        self.digest = MerkleDigest()
        self.epoch = epoch_base
        self.max_log_changes = max_log_changes
        self._pending_added: set[BlockHash] = set()
        self._pending_removed: set[BlockHash] = set()
        # (epoch, added, removed) for every epoch after _log_floor, oldest first.
        self._log: deque[tuple[int, tuple[BlockHash, ...], tuple[BlockHash, ...]]] = deque()
        self._log_changes = 0
        self._log_floor = epoch_base

    @property
    def root(self) -> int:
        return self.digest.root

    @property
    def count(self) -> int:
        return len(self.digest)

    def block_added(self, h: BlockHash) -> None:
        if self.digest.add(h):
            if h in self._pending_removed:
                self._pending_removed.discard(h)
            else:
                self._pending_added.add(h)

    def block_removed(self, h: BlockHash) -> None:
        if self.digest.discard(h):
            if h in self._pending_added:
                self._pending_added.discard(h)
            else:
                self._pending_removed.add(h)

    def has_pending_changes(self) -> bool:
        return bool(self._pending_added or self._pending_removed)

    def seal_epoch(self) -> EpochDelta:
        """Close the pending changes into a new epoch and return its delta."""
        added = tuple(sorted(self._pending_added))
        removed = tuple(sorted(self._pending_removed))
        self._pending_added = set()
        self._pending_removed = set()
        prev = self.epoch
        self.epoch += 1
        self._log.append((self.epoch, added, removed))
        self._log_changes += len(added) + len(removed)
        while self._log and self._log_changes > self.max_log_changes:
            epoch, a, r = self._log.popleft()
            self._log_changes -= len(a) + len(r)
            self._log_floor = epoch
        truncated = len(added) > MAX_DELTA or len(removed) > MAX_DELTA
        if truncated:
            added, removed = (), ()
        return EpochDelta(prev, self.epoch, self.root, self.count, added, removed, truncated)

    def delta_since(self, since_epoch: int) -> tuple[list[int], list[int]] | None:
        """The net changes from epoch ``since_epoch`` to the live set, if the log reaches back."""
        if not self._log_floor <= since_epoch <= self.epoch:
            return None
        added: set[int] = set()
        removed: set[int] = set()
        epochs: list[tuple[Iterable[int], Iterable[int]]] = [
            (a, r) for epoch, a, r in self._log if epoch > since_epoch
        ]
        epochs.append((self._pending_added, self._pending_removed))
        for a, r in epochs:
            for h in a:  # absent before this epoch, present after it
                if h in removed:
                    removed.discard(h)
                else:
                    added.add(h)
            for h in r:
                if h in added:
                    added.discard(h)
                else:
                    removed.add(h)
            if len(added) + len(removed) > DELTA_CAP:
                return None
        return sorted(added), sorted(removed)

    def answer(self, request: SyncRequest) -> SyncResponse:
        """The responder: a pure function of the current state (raises ProtocolError on a
        query that breaks the protocol's rules; see ``messages.SyncQuery``).

        A request whose ``since_epoch`` the log reaches back to is answered with the net delta.
        Otherwise the queries are answered in order, always the first, then while the response
        budgets last (``RESPONSE_ELEMENT_BUDGET``, ``RESPONSE_WORK_BUDGET``, the length of
        ``SyncNode.counts``). A comparison marks the descendants whose summary differs from the
        requester's. An exchange sends the elements whose fingerprint the requester did not
        send and marks the requester's fingerprints it does not hold; an exchange on a node of
        more than ``LIST_CAP`` elements is answered with the count alone.
        """
        digest = self.digest
        header = (request.session, self.epoch, digest.root, len(digest))
        if request.since_epoch > 0:
            delta = self.delta_since(request.since_epoch)
            if delta is not None:
                added, removed = delta
                return SyncResponse(
                    *header, delta=True, added=pack_elements(added), removed=pack_elements(removed)
                )
        j = request.slice
        counts: list[int] = []
        bitmaps: list[bytes] = []
        hashes: list[bytes] = []
        elements: list[bytes] = []
        answered = 0
        elements_left = RESPONSE_ELEMENT_BUDGET
        work_left = RESPONSE_WORK_BUDGET
        counts_left = RESPONSE_COUNTS_BUDGET
        for q in request.queries:
            n_fingerprints = _check_query(q)
            if q.span == 0:
                count = digest.node_summary(q.level, q.prefix)[1]
                work = min(count, LIST_CAP) + n_fingerprints
                if answered and (
                    work > work_left or min(count, LIST_CAP) > elements_left or counts_left < 2
                ):
                    break
                work_left -= work
                counts_left -= 2
                if count > LIST_CAP:
                    counts += (count, 0)
                    bitmaps.append(bytes(packed_length(n_fingerprints, 1)))
                else:
                    bits = fingerprint_bits(n_fingerprints)
                    theirs = unpack_fixed(q.summaries, bits, n_fingerprints)
                    members = digest.positions_under(q.level, q.prefix)
                    mine = {fingerprint(p, j, bits) for p in members}
                    their_set = set(theirs)
                    send = [p for p in members if fingerprint(p, j, bits) not in their_set]
                    absent = [i for i, f in enumerate(theirs) if f not in mine]
                    elements_left -= len(send)
                    counts += (count, len(send))
                    bitmaps.append(pack_bitmap(absent, n_fingerprints))
                    elements.append(pack_elements(unmix(p) for p in send))
                answered += 1
                continue
            n = 1 << q.span
            if answered and (n > work_left or n + 1 > counts_left):
                break
            work_left -= n
            theirs = unpack_fixed(q.summaries, SyncQuery.SUMMARY_BITS, n)
            pairs, child_counts = digest.children(q.level, q.prefix, q.span)
            empty = summary_of(0, 0, j)  # most descendants of a sparse region are empty
            marked = [
                i
                for i in range(n)
                if (summary_of(pairs[i], child_counts[i], j) if child_counts[i] else empty)
                != theirs[i]
            ]
            counts_left -= 1 + len(marked)
            counts.append(sum(child_counts))
            counts += (child_counts[i] for i in marked)
            bitmaps.append(pack_bitmap(marked, n))
            if len(marked) <= n * HASH_DENSITY:
                for i in marked:
                    step = (child_counts[i] - theirs[i]) & 3
                    if step == 1:
                        hashes.append((pairs[i] & _MASK).to_bytes(8, "big"))
                    elif step == 3:
                        hashes.append((pairs[i] & _LOW32).to_bytes(4, "big"))
            answered += 1
        answers = SyncNode(
            answered, tuple(counts), b"".join(bitmaps), b"".join(hashes), b"".join(elements)
        )
        return SyncResponse(*header, answers=answers)


def _check_query(q: SyncQuery) -> int:
    """Raise ProtocolError unless the query is well formed; its fingerprint count (exchanges)."""
    if q.prefix >> q.level:
        raise ProtocolError(f"SyncQuery prefix {q.prefix:#x} does not fit level {q.level}")
    if q.span > SyncQuery.MAX_SPAN or q.level + q.span > _BITS:
        raise ProtocolError(f"SyncQuery span {q.span} is too wide at level {q.level}")
    if q.span:
        expected = packed_length(1 << q.span, SyncQuery.SUMMARY_BITS)
        if len(q.summaries) != expected:
            raise ProtocolError(
                f"SyncQuery summaries of {len(q.summaries)} bytes, expected {expected}"
            )
        return 0
    n = fingerprint_count(len(q.summaries))
    if n is None:
        raise ProtocolError(f"SyncQuery fingerprints of {len(q.summaries)} bytes fit no width")
    return n
