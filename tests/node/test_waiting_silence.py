"""A request's silence counts only while it is served, never while it waits its turn.

The core decides (``NodeCore.silence``, driven by hand below); the door acts on it (a node's
``submit`` in virtual time: trio's MockClock, the core fed by hand in place of the engine
worker, so minutes of waiting take milliseconds). A flooder's preempted generation and an
honest request behind a long queue wait as long as their turn takes, told they are still
there by heartbeats; a request whose engine stalls still ends with a clear timeout.
"""

from __future__ import annotations

import itertools
import random
import types
from collections.abc import Callable

import trio
import trio.testing

from peerinfer.core.costmodel import CostModel
from peerinfer.core.messages import (
    ErrorMessage,
    GenerateDone,
    GenerateRequest,
    Message,
    SamplingParams,
    TokenChunk,
)
from peerinfer.core.node import (
    AnnounceReceived,
    CacheChanged,
    ClientRequest,
    Forward,
    ForwardFirstToken,
    LocalFinished,
    LocalPreempted,
    NodeConfig,
    NodeCore,
    PeerSeen,
    Phase,
    Publish,
)
from peerinfer.core.prefix import PrefixHasher
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.node import Node, NodeOptions
from peerinfer.node.door import WAITING_HEARTBEAT_S
from peerinfer.node.options import TOKEN_GAP_TIMEOUT_S
from peerinfer.types import PeerId, RequestId

GAP = TOKEN_GAP_TIMEOUT_S
COSTS = CostModel(prefill_s_per_token=0.0002, cached_s_per_token=0.00001,
                  decode_s_per_token=0.01, overhead_s=0.002, slots=1)
PARAMS = SamplingParams(max_tokens=1000)


def core_with(slots: int = 1, **config: object) -> NodeCore:
    cfg = NodeConfig(peer_id=PeerId("A"), policy="longest_prefix",
                     costs=COSTS.with_slots(slots), preempt_after_tokens=2,
                     token_gap_timeout_s=GAP, **config)  # type: ignore[arg-type]
    return NodeCore(cfg, PrefixHasher(b"silence-model"), rng=random.Random(0), now=0.0)


def ask(core: NodeCore, rid: str, requester: str, now: float, tokens: tuple[int, ...] = (1, 2, 3)) -> None:
    core.handle(ClientRequest(RequestId(rid), tokens, PARAMS, requester=requester), now)


# ------------------------------------------------------------------------------ the core decides


def test_running_counts_from_its_last_event_or_its_restart() -> None:
    core = core_with()
    ask(core, "a", "x", now=10.0)
    assert core.phase(RequestId("a")) is Phase.RUNNING
    s = core.silence(RequestId("a"), last_event=10.0, engine_progress=500.0)
    assert s.deadline == 10.0 + GAP and not s.waiting  # engine progress is no excuse
    assert core.silence(RequestId("a"), last_event=50.0, engine_progress=0.0).deadline == 50.0 + GAP
    # Not held (ending): its last event counts.
    assert core.silence(RequestId("gone"), last_event=7.0, engine_progress=0.0).deadline == 7.0 + GAP


def test_waiting_lasts_while_the_engine_moves() -> None:
    core = core_with()
    ask(core, "a", "x", now=0.0)
    ask(core, "b", "y", now=1.0)
    assert core.phase(RequestId("b")) is Phase.QUEUED
    s = core.silence(RequestId("b"), last_event=1.0, engine_progress=1000.0)
    assert s.waiting and s.deadline == 1000.0 + GAP
    stalled = core.silence(RequestId("b"), last_event=1.0, engine_progress=0.5)
    assert stalled.deadline == 1.0 + GAP and "no progress" in stalled.message
    # "a" is asked to yield; once it does it waits (PREEMPTED) and "b" runs.
    core.handle(LocalPreempted(RequestId("a"), generated=2), 30.0)
    assert core.phase(RequestId("a")) is Phase.PREEMPTED
    assert core.phase(RequestId("b")) is Phase.RUNNING
    a = core.silence(RequestId("a"), last_event=29.0, engine_progress=400.0)
    assert a.waiting and a.deadline == 400.0 + GAP and "preempted" in a.message
    # "b" runs since 30: its silence counts from there, not from its last event in the queue.
    b = core.silence(RequestId("b"), last_event=1.0, engine_progress=400.0)
    assert not b.waiting and b.deadline == 30.0 + GAP
    # "b" ends, "a" resumes at 200: its silence counts again, from its resumption.
    core.handle(LocalFinished(RequestId("b"), ok=True, generated=3), 200.0)
    assert core.phase(RequestId("a")) is Phase.RUNNING
    assert core.silence(RequestId("a"), last_event=29.0, engine_progress=400.0).deadline == 200.0 + GAP


