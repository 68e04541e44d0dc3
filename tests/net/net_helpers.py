"""Helpers shared by the network shell's tests (tests/net/)."""

from __future__ import annotations

from collections.abc import Callable

import trio

from peerinfer.net import FramedStream, HostConfig, PeerEvent
from peerinfer.testing import waiting

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


def config(**overrides: object) -> HostConfig:
    """A test host: loopback, ephemeral port, throwaway identity, no mDNS, no liveness loop."""
    base: dict[str, object] = {
        "listen": LOOPBACK,
        "persist_identity": False,
        "mdns": False,
        "liveness_interval_s": 0.0,
        "stream_timeout_s": 5.0,
        "connect_timeout_s": 5.0,
    }
    base.update(overrides)
    return HostConfig(**base)  # type: ignore[arg-type]


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """``peerinfer.testing.wait_until`` with the host tests' tighter default bound (10 s)."""
    await waiting.wait_until(predicate, timeout)


async def next_event(events: trio.MemoryReceiveChannel[PeerEvent], kind: str, peer: str) -> PeerEvent:
    with trio.fail_after(10):
        async for event in events:
            if event.kind == kind and event.peer_id == peer:
                return event
    raise AssertionError("event channel closed")


async def echo(stream: FramedStream) -> None:
    async for frame in stream:
        await stream.send(frame)
