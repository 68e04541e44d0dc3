"""A real ``peerinfer node`` process, attacked on its own protocols over loopback.

One node process (simulated engine) serves the whole module. Each test sends it something
hostile on ``/peerinfer/generate/1.0.0``, ``/peerinfer/sync/1.0.0`` or
``/peerinfer/status/1.0.0`` from a separate libp2p host (so the attacker is a peer like any
other, authenticated by Noise but free to write any bytes), checks that the node refuses it the
documented way (an ``ErrorMessage``, or a reset stream), and then that an honest client is still
served. Every wait is bounded; the node process is stopped by the fixture, whatever happens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import msgpack
import pytest
import trio
from libp2p.network.stream.exceptions import StreamReset
from libp2p.utils.varint import encode_uvarint

from peerinfer.client import Client
from peerinfer.core.messages import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    ErrorMessage,
    GenerateDone,
    GenerateRequest,
    SamplingParams,
    StatusRequest,
    SyncRequest,
    SyncResponse,
    TokenChunk,
    decode,
    encode,
)
from peerinfer.errors import InvalidRequestError, PeerUnavailableError, ProtocolError, RemoteError
from peerinfer.net import FramedStream, Host, HostConfig, open_host
from peerinfer.node import GENERATE_PROTOCOL, STATUS_PROTOCOL, SYNC_PROTOCOL
from peerinfer.testing import Cluster, NodeHandle, start_cluster

pytestmark = pytest.mark.slow

#: The node's deadline for one frame (HostConfig.stream_timeout_s's default) is 10 s; a stream
#: the node should have reset must be gone well within this.
NODE_GIVES_UP_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with start_cluster(1) as c:
        yield c


@pytest.fixture
def node(cluster: Cluster) -> NodeHandle:
    (handle,) = cluster.nodes
    assert handle.alive, handle.log_tail()
    return handle


@asynccontextmanager
async def attacker(node: NodeHandle) -> AsyncIterator[Host]:
    config = HostConfig(
        listen=("/ip4/127.0.0.1/tcp/0",),
        persist_identity=False,
        mdns=False,
        liveness_interval_s=0,
        gossip_topics=(),
        stream_timeout_s=5.0,
    )
    async with open_host(config) as host:
        with trio.fail_after(10):
            await host.connect(node.addr)
        yield host


async def open_raw(host: Host, node: NodeHandle, protocol: str) -> FramedStream:
    return await host.open_stream(node.peer_id, protocol, timeout=10)


async def write_bytes(stream: FramedStream, data: bytes) -> None:
    """Write ``data`` as is, bypassing the framing (and its size check)."""
    with trio.fail_after(10):
        await stream._stream.write(data)


async def assert_stream_ended_by_node(stream: FramedStream, timeout_s: float = 10.0) -> None:
    """The node reset or closed the stream (rather than answering or keeping it open)."""
    with trio.fail_after(timeout_s + 5):
        with pytest.raises((PeerUnavailableError, ProtocolError, trio.EndOfChannel)):
            frame = await stream.receive(timeout=timeout_s)
            raise AssertionError(f"the node answered {decode(frame)!r}")


async def assert_error_reply(stream: FramedStream, code: str) -> ErrorMessage:
    with trio.fail_after(15):
        reply = decode(await stream.receive(timeout=10), expected=ErrorMessage)
    assert isinstance(reply, ErrorMessage)
    assert reply.code == code, reply
    return reply


async def assert_still_serving(node: NodeHandle) -> None:
    assert node.alive, node.log_tail()
    with trio.fail_after(30):
        async with Client.connect(node.addr, timeout_s=20) as client:
            result = await client.generate("still there? a normal question", max_tokens=3)
            status = await client.status()
    assert result.completion_tokens == 3
    assert result.served_by == node.peer_id
    assert status["peer_id"] == node.peer_id


def generate_request(**overrides: object) -> GenerateRequest:
    fields: dict[str, object] = dict(
        request_id="attack-1", params=SamplingParams(max_tokens=2), prompt="hello"
    )
    fields.update(overrides)
    return GenerateRequest(**fields)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# /peerinfer/generate/1.0.0


async def test_garbage_frame_is_refused_with_a_protocol_error(node: NodeHandle) -> None:
    async with attacker(node) as host:
        for garbage in (b"\xc1\xc1garbage", b"\x00", msgpack.packb({"a": 1}), b"\x93\x01\x0a"):
            stream = await open_raw(host, node, GENERATE_PROTOCOL)
            await stream.send(garbage)
            await assert_error_reply(stream, "protocol")
            await stream.aclose()
    await assert_still_serving(node)


async def test_unframed_garbage_and_truncated_frames_end_the_stream(node: NodeHandle) -> None:
    async with attacker(node) as host:
        # A length prefix longer than any 64-bit varint.
        stream = await open_raw(host, node, GENERATE_PROTOCOL)
        await write_bytes(stream, b"\xff" * 11)
        await assert_stream_ended_by_node(stream)
        # A frame cut short: the length says 100 bytes, 3 arrive, then the writer closes.
        stream = await open_raw(host, node, GENERATE_PROTOCOL)
        await write_bytes(stream, encode_uvarint(100) + b"abc")
        await stream.close_write()
        await assert_stream_ended_by_node(stream)
    await assert_still_serving(node)


async def test_a_frame_over_the_size_limit_is_refused_before_its_body(node: NodeHandle) -> None:
    async with attacker(node) as host:
        stream = await open_raw(host, node, GENERATE_PROTOCOL)
        # Only the length prefix is sent: the node must refuse on it, not wait for 8 MiB.
        await write_bytes(stream, encode_uvarint(MAX_FRAME_BYTES + 1))
        await assert_stream_ended_by_node(stream)
        stream = await open_raw(host, node, GENERATE_PROTOCOL)
        await write_bytes(stream, encode_uvarint(2**62))
        await assert_stream_ended_by_node(stream)
    await assert_still_serving(node)


async def test_wrong_protocol_version_is_refused(node: NodeHandle) -> None:
    good = msgpack.unpackb(encode(generate_request()))
    assert good[0] == PROTOCOL_VERSION
    async with attacker(node) as host:
        for version in (PROTOCOL_VERSION + 1, 0, "1", None):
            stream = await open_raw(host, node, GENERATE_PROTOCOL)
            await stream.send(msgpack.packb([version, *good[1:]]))
            reply = await assert_error_reply(stream, "protocol")
            assert "version" in reply.message
            await stream.aclose()
        # The right version but a message that does not belong on this protocol.
        stream = await open_raw(host, node, GENERATE_PROTOCOL)
        await stream.send(encode(StatusRequest()))
        await assert_error_reply(stream, "protocol")
        await stream.aclose()
    await assert_still_serving(node)


async def test_prompts_longer_than_the_context_are_refused(node: NodeHandle) -> None:
    # Through the client: a text prompt of more tokens than the context (8192) holds.
    with trio.fail_after(60):
        async with Client.connect(node.addr) as client:
            with pytest.raises(InvalidRequestError, match="context"):
                await client.generate("x " * 9000, max_tokens=2)
    async with attacker(node) as host:
        # A forwarded request carries token ids; too many of them, and ids outside the vocabulary.
        for tokens in ((5,) * 9000, (10**6, 5)):
            stream = await open_raw(host, node, GENERATE_PROTOCOL)
            await stream.send(encode(generate_request(prompt=None, tokens=tokens, forwarded=True)))
            await assert_error_reply(stream, "invalid")
            await stream.aclose()
        # A prompt text longer than the wire schema allows is a protocol error.
        stream = await open_raw(host, node, GENERATE_PROTOCOL)
        frame = msgpack.unpackb(encode(generate_request()))
        frame[4] = "y" * (1_048_576 + 1)
        await stream.send(msgpack.packb(frame))
        await assert_error_reply(stream, "protocol")
        await stream.aclose()
    await assert_still_serving(node)


async def test_slow_loris_streams_do_not_stop_the_node(node: NodeHandle) -> None:
    """Forty streams opened and left silent (or holding half a frame): the node serves an
    honest client meanwhile, and ends every one of them on its own deadline."""
    async with attacker(node) as host:
        streams: list[FramedStream] = []
        with trio.fail_after(60):
            for i in range(40):
                try:
                    stream = await open_raw(host, node, GENERATE_PROTOCOL)
                except RemoteError:
                    continue  # beyond the per-peer stream limit: refused, as it should be
                if i % 2:
                    try:
                        await write_bytes(stream, encode_uvarint(50) + b"ab")
                    except StreamReset:
                        continue  # reset as soon as opened: beyond the per-peer stream limit
                streams.append(stream)
        assert streams
        await assert_still_serving(node)
        with trio.fail_after(NODE_GIVES_UP_WITHIN_S + 10):
            for stream in streams:
                await assert_stream_ended_by_node(stream, timeout_s=NODE_GIVES_UP_WITHIN_S)
    await assert_still_serving(node)


# --------------------------------------------------------------------------------------------
# /peerinfer/sync/1.0.0 and /peerinfer/status/1.0.0


async def test_malformed_sync_requests_are_refused(node: NodeHandle) -> None:
    valid = msgpack.unpackb(encode(SyncRequest(session=1, since_epoch=0, slice=0)))
    bad_slice = [*valid[:4], 300, *valid[5:]]  # slice is a u8
    bad_queries = [*valid[:5], [[1, 2, 3, "x"]]]
    attacks = [
        b"\xc1not msgpack",
        msgpack.packb(bad_slice),
        msgpack.packb(bad_queries),
        msgpack.packb([PROTOCOL_VERSION + 1, *valid[1:]]),
        encode(generate_request()),  # a well-formed message of another protocol
    ]
    async with attacker(node) as host:
        for data in attacks:
            stream = await open_raw(host, node, SYNC_PROTOCOL)
            await stream.send(data)
            await assert_stream_ended_by_node(stream)
        # Oversized, and silent.
        stream = await open_raw(host, node, SYNC_PROTOCOL)
        await write_bytes(stream, encode_uvarint(MAX_FRAME_BYTES + 1))
        await assert_stream_ended_by_node(stream)
        # A well-formed pull is still answered.
        with trio.fail_after(15):
            reply = await host.request(
                node.peer_id, SYNC_PROTOCOL, encode(SyncRequest(session=7, since_epoch=0, slice=0))
            )
        response = decode(reply, expected=SyncResponse)
        assert isinstance(response, SyncResponse) and response.session == 7
    await assert_still_serving(node)


async def test_malformed_status_requests_are_refused(node: NodeHandle) -> None:
    async with attacker(node) as host:
        for data in (b"\xc1", encode(generate_request())):
            stream = await open_raw(host, node, STATUS_PROTOCOL)
            await stream.send(data)
            await assert_stream_ended_by_node(stream)
    await assert_still_serving(node)


async def test_a_forward_over_its_queue_limit_is_refused_as_busy(node: NodeHandle) -> None:
    """``max_outstanding`` crosses the wire: a forwarded request that allows no request ahead of
    it is refused while the node is busy; one that allows one is queued and served."""
    async with attacker(node) as host, Client.connect(node.addr) as client:
        long_run = await open_raw(host, node, GENERATE_PROTOCOL)
        # ~1,000 uncached tokens: seconds of prefill with the default costs.
        await long_run.send(encode(generate_request(
            request_id="busy-1", prompt=None, tokens=tuple(range(5, 1005)), forwarded=True,
        )))
        with trio.fail_after(20):
            while (await client.status())["load"]["running"] < 1:
                await trio.sleep(0.05)
        refused = await open_raw(host, node, GENERATE_PROTOCOL)
        await refused.send(encode(generate_request(
            request_id="busy-2", prompt=None, tokens=(7, 8, 9), forwarded=True, max_outstanding=0,
        )))
        reply = await assert_error_reply(refused, "busy")
        assert "more than the 0" in reply.message
        queued = await open_raw(host, node, GENERATE_PROTOCOL)
        await queued.send(encode(generate_request(
            request_id="busy-3", prompt=None, tokens=(7, 8, 9), forwarded=True, max_outstanding=1,
        )))
        with trio.fail_after(60):
            while True:
                msg = decode(await queued.receive(timeout=30), expected=(TokenChunk, GenerateDone))
                if isinstance(msg, GenerateDone):
                    break
        for stream in (long_run, refused, queued):
            await stream.aclose()
    await assert_still_serving(node)


async def test_the_node_survived_every_attack(cluster: Cluster) -> None:
    """Runs last in this module: the same process served all along."""
    (handle,) = cluster.nodes
    assert handle.alive, handle.log_tail()
    await assert_still_serving(handle)
