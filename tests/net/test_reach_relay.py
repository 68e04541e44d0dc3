"""Circuit relay v2 between peerinfer hosts on loopback (peerinfer.net.relay, net.reach).

Loopback has no NAT, so these check the relay mechanics and its admission rule; the NAT
behaviour itself is in tests/test_reach_netns.py.
"""

from __future__ import annotations

import contextlib

import pytest
import trio

from peerinfer.errors import PeerUnavailableError
from peerinfer.net import open_host
from peerinfer.net.reach import ReachSettings, run_reach
from peerinfer.net.relay import RelaySettings, open_relay
from peerinfer.node.options import GENERATE_PROTOCOL
from tests.net.net_helpers import config, echo, wait_until

KEY = b"the members' key"
ECHO = "/test/echo/1"


def base(addr: str) -> str:
    return addr.rsplit("/p2p/", 1)[0]


async def test_a_member_reserves_and_another_reaches_it_through_the_relay() -> None:
    cfg = config(swarm_key=KEY)
    async with open_host(cfg) as r, open_host(cfg) as dest, open_host(cfg) as src:
        async with open_relay(r, RelaySettings(service=True)), open_relay(dest, RelaySettings()) as d, \
                open_relay(src, RelaySettings()) as s:
            dest.set_handler(ECHO, echo)
            relay_addr = base(r.listen_addrs()[0])
            circuit = await d.reserve(r.peer_id, relay_addr)
            assert circuit == f"{relay_addr}/p2p/{r.peer_id}/p2p-circuit/p2p/{dest.peer_id}"
            assert await s.dial(circuit) == dest.peer_id
            await wait_until(lambda: src.is_admitted(dest.peer_id))
            assert await src.request(dest.peer_id, ECHO, b"through the relay") == b"through the relay"


async def test_a_relay_refuses_a_reservation_from_an_outsider() -> None:
    async with open_host(config(swarm_key=KEY)) as r, open_host(config(swarm_key=b"another key")) as out:
        async with open_relay(r, RelaySettings(service=True)), open_relay(out, RelaySettings()) as o:
            with pytest.raises(PeerUnavailableError):
                await o.reserve(r.peer_id, base(r.listen_addrs()[0]), timeout=5)
            # The outsider gives up on its own check of the relay, maybe before the relay's
            # check of it has concluded.
            await wait_until(lambda: r.statistics().admissions_refused >= 1)


async def test_a_host_without_relay_service_refuses_reservations() -> None:
    async with open_host(config()) as r, open_host(config()) as dest:
        async with open_relay(r, RelaySettings(service=False)), open_relay(dest, RelaySettings()) as d:
            with pytest.raises(PeerUnavailableError):
                await d.reserve(r.peer_id, base(r.listen_addrs()[0]), timeout=5)


async def test_a_peer_known_only_by_its_relayed_address_is_dialed_through_the_relay() -> None:
    """Host.dial of a peer whose only known address is a circuit one goes through the relay
    (the direct try has nothing to dial), and admission still runs end to end."""
    cfg = config(swarm_key=KEY)
    async with open_host(cfg) as r, open_host(cfg) as dest, open_host(cfg) as src:
        async with trio.open_nursery() as nursery:
            state = await nursery.start(run_reach, src, ReachSettings(relay_service=False))
            async with open_relay(r, RelaySettings(service=True)), open_relay(dest, RelaySettings()) as d:
                dest.set_handler(ECHO, echo)
                circuit = await d.reserve(r.peer_id, base(r.listen_addrs()[0]))
                src.add_known_peer(dest.peer_id, [circuit])
                assert src.known_addrs(dest.peer_id) == [circuit]
                await src.dial(dest.peer_id, timeout=10)
                assert src.is_admitted(dest.peer_id)
                assert await src.request(dest.peer_id, ECHO, b"hi") == b"hi"
                # Nobody here answers dial-back tests: src does not know it is reachable, and
                # does not take a reservation on a guess.
                assert state.reachable is None and state.reservations == {}
            nursery.cancel_scope.cancel()


