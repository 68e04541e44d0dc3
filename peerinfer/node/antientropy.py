"""Anti-entropy in the shell: publishing and receiving announcements, running sync rounds
(pulls) and answering them. Every decision is the core's."""

from __future__ import annotations

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
from peerinfer.net import FramedStream, GossipMessage
from peerinfer.node.options import MAX_PEER_TABLE, SYNC_PROTOCOL, logger
from peerinfer.types import PeerId


class AntiEntropyMixin:
    """One part of :class:`~peerinfer.node.Node` (see the package docstring)."""

    async def _publish(self, announce: Announce) -> None:
        host = self.host
        assert host is not None
        try:
            data = encode(announce)
            await host.publish(self._topic, data)
            self.traffic["announce", "sent"] += len(data)
        except PeerInferError as exc:
            logger.warning("announcement not published: %s", exc)

    async def _validate_announce(self, message: GossipMessage) -> bool:
        # True for anything well-formed (stale ones are dropped by the core, not penalised);
        # False only for provable garbage or a sender speaking for someone else.
        try:
            announce = decode(message.data, expected=Announce)
        except ProtocolError:
            return False
        assert isinstance(announce, Announce)
        return announce.sender == message.sender

    async def _gossip_loop(self, messages: trio.MemoryReceiveChannel[GossipMessage]) -> None:
        async for message in messages:
            self.traffic["announce", "received"] += len(message.data)
            try:
                announce = decode(message.data, expected=Announce)
            except ProtocolError:
                continue
            assert isinstance(announce, Announce)
            sender = message.sender
            self._feed(AnnounceReceived(PeerId(sender), announce))
            if sender not in self._exchanged and self._is_member(sender) and self._nursery is not None:
                # A member we have not swapped peer lists with yet (clients never announce, so
                # they are never asked for a protocol they do not speak; identities heard of
                # only through gossip are not members, and are never dialed for it).
                self._exchanged[sender] = None
                if len(self._exchanged) > MAX_PEER_TABLE:
                    self._exchanged.popitem(last=False)
                self._nursery.start_soon(self._exchange_peers, sender)

    def _is_member(self, peer: str) -> bool:
        """A peer that answered us over a direct (admitted) connection, and still has one."""
        core, host = self.core, self.host
        return core is not None and host is not None and core.is_member(PeerId(peer)) and host.is_admitted(peer)

    async def _sync_round(self, eff: SendSyncRequest) -> None:
        host = self.host
        assert host is not None
        try:
            data = encode(eff.request)
            self.traffic["sync", "sent"] += len(data)
            reply = await host.request(eff.peer, SYNC_PROTOCOL, data, timeout=eff.timeout_s)
            self.traffic["sync", "received"] += len(reply)
            response = decode(reply, expected=SyncResponse)
            assert isinstance(response, SyncResponse)
        except PeerInferError as exc:
            self._feed(SyncFailed(eff.peer, eff.request.session, str(exc)))
            return
        self._feed(SyncResponseReceived(eff.peer, response))

    async def _serve_sync(self, stream: FramedStream) -> None:
        core = self.core
        assert core is not None
        async for frame in stream:
            self.traffic["sync", "received"] += len(frame)
            request = decode(frame, expected=SyncRequest)
            assert isinstance(request, SyncRequest)
            answer = encode(core.answer_sync(request))
            self.traffic["sync", "sent"] += len(answer)
            await stream.send(answer)
