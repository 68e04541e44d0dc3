"""The network shell's ordinary behaviour: hosts on 127.0.0.1, ephemeral ports, real libp2p.

Pure pieces (config sizing, pacing, identity files, address expansion) are tested directly;
everything else runs two or three in-process hosts under pytest-trio. Every wait is bounded by
``trio.fail_after``.
"""

from __future__ import annotations

import os
import random
import socket
import stat
import threading
from functools import partial
from pathlib import Path

import multiaddr
import pytest
import trio
from libp2p.discovery.events.peerDiscovery import peerDiscovery
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

import peerinfer.net as net
from peerinfer.errors import (
    ClosedError,
    ConfigError,
    InvalidRequestError,
    PeerInferError,
    PeerUnavailableError,
    ProtocolError,
)
from peerinfer.net import FramedStream, Host, HostConfig, open_host
from peerinfer.net.config import gossip_rate_limit, own_publish_rate
from peerinfer.net.discovery import expand_unspecified
from peerinfer.net.identity import load_or_create_identity, peer_id_of
from peerinfer.net.pacing import Backoff, TokenBucket
from tests.net.net_helpers import config, echo, next_event, wait_until


async def mesh_ready(hosts: list[Host], topic: str) -> None:
    """Every host sees at least one mesh peer for ``topic``."""
    await wait_until(lambda: all(h.mesh_peers(topic) for h in hosts))


# --- pure pieces -----------------------------------------------------------------------------


