"""A real node (libp2p on 127.0.0.1) serving many clients at once through its batch scheduler.

The engine is the recording test engine, so the test sees which requests decoded together; its
output is a pure function of the prompt, so every client's text is checked exactly.
"""

from __future__ import annotations

import threading

import pytest
import trio

from peerinfer.client import Client
from peerinfer.core.messages import SamplingParams
from peerinfer.engine import Tokens
from peerinfer.errors import EngineError
from peerinfer.node import Node, NodeOptions
from peerinfer.testing.engines import BatchRecordingEngine
from peerinfer.testing.inprocess import node_options, wait_until


def _options(**overrides: object) -> NodeOptions:
    return node_options(**{"engine": "unused", "policy": "local", **overrides})


def _expected_text(prompt: str, max_tokens: int) -> str:
    reference = BatchRecordingEngine()
    events = reference.generate(reference.tokenize(prompt), SamplingParams(max_tokens=max_tokens))
    return "".join(ev.text for ev in events if isinstance(ev, Tokens))


def _handed_over(node: Node) -> int:
    return node.worker.in_flight


@pytest.mark.slow
async def test_concurrent_clients_are_decoded_together() -> None:
    gate = threading.Event()
    # Whole prompts in one prefill chunk: the k-th request joins the batch at the k-th step.
    engine = BatchRecordingEngine(max_batch_size=4, gate=gate, prefill_chunk_tokens=256)
    node = Node(_options(), engine=engine)
    prompts = [f"question number {i}: " + "why? " * (i + 1) for i in range(4)]
    results: dict[int, object] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(node.serve)
        assert node.core is not None and node.core.config.costs.slots == 4  # the engine's capacity
        addr = node.addresses()[0]

        async def ask(i: int) -> None:
            async with Client.connect(addr) as client:
                results[i] = await client.generate(prompts[i], max_tokens=12)

        async with trio.open_nursery() as clients:
            for i in range(4):
                clients.start_soon(ask, i)
            # The first request holds the engine at the gate until all four are in the node.
            await wait_until(lambda: _handed_over(node) == 4)
            gate.set()
        nursery.cancel_scope.cancel()
    for i, prompt in enumerate(prompts):
        result = results[i]
        assert result.text == _expected_text(prompt, 12)  # type: ignore[attr-defined]
        assert result.completion_tokens == 12 and result.finish_reason == "length"  # type: ignore[attr-defined]
    assert max(engine.batch_sizes) == 4  # all four decoded in one batch
    assert engine.open_decoders == 0


@pytest.mark.slow
async def test_a_client_leaving_mid_batch_does_not_disturb_the_others() -> None:
    # Paced so that the leaving client's cancellation arrives while the others decode.
    engine = BatchRecordingEngine(max_batch_size=4, step_delay_s=0.002)
    node = Node(_options(), engine=engine)
    prompts = [f"stay {i} " * 3 for i in range(2)] + ["leave early please"]
    n_tokens = 300
    results: dict[int, object] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(node.serve)
        addr = node.addresses()[0]

        async def ask(i: int) -> None:
            async with Client.connect(addr) as client:
                results[i] = await client.generate(prompts[i], max_tokens=n_tokens)

        async def ask_and_leave(scope: trio.CancelScope) -> None:
            seen: list[str] = []

            def on_text(text: str) -> None:
                seen.append(text)
                if len(seen) >= 2:
                    scope.cancel()  # the client goes away mid-stream

            with scope:
                async with Client.connect(addr) as client:
                    await client.generate(prompts[2], max_tokens=n_tokens, on_text=on_text)
            results[2] = seen

        async with trio.open_nursery() as clients:
            for i in range(2):
                clients.start_soon(ask, i)
            await wait_until(lambda: len(engine.batch_sizes) > 0)
            clients.start_soon(ask_and_leave, trio.CancelScope())
        await wait_until(lambda: node.worker.in_flight == 0)
        nursery.cancel_scope.cancel()
    for i in range(2):
        assert results[i].text == _expected_text(prompts[i], n_tokens)  # type: ignore[attr-defined]
        assert results[i].completion_tokens == n_tokens  # type: ignore[attr-defined]
    assert len(results[2]) >= 2  # type: ignore[arg-type]
    # The leaver decoded beside the others for a while, then left them to finish alone: it was
    # in far fewer three-wide batches than its 300 tokens would have taken.
    assert 3 in engine.batch_sizes
    assert engine.batch_sizes.count(3) < n_tokens // 2
    assert len(engine.batch_sizes) >= n_tokens
    assert engine.open_decoders == 0
    assert engine.radix_cache is not None and engine.radix_cache.stats().locked_blocks == 0


@pytest.mark.slow
async def test_a_failing_request_gets_an_error_and_its_batch_neighbours_their_answers() -> None:
    gate = threading.Event()
    # '#' poisons a request: the engine's batched decode raises while it is in the batch.
    engine = BatchRecordingEngine(
        max_batch_size=4, gate=gate, prefill_chunk_tokens=256, fail_tokens=frozenset({ord("#")})
    )
    node = Node(_options(), engine=engine)
    prompts = ["fine one", "broken # one", "fine two"]
    outcomes: dict[int, object] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(node.serve)
        addr = node.addresses()[0]

        async def ask(i: int) -> None:
            async with Client.connect(addr) as client:
                try:
                    outcomes[i] = await client.generate(prompts[i], max_tokens=8)
                except EngineError as exc:
                    outcomes[i] = exc

        async with trio.open_nursery() as clients:
            for i in range(3):
                clients.start_soon(ask, i)
            await wait_until(lambda: _handed_over(node) == 3)
            gate.set()
        nursery.cancel_scope.cancel()
    assert isinstance(outcomes[1], EngineError) and "poisoned" in str(outcomes[1])
    for i in (0, 2):
        assert outcomes[i].text == _expected_text(prompts[i], 8)  # type: ignore[attr-defined]
    assert max(engine.batch_sizes) >= 2
    assert engine.open_decoders == 0
