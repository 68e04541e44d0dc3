"""The ping protocol: the dialer sends one frame of up to ``PING_MAX_BYTES``, the listener
echoes it. Used by liveness (``peerinfer.net.liveness``) and by the check of one connection
(``peerinfer.net.connections``)."""

from __future__ import annotations

import secrets
from collections.abc import Callable

import trio

from peerinfer.errors import PeerUnavailableError, ProtocolError
from peerinfer.net.framing import FramedStream

#: Our liveness protocol: the dialer sends one frame of up to 64 bytes, the listener echoes it.
PING_PROTOCOL = "/peerinfer/ping/1.0.0"
PING_MAX_BYTES = 64


async def echo_nonce(stream: FramedStream, peer_id: str, left: Callable[[], float]) -> float:
    """One ping exchange on ``stream``: a random nonce out, the same bytes back, each step
    within ``left()`` seconds; returns the round trip."""
    nonce = secrets.token_bytes(8)
    started = trio.current_time()
    await stream.send(nonce, timeout=left())
    try:
        echo = await stream.receive(timeout=left(), max_bytes=PING_MAX_BYTES)
    except trio.EndOfChannel:
        # A remote failure like any other: escaping as EndOfChannel it ended the node that
        # pinged (its ping and liveness tasks catch peerinfer's errors only).
        raise PeerUnavailableError(f"{peer_id} ended a ping stream without answering") from None
    rtt = trio.current_time() - started
    if echo != nonce:
        raise ProtocolError(f"{peer_id} answered a ping with the wrong bytes")
    return rtt


async def serve_ping(stream: FramedStream) -> None:
    async for frame in stream:
        if len(frame) > PING_MAX_BYTES:
            raise ProtocolError("ping frame too large")
        await stream.send(frame)


__all__ = ["PING_MAX_BYTES", "PING_PROTOCOL", "echo_nonce", "serve_ping"]
