"""Sinks: where each request's frames go, and the one place request ids are composed.

Every request a node takes, whoever serves it, has a :class:`Sink`: a memory channel whose
receiver is the front end answering the client (or the forwarding peer). Local runs and
forwards write ``TokenChunk`` frames into it and end it with ``GenerateDone`` or
``ErrorMessage``. The :class:`SinkTable` keys them by the node's request id and lets shutdown
wait for the last one (an event, not a poll).

Request ids: a client's id is unique only per requester, so the node's id is
``<requester>/<client id>`` (:func:`node_request_id`); a forward names the request to the next
peer by the client's id, its attempt and whether it is the one retry on a fresh stream
(:func:`forward_request_id`), never by the requester (the next peer keys it by us).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import trio

from peerinfer.core.messages import Message, TokenChunk, TokenLogprob
from peerinfer.types import RequestId

#: The longest client id a forward carries (the wire's request ids are bounded).
FORWARD_ID_CHARS = 64


def node_request_id(requester: str, client_id: str) -> RequestId:
    """The node's id of a request: request ids are unique per requester only."""
    return RequestId(f"{requester}/{client_id}")


def forward_request_id(request_id: RequestId, attempt: int, retry: bool) -> str:
    """The id a forward carries: the client's id (bounded), the core's attempt number, and
    ``r`` for the retry on a fresh stream after a kept one was gone (two sends of one attempt
    must not collide at the peer)."""
    client_id = request_id.rsplit("/", 1)[-1][:FORWARD_ID_CHARS]
    return client_id + f"~{attempt}" + ("r" if retry else "")


@dataclass(slots=True)
class Sink:
    """Where a request's frames go: the stream handler that owns the request reads them."""

    send: trio.MemorySendChannel[Message]
    request_id: str  # the id the client used (frames carry it)
    started: float
    prompt_tokens: int
    first_token_at: float | None = None
    completion_ids: list[int] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)
    forward_scope: trio.CancelScope | None = None
    done: bool = False
    serving_peer: str = ""  # where the request runs now (the last routing decision)

    def stop(self) -> None:
        """Stop the work wherever it runs here: the engine sees ``cancel`` at its next step,
        a forward is cancelled."""
        self.cancel.set()
        if self.forward_scope is not None:
            self.forward_scope.cancel()


class SinkTable:
    """The sinks of the requests in flight, by the node's request id."""

    def __init__(self) -> None:
        self._sinks: dict[RequestId, Sink] = {}
        self._empty = trio.Event()
        self._empty.set()

    def __contains__(self, rid: object) -> bool:
        return rid in self._sinks

    def __len__(self) -> int:
        return len(self._sinks)

    def __iter__(self) -> Iterator[Sink]:
        return iter(list(self._sinks.values()))

    def get(self, rid: RequestId) -> Sink | None:
        return self._sinks.get(rid)

    def add(self, rid: RequestId, sink: Sink) -> None:
        self._sinks[rid] = sink
        if self._empty.is_set():
            self._empty = trio.Event()

    def discard(self, rid: RequestId) -> None:
        self._sinks.pop(rid, None)
        self._note_removed()

    async def wait_empty(self) -> None:
        """Until no request is in flight."""
        await self._empty.wait()

    def finish(self, sink: Sink, final: Message) -> None:
        """End ``sink`` with its final frame (once) and forget it."""
        if sink.done:
            return
        sink.done = True
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            sink.send.send_nowait(final)
        for rid, s in list(self._sinks.items()):
            if s is sink:
                del self._sinks[rid]
        self._note_removed()

    def relay_tokens(self, sink: Sink, ids: Sequence[int], text: str,
                     logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        if sink.done:
            return
        if sink.first_token_at is None and (ids or text):
            sink.first_token_at = trio.current_time()
        sink.completion_ids.extend(ids)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            sink.send.send_nowait(TokenChunk(sink.request_id, tuple(ids), text, logprobs))

    def _note_removed(self) -> None:
        if not self._sinks:
            self._empty.set()


__all__ = ["FORWARD_ID_CHARS", "Sink", "SinkTable", "forward_request_id", "node_request_id"]
