"""KV pulls between real nodes (libp2p on 127.0.0.1, one process; issue 24).

A holder warms a prompt; a puller, asked the same prompt, pulls the holder's KV over
``/peerinfer/kv/1.0.0``, checks a sample by recomputing it, adopts it and serves the request with
those tokens cached. Each test checks what the client got (the tokens of a local recompute, always
an answer) and what the pull did (``KvExchange.outcomes``): pulled and adopted; refused by a
holder that does not trust the puller; caught when the holder alters the bytes (the holder
banned, the request recomputed); recomputed when the holder vanishes or stalls mid-pull.
The puller runs the ``local`` policy with ``kv_pull="always"``: every request is served there,
pulling from the trusted holder with the longest match (the core's baseline mode), so the tests
do not depend on the cost estimates. Every wait is bounded.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from peerinfer.core.kvpull import PullVerifier
from peerinfer.core.messages import (
    ErrorMessage,
    GenerateDone,
    GenerateRequest,
    KvBlocks,
    SamplingParams,
    TokenChunk,
    encode,
)
from peerinfer.core.node import ProbeLink
from peerinfer.engine.base import Engine
from peerinfer.net import FramedStream
from peerinfer.node import Node, NodeOptions
from peerinfer.node.kvpull import PullOutcome
from peerinfer.node.options import KV_PROTOCOL
from peerinfer.testing.inprocess import node_options, open_nodes, wait_until
from peerinfer.types import BlockHash, PeerId

pytestmark = pytest.mark.slow

SWARM_KEY = b"kv-pull-test-swarm"
_ids = itertools.count(1)


def prompt(k: int) -> str:
    return f"question {k}: " + " ".join(f"w{k}x{i}" for i in range(120))


def options(**overrides: Any) -> NodeOptions:
    return node_options(**{
        "policy": "local", "kv_pull": "always", "kv_pull_min_tokens": 16, "swarm_key": SWARM_KEY,
        "audit_rate": 0.0,
        "peer_timeout_s": 4.0, **overrides,
    })


async def ask(node: Node, text: str, max_tokens: int = 8) -> tuple[list[int], GenerateDone]:
    req = GenerateRequest(
        request_id=f"kv-test-{next(_ids)}",
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        prompt=text,
    )
    ids: list[int] = []
    with trio.fail_after(60):
        async with node.submit(req, requester="kv-test", local=True) as events:
            async for ev in events:
                if isinstance(ev, TokenChunk):
                    ids.extend(ev.token_ids)
            final = events.final
    assert not isinstance(final, ErrorMessage), final
    assert isinstance(final, GenerateDone)
    return ids, final


async def holder_seen(puller: Node, holder: Node, tokens: int) -> None:
    """Until the puller's index says the holder caches at least ``tokens`` tokens."""
    assert puller.core is not None

    def seen() -> bool:
        assert puller.core is not None
        return any(
            p.peer_id == holder.peer_id and p.cached_tokens >= tokens
            for p in puller.core.peers(puller.ctx.now())
        )

    await wait_until(seen, timeout=20)


@asynccontextmanager
async def pair(
    holder_opts: NodeOptions, puller_opts: NodeOptions,
    engines: Callable[[int], Engine | None] = lambda i: None,
) -> AsyncIterator[tuple[Node, Node]]:
    made = (holder_opts, puller_opts)

    def make(i: int, bootstrap: tuple[str, ...]) -> Node:
        from dataclasses import replace

        return Node(replace(made[i], bootstrap=bootstrap), engine=engines(i))

    async with open_nodes(2, make) as (holder, puller):
        yield holder, puller


async def warm(holder: Node, puller: Node, text: str) -> tuple[list[int], GenerateDone]:
    ids, done = await ask(holder, text)
    assert done.cached_tokens == 0
    await holder_seen(puller, holder, 64)
    return ids, done


