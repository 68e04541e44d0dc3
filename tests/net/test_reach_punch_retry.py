"""Hole punching is retried after py-libp2p's DCUtR spends its attempts (peerinfer.net.reach).

DCUtR tries a relayed peer 3 times and then never again while the relayed connection lasts;
a punch that lost one race would stay relayed for good. ``_give_back_punch_budgets`` gives the
budget back after ``PUNCH_RETRY_S``, doubling per peer. Driven with a fake DCUtR state on
trio's virtual clock: what matters is which attempt tables it edits, and when.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from peerinfer.net.reach import (
    MAX_HOLE_PUNCH_ATTEMPTS,
    PUNCH_RETRY_MAX_S,
    PUNCH_RETRY_S,
    _give_back_punch_budgets,
)


def _dcutr() -> SimpleNamespace:
    return SimpleNamespace(_hole_punch_attempts={}, _direct_connections=set())


def test_spent_budgets_come_back_after_a_doubling_wait() -> None:
    async def main() -> None:
        dcutr = _dcutr()
        spent = MAX_HOLE_PUNCH_ATTEMPTS
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_give_back_punch_budgets, dcutr)
            dcutr._hole_punch_attempts.update({"stuck": spent, "trying": 1, "punched": spent})
            dcutr._direct_connections.add("punched")
            await trio.sleep(PUNCH_RETRY_S - 2)
            assert dcutr._hole_punch_attempts["stuck"] == spent  # not yet
            await trio.sleep(4)
            assert "stuck" not in dcutr._hole_punch_attempts  # given back
            assert dcutr._hole_punch_attempts["trying"] == 1  # still has attempts: untouched
            assert dcutr._hole_punch_attempts["punched"] == spent  # direct: nothing to retry
            # It fails its three attempts again: the next wait is twice as long.
            dcutr._hole_punch_attempts["stuck"] = spent
            await trio.sleep(PUNCH_RETRY_S + 2)
            assert dcutr._hole_punch_attempts["stuck"] == spent
            await trio.sleep(PUNCH_RETRY_S + 2)
            assert "stuck" not in dcutr._hole_punch_attempts
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_wait_is_capped() -> None:
    failures = 12  # 15 s doubled past the 600 s cap
    async def main() -> None:
        dcutr = _dcutr()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_give_back_punch_budgets, dcutr)
            waits = []
            for _ in range(failures):
                dcutr._hole_punch_attempts["symmetric"] = MAX_HOLE_PUNCH_ATTEMPTS
                start = trio.current_time()
                while "symmetric" in dcutr._hole_punch_attempts:
                    await trio.sleep(1)
                waits.append(trio.current_time() - start)
            nursery.cancel_scope.cancel()
        assert waits[0] == pytest.approx(PUNCH_RETRY_S, abs=2)
        assert waits[1] == pytest.approx(2 * PUNCH_RETRY_S, abs=2)
        assert max(waits) <= PUNCH_RETRY_MAX_S + 2
        assert waits[-1] == pytest.approx(PUNCH_RETRY_MAX_S, abs=2)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


KEY = b"the members' key"


def _base(addr: str) -> str:
    return addr.rsplit("/p2p/", 1)[0]


def _relayed(conn: object) -> bool:
    return any("/p2p-circuit" in str(a) for a in conn.get_transport_addresses())  # type: ignore[attr-defined]


async def test_a_punched_connection_is_not_refused_beside_two_relayed_ones() -> None:
    """Two homes that learn each other's relayed address at the same moment both dial through
    the relay: two relayed connections per pair. The hole-punched direct connection then came
    third, and py-libp2p's per-peer limit (``max_connections_per_peer``, 2) refused it and
    closed it (measured on the emulated internet: ``ADDCONN_DENY``, then every later punch
    failed with EADDRNOTAVAIL for the closed 4-tuple's TIME_WAIT, 60 s: the pair stayed
    relayed). Here on loopback: both relayed dials, then the direct dial DCUtR makes."""
    from multiaddr import Multiaddr

    from peerinfer.net import open_host
    from peerinfer.net.host import parse_peer_id
    from peerinfer.net.relay import RelaySettings, open_relay
    from tests.net.net_helpers import config, wait_until

    cfg = config(swarm_key=KEY)
    async with open_host(cfg) as r, open_host(cfg) as a, open_host(cfg) as b:
        async with open_relay(r, RelaySettings(service=True)), open_relay(a, RelaySettings()) as ra, \
                open_relay(b, RelaySettings()) as rb:
            relay_addr = _base(r.listen_addrs()[0])
            a_circuit = await ra.reserve(r.peer_id, relay_addr)
            b_circuit = await rb.reserve(r.peer_id, relay_addr)
            assert await ra.dial(b_circuit) == b.peer_id
            assert await rb.dial(a_circuit) == a.peer_id
            b_id = parse_peer_id(b.peer_id)
            await wait_until(lambda: len(a._live_connections(b_id)) == 2)
            assert all(_relayed(c) for c in a._live_connections(b_id))
            # What DCUtR's hole punch does once the SYNs have crossed: a fresh direct dial.
            await a._network.dial_addr(Multiaddr(_base(b.listen_addrs()[0])), b_id)
            await wait_until(lambda: any(not _relayed(c) for c in a._live_connections(b_id)))
            assert a.is_admitted(b.peer_id)


async def test_direct_connections_beyond_the_per_peer_bound_are_closed() -> None:
    """The room left for relayed connections is not room for more direct ones: a direct
    connection beyond ``max_connections_per_peer`` is closed as it opens."""
    from multiaddr import Multiaddr

    from peerinfer.net import open_host
    from peerinfer.net.host import parse_peer_id
    from tests.net.net_helpers import config, wait_until

    async with open_host(config(max_connections_per_peer=1)) as a, open_host(config()) as b:
        b_id, b_addr = parse_peer_id(b.peer_id), Multiaddr(_base(b.listen_addrs()[0]))
        await a.connect(b.listen_addrs()[0])
        for _ in range(2):
            with contextlib.suppress(Exception):  # libp2p may see it closed under it
                await a._network.dial_addr(b_addr, b_id)
        await wait_until(lambda: len(a._live_connections(b_id)) == 1)
        await trio.sleep(0.2)
        assert len(a._live_connections(b_id)) == 1
        assert a.is_connected(b.peer_id)


def test_the_smaller_peer_id_punches_first_and_the_other_only_after_a_wait() -> None:
    """Both ends starting a punch at once dialed one TCP 4-tuple in two sessions with opposite
    roles (EADDRNOTAVAIL, or a merged connection with two Noise responders, then 60 s of
    TIME_WAIT): the smaller id leads, the other waits PUNCH_FOLLOWER_WAIT_S. And each peer's
    attempt runs on its own: a futile one (a symmetric NAT, ~20 s) holds back no other peer's,
    and a peer is never tried twice at once."""
    from libp2p.peer.id import ID

    from peerinfer.net.identity import new_identity, peer_id_of
    from peerinfer.net.reach import PUNCH_ASK_GAP_S, PUNCH_FOLLOWER_WAIT_S, _one_side_first

    low, high, symmetric = sorted(peer_id_of(new_identity()) for _ in range(3))
    futile_s = 19.0  # ends between two of DCUtR's asks (every 2 s)

    async def main() -> None:
        started: list[tuple[str, str, float]] = []

        def starting(who: str):  # noqa: ANN202
            async def initiate(peer: ID) -> bool:
                started.append((who, peer.to_base58(), trio.current_time()))
                await trio.sleep(futile_s)  # the punch fails, slowly
                return False
            return initiate

        async with trio.open_nursery() as nursery:
            leader = _one_side_first(low, starting("low"), nursery)
            follower = _one_side_first(high, starting("high"), nursery)
            t0 = trio.current_time()
            for _ in range(int(PUNCH_FOLLOWER_WAIT_S / 2) + 2):  # DCUtR's auto-drive: every 2 s
                with trio.fail_after(0.1):  # never waits for an attempt
                    await leader(ID.from_base58(symmetric))
                    await leader(ID.from_base58(high))
                    await follower(ID.from_base58(low))
                await trio.sleep(2)
            by_low = [(peer, t - t0) for who, peer, t in started if who == "low"]
            assert sorted(by_low[:2]) == sorted([(symmetric, 0.0), (high, 0.0)])  # side by side
            assert [t for peer, t in by_low if peer == high] == [0.0, 20.0]  # one at a time
            follower_starts = [t - t0 for who, _, t in started if who == "high"]
            assert follower_starts and min(follower_starts) >= PUNCH_FOLLOWER_WAIT_S
            # A gap in asking (the relayed connection went): the wait starts afresh.
            await trio.sleep(PUNCH_ASK_GAP_S + futile_s)
            started.clear()
            await follower(ID.from_base58(low))
            await trio.sleep(1)
            assert started == []
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
