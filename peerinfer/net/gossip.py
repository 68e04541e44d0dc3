"""Gossipsub, configured and guarded: what py-libp2p 0.8.1 needs before a hostile peer meets it.

What is changed from the library's defaults, and why:

* ``heartbeat_interval`` 1 s (the spec's) instead of 120 s: the heartbeat drives mesh repair,
  gossip (IHAVE) and score decay.
* ``adaptive_gossip_enabled=False``: its "network health" heuristic rewrites the heartbeat to
  30-60 s whenever health drops below 0.7, silently undoing the line above.
* ``max_messages_per_topic_per_second`` from a capacity estimate (``config.gossip_rate_limit``)
  instead of 10: above it, messages from one *forwarder* are dropped without a trace.
* ``eclipse_protection_enabled=False``: it grafts extra peers for IP diversity, which means
  nothing on a home LAN (or on loopback) where peers share one NAT address.
* ``strict_signing=True`` (the default, kept): every message is signed by its origin and checked
  against the origin's peer id before validators run, so ``GossipMessage.sender`` is proven.

``GuardedPubsub`` delivers accepted messages through a callback (``notify_subscriptions``)
instead of libp2p's 32-slot subscription channel, and closes two crashes, both reachable by any
connected peer:

1. A malformed RPC on the pubsub stream: ``continuously_read_stream`` lets protobuf's
   ``DecodeError`` escape, which kills the Pubsub service and then the whole host.
2. A well-formed RPC carrying a message with a garbage ``key``: the signature check calls
   ``deserialize_public_key``, which raises inside a ``push_msg`` service task; any exception
   in a service task cancels the Pubsub service (found while writing this adapter).

Both now reset the stream, drop the peer from pubsub and report a protocol violation through a
callback (the host disconnects the peer and emits a ``misbehaved`` event).

It also re-announces our subscriptions to each newly registered peer: py-libp2p loses a
``subscribe()`` that lands while a peer's pubsub stream is being set up, and the two peers then
never mesh (seen under load in the tests here). And it keeps a peer's subscriptions while the
peer's stream to us lives, when a write on our stream to it fails: py-libp2p forgot them then,
also when the peer had just sent them again on a stream over another connection, and never
sent that peer anything more (a restarted peer, or one whose stalled connection was replaced,
stayed silent; ``_handle_dead_peer``). ``renew_stream_off`` moves our stream off connections
the host is closing, so the peer gets our hello at once.

In a private swarm (``admitted`` given) a peer gets no pubsub stream from us and its pubsub
streams are not read until it has passed admission (``peerinfer.net.admission``): it can
neither subscribe, publish, nor learn our subscriptions and messages before that.

``GuardedGossipSub`` ignores peer exchange in PRUNE messages: py-libp2p dials the (self-signed,
so arbitrary) addresses any peer puts there, even with ``do_px=False``.

Validators: py-libp2p calls a synchronous validator inline (an exception there crashes the
node) and counts an async one that raises as a rejection. We register every validator as async,
wrapped so that it never raises: an exception is logged and counts as a rejection. A validator
must return True for well-formed messages it merely does not want (stale, duplicate, from a peer
we ignore) and False only for provable garbage, because False penalises the forwarder.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetConn, INetStream
from libp2p.custom_types import TProtocol
from libp2p.exceptions import ParseError
from libp2p.io.exceptions import IncompleteReadError
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub

from peerinfer.net.config import HostConfig

logger = logging.getLogger(__name__)

#: The gossipsub version we speak. All peers run peerinfer on py-libp2p, so one version: v1.1
#: (scoring, PRUNE backoff). v1.2 adds IDONTWANT, which py-libp2p sends for each message to
#: every mesh peer *including the one it is sending the message to*, doubling the outbound RPCs
#: (and the per-peer queue of 32 RPCs then overflows, silently, after 16 quick publishes);
#: v1.3+ adds an extension machinery we do not need (less code reachable by a peer).
GOSSIP_PROTOCOLS: tuple[str, ...] = ("/meshsub/1.1.0",)

#: Room for the RPC envelope around a message (signature, key, ids, the signed peer record).
RPC_OVERHEAD_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class GossipMessage:
    """One pubsub message as delivered to a subscriber or a validator."""

    topic: str
    #: The origin's peer id, proven by its signature (not the neighbour that relayed it).
    sender: str
    data: bytes
    #: The origin's sequence number (unique per origin; not necessarily contiguous).
    seqno: int


#: A topic validator: True accepts (and forwards), False rejects and penalises the forwarder.
Validator = Callable[[GossipMessage], Awaitable[bool] | bool]

#: Called with (peer id, reason) when a peer sent pubsub bytes we cannot accept.
ViolationCallback = Callable[[str, str], None]

#: Called (synchronously, in push order) with each accepted message for a topic we joined.
DeliveryCallback = Callable[[str, rpc_pb2.Message], None]

#: Waits for a peer's admission verdict: True once admitted, False if refused.
AdmissionCheck = Callable[[ID], Awaitable[bool]]


def gossip_message_from_pb(topic: str, msg: rpc_pb2.Message) -> GossipMessage:
    return GossipMessage(
        topic=topic,
        sender=ID(msg.from_id).to_base58(),
        data=bytes(msg.data),
        seqno=int.from_bytes(msg.seqno, "big"),
    )


def wrap_validator(topic: str, validator: Validator) -> Callable[[ID, rpc_pb2.Message], Awaitable[bool]]:
    """An async libp2p validator that never raises (an exception counts as a rejection)."""

    async def validate(forwarder: ID, msg: rpc_pb2.Message) -> bool:
        try:
            verdict = validator(gossip_message_from_pb(topic, msg))
            if inspect.isawaitable(verdict):
                verdict = await verdict
            return bool(verdict)
        except Exception:
            logger.exception("validator for topic %r raised; rejecting the message", topic)
            return False

    return validate


class GuardedGossipSub(GossipSub):
    """GossipSub that ignores peer exchange (PX) carried in PRUNE messages.

    py-libp2p acts on PX whatever ``do_px`` says (that flag only controls whether *we* send
    it): for each of up to 16 peer records in a PRUNE from any peer it dials the addresses,
    inline, with no deadline. The records are self-signed, so an attacker can make us dial
    anything. Peer exchange is the node's business (``Host.add_known_peer`` + ``dial``).
    """

    async def _do_px(self, px_peers: list[rpc_pb2.PeerInfo]) -> None:
        if px_peers:
            logger.debug("ignoring %d gossipsub PX entries", len(px_peers))


def make_router(config: HostConfig) -> GossipSub:
    """A GossipSub router with the settings explained in the module docstring."""
    degree, degree_low, degree_high = config.gossip_degree
    return GuardedGossipSub(
        protocols=[TProtocol(p) for p in GOSSIP_PROTOCOLS],
        degree=degree,
        degree_low=degree_low,
        degree_high=degree_high,
        heartbeat_interval=config.heartbeat_interval_s,
        adaptive_gossip_enabled=False,
        spam_protection_enabled=True,
        max_messages_per_topic_per_second=config.effective_gossip_rate_limit(),
        eclipse_protection_enabled=False,
        do_px=False,
    )


def _stream_closed(stream: INetStream) -> bool:
    """``NetStream.is_closed`` (a property the ``INetStream`` interface does not declare)."""
    return bool(getattr(stream, "is_closed", False))


class GuardedPubsub(Pubsub):
    """``Pubsub`` whose remote-input paths cannot raise into the service (see module doc)."""

    def __init__(
        self,
        host: IHost,
        router: GossipSub,
        config: HostConfig,
        on_violation: ViolationCallback,
        deliver: DeliveryCallback,
        *,
        admitted: AdmissionCheck | None = None,
    ) -> None:
        super().__init__(
            host,
            router,
            strict_signing=True,
            validation_timeout=config.validation_timeout_s,
            max_inbound_rpc_size=config.gossip_max_message_bytes + RPC_OVERHEAD_BYTES,
            allowed_topics=None if config.gossip_topics is None else set(config.gossip_topics),
        )
        self._on_violation = on_violation
        self._deliver = deliver
        self._admitted = admitted
        #: each peer's newest pubsub stream to us, while we read it (see _handle_dead_peer)
        self._reading: dict[ID, INetStream] = {}

    async def stream_handler(self, stream: INetStream) -> None:
        if self._admitted is not None and not await self._admitted(stream.muxed_conn.peer_id):
            with trio.move_on_after(1.0) as scope:
                scope.shield = True
                try:
                    await stream.reset()
                except Exception:
                    pass
            return
        await super().stream_handler(stream)

    async def _teardown_if_connected(self, peer_id: ID) -> None:
        # 0.8.1's version does `del self.peers[peer_id]` after awaiting the stream's reset, by
        # which time the disconnect handler may have removed the peer: the KeyError ended the
        # pubsub service and with it the node (seen when a ban blacklists a connected peer).
        stream = self.peers.get(peer_id)
        if stream is not None:
            try:
                await stream.reset()
            except Exception:
                pass
            self.peers.pop(peer_id, None)
        self._forget_all_subscriptions(peer_id)

    def _report(self, peer_id: ID, reason: str) -> None:
        try:
            self._on_violation(peer_id.to_base58(), reason)
        except Exception:
            logger.exception("violation callback failed")

    async def continuously_read_stream(self, stream: INetStream) -> None:
        peer_id = stream.muxed_conn.peer_id
        # The newest stream carries the peer's subscriptions (its hello repeats all of them).
        self._reading[peer_id] = stream
        try:
            await super().continuously_read_stream(stream)
        except (StreamError, ParseError, IncompleteReadError):
            raise  # the base stream_handler resets and forgets the peer: a hangup, not an attack
        except Exception as exc:
            self._stop_reading(peer_id, stream)  # before _handle_dead_peer: forget all of it
            logger.warning("malformed pubsub RPC from %s: %r; dropping the peer", peer_id, exc)
            with trio.move_on_after(1.0) as scope:
                scope.shield = True
                try:
                    await stream.reset()
                except Exception:
                    pass
            self._handle_dead_peer(peer_id)
            self._report(peer_id, f"malformed pubsub RPC: {exc!r}")
        finally:
            self._stop_reading(peer_id, stream)

    def _stop_reading(self, peer_id: ID, stream: INetStream) -> None:
        if self._reading.get(peer_id) is stream:
            del self._reading[peer_id]

    def _handle_dead_peer(self, peer_id: ID) -> None:
        # py-libp2p calls this when a write on *our* stream to the peer fails, and it forgets
        # the peer's subscriptions, which came on the peer's stream to us. When that stream
        # lives on (another connection: a stalled one replaced, a restarted peer's old one
        # closed), they still hold, and nothing would bring them back: the peer sends them only
        # in the hello of a stream it opens, and it may have renewed its stream (hello and
        # all) just before our write failed. We would then send it nothing on the topic (no
        # subscriber known) while it gossips to us: a peer admitted but silent towards it
        # (tests/net/test_net_host.py, the connection under the pubsub streams closing).
        reading = self._reading.get(peer_id)
        if reading is None or _stream_closed(reading) or reading.muxed_conn.is_closed:
            super()._handle_dead_peer(peer_id)
            return
        topics = [topic for topic, peers in self.peer_topics.items() if peer_id in peers]
        count = self._peer_subscription_count.get(peer_id)
        super()._handle_dead_peer(peer_id)
        for topic in topics:
            self.peer_topics.setdefault(topic, set()).add(peer_id)
        if count is not None:
            self._peer_subscription_count[peer_id] = count

    def renew_stream_off(self, peer_id: ID, closing: list[INetConn]) -> None:
        """If our stream to ``peer_id`` runs on one of the ``closing`` connections (out of
        the swarm's list already), drop it and open another one now, on what is left, rather
        than at our next write to it, which fails (an announce interval away, or never while
        we have nothing to say): until then the peer has no stream from us, so no hello with
        our subscriptions, and gossips nothing to us."""
        stream = self.peers.get(peer_id)
        if stream is not None and any(stream.muxed_conn is conn.muxed_conn for conn in closing):
            self._handle_dead_peer(peer_id)  # schedules the new stream while the peer is connected

    async def _handle_new_peer(self, peer_id: ID) -> None:
        if self._admitted is not None and not await self._admitted(peer_id):
            return  # not a member: no pubsub stream, no subscriptions, no messages
        await super()._handle_new_peer(peer_id)
        # py-libp2p builds the hello (our subscriptions) before it registers the peer, with
        # an await in between; a subscribe() in that gap is announced to neither (the peer
        # is not registered yet, the hello is already built), so the peer never learns of it
        # and no mesh forms. Re-announcing every subscription once registration is done
        # closes the gap (a repeated subscription is a no-op for the receiver).
        queue = self.peer_queues.get(peer_id)
        if queue is not None and self.topic_ids:
            announcement = rpc_pb2.RPC()
            for topic in self.topic_ids:
                announcement.subscriptions.add(subscribe=True, topicid=topic)
            queue.push(announcement)

    def notify_subscriptions(self, publish_message: rpc_pb2.Message) -> None:
        # Instead of libp2p's 32-slot channel per topic (full: dropped with a log line), hand
        # each message straight to the host, which buffers per subscriber and counts drops.
        for topic in publish_message.topicIDs:
            if topic in self.subscribed_topics_receive:
                try:
                    self._deliver(topic, publish_message)
                except Exception:
                    logger.exception("delivering a message on %r failed", topic)

    async def push_msg(self, msg_forwarder: ID, msg: rpc_pb2.Message) -> None:
        try:
            await super().push_msg(msg_forwarder, msg)
        except Exception as exc:
            if msg_forwarder == self.my_id:
                raise  # our own publish: the caller sees (and translates) it
            logger.warning("unprocessable pubsub message from %s: %r", msg_forwarder, exc)
            self._report(msg_forwarder, f"unprocessable pubsub message: {exc!r}")


__all__ = [
    "GOSSIP_PROTOCOLS",
    "GossipMessage",
    "GuardedGossipSub",
    "GuardedPubsub",
    "Validator",
    "gossip_message_from_pb",
    "make_router",
    "wrap_validator",
]