def test_public_names_are_pinned() -> None:
    assert sorted(net.__all__) == sorted(
        [
            "DEFAULT_PORT",
            "PING_PROTOCOL",
            "FramedStream",
            "GossipMessage",
            "Host",
            "HostConfig",
            "HostStatistics",
            "NodeHost",
            "PeerEvent",
            "PeerEventKind",
            "Stream",
            "StreamHandler",
            "StreamUse",
            "Transport",
            "Validator",
            "default_identity_path",
            "gossip_rate_limit",
            "open_host",
        ]
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {"listen": ()},
        {"stream_timeout_s": 0},
        {"max_streams_per_peer": 0},
        {"gossip_degree": (6, 8, 12)},
        {"bootstrap_backoff_min_s": 5.0, "bootstrap_backoff_max_s": 1.0},
        {"gossip_max_message_bytes": 2 * 1024 * 1024},
        {"gossip_topics": ("",)},
    ],
)
def test_config_check_rejects_values_that_cannot_work(overrides: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        config(**overrides).check()


def test_default_config_is_valid_and_listens_on_the_documented_port() -> None:
    default = HostConfig()
    default.check()
    assert default.listen == (f"/ip4/0.0.0.0/tcp/{net.DEFAULT_PORT}",)
    assert default.heartbeat_interval_s == 1


def test_gossip_rate_limit_covers_a_swarm_announcing_in_the_same_second() -> None:
    # libp2p drops above 10/s per forwarder; a 64-peer swarm can relay 64 in one second.
    assert gossip_rate_limit(64, 5.0) >= 64
    assert gossip_rate_limit(256, 5.0) >= 256
    # Sub-second announcements: the steady rate dominates.
    assert gossip_rate_limit(10, 0.1) >= 100
    # Never below libp2p's own default.
    assert gossip_rate_limit(1, 60.0) == 10
    assert HostConfig().effective_gossip_rate_limit() > 10
    assert own_publish_rate(HostConfig().effective_gossip_rate_limit()) < HostConfig().effective_gossip_rate_limit()


def test_backoff_grows_to_its_cap_and_resets() -> None:
    rng = random.Random(7)
    backoff = Backoff(1.0, 30.0)
    delays = [backoff.next_delay(rng) for _ in range(20)]
    assert all(0.5 <= d <= 30.0 for d in delays)
    assert max(delays[-5:]) > 15.0  # it did grow
    backoff.reset()
    assert backoff.next_delay(rng) <= 1.0


def test_token_bucket_paces_after_its_burst() -> None:
    bucket = TokenBucket(rate=2.0, burst=2.0)
    assert bucket.take(0.0) and bucket.take(0.0)
    assert not bucket.take(0.0)
    assert bucket.delay(0.0) == pytest.approx(0.5)
    assert bucket.take(0.5)
    assert not bucket.take(0.5)
    assert bucket.take(10.0) and bucket.take(10.0) and not bucket.take(10.0)  # burst caps saving


def test_identity_is_created_private_and_reloaded(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "identity.key"
    first = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_or_create_identity(path)
    assert peer_id_of(first) == peer_id_of(again)
    assert [p.name for p in path.parent.iterdir()] == ["identity.key"]  # no temp file left


def test_identity_refuses_a_corrupt_or_exposed_key(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.key"
    corrupt.write_bytes(b"not a key")
    corrupt.chmod(0o600)
    with pytest.raises(ConfigError, match="corrupt"):
        load_or_create_identity(corrupt)
    exposed = tmp_path / "exposed.key"
    load_or_create_identity(exposed)
    exposed.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_or_create_identity(exposed)


def test_unspecified_addresses_expand_to_dialable_ones() -> None:
    bound = [multiaddr.Multiaddr("/ip4/0.0.0.0/tcp/4737"), multiaddr.Multiaddr("/ip4/10.1.2.3/tcp/9")]
    expanded = [str(a) for a in expand_unspecified(bound, ["127.0.0.1", "192.168.1.5"])]
    assert expanded == ["/ip4/127.0.0.1/tcp/4737", "/ip4/192.168.1.5/tcp/4737", "/ip4/10.1.2.3/tcp/9"]


# --- hosts -----------------------------------------------------------------------------------


async def test_persistent_identity_survives_a_restart(tmp_path: Path) -> None:
    cfg = config(persist_identity=True, identity_path=tmp_path / "id.key")
    async with open_host(cfg) as first:
        peer_id = first.peer_id
    async with open_host(cfg) as second:
        assert second.peer_id == peer_id


async def test_connect_request_response_and_events() -> None:
    async with open_host(config()) as a, open_host(config()) as b:
        seen_by: dict[str, str] = {}

        async def who_am_i(stream: FramedStream) -> None:
            request = await stream.receive()
            seen_by["remote"] = stream.remote_peer
            await stream.send(request[::-1])

        b.set_handler("/test/reverse/1", who_am_i)
        events = a.peer_events()
        assert await a.connect(b.listen_addrs()[0]) == b.peer_id
        await next_event(events, "connected", b.peer_id)
        assert a.connected_peers() == [b.peer_id]
        assert await a.request(b.peer_id, "/test/reverse/1", b"abc") == b"cba"
        assert seen_by["remote"] == a.peer_id  # the handler sees the authenticated dialer
        await a.disconnect(b.peer_id)
        await next_event(events, "disconnected", b.peer_id)
        assert not a.is_connected(b.peer_id)


async def test_listen_and_dialable_addresses_carry_our_peer_id() -> None:
    async with open_host(config(listen=("/ip4/0.0.0.0/tcp/0",))) as host:
        (bound,) = host.listen_addrs()
        assert bound.startswith("/ip4/0.0.0.0/tcp/") and bound.endswith(f"/p2p/{host.peer_id}")
        dialable = host.dialable_addrs()
        assert dialable[0].startswith("/ip4/127.0.0.1/tcp/")
        assert all(a.endswith(f"/p2p/{host.peer_id}") for a in dialable)
        async with open_host(config()) as other:
            assert await other.connect(dialable[0]) == host.peer_id


async def test_frames_stream_both_ways_until_a_clean_end() -> None:
    async with open_host(config()) as a, open_host(config()) as b:
        b.set_handler("/test/echo/1", echo)
        await a.connect(b.listen_addrs()[0])
        stream = await a.open_stream(b.peer_id, "/test/echo/1")
        async with stream:
            frames = [b"", b"x", os.urandom(200_000), b"last"]
            for frame in frames:
                await stream.send(frame)
            await stream.close_write()
            received = [frame async for frame in stream]
        assert received == frames
        with pytest.raises(ClosedError):
            await stream.receive()  # we closed it


async def test_a_lazily_negotiated_stream_carries_frames_both_ways() -> None:
    """The first frame travels with the protocol proposal; the handler sees the authenticated
    dialer, frames of any size pass both ways, and a receive before any send still works."""
    async with open_host(config()) as a, open_host(config()) as b:
        seen_by: list[str] = []

        async def greet_then_echo(stream: FramedStream) -> None:
            seen_by.append(stream.remote_peer)
            await stream.send(b"hello")
            await echo(stream)

        b.set_handler("/test/echo/1", echo)
        b.set_handler("/test/greet/1", greet_then_echo)
        await a.connect(b.listen_addrs()[0])
        stream = await a.open_stream(b.peer_id, "/test/echo/1", lazy=True)
        assert stream.protocol == "/test/echo/1" and stream.remote_peer == b.peer_id
        async with stream:
            for frame in [b"first", os.urandom(200_000), b""]:
                await stream.send(frame)
                assert await stream.receive() == frame
        greeter = await a.open_stream(b.peer_id, "/test/greet/1", lazy=True)
        async with greeter:
            assert await greeter.receive() == b"hello"  # nothing sent yet: the proposal goes alone
            await greeter.send(b"again")
            assert await greeter.receive() == b"again"
        assert seen_by == [a.peer_id]
        # A half-close before any frame still completes the negotiation for the listener.
        quiet = await a.open_stream(b.peer_id, "/test/echo/1", lazy=True)
        async with quiet:
            await quiet.close_write()
            with pytest.raises(trio.EndOfChannel):
                await quiet.receive()


async def test_a_lazily_refused_protocol_fails_the_first_receive() -> None:
    async with open_host(config()) as a, open_host(config()) as b:
        b.set_handler("/test/echo/1", echo)
        await a.connect(b.listen_addrs()[0])
        stream = await a.open_stream(b.peer_id, "/test/nobody-serves-this/1", lazy=True)
        await stream.send(b"anyone?")
        with pytest.raises(PeerUnavailableError, match="refused the protocol"):
            await stream.receive()
        assert stream.closed  # reset, as after any failure
        with pytest.raises(PeerUnavailableError, match="refused the protocol"):
            await a.request(b.peer_id, "/test/nobody-serves-this/1", b"q")
        # The connection is unharmed.
        assert await a.request(b.peer_id, "/test/echo/1", b"still here") == b"still here"


async def test_window_credit_goes_back_per_half_window_not_per_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A small exchange sends no window updates beyond the stream's SYN/ACK/FIN; a 4 MiB
    transfer (16 windows) completes, with one credit frame per half window consumed."""
    import struct

    from libp2p.stream_muxer.yamux import yamux

    from peerinfer.net.muxer import CREDIT_THRESHOLD_BYTES

    credit: list[int] = []
    write_frame = yamux.Yamux._write_frame

    async def counting(self: yamux.Yamux, data: bytes) -> None:
        _, kind, flags, _, length = struct.unpack(yamux.YAMUX_HEADER_FORMAT, data[: yamux.HEADER_SIZE])
        if kind == yamux.TYPE_WINDOW_UPDATE and not flags:
            credit.append(length)
        await write_frame(self, data)

    monkeypatch.setattr(yamux.Yamux, "_write_frame", counting)
    async with open_host(config()) as a, open_host(config()) as b:
        received: list[int] = []

        async def sink(stream: FramedStream) -> None:
            async for frame in stream:
                received.append(len(frame))
            await stream.send(b"done")

        b.set_handler("/test/echo/1", echo)
        b.set_handler("/test/sink/1", sink)
        await a.connect(b.listen_addrs()[0])
        assert await a.request(b.peer_id, "/test/echo/1", b"x" * 100) == b"x" * 100
        assert credit == []
        chunk = 100_000
        total = 4 * 1024 * 1024
        async with await a.open_stream(b.peer_id, "/test/sink/1", lazy=True) as stream:
            for _ in range(total // chunk):
                await stream.send(os.urandom(chunk))
            await stream.close_write()
            assert await stream.receive() == b"done"
        assert sum(received) == chunk * (total // chunk)
        assert all(c >= CREDIT_THRESHOLD_BYTES for c in credit)
        assert len(credit) <= total // CREDIT_THRESHOLD_BYTES + 2


async def test_unknown_protocol_and_unknown_peer_are_unavailable() -> None:
    async with open_host(config()) as a, open_host(config()) as b:
        await a.connect(b.listen_addrs()[0])
        with pytest.raises(PeerUnavailableError):
            await a.open_stream(b.peer_id, "/test/nobody-serves-this/1")
        async with open_host(config()) as c:
            stranger = c.peer_id
        with pytest.raises(PeerUnavailableError):
            await a.open_stream(stranger, "/test/echo/1")


async def test_address_with_the_wrong_peer_id_is_refused() -> None:
    """The Noise handshake proves the peer id: B's address with C's id must not connect."""
    async with open_host(config()) as a, open_host(config()) as b, open_host(config()) as c:
        forged = b.listen_addrs()[0].rsplit("/p2p/", 1)[0] + f"/p2p/{c.peer_id}"
        with pytest.raises(PeerUnavailableError):
            await a.connect(forged)
        assert a.connected_peers() == []


async def test_bad_addresses_are_config_or_protocol_errors() -> None:
    async with open_host(config()) as a:
        with pytest.raises(ConfigError):
            await a.connect("/ip4/127.0.0.1/tcp/1")  # no /p2p
        with pytest.raises(ProtocolError):
            a.add_known_peer("not-a-peer-id", ["/ip4/127.0.0.1/tcp/1"])
        with pytest.raises(InvalidRequestError):
            await a.connect(a.listen_addrs()[0])  # ourselves


async def test_listening_on_a_busy_port_is_a_config_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError):
            async with open_host(config(listen=(f"/ip4/127.0.0.1/tcp/{port}",))):
                pass


async def test_ping_measures_a_round_trip() -> None:
    async with open_host(config()) as a, open_host(config()) as b:
        await a.connect(b.listen_addrs()[0])
        rtt = await a.ping(b.peer_id)
        assert 0 < rtt < 5
        assert a.last_rtt(b.peer_id) == rtt
        # The one RTT table also says how recent a measurement is.
        assert a.fresh_rtt(b.peer_id, max_age_s=60.0) == rtt
        await trio.sleep(0.05)
        assert a.fresh_rtt(b.peer_id, max_age_s=0.01) is None
        await a.disconnect(b.peer_id)
        assert a.last_rtt(b.peer_id) is None and a.fresh_rtt(b.peer_id, max_age_s=60.0) is None


async def test_a_ping_stream_ended_without_an_echo_is_a_remote_failure() -> None:
    """A peer (hostile, or going away) that accepts a ping stream and closes it unanswered:
    the ping fails with peerinfer's error, which liveness and the node handle (a bare
    trio.EndOfChannel escaped them and ended the pinging node: seen once, test_node_inprocess)."""

    async def close_unanswered(stream: FramedStream) -> None:
        await stream.close_write()  # a clean end of stream, no echo

    async with open_host(config()) as a, open_host(config()) as b:
        b.set_handler(net.host.PING_PROTOCOL, close_unanswered)
        await a.connect(b.listen_addrs()[0])
        with pytest.raises(PeerUnavailableError, match="without answering"):
            await a.ping(b.peer_id, timeout=5.0)
        assert a.is_connected(b.peer_id)  # the host itself carries on


async def test_gossip_is_relayed_signed_and_not_echoed_to_its_sender() -> None:
    topic = "peerinfer/test/announce"
    async with open_host(config()) as a, open_host(config()) as b, open_host(config()) as c:
        # A line: A - B - C. C hears A only through B.
        await a.connect(b.listen_addrs()[0])
        await c.connect(b.listen_addrs()[0])
        at_a = await a.subscribe(topic)
        own_at_a = await a.subscribe(topic, include_own=True)
        await b.subscribe(topic)
        at_c = await c.subscribe(topic)
        await mesh_ready([a, b, c], topic)
        await a.publish(topic, b"hello")
        with trio.fail_after(10):
            message = await at_c.receive()
            own = await own_at_a.receive()
        assert (message.sender, message.data, message.topic) == (a.peer_id, b"hello", topic)
        assert own.sender == a.peer_id
        with pytest.raises(trio.WouldBlock):
            at_a.receive_nowait()  # our own message is not delivered unless asked for


async def test_gossip_topics_restrict_what_we_subscribe_and_publish() -> None:
    async with open_host(config(gossip_topics=("allowed",))) as a:
        await a.subscribe("allowed")
        with pytest.raises(ConfigError):
            await a.subscribe("other")
        with pytest.raises(ConfigError):
            await a.publish("other", b"x")
        with pytest.raises(InvalidRequestError):
            await a.publish("allowed", b"x" * (a._config.gossip_max_message_bytes + 1))


async def test_unsubscribe_ends_every_subscriber_channel() -> None:
    async with open_host(config()) as a:
        first = await a.subscribe("t")
        second = await a.subscribe("t")
        await a.unsubscribe("t")
        with trio.fail_after(5):
            with pytest.raises(trio.EndOfChannel):
                await first.receive()
            with pytest.raises(trio.EndOfChannel):
                await second.receive()


async def test_add_known_peer_then_dial() -> None:
    async with open_host(config()) as a, open_host(config()) as b:
        events = a.peer_events()
        bare = b.listen_addrs()[0].rsplit("/p2p/", 1)[0]
        a.add_known_peer(b.peer_id, [bare])
        discovered = await next_event(events, "discovered", b.peer_id)
        assert discovered.addrs == (bare,)
        with pytest.raises(trio.WouldBlock):
            events.receive_nowait()
        assert a.known_addrs(b.peer_id) == [bare]
        a.add_known_peer(b.peer_id, [bare])  # nothing new: no second event
        a.add_known_peer(b.peer_id, [f"/ip4/127.0.0.1/tcp/{n}" for n in range(1, 100)])
        assert len(a.known_addrs(b.peer_id)) == 1 + 8  # capped per call
        await a.dial(b.peer_id)
        assert a.is_connected(b.peer_id)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def test_bootstrap_peer_down_at_first_is_connected_once_it_starts(tmp_path: Path) -> None:
    """Issue item 7: our redial loop keeps trying (libp2p's gives up after 3 failures)."""
    key = tmp_path / "bootstrap.key"
    port = _free_port()
    bootstrap_id = peer_id_of(load_or_create_identity(key))
    bootstrap_addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{bootstrap_id}"
    cfg = config(bootstrap=(bootstrap_addr,), bootstrap_backoff_min_s=0.1, bootstrap_backoff_max_s=0.4)
    async with open_host(cfg) as node:
        events = node.peer_events()
        # More failed attempts than libp2p's own bootstrap would ever make.
        await wait_until(lambda: node.statistics().bootstrap_attempts >= 5)
        assert not node.is_connected(bootstrap_id)
        bootstrap_cfg = config(listen=(f"/ip4/127.0.0.1/tcp/{port}",), persist_identity=True, identity_path=key)
        async with open_host(bootstrap_cfg) as bootstrap:
            assert bootstrap.peer_id == bootstrap_id
            await next_event(events, "connected", bootstrap_id)
            # And it reconnects after the connection drops.
            await bootstrap.disconnect(node.peer_id)
            await next_event(events, "disconnected", bootstrap_id)
            await next_event(events, "connected", bootstrap_id)


def _no_multicast(*args: object, **kwargs: object) -> object:
    raise OSError("no multicast in tests")


async def test_mdns_discovery_connects_to_the_discovered_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue item 8, through the hook libp2p's mDNS listener calls (from zeroconf's thread).

    Real multicast is not used here: tests stay on 127.0.0.1, and zeroconf would announce on
    every interface of the machine, so zeroconf itself is replaced by a failure (the bridge
    then runs without it, as on a machine without multicast). The hook is the process-global
    ``peerDiscovery`` event. Two separate processes with real mDNS did find and connect to
    each other within a second on the development machine.
    """
    monkeypatch.setattr("peerinfer.net.discovery.create_mdns_discovery", _no_multicast)
    async with open_host(config(mdns=True)) as a, open_host(config()) as b:
        events = a.peer_events()
        bare = b.listen_addrs()[0].rsplit("/p2p/", 1)[0]
        info = PeerInfo(ID.from_base58(b.peer_id), [multiaddr.Multiaddr(bare)])
        # Emitted from a foreign thread, exactly as zeroconf's ServiceBrowser does.
        thread = threading.Thread(target=peerDiscovery.emit_peer_discovered, args=(info,))
        thread.start()
        await trio.to_thread.run_sync(thread.join)
        await next_event(events, "discovered", b.peer_id)
        await next_event(events, "connected", b.peer_id)


async def test_without_mdns_discoveries_are_ignored() -> None:
    async with open_host(config(mdns=False)) as a, open_host(config()) as b:
        bare = b.listen_addrs()[0].rsplit("/p2p/", 1)[0]
        peerDiscovery.emit_peer_discovered(PeerInfo(ID.from_base58(b.peer_id), [multiaddr.Multiaddr(bare)]))
        await trio.sleep(0.3)  # give a (wrong) dial time to happen; the assertion is absence
        assert a.connected_peers() == []
        assert a.known_addrs(b.peer_id) == []


async def test_closed_host_refuses_use() -> None:
    async with open_host(config()) as a:
        pass
    with pytest.raises(ClosedError):
        await a.publish("t", b"x")
    with pytest.raises(ClosedError):
        await a.open_stream(a.peer_id, "/x")


async def test_a_reset_is_not_mistaken_for_a_clean_end() -> None:
    """py-libp2p's yamux turns a RST into a plain EOF; FramedStream must still tell them apart."""

    async def answer_then_fail(stream: FramedStream) -> None:
        await stream.receive()
        await stream.send(b"partial answer")
        raise RuntimeError("failed mid-answer")

    async with open_host(config()) as a, open_host(config()) as b:
        b.set_handler("/test/fails/1", answer_then_fail)
        await a.connect(b.listen_addrs()[0])
        stream = await a.open_stream(b.peer_id, "/test/fails/1")
        await stream.send(b"question")
        await stream.close_write()
        assert await stream.receive() == b"partial answer"
        with pytest.raises(PeerUnavailableError):
            await stream.receive()


async def test_an_exception_in_the_body_comes_out_as_itself() -> None:
    """libp2p nests its nurseries around our body; callers must not see ExceptionGroups."""

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with open_host(config()):
            raise Boom


async def test_a_peer_whose_pings_fail_gets_a_fresh_connection_that_replaces_the_stalled_one() -> None:
    """b stops answering pings (its connection looks stalled, as behind a cut link): a probes it
    with a fresh connection and, once that opens, closes the one its pings failed on; b counts
    as newly connected, never as disconnected (the old connection may have been all we had)."""
    cfg_a = config(liveness_interval_s=0.2, liveness_timeout_s=0.3, liveness_max_failures=50,
                   replace_stalled_connections=True)
    async with open_host(cfg_a) as a, open_host(config()) as b:
        events = a.peer_events()
        await a.connect(b.listen_addrs()[0])
        await next_event(events, "connected", b.peer_id)
        (first,) = a._live_connections(ID.from_base58(b.peer_id))

        async def never_answer(stream: FramedStream) -> None:
            await trio.sleep_forever()

        b.set_handler(net.host.PING_PROTOCOL, never_answer)
        seen = []
        with trio.fail_after(15):
            async for ev in events:
                seen.append(ev.kind)
                if ev.peer_id == b.peer_id and ev.kind == "connected":
                    break
        assert "disconnected" not in seen and "unresponsive" not in seen
        await wait_until(lambda: first.is_closed)
        assert a.is_connected(b.peer_id)


async def test_gossip_flows_both_ways_after_the_connection_under_the_pubsub_streams_closes() -> None:
    """Two connections between a and b; the older one, which carries both pubsub streams,
    closes (as when a stalled connection is replaced, or a restarted peer's new connection
    meets the old one). Each side renews its stream on the other connection. py-libp2p's
    pubsub forgets the peer's subscriptions whenever a write on *our* stream fails, also those
    the peer has just sent on its renewed stream: the side whose write failed second then never
    sends the other anything (it knows of no subscriber), the "restarted peer admitted but
    silent" of docs/reach.md. The order here is that one: a's write fails first (a
    subscription), b's after b took in a's renewed hello (its publish)."""
    topic, later = "peerinfer/test/announce", "peerinfer/test/later"
    async with open_host(config()) as a, open_host(config()) as b:
        at_a = await a.subscribe(topic)
        at_b = await b.subscribe(topic)
        await a.connect(b.listen_addrs()[0])
        await mesh_ready([a, b], topic)
        a_id, b_id = ID.from_base58(a.peer_id), ID.from_base58(b.peer_id)
        (older,) = a._live_connections(b_id)
        assert await a._fresh_connection(b.peer_id, 5.0)
        await wait_until(lambda: len(a._live_connections(b_id)) == 2 and len(b._live_connections(a_id)) == 2)
        await a._close_connection(b.peer_id, older)
        await wait_until(lambda: len(a._live_connections(b_id)) == 1 and len(b._live_connections(a_id)) == 1)
        await a.subscribe(later)  # a's write on its dead stream fails: a renews it, with a hello
        await wait_until(lambda: a_id in b._pubsub.peer_topics.get(later, ()))
        # b's first publication fails on its dead stream, as a's subscription did
        assert await heard(b, topic, at_a), "b forgot a's subscriptions: its gossip no longer reaches a"
        assert await heard(a, topic, at_b)


async def heard(sender: Host, topic: str, channel: trio.MemoryReceiveChannel[net.GossipMessage]) -> bool:
    """One of up to 20 publications of ``sender`` (one every 0.25 s) arrives on ``channel``."""
    for i in range(20):
        await sender.publish(topic, b"after %d" % i)
        with trio.move_on_after(0.25):
            message = await channel.receive()
            return message.sender == sender.peer_id
    return False


async def silent_relay(
    target_port: int, *, task_status: trio.TaskStatus[tuple[int, trio.Event]] = trio.TASK_STATUS_IGNORED
) -> None:
    """A TCP relay on 127.0.0.1 to ``target_port``, reporting (its port, an event). Once the
    event is set it forwards nothing more and keeps every socket open: a link that failed
    without a FIN or a reset. Runs until cancelled."""
    silent = trio.Event()

    async def pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
        while data := await source.receive_some(65536):
            if silent.is_set():
                continue  # swallowed, as by a cut link
            await sink.send_all(data)

    async def serve(client: trio.SocketStream) -> None:
        async with client, await trio.open_tcp_stream("127.0.0.1", target_port) as upstream:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, client, upstream)
                nursery.start_soon(pump, upstream, client)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        task_status.started((listeners[0].socket.getsockname()[1], silent))


async def test_a_ping_caught_on_a_connection_replaced_meanwhile_is_asked_again_on_the_new_one() -> None:
    """a's ping to b starts on a connection that has gone silent (a relay forwarding nothing);
    a fresh direct connection then replaces it. The ping's failure is the old connection's, not
    b's: the ping is asked again and answers (a node fed such a failure to its core, which
    dropped a peer it had just got back after a partition)."""
    replacing = config(replace_stalled_connections=True)
    async with open_host(replacing) as a, open_host(config()) as b, trio.open_nursery() as relays:
        b_port = int(multiaddr.Multiaddr(b.listen_addrs()[0]).value_for_protocol("tcp"))
        relay_port, silent = await relays.start(silent_relay, b_port)
        await a.connect(f"/ip4/127.0.0.1/tcp/{relay_port}/p2p/{b.peer_id}")
        b_id = ID.from_base58(b.peer_id)
        (stalled,) = a._live_connections(b_id)
        silent.set()
        outcome: list[object] = []

        async def ping() -> None:
            try:
                outcome.append(await a.ping(b.peer_id, timeout=4.0))
            except PeerInferError as exc:
                outcome.append(exc)

        async with trio.open_nursery() as pings:
            pings.start_soon(ping)
            await trio.sleep(0.3)  # the ping is under way on the silent connection
            assert not outcome
            a._liveness_failures[b.peer_id] = 1  # as after a failed liveness ping
            direct = multiaddr.Multiaddr(b.listen_addrs()[0].rsplit("/p2p/", 1)[0])
            await a._within("dial", b.peer_id, 5.0, lambda: a._network.dial_addr(direct, b_id))
            await wait_until(lambda: stalled.is_closed, 10)
        (rtt,) = outcome
        assert isinstance(rtt, float), f"the ping failed: {rtt!r}"
        assert a.is_connected(b.peer_id) and a._live_connections(b_id) != [stalled]
        relays.cancel_scope.cancel()


async def test_a_new_connection_replaces_an_older_one_that_went_silent() -> None:
    """a reaches b through a relay that then goes silent (sockets open, nothing forwarded: a
    link that failed without a FIN, or a restarted peer's old connection); b dials a anew.
    Each side pings the older connection over itself, finds it silent and replaces it. Gossip
    flows both ways again (libp2p left both pubsub streams on the silent connection: nothing
    reached the other side), and neither side saw the other disconnect."""
    topic = "peerinfer/test/announce"
    replacing = config(replace_stalled_connections=True)
    async with open_host(replacing) as a, open_host(replacing) as b, trio.open_nursery() as relays:
        b_port = int(multiaddr.Multiaddr(b.listen_addrs()[0]).value_for_protocol("tcp"))
        relay_port, silent = await relays.start(silent_relay, b_port)
        events_a, events_b = a.peer_events(), b.peer_events()
        at_a = await a.subscribe(topic)
        at_b = await b.subscribe(topic)
        await a.connect(f"/ip4/127.0.0.1/tcp/{relay_port}/p2p/{b.peer_id}")
        await mesh_ready([a, b], topic)
        a_id, b_id = ID.from_base58(a.peer_id), ID.from_base58(b.peer_id)
        (older_at_a,) = a._live_connections(b_id)
        (older_at_b,) = b._live_connections(a_id)
        silent.set()
        direct = multiaddr.Multiaddr(a.listen_addrs()[0].rsplit("/p2p/", 1)[0])
        await b._within("dial", a.peer_id, 5.0, lambda: b._network.dial_addr(direct, a_id))
        await wait_until(lambda: len(a._live_connections(b_id)) == 2)
        # While the older one is checked (5 s here) new streams go on the new one: libp2p
        # would pick the silent one (it carries the pubsub streams), and this ping would hang.
        assert isinstance(await a.ping(b.peer_id, timeout=2.0), float)
        assert not older_at_a.is_closed
        await wait_until(lambda: older_at_a.is_closed and older_at_b.is_closed, 15)
        assert a.is_connected(b.peer_id) and b.is_connected(a.peer_id)
        assert await heard(b, topic, at_a), "b's gossip does not reach a"
        assert await heard(a, topic, at_b), "a's gossip does not reach b"
        for events, other in ((events_a, b.peer_id), (events_b, a.peer_id)):
            seen = []
            while True:
                try:
                    seen.append(events.receive_nowait())
                except trio.WouldBlock:
                    break
            assert not any(e.kind == "disconnected" and e.peer_id == other for e in seen), seen
        relays.cancel_scope.cancel()