def last_outcome(node: Node) -> PullOutcome:
    assert node.kv.outcomes, "no pull was made"
    return node.kv.outcomes[-1]


async def test_a_pull_serves_the_tokens_of_a_recompute_with_the_prefix_cached() -> None:
    async with pair(options(), options(seed=2)) as (holder, puller):
        text = prompt(1)
        recomputed, _ = await warm(holder, puller, text)
        ids, done = await ask(puller, text)
        outcome = last_outcome(puller)
        assert outcome.ok is True and not outcome.failure and not outcome.refused, outcome
        assert outcome.received > 0 and outcome.checked >= 1
        assert outcome.adopted_tokens >= 64
        assert done.served_by == puller.peer_id
        assert done.cached_tokens >= outcome.adopted_tokens  # the request hit what was pulled
        assert ids == recomputed
        assert puller.core is not None
        assert PeerId(holder.peer_id) not in puller.core.trust.reputation.blocked()
        # The transfer was a bandwidth sample of the link.
        links = puller.core.choice.links
        assert links is not None and links.bandwidth(PeerId(holder.peer_id), puller.ctx.now())


async def test_a_probe_measures_the_link() -> None:
    async with pair(options(), options(seed=2)) as (holder, puller):
        await holder_seen(puller, holder, 0)
        assert puller.core is not None and puller.core.choice.links is not None
        await puller.kv.probe(ProbeLink(PeerId(holder.peer_id), 1 << 20))
        bw = puller.core.choice.links.bandwidth(PeerId(holder.peer_id), puller.ctx.now())
        assert bw is not None and bw > 0