async def test_dial_back_proves_reachability_and_a_dead_port_does_not() -> None:
    async with open_host(config()) as a, open_host(config()) as b, trio.open_nursery() as nursery:
        state_a = await nursery.start(run_reach, a, ReachSettings())
        await nursery.start(run_reach, b, ReachSettings())
        await b.connect(a.listen_addrs()[0])
        await wait_until(lambda: state_a.reachable is True, timeout=15)
        # A port nobody listens on is not reachable (the peer dials it back and is refused).
        from peerinfer.net.reach import DIALBACK_PROTOCOL

        with contextlib.closing(__import__("socket").socket()) as sock:
            sock.bind(("127.0.0.1", 0))
            dead_port = sock.getsockname()[1]
        assert await a.request(b.peer_id, DIALBACK_PROTOCOL, str(dead_port).encode(), timeout=10) == b"0"
        nursery.cancel_scope.cancel()


async def test_closing_one_circuit_leaves_a_newer_one_to_the_same_peer_open() -> None:
    """Two relayed connections from src to dest through one relay (as while a stalled one is
    replaced after a heal); the older closes. The newer keeps working, and stays open at both
    ends. py-libp2p's relay files a circuit's streams under the peer id, so the end of one
    circuit closed the streams of the newest circuit to that peer and left its own open: the
    fresh connection died, and the old one stayed half-open at the far end (silent)."""
    from libp2p.peer.id import ID

    async with open_host(config()) as r, open_host(config()) as dest, open_host(config()) as src:
        async with open_relay(r, RelaySettings(service=True)), open_relay(dest, RelaySettings()) as d, \
                open_relay(src, RelaySettings()) as s:
            dest.set_handler(ECHO, echo)
            circuit = await d.reserve(r.peer_id, base(r.listen_addrs()[0]))
            dest_id, src_id = ID.from_base58(dest.peer_id), ID.from_base58(src.peer_id)
            assert await s.dial(circuit) == dest.peer_id
            await wait_until(lambda: len(src._live_connections(dest_id)) == 1)
            (older,) = src._live_connections(dest_id)
            assert await s.dial(circuit) == dest.peer_id
            await wait_until(lambda: len(src._live_connections(dest_id)) == 2)
            await wait_until(lambda: len(dest._live_connections(src_id)) == 2)
            (newer,) = [c for c in src._live_connections(dest_id) if c is not older]
            await src._close_connection(dest.peer_id, older)
            # Each end sees exactly one connection left, and it carries requests.
            await wait_until(lambda: len(dest._live_connections(src_id)) == 1, 10)
            await trio.sleep(0.5)  # a wrongly closed circuit would be gone by now
            assert src._live_connections(dest_id) == [newer] and not newer.is_closed
            assert len(dest._live_connections(src_id)) == 1
            assert await src.request(dest.peer_id, ECHO, b"on the newer circuit", timeout=5) == b"on the newer circuit"


async def test_a_dial_back_is_never_asked_or_answered_through_a_relay() -> None:
    """Through a relay the address a peer sees is the relay's (py-libp2p's relayed connection
    reports the one under it). The relay here listens on 127.0.0.2, the others on 127.0.0.1,
    and a socket listens on 127.0.0.2 only: a dial-back served over the relayed connection
    would dial the relay's IP there, succeed, and tell ``dest`` it is reachable at a port it
    does not listen on. It is not answered; and ``dest``, whose only dial-back peer is reached
    through the relay, asks nobody (no verdict) rather than take that peer's word."""
    from peerinfer.net.reach import DIALBACK_PROTOCOL

    async with open_host(config(listen=("/ip4/127.0.0.2/tcp/0",))) as r, \
            open_host(config()) as dest, open_host(config()) as src, trio.open_nursery() as nursery:
        await nursery.start(run_reach, src, ReachSettings(relay_service=False))
        async with open_relay(r, RelaySettings(service=True)), open_relay(dest, RelaySettings()) as d, \
                open_relay(src, RelaySettings()) as s:
            circuit = await d.reserve(r.peer_id, base(r.listen_addrs()[0]))
            assert await s.dial(circuit) == dest.peer_id
            await wait_until(lambda: dest.is_connected(src.peer_id) and dest.only_relayed(src.peer_id))
            with contextlib.closing(__import__("socket").socket()) as sock:
                sock.bind(("127.0.0.2", 0))
                sock.listen()
                relays_ip_only = sock.getsockname()[1]
                with pytest.raises(PeerUnavailableError, match="without replying"):
                    await dest.request(src.peer_id, DIALBACK_PROTOCOL, str(relays_ip_only).encode(), timeout=10)
                state = await nursery.start(run_reach, dest, ReachSettings(relay_service=False))
                await trio.sleep(1.0)  # its first verdict round (FIRST_VERDICT_POLL_S)
                assert state.reachable is None and dest.only_relayed(src.peer_id)
        nursery.cancel_scope.cancel()


