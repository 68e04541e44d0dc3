"""The node's HTTP front end: an ASGI app (Starlette for routing, raw ASGI for completions).

Every completion request goes through the node's door (``Node.submit``), exactly as a libp2p
client's does, so it is routed through the network like any other. The completion endpoints
are raw ASGI handlers, not Starlette responses, for two reasons: the handler must see the
client's disconnect while it waits for a token (a task watches ``receive()`` for
``http.disconnect`` and cancels the request, which leaving the door turns into a network-wide
cancel), and a response's status and ``x-peerinfer-served-by`` header are chosen once the
first event is known (an error before the first token is a proper HTTP error, not an SSE
event; the header names the peer the request runs on).

Authentication: with API keys configured, every endpoint but the dashboard's static page
needs ``Authorization: Bearer <key>``; keys are compared with ``hmac.compare_digest``, each
one, so the time taken does not tell which key nearly matched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from peerinfer.core.messages import ErrorMessage, GenerateDone, TokenChunk, TokenLogprob
from peerinfer.engine.tools import ToolCall, could_become_call
from peerinfer.http import openai as oa
from peerinfer.http.address import is_loopback
from peerinfer.http.metrics import CONTENT_TYPE, NodeMetrics

if TYPE_CHECKING:
    from peerinfer.node import Node, Submission

logger = logging.getLogger("peerinfer.http")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

#: The largest request body accepted (a prompt of MAX_PROMPT_CHARS in JSON, with room).
MAX_BODY_BYTES = 8 * 1024 * 1024
SERVED_BY_HEADER = b"x-peerinfer-served-by"
REQUEST_ID_HEADER = b"x-request-id"


def _dashboard_html() -> str:
    return resources.files("peerinfer.http").joinpath("dashboard.html").read_text("utf-8")


class HttpApi:
    """The ASGI app of one node. ``app`` is what the server runs."""

    def __init__(self, node: Node, api_keys: Sequence[str] = ()) -> None:
        self.node = node
        self._keys = tuple(k.encode() for k in api_keys if k)
        self.metrics = NodeMetrics(node)
        node.request_listeners.append(self.metrics.observe)
        self._created = int(time.time())
        self._dashboard = _dashboard_html()
        self.app = Starlette(
            routes=[
                Route("/", self._index, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/v1/peerinfer/status", self._status, methods=["GET"]),
                Route("/v1/chat/completions", _Completions(self, chat=True), methods=["POST"]),
                Route("/v1/completions", _Completions(self, chat=False), methods=["POST"]),
            ],
            exception_handlers={HTTPException: self._http_error},  # type: ignore[dict-item]
        )

    # ------------------------------------------------------------------ helpers

    @property
    def model(self) -> str:
        engine = self.node.engine
        assert engine is not None
        return str(engine.model_name)

    def authorized(self, headers: Mapping[bytes, bytes] | Sequence[tuple[bytes, bytes]]) -> bool:
        return self.api_key_of(headers) is not None

    def api_key_of(
        self, headers: Mapping[bytes, bytes] | Sequence[tuple[bytes, bytes]]
    ) -> bytes | None:
        """The API key the request carries, if it is one of ours (b"" when the API has no
        keys); None: not authorized."""
        if not self._keys:
            return b""
        value = b""
        items = headers.items() if isinstance(headers, Mapping) else headers
        for name, v in items:
            if name.lower() == b"authorization":
                value = v
        scheme, _, token = value.partition(b" ")
        if scheme.lower() != b"bearer":
            token = b""
        token = token.strip()
        found: bytes | None = None
        for key in self._keys:  # every key, so the time does not depend on which matched
            if hmac.compare_digest(token, key):
                found = key
        return found

    def _unauthorized(self) -> JSONResponse:
        return JSONResponse(
            oa.error_body("a valid API key is required: send 'Authorization: Bearer <key>'",
                          "invalid_request_error", None, "invalid_api_key"),
            status_code=401, headers={"www-authenticate": "Bearer"},
        )

    def _check(self, request: Request) -> JSONResponse | None:
        return None if self.authorized(request.headers.raw) else self._unauthorized()

    async def _http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}
        return JSONResponse(
            oa.error_body(message.get(exc.status_code, str(exc.detail)), "invalid_request_error"),
            status_code=exc.status_code,
        )

    # ------------------------------------------------------------------ endpoints

    async def _index(self, request: Request) -> Response:
        return HTMLResponse(self._dashboard, headers={"cache-control": "no-store"})

    async def _models(self, request: Request) -> Response:
        return self._check(request) or JSONResponse(oa.models_list(self.model, self._created))

    async def _metrics(self, request: Request) -> Response:
        denied = self._check(request)
        if denied is not None:
            return denied
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def _status(self, request: Request) -> Response:
        return self._check(request) or JSONResponse(self.status())

    def status(self) -> dict[str, Any]:
        """What the dashboard shows: the node's status, plus what only this process knows."""
        from peerinfer.client import status_to_dict

        node = self.node
        engine = node.engine
        snapshot = node.statistics()
        status = status_to_dict(node.status())
        status["device"] = str(getattr(engine, "device", "cpu"))
        status["dtype"] = str(getattr(engine, "dtype", "")).removeprefix("torch.")
        status["engine"] = type(engine).__name__
        status["http_url"] = snapshot.http_url
        status["uptime_s"] = snapshot.uptime_s
        status["decisions"] = [
            {"at": d.at, "request_id": d.request_id, "peer": d.peer, "local": d.local,
             "reason": d.reason}
            for d in snapshot.decisions
        ]
        outcomes: dict[str, float] = {}
        for metric in self.metrics.requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    key = sample.labels["outcome"]
                    outcomes[key] = outcomes.get(key, 0) + sample.value
        status["outcomes"] = outcomes
        status["traffic_bytes"] = {f"{k}_{d}": v for (k, d), v in snapshot.traffic}
        return status


