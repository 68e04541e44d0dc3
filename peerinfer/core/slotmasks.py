"""Slot bitmasks and block-hash chains, as the replica index reads them: the slots (set bits)
of a mask (``slots_in``), and how many of a chain's leading blocks a peer holds (``leading``).
Pure functions over ints and hash sets; ``peerinfer.core.replicaindex`` keeps the masks."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import islice, takewhile

from peerinfer.types import BlockHash

__all__ = ["leading", "slots_in"]

#: The set bits of each byte value, ascending.
_BYTE_BITS = tuple(tuple(i for i in range(8) if b >> i & 1) for b in range(256))
#: Maps every non-zero byte to 1, so ``bytes.find(1)`` skips runs of empty bytes in C.
_NONZERO = bytes([0] + [1] * 255)
#: ``slots_in``'s tables, one per byte of a mask: 256 slot tuples each (about 2.5 KB
#: per slot), grown on demand up to the highest slot any index handed out. Shared by every
#: index of the process: their content is a pure function of the byte position (a simulator
#: of 1,024 nodes kept 1,024 identical copies: about 2.9 GB, estimated from 2.75 KB per slot).
_BYTE_TABLES: list[tuple[tuple[int, ...], ...]] = []


def leading(
    chain: Sequence[BlockHash], held: Callable[[BlockHash], bool], refs: Mapping[BlockHash, int]
) -> int:
    """How many of ``chain``'s leading blocks are ``held`` or in ``refs`` (a peer's replica
    and its speculative entries), counted in C: stretches held, each continued by one in the
    entries (mostly one stretch, or two), not block by block in Python."""
    n = len(chain)
    depth = 0
    while depth < n:
        depth += len(list(takewhile(held, islice(chain, depth, None))))
        if depth == n or chain[depth] not in refs:
            break
        depth += 1 + len(list(takewhile(refs.__contains__, islice(chain, depth + 1, None))))
    return depth


def slots_in(mask: int) -> list[int]:
    """The slots (set bit indices) of ``mask``, ascending."""
    if mask.bit_count() * 32 <= mask.bit_length():
        # Sparse: peel the lowest bit off, a few big-integer operations per peer.
        out = []
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return out
    # Dense: walk the non-zero bytes; a per-byte-position table gives their slots at once.
    data = mask.to_bytes((mask.bit_length() + 7) // 8, "little")
    tables = _BYTE_TABLES
    while len(tables) < len(data):
        base = 8 * len(tables)
        slot_ints = [base + i for i in range(8)]  # shared by the 256 tuples: less memory
        tables.append(tuple(tuple(slot_ints[i] for i in bits) for bits in _BYTE_BITS))
    slots: list[int] = []
    extend = slots.extend
    nonzero = data.translate(_NONZERO)
    j = nonzero.find(1)
    while j >= 0:
        extend(tables[j][data[j]])
        j = nonzero.find(1, j + 1)
    return slots
