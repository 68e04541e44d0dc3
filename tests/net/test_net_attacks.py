"""Each hardening item of the network shell, attacked over loopback (127.0.0.1 only).

The attackers are raw py-libp2p hosts (to speak plaintext or write garbage on the gossipsub
stream), our own ``Host`` misused through its internals (slow-loris), or a separate OS process
that we SIGSTOP (a hung peer). Every wait is bounded; every process is killed in a ``finally``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.custom_types import TProtocol, TSecurityOptions
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.peer.peerstore import create_signed_peer_record
from libp2p.pubsub.pb import rpc_pb2
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.utils.varint import encode_uvarint, encode_varint_prefixed

from peerinfer.errors import PeerUnavailableError, ProtocolError, RemoteError, RequestTimeoutError
from peerinfer.net import FramedStream, GossipMessage, Host, open_host
from tests.net.net_helpers import config, echo, next_event, wait_until

REPO = Path(__file__).resolve().parents[2]
RAW_LISTEN = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
MESHSUB = TProtocol("/meshsub/1.1.0")
ECHO = "/test/echo/1"


@asynccontextmanager
async def raw_host(security: str = "noise") -> AsyncIterator[IHost]:
    """A bare py-libp2p host offering exactly one security protocol."""
    key_pair = create_new_key_pair()
    sec: TSecurityOptions
    if security == "plaintext":
        sec = {TProtocol(PLAINTEXT_PROTOCOL_ID): InsecureTransport(key_pair)}
    else:
        sec = {NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)}
    host = new_host(key_pair=key_pair, sec_opt=sec, muxer_preference="YAMUX", listen_addrs=RAW_LISTEN)
    async with host.run(RAW_LISTEN):
        yield host


async def raw_connect(attacker: IHost, target: Host) -> None:
    with trio.fail_after(10):
        await attacker.connect(info_from_p2p_addr(multiaddr.Multiaddr(target.listen_addrs()[0])))


async def assert_still_serving(node: Host, honest: Host, topic: str,
                               at_node: trio.MemoryReceiveChannel[GossipMessage],
                               at_honest: trio.MemoryReceiveChannel[GossipMessage]) -> None:
    """The node still answers streams, receives gossip and publishes gossip."""
    assert await honest.request(node.peer_id, ECHO, b"still there?") == b"still there?"
    await honest.publish(topic, b"to node")
    await node.publish(topic, b"from node")
    with trio.fail_after(10):
        assert (await at_node.receive()).data == b"to node"
        assert (await at_honest.receive()).data == b"from node"


@asynccontextmanager
async def node_with_honest_peer(topic: str, **overrides: object) -> AsyncIterator[
    tuple[Host, Host, trio.MemoryReceiveChannel[GossipMessage], trio.MemoryReceiveChannel[GossipMessage]]
]:
    async with open_host(config(**overrides)) as node, open_host(config()) as honest:
        node.set_handler(ECHO, echo)
        await honest.connect(node.listen_addrs()[0])
        at_node = await node.subscribe(topic)
        at_honest = await honest.subscribe(topic)
        await wait_until(lambda: honest.peer_id in node.mesh_peers(topic) and node.peer_id in honest.mesh_peers(topic))
        yield node, honest, at_node, at_honest


# --- 1. Noise only --------------------------------------------------------------------------


async def test_a_plaintext_dialer_is_refused() -> None:
    """A plaintext peer could claim any peer id; it must not get a connection at all."""
    async with open_host(config()) as node, raw_host("plaintext") as attacker:
        with pytest.raises(Exception):  # noqa: B017 - libp2p's own dial error; what matters is below
            await raw_connect(attacker, node)
        assert node.connected_peers() == []
        assert attacker.get_connected_peers() == []


async def test_a_noise_dialer_is_known_by_its_proven_id() -> None:
    async with open_host(config()) as node, raw_host("noise") as peer:
        events = node.peer_events()
        await raw_connect(peer, node)
        await next_event(events, "connected", peer.get_id().to_base58())


# --- 2. garbage on the gossipsub stream -----------------------------------------------------


async def test_garbage_on_the_gossipsub_stream_drops_the_peer_not_the_node() -> None:
    topic = "peerinfer/test/gossip"
    async with node_with_honest_peer(topic) as (node, honest, at_node, at_honest), raw_host() as attacker:
        events = node.peer_events()
        attacker_id = attacker.get_id().to_base58()
        await raw_connect(attacker, node)
        stream = await attacker.new_stream(node._h.get_id(), [MESHSUB])
        # A valid length prefix, then 200 bytes protobuf cannot parse (wire type 7 first).
        garbage = bytes([0x07]) + random.Random(1).randbytes(199)
        await stream.write(encode_varint_prefixed(garbage))
        misbehaved = await next_event(events, "misbehaved", attacker_id)
        assert "DecodeError" in misbehaved.detail
        await next_event(events, "disconnected", attacker_id)
        await assert_still_serving(node, honest, topic, at_node, at_honest)
        assert node.statistics().protocol_violations == 1


async def test_a_message_with_a_garbage_signing_key_does_not_kill_pubsub() -> None:
    """Found while building the adapter: the signature check raises on an undecodable key."""
    topic = "peerinfer/test/gossip"
    async with node_with_honest_peer(topic) as (node, honest, at_node, at_honest), raw_host() as attacker:
        events = node.peer_events()
        attacker_id = attacker.get_id().to_base58()
        await raw_connect(attacker, node)
        stream = await attacker.new_stream(node._h.get_id(), [MESHSUB])
        forged = rpc_pb2.Message(
            from_id=b"not a peer id", data=b"x", topicIDs=[topic], seqno=b"\0" * 8,
            signature=b"sig", key=b"not a key",
        )
        await stream.write(encode_varint_prefixed(rpc_pb2.RPC(publish=[forged]).SerializeToString()))
        await next_event(events, "misbehaved", attacker_id)
        await assert_still_serving(node, honest, topic, at_node, at_honest)


async def test_peer_exchange_in_a_prune_does_not_make_us_dial() -> None:
    """Found while building the adapter: any peer can PRUNE us with 16 self-signed "peer
    records" naming arbitrary addresses, and py-libp2p dials each one, inline, whether or not
    we enabled PX. We ignore gossipsub PX (peer exchange is the node's, with its own checks)."""
    topic = "peerinfer/test/px"
    async with node_with_honest_peer(topic) as (node, honest, *_), raw_host() as attacker, \
            open_host(config()) as bystander:
        bystander_events = bystander.peer_events()
        await raw_connect(attacker, node)
        key_pair = bystander._h.get_private_key()  # the record must be validly signed
        record = create_signed_peer_record(
            bystander._h.get_id(), [multiaddr.Multiaddr(bystander.listen_addrs()[0].rsplit("/p2p/", 1)[0])], key_pair
        )
        prune = rpc_pb2.RPC()
        entry = prune.control.prune.add(topicID=topic, backoff=60)
        entry.peers.add(peerID=bystander._h.get_id().to_bytes(), signedPeerRecord=record.marshal_envelope())
        stream = await attacker.new_stream(node._h.get_id(), [MESHSUB])
        await stream.write(encode_varint_prefixed(prune.SerializeToString()))
        # The PRUNE is processed before anything the honest peer sends after it.
        assert await honest.request(node.peer_id, ECHO, b"sync") == b"sync"
        await trio.sleep(0.5)  # a dial would have connected by now; the assertion is absence
        assert not node.is_connected(bystander.peer_id)
        with pytest.raises(trio.WouldBlock):
            bystander_events.receive_nowait()


def random_rpc(rng: random.Random, topic: str, origin: bytes) -> rpc_pb2.RPC:
    """A well-formed gossipsub RPC with random subscriptions, messages and control parts."""

    def blob(size: int | None = None) -> bytes:
        return rng.randbytes(rng.randint(0, 40) if size is None else size)

    def any_topic() -> str:
        return rng.choice([topic, "", "x" * rng.randint(1, 300), blob().hex()])

    rpc = rpc_pb2.RPC()
    for _ in range(rng.randint(0, 3)):
        rpc.subscriptions.add(subscribe=rng.random() < 0.7, topicid=any_topic())
    for _ in range(rng.randint(0, 2)):
        rpc.publish.add(
            from_id=rng.choice([origin, blob()]), data=blob(), seqno=blob(rng.choice([0, 8, 20])),
            topicIDs=[any_topic() for _ in range(rng.randint(0, 3))], signature=blob(),
            key=rng.choice([b"", blob()]),
        )
    if rng.random() < 0.6:
        control = rpc.control
        for _ in range(rng.randint(0, 3)):
            control.ihave.add(topicID=any_topic(), messageIDs=[blob() for _ in range(rng.randint(0, 5))])
        for _ in range(rng.randint(0, 3)):
            control.iwant.add(messageIDs=[blob() for _ in range(rng.randint(0, 5))])
        for _ in range(rng.randint(0, 3)):
            control.graft.add(topicID=any_topic())
        for _ in range(rng.randint(0, 3)):
            prune = control.prune.add(topicID=any_topic(), backoff=rng.randint(0, 2**40))
            for _ in range(rng.randint(0, 2)):
                prune.peers.add(peerID=blob(), signedPeerRecord=blob())
    if rng.random() < 0.2:
        rpc.senderRecord = blob()
    return rpc


async def test_random_wellformed_pubsub_rpcs_do_not_kill_the_node() -> None:
    topic = "peerinfer/test/fuzz"
    rng = random.Random(20240501)
    async with node_with_honest_peer(topic) as (node, honest, at_node, at_honest):
        for _ in range(6):
            async with raw_host() as attacker:
                await raw_connect(attacker, node)
                stream = await attacker.new_stream(node._h.get_id(), [MESHSUB])
                origin = attacker.get_id().to_bytes()
                for _ in range(10):
                    try:
                        await stream.write(encode_varint_prefixed(random_rpc(rng, topic, origin).SerializeToString()))
                    except Exception:
                        break  # the node dropped us for a violation: fine
        await assert_still_serving(node, honest, topic, at_node, at_honest)


# --- 3. handlers never raise into the host --------------------------------------------------


async def test_a_raising_handler_resets_its_stream_and_the_host_carries_on() -> None:
    async with open_host(config()) as node, open_host(config()) as client:

        async def broken(stream: FramedStream) -> None:
            await stream.receive()
            raise ValueError("handler bug")

        node.set_handler("/test/broken/1", broken)
        node.set_handler(ECHO, echo)
        await client.connect(node.listen_addrs()[0])
        with pytest.raises(PeerUnavailableError):
            await client.request(node.peer_id, "/test/broken/1", b"hi")
        assert node.statistics().handler_errors == 1
        assert await client.request(node.peer_id, ECHO, b"ok") == b"ok"


# --- 4. validators never raise --------------------------------------------------------------


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_a_raising_validator_rejects_and_the_node_carries_on(asynchronous: bool) -> None:
    topic = "peerinfer/test/validated"
    verdicts: list[bytes] = []

    def judge(message: GossipMessage) -> bool:
        verdicts.append(message.data)
        if message.data == b"boom":
            raise ValueError("validator bug")
        return message.data != b"garbage"  # False only for provable garbage

    async def judge_async(message: GossipMessage) -> bool:
        await trio.lowlevel.checkpoint()
        return judge(message)

    async with open_host(config()) as node, open_host(config()) as honest:
        await honest.connect(node.listen_addrs()[0])
        at_node = await node.subscribe(topic, judge_async if asynchronous else judge)
        await honest.subscribe(topic)
        await wait_until(lambda: honest.peer_id in node.mesh_peers(topic))
        for data in (b"boom", b"garbage", b"stale but well-formed"):
            await honest.publish(topic, data)
        with trio.fail_after(10):
            delivered = await at_node.receive()
        assert delivered.data == b"stale but well-formed"
        # Validators run concurrently, one task per message: any order.
        assert sorted(verdicts) == sorted([b"boom", b"garbage", b"stale but well-formed"])
        assert delivered.sender == honest.peer_id


# --- 5. sized rate limits -------------------------------------------------------------------


async def test_twenty_messages_a_second_from_distinct_senders_all_arrive() -> None:
    """py-libp2p drops, silently, what one *forwarder* relays above 10 messages/s on a topic.

    The drop happens when a node relays (its own subscribers still get the message), so the
    receiver sits two hops behind the hub: senders -> hub -> relay -> receiver. The relay gets
    all 20 messages from one forwarder (the hub) within about a second.
    """
    topic = "peerinfer/test/burst"
    senders_count, per_sender = 5, 4
    async with open_host(config()) as hub, open_host(config()) as relay, open_host(config()) as receiver:
        await relay.connect(hub.listen_addrs()[0])
        await receiver.connect(relay.listen_addrs()[0])
        await hub.subscribe(topic)
        await relay.subscribe(topic)
        inbox = await receiver.subscribe(topic)
        async with AsyncExitStack() as stack:
            senders = [await stack.enter_async_context(open_host(config())) for _ in range(senders_count)]
            for sender in senders:
                await sender.connect(hub.listen_addrs()[0])
                await sender.subscribe(topic)
            await wait_until(
                lambda: relay.peer_id in hub.mesh_peers(topic)
                and receiver.peer_id in relay.mesh_peers(topic)
                and all(hub.peer_id in s.mesh_peers(topic) for s in senders)
            )
            async with trio.open_nursery() as burst:
                for index, sender in enumerate(senders):
                    for n in range(per_sender):
                        burst.start_soon(sender.publish, topic, f"{index}:{n}".encode())
            received: set[bytes] = set()
            with trio.fail_after(15):
                while len(received) < senders_count * per_sender:
                    received.add((await inbox.receive()).data)
            assert len(received) == 20


async def test_twenty_quick_publishes_from_one_node_all_go_out() -> None:
    """libp2p applies the same per-forwarder limit to our own publish() (forwarder = us)."""
    topic = "peerinfer/test/own-burst"
    async with open_host(config()) as sender, open_host(config()) as receiver:
        await receiver.connect(sender.listen_addrs()[0])
        await sender.subscribe(topic)
        inbox = await receiver.subscribe(topic)
        await wait_until(lambda: receiver.peer_id in sender.mesh_peers(topic))
        for n in range(20):
            await sender.publish(topic, str(n).encode())
        with trio.fail_after(15):
            received = {(await inbox.receive()).data for _ in range(20)}
        assert len(received) == 20


# --- 6. deadlines and liveness --------------------------------------------------------------


async def test_a_slow_loris_gets_a_timeout_and_a_reset_stream() -> None:
    outcome: list[str] = []

    async def patient(stream: FramedStream) -> None:
        try:
            await stream.receive()  # the host's stream_timeout_s: 1 s for the whole frame
        except RequestTimeoutError:
            outcome.append("timeout")
            raise

    async with open_host(config(stream_timeout_s=1.0)) as node, open_host(config()) as loris:
        node.set_handler("/test/patient/1", patient)
        await loris.connect(node.listen_addrs()[0])
        stream = await loris.open_stream(node.peer_id, "/test/patient/1")
        raw = stream._stream
        await raw.write(encode_uvarint(100))  # announce 100 bytes, then dribble them
        with trio.fail_after(10):
            with pytest.raises(Exception):  # noqa: B017 - the reset surfaces as a libp2p error
                for _ in range(100):
                    await raw.write(b"x")
                    await trio.sleep(0.25)
                    if node.statistics().handler_errors:
                        await raw.read(1)  # the stream was reset: this raises
        assert outcome == ["timeout"]
        assert node.statistics().handler_errors == 1


async def test_a_peer_that_stops_reading_makes_our_send_time_out() -> None:
    outcome: list[str] = []

    async def firehose(stream: FramedStream) -> None:
        try:
            while True:
                await stream.send(b"x" * 65536)  # yamux's 256 KiB window fills, then we wait
        except RequestTimeoutError:
            outcome.append("timeout")
            raise

    async with open_host(config(stream_timeout_s=1.0)) as node, open_host(config()) as reader:
        node.set_handler("/test/firehose/1", firehose)
        await reader.connect(node.listen_addrs()[0])
        stream = await reader.open_stream(node.peer_id, "/test/firehose/1")
        await stream.send(b"go")
        await wait_until(lambda: node.statistics().handler_errors == 1)
        assert outcome == ["timeout"]
        with pytest.raises(PeerUnavailableError):
            while True:  # the buffered frames, then the reset
                await stream.receive(timeout=5)


_HELPER = """
import sys, trio
from peerinfer.net import HostConfig, open_host

async def echo(stream):
    async for frame in stream:
        await stream.send(frame)

async def main():
    config = HostConfig(listen=("/ip4/127.0.0.1/tcp/0",), persist_identity=False, mdns=False,
                        liveness_interval_s=0)
    async with open_host(config) as host:
        host.set_handler("/test/echo/1", echo)
        print(host.listen_addrs()[0], flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


@asynccontextmanager
async def helper_process() -> AsyncIterator[tuple[trio.Process, str]]:
    """A peerinfer host in its own OS process; yields (process, its multiaddr). Always killed."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", _HELPER],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(30):
            while not line.endswith(b"\n"):
                chunk = await process.stdout.receive_some(1)
                if not chunk:
                    raise AssertionError("helper process exited before listening")
                line += chunk
        yield process, line.decode().strip()
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                process.send_signal(sig)
            except ProcessLookupError:
                pass
        with trio.move_on_after(10):
            await process.wait()


