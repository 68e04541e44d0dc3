"""The HTTP API of real in-process nodes (libp2p on 127.0.0.1, the simulated engine).

Clients: the official ``openai`` package (run in a worker thread: it is synchronous) and raw
HTTP through httpx. Every error path of the API has a test here.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
import trio

from peerinfer.client import Client
from peerinfer.core.costmodel import CostModel
from peerinfer.core.messages import ERROR_CODES, ErrorMessage, GenerateRequest, SamplingParams
from peerinfer.engine.base import Decoder, DecodeRequest
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.errors import ERROR_TABLE, ConfigError, PeerInferError, error_from_code
from peerinfer.http import check_exposure, parse_http_address
from peerinfer.http.openai import api_error_from
from peerinfer.node import Node, NodeOptions
from peerinfer.serve import serve_node
from peerinfer.testing.inprocess import node_options, open_nodes, wait_until

COSTS = CostModel(
    prefill_s_per_token=0.0004, cached_s_per_token=0.00001, decode_s_per_token=0.002,
    overhead_s=0.002, slots=1,
)
SHARED = " ".join(f"shared{i}" for i in range(300))
KEY = "sk-test-0123456789"


class RecordingEngine(SimulatedEngine):
    """The simulated engine, remembering what it was asked (for the cancel and chat tests)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.requests: list[DecodeRequest] = []
        self.chats: list[list[Any]] = []
        self.lock = threading.Lock()

    def open_decoder(self, request: DecodeRequest) -> Decoder:
        with self.lock:
            self.requests.append(request)
        return super().open_decoder(request)

    def chat_tokens(self, messages: Any) -> list[int]:
        with self.lock:
            self.chats.append(list(messages))
        return super().chat_tokens(messages)


def options(**overrides: Any) -> NodeOptions:
    return node_options(**{
        "costs": COSTS, "peer_timeout_s": 4.0, "http": "127.0.0.1:0",
        "max_tokens": 8192,  # the cancel tests ask for 5,000
        **overrides,
    })


@asynccontextmanager
async def nodes(n: int = 1, costs: CostModel = COSTS, **overrides: Any) -> AsyncIterator[list[Node]]:
    """``n`` nodes in a chain, each with its HTTP API on a free loopback port."""
    def make(i: int, bootstrap: tuple[str, ...]) -> Node:
        return Node(options(bootstrap=bootstrap, costs=costs, **overrides), engine=RecordingEngine(costs=costs))

    async with open_nodes(n, make) as started:
        yield started


def sdk(node: Node, key: str = "none") -> openai.OpenAI:
    assert node.http_url is not None
    return openai.OpenAI(base_url=node.http_url + "/v1", api_key=key, max_retries=0, timeout=30)


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn)


async def warm_up(a: Node, b: Node) -> tuple[Node, Node]:
    """Put the long prefix in one node's cache (wherever the request to ``b`` was routed: with
    nothing cached, either node may serve it) and wait until the other knows it is there.
    Returns (asker, holder)."""
    raw = await in_thread(lambda: sdk(b).completions.with_raw_response.create(
        model="simulated", prompt=SHARED + " warm", max_tokens=2))
    holder = a if raw.headers["x-peerinfer-served-by"] == a.peer_id else b
    asker = b if holder is a else a
    await wait_until(
        lambda: asker.core.index.replica(holder.core.peer_id) is not None  # type: ignore[union-attr]
        and len(asker.core.index.replica(holder.core.peer_id).digest) > 0,  # type: ignore[union-attr]
        timeout=60.0,
    )
    return asker, holder


# ------------------------------------------------------------------------- the error table


def test_the_error_table_covers_every_wire_code_once() -> None:
    assert set(ERROR_TABLE) == set(ERROR_CODES)
    for code, kind in ERROR_TABLE.items():
        exc = error_from_code(code, "why")
        assert isinstance(exc, kind.exception) and isinstance(exc, PeerInferError)
        assert api_error_from(ErrorMessage("r", code, "why")).status == kind.http_status
    assert ERROR_TABLE["invalid"].http_status == 400
    assert ERROR_TABLE["busy"].http_status == 429
    assert ERROR_TABLE["timeout"].http_status == 504
    assert ERROR_TABLE["unavailable"].http_status == 503
    # A code from a newer peer reads as an internal failure, not a crash.
    assert api_error_from(ErrorMessage("r", "internal", "x")).status == 500


