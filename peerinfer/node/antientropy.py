"""Anti-entropy in the shell: publishing and receiving announcements, running sync rounds
(pulls) and answering them. Every decision is the core's.

:class:`AntiEntropy` is a component of the node (see ``peerinfer.node``): it takes the node's
:class:`~peerinfer.node.context.NodeContext`, and tells the peer keeper of each announcement's
sender (``on_announcer``: a member heard for the first time is asked whom it knows)."""

from __future__ import annotations

from collections.abc import Callable

import trio

from peerinfer.core.messages import (
    Announce,
    SyncRequest,
    SyncResponse,
    decode,
    encode,
)
from peerinfer.core.node import (
    AnnounceReceived,
    SendSyncRequest,
    SyncFailed,
    SyncResponseReceived,
)
from peerinfer.errors import (
    PeerInferError,
    ProtocolError,
)
from peerinfer.net import GossipMessage, Stream
from peerinfer.node.context import NodeContext
from peerinfer.node.options import SYNC_PROTOCOL, logger
from peerinfer.types import PeerId


class AntiEntropy:
    """Announcements out (:meth:`publish`) and in (:meth:`gossip_loop`), sync rounds
    (:meth:`sync_round`) and answers to them (:meth:`serve_sync`)."""

    def __init__(self, ctx: NodeContext, on_announcer: Callable[[str], None]) -> None:
        self._ctx = ctx
        self._on_announcer = on_announcer

    async def publish(self, announce: Announce) -> None:
        ctx = self._ctx
        host = ctx.host
        assert host is not None
        try:
            data = encode(announce)
            await host.publish(ctx.topic, data)
            ctx.traffic["announce", "sent"] += len(data)
        except PeerInferError as exc:
            logger.warning("announcement not published: %s", exc)

    async def validate_announce(self, message: GossipMessage) -> bool:
        # True for anything well-formed (stale ones are dropped by the core, not penalised);
        # False only for provable garbage or a sender speaking for someone else.
        try:
            announce = decode(message.data, expected=Announce)
        except ProtocolError:
            return False
        assert isinstance(announce, Announce)
        return announce.sender == message.sender

    async def gossip_loop(self, messages: trio.MemoryReceiveChannel[GossipMessage]) -> None:
        ctx = self._ctx
        async for message in messages:
            ctx.traffic["announce", "received"] += len(message.data)
            try:
                announce = decode(message.data, expected=Announce)
            except ProtocolError:
                continue
            assert isinstance(announce, Announce)
            sender = message.sender
            ctx.feed(AnnounceReceived(PeerId(sender), announce))
            self._on_announcer(sender)

    async def sync_round(self, eff: SendSyncRequest) -> None:
        ctx = self._ctx
        host = ctx.host
        assert host is not None
        try:
            data = encode(eff.request)
            ctx.traffic["sync", "sent"] += len(data)
            reply = await host.request(eff.peer, SYNC_PROTOCOL, data, timeout=eff.timeout_s)
            ctx.traffic["sync", "received"] += len(reply)
            response = decode(reply, expected=SyncResponse)
            assert isinstance(response, SyncResponse)
        except PeerInferError as exc:
            ctx.feed(SyncFailed(eff.peer, eff.request.session, str(exc)))
            return
        ctx.feed(SyncResponseReceived(eff.peer, response))

    async def serve_sync(self, stream: Stream) -> None:
        ctx = self._ctx
        core = ctx.core
        assert core is not None
        async for frame in stream:
            ctx.traffic["sync", "received"] += len(frame)
            request = decode(frame, expected=SyncRequest)
            assert isinstance(request, SyncRequest)
            answer = encode(core.answer_sync(request))
            ctx.traffic["sync", "sent"] += len(answer)
            await stream.send(answer)