async def test_a_stream_to_a_peer_we_are_not_connected_to_goes_through_its_relay() -> None:
    """``open_stream`` (and so a forward) to a peer we hold no connection to, known by a direct
    address that is dead (behind a NAT) and by a circuit address, reaches it through the relay:
    libp2p's own dial inside new_stream knows only the direct one and failed the forward (or,
    with a NAT dropping the SYN, stalled it until the client gave up)."""
    async with open_host(config()) as r, open_host(config()) as dest, open_host(config()) as src:
        async with trio.open_nursery() as nursery:
            await nursery.start(run_reach, src, ReachSettings(relay_service=False))
            async with open_relay(r, RelaySettings(service=True)), open_relay(dest, RelaySettings()) as d:
                dest.set_handler(ECHO, echo)
                circuit = await d.reserve(r.peer_id, base(r.listen_addrs()[0]))
                with contextlib.closing(__import__("socket").socket()) as sock:
                    sock.bind(("127.0.0.1", 0))
                    dead = f"/ip4/127.0.0.1/tcp/{sock.getsockname()[1]}"
                src.add_known_peer(dest.peer_id, [dead, circuit])
                assert not src.is_connected(dest.peer_id)
                stream = await src.open_stream(dest.peer_id, ECHO, timeout=10, lazy=True)
                async with stream:
                    await stream.send(b"through the relay")
                    assert await stream.receive() == b"through the relay"
                assert src.is_connected(dest.peer_id)
            nursery.cancel_scope.cancel()


async def test_a_peer_reached_only_through_a_relay_gets_a_spare_negotiated_stream() -> None:
    """A forward to a peer we reach only through a relay opens a spare stream ahead of the next
    one (negotiated, kept for ``SPARE_STREAM_TTL_S``): a new stream's opening frames each cross
    the relay. A directly connected peer gets none. Kept streams are taken soonest-to-expire
    first, so a spare outlives the streams kept after exchanges."""
    async with open_host(config()) as r, open_host(config()) as dest, open_host(config()) as src:
        async with trio.open_nursery() as nursery:
            async with open_relay(r, RelaySettings(service=True)), open_relay(dest, RelaySettings()) as d, \
                    open_relay(src, RelaySettings()) as s:
                dest.set_handler(GENERATE_PROTOCOL, echo)
                r.set_handler(GENERATE_PROTOCOL, echo)
                circuit = await d.reserve(r.peer_id, base(r.listen_addrs()[0]))
                assert await s.dial(circuit) == dest.peer_id
                assert src.only_relayed(dest.peer_id) and not src.only_relayed(r.peer_id)
                pool = src.streams
                pool.spare_ahead(r.peer_id, GENERATE_PROTOCOL)  # direct: no spare
                pool.spare_ahead(dest.peer_id, GENERATE_PROTOCOL)
                pool.spare_ahead(dest.peer_id, GENERATE_PROTOCOL)  # one at a time
                assert pool.spares_opening == {dest.peer_id}
                await wait_until(lambda: src.has_idle_stream(dest.peer_id, GENERATE_PROTOCOL))
                assert not pool.spares_opening and not src.has_idle_stream(r.peer_id, GENERATE_PROTOCOL)
                used = await src.open_stream(dest.peer_id, GENERATE_PROTOCOL, lazy=True)
                await used.send(b"one")
                assert await used.receive() == b"one"
                src.keep_idle_stream(used, ttl_s=0.3)  # kept after an exchange, expiring first
                assert src.take_idle_stream(dest.peer_id, GENERATE_PROTOCOL) is used
                src.keep_idle_stream(used, ttl_s=0.3)
                await trio.sleep(0.4)  # the kept one expired; the spare did not
                spare = src.take_idle_stream(dest.peer_id, GENERATE_PROTOCOL)
                assert spare is not None and spare is not used
                await spare.send(b"at once")  # negotiated when it was opened
                assert await spare.receive() == b"at once"
                assert src.take_idle_stream(dest.peer_id, GENERATE_PROTOCOL) is None
                pool.spare_ahead(dest.peer_id, GENERATE_PROTOCOL)  # none kept again: another spare
                await wait_until(lambda: src.has_idle_stream(dest.peer_id, GENERATE_PROTOCOL))
            nursery.cancel_scope.cancel()