def test_http_addresses_and_exposure() -> None:
    assert parse_http_address("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert parse_http_address("[::1]:0") == ("::1", 0)
    assert parse_http_address("none") is None
    for bad in ("8000", "localhost:", "host:99999", "a:b"):
        with pytest.raises(ConfigError):
            parse_http_address(bad)
    check_exposure("127.0.0.1", ())
    check_exposure("::1", ())
    check_exposure("0.0.0.0", ("a-long-key",))
    with pytest.raises(ConfigError, match="api-key"):
        check_exposure("0.0.0.0", ())
    with pytest.raises(ConfigError, match="api-key"):
        check_exposure("192.168.1.20", ())


async def test_a_non_loopback_address_without_a_key_is_refused_before_loading() -> None:
    node = Node(options(http="0.0.0.0:0"), engine=RecordingEngine(costs=COSTS))
    with pytest.raises(ConfigError, match="without an API key"):
        await serve_node(node)


# ------------------------------------------------------------------------- happy paths


async def test_openai_client_lists_the_model_and_chats() -> None:
    async with nodes(1) as (node,):
        client = sdk(node)
        models = await in_thread(lambda: client.models.list())
        assert [m.id for m in models.data] == ["simulated"]
        raw = await in_thread(lambda: client.chat.completions.with_raw_response.create(
            model="simulated", messages=[{"role": "user", "content": "hello there"}],
            max_tokens=5, temperature=0,
        ))
        assert raw.headers["x-peerinfer-served-by"] == node.peer_id
        answer = raw.parse()
        assert answer.object == "chat.completion"
        assert answer.choices[0].message.role == "assistant"
        assert answer.choices[0].message.content
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage.completion_tokens == 5
        assert answer.usage.total_tokens == answer.usage.prompt_tokens + 5
        assert answer.usage.prompt_tokens_details.cached_tokens == 0


async def test_streaming_matches_the_whole_answer_and_reports_cached_tokens() -> None:
    async with nodes(1) as (node,):
        client = sdk(node)
        messages = [{"role": "user", "content": SHARED + " what follows?"}]
        whole = await in_thread(lambda: client.chat.completions.create(
            model="simulated", messages=messages, max_tokens=8, temperature=0, seed=7,
        ))

        def stream() -> tuple[list[str], Any, list[Any]]:
            parts, usage, chunks = [], None, []
            for chunk in client.chat.completions.create(
                model="simulated", messages=messages, max_tokens=8, temperature=0, seed=7,
                stream=True, stream_options={"include_usage": True},
            ):
                chunks.append(chunk)
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    if choice.delta.content:
                        parts.append(choice.delta.content)
            return parts, usage, chunks

        parts, usage, chunks = await in_thread(stream)
        assert len(parts) == 8  # one event per token: streamed, not buffered
        assert "".join(parts) == whole.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices == [] and usage is not None
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        # The first request left the long prompt in the cache; the second was served from it.
        assert whole.usage.prompt_tokens_details.cached_tokens == 0
        assert usage.prompt_tokens_details.cached_tokens >= 256
        assert usage.prompt_tokens == whole.usage.prompt_tokens


async def test_raw_sse_ends_with_done_and_streams_completions() -> None:
    async with nodes(1) as (node,), httpx.AsyncClient(base_url=node.http_url) as http:
        body = {"model": "simulated", "prompt": "once upon a time", "max_tokens": 4,
                "stream": True, "stop": ["\n\n"], "top_p": 0.9, "temperature": 0.5}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["x-peerinfer-served-by"] == node.peer_id
            lines = [line async for line in response.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert all(e["object"] == "text_completion" for e in events)
        assert "".join(e["choices"][0]["text"] for e in events).strip()
        assert "usage" not in events[-1]  # not asked for
        whole = await http.post("/v1/completions", json={**body, "stream": False})
        assert whole.status_code == 200
        assert whole.json()["usage"]["completion_tokens"] == 4


async def metrics_showing(http: httpx.AsyncClient, line: str, timeout_s: float = 5.0) -> str:
    """The node's /metrics text once it shows ``line`` (or after ``timeout_s``, for the caller's
    assert to say what is missing). A request is counted when its submission ends, which can come
    a moment after its client has read the whole response."""
    with trio.move_on_after(timeout_s):
        while line not in (text := (await http.get("/metrics")).text):
            await trio.sleep(0.05)
    return text


def _sample(text: str, name: str) -> float:
    """The value of metric sample ``name`` (with its labels) in /metrics ``text``; 0 if absent."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_request_is_routed_through_the_network_and_names_its_server() -> None:
    ok_remote = 'peerinfer_requests_total{outcome="ok",served="remote",source="local"}'
    async with nodes(2) as pair:
        # Warm one cache with the long prefix, then ask the other node: it forwards. (The warm-up
        # itself may have been forwarded by the node that is now the asker, so count from here.)
        a, b = await warm_up(*pair)
        async with httpx.AsyncClient(base_url=a.http_url) as http:
            before = (await http.get("/metrics")).text
            raw = await in_thread(lambda: sdk(a).completions.with_raw_response.create(
                model="simulated", prompt=SHARED + " again", max_tokens=3))
            assert raw.headers["x-peerinfer-served-by"] == b.peer_id
            assert raw.parse().usage.prompt_tokens_details.cached_tokens >= 256
            assert any(not d.local and d.peer == b.peer_id for d in a.recent_decisions)
            expected = f"{ok_remote} {_sample(before, ok_remote) + 1:.1f}"
            metrics = await metrics_showing(http, expected)
            status = (await http.get("/v1/peerinfer/status")).json()
        assert expected in metrics
        forwards = _sample(metrics, "peerinfer_forwards_total")
        assert forwards == _sample(before, "peerinfer_forwards_total") + 1
        assert "peerinfer_peers_known 1.0" in metrics
        assert status["decisions"][0]["peer"] == b.peer_id
        assert status["decisions"][0]["reason"].startswith("longest_prefix")
        # The dashboard shows `at` as a time of day: it must be the wall clock, not trio's.
        assert abs(status["decisions"][0]["at"] - time.time()) < 600


async def test_metrics_count_requests_tokens_and_traffic() -> None:
    async with nodes(2) as (a, _b), httpx.AsyncClient(base_url=a.http_url) as http:
        for _ in range(2):
            r = await http.post("/v1/chat/completions", json={
                "model": "simulated", "max_completion_tokens": 3,
                "messages": [{"role": "user", "content": SHARED}]})
            assert r.status_code == 200
        await wait_until(lambda: a.traffic["announce", "received"] > 0)
        text = await metrics_showing(http, "peerinfer_completion_tokens_total 6.0")
        samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                   for line in text.splitlines() if line and not line.startswith("#")}
        ok = sum(v for k, v in samples.items()
                 if k.startswith("peerinfer_requests_total{") and 'outcome="ok"' in k)
        assert ok == 2
        assert samples['peerinfer_ttft_seconds_count{source="local"}'] == 2
        assert samples['peerinfer_request_latency_seconds_count{source="local"}'] == 2
        assert samples['peerinfer_prompt_tokens_total{kind="cached"}'] >= 256
        assert samples['peerinfer_prompt_tokens_total{kind="computed"}'] > 0
        assert samples["peerinfer_completion_tokens_total"] == 6
        assert samples['peerinfer_traffic_bytes_total{direction="sent",kind="announce"}'] > 0
        assert samples["peerinfer_requests_running"] == 0
        # A libp2p client's request goes through the same door, counted as from the network.
        async with Client.connect(a.addresses()[0]) as client:
            await client.generate("hello over libp2p", max_tokens=2)
        text = (await http.get("/metrics")).text
        assert 'outcome="ok",served="local",source="network"} 1.0' in text or \
            'outcome="ok",served="remote",source="network"} 1.0' in text
        assert "peerinfer_batch_occupancy" in samples
        # Read from the engine worker's batch scheduler (the requests may have run on either
        # node: nothing was cached when the first one was routed).
        assert "peerinfer_batch_decode_steps_total" in samples
        assert samples["peerinfer_batch_max_running"] >= 1
        assert "peerinfer_cache_bytes" in samples


# ------------------------------------------------------------------------- error paths


async def test_unsupported_parameters_are_refused_by_name() -> None:
    async with nodes(1) as (node,):
        client = sdk(node)
        base: dict[str, Any] = dict(model="simulated", messages=[{"role": "user", "content": "hi"}])
        cases: list[tuple[dict[str, Any], str]] = [
            ({"n": 2}, "n > 1"),
            ({"functions": [{"name": "f", "parameters": {}}]}, "legacy 'functions'"),
            ({"presence_penalty": 0.5}, "presence penalty"),
            ({"logit_bias": {"5": 1}}, "logit_bias"),
        ]
        for extra, what in cases:
            with pytest.raises(openai.BadRequestError) as info:
                await in_thread(lambda extra=extra: client.chat.completions.create(**base, **extra))
            assert info.value.status_code == 400
            assert what in info.value.message and "not supported" in info.value.message
            assert info.value.code == "unsupported_parameter"
        # The simulated engine has no distribution and no text to constrain: it says so.
        engine_cases: list[tuple[dict[str, Any], str]] = [
            ({"logprobs": True}, "does not report logprobs"),
            ({"response_format": {"type": "json_object"}}, "does not support constrained decoding"),
        ]
        for extra, what in engine_cases:
            with pytest.raises(openai.BadRequestError) as info:
                await in_thread(lambda extra=extra: client.chat.completions.create(**base, **extra))
            assert what in info.value.message


async def test_invalid_requests_get_400_in_openai_shape() -> None:
    async with nodes(1) as (node,), httpx.AsyncClient(base_url=node.http_url) as http:
        msgs = [{"role": "user", "content": "hi"}]
        cases: list[tuple[Any, str]] = [
            ({"model": "simulated", "messages": msgs, "temperature": 5}, "temperature"),
            ({"model": "simulated", "messages": []}, "messages"),
            ({"model": "simulated", "messages": msgs, "max_tokens": 0}, "max_tokens"),
            ({"model": "simulated", "messages": msgs, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
            ({"messages": msgs}, "model"),
            ([1, 2], "JSON object"),
        ]
        for body, word in cases:
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, body
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and word in error["message"], error
        r = await http.post("/v1/chat/completions", content=b"{not json",
                            headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        # A prompt longer than the model's context is refused by the node's door.
        r = await http.post("/v1/completions", json={
            "model": "simulated", "prompt": "x " * 9000, "max_tokens": 2})
        assert r.status_code == 400 and "context" in r.json()["error"]["message"]
        r = await http.get("/v1/nothing-here")
        assert r.status_code == 404 and "no such endpoint" in r.json()["error"]["message"]


async def test_an_unknown_model_is_404() -> None:
    async with nodes(1) as (node,):
        with pytest.raises(openai.NotFoundError) as info:
            await in_thread(lambda: sdk(node).chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}]))
        assert info.value.code == "model_not_found"
        assert "simulated" in info.value.message


async def test_api_keys_are_required_when_configured() -> None:
    async with nodes(1, api_keys=(KEY,)) as (node,):
        with pytest.raises(openai.AuthenticationError):
            await in_thread(lambda: sdk(node, key="sk-wrong-key-000").models.list())
        models = await in_thread(lambda: sdk(node, key=KEY).models.list())
        assert models.data[0].id == "simulated"
        async with httpx.AsyncClient(base_url=node.http_url) as http:
            for path in ("/metrics", "/v1/peerinfer/status", "/v1/models"):
                r = await http.get(path)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await http.post("/v1/chat/completions", json={})
            assert r.status_code == 401
            r = await http.get("/metrics", headers={"authorization": f"Bearer {KEY}"})
            assert r.status_code == 200 and "peerinfer_requests_running" in r.text
            # The dashboard page itself holds no data; it asks for the key.
            assert (await http.get("/")).status_code == 200


async def test_a_full_queue_is_429() -> None:
    slow = CostModel(prefill_s_per_token=0.0004, cached_s_per_token=0.00001,
                     decode_s_per_token=0.05, overhead_s=0.002, slots=1)
    async with nodes(1, costs=slow) as (node,), contextlib.AsyncExitStack() as stack:
        params = SamplingParams(max_tokens=1000)
        limit = node.core.config.hard_max_queue  # type: ignore[union-attr]
        # One running and a full queue, submitted at the door directly (tokens: no tokenizer),
        # each from its own requester (one requester may only queue its share).
        for i in range(limit + 1):
            await stack.enter_async_context(node.submit(
                GenerateRequest(request_id=f"fill{i}", params=params, tokens=(5, 6, 7)),
                requester=f"test{i}", local=True))
        with pytest.raises(openai.RateLimitError) as info:
            await in_thread(lambda: sdk(node).completions.create(
                model="simulated", prompt="one more", max_tokens=2))
        assert info.value.status_code == 429 and info.value.code == "busy"
        # The node's retry hint, as HTTP says it.
        assert int(info.value.response.headers["retry-after"]) >= 1


async def test_no_token_in_time_is_504() -> None:
    # A prefill of ~3 s against a 0.3 s gap limit at the door.
    slow = CostModel(prefill_s_per_token=0.01, cached_s_per_token=0.00001,
                     decode_s_per_token=0.002, overhead_s=0.002, slots=1)
    async with nodes(1, costs=slow, token_gap_timeout_s=0.3) as (node,):
        with pytest.raises(openai.APIStatusError) as info:
            await in_thread(lambda: sdk(node).completions.create(
                model="simulated", prompt=SHARED, max_tokens=2))
        assert info.value.status_code == 504 and info.value.code == "timeout"


async def test_a_client_disconnect_cancels_the_work_in_the_engine() -> None:
    async with nodes(1) as (node,), httpx.AsyncClient(base_url=node.http_url) as http:
        engine = node.engine
        assert isinstance(engine, RecordingEngine)
        body = {"model": "simulated", "prompt": "tell me a long story", "max_tokens": 5000,
                "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break
        # Leaving the block closed the connection mid-stream.
        (request,) = engine.requests
        await wait_until(lambda: request.cancel.is_set())
        await wait_until(lambda: node.core.load().running == 0)  # type: ignore[union-attr]
        cancelled = 'peerinfer_requests_total{outcome="cancelled",served="none",source="local"} 1.0'
        assert cancelled in await metrics_showing(http, cancelled)


async def test_a_disconnect_cancels_a_forwarded_request_on_the_peer() -> None:
    async with nodes(2) as pair:
        a, b = await warm_up(*pair)
        engine = b.engine
        assert isinstance(engine, RecordingEngine)
        body = {"model": "simulated", "prompt": SHARED + " long", "max_tokens": 5000,
                "stream": True}
        async with httpx.AsyncClient(base_url=a.http_url) as http:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.headers["x-peerinfer-served-by"] == b.peer_id
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break
        forwarded = engine.requests[-1]
        await wait_until(lambda: forwarded.cancel.is_set())
        await wait_until(lambda: b.core.load().running == 0)  # type: ignore[union-attr]


async def test_a_client_that_gives_up_on_a_whole_answer_cancels_it() -> None:
    async with nodes(1) as (node,), httpx.AsyncClient(base_url=node.http_url) as http:
        engine = node.engine
        assert isinstance(engine, RecordingEngine)
        body = {"model": "simulated", "prompt": "a very long answer", "max_tokens": 5000}
        with pytest.raises(httpx.ReadTimeout):
            # Not streamed: the client waits for the whole answer, then gives up and hangs up.
            await http.post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
        (request,) = engine.requests
        await wait_until(lambda: request.cancel.is_set())
        await wait_until(lambda: node.core.load().running == 0)  # type: ignore[union-attr]
