"""The node makes each announcement without ``Announce``'s frozen ``__init__``
(``announcing._make_announce``) and seals its digest's epoch as a plain tuple
(``LocalDigest.seal``): both must give what the plain forms give."""

from __future__ import annotations

import dataclasses
import random

import pytest

from peerinfer.core import digest as digest_module
from peerinfer.core.messages import Announce, Load, decode, encode
from peerinfer.core.node import announcing
from peerinfer.types import BlockHash, PeerId


def test_the_announce_maker_makes_what_announce_makes() -> None:
    assert announcing._make_announce is not Announce  # (the fast form is in use)
    rng = random.Random(7)
    for _ in range(200):
        values = (
            PeerId(f"peer-{rng.randrange(100)}"), rng.randrange(1, 1 << 40), rng.randrange(1 << 40),
            rng.getrandbits(64), rng.randrange(5000),
            Load(queued=rng.randrange(9), running=rng.randrange(3), slots=rng.randrange(1, 4)),
            tuple(sorted(rng.getrandbits(64) for _ in range(rng.randrange(6)))),
            tuple(sorted(rng.getrandbits(64) for _ in range(rng.randrange(6)))),
            rng.random() < 0.2, rng.randrange(1 << 30),
        )
        made = announcing._make_announce(*values)
        plain = Announce(*values)
        assert type(made) is Announce
        assert made == plain and hash(made) == hash(plain) and repr(made) == repr(plain)
        assert [getattr(made, f.name) for f in dataclasses.fields(Announce)] == list(values)
        assert encode(made) == encode(plain) and decode(encode(made)) == plain
        with pytest.raises(dataclasses.FrozenInstanceError):
            made.epoch = 1  # type: ignore[misc]


def test_the_announce_maker_falls_back_on_another_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(announcing, "_ANNOUNCE_FIELDS", ("sender", "epoch"))
    assert announcing._announce_maker() is Announce


def test_seal_gives_seal_epochs_delta_as_a_tuple() -> None:
    rng = random.Random(3)
    a, b = digest_module.LocalDigest(epoch_base=5), digest_module.LocalDigest(epoch_base=5)
    live: list[BlockHash] = []
    truncated = 0
    for step in range(60):
        for _ in range(rng.randrange(0, 40 if step % 7 else 9000)):  # some past MAX_DELTA
            if live and rng.random() < 0.4:
                h = live.pop(rng.randrange(len(live)))
                a.block_removed(h)
                b.block_removed(h)
            else:
                h = BlockHash(rng.getrandbits(64))
                live.append(h)
                a.block_added(h)
                b.block_added(h)
        delta = a.seal_epoch()
        assert b.seal() == dataclasses.astuple(delta)
        truncated += delta.truncated
        assert (a.epoch, a.root, a.count) == (b.epoch, b.root, b.count)
    assert 0 < truncated < 60
