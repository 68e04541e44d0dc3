"""Free checks of pulled KV: a bounded memo of the blocks this engine computed itself (issue 24).

When an engine computes a prompt's blocks (``Engine._store``) it marks them as its own
(:func:`remember_stored`: their hashes only, no bytes touched). When the cache drops one of
them (``Engine._on_evict``: eviction, or an emptied cache), the digest of its encoded bytes
(``encode_block``) is remembered by block hash (:func:`dropped`), up to ``MAX_DIGESTS`` blocks
(the least recently dropped are forgotten first; 16 bytes of digest a block, against ~370 KB
of the block itself on the default llama.cpp model). A block pulled later whose bytes have the
digest remembered for its hash is exactly what this engine computed: it needs no recompute.
That happens when this node computed a prefix, evicted it (no disk tier, or a full one), and
then pulls it back from a peer instead of recomputing it, so the digest is needed only once a
block is dropped, and is made then: a block that is never evicted costs nothing, and a
prefill does not encode and hash every block it stores (it did until Dec 6: 0.002 of a
2,000-token prefill's time on llama.cpp, 0.010-0.012 on float32 Transformers,
docs/performance.md).

Only blocks computed here are remembered: a pulled block that passed a sampled check was not
checked at every token, so remembering it would let a later pull of the same altered bytes
through for free. A digest that differs proves nothing (an honest peer's engine may round
differently: another CPU's kernels, a Transformers batch of another shape), so such a block is
checked as any other. Equal bytes are always safe to take, so the memo is on for every engine;
it pays where honest KV is bit-identical between nodes (llama.cpp on one kind of CPU: an
honest block compares at 0.0).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from peerinfer.types import BlockHash

if TYPE_CHECKING:
    from peerinfer.core.radix import RadixCache


class _Engine(Protocol):
    """What this module reads of an ``Engine`` (not imported: the engine imports this)."""

    _own_blocks: OwnBlocks | None

    def kv_format(self) -> str | None: ...
    def encode_block(self, payload: Any) -> bytes: ...

#: Blocks remembered (about 100 bytes each with the dict's own: ~6.5 MB at most).
MAX_DIGESTS = 65_536


def digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class OwnBlocks:
    """Block hash -> digest of the encoded bytes this engine computed for it, LRU-bounded; and
    the hashes of the blocks it computed that are still cached (``mine``: digested when
    dropped; at most the cache's blocks, since each leaves it when its block is dropped)."""

    def __init__(self, capacity: int = MAX_DIGESTS) -> None:
        self.capacity = capacity
        self._digests: OrderedDict[BlockHash, bytes] = OrderedDict()
        self.mine: set[BlockHash] = set()

    def __len__(self) -> int:
        return len(self._digests)

    def remember(self, h: BlockHash, data: bytes | memoryview) -> None:
        self._digests[h] = digest(data)
        self._digests.move_to_end(h)
        while len(self._digests) > self.capacity:
            self._digests.popitem(last=False)

    def matches(self, h: BlockHash, data: bytes | memoryview) -> bool:
        """Whether ``data`` are the very bytes this engine computed for block ``h``."""
        known = self._digests.get(h)
        return known is not None and known == digest(data)


def own_blocks(engine: _Engine) -> OwnBlocks:
    """``engine``'s memo (made on first use, kept across ``configure_cache``)."""
    memo = engine._own_blocks
    if memo is None:
        memo = engine._own_blocks = OwnBlocks()
    return memo


def remember_stored(engine: _Engine, cache: RadixCache, seq: Sequence[int], have: int) -> None:
    """After ``Engine._store`` inserted the blocks ``have ..`` of ``seq`` it computed: mark them
    as this engine's own, to be digested when dropped (engines that cannot encode blocks
    remember nothing)."""
    if engine.kv_format() is None:
        return
    mine = own_blocks(engine).mine
    for node in cache.match(tuple(seq), touch=False).nodes[have:]:
        if node.payload is not None:
            mine.add(node.hash)


def dropped(engine: _Engine, h: BlockHash, payload: Any, data: bytes | None = None) -> None:
    """The cache drops block ``h`` (its ``payload``; ``data``: its encoded bytes, when the
    caller has them already): if this engine computed it, remember its digest."""
    memo = engine._own_blocks
    if memo is None or h not in memo.mine:
        return
    memo.mine.discard(h)
    if data is None:
        if payload is None:
            return
        try:
            data = engine.encode_block(payload)
        except Exception:  # an export that fails: no free check for this block, nothing worse
            return
    memo.remember(h, data)


def known_blocks(
    engine: _Engine, hashes: Sequence[BlockHash], blocks: Sequence[bytes | memoryview]
) -> frozenset[int]:
    """The positions among pulled ``blocks`` (of ``hashes``) whose bytes are exactly what this
    engine computed for them: checked for free (see the module docstring)."""
    memo = own_blocks(engine)
    if not len(memo):
        return frozenset()
    return frozenset(i for i, (h, b) in enumerate(zip(hashes, blocks, strict=False))
                     if memo.matches(h, b))


__all__ = [
    "MAX_DIGESTS", "OwnBlocks", "digest", "dropped", "known_blocks", "own_blocks",
    "remember_stored",
]
