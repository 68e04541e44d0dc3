"""The door: the one entry point (``Node.submit``) through which every front end (the libp2p
generate handler, the HTTP API) submits a request and receives its stream of events.

:class:`Door` is a component of the node (see ``peerinfer.node``): it takes the node's
:class:`~peerinfer.node.context.NodeContext` and owns the front ends' side of each request (its
sink, its listeners, the routing decisions the dashboard shows)."""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import trio

from peerinfer.core.messages import (
    MAX_PROMPT_TOKENS,
    ErrorMessage,
    GenerateDone,
    GenerateRequest,
    Message,
    TokenChunk,
    decode,
    encode,
)
from peerinfer.core.node import (
    Cancel,
    ClientRequest,
    Forward,
    RunLocal,
    Silence,
)
from peerinfer.core.prefix import scaffold_messages
from peerinfer.errors import (
    InvalidRequestError,
    PeerInferError,
    ProtocolError,
    RequestTimeoutError,
)
from peerinfer.net import Stream
from peerinfer.node.context import NodeContext
from peerinfer.node.options import RECENT_DECISIONS, TOKEN_GAP_TIMEOUT_S, logger
from peerinfer.node.sinks import Sink, node_request_id
from peerinfer.types import PeerId, RequestId

#: How long a generate stream waits for its next request once one ended (well above
#: ``peerinfer.net.host.IDLE_STREAM_TTL_S``, how long a forwarding peer keeps it).
GENERATE_IDLE_TIMEOUT_S = 15.0
#: A request waiting its turn tells its client it is still there this often (an empty
#: ``TokenChunk``): well within every receiver's own gap timeout (a client's 120 s, a
#: forwarding peer's ``TOKEN_GAP_TIMEOUT_S``), so a long wait is not taken for a dead stream.
WAITING_HEARTBEAT_S = TOKEN_GAP_TIMEOUT_S / 4


def _plain_silence(last_event: float) -> Silence:
    return Silence(last_event + TOKEN_GAP_TIMEOUT_S, False,
                   f"no event for {TOKEN_GAP_TIMEOUT_S:.0f} s")


@dataclass(frozen=True, slots=True)
class RoutingRecord:
    """One routing decision, as the dashboard shows it."""

    at: float  # wall clock
    request_id: str
    peer: str
    local: bool
    reason: str


class Submission:
    """The events of one request submitted through :meth:`Node.submit`, in order.

    ``TokenChunk`` events, then exactly one ``GenerateDone`` or ``ErrorMessage`` (also kept as
    ``final``); iteration stops after it. Silence ends it with a ``timeout`` error when the
    core says so (``silence``: ``NodeCore.silence`` for this request): while it is served, after
    ``TOKEN_GAP_TIMEOUT_S`` without an event; while it waits its turn, only once the engine
    stops making progress. While it waits, an empty ``TokenChunk`` (no ids, no text: a
    heartbeat) comes every ``WAITING_HEARTBEAT_S``. ``serving_peer``: where the request runs now ("" before it is
    routed). ``on_end`` runs once, as the final event is handed out (before the front end can
    answer its client, so a scrape after the answer sees the request) or, for a request left
    early, when the door closes.
    """

    def __init__(
        self, request_id: str, receive: trio.MemoryReceiveChannel[Message] | None,
        sink: Sink | None, final: ErrorMessage | None = None,
        silence: Callable[[float], Silence] = _plain_silence,
    ) -> None:
        self.request_id = request_id
        self._receive = receive
        self._sink = sink
        self._pending = final
        self._silence = silence
        #: the last event from the request (not a heartbeat), and the last one handed out
        self._last_event = self._last_out = trio.current_time()
        self.final: GenerateDone | ErrorMessage | None = None
        self.on_end: Callable[[Submission], None] | None = None

    @classmethod
    def failed(cls, error: ErrorMessage) -> Submission:
        return cls(error.request_id, None, None, final=error)

    def end(self) -> None:
        callback, self.on_end = self.on_end, None
        if callback is not None:
            callback(self)

    @property
    def serving_peer(self) -> str:
        return self._sink.serving_peer if self._sink is not None else ""

    def __aiter__(self) -> Submission:
        return self

    async def __anext__(self) -> TokenChunk | GenerateDone | ErrorMessage:
        if self.final is not None:
            raise StopAsyncIteration
        item: Message
        if self._pending is not None or self._receive is None:
            item = self._pending or ErrorMessage(self.request_id, "internal", "no result")
        else:
            item = await self._next_event(self._receive)
        if isinstance(item, GenerateDone | ErrorMessage):
            self.final = item
            self.end()
        assert isinstance(item, TokenChunk | GenerateDone | ErrorMessage)
        return item

    async def _next_event(self, receive: trio.MemoryReceiveChannel[Message]) -> Message:
        """The request's next event, a heartbeat while it waits its turn, or the timeout the
        core's ``silence`` calls for."""
        silence = self._silence(self._last_event)
        while True:
            # Looked at again every heartbeat period at least: a request preempted since its
            # last token is told it waits before its client's own gap timeout passes.
            wake = min(silence.deadline, self._last_out + WAITING_HEARTBEAT_S)
            with trio.move_on_at(wake):
                try:
                    item = await receive.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return ErrorMessage(self.request_id, "internal",
                                        "the request ended without a result")
                self._last_event = self._last_out = trio.current_time()
                return item
            now = trio.current_time()
            silence = self._silence(self._last_event)
            if now >= silence.deadline:
                return ErrorMessage(self.request_id, "timeout", silence.message)
            if now >= self._last_out + WAITING_HEARTBEAT_S:
                if silence.waiting:
                    self._last_out = now
                    return TokenChunk(self.request_id, (), "")
                self._last_out = now  # not waiting: no heartbeat, look again a period later


