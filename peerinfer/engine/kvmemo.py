"""Free checks of pulled KV: a bounded memo of the blocks this engine computed itself (issue 24).

When an engine computes a prompt's blocks (``Engine._store``), the digest of each new block's
encoded bytes (``encode_block``) is remembered by block hash, up to ``MAX_DIGESTS`` blocks (the
least recently stored are forgotten first; 16 bytes of digest a block, against ~370 KB of the
block itself on the default llama.cpp model). A block pulled later whose bytes have the digest
remembered for its hash is exactly what this engine computed: it needs no recompute. That
happens when this node computed a prefix, evicted it (no disk tier, or a full one), and then
pulls it back from a peer instead of recomputing it.

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

    __dict__: dict[str, Any]

    def kv_format(self) -> str | None: ...
    def encode_block(self, payload: Any) -> bytes: ...

#: Blocks remembered (about 100 bytes each with the dict's own: ~6.5 MB at most).
MAX_DIGESTS = 65_536


def digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class OwnBlocks:
    """Block hash -> digest of the encoded bytes this engine computed for it, LRU-bounded."""

    def __init__(self, capacity: int = MAX_DIGESTS) -> None:
        self.capacity = capacity
        self._digests: OrderedDict[BlockHash, bytes] = OrderedDict()

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
    memo: OwnBlocks | None = engine.__dict__.get("_own_blocks")
    if memo is None:
        memo = engine.__dict__["_own_blocks"] = OwnBlocks()
    return memo


def remember_stored(engine: _Engine, cache: RadixCache, seq: Sequence[int], have: int) -> None:
    """After ``Engine._store`` inserted the blocks ``have ..`` of ``seq`` it computed: remember
    their digests (engines that cannot encode blocks remember nothing)."""
    if engine.kv_format() is None:
        return
    memo = own_blocks(engine)
    for node in cache.match(tuple(seq), touch=False).nodes[have:]:
        if node.payload is not None:
            memo.remember(node.hash, engine.encode_block(node.payload))


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


__all__ = ["MAX_DIGESTS", "OwnBlocks", "digest", "known_blocks", "own_blocks", "remember_stored"]