async def test_a_hung_peer_times_out_and_is_dropped_by_liveness() -> None:
    """A SIGSTOPped peer keeps its TCP connection; deadlines and pings must notice.

    A large send is left blocked on the hung peer's full socket, so the disconnect cannot be
    polite (the GO_AWAY queues behind it) and has to abort the socket.
    """
    liveness = config(liveness_interval_s=0.5, liveness_timeout_s=0.5, liveness_max_failures=2)
    async with helper_process() as (process, address), open_host(liveness) as node:
        events = node.peer_events()
        hung = await node.connect(address)
        assert await node.request(hung, ECHO, b"alive") == b"alive"
        assert await node.ping(hung) > 0
        stuck = await node.open_stream(hung, ECHO)
        process.send_signal(signal.SIGSTOP)
        with pytest.raises(RequestTimeoutError):
            await node.ping(hung, timeout=0.5)
        with pytest.raises(RequestTimeoutError):
            await node.request(hung, ECHO, b"anyone?", timeout=0.5)
        stuck_outcome: list[BaseException] = []

        async def send_into_the_void() -> None:
            try:
                await stuck.send(b"x" * 8_000_000, timeout=60)
            except RemoteError as exc:
                stuck_outcome.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_into_the_void)
            event = await next_event(events, "unresponsive", hung)
            assert event.detail
            await next_event(events, "disconnected", hung)
        assert not node.is_connected(hung)
        assert isinstance(stuck_outcome[0], PeerUnavailableError)  # aborted, not left hanging
        assert node.statistics().unresponsive_disconnects == 1


