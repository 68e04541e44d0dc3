"""Swarm admission at the host level: members connect, outsiders are refused fast, on loopback."""

from __future__ import annotations

import contextlib
import logging

import pytest
import trio

from peerinfer.errors import ConfigError, PeerUnavailableError
from peerinfer.net import open_host
from peerinfer.net.admission import make_invite, new_swarm_key, parse_invite
from tests.net.net_helpers import config, echo, wait_until

KEY = b"the members' key"
TOPIC = "t"
#: The behaviour bound of the issue: an outsider's dial fails within this (not a benchmark).
REFUSAL_BOUND_S = 2.0


def test_invites_round_trip_and_malformed_ones_are_config_errors() -> None:
    key = new_swarm_key()
    addrs = ("/ip4/127.0.0.1/tcp/4737/p2p/12D3KooWabc", "/ip4/10.0.0.2/tcp/4737/p2p/12D3KooWabc")
    assert parse_invite(make_invite(key, addrs)) == (key, addrs)
    assert len(key) == 64 and new_swarm_key() != key
    for bad in ("", "peerinfer-invite:1:", "peerinfer-invite:1:k:", "peerinfer-invite:1:k:/ip4/1.2.3.4",
                "hello"):
        with pytest.raises(ConfigError):
            parse_invite(bad)


async def test_members_connect_talk_and_gossip() -> None:
    cfg = config(swarm_key=KEY, gossip_topics=(TOPIC,))
    async with open_host(cfg) as a, open_host(cfg) as b:
        a.set_handler("/x/1", echo)
        messages = await a.subscribe(TOPIC)
        await b.subscribe(TOPIC)
        assert await b.connect(a.listen_addrs()[0]) == a.peer_id
        assert b.is_admitted(a.peer_id)
        assert await b.request(a.peer_id, "/x/1", b"hi") == b"hi"
        await wait_until(lambda: a.is_admitted(b.peer_id) and b.peer_id in a.connected_peers())
        await wait_until(lambda: a.peer_id in b.gossip_peers(TOPIC))
        await b.publish(TOPIC, b"news")
        with trio.fail_after(10):
            got = await messages.receive()
        assert got.data == b"news" and got.sender == b.peer_id
        assert a.statistics().admissions_refused == 0


@pytest.mark.parametrize("outsider_key", [b"another key", None], ids=["wrong-key", "no-key"])
async def test_an_outsider_is_refused_fast_and_gets_nothing(
    outsider_key: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    served: list[str] = []

    async def handler(stream: object) -> None:
        served.append("x")

    caplog.set_level(logging.WARNING, logger="peerinfer.net.host")
    async with open_host(config(swarm_key=KEY, gossip_topics=(TOPIC,))) as member, open_host(
        config(swarm_key=outsider_key, gossip_topics=(TOPIC,))
    ) as outsider:
        member.set_handler("/x/1", handler)
        messages = await member.subscribe(TOPIC)
        await outsider.subscribe(TOPIC)
        for _attempt in range(2):
            started = trio.current_time()
            if outsider_key is not None:
                # It runs admission itself: its connect fails, naming the reason.
                with pytest.raises(PeerUnavailableError, match="admission"):
                    await outsider.connect(member.listen_addrs()[0])
            else:
                # An open-swarm node's libp2p connect may even succeed; the member closes it
                # at once.
                with trio.move_on_after(REFUSAL_BOUND_S), contextlib.suppress(PeerUnavailableError):
                    await outsider.connect(member.listen_addrs()[0])
                await wait_until(lambda: not outsider.is_connected(member.peer_id), REFUSAL_BOUND_S)
            assert trio.current_time() - started < REFUSAL_BOUND_S
            await wait_until(lambda: not member.is_connected(outsider.peer_id), REFUSAL_BOUND_S)
        # Whatever it tries afterwards reaches nothing.
        with pytest.raises(PeerUnavailableError):
            await outsider.request(member.peer_id, "/x/1", b"hi", timeout=REFUSAL_BOUND_S)
        with pytest.raises(PeerUnavailableError):
            await outsider.publish(TOPIC, b"spam")
            raise PeerUnavailableError("published into the void")
        await trio.sleep(0.3)
        with pytest.raises(trio.WouldBlock):
            messages.receive_nowait()
        assert served == []
        assert member.connected_peers() == []
        stats = member.statistics()
        assert stats.admissions_refused >= 2
    # The member logged its refusal of the outsider once, for two attempts (an outsider with a
    # key of its own refuses the member too, in its own log).
    refusals = [r for r in caplog.records if f"refusing peer {outsider.peer_id}" in r.getMessage()]
    assert len(refusals) == 1


def test_the_cli_takes_keys_from_a_file_the_environment_or_an_invite(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pathlib import Path

    from peerinfer.cli import SWARM_KEY_ENV, _swarm_options, build_parser

    base = Path(str(tmp_path))
    key_file = base / "key"
    key_file.write_text("k1\n")
    invite_file = base / "invite"
    invite_file.write_text(make_invite("k1", ["/ip4/10.0.0.1/tcp/4737/p2p/12D3KooWabc"]) + "\n")
    monkeypatch.delenv(SWARM_KEY_ENV, raising=False)
    parse = build_parser().parse_args
    assert _swarm_options(parse(["node"])) == (None, ())
    assert _swarm_options(parse(["node", "--swarm-key-file", str(key_file)])) == (b"k1", ())
    assert _swarm_options(parse(["node", "--join", f"@{invite_file}"])) == (
        b"k1", ("/ip4/10.0.0.1/tcp/4737/p2p/12D3KooWabc",)
    )
    assert _swarm_options(parse(["status", "--peer", "x", "--swarm-key-file", str(key_file)]))[0] == b"k1"
    monkeypatch.setenv(SWARM_KEY_ENV, "k1")
    assert _swarm_options(parse(["generate", "--peer", "x", "hi"])) == (b"k1", ())
    monkeypatch.setenv(SWARM_KEY_ENV, "k2")
    with pytest.raises(ConfigError, match="different swarm keys"):
        _swarm_options(parse(["node", "--join", f"@{invite_file}"]))
    with pytest.raises(ConfigError, match="cannot read"):
        _swarm_options(parse(["node", "--swarm-key-file", str(base / "missing")]))
