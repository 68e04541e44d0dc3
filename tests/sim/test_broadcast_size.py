"""The broadcast counts each announcement's bytes without encoding it (``announce_wire_size``):
the count must be ``len(encode(announce))`` exactly, for every announcement, since the bytes
are part of a run's statistics."""

from __future__ import annotations

import random

import pytest

from peerinfer.core.messages import Announce, Load, encode
from peerinfer.sim import SimConfig, simulate
from peerinfer.sim import broadcast as broadcast_module
from peerinfer.sim.broadcast import announce_wire_size

# Every integer width msgpack has, from both sides of each boundary.
_EDGES = (
    0, 1, 31, 32, 127, 128, 255, 256, 65_535, 65_536, 2**32 - 1, 2**32, 2**63, 2**64 - 1,
)


def _int(rng: random.Random, top: int = 2**64 - 1) -> int:
    if rng.random() < 0.01:  # no message carries one; still packed (signed), and counted
        return -rng.choice(_EDGES[1:-2])
    if rng.random() < 0.5:
        return min(rng.choice(_EDGES), top)
    return rng.randint(0, top) >> rng.randint(0, 63)


def _hashes(rng: random.Random) -> tuple[int, ...]:
    n = rng.choice((0, 1, 2, 15, 16, 17, rng.randint(0, 300)))
    if rng.random() < 0.7:  # block hashes: 64-bit, now and then a small one
        return tuple(
            rng.getrandbits(64) if rng.random() > 0.05 else rng.choice(_EDGES) for _ in range(n)
        )
    return tuple(_int(rng) for _ in range(n))


def _text(rng: random.Random) -> str:
    n = rng.choice((0, 1, 31, 32, 52, 255, 256, rng.randint(0, 400)))
    alphabet = "abcXYZ0123456789" if rng.random() < 0.7 else "aé€𝄞"
    return "".join(rng.choice(alphabet) for _ in range(n))


def random_announce(rng: random.Random) -> Announce:
    speed = tuple(_int(rng, 10**15 - 1) for _ in range(rng.choice((0, 4))))
    scaffolds = _hashes(rng)[:128] if rng.random() < 0.3 else ()
    disk = (_int(rng, 1000), _int(rng, 10**15 - 1)) if rng.random() < 0.3 else ()
    load = Load(
        _int(rng, 2**32 - 1), _int(rng, 2**32 - 1), _int(rng, 2**32 - 1) or 1, speed,
        scaffolds, disk,
    )
    return Announce(
        _text(rng), _int(rng), _int(rng), _int(rng), _int(rng), load, _hashes(rng),
        _hashes(rng), rng.random() < 0.5, _int(rng),
    )


def test_the_counted_bytes_are_the_encoded_length_of_random_announcements() -> None:
    assert broadcast_module._ANNOUNCE_LAYOUT  # else the fast count never runs
    rng = random.Random("announce-size")
    for _ in range(5_000):
        a = random_announce(rng)
        assert announce_wire_size(a) == len(encode(a)), a


def test_long_delta_lists_take_the_wide_array_headers() -> None:
    load = Load(1, 2, 3, (10, 20, 30, 40))
    for n in (65_535, 65_536):
        hs = tuple(range(2**40, 2**40 + n))
        a = Announce("p" * 52, 7, 6, 2**63, n, load, hs, hs[:3], False, 123_456)
        assert announce_wire_size(a) == len(encode(a))


def test_the_count_does_not_encode(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(a: Announce) -> int:
        raise AssertionError("encoded")

    monkeypatch.setattr(broadcast_module, "_encoded_size", refuse)
    a = random_announce(random.Random(1))
    announce_wire_size(a)  # no encoding on the fast path
    monkeypatch.setattr(broadcast_module, "_ANNOUNCE_LAYOUT", False)
    with pytest.raises(AssertionError, match="encoded"):
        announce_wire_size(a)  # another layout of the message: counted by encoding


def test_a_run_counts_the_same_bytes_as_by_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    config = SimConfig(nodes=6, requests=120, seed=3, skew="zipf:1.0")
    _, fast = simulate(config)
    monkeypatch.setattr(broadcast_module, "_ANNOUNCE_LAYOUT", False)
    _, slow = simulate(config)
    assert fast["anti_entropy"]["announce_bytes"] > 0
    assert fast["anti_entropy"] == slow["anti_entropy"]


def test_plain_values_are_sized_as_msgpack_packs_them() -> None:
    import msgpack

    edges = [s * e + d for e in _EDGES for s in (1, -1) for d in (-1, 0, 1)]
    values: list[object] = [v for v in edges if -(2**63) <= v <= 2**64 - 1]
    values += [True, False, None, 0.5, b"", b"x" * 255, b"x" * 256, "é" * 20, [[1, 2], ()]]
    for v in values:
        assert broadcast_module._value_size(v) == len(msgpack.packb(v, use_bin_type=True)), v
