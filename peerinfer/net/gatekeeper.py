"""The host's side of swarm admission (``peerinfer.net.admission`` holds the proof itself):
each peer's verdict, the challenge on every new peer, the answer to a peer's challenge, and
the multistream-select gate that offers a stranger nothing but the admission protocol."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.protocol_muxer.exceptions import MultiselectCommunicatorError, MultiselectError
from libp2p.protocol_muxer.multiselect import (
    DEFAULT_NEGOTIATE_TIMEOUT,
    PROTOCOL_NOT_FOUND_MSG,
    Multiselect,
)

from peerinfer.errors import (
    ClosedError,
    PeerUnavailableError,
    ProtocolError,
    RemoteError,
    RequestTimeoutError,
)
from peerinfer.net.admission import (
    ADMIT_PROTOCOL,
    NONCE_BYTES,
    PROOF_BYTES,
    check_proof,
    new_nonce,
    proof,
)
from peerinfer.net.connections import Connections
from peerinfer.net.context import HostContext, PeerEvent, logger, parse_peer_id, reset_stream
from peerinfer.net.framing import FramedStream, peer_id_text

#: Peers whose admission refusal was logged (once each); the oldest are forgotten beyond this.
MAX_REFUSALS_LOGGED = 4096


@dataclass
class Admission:
    """The admission verdict for one peer's current connections."""

    done: trio.Event = field(default_factory=trio.Event)
    ok: bool = False
    reason: str = ""
    started: bool = False