async def test_a_stream_reset_while_widening_the_window_fails_the_probe_not_the_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The window update is a write on the stream: a reset there is a peerinfer error (the
    probe reports nothing), never the muxer's ``StreamReset`` escaping into the node's nursery."""
    from libp2p.network.stream.exceptions import StreamReset

    from peerinfer.errors import PeerUnavailableError
    from peerinfer.net import muxer

    async def reset(net_stream: object, nbytes: int) -> bool:
        raise StreamReset("reset while widening")

    monkeypatch.setattr(muxer, "widen_receive_window", reset)
    async with pair(options(), options(seed=2)) as (holder, puller):
        await holder_seen(puller, holder, 0)
        assert puller.host is not None and puller.core is not None
        with pytest.raises(PeerUnavailableError):
            async with puller.host.streams.use(holder.peer_id, KV_PROTOCOL, timeout=5) as use:
                await use.stream.widen_receive_window(1 << 20)
        await puller.kv.probe(ProbeLink(PeerId(holder.peer_id), 1 << 20))
        links = puller.core.choice.links
        assert links is not None and links.bandwidth(PeerId(holder.peer_id), puller.ctx.now()) is None
        assert not puller.ctx.closing


async def test_in_auto_mode_a_holder_without_a_link_figure_is_probed() -> None:
    """The core asks for a probe (``ProbeLink``) of a holder's link it has no figure for; the
    node fetches the filler and reports the transfer, so the link has a figure after."""
    async with pair(options(), options(policy="cost", kv_pull="auto", seed=2)) as (holder, puller):
        text = prompt(6)
        await warm(holder, puller, text)
        assert puller.core is not None and puller.core.choice.links is not None
        peer = PeerId(holder.peer_id)
        assert puller.core.choice.links.bandwidth(peer, puller.ctx.now()) is None
        await ask(puller, text)
        await wait_until(
            lambda: puller.core.choice.links.bandwidth(peer, puller.ctx.now()) is not None,  # type: ignore[union-attr]
            timeout=10,
        )


async def test_a_holder_bounds_each_peer_s_pull_rate_and_the_format() -> None:
    """Filler requests back to back: the burst is served, the next is refused as busy; a pull
    in another KV format is refused as such. (Each request on its own stream.)"""
    from peerinfer.core.messages import KvPullDone, KvPullRequest, decode
    from peerinfer.node.kvpull import PULL_BURST_PER_PEER

    async with pair(options(), options(seed=2)) as (holder, puller):
        await holder_seen(puller, holder, 0)
        assert puller.host is not None
        answers = []
        for _ in range(PULL_BURST_PER_PEER + 2):
            reply = await puller.host.request(
                holder.peer_id, KV_PROTOCOL, encode(KvPullRequest("", (), 1)), timeout=5
            )
            answers.append(decode(reply, expected=(KvBlocks, KvPullDone)))
        served = [a for a in answers if isinstance(a, KvBlocks)]
        busy = [a for a in answers if isinstance(a, KvPullDone) and a.refused == "busy"]
        # The bucket refills at 2 a second: a slow loop may earn one more.
        assert PULL_BURST_PER_PEER <= len(served) <= PULL_BURST_PER_PEER + 1
        assert len(busy) == len(answers) - len(served) >= 1
        await trio.sleep(1.0)
        reply = await puller.host.request(
            holder.peer_id, KV_PROTOCOL, encode(KvPullRequest("other-format", (1, 2))), timeout=5
        )
        done = decode(reply, expected=KvPullDone)
        assert isinstance(done, KvPullDone) and done.refused == "format"


async def test_a_holder_refuses_a_pull_of_blocks_larger_than_a_frame() -> None:
    """A block that would not fit one frame is refused as "too_large" (before: sent anyway,
    and the puller's frame limit failed the stream)."""
    from peerinfer.core.messages import KvPullDone, KvPullRequest, decode
    from peerinfer.node.kvpull import MAX_KV_BLOCK_BYTES

    async with pair(options(), options(seed=2)) as (holder, puller):
        text = prompt(7)
        await warm(holder, puller, text)
        engine = holder.engine
        assert engine is not None and puller.host is not None
        fmt = engine.kv_format()
        assert fmt is not None
        budgets: list[int | None] = []

        def huge(hashes: list[int], max_bytes: int | None = None) -> list[bytes]:
            budgets.append(max_bytes)
            return [bytes(MAX_KV_BLOCK_BYTES + 1)]

        engine.encode_blocks = huge  # type: ignore[method-assign]
        reply = await puller.host.request(
            holder.peer_id, KV_PROTOCOL, encode(KvPullRequest(fmt, (1, 2))), timeout=10
        )
        done = decode(reply, expected=(KvBlocks, KvPullDone))
        assert isinstance(done, KvPullDone) and done.refused == "too_large", done
        assert budgets and budgets[0] is not None  # the byte cap bounds the encoding too


async def test_a_holder_serves_one_pull_per_peer_at_a_time_each_within_the_pull_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two pulls of one peer at once (two streams): one is served, the other refused as busy,
    so one peer cannot take every serving slot. A serve that outlasts ``PULL_TIMEOUT_S`` is
    ended (its stream reset) and frees its slot."""
    import time

    from peerinfer.core.messages import KvPullDone, KvPullRequest, decode
    from peerinfer.errors import PeerUnavailableError
    from peerinfer.node import kvpull

    async with pair(options(), options(seed=2)) as (holder, puller):
        await holder_seen(puller, holder, 0)
        engine = holder.engine
        assert engine is not None and puller.host is not None
        fmt = engine.kv_format()
        assert fmt is not None
        host = puller.host

        def slow(hashes: list[int], max_bytes: int | None = None) -> list[bytes]:
            time.sleep(1.0)  # the engine thread
            return []

        engine.encode_blocks = slow  # type: ignore[method-assign]
        answers: list[object] = []

        async def pull() -> None:
            reply = await host.request(holder.peer_id, KV_PROTOCOL,
                                       encode(KvPullRequest(fmt, (1, 2))), timeout=10)
            answers.append(decode(reply, expected=(KvBlocks, KvPullDone)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pull)
            nursery.start_soon(pull)
        refused = sorted(a.refused for a in answers if isinstance(a, KvPullDone))
        assert refused == ["", "busy"], answers

        monkeypatch.setattr(kvpull, "PULL_TIMEOUT_S", 0.3)
        await trio.sleep(1.0)  # the rate bucket refills
        with pytest.raises(PeerUnavailableError):
            await host.request(holder.peer_id, KV_PROTOCOL, encode(KvPullRequest(fmt, (1, 2))),
                               timeout=10)
        assert not holder.kv._serving_peers


async def test_the_kv_protocol_is_admitted_like_every_other() -> None:
    """In a private swarm a host without the key gets no KV (nor filler) from a member."""
    from peerinfer.core.messages import KvPullRequest
    from peerinfer.errors import PeerUnavailableError
    from tests.node.test_admission_nodes import raw_host

    async with pair(options(), options(seed=2)) as (holder, puller):
        await holder_seen(puller, holder, 0)
        for outsider_key in (b"a guess", None):
            async with raw_host(outsider_key, None) as outsider:
                with pytest.raises(PeerUnavailableError):
                    await outsider.connect(holder.addresses()[0])
                    await outsider.request(holder.peer_id, KV_PROTOCOL,
                                           encode(KvPullRequest("", (), 1)), timeout=5)
                with pytest.raises(PeerUnavailableError):
                    await outsider.request(holder.peer_id, KV_PROTOCOL,
                                           encode(KvPullRequest("", (), 1)), timeout=5)
        assert holder.ctx.traffic["kv-probe", "sent"] == 0


async def test_a_holder_refuses_a_peer_it_does_not_trust_and_the_request_is_recomputed() -> None:
    # An open swarm: the puller opted in to pulling there, the holder did not.
    holder_opts = options(swarm_key=None)
    puller_opts = options(swarm_key=None, kv_pull_open_swarm=True, seed=2)
    async with pair(holder_opts, puller_opts) as (holder, puller):
        text = prompt(2)
        recomputed, _ = await warm(holder, puller, text)
        ids, done = await ask(puller, text)
        outcome = last_outcome(puller)
        assert outcome.refused.startswith("untrusted"), outcome
        assert outcome.received == 0 and outcome.adopted_tokens == 0
        assert done.served_by == puller.peer_id and done.cached_tokens == 0
        assert ids == recomputed
        # Reported to the core (PullFailed): no pulls from that holder for a while, no ban.
        assert puller.core is not None
        await wait_until(lambda: puller.core.choice.pull_held_off(  # type: ignore[union-attr]
            PeerId(holder.peer_id), puller.ctx.now()), timeout=5)
        assert PeerId(holder.peer_id) not in puller.core.trust.reputation.blocked()


async def test_without_the_open_swarm_opt_in_a_node_never_pulls() -> None:
    async with pair(options(swarm_key=None), options(swarm_key=None, seed=2)) as (holder, puller):
        text = prompt(3)
        recomputed, _ = await warm(holder, puller, text)
        ids, done = await ask(puller, text)
        assert not puller.kv.outcomes
        assert done.cached_tokens == 0 and ids == recomputed


async def test_a_holder_serving_altered_kv_is_caught_banned_and_the_request_answered() -> None:
    async with pair(options(), options(seed=2)) as (holder, puller):
        engine = holder.engine
        assert engine is not None
        honest = engine.encode_block

        def altered(payload: object) -> bytes:
            data = bytearray(honest(payload))
            data[-1] ^= 0x40  # every block: whichever the verifier samples differs
            return bytes(data)

        engine.encode_block = altered  # type: ignore[method-assign]
        text = prompt(4)
        recomputed, _ = await warm(holder, puller, text)
        ids, done = await ask(puller, text)
        outcome = last_outcome(puller)
        assert outcome.ok is False and outcome.failure.startswith("mismatch"), outcome
        assert outcome.adopted_tokens == 0
        assert done.cached_tokens == 0 and ids == recomputed
        assert puller.core is not None
        await wait_until(
            lambda: PeerId(holder.peer_id) in puller.core.trust.reputation.blocked()  # type: ignore[union-attr]
            , timeout=5,
        )


async def test_a_pull_whose_checks_are_turned_off_meanwhile_blames_nobody() -> None:
    """With no verifier left (pulls turned off while the pull ran) nothing judges the holder:
    nothing is adopted, the request is recomputed, and the honest holder is not banned."""
    async with pair(options(), options(seed=2)) as (holder, puller):
        text = prompt(9)
        recomputed, _ = await warm(holder, puller, text)
        assert puller.core is not None
        puller.core.trust.pull_verifier = None
        ids, done = await ask(puller, text)
        outcome = last_outcome(puller)
        assert outcome.failure == "pulls were turned off" and outcome.ok is None, outcome
        assert outcome.adopted_tokens == 0 and done.cached_tokens == 0 and ids == recomputed
        await trio.sleep(0.2)
        assert PeerId(holder.peer_id) not in puller.core.trust.reputation.blocked()


async def test_a_holder_whose_engine_is_busy_a_while_still_serves_the_pull() -> None:
    """The holder's first frame waits for its engine thread (the lock): longer than the 5 s
    between frames, within the first frame's wait, the pull still succeeds."""
    import time

    from peerinfer.node.kvpull import PULL_FIRST_FRAME_TIMEOUT_S, PULL_FRAME_TIMEOUT_S

    async with pair(options(), options(seed=2)) as (holder, puller):
        text = prompt(10)
        recomputed, _ = await warm(holder, puller, text)
        engine = holder.engine
        assert engine is not None
        honest = engine.encode_blocks
        delay = PULL_FRAME_TIMEOUT_S + 1.0
        assert delay < PULL_FIRST_FRAME_TIMEOUT_S

        def busy(hashes: list[int], max_bytes: int | None = None) -> list[bytes]:
            time.sleep(delay)  # the engine thread, as if the lock were held
            return honest(hashes, max_bytes)

        engine.encode_blocks = busy  # type: ignore[method-assign]
        ids, done = await ask(puller, text)
        outcome = last_outcome(puller)
        assert outcome.ok is True and outcome.adopted_tokens >= 64, outcome
        assert ids == recomputed


@pytest.mark.parametrize("how", ["reset", "stall"])
async def test_a_holder_that_vanishes_mid_pull_leaves_the_request_to_a_recompute(how: str) -> None:
    async with pair(options(), options(seed=2)) as (holder, puller):
        text = prompt(5)
        recomputed, _ = await warm(holder, puller, text)
        engine = holder.engine
        assert engine is not None
        block = engine.encode_block(None) if engine.kv_format() else b""

        async def vanishing(stream: FramedStream) -> None:
            await stream.receive()
            await stream.send(encode(KvBlocks((block,))))  # one block of many, then gone
            if how == "reset":
                await stream.reset()
            else:
                await trio.sleep_forever()

        assert holder.host is not None
        holder.host.set_handler(KV_PROTOCOL, vanishing)
        started = trio.current_time()
        ids, done = await ask(puller, text)
        outcome = last_outcome(puller)
        assert outcome.failure and outcome.adopted_tokens == 0, outcome
        assert done.cached_tokens == 0 and ids == recomputed
        assert trio.current_time() - started < 15  # a stalled holder costs one frame timeout


async def test_a_block_of_the_wrong_length_is_refused_as_it_arrives() -> None:
    """The puller does not buffer a block whose length is not the format's: the pull fails on
    that frame (not a frame timeout later), and the request is recomputed."""
    async with pair(options(), options(seed=2)) as (holder, puller):
        text = prompt(8)
        recomputed, _ = await warm(holder, puller, text)
        engine = holder.engine
        assert engine is not None
        block = engine.encode_block(None) + b"extra"

        async def padded(stream: FramedStream) -> None:
            await stream.receive()
            await stream.send(encode(KvBlocks((block,))))
            await trio.sleep_forever()

        assert holder.host is not None
        holder.host.set_handler(KV_PROTOCOL, padded)
        started = trio.current_time()
        ids, done = await ask(puller, text)
        outcome = last_outcome(puller)
        assert "the format's are" in outcome.failure, outcome
        assert outcome.adopted_tokens == 0 and done.cached_tokens == 0 and ids == recomputed
        assert trio.current_time() - started < 4  # not the 5 s frame timeout


# --------------------------------------------------------------------------------------------
# A real model: a tiny Transformers model, the same weights on both nodes.

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from tests.engine.test_engine_hf import _make_tiny_model

    directory: Path = tmp_path_factory.mktemp("tiny-llama-pull")
    _make_tiny_model(directory)
    return directory


async def test_a_pull_between_transformers_nodes_gives_the_greedy_tokens_of_a_recompute(
    tiny_model_dir: Path,
) -> None:
    from peerinfer.engine.hf import TransformersEngine

    engines = [TransformersEngine(tiny_model_dir, device="cpu") for _ in range(2)]
    try:
        async with pair(
            options(engine="hf"), options(engine="hf", seed=2), engines=lambda i: engines[i]
        ) as (holder, puller):
            text = "the quick brown fox jumps over the lazy dog " * 3  # ~130 of 160 tokens
            recomputed, _ = await warm(holder, puller, text)
            ids, done = await ask(puller, text)
            outcome = last_outcome(puller)
            assert outcome.ok is True and outcome.adopted_tokens >= 64, outcome
            assert done.cached_tokens >= outcome.adopted_tokens
            assert ids == recomputed and len(ids) == 8
    finally:
        for e in engines:
            e.close()


def _check_every_block(node: Node) -> None:
    """Give ``node``'s core a verifier that samples one run in every pulled block (at the
    default rate a given block is sampled with probability rate * 16 / run, docs/security.md):
    a holder altering one block is then caught at its first pull, whichever block it is."""
    assert node.core is not None and node.engine is not None
    run = node.engine.verify_run_tokens
    node.core.trust.pull_verifier = PullVerifier(f"every-block/{node.peer_id}", rate=run / 16)


def _alter_one_block(engine: Engine, alter: Callable[[bytes], bytes]) -> None:
    """Make ``engine`` a liar that alters ONE block of every pull it serves (the second, or
    the only one), every token of it, and serves the rest honestly."""
    honest = engine.encode_blocks

    def encode_blocks(hashes: Sequence[BlockHash], max_bytes: int | None = None) -> list[bytes]:
        blocks = honest(hashes, max_bytes)
        if blocks:
            i = min(1, len(blocks) - 1)
            blocks[i] = alter(blocks[i])
        return blocks

    engine.encode_blocks = encode_blocks  # type: ignore[method-assign]


async def test_a_transformers_holder_altering_one_block_is_caught(tiny_model_dir: Path) -> None:
    """The default verifier checks a token or two of every block: a holder that alters one
    whole block of each pull is caught at its first, and the request is recomputed."""
    import torch

    from peerinfer.engine.hf import TransformersEngine

    engines = [TransformersEngine(tiny_model_dir, device="cpu") for _ in range(2)]
    holder_engine = engines[0]

    def alter(block: bytes) -> bytes:
        kv = holder_engine.decode_block(block, 0).payload
        return holder_engine.encode_block(kv + 0.5 * torch.sign(kv))

    _alter_one_block(holder_engine, alter)
    try:
        async with pair(
            options(engine="hf"), options(engine="hf", seed=2), engines=lambda i: engines[i]
        ) as (holder, puller):
            text = "the quick brown fox jumps over the lazy dog " * 3
            recomputed, _ = await warm(holder, puller, text)
            _check_every_block(puller)
            ids, done = await ask(puller, text)
            outcome = last_outcome(puller)
            assert outcome.ok is False and outcome.failure.startswith("mismatch"), outcome
            assert outcome.adopted_tokens == 0 and outcome.checked >= outcome.received
            assert done.cached_tokens == 0 and ids == recomputed
            assert puller.core is not None
            await wait_until(
                lambda: PeerId(holder.peer_id) in puller.core.trust.reputation.blocked()  # type: ignore[union-attr]
                , timeout=5,
            )
    finally:
        for e in engines:
            e.close()


# --------------------------------------------------------------------------------------------
# llama.cpp: the real SmolLM2 GGUF on both nodes; the puller checks a sample by recomputing it.


def short_prompt(k: int) -> str:
    """A prompt of some 150 tokens: it fits the 256-cell streams of a 96 MiB llama.cpp budget."""
    return f"question {k}: " + " ".join(f"w{k}x{i}" for i in range(30))


async def test_a_pull_between_llamacpp_nodes_gives_the_greedy_tokens_of_a_recompute() -> None:
    pytest.importorskip("llama_cpp")
    from peerinfer.engine.llamacpp import LlamaCppEngine

    engines = [
        LlamaCppEngine(threads=1, capacity_bytes=96 << 20, extra_buffers=False) for _ in range(2)
    ]
    try:
        async with pair(
            options(engine="llamacpp"),
            options(engine="llamacpp", seed=2),
            engines=lambda i: engines[i],
        ) as (holder, puller):
            text = short_prompt(3)
            recomputed, _ = await warm(holder, puller, text)
            ids, done = await ask(puller, text)
            outcome = last_outcome(puller)
            assert outcome.ok is True and outcome.adopted_tokens >= 64, outcome
            assert outcome.checked >= 1
            assert done.served_by == puller.peer_id
            assert done.cached_tokens >= outcome.adopted_tokens
            assert ids == recomputed and len(ids) == 8
            assert puller.core is not None
            assert PeerId(holder.peer_id) not in puller.core.trust.reputation.blocked()
    finally:
        for e in engines:
            e.close()


async def test_a_llamacpp_holder_serving_altered_kv_is_caught_and_the_request_answered() -> None:
    pytest.importorskip("llama_cpp")
    import numpy as np

    from peerinfer.engine.llamacpp import LlamaCppEngine

    engines = [
        LlamaCppEngine(threads=1, capacity_bytes=96 << 20, extra_buffers=False) for _ in range(2)
    ]
    from peerinfer.engine import llamacpp_state as llstate

    def alter(block: bytes) -> bytes:
        # Every cell's K values of every layer moved by 2 (float16), in place of the bytes.
        raw = bytearray(block)
        section = llstate.parse(raw).sections[0]
        assert section is not None
        for k in section.k:
            values = k.data.view("<f2")
            values[...] = (values.astype(np.float32) + 2.0).astype("<f2")
        return bytes(raw)

    _alter_one_block(engines[0], alter)
    try:
        async with pair(
            options(engine="llamacpp"), options(engine="llamacpp", seed=2),
            engines=lambda i: engines[i],
        ) as (holder, puller):
            text = short_prompt(5)
            recomputed, _ = await warm(holder, puller, text)
            _check_every_block(puller)
            ids, done = await ask(puller, text)
            outcome = last_outcome(puller)
            assert outcome.ok is False and outcome.failure.startswith("mismatch"), outcome
            assert outcome.adopted_tokens == 0 and outcome.checked >= 1
            assert done.cached_tokens == 0 and ids == recomputed
            assert puller.core is not None
            await wait_until(
                lambda: PeerId(holder.peer_id) in puller.core.trust.reputation.blocked()  # type: ignore[union-attr]
                , timeout=5,
            )
    finally:
        for e in engines:
            e.close()
