"""The client API: talk to any peerinfer node, from trio or from plain synchronous code.

The client is a light libp2p peer with no model. It opens one stream per request to the node it
connected to; that node routes the request to whichever peer serves it best and relays the
tokens back, so the client never needs to know the network.

From trio::

    async with peerinfer.Client.connect("/ip4/127.0.0.1/tcp/4737/p2p/12D3KooW...") as c:
        result = await c.generate("The capital of France is", max_tokens=8)
        async for text in c.stream([{"role": "user", "content": "Hello!"}]):
            print(text, end="")
        status = await c.status()

From synchronous code (a trio loop runs in a background thread)::

    with peerinfer.connect("/ip4/127.0.0.1/tcp/4737/p2p/12D3KooW...") as c:
        print(c.generate("Hello", max_tokens=8).text)
"""

from __future__ import annotations

import itertools
import json
import queue
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any

import trio

from peerinfer.core.messages import (
    ChatMessage,
    Constraint,
    ErrorMessage,
    GenerateDone,
    GenerateRequest,
    Load,
    SamplingParams,
    StatusRequest,
    StatusResponse,
    TokenChunk,
    TokenLogprob,
    decode,
    encode,
)
from peerinfer.engine.constraints import check_constraint
from peerinfer.errors import (
    ClosedError,
    InvalidRequestError,
    PeerUnavailableError,
    ProtocolError,
    error_from_code,
)
from peerinfer.net import HostConfig, NodeHost, Transport, open_host

GENERATE_PROTOCOL = "/peerinfer/generate/1.0.0"
STATUS_PROTOCOL = "/peerinfer/status/1.0.0"

