"""The radix prefix cache: which prompt prefixes this node holds KV state for, and what to evict.

Algorithm
---------
The cache is a tree of *blocks* (after SGLang's original ``radix_cache.py``, paged at a fixed
block size). Every node but the root stands for one full block of ``block_size`` tokens; the path
from the root to a node spells a cached prompt prefix. Children are keyed by their block's token
tuple, so looking a prompt up is one dict probe per block on tuple slices of the prompt. Each node
carries the chain hash of its prefix (``PrefixHasher.block_hash(parent.hash, key)``, computed once
when the node is created): that is what digests and routing talk about. A trailing partial block
is never cached: it cannot be shared at block granularity.

The tree is **prefix-closed**: a block is cached only if all its ancestors are, because eviction
only ever removes *leaves*. Each node carries an opaque ``payload`` (the engine's KV segment for
that block) and the ``nbytes`` it is accounted for; the cache never frees payloads itself, it
calls ``on_evict(node)`` for every node it removes and the engine frees the memory there.

**Pins.** ``lock(node)`` adds one to ``lock_ref`` on the node and on every ancestor, ``unlock``
takes it away; so ``lock_ref > 0`` exactly when some pin is held on the node or below it, and a
node with ``lock_ref > 0`` is never evicted. A request pins its matched path while it runs.

**LRU with logical ticks** (as Hypothesis's ``GenericCache``; never a clock). The cache keeps a
counter ``tick`` that grows by one per ``match(touch=True)`` and per ``insert``; both stamp every
node of the path they walk with the new tick, so a parent's tick is always >= its children's.
Eviction removes the unpinned leaf with the smallest tick. Two evictable leaves never share a
tick (the nodes still stamped with tick ``t`` form one chain of the path walked at ``t``, and only
the bottom of a chain can be a leaf), so the order is fully determined.

**Lazy heap.** Evictable leaves are found through a binary heap of ``(tick, seq, node)`` entries.
An entry is pushed whenever a node *becomes* an evictable leaf with some tick: it is created at
the bottom of an insert, it is stamped while being a leaf, its last child is evicted, or its last
pin is released. Entries are never removed eagerly; a popped entry is valid only if the node is
still in the tree, has no children, is unpinned and still has that tick. Invariant: every
evictable leaf has a valid entry. Stale entries are dropped in one pass (O(heap)) when the heap
grows past twice its size after the last compaction (plus a constant), so every operation costs
amortized O(log n) for the heap on top of its O(blocks walked), whatever the workload.

**Capacity** is in tokens (``blocks * block_size``) and/or bytes (sum of ``nbytes``); ``None`` is
unbounded. ``insert`` evicts LRU leaves before adding each new block that would not fit, never
the path it is inserting into (whose only possible leaf is the current bottom node, held aside);
if no room can be made it stops there and hands the payloads it could not store back to the
caller. Accounting is exact, so the cache never exceeds its capacity.

**Reservations.** Running requests hold KV memory the cache does not (their working state), and
it comes out of the same byte budget. ``reserve(n)`` sets ``n`` bytes aside, evicting LRU
unpinned leaves until ``bytes + reserved <= capacity_bytes``; every later insert makes room
within what is left. Since pins are ancestor-closed, every unpinned block can be evicted (leaves
first), so a reservation fits exactly when ``pinned bytes + reserved + n <= capacity_bytes``;
``reserve`` checks that first and evicts nothing when it fails (the caller waits for running
requests to end). ``release(n)`` gives the bytes back. Pinned bytes are counted as pins change.

Callbacks (``on_evict`` and observers) run synchronously inside the operation that caused them,
after the tree is consistent again; they must not raise and must not call back into the cache.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from operator import index
from typing import Any

from peerinfer.core.prefix import PrefixHasher
from peerinfer.core.radixnode import CacheObserver, CacheStats, InsertResult, MatchResult, RadixNode
from peerinfer.errors import ConfigError
from peerinfer.types import BlockHash

#: Compaction slack: the heap may hold this many entries beyond twice its last compacted size.
_HEAP_SLACK = 1024


class RadixCache:
    """A prefix-closed block tree with pins, logical-tick LRU eviction and exact accounting."""

    def __init__(
        self,
        hasher: PrefixHasher,
        *,
        capacity_tokens: int | None = None,
        capacity_bytes: int | None = None,
        on_evict: Callable[[RadixNode], None] | None = None,
    ) -> None:
        if capacity_tokens is not None and capacity_tokens < 0:
            raise ConfigError(f"capacity_tokens must be >= 0 or None, got {capacity_tokens}")
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ConfigError(f"capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        self.hasher = hasher
        self.block_size: int = hasher.block_size
        self.capacity_tokens = capacity_tokens
        self.capacity_bytes = capacity_bytes
        self._on_evict = on_evict
        self._observers: list[CacheObserver] = []
        self._root = RadixNode(None, (), hasher.root)
        self._by_hash: dict[BlockHash, RadixNode] = {}
        self._tick = 0
        self._bytes = 0
        self._locked = 0
        self._locked_bytes = 0
        self._reserved = 0
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._seq = 0
        self._heap_limit = _HEAP_SLACK
        self._queries = 0
        self._hit_queries = 0
        self._query_tokens = 0
        self._hit_tokens = 0
        self._inserted = 0
        self._evicted = 0

    # ---------------------------------------------------------------- observers and lookups

    @property
    def root(self) -> RadixNode:
        """The root node (no block; its hash is the hasher's root)."""
        return self._root

    @property
    def tick(self) -> int:
        """The logical clock: the tick stamped by the last touching operation."""
        return self._tick

    def add_observer(self, observer: CacheObserver) -> None:
        """Tell ``observer`` of every block added or removed from now on.

        Blocks already cached are reported to it at once with ``block_added``, so an observer's
        view always equals ``block_hashes()``.
        """
        self._observers.append(observer)
        for h in list(self._by_hash):
            observer.block_added(h)

    def remove_observer(self, observer: CacheObserver) -> None:
        """Stop telling ``observer`` (no ``block_removed`` is sent for the blocks it knew)."""
        self._observers.remove(observer)

    def block_hashes(self) -> Iterator[BlockHash]:
        """The chain hash of every cached block (a snapshot, any order)."""
        return iter(list(self._by_hash))

    def node_by_hash(self, h: BlockHash) -> RadixNode | None:
        """The cached node whose chain hash is ``h``, if any."""
        return self._by_hash.get(h)

    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, h: object) -> bool:
        return h in self._by_hash

    def membership(self) -> Callable[[object], bool]:
        """``h in self`` as a function called in C (the block index's own test, which lives as
        long as the cache): for a caller that tests many hashes through ``filter``."""
        return self._by_hash.__contains__

    # ---------------------------------------------------------------- match

    def match(self, tokens: Sequence[int], *, touch: bool = True) -> MatchResult:
        """The longest cached prefix of ``tokens`` (whole blocks only).

        With ``touch`` (the default) this is a query: the matched path is stamped with a new tick
        and the hit statistics are updated. ``touch=False`` is a pure peek (routing estimates).
        The nodes are valid until evicted; lock the last one to keep them.
        """
        bs = self.block_size
        node = self._root
        path: list[RadixNode] = []
        append = path.append
        # zip over one iterator repeated bs times yields the full blocks as tuples, cut in C:
        # markedly faster than slicing in a Python loop (the hot path of every request).
        for key in zip(*[iter(tokens)] * bs, strict=False):
            child = node.children.get(key)
            if child is None:
                break
            append(child)
            node = child
        if touch:
            self._tick = tick = self._tick + 1
            self._root.last_access = tick
            for n in path:
                n.last_access = tick
            self._queries += 1
            self._query_tokens += len(tokens)
            if path:
                self._hit_queries += 1
                self._hit_tokens += len(path) * bs
                if not node.children and not node.lock_ref:
                    self._push(node)
        return MatchResult(len(path) * bs, tuple(path), self._root.hash)

    # ---------------------------------------------------------------- insert

    def insert(
        self,
        tokens: Sequence[int],
        payloads: Sequence[Any] | None = None,
        nbytes: Sequence[int] | int = 0,
    ) -> InsertResult:
        """Cache every full block of ``tokens``, evicting LRU leaves to stay within capacity.

        ``payloads[i]`` and ``nbytes[i]`` belong to full block ``i``; both may also carry one
        entry for a trailing partial block, which is ignored (its payload is returned unused).
        ``nbytes`` may be one int for every block. Blocks already cached keep their payload and
        size; the given payload is returned in ``unused_payloads`` (unless it *is* the stored
        payload, as when a caller re-inserts what ``match`` gave it). If a block cannot be made room
        for (everything else evictable is pinned, or the block alone exceeds the capacity), the
        insert stops there and the payloads of that block and all after it are returned unused.
        The whole path is stamped with a new tick.
        """
        bs = self.block_size
        n_full = len(tokens) // bs
        n_any = -(-len(tokens) // bs)
        if payloads is not None and len(payloads) not in (n_full, n_any):
            raise ValueError(
                f"{len(payloads)} payloads for {n_full} full blocks of {len(tokens)} tokens"
            )
        sizes: Sequence[int] | None
        if isinstance(nbytes, int):
            if nbytes < 0:
                raise ValueError(f"nbytes must be >= 0, got {nbytes}")
            sizes, size = None, nbytes
        else:
            if len(nbytes) not in (n_full, n_any):
                raise ValueError(
                    f"{len(nbytes)} nbytes for {n_full} full blocks of {len(tokens)} tokens"
                )
            if any(s < 0 for s in nbytes):
                raise ValueError("nbytes must be >= 0")
            sizes, size = nbytes, 0
        self._tick = tick = self._tick + 1
        root = self._root
        root.last_access = tick
        block_hash = self.hasher.block_hash
        node = root
        path: list[RadixNode] = []
        unused: list[Any] = []
        inserted = 0
        try:
            for i, key in enumerate(zip(*[iter(tokens)] * bs, strict=False)):
                child = node.children.get(key)
                if child is not None:
                    child.last_access = tick
                    path.append(child)
                    node = child
                    # Handing back the very payload already stored is not an offer of a new
                    # one: the caller must not free it.
                    if payloads is not None and payloads[i] is not child.payload:
                        unused.append(payloads[i])
                    continue
                if sizes is not None:
                    size = sizes[i]
                h = block_hash(node.hash, key)  # raises ValueError on bad token ids
                key = tuple(map(index, key))  # stored keys are plain ints (e.g. not numpy's)
                if not self._make_room(bs, size, node):
                    if payloads is not None:
                        unused.extend(payloads[i:n_full])
                    break
                node = self._attach(
                    node, key, h, None if payloads is None else payloads[i], size, tick
                )
                inserted += 1
                path.append(node)
        finally:
            # The bottom of the path is the only node this insert can have made a leaf.
            if node is not root and not node.children and not node.lock_ref:
                self._push(node)
        if payloads is not None and len(payloads) > n_full:
            unused.append(payloads[n_full])
        return InsertResult(inserted, len(path) * bs, tuple(path), tuple(unused))

    def match_insert(
        self,
        tokens: Sequence[int],
        head: int,
        nbytes: int = 0,
        chain: Sequence[BlockHash] = (),
        tail: Sequence[int] = (),
        ints: bool = False,
    ) -> int:
        """``match(seq[:head]).tokens``, then ``insert(seq, nbytes=nbytes)``, in one walk, where
        ``seq`` is ``tokens`` followed by ``tail``.

        A request served whole (the simulated engine's plan: its prompt, and its completion as
        ``tail``): the same tree, ticks, statistics, evictions and callbacks as the two calls,
        from one walk instead of two (``head`` must not exceed ``len(seq)``). ``seq`` is never
        made whole: only its tokens from the first block not cached on are joined (a prompt is
        hundreds of ids; most are cached). ``chain``, the chain hashes of leading full blocks
        of ``seq`` when the caller has them (``PrefixHasher.prompt_chain``), finds the cached
        blocks they name by hash, by halving, and names the new ones without hashing them;
        the blocks after it are walked by their tokens. A hash names its whole prefix (64
        bits: a collision, which this never checks for, is as unlikely as anywhere else in
        the protocol), so only a caller whose chain is the cache hasher's should pass one.
        Returns the matched tokens. The match's own pushes are left out: every node it would
        stamp, the insert stamps again, so an entry it pushed would be stale (the LRU order
        of the evictable leaves is their ticks'). ``ints``: the caller knows every token to
        be an ``int`` (a validated prompt, an engine's output), which ``operator.index`` gives
        back as it is, so a new block's key is its tuple slice as it is (``insert`` converts
        each token)."""
        bs = self.block_size
        length = len(tokens) + len(tail)
        if not 0 <= head <= length:
            raise ValueError(f"head {head} outside the {length} tokens")
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        n_full = length // bs
        by_hash = self._by_hash
        root = self._root
        node = root
        k = 0  # the leading blocks cached
        if chain:
            chain = chain[:n_full]
            # The tree is prefix-closed, so the chain's cached blocks are a prefix of it: the
            # first one not cached is found by halving (reversed, the blocks cached are the
            # last ones, and ``bisect`` reads the keys in C), and its parent ends the path.
            k = len(chain) - bisect_left(chain[::-1], True, key=by_hash.__contains__)
            if k:
                node = by_hash[chain[k - 1]]
        # ``seq`` from block ``k`` on: ``rest[j]`` is ``seq[start + j]``.
        start = k * bs
        rest = tokens[start:]
        if tail:
            rest = tuple(rest) + tuple(tail[max(0, start - len(tokens)) :])
        if k == len(chain):
            # The rest of the cached prefix, by the tokens (past the chain, or without one).
            children = node.children
            for key in zip(*[iter(rest[: n_full * bs - start])] * bs, strict=False):
                child = children.get(key)
                if child is None:
                    break
                k += 1
                node = child
                children = child.children
        # The match: a query of the leading blocks of ``seq[:head]``.
        matched = min(k, head // bs)
        self._queries += 1
        self._query_tokens += head
        if matched:
            self._hit_queries += 1
            self._hit_tokens += matched * bs
        # The insert: every node of the path stamped (the bottom's ancestors), then the
        # blocks not cached.
        self._tick = tick = self._tick + 2
        n = node
        while n is not root:
            n.last_access = tick
            n = n.parent  # type: ignore[assignment]  # (only the root's is None)
        root.last_access = tick
        block_hash = self.hasher.block_hash
        n_chain = len(chain)
        make_room, attach = self._make_room, self._attach
        try:
            for i in range(k, n_full):
                block = rest[i * bs - start : (i + 1) * bs - start]
                h = chain[i] if i < n_chain else block_hash(node.hash, block)  # (bad ids: ValueError)
                key = block if ints and type(block) is tuple else tuple(map(index, block))
                if not make_room(bs, nbytes, node):
                    break
                node = attach(node, key, h, None, nbytes, tick)
        finally:
            if node is not root and not node.children and not node.lock_ref:
                self._push(node)
        return matched * bs

    def _attach(
        self, parent: RadixNode, key: tuple[int, ...], h: BlockHash, payload: Any, size: int,
        tick: int,
    ) -> RadixNode:
        """A new block under ``parent`` (room made by the caller): indexed, counted, and told
        to the observers (``insert`` and ``match_insert`` both add blocks this way)."""
        child = RadixNode(parent, key, h, payload, size, tick)
        parent.children[key] = child
        self._by_hash[h] = child
        self._bytes += size
        self._inserted += 1
        for observer in self._observers:
            observer.block_added(h)
        return child

    # ---------------------------------------------------------------- pins

    def lock(self, node: RadixNode | None) -> None:
        """Pin ``node`` and all its ancestors against eviction (counted; None/root: no-op)."""
        if node is None or node is self._root:
            return
        self._check_attached(node)
        n: RadixNode | None = node
        while n is not None and n.depth > 0:
            if n.lock_ref == 0:
                self._locked += 1
                self._locked_bytes += n.nbytes
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: RadixNode | None) -> None:
        """Release one pin taken with ``lock(node)`` (None/root: no-op)."""
        if node is None or node is self._root:
            return
        self._check_attached(node)
        if node.lock_ref <= 0:
            raise ValueError(f"unlock of a node that is not locked: {node!r}")
        n: RadixNode | None = node
        while n is not None and n.depth > 0:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._locked -= 1
                self._locked_bytes -= n.nbytes
                if not n.children:
                    self._push(n)
            n = n.parent

    def _check_attached(self, node: RadixNode) -> None:
        n = node
        while n.parent is not None:
            n = n.parent
        if n is not self._root:
            what = "an evicted node" if node.evicted or n.depth > 0 else "a node of another cache"
            raise ValueError(f"cannot (un)lock {what}: {node!r}")

    # ---------------------------------------------------------------- reservations

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the budget set aside with ``reserve`` and not released yet."""
        return self._reserved

    def reserve(self, nbytes: int) -> bool:
        """Set ``nbytes`` of the byte budget aside for memory outside the cache, evicting LRU
        unpinned leaves to make room. Returns False, evicting nothing, if even evicting every
        unpinned block would not make room. Unbounded in bytes: always True (still counted)."""
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        cap_b = self.capacity_bytes
        if cap_b is not None:
            if self._locked_bytes + self._reserved + nbytes > cap_b:
                return False
            while self._bytes + self._reserved + nbytes > cap_b:
                node = self._pop_evictable()
                assert node is not None, "an unpinned block must be evictable"
                self._evict_node(node)
        self._reserved += nbytes
        return True

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` taken with ``reserve``."""
        if type(nbytes) is not int or not 0 <= nbytes <= self._reserved:
            raise ValueError(f"cannot release {nbytes!r} bytes of {self._reserved} reserved")
        self._reserved -= nbytes

    # ---------------------------------------------------------------- eviction

    def evict(self, *, tokens: int = 0, bytes: int = 0) -> int:
        """Evict LRU unpinned leaves until at least ``tokens`` tokens and ``bytes`` bytes are freed
        (or nothing more can be). Returns the number of blocks evicted."""
        freed_tokens = freed_bytes = evicted = 0
        while freed_tokens < tokens or freed_bytes < bytes:
            node = self._pop_evictable()
            if node is None:
                break
            freed_tokens += self.block_size
            freed_bytes += node.nbytes
            evicted += 1
            self._evict_node(node)
        return evicted

    def clear(self) -> None:
        """Evict every unpinned block (``on_evict`` and observers are told of each)."""
        while (node := self._pop_evictable()) is not None:
            self._evict_node(node)

    def _make_room(self, tokens: int, nbytes: int, protect: RadixNode) -> bool:
        """Evict until ``tokens``/``nbytes`` more fit, sparing ``protect``; False if impossible."""
        cap_t = self.capacity_tokens
        cap_b = None if self.capacity_bytes is None else self.capacity_bytes - self._reserved
        by_hash, bs = self._by_hash, self.block_size
        if (cap_t is None or len(by_hash) * bs + tokens <= cap_t) and (
            cap_b is None or self._bytes + nbytes <= cap_b
        ):
            return True
        if (cap_t is not None and tokens > cap_t) or (cap_b is not None and nbytes > cap_b):
            return False
        held = False
        try:
            # It does not fit (above): evict, and check again after each block evicted.
            while True:
                node = self._pop_evictable()
                if node is None:
                    return False
                if node is protect:
                    held = True
                    continue
                self._evict_node(node)
                if (cap_t is None or len(by_hash) * bs + tokens <= cap_t) and (
                    cap_b is None or self._bytes + nbytes <= cap_b
                ):
                    return True
        finally:
            if held:
                self._push(protect)

    def _pop_evictable(self) -> RadixNode | None:
        """Pop the LRU evictable leaf off the lazy heap, dropping stale entries."""
        heap = self._heap
        while heap:
            tick, _, node = heapq.heappop(heap)
            if (
                node.last_access == tick
                and not node.children
                and not node.lock_ref
                and node.parent is not None
            ):
                return node
        return None

    def _evict_node(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        node.parent = None
        h = node.hash
        by_hash = self._by_hash
        if by_hash.get(h) is node:
            del by_hash[h]
        self._bytes -= node.nbytes
        self._evicted += 1
        if not parent.children and not parent.lock_ref and parent.depth > 0:
            self._push(parent)
        on_evict = self._on_evict
        if on_evict is not None:
            on_evict(node)
        for observer in self._observers:
            observer.block_removed(h)

    def _push(self, node: RadixNode) -> None:
        self._seq += 1
        heap = self._heap
        heapq.heappush(heap, (node.last_access, self._seq, node))
        if len(heap) > self._heap_limit:
            self._compact_heap()

    def _compact_heap(self) -> None:
        """Drop stale and duplicate entries; amortized O(1) per push (see module docstring)."""
        seen: set[int] = set()
        kept: list[tuple[int, int, RadixNode]] = []
        for entry in self._heap:
            tick, _, node = entry
            if (
                node.last_access == tick
                and not node.children
                and not node.lock_ref
                and node.parent is not None
                and id(node) not in seen
            ):
                seen.add(id(node))
                kept.append(entry)
        heapq.heapify(kept)
        self._heap = kept
        self._heap_limit = 2 * len(kept) + _HEAP_SLACK

    # ---------------------------------------------------------------- statistics and checks

    def stats(self) -> CacheStats:
        """A frozen snapshot of sizes and counters."""
        blocks = len(self._by_hash)
        return CacheStats(
            blocks=blocks,
            tokens=blocks * self.block_size,
            bytes=self._bytes,
            capacity_tokens=self.capacity_tokens,
            capacity_bytes=self.capacity_bytes,
            locked_blocks=self._locked,
            queries=self._queries,
            hit_queries=self._hit_queries,
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            inserted_blocks=self._inserted,
            evicted_blocks=self._evicted,
            reserved_bytes=self._reserved,
        )

    def check_invariants(self, *, verify_hashes: bool = True) -> None:
        """Raise AssertionError if the tree, pins, accounting or heap are inconsistent.

        O(blocks + heap); ``verify_hashes`` also recomputes every chain hash.
        """

        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise AssertionError(f"radix cache invariant violated: {msg}")

        root = self._root
        bs = self.block_size
        check(root.parent is None and root.depth == 0, "root has a parent or depth")
        check(root.hash == self.hasher.root, "root hash is not the hasher's root")
        check(root.lock_ref == 0, "root is locked")
        valid_entries = {
            id(node)
            for tick, _, node in self._heap
            if node.last_access == tick
            and not node.children
            and not node.lock_ref
            and node.parent is not None
        }
        blocks = total_bytes = locked = locked_bytes = 0
        stack = [root]
        while stack:
            node = stack.pop()
            if node.last_access > self._tick:
                check(False, f"tick from the future on {node!r}")
            child_locks = 0
            for key, child in node.children.items():
                problem = self._child_problem(node, key, child, verify_hashes)
                if problem is not None:
                    check(False, f"{child!r} {problem}")
                child_locks += child.lock_ref
                stack.append(child)
            if node is root:
                continue
            blocks += 1
            total_bytes += node.nbytes
            if node.lock_ref < child_locks:
                check(False, f"{node!r} has fewer pins than its children")
            if node.lock_ref:
                locked += 1
                locked_bytes += node.nbytes
            elif not node.children and id(node) not in valid_entries:
                check(False, f"evictable leaf {node!r} missing from the heap")
        check(blocks == len(self._by_hash), f"{blocks} nodes but {len(self._by_hash)} hashes")
        check(total_bytes == self._bytes, f"bytes {total_bytes} != accounted {self._bytes}")
        check(locked == self._locked, f"locked {locked} != accounted {self._locked}")
        check(
            locked_bytes == self._locked_bytes,
            f"locked bytes {locked_bytes} != accounted {self._locked_bytes}",
        )
        check(self._reserved >= 0, f"negative reservation {self._reserved}")
        if self.capacity_tokens is not None:
            check(blocks * bs <= self.capacity_tokens, "over token capacity")
        if self.capacity_bytes is not None:
            check(
                total_bytes + self._reserved <= self.capacity_bytes,
                f"bytes {total_bytes} + reserved {self._reserved} over capacity",
            )
        heap = self._heap
        check(
            all(heap[(i - 1) // 2][:2] <= heap[i][:2] for i in range(1, len(heap))),
            "heap order broken",
        )
        check(len(heap) <= self._heap_limit, "heap above its compaction limit")

    def _child_problem(
        self, parent: RadixNode, key: tuple[int, ...], child: RadixNode, verify_hash: bool
    ) -> str | None:
        """What is wrong with ``child`` filed under ``parent.children[key]``, if anything."""
        if child.parent is not parent:
            return "has the wrong parent"
        if child.key != key:
            return "is filed under another key"
        if len(key) != self.block_size or not all(type(t) is int for t in key):
            return "has a malformed key"
        if child.depth != parent.depth + 1:
            return "has the wrong depth"
        if child.last_access > parent.last_access:
            return "was touched after its parent"
        if verify_hash and child.hash != self.hasher.block_hash(parent.hash, key):
            return "has the wrong chain hash"
        if self._by_hash.get(child.hash) is not child:
            return "is not indexed by its hash"
        if child.nbytes < 0:
            return "has negative nbytes"
        return None


__all__ = [
    "CacheObserver",
    "CacheStats",
    "InsertResult",
    "MatchResult",
    "RadixCache",
    "RadixNode",
]