class _Completions:
    """``POST /v1/chat/completions`` or ``/v1/completions`` as a raw ASGI app."""

    def __init__(self, api: HttpApi, *, chat: bool) -> None:
        self.api = api
        self.chat = chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = self.api
        key = api.api_key_of(scope["headers"])
        if key is None:
            await _send_json(send, 401, oa.error_body(
                "a valid API key is required: send 'Authorization: Bearer <key>'",
                "invalid_request_error", None, "invalid_api_key"),
                extra=[(b"www-authenticate", b"Bearer")])
            return
        rid = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        try:
            body = json.loads(await _read_body(receive))
            parse = oa.parse_chat if self.chat else oa.parse_completion
            parsed = parse(body, rid, api.model)
        except oa.ApiError as exc:
            await _send_json(send, exc.status, exc.body())
            return
        except ValueError:
            await _send_json(send, 400, oa.error_body("the body is not valid JSON",
                                                      "invalid_request_error"))
            return
        client = scope.get("client") or ("unknown", 0)
        # Fair share per API key (every user behind one proxy or chat UI has its own), per
        # client address only when the API has no keys; a client on this machine is the
        # node's own user (entitled to more, first among those below their share), one from
        # the network (a key-holding LAN user) is not.
        requester = requester_name(key, str(client[0]))
        local = is_loopback(str(client[0]))
        async with trio.open_nursery() as nursery:
            # The client hanging up cancels the request: leaving submit() tells the network.
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            async with api.node.submit(parsed.request, requester=requester, local=local) as events:
                if parsed.stream:
                    await self._stream(send, events, parsed, rid)
                else:
                    await self._whole(send, events, parsed, rid)
            nursery.cancel_scope.cancel()

    async def _whole(self, send: Send, events: Submission, parsed: oa.ParsedRequest,
                     rid: str) -> None:
        parts: list[str] = []
        logprobs: list[TokenLogprob] | None = [] if parsed.logprobs else None
        async for ev in events:
            if isinstance(ev, TokenChunk):
                parts.append(ev.text)
                if logprobs is not None:
                    logprobs.extend(ev.logprobs)
            elif isinstance(ev, ErrorMessage):
                err = oa.api_error_from(ev)
                await _send_json(send, err.status, err.body(), rid=rid, extra=_retry_after(ev))
                return
            else:
                assert isinstance(ev, GenerateDone)
                text = "".join(parts)
                if self.chat:
                    body = oa.chat_response(rid, parsed.model, text, ev,
                                            tool_names=parsed.tool_names, logprobs=logprobs)
                else:
                    body = oa.completion_response(rid, parsed.model, text, ev, logprobs=logprobs)
                await _send_json(send, 200, body, rid=rid, served_by=ev.served_by)

    async def _stream(self, send: Send, events: Submission, parsed: oa.ParsedRequest,
                      rid: str) -> None:
        first = await events.__anext__()
        if isinstance(first, ErrorMessage):
            err = oa.api_error_from(first)
            await _send_json(send, err.status, err.body(), rid=rid, extra=_retry_after(first))
            return
        served_by = first.served_by if isinstance(first, GenerateDone) else events.serving_peer
        await send({
            "type": "http.response.start", "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),
                (REQUEST_ID_HEADER, rid.encode()),
                (SERVED_BY_HEADER, served_by.encode()),
            ],
        })
        created = int(time.time())
        model = parsed.model
        chat = self.chat
        role_sent = False
        # Logprobs of tokens whose text is not out yet go with the next text sent.
        pending: list[TokenLogprob] | None = [] if parsed.logprobs else None
        offset = 0  # completions' text_offset
        # With tools offered, text that may be the start of a call is held until it is known
        # (a call) or cannot be one (then it streams like any text).
        held: str | None = "" if parsed.tool_names else None

        async def body(data: bytes, more: bool = True) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": more})

        def take_logprobs() -> list[TokenLogprob] | None:
            nonlocal pending
            if pending is None:
                return None
            out, pending = pending, []
            return out

        ev: TokenChunk | GenerateDone | ErrorMessage = first
        while True:
            if isinstance(ev, TokenChunk):
                if pending is not None:
                    pending.extend(ev.logprobs)
                text = ev.text
                if held is not None:
                    held += text
                    if could_become_call(held):
                        text = ""
                    else:
                        text, held = held, None
                if text or not role_sent:
                    if chat:
                        chunk = oa.chat_chunk(rid, model, created, content=text,
                                              role=not role_sent, logprobs=take_logprobs())
                    else:
                        lps = take_logprobs()
                        chunk = oa.completion_chunk(rid, model, created, text=text,
                                                    logprobs=lps, offset=offset)
                        offset += sum(len(e.text) for e in lps or ())
                    role_sent = True
                    await body(oa.sse(chunk))
            elif isinstance(ev, GenerateDone):
                calls: list[ToolCall] = []
                data = b""
                if held is not None:  # the answer was a call, or text that looked like one
                    content, calls = oa.read_answer(held, parsed.tool_names)
                    if content:
                        data += oa.sse(oa.chat_chunk(rid, model, created, content=content,
                                                     logprobs=take_logprobs()))
                    for delta in oa.tool_call_chunks(calls):
                        data += oa.sse(oa.chat_chunk(rid, model, created, tool_calls=delta))
                finish = oa.finish_reason(ev.finish_reason, bool(calls))
                if chat:
                    tail = oa.chat_chunk(rid, model, created, role=not role_sent, finish=finish,
                                         logprobs=take_logprobs() or None)
                else:
                    tail = oa.completion_chunk(rid, model, created, finish=finish,
                                               logprobs=take_logprobs() or None, offset=offset)
                data += oa.sse(tail)
                if parsed.include_usage:
                    data += oa.sse(oa.usage_chunk(rid, model, created, ev, chat))
                await body(data + oa.SSE_DONE, more=False)
                return
            else:
                # Failed after the response began: OpenAI's clients read an error event.
                assert isinstance(ev, ErrorMessage)
                err = oa.api_error_from(ev)
                await body(oa.sse(err.body()), more=False)
                return
            ev = await events.__anext__()


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise oa.ApiError(400, "the client went away before sending the whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise oa.ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def requester_name(api_key: bytes, address: str) -> str:
    """Who an HTTP request counts as for the node's fair share: its API key (a digest of it,
    which refusal messages may name without giving the key away), or its address when the
    API has no keys."""
    if api_key:
        return "http-key:" + hashlib.blake2b(api_key, digest_size=8, person=b"peerinfer-key").hexdigest()
    return f"http:{address}"


def _retry_after(error: ErrorMessage) -> list[tuple[bytes, bytes]]:
    """A busy refusal's retry hint as HTTP's Retry-After (whole seconds)."""
    if error.retry_after_s <= 0:
        return []
    return [(b"retry-after", str(math.ceil(error.retry_after_s)).encode())]


async def _send_json(send: Send, status: int, payload: Any, *, rid: str | None = None,
                     served_by: str | None = None,
                     extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(payload, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode()), *extra]
    if rid is not None:
        headers.append((REQUEST_ID_HEADER, rid.encode()))
    if served_by is not None:
        headers.append((SERVED_BY_HEADER, served_by.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data, "more_body": False})


__all__ = ["MAX_BODY_BYTES", "SERVED_BY_HEADER", "HttpApi"]
