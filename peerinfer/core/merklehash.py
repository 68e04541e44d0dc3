"""The digest's arithmetic and encodings: positions, contributions, summaries, slices,
fingerprints and the packed forms a pull carries (shared by ``peerinfer.core.digest``, the
digest of this node's own cache in ``peerinfer.core.localdigest`` and the reconciliation in
``peerinfer.core.antientropy``).

Pure functions of their arguments and constants: what they compute, and why, is described in
the module docstring of ``peerinfer.core.digest`` ("Mixing", "Truncated summaries").
"""

from __future__ import annotations

from collections.abc import Iterable

from peerinfer.core.messages import SyncQuery

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
