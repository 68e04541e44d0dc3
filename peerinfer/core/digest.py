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
A flat digest given a ``DeltaMemo`` (``MerkleDigest(memo=...)``, which a ``Replica`` passes on:
the simulator creates one memo per run and hands it to its cores) memoizes ``apply_delta``'s
result there, keyed by
the set's root summary and size and the identity of the delta's tuples: the first replica builds
a new set (a copy, then the delta), the next ones holding the same set (the same summary and
size: a 128-bit XOR of hashed contributions, which random block hashes do not collide in) adopt
that set object. A digest holding a shared set copies it before changing it in place (copy on
write). Replicas that took the same announcements in then share one set in memory instead of
one each. A result is left in the memo only where another digest may read it: a shared run
(``peerinfer.core.announcerun``) whose every recipient follows it, in its sender's last delay
group, applies the delta for them all, and ``apply_delta(share=False)`` stores nothing (with one
delay and no loss, every store was such a run's, and none was ever read; with several delays or
with loss, most lookups hit). No memo by default: a real node hands each announcement to one
replica, where the memo could only cost a copy per announcement. The memo is an object passed in, never module state, so
two simulations in one process (or a simulation beside a node) share nothing.

*This node's digest* (``peerinfer.core.localdigest``). ``LocalDigest`` wraps the digest of this node's own cache with *epochs*: the
engine's changes accumulate as pending net changes until ``seal_epoch`` closes them into a new
epoch, returning the delta that an announcement carries. A bounded log of past epochs' deltas
lets ``answer`` serve a requester whose replica matched a recent epoch with the net delta alone;
otherwise it answers the requester's Merkle queries (see ``answer``). Its digest is lazy too: the
engine adds and evicts blocks with every request it serves, while only a pull's subtree query
needs the trie, which is built then (and kept: it is updated as before from there on). Until
then each change is a set operation and an XOR, not a walk down the trie (a tenth of a 64-node
simulation's CPU). The same summaries and answers; an exchange lists its elements in the
trie's leaf order, which for a trie built from the set is not the order of the adds (the
requester reads them as a set).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# The digest is three modules: the arithmetic (merklehash), the set with its summary (merkle) and
# this node's own digest (here); this module re-exports the other two's names, where the digest's
# users import them from.
from peerinfer.core.merkle import BatchCacheObserver, CacheObserver, DeltaMemo, MerkleDigest
from peerinfer.core.merklehash import (
    _BITS,
    _LOW32,
    _MASK,
    DELTA_CAP,
    HASH_DENSITY,
    LEAF_MAX,
    LEAF_MIN,
    LIST_CAP,
    RESPONSE_COUNTS_BUDGET,
    RESPONSE_ELEMENT_BUDGET,
    RESPONSE_WORK_BUDGET,
    bitmap_indices,
    contribution,
    fingerprint,
    fingerprint_bits,
    fingerprint_count,
    mix,
    pack_bitmap,
    pack_elements,
    pack_fixed,
    packed_length,
    position_of_contribution,
    root_of,
    slice_of,
    summary_of,
    under,
    unmix,
    unpack_elements,
    unpack_fixed,
)
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
    "DeltaMemo",
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
        self.digest = MerkleDigest(lazy=True)  # (flat until a subtree query: above)
        self.epoch = epoch_base
        self.max_log_changes = max_log_changes
        self._pending_added: set[BlockHash] = set()
        self._pending_removed: set[BlockHash] = set()
        # (epoch, added, removed) for every epoch with changes after _log_floor, oldest first.
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

    def blocks_changed(self, added: Sequence[BlockHash], removed: Sequence[BlockHash]) -> None:
        """``block_removed`` for each of ``removed``, then ``block_added`` for each of
        ``added``: the same digest and pending changes, in one pass over each (the engine
        reports a request's changes together)."""
        if not (added or removed):
            return
        new, gone = self.digest.apply_changes(added, removed)
        pending_added, pending_removed = self._pending_added, self._pending_removed
        for h in gone:
            if h in pending_added:
                pending_added.discard(h)
            else:
                pending_removed.add(h)
        for h in new:
            if h in pending_removed:
                pending_removed.discard(h)
            else:
                pending_added.add(h)

    def has_pending_changes(self) -> bool:
        return bool(self._pending_added or self._pending_removed)

    def seal_epoch(self) -> EpochDelta:
        """Close the pending changes into a new epoch and return its delta."""
        return EpochDelta(*self.seal())

    def seal(self) -> tuple[int, int, int, int, tuple[BlockHash, ...], tuple[BlockHash, ...], bool]:
        """``seal_epoch``'s delta as a plain tuple, in ``EpochDelta``'s field order (the node
        seals an epoch at every announcement it makes, and reads the fields once)."""
        prev = self.epoch
        epoch = self.epoch = prev + 1
        log = self._log
        if self._pending_added or self._pending_removed:
            added = tuple(sorted(self._pending_added))
            removed = tuple(sorted(self._pending_removed))
            self._pending_added = set()
            self._pending_removed = set()
            log.append((epoch, added, removed))
            self._log_changes += len(added) + len(removed)
        else:
            # Most announcements are the periodic ones, nothing changed since the last. Their
            # epochs are not logged: ``delta_since`` reads nothing from them, and the floor
            # they would have set is always overwritten by the next epoch with changes popped
            # (popping them never lowers the count); logged, they grew the log by one entry
            # per announcement interval for as long as the node runs.
            added = removed = ()
        while log and self._log_changes > self.max_log_changes:
            floor, a, r = log.popleft()
            self._log_changes -= len(a) + len(r)
            self._log_floor = floor
        truncated = len(added) > MAX_DELTA or len(removed) > MAX_DELTA
        if truncated:
            added, removed = (), ()
        return prev, epoch, self.digest.root, len(self.digest), added, removed, truncated

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