class Gatekeeper:
    """Admission verdicts per peer. Without a swarm key every connected peer is admitted and
    none of the rest is used."""

    def __init__(self, ctx: HostContext, connections: Connections) -> None:
        self._ctx = ctx
        self._connections = connections
        self.admissions: dict[str, Admission] = {}
        #: the last admission refusal of each peer (bounded), logged once per peer
        self.refusals_logged: OrderedDict[str, str] = OrderedDict()
        connections.is_admitted = self.is_admitted
        connections.on_gone.append(self.forget)

    def forget(self, peer_id: str) -> None:
        self.admissions.pop(peer_id, None)

    def is_admitted(self, peer_id: str) -> bool:
        """Whether ``peer_id`` passed admission on its current connections (always True for an
        open swarm, i.e. without ``swarm_key``, once connected)."""
        if self._ctx.admission_key is None:
            return self._connections.is_connected(peer_id)
        adm = self.admissions.get(peer_id)
        return adm is not None and adm.done.is_set() and adm.ok

    async def wait_admitted(self, peer_id: str, timeout: float | None = None) -> Admission | None:
        """The peer's verdict once known (None: no connection, so no admission under way)."""
        adm = self.admissions.get(peer_id)
        if adm is None:
            return None
        limit = self._ctx.config.admission_timeout_s if timeout is None else timeout
        with trio.move_on_after(limit):
            await adm.done.wait()
        return adm

    async def require_admitted(self, peer_id: str, timeout: float) -> None:
        adm = await self.wait_admitted(peer_id, timeout)
        if adm is None or not adm.done.is_set():
            reason = "no connection" if adm is None else f"admission not done within {timeout:.1f} s"
            raise PeerUnavailableError(f"{peer_id} is not admitted to this swarm: {reason}")
        if not adm.ok:
            raise PeerUnavailableError(f"{peer_id} refused by swarm admission: {adm.reason}")

    async def admitted_in_time(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is admitted, waiting for its verdict if it is under way."""
        adm = await self.wait_admitted(peer_id)
        return adm is not None and adm.done.is_set() and adm.ok

    async def pubsub_admitted(self, pid: ID) -> bool:
        adm = await self.wait_admitted(pid.to_base58())
        return adm is not None and adm.ok

    async def push_identify_to_admitted(self) -> None:
        from libp2p.identity.identify_push.identify_push import push_identify_to_peers

        h = self._ctx.h
        admitted = {p for p in h.get_connected_peers() if self.is_admitted(p.to_base58())}
        if admitted:
            with contextlib.suppress(Exception):  # best effort, as py-libp2p's own push
                await push_identify_to_peers(h, admitted)

    def opened(self, peer_id: str, first: bool) -> None:
        """A connection to ``peer_id`` opened: challenge it if it is new to us."""
        if first or peer_id not in self.admissions:
            self.begin(peer_id)

    def begin(self, peer_id: str) -> None:
        adm = self.admissions.get(peer_id)
        if adm is None or (adm.done.is_set() and not adm.ok):
            adm = self.admissions[peer_id] = Admission()
        if not adm.started and self._ctx.running:
            adm.started = True
            self._ctx.start_soon(self._admit, peer_id, adm)

    def begin_pending(self) -> None:
        """Connections that arrived while libp2p was starting, before we had a nursery."""
        for peer_id, adm in list(self.admissions.items()):
            if not adm.started:
                self.begin(peer_id)

    async def _admit(self, peer_id: str, adm: Admission) -> None:
        """Challenge ``peer_id``; admit it, or refuse and disconnect it."""
        ctx = self._ctx
        try:
            ok, reason = await self._challenge(peer_id)
        except ClosedError:
            ok, reason = False, "the host is closing"
        adm.ok, adm.reason = ok, reason
        adm.done.set()
        if ok:
            ctx.emit(PeerEvent("connected", peer_id))
            return
        ctx.counters.admissions_refused += 1
        if peer_id not in self.refusals_logged:
            logger.warning("refusing peer %s: %s", peer_id, reason)
        self.refusals_logged[peer_id] = reason
        if len(self.refusals_logged) > MAX_REFUSALS_LOGGED:
            self.refusals_logged.popitem(last=False)
        if not ctx.closed:
            await self._connections.disconnect(peer_id)

    async def _challenge(self, peer_id: str) -> tuple[bool, str]:
        ctx = self._ctx
        key = ctx.admission_key
        assert key is not None
        timeout = ctx.config.admission_timeout_s
        deadline = trio.current_time() + timeout
        pid = parse_peer_id(peer_id)
        while True:
            left = deadline - trio.current_time()
            if left <= 0:
                return False, f"no admission answer within {timeout:.1f} s"
            try:
                net_stream = await ctx.within(
                    "admission", peer_id, left,
                    lambda: ctx.h.new_stream(pid, [TProtocol(ADMIT_PROTOCOL)]),
                    discard=reset_stream,
                )
                break
            except RequestTimeoutError:
                return False, f"no admission answer within {timeout:.1f} s"
            except PeerUnavailableError as exc:
                if "refused the protocol" in str(exc):
                    return False, "it does not speak swarm admission (no swarm key: an open-swarm node?)"
                if not self._connections.is_connected(peer_id):
                    return False, f"the connection closed during admission ({exc})"
                # The connected notification can precede the muxer's readiness: try again.
                await trio.sleep(0.02)
        stream = FramedStream(net_stream, max_frame_bytes=PROOF_BYTES + 16, timeout_s=timeout)
        async with stream:
            nonce = new_nonce()
            try:
                await stream.send(nonce, timeout=max(0.01, deadline - trio.current_time()))
                answer = await stream.receive(
                    timeout=max(0.01, deadline - trio.current_time()), max_bytes=PROOF_BYTES
                )
            except RequestTimeoutError:
                return False, f"no admission answer within {timeout:.1f} s"
            except (RemoteError, trio.EndOfChannel) as exc:
                return False, f"the admission exchange failed ({type(exc).__name__}: {exc})"
        if not check_proof(key, ctx.peer_id, peer_id, nonce, answer):
            return False, "wrong admission proof: it does not hold this swarm's key"
        return True, ""

    async def serve_admit(self, stream: FramedStream) -> None:
        """Answer a peer's challenge (to anyone: the proof is useless for any other exchange)."""
        key = self._ctx.admission_key
        assert key is not None
        nonce = await stream.receive(max_bytes=NONCE_BYTES)
        if len(nonce) != NONCE_BYTES:
            raise ProtocolError(f"admission nonce of {len(nonce)} bytes, expected {NONCE_BYTES}")
        await stream.send(proof(key, stream.remote_peer, self._ctx.peer_id, nonce))


class AdmissionGate(Multiselect):
    """py-libp2p's multistream-select listener, for a private swarm: a peer not admitted (yet)
    is offered only ``ADMIT_PROTOCOL``. Any other protocol it names waits for its verdict
    (``admission_timeout_s`` at most, like our handlers) and is then served if it was
    admitted, else answered "na" (or its connection is closed first), exactly as a protocol
    we do not speak; "ls" lists only the admission protocol to it (answered at once). So a
    stranger without the key learns neither our protocol names nor, through identify, our
    listen addresses. (It shares the host's multiselect's handlers dict: handlers set later
    are seen here.)"""

    def __init__(self, handlers: dict[Any, Any], ctx: HostContext, gatekeeper: Gatekeeper) -> None:
        super().__init__(handlers)
        self._ctx = ctx
        self._gatekeeper = gatekeeper

    async def negotiate(
        self, communicator: Any, negotiate_timeout: int = DEFAULT_NEGOTIATE_TIMEOUT
    ) -> tuple[Any, Any]:
        try:
            peer: str | None = peer_id_text(communicator.read_writer)
        except Exception:
            peer = None
        gate, counters = self._gatekeeper, self._ctx.counters
        if peer is not None and gate.is_admitted(peer):
            return await super().negotiate(communicator, negotiate_timeout)
        try:
            with trio.fail_after(negotiate_timeout):
                await self.handshake(communicator)
                while True:
                    try:
                        command = await communicator.read()
                    except MultiselectCommunicatorError as error:
                        raise MultiselectError() from error
                    try:
                        if command == "ls":  # at once (a refusal closes the connection)
                            admitted = peer is not None and gate.is_admitted(peer)
                            if not admitted:
                                counters.unadmitted_protocols_refused += 1
                            listed = ([p for p in self.handlers if p is not None] if admitted
                                      else [ADMIT_PROTOCOL])
                            await communicator.write("\n".join(listed) + "\n")
                            continue
                        admitted = command == ADMIT_PROTOCOL or (
                            peer is not None and await gate.admitted_in_time(peer)
                        )
                        if admitted and command and TProtocol(command) in self.handlers:
                            await communicator.write(command)
                            return TProtocol(command), self.handlers[TProtocol(command)]
                        if not admitted:
                            counters.unadmitted_protocols_refused += 1
                        await communicator.write(PROTOCOL_NOT_FOUND_MSG)
                    except MultiselectCommunicatorError as error:
                        raise MultiselectError() from error
        except trio.TooSlowError:
            raise MultiselectError("handshake read timeout") from None


__all__ = ["MAX_REFUSALS_LOGGED", "Admission", "AdmissionGate", "Gatekeeper"]