class Door:
    """Takes every request a front end submits (:meth:`submit`) and answers the libp2p
    generate protocol (:meth:`serve_generate`)."""

    def __init__(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        #: called with (submission, local) when a request submitted here ends with its final
        #: event (metrics); must not block or raise
        self.request_listeners: list[Callable[[Submission, bool], None]] = []
        #: the last routing decisions, newest last (bounded)
        self.recent_decisions: collections.deque[RoutingRecord] = collections.deque(
            maxlen=RECENT_DECISIONS
        )
        #: front-end handlers inside ``submit`` now; shutdown lets them write their last frame
        self._open_handlers = 0
        self._handlers_gone = trio.Event()
        self._handlers_gone.set()

    async def wait_handlers_gone(self) -> None:
        """Until no front end is inside ``submit`` (each wrote its request's final frame)."""
        await self._handlers_gone.wait()

    async def serve_generate(self, stream: Stream) -> None:
        """A client (or a peer forwarding) asks for a completion; stream it back.

        After a request's final event the stream may carry the next request (a forwarding
        peer keeps it for its next forward, ``Host.keep_idle_stream``); it ends at the other
        side's end of stream, or after ``GENERATE_IDLE_TIMEOUT_S`` without a next request."""
        first = True
        while True:
            try:
                frame = await stream.receive(timeout=None if first else GENERATE_IDLE_TIMEOUT_S)
                req = decode(frame, expected=GenerateRequest)
                assert isinstance(req, GenerateRequest)
            except ProtocolError as exc:
                with contextlib.suppress(PeerInferError, trio.BrokenResourceError, trio.ClosedResourceError):
                    await stream.send(encode(ErrorMessage("", "protocol", str(exc))))
                return
            except trio.EndOfChannel:
                return
            except RequestTimeoutError:
                if first:
                    raise
                return  # idle: the stream was reset
            first = False
            try:
                async with self.submit(req, requester=stream.remote_peer, local=False) as events:
                    async for item in events:
                        await stream.send(encode(item))
            except (PeerInferError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                # Leaving submit() cancelled the work, wherever it ran.
                logger.info("request %s from %s: stream ended early (%s)", req.request_id,
                            stream.remote_peer, type(exc).__name__)
                return

    @contextlib.asynccontextmanager
    async def submit(
        self, req: GenerateRequest, *, requester: str, local: bool
    ) -> AsyncIterator[Submission]:
        """The door: every front end (the libp2p generate handler, the HTTP API) submits here.

        ``requester`` names who asked (a peer id, ``http:<address>``): request ids are unique
        per requester, and the core's fair share of the engine is kept between requesters.
        ``local``: the request comes from this node's own users (the HTTP API's loopback
        clients), whom the core serves before the network's. Yields a :class:`Submission`, an async iterator of ``TokenChunk``
        events ending with exactly one ``GenerateDone`` or ``ErrorMessage``; a request that
        cannot be taken (bad prompt, duplicate id, shutting down) yields just the error.
        Leaving the block before the end (the client went away, the caller was cancelled)
        cancels the work wherever in the network it runs.
        """
        ctx = self._ctx
        error: ErrorMessage | None = None
        tokens: list[int] = []
        rid = node_request_id(requester, req.request_id)
        if ctx.closing:
            error = ErrorMessage(req.request_id, "shutdown", "the node is shutting down")
        elif rid in ctx.sinks:
            error = ErrorMessage(req.request_id, "invalid", "duplicate request id")
        else:
            try:
                tokens = await self._prompt_tokens(req)
            except InvalidRequestError as exc:
                error = ErrorMessage(req.request_id, "invalid", str(exc))
            if rid in ctx.sinks:  # the same id arrived again while we tokenized
                error = ErrorMessage(req.request_id, "invalid", "duplicate request id")
        if error is not None:
            refused = Submission.failed(error)
            refused.on_end = lambda sub: self._notify_listeners(sub, local)
            try:
                yield refused
            finally:
                refused.end()
            return
        send, receive = trio.open_memory_channel[Message](math.inf)
        sink = Sink(send, req.request_id, trio.current_time(), len(tokens))
        ctx.sinks.add(rid, sink)
        self._open_handlers += 1
        if self._handlers_gone.is_set():
            self._handlers_gone = trio.Event()
        submission = Submission(req.request_id, receive, sink,
                                silence=lambda last: self._silence_of(rid, last))
        submission.on_end = lambda sub: self._notify_listeners(sub, local)
        ctx.feed(
            ClientRequest(
                request_id=rid,
                tokens=tuple(tokens),
                params=req.params,
                forwarded=req.forwarded,
                origin=PeerId(requester) if req.forwarded else None,
                max_outstanding=req.max_outstanding if req.forwarded else None,
                requester=requester,
                local=local,
                scaffold=self._scaffold_of(req),
            )
        )
        try:
            async with receive:
                yield submission
        finally:
            self._open_handlers -= 1
            if not self._open_handlers:
                self._handlers_gone.set()
            if rid in ctx.sinks and not sink.done:
                # The client went away: stop the work, wherever it runs.
                ctx.feed(Cancel(rid))
                sink.stop()
                ctx.sinks.discard(rid)
            submission.end()

    def _silence_of(self, rid: RequestId, last_event: float) -> Silence:
        """The core decides how long a request's client may hear nothing (its phase)."""
        core = self._ctx.core
        if core is None:
            return _plain_silence(last_event)
        return core.silence(rid, last_event, self._ctx.engine_progress_at)

    def _notify_listeners(self, submission: Submission, local: bool) -> None:
        for listener in self.request_listeners:
            try:
                listener(submission, local)
            except Exception:  # metrics must never break a request
                logger.exception("request listener failed")

    def note_route(self, eff: RunLocal | Forward) -> None:
        """Remember where a request went and why (the dashboard shows the last ones)."""
        sink = self._ctx.sinks.get(eff.request_id)
        target = self._ctx.peer_id if isinstance(eff, RunLocal) else eff.peer
        if sink is not None:
            sink.serving_peer = target
        decision = eff.decision
        self.recent_decisions.append(
            RoutingRecord(
                # The wall clock, not ctx.now() (monotonic): the dashboard shows it as a time of day.
                at=self._ctx.options.wall_clock(),
                request_id=str(eff.request_id),
                peer=str(target),
                local=isinstance(eff, RunLocal),
                reason=decision.reason if decision is not None else "",
            )
        )

    def _scaffold_of(self, req: GenerateRequest) -> int | None:
        """The request's scaffold hash (the ``scaffold_hash`` policy's key): as the origin
        sent it for a forwarded request, else from a chat's messages (a plain prompt has
        none). Only a node running that policy hashes anything."""
        core = self._ctx.core
        if core is None or core.config.policy != "scaffold_hash":
            return None
        if req.forwarded:
            return req.scaffold
        return core.hasher.scaffold_hash(
            scaffold_messages([(m.role, m.content) for m in req.messages])
        )

    async def _prompt_tokens(self, req: GenerateRequest) -> list[int]:
        engine = self._ctx.engine
        assert engine is not None
        # Routing needs the tokens: with a thread-safe tokenizer they are computed beside the
        # running generation instead of queueing behind its current (possibly long) step.
        run = self._ctx.in_thread if engine.thread_safe_tokenizer else self._ctx.in_engine
        if req.forwarded or req.tokens:
            tokens = list(req.tokens)
        elif req.messages:
            tokens = await run(engine.chat_prompt_tokens, list(req.messages), req.tools)
        elif req.prompt:
            tokens = await run(engine.tokenize, req.prompt)
        else:
            raise InvalidRequestError("the request has no prompt, messages or tokens")
        if not tokens:
            raise InvalidRequestError("the prompt is empty")
        if len(tokens) >= min(engine.max_context_tokens, MAX_PROMPT_TOKENS):
            raise InvalidRequestError(
                f"the prompt has {len(tokens)} tokens; the model's context holds "
                f"{engine.max_context_tokens} and at least one must be left to generate"
            )
        vocab = engine.vocab_size
        if any(t < 0 or t >= vocab for t in tokens):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})")
        return tokens
