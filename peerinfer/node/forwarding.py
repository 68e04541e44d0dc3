"""Forwarding: relaying a request to the peer the core chose, and its token stream back,
reporting the first token, the end or a failure to the core.

:class:`Forwarder` is a component of the node (see ``peerinfer.node``): it takes the node's
:class:`~peerinfer.node.context.NodeContext`."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from peerinfer.core.messages import (
    ErrorMessage,
    GenerateDone,
    GenerateRequest,
    SamplingParams,
    TokenChunk,
    decode,
    encode,
)
from peerinfer.core.node import (
    Event,
    Forward,
    ForwardFailed,
    ForwardFinished,
    ForwardFirstToken,
)
from peerinfer.errors import (
    ProtocolError,
    RemoteError,
    RequestTimeoutError,
    error_kind,
)
from peerinfer.net import NodeHost, StreamUse
from peerinfer.node.context import NodeContext
from peerinfer.node.options import GENERATE_PROTOCOL, TOKEN_GAP_TIMEOUT_S, logger
from peerinfer.node.sinks import Sink, forward_request_id


class _RelayCheck:
    """What a forwarded result must satisfy before any of it reaches the client.

    A chunk is refused (and the forward fails as the peer's breach of contract) when it would
    take the completion past ``max_tokens``, carries an id outside the vocabulary, or carries
    text that contains a stop sequence (an honest engine stops before one and never releases
    it, also across chunks, since it holds back a possible stop prefix). The final
    ``GenerateDone`` must count exactly the tokens streamed and no more cached tokens than the
    prompt has. ``generated`` is what passed (and was relayed).
    """

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_tokens: int) -> None:
        self.max_tokens = params.max_tokens
        self.vocab_size = vocab_size
        self.prompt_tokens = prompt_tokens
        self.stop = tuple(s for s in params.stop if s)
        self._keep = max((len(s) for s in self.stop), default=1) - 1
        self._tail = ""  # the end of the relayed text, long enough to see a stop across chunks
        self.generated: list[int] = []

    def chunk(self, ids: Sequence[int], text: str) -> str:
        """Why this chunk breaks the contract, or "" when it may be relayed."""
        if len(self.generated) + len(ids) > self.max_tokens:
            return f"{len(self.generated) + len(ids)} tokens for max_tokens={self.max_tokens}"
        vocab = self.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                return f"token id {t} is outside the vocabulary [0, {vocab})"
        if self.stop and text:
            window = self._tail + text
            for s in self.stop:
                if s in window:
                    return f"text continues past the stop sequence {s!r}"
            self._tail = window[-self._keep :] if self._keep else ""
        return ""

    def done(self, msg: GenerateDone) -> str:
        """Why the final accounting breaks the contract, or ""."""
        if msg.completion_tokens != len(self.generated):
            return f"reports {msg.completion_tokens} completion tokens but streamed {len(self.generated)}"
        if msg.cached_tokens > self.prompt_tokens:
            return f"reports {msg.cached_tokens} cached tokens of a {self.prompt_tokens}-token prompt"
        return ""

    def synthesized_done(self, peer: str) -> GenerateDone:
        """The end of a completion whose whole budget was relayed before the peer misbehaved."""
        return GenerateDone(
            request_id="", prompt_tokens=self.prompt_tokens, completion_tokens=len(self.generated),
            cached_tokens=0, served_by=peer, ttft_s=0.0, latency_s=0.0, finish_reason="length",
        )


class Forwarder:
    """Runs the core's ``Forward`` effects (:meth:`forward`, one task each)."""

    def __init__(self, ctx: NodeContext) -> None:
        self._ctx = ctx

    async def forward(self, eff: Forward) -> None:
        """Relay ``eff``'s request to its peer and check what comes back (see ``_RelayCheck``).

        Whatever the peer writes, the client never receives more than ``max_tokens`` tokens, nor
        a token outside the vocabulary, nor text past a stop sequence, and ``served_by`` names
        the stream's authenticated peer. A result that breaks that contract, and a peer's
        "invalid" for a request this node already validated, are the peer's failure: the core
        fails over (resuming after the tokens already relayed) and lowers its reputation.
        """
        ctx = self._ctx
        sink = ctx.sinks.get(eff.request_id)
        host = ctx.host
        assert host is not None
        if sink is None:
            return
        logger.info("request %s -> %s: %s", eff.request_id, eff.peer, eff.decision.reason)
        engine = ctx.engine
        assert engine is not None
        check = _RelayCheck(eff.params, engine.vocab_size, len(eff.tokens))
        outcome: Event | None = None
        done: GenerateDone | None = None
        with trio.CancelScope() as scope:
            sink.forward_scope = scope
            try:
                outcome, done = await self._forward_attempt(host, eff, sink, check)
            except ProtocolError as exc:
                outcome = ForwardFailed(eff.request_id, eff.peer, "protocol", tuple(check.generated))
                logger.info("forward to %s: %s", eff.peer, exc)
            except RequestTimeoutError:
                outcome = ForwardFailed(eff.request_id, eff.peer, "timeout", tuple(check.generated))
            except (RemoteError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                outcome = ForwardFailed(eff.request_id, eff.peer, "unavailable", tuple(check.generated))
                logger.info("forward to %s failed: %s", eff.peer, exc)
        if sink.forward_scope is scope:
            sink.forward_scope = None
        if scope.cancelled_caught:
            return  # the core cancelled it (deadline, peer lost, client gone): it knows
        if (
            isinstance(outcome, ForwardFailed)
            and len(check.generated) >= eff.params.max_tokens
            and not sink.done
        ):
            # The whole budget was relayed (and checked) before the peer misbehaved: the answer
            # is complete; the core, told of the failure, does not resume it.
            done = check.synthesized_done(eff.peer)
        if done is not None:
            now = trio.current_time()
            ctx.sinks.finish(
                sink,
                GenerateDone(
                    request_id=sink.request_id,
                    prompt_tokens=sink.prompt_tokens,
                    completion_tokens=len(check.generated),
                    cached_tokens=min(done.cached_tokens, sink.prompt_tokens),
                    # The authenticated peer of the stream, never what the peer wrote.
                    served_by=eff.peer,
                    ttft_s=(sink.first_token_at or now) - sink.started,
                    latency_s=now - sink.started,
                    finish_reason=done.finish_reason,
                ),
            )
        if outcome is not None:
            ctx.feed(outcome)

    async def _forward_attempt(
        self, host: NodeHost, eff: Forward, sink: Sink, check: _RelayCheck
    ) -> tuple[Event, GenerateDone | None]:
        """Send the request on a stream of the host's pool (``host.streams.exchange``): one
        kept from the last forward to the same peer when it can (no stream to open, no protocol
        to negotiate), kept again after a clean ``GenerateDone``. If the peer let a kept stream
        go, or the stream's connection was replaced as stalled, which shows before any answer,
        the request goes again once on a new stream, under another id. A peer we reach only
        through a relay gets a spare stream opened ahead of the next forward."""

        async def attempt(use: StreamUse) -> tuple[Event, GenerateDone | None]:
            stream, started, second_try = use.stream, use.started, use.retry
            deadline = started + eff.first_token_timeout_s
            generated = check.generated
            if stream.remote_peer != eff.peer:  # the host authenticates; never relay otherwise
                raise ProtocolError(f"a stream to {eff.peer} reached {stream.remote_peer}")
            await stream.send(
                encode(
                    GenerateRequest(
                        request_id=forward_request_id(eff.request_id, eff.attempt, second_try),
                        params=eff.params,
                        tokens=eff.tokens,
                        forwarded=True,
                        origin=self._ctx.peer_id,
                        max_outstanding=eff.decision.max_outstanding,
                        scaffold=eff.scaffold,
                    )
                ),
                timeout=max(0.01, deadline - trio.current_time()),
            )
            first_at: float | None = None
            # The core's gap (NodeCore.silence gives the door twice this for a forward).
            core = self._ctx.core
            gap_s = core.config.token_gap_timeout_s if core is not None else TOKEN_GAP_TIMEOUT_S
            while True:
                timeout = max(0.01, deadline - trio.current_time()) if first_at is None else gap_s
                frame = await stream.receive(timeout=timeout)
                msg = decode(frame, expected=(TokenChunk, GenerateDone, ErrorMessage))
                if isinstance(msg, TokenChunk):
                    broken = check.chunk(msg.token_ids, msg.text)
                    if broken:
                        logger.warning("forward to %s broke its contract: %s", eff.peer, broken)
                        return ForwardFailed(eff.request_id, eff.peer, "contract", tuple(generated)), None
                    generated.extend(msg.token_ids)
                    self._ctx.sinks.relay_tokens(sink, msg.token_ids, msg.text, msg.logprobs)
                    if first_at is None and (msg.token_ids or msg.text):
                        first_at = trio.current_time()
                        self._ctx.feed(ForwardFirstToken(eff.request_id, eff.peer))
                elif isinstance(msg, GenerateDone):
                    broken = check.done(msg)
                    if broken:
                        logger.warning("forward to %s broke its contract: %s", eff.peer, broken)
                        return ForwardFailed(eff.request_id, eff.peer, "contract", tuple(generated)), None
                    ttft = (first_at if first_at is not None else trio.current_time()) - started
                    use.keep()  # the peer serves the next request on this stream
                    return (
                        ForwardFinished(
                            eff.request_id,
                            eff.peer,
                            cached_tokens=msg.cached_tokens,
                            ttft_s=ttft,
                            completion=tuple(generated),
                        ),
                        msg,
                    )
                else:
                    assert isinstance(msg, ErrorMessage)
                    # This node validated the request before forwarding it, so every error a
                    # peer answers, "invalid" included, is that peer's failure and the request
                    # goes elsewhere (else one peer could fail every request sent to it).
                    kind = error_kind(msg.code)
                    return ForwardFailed(eff.request_id, eff.peer, kind.forward_reason, tuple(generated)), None

        return await host.streams.exchange(
            eff.peer, GENERATE_PROTOCOL, attempt, timeout=eff.first_token_timeout_s, spare=not self._ctx.closing
        )