async def test_shutdown_is_bounded_with_a_hung_peer_and_a_stuck_write() -> None:
    """libp2p closes connections politely on shutdown; a full socket must not hang it."""
    async with helper_process() as (process, address):
        with trio.fail_after(15):
            async with open_host(config()) as node:
                hung = await node.connect(address)
                stuck = await node.open_stream(hung, ECHO)
                process.send_signal(signal.SIGSTOP)
                with trio.move_on_after(1.0):  # fill the socket, then give up on the write
                    await stuck.send(b"x" * 8_000_000, timeout=60)
                with trio.move_on_after(0.5):  # and leave a stream opening stuck behind it
                    await node.open_stream(hung, ECHO, timeout=60)


# --- 9. limits ------------------------------------------------------------------------------


async def test_streams_beyond_the_per_peer_limit_are_reset() -> None:
    release = trio.Event()

    async def hold(stream: FramedStream) -> None:
        frame = await stream.receive()
        await release.wait()
        await stream.send(frame)

    async with open_host(config(max_streams_per_peer=2)) as node, open_host(config()) as client:
        node.set_handler("/test/hold/1", hold)
        await client.connect(node.listen_addrs()[0])
        results: dict[int, object] = {}

        async def one(index: int) -> None:
            try:
                results[index] = await client.request(node.peer_id, "/test/hold/1", bytes([index]), timeout=10)
            except PeerUnavailableError as exc:
                results[index] = exc

        async with trio.open_nursery() as nursery:
            for index in range(3):
                nursery.start_soon(one, index)
            await wait_until(lambda: len(results) == 1)  # the refused one, while two are held
            assert node.statistics().streams_refused == 1
            release.set()
        refused = [i for i, r in results.items() if isinstance(r, PeerUnavailableError)]
        assert len(refused) == 1
        assert all(results[i] == bytes([i]) for i in results if i not in refused)