def test_forwarded_requests_are_bounded_by_the_forward_first() -> None:
    core = core_with()
    hasher = core.hasher
    shared = tuple(range(1, 257))
    b = NodeCore(NodeConfig(peer_id=PeerId("B"), policy="local"), hasher, rng=random.Random(1))
    announced = b.handle(CacheChanged(added=tuple(hasher.chain(shared))), 0.0) + b.tick(0.0)
    core.handle(PeerSeen(PeerId("B"), rtt_s=0.001), 0.0)
    for e in announced:
        if isinstance(e, Publish):
            core.handle(AnnounceReceived(PeerId("B"), e.announce), 0.0)
    effects = core.handle(ClientRequest(RequestId("f"), shared + (9, 9), PARAMS, requester="z"), 5.0)
    assert [e.peer for e in effects if isinstance(e, Forward)] == [PeerId("B")]
    s = core.silence(RequestId("f"), last_event=5.0, engine_progress=0.0)
    # Twice the gap: the forward's own deadlines (first token, token gap) fail over first.
    assert not s.waiting and s.deadline == 5.0 + 2 * GAP
    core.handle(ForwardFirstToken(RequestId("f"), PeerId("B")), 8.0)
    assert core.silence(RequestId("f"), last_event=8.5, engine_progress=0.0).deadline == 8.5 + 2 * GAP


# ------------------------------------------------------------------------------ the door acts


