"""``peerinfer swarm new``: the invite it prints can be dialed, or the command refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from peerinfer.cli import main
from peerinfer.net.admission import parse_invite


def swarm_new(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["swarm", "new", "--identity", str(tmp_path / "identity.key"), *args])
    out, err = capsys.readouterr()
    return code, out, err


def invite_addrs(out: str) -> tuple[str, ...]:
    (line,) = [x for x in out.splitlines() if x.startswith("invite:")]
    return parse_invite(line.split(None, 1)[1])[1]


def test_a_bare_host_gets_the_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = swarm_new(tmp_path, capsys, "--addr", "/ip4/192.0.2.7", "--addr", "/dns4/home.example/",
                             "--port", "4800")
    assert code == 0
    first, second = invite_addrs(out)
    assert first.startswith("/ip4/192.0.2.7/tcp/4800/p2p/12D3KooW")
    assert second.startswith("/dns4/home.example/tcp/4800/p2p/12D3KooW")


def test_full_and_relayed_addresses_are_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    relay = "/ip4/198.51.100.1/tcp/4737/p2p/12D3KooWRelayRelayRelay/p2p-circuit"
    code, out, _ = swarm_new(tmp_path, capsys, "--addr", "/ip6/::1/tcp/4801", "--addr", relay)
    assert code == 0
    direct, relayed = invite_addrs(out)
    assert direct.startswith("/ip6/::1/tcp/4801/p2p/12D3KooW")
    assert relayed.startswith(relay + "/p2p/12D3KooW")


@pytest.mark.parametrize(
    ("addr", "message"),
    [
        ("/ip4/192.0.2.7/udp/4737/quic", "listen on TCP"),
        ("/ip4/192.0.2.7/tcp", "listen on TCP"),
        ("/ip4/192.0.2.7/tcp/4737/p2p/12D3KooWSomeone", "without /p2p"),
        ("192.0.2.7", "expected a multiaddr"),
    ],
)
def test_an_address_nobody_can_dial_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], addr: str, message: str
) -> None:
    code, out, err = swarm_new(tmp_path, capsys, "--addr", addr)
    assert code == 2
    assert "invite" not in out
    assert message in err and err.count("\n") == 1, err