Prompt = str | Sequence[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """One completed generation. Field names match ``peerinfer generate --json``."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    served_by: str
    ttft_s: float
    latency_s: float
    finish_reason: str = "stop"
    #: per generated token, when asked for with ``logprobs=``
    logprobs: tuple[TokenLogprob, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _raise_error(message: ErrorMessage) -> None:
    raise error_from_code(message.code, message.message, message.retry_after_s)


def _constraint(json_schema: Mapping[str, Any] | None,
                constraint: Constraint | None) -> Constraint | None:
    if json_schema is not None and constraint is not None:
        raise InvalidRequestError("give json_schema or constraint, not both")
    if json_schema is not None:
        constraint = Constraint("json_schema", json.dumps(dict(json_schema)))
    if constraint is not None:
        check_constraint(constraint)  # InvalidRequestError naming the problem, before sending
    return constraint


def _message(m: Mapping[str, Any]) -> ChatMessage:
    calls = m.get("tool_calls")
    return ChatMessage(str(m["role"]), str(m.get("content") or ""),
                       json.dumps(list(calls)) if calls else "",
                       str(m.get("tool_call_id") or ""), str(m.get("name") or ""))


def _build_request(
    request_id: str,
    prompt: Prompt,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None,
    stop: Sequence[str],
    *,
    json_schema: Mapping[str, Any] | None = None,
    constraint: Constraint | None = None,
    tools: Sequence[Mapping[str, Any]] = (),
    logprobs: int | None = None,
) -> GenerateRequest:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
        seed=seed, stop=tuple(stop), constraint=_constraint(json_schema, constraint),
        logprobs=logprobs is not None, top_logprobs=logprobs or 0,
    )
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        if tools:
            raise InvalidRequestError("tools need a chat (a list of messages), not a text prompt")
        request = GenerateRequest(request_id=request_id, params=params, prompt=prompt)
    else:
        try:
            messages = tuple(_message(m) for m in prompt)
        except (KeyError, TypeError) as exc:
            raise InvalidRequestError(
                "chat messages must be dicts with 'role' and 'content'"
            ) from exc
        if not messages:
            raise InvalidRequestError("a chat needs at least one message")
        request = GenerateRequest(request_id=request_id, params=params, messages=messages,
                                  tools=json.dumps(list(tools)) if tools else "")
    # Validate locally what the node would refuse, so the caller gets a LocalError.
    try:
        decode(encode(request), expected=GenerateRequest)
    except ProtocolError as exc:
        raise InvalidRequestError(str(exc)) from None
    return request


class Client:
    """A connection to one peerinfer node. Create it with ``Client.connect``."""

    def __init__(self, host: NodeHost, node_peer: str, timeout_s: float) -> None:
        self._host = host
        self._node = node_peer
        self._timeout = timeout_s
        self._ids = itertools.count(1)
        self._prefix = secrets.token_hex(4)
        self._closed = False

    @classmethod
    @asynccontextmanager
    async def connect(
        cls, multiaddr: str, *, timeout_s: float = 120.0, swarm_key: bytes | None = None,
        transport: Transport | None = None,
    ) -> AsyncIterator[Client]:
        """Connect to the node at ``multiaddr`` (``/ip4/.../tcp/.../p2p/<peer id>``); a node of
        a private swarm needs its ``swarm_key``. ``transport`` opens the client's host
        (default: libp2p's ``open_host``; tests: an in-memory network's)."""
        config = HostConfig(
            listen=("/ip4/127.0.0.1/tcp/0",),
            persist_identity=False,
            mdns=False,
            # A client never pings its node: a node slow to answer costs it no request (each
            # frame of an answer has ``timeout_s``). Its host still checks an older connection
            # when the node dials it anew, and keeps one that still delivers frames
            # (peerinfer.net.connections, "Slow but alive").
            liveness_interval_s=0,
            gossip_topics=(),
            swarm_key=swarm_key,
        )
        async with (transport or open_host)(config) as host:
            peer = await host.connect(multiaddr)
            client = cls(host, peer, timeout_s)
            try:
                yield client
            finally:
                client._closed = True

    @property
    def node(self) -> str:
        """The peer id of the node this client talks to."""
        return self._node

    def _next_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def _events(self, request: GenerateRequest) -> AsyncIterator[TokenChunk | GenerateDone]:
        if self._closed:
            raise ClosedError("the client is closed")
        stream = await self._host.open_stream(self._node, GENERATE_PROTOCOL, timeout=self._timeout)
        async with stream:
            await stream.send(encode(request), timeout=self._timeout)
            while True:
                try:
                    frame = await stream.receive(timeout=self._timeout)
                except trio.EndOfChannel:
                    raise PeerUnavailableError("the node closed the stream before finishing") from None
                msg = decode(frame, expected=(TokenChunk, GenerateDone, ErrorMessage))
                if isinstance(msg, ErrorMessage):
                    _raise_error(msg)
                assert isinstance(msg, TokenChunk | GenerateDone)
                yield msg
                if isinstance(msg, GenerateDone):
                    return

    async def generate(
        self,
        prompt: Prompt,
        *,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        json_schema: Mapping[str, Any] | None = None,
        constraint: Constraint | None = None,
        tools: Sequence[Mapping[str, Any]] = (),
        logprobs: int | None = None,
    ) -> GenerationResult:
        """Generate a completion of ``prompt`` (text, or chat messages as role/content dicts,
        which may hold OpenAI's ``tool_calls`` and ``tool`` messages).

        ``ttft_s`` and ``latency_s`` are measured here, as the caller experiences them.
        ``on_text`` is called with each text chunk as it arrives (for streaming displays).
        ``json_schema``: the answer is JSON matching it (constrained decoding); ``constraint``:
        any other constraint (``peerinfer.core.messages.Constraint``: a Lark grammar, a regex,
        any JSON object). ``tools``: OpenAI's tool list, rendered into the chat's prompt (read
        the calls back with ``peerinfer.engine.tools.parse_tool_calls``). ``logprobs``: report
        each token's log-probability with that many top alternatives (0 to 20).
        """
        request = _build_request(self._next_id(), prompt, max_tokens, temperature, top_p, seed,
                                 stop, json_schema=json_schema, constraint=constraint,
                                 tools=tools, logprobs=logprobs)
        started = time.perf_counter()
        first: float | None = None
        parts: list[str] = []
        logprob_entries: list[TokenLogprob] = []
        done: GenerateDone | None = None
        async for msg in self._events(request):
            if isinstance(msg, TokenChunk):
                if first is None and (msg.token_ids or msg.text):
                    first = time.perf_counter()
                parts.append(msg.text)
                logprob_entries.extend(msg.logprobs)
                if on_text is not None and msg.text:
                    on_text(msg.text)
            else:
                done = msg
        assert done is not None
        end = time.perf_counter()
        return GenerationResult(
            text="".join(parts),
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.completion_tokens,
            cached_tokens=done.cached_tokens,
            served_by=done.served_by,
            ttft_s=(first if first is not None else end) - started,
            latency_s=end - started,
            finish_reason=done.finish_reason,
            logprobs=tuple(logprob_entries),
        )

    async def stream(
        self,
        prompt: Prompt,
        *,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        json_schema: Mapping[str, Any] | None = None,
        constraint: Constraint | None = None,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> AsyncIterator[str]:
        """The completion of ``prompt`` as text chunks, as they arrive (the options as in
        ``generate``)."""
        request = _build_request(self._next_id(), prompt, max_tokens, temperature, top_p, seed,
                                 stop, json_schema=json_schema, constraint=constraint, tools=tools)
        async for msg in self._events(request):
            if isinstance(msg, TokenChunk) and msg.text:
                yield msg.text

    async def status(self) -> dict[str, Any]:
        """The node's status: ``peer_id``, ``addrs``, ``model``, ``peers``, ``cache``, ``load``."""
        reply = await self._host.request(
            self._node, STATUS_PROTOCOL, encode(StatusRequest()), timeout=self._timeout
        )
        msg = decode(reply, expected=(StatusResponse, ErrorMessage))
        if isinstance(msg, ErrorMessage):
            _raise_error(msg)
        assert isinstance(msg, StatusResponse)
        return status_to_dict(msg)


def _load_to_dict(load: Load) -> dict[str, int]:
    """A node's load: queued, running and its capacity (``slots``, kept for old readers)."""
    return {"queued": load.queued, "running": load.running, "slots": load.slots,
            "capacity": load.slots}


def status_to_dict(msg: StatusResponse) -> dict[str, Any]:
    """A ``StatusResponse`` as plain JSON-able data (the ``peerinfer status --json`` shape)."""
    return {
        "peer_id": msg.peer_id,
        "addrs": list(msg.addrs),
        "model": msg.model,
        "load": _load_to_dict(msg.load),
        "peers": [
            {
                "peer_id": p.peer_id,
                "digest_age_s": p.digest_age_s,
                "load": _load_to_dict(p.load),
                "cached_tokens": p.cached_tokens,
                "rtt_ms": p.rtt_ms,
                "reputation": p.reputation,
            }
            for p in msg.peers
        ],
        "cache": {
            "tokens": msg.cache.tokens,
            "bytes": msg.cache.bytes,
            "capacity_bytes": msg.cache.capacity_bytes,
        },
        "requests": {
            "received": msg.counters.requests,
            "served_locally": msg.counters.served_locally,
            "forwarded": msg.counters.forwarded,
            "failovers": msg.counters.failovers,
            "rejected": msg.counters.rejected,
            "rejected_over_limit": msg.counters.rejected_over_limit,
        },
    }


class SyncClient:
    """The synchronous client: a trio loop in a background thread runs a ``Client``."""

    def __init__(self, multiaddr: str, *, timeout_s: float = 120.0) -> None:
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._client: Client | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(
            target=self._main, args=(multiaddr, timeout_s), name="peerinfer-client", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def _main(self, multiaddr: str, timeout_s: float) -> None:
        async def run() -> None:
            try:
                async with Client.connect(multiaddr, timeout_s=timeout_s) as client:
                    self._client = client
                    self._token = trio.lowlevel.current_trio_token()
                    self._stop = trio.Event()
                    self._ready.set()
                    await self._stop.wait()
            except BaseException as exc:  # reported to the constructing thread
                if not self._ready.is_set():
                    self._error = exc
                    self._ready.set()
                else:
                    raise

        trio.run(run)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._client is None or self._token is None or not self._thread.is_alive():
            raise ClosedError("the client is closed")

        async def call() -> Any:
            return await fn(*args, **kwargs)

        return trio.from_thread.run(call, trio_token=self._token)

    def generate(self, prompt: Prompt, **kwargs: Any) -> GenerationResult:
        """As ``Client.generate``, blocking."""
        assert self._client is not None
        result: GenerationResult = self._call(self._client.generate, prompt, **kwargs)
        return result

    def stream(self, prompt: Prompt, **kwargs: Any) -> Iterator[str]:
        """As ``Client.stream``: yields text chunks as they arrive."""
        client = self._client
        if client is None:
            raise ClosedError("the client is closed")
        chunks: queue.Queue[tuple[str, Any]] = queue.Queue()

        async def pump() -> None:
            try:
                async for text in client.stream(prompt, **kwargs):
                    chunks.put(("text", text))
            except BaseException as exc:
                chunks.put(("error", exc))
                return
            chunks.put(("end", None))

        assert self._token is not None
        trio.from_thread.run_sync(
            lambda: self._spawn(pump), trio_token=self._token
        )
        while True:
            kind, value = chunks.get()
            if kind == "text":
                yield value
            elif kind == "error":
                raise value
            else:
                return

    def _spawn(self, fn: Any) -> None:
        trio.lowlevel.spawn_system_task(fn)

    def status(self) -> dict[str, Any]:
        assert self._client is not None
        status: dict[str, Any] = self._call(self._client.status)
        return status

    def close(self) -> None:
        if self._stop is not None and self._token is not None and self._thread.is_alive():
            stop = self._stop
            trio.from_thread.run_sync(stop.set, trio_token=self._token)
        self._thread.join(timeout=30)
        self._client = None

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(multiaddr: str, *, timeout_s: float = 120.0) -> SyncClient:
    """Connect to a node from synchronous code; use it as a context manager, or ``close()``."""
    return SyncClient(multiaddr, timeout_s=timeout_s)


__all__ = ["Client", "GenerationResult", "SyncClient", "connect", "status_to_dict"]