class _Harness:
    """A node whose core is fed by hand in place of its engine worker, in virtual time."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.node = Node(NodeOptions(engine="simulated", persist_identity=False, mdns=False),
                         engine=SimulatedEngine(costs=COSTS))
        async def publish(topic: str, data: bytes) -> None:  # announcements go nowhere
            return None

        self.node.ctx.host = types.SimpleNamespace(peer_id="A", publish=publish)  # type: ignore[assignment]
        self.node.ctx.core = core_with()
        self.node.ctx.nursery = nursery
        self.events: dict[str, list[tuple[float, Message]]] = {}

    async def client(self, rid: str, requester: str) -> None:
        got = self.events.setdefault(rid, [])
        req = GenerateRequest(request_id=rid, params=PARAMS, tokens=(1, 2, 3))
        async with self.node.submit(req, requester=requester, local=False) as events:
            async for ev in events:
                got.append((trio.current_time(), ev))

    def rid(self, requester: str, rid: str) -> RequestId:
        return RequestId(f"{requester}/{rid}")

    def step(self, requester: str, rid: str, n: int = 1) -> None:
        """One engine step of a running request: ``n`` tokens, and the engine moved."""
        sinks = self.node.ctx.sinks
        sink = sinks.get(self.rid(requester, rid))
        assert sink is not None
        sinks.relay_tokens(sink, [7] * n, "x" * n)
        self.node.ctx.engine_progress_at = trio.current_time()

    def finish(self, requester: str, rid: str) -> None:
        sinks = self.node.ctx.sinks
        sink = sinks.get(self.rid(requester, rid))
        assert sink is not None
        self.node.ctx.feed(LocalFinished(self.rid(requester, rid), ok=True, generated=1))
        sinks.finish(sink, GenerateDone(
            request_id=sink.request_id, prompt_tokens=3, completion_tokens=len(sink.completion_ids),
            cached_tokens=0, served_by="A", ttft_s=0.0, latency_s=0.0, finish_reason="length"))

    def phase(self, requester: str, rid: str) -> Phase | None:
        assert self.node.core is not None
        return self.node.core.phase(self.rid(requester, rid))


def run_virtual(body: Callable[[_Harness], object]) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            harness = _Harness(nursery)
            await body(harness)  # type: ignore[misc]
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def kinds(events: list[tuple[float, Message]]) -> list[str]:
    out = []
    for _, ev in events:
        if isinstance(ev, TokenChunk):
            out.append("beat" if not ev.token_ids and not ev.text else "token")
        else:
            out.append(type(ev).__name__)
    return out


def test_a_preempted_generation_and_a_queued_request_outwait_the_gap() -> None:
    """The flooder's generation is preempted for over twice the gap while the honest request
    runs (and waited before that); neither times out, both are served in full."""

    async def body(h: _Harness) -> None:
        async with trio.open_nursery() as clients:
            clients.start_soon(h.client, "f1", "flooder")
            await trio.sleep(0.1)
            assert h.phase("flooder", "f1") is Phase.RUNNING
            clients.start_soon(h.client, "h1", "honest")
            await trio.sleep(0.1)
            assert h.phase("honest", "h1") is Phase.QUEUED
            # The flooder streams for three gaps while the honest request waits (no yield
            # yet: the engine worker is this test).
            for _ in range(int(3 * GAP / 10)):
                h.step("flooder", "f1")
                await trio.sleep(10)
            assert h.phase("honest", "h1") is Phase.QUEUED
            # The flooder yields; the honest request runs for three gaps more.
            h.node.ctx.feed(LocalPreempted(h.rid("flooder", "f1"), generated=2))
            assert h.phase("flooder", "f1") is Phase.PREEMPTED
            assert h.phase("honest", "h1") is Phase.RUNNING
            for _ in range(int(3 * GAP / 10)):
                h.step("honest", "h1")
                await trio.sleep(10)
            h.finish("honest", "h1")
            await trio.sleep(0.1)
            assert h.phase("flooder", "f1") is Phase.RUNNING  # resumed
            h.step("flooder", "f1")
            await trio.sleep(1)
            h.finish("flooder", "f1")

        honest, flood = kinds(h.events["h1"]), kinds(h.events["f1"])
        assert honest[-1] == "GenerateDone" and "ErrorMessage" not in honest
        assert flood[-1] == "GenerateDone" and "ErrorMessage" not in flood
        # While it waited, each was told it is still there, every WAITING_HEARTBEAT_S.
        expected_beats = int(3 * GAP / WAITING_HEARTBEAT_S) - 1
        assert honest.count("beat") >= expected_beats
        assert flood.count("beat") >= expected_beats
        beats = [t for t, ev in h.events["f1"] if isinstance(ev, TokenChunk) and not ev.text]
        assert all(b - a <= WAITING_HEARTBEAT_S + 1e-6 for a, b in itertools.pairwise(beats))
        assert flood.count("token") == int(3 * GAP / 10) + 1

    run_virtual(body)


def test_a_running_request_without_tokens_times_out_after_the_gap() -> None:
    async def body(h: _Harness) -> None:
        start = trio.current_time()
        await h.client("r1", "x")
        ends = h.events["r1"]
        assert kinds(ends) == ["ErrorMessage"]
        at, err = ends[-1]
        assert isinstance(err, ErrorMessage) and err.code == "timeout"
        assert "while running" in err.message
        assert GAP <= at - start <= GAP + 1

    run_virtual(body)


def test_a_waiting_request_ends_once_the_engine_stops_moving() -> None:
    """The slot's holder streams for a while, then the engine stalls: the waiting request
    ends with a timeout that says so, one gap after the engine's last step."""

    async def body(h: _Harness) -> None:
        async with trio.open_nursery() as clients:
            clients.start_soon(h.client, "s1", "x")
            await trio.sleep(0.1)
            clients.start_soon(h.client, "w1", "y")
            await trio.sleep(0.1)
            for _ in range(20):  # 200 s of progress: beyond one gap
                h.step("x", "s1")
                await trio.sleep(10)
            last_step = h.node.ctx.engine_progress_at
            assert h.phase("y", "w1") is Phase.QUEUED
        waited = kinds(h.events["w1"])
        assert waited[-1] == "ErrorMessage" and set(waited[:-1]) == {"beat"}
        at, err = h.events["w1"][-1]
        assert isinstance(err, ErrorMessage) and err.code == "timeout"
        assert "no progress" in err.message
        assert GAP <= at - last_step <= GAP + 1
        # The stalled holder itself times out one gap after its last token.
        assert kinds(h.events["s1"])[-1] == "ErrorMessage"

    run_virtual(body)
