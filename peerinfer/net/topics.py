"""Gossip for one host, on top of the guarded gossipsub (``peerinfer.net.gossip``): topics and
their subscribers' channels, paced publishing, and what a protocol violation costs a peer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.rpc_queue import OutBoundQueueSize

from peerinfer.errors import ConfigError, InvalidRequestError
from peerinfer.net._errors import translated
from peerinfer.net.config import own_publish_rate
from peerinfer.net.connections import Connections
from peerinfer.net.context import HostContext, PeerEvent
from peerinfer.net.gossip import (
    GossipMessage,
    GuardedPubsub,
    Validator,
    gossip_message_from_pb,
    make_router,
    wrap_validator,
)
from peerinfer.net.pacing import TokenBucket

#: Before publishing, wait (at most OUTBOUND_DRAIN_WAIT_S) until every peer's libp2p outbound
#: queue is below this many RPCs (of OutBoundQueueSize = 32; a full queue drops silently).
OUTBOUND_HIGH_WATER = OutBoundQueueSize // 2
OUTBOUND_DRAIN_WAIT_S = 0.25


@dataclass
class _Subscriber:
    channel: trio.MemorySendChannel[GossipMessage]
    include_own: bool


@dataclass
class _Topic:
    subscribers: list[_Subscriber] = field(default_factory=list)


class Topics:
    """Joined topics, their subscribers and the publishing pace, over the guarded pubsub it
    builds (``admitted``: in a private swarm, whether a peer passed admission)."""

    def __init__(
        self, ctx: HostContext, connections: Connections,
        admitted: Callable[[ID], Awaitable[bool]] | None,
    ) -> None:
        self._ctx = ctx
        self._connections = connections
        self.router = make_router(ctx.config)
        self.pubsub = GuardedPubsub(
            ctx.h, self.router, ctx.config, self.on_violation, self.deliver, admitted=admitted,
        )
        self._topics: dict[str, _Topic] = {}
        self._buckets: dict[str, TokenBucket] = {}
        self._publish_rate = own_publish_rate(ctx.config.effective_gossip_rate_limit())

    def _ps(self) -> GuardedPubsub:
        return self.pubsub

    async def subscribe(
        self, topic: str, validator: Validator | None = None, *, include_own: bool = False
    ) -> trio.MemoryReceiveChannel[GossipMessage]:
        """See ``Host.subscribe``."""
        self._ctx.check_open()
        self.check_topic(topic)
        pubsub = self._ps()
        if validator is not None:
            pubsub.set_topic_validator(topic, wrap_validator(topic, validator), True)
        state = self._topics.get(topic)
        if state is None:
            with translated("subscribe"):
                await pubsub.subscribe(topic)  # messages arrive through deliver
            state = self._topics[topic] = _Topic()
        send, receive = trio.open_memory_channel[GossipMessage](self._ctx.config.subscription_buffer)
        state.subscribers.append(_Subscriber(send, include_own))
        return receive

    async def unsubscribe(self, topic: str) -> None:
        """See ``Host.unsubscribe``."""
        state = self._topics.pop(topic, None)
        if state is None:
            return
        for subscriber in state.subscribers:
            subscriber.channel.close()
        pubsub = self._ps()
        pubsub.remove_topic_validator(topic)
        with translated("unsubscribe"):
            await pubsub.unsubscribe(topic)

    def deliver(self, topic: str, raw: rpc_pb2.Message) -> None:
        """Called by GuardedPubsub, synchronously, for each accepted message of a joined topic."""
        state = self._topics.get(topic)
        if state is None:
            return
        message = gossip_message_from_pb(topic, raw)
        own = message.sender == self._ctx.peer_id
        for subscriber in list(state.subscribers):
            if own and not subscriber.include_own:
                continue
            try:
                subscriber.channel.send_nowait(message)
            except trio.WouldBlock:
                self._ctx.counters.gossip_dropped += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                state.subscribers.remove(subscriber)

    async def publish(self, topic: str, data: bytes, *, timeout: float | None = None) -> None:
        """See ``Host.publish``."""
        config = self._ctx.config
        self._ctx.check_open()
        self.check_topic(topic)
        if len(data) > config.gossip_max_message_bytes:
            raise InvalidRequestError(
                f"gossip message of {len(data)} bytes exceeds {config.gossip_max_message_bytes}"
            )
        bucket = self._buckets.get(topic)
        if bucket is None:
            bucket = self._buckets[topic] = TokenBucket(self._publish_rate, self._publish_rate)
        deadline = config.stream_timeout_s if timeout is None else timeout
        with translated("publish", None, deadline), trio.fail_after(deadline):
            while not bucket.take(trio.current_time()):
                await trio.sleep(bucket.delay(trio.current_time()))
            await self._wait_for_outbound_room()
            await self._ps().publish(topic, bytes(data))

    async def _wait_for_outbound_room(self) -> None:
        """Let libp2p's per-peer outbound queues (32 RPCs, full: dropped) drain below half.

        Bounded: a hung peer's queue never drains, and must not stall publishing to others.
        """
        pubsub = self._ps()
        with trio.move_on_after(OUTBOUND_DRAIN_WAIT_S):
            while any(len(q) >= OUTBOUND_HIGH_WATER for q in pubsub.peer_queues.values()):
                await trio.sleep(0.001)
        await trio.lowlevel.checkpoint()

    def gossip_peers(self, topic: str) -> list[str]:
        """Connected peers known to be subscribed to ``topic``."""
        return [pid.to_base58() for pid in self._ps().peer_topics.get(topic, ())]

    def mesh_peers(self, topic: str) -> list[str]:
        """Peers in our gossipsub mesh for ``topic`` (they get our messages first-hand)."""
        return [pid.to_base58() for pid in self.router.mesh.get(topic, ())]

    def check_topic(self, topic: str) -> None:
        if not topic:
            raise InvalidRequestError("empty topic")
        allowed = self._ctx.config.gossip_topics
        if allowed is not None and topic not in allowed:
            raise ConfigError(f"topic {topic!r} is not in the configured gossip_topics")

    def on_violation(self, peer_id: str, reason: str) -> None:
        self._ctx.counters.protocol_violations += 1
        self._ctx.emit(PeerEvent("misbehaved", peer_id, detail=reason))
        self._ctx.start_soon(self._connections.disconnect, peer_id)


__all__ = ["OUTBOUND_DRAIN_WAIT_S", "OUTBOUND_HIGH_WATER", "Topics"]