async def test_an_oversized_frame_is_a_protocol_error_and_a_reset() -> None:
    outcome: list[str] = []

    async def small(stream: FramedStream) -> None:
        try:
            await stream.receive()
        except ProtocolError:
            outcome.append("too big")
            raise

    async with open_host(config(max_frame_bytes=1000)) as node, open_host(config()) as client:
        node.set_handler("/test/small/1", small)
        await client.connect(node.listen_addrs()[0])
        with pytest.raises(PeerUnavailableError):
            await client.request(node.peer_id, "/test/small/1", b"x" * 5000)
        assert outcome == ["too big"]


async def test_connections_beyond_the_limit_are_refused() -> None:
    async with open_host(config(max_connections=1)) as node, open_host(config()) as first, \
            open_host(config()) as second:
        await first.connect(node.listen_addrs()[0])
        with pytest.raises((PeerUnavailableError, RequestTimeoutError)):
            await second.connect(node.listen_addrs()[0], timeout=3)
        await wait_until(lambda: node.connected_peers() == [first.peer_id])


async def test_a_banned_peer_is_disconnected_and_refused() -> None:
    topic = "peerinfer/test/ban"
    async with node_with_honest_peer(topic) as (node, honest, at_node, _):
        node.ban(honest.peer_id)
        await wait_until(lambda: not node.is_connected(honest.peer_id))
        with pytest.raises((PeerUnavailableError, RequestTimeoutError)):
            await honest.connect(node.listen_addrs()[0])
            await honest.request(node.peer_id, ECHO, b"let me in", timeout=2)
        await wait_until(lambda: not node.is_connected(honest.peer_id))
        assert node.banned_peers() == [honest.peer_id]
        await wait_until(lambda: not honest.is_connected(node.peer_id))
        node.unban(honest.peer_id)
        await honest.connect(node.listen_addrs()[0])
        assert await honest.request(node.peer_id, ECHO, b"back") == b"back"
