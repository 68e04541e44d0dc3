"""``parse_peer_id`` keeps decoded peer ids (a bounded LRU): the base58 decode is pure Python
and the connection and admission checks call it for the same few peers many times a second
(reachability's poll walked every connected peer five times a second; docs/performance.md)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import base58
import pytest
from libp2p.peer.id import ID

from peerinfer.errors import ConfigError, InvalidRequestError
from peerinfer.net import context
from peerinfer.net.context import PEER_ID_CACHE, parse_peer_id


def _random_id() -> str:
    # An Ed25519 peer id: the identity multihash of a protobuf-wrapped 32-byte public key.
    return ID(b"\x00\x24\x08\x01\x12\x20" + os.urandom(32)).to_base58()


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every base58 decode ``parse_peer_id`` performs, on an empty cache."""
    seen: list[str] = []
    real = ID.from_base58.__func__  # type: ignore[attr-defined]

    def counting(cls: type[ID], text: str) -> ID:
        seen.append(text)
        return real(cls, text)  # type: ignore[no-any-return]

    monkeypatch.setattr(ID, "from_base58", classmethod(counting))
    context._decoded_peer_id.cache_clear()
    yield seen
    context._decoded_peer_id.cache_clear()


def test_a_peer_id_is_decoded_once_and_equals_a_fresh_decode(decodes: list[str]) -> None:
    text = _random_id()
    first = parse_peer_id(text)
    again = parse_peer_id(text)
    assert decodes == [text]
    assert again is first
    assert first.to_bytes() == base58.b58decode(text) and first.to_base58() == text
    other = _random_id()
    assert parse_peer_id(other) != first
    assert decodes == [text, other]


def test_a_malformed_id_raises_the_asked_error_every_time(decodes: list[str]) -> None:
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="not a peer id"):
            parse_peer_id("not-base58-0OIl")
    with pytest.raises(ConfigError, match="not a peer id"):
        parse_peer_id("not-base58-0OIl", ConfigError)
    with pytest.raises(InvalidRequestError):
        parse_peer_id([1, 2])  # type: ignore[arg-type]  # unhashable: the same error, not a TypeError
    assert decodes.count("not-base58-0OIl") == 3  # failures are not cached


def test_the_cache_is_bounded_and_drops_the_least_recently_used(decodes: list[str]) -> None:
    kept = _random_id()
    parse_peer_id(kept)
    for _ in range(PEER_ID_CACHE + 10):
        parse_peer_id(_random_id())
        parse_peer_id(kept)  # used all along: stays
    info = context._decoded_peer_id.cache_info()
    assert info.currsize == PEER_ID_CACHE
    assert decodes.count(kept) == 1
    first_dropped = decodes[1]
    parse_peer_id(first_dropped)
    assert decodes.count(first_dropped) == 2
