"""The request lifecycle's phases and the fair share of the local engine, driven by hand."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from peerinfer.core.costmodel import DEFAULT_COSTS
from peerinfer.core.messages import Load, SamplingParams
from peerinfer.core.node import (
    _TRANSITIONS,
    AnnounceReceived,
    CacheChanged,
    Cancel,
    CancelLocal,
    ClientRequest,
    Effect,
    Forward,
    ForwardFailed,
    ForwardFinished,
    ForwardFirstToken,
    LocalFinished,
    LocalPreempted,
    NodeConfig,
    NodeCore,
    PeerSeen,
    Phase,
    PreemptLocal,
    Publish,
    Reject,
    ResumeLocal,
    RunLocal,
)
from peerinfer.core.prefix import PrefixHasher
from peerinfer.types import PeerId, RequestId

HASHER = PrefixHasher(b"fair-model")
PARAMS = SamplingParams(max_tokens=4)


def make(slots: int = 1, **config: object) -> NodeCore:
    cfg = NodeConfig(peer_id=PeerId("A"), policy="longest_prefix",
                     costs=DEFAULT_COSTS.with_slots(slots), **config)  # type: ignore[arg-type]
    return NodeCore(cfg, HASHER, rng=random.Random(0), now=0.0)


def prompt(seed: int, n: int = 64) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1, 30000) for _ in range(n))


def started(effects: Sequence[Effect]) -> list[str]:
    return [e.request_id for e in effects if isinstance(e, RunLocal)]


def send(core: NodeCore, rid: str, requester: str, *, local: bool = False,
         tokens: tuple[int, ...] | None = None, params: SamplingParams = PARAMS) -> list[Effect]:
    effects = core.handle(
        ClientRequest(RequestId(rid), tokens or prompt(hash(rid) % 1000), params,
                      requester=requester, local=local),
        0.0,
    )
    core.check_invariants()
    return effects


def finish(core: NodeCore, rid: str) -> list[str]:
    effects = core.handle(LocalFinished(RequestId(rid), ok=True), 1.0)
    core.check_invariants()
    return started(effects)


def with_peer_holding(core: NodeCore, tokens: tuple[int, ...]) -> PeerId:
    """Make peer B a routing candidate that holds ``tokens``."""
    b = NodeCore(NodeConfig(peer_id=PeerId("B"), policy="local"), HASHER, rng=random.Random(1))
    effects = b.handle(CacheChanged(added=tuple(HASHER.chain(tokens))), 0.0) + b.tick(0.0)
    core.handle(PeerSeen(PeerId("B"), rtt_s=0.001), 0.0)
    for e in effects:
        if isinstance(e, Publish):
            core.handle(AnnounceReceived(PeerId("B"), e.announce), 0.0)
    return PeerId("B")


def test_the_transition_table_is_closed_and_done_is_final() -> None:
    assert set(_TRANSITIONS) == set(Phase)
    assert all(set(nxt) <= set(Phase) for nxt in _TRANSITIONS.values())
    assert _TRANSITIONS[Phase.DONE] == {}
    assert Phase.FORWARDED not in _TRANSITIONS[Phase.QUEUED]  # nothing local is forwarded


def test_phases_follow_a_request_here_and_through_a_peer() -> None:
    a = make()
    send(a, "l1", "c")
    send(a, "l2", "c")
    assert (a.phase(RequestId("l1")), a.phase(RequestId("l2"))) == (Phase.RUNNING, Phase.QUEUED)
    assert finish(a, "l1") == ["l2"]
    assert a.phase(RequestId("l1")) is None and a.phase(RequestId("l2")) is Phase.RUNNING
    shared = prompt(7, 256)
    b = with_peer_holding(a, shared)
    rid = RequestId("f")
    assert [e.peer for e in send(a, rid, "c", tokens=shared + prompt(8, 16))
            if isinstance(e, Forward)] == [b]
    assert a.phase(rid) is Phase.FORWARDED
    a.handle(ForwardFirstToken(rid, b), 0.1)
    assert a.phase(rid) is Phase.RELAYING
    a.check_invariants()
    a.handle(ForwardFinished(rid, b), 0.2)
    assert a.phase(rid) is None
    a.check_invariants()
    assert a.statistics().completed == 2


def test_a_move_not_in_the_table_is_a_bug() -> None:
    a = make()
    send(a, "r", "c")
    req = a.requests.get(RequestId("r"))
    assert req is not None
    with pytest.raises(AssertionError, match="no transition from running to queued"):
        a.requests.transition(req, Phase.QUEUED)
    forwarded = ClientRequest(RequestId("p/1"), prompt(2), PARAMS, forwarded=True,
                              origin=PeerId("P"))
    a.handle(forwarded, 0.0)
    with pytest.raises(AssertionError, match="from queued to forwarded"):
        held = a.requests.get(RequestId("p/1"))
        assert held is not None
        a.requests.transition(held, Phase.FORWARDED, target=PeerId("B"))


def yields(effects: Sequence[Effect]) -> list[str]:
    return [e.request_id for e in effects if isinstance(e, PreemptLocal)]


def resumes(effects: Sequence[Effect]) -> list[str]:
    return [e.request_id for e in effects if isinstance(e, ResumeLocal)]


def busy(effects: Sequence[Effect]) -> list[Reject]:
    return [e for e in effects if isinstance(e, Reject) and e.code == "busy"]


def preempted(core: NodeCore, rid: str, generated: int = 40) -> list[Effect]:
    effects = core.handle(LocalPreempted(RequestId(rid), generated), 1.0)
    core.check_invariants()
    return effects


def test_an_honest_requester_is_next_despite_a_flood() -> None:
    """Issue 11's attack at the core: 32 maximal requests from one peer on a 4-slot node,
    without preemption: the flooder's queue is bounded, and a freed slot goes to the honest."""
    size = 4096
    a = make(slots=4, max_prompt_tokens=size, max_new_tokens=4096, max_queued_per_peer=None)
    big = SamplingParams(max_tokens=4096)
    flood = [f"x{i}" for i in range(32)]
    runs, refused = [], []
    for rid in flood:
        effects = send(a, rid, "flooder", tokens=prompt(int(rid[1:]), size), params=big)
        runs += started(effects)
        refused += busy(effects)
    # At most twice the slots admitted (running plus waiting); the rest refused with a hint.
    assert runs == flood[:4]
    assert a.load() == Load(queued=4, running=4, slots=4)
    assert len(refused) == 24
    assert all("max_queued_per_peer 4" in r.message and "retry in about" in r.message
               and r.retry_after_s >= 1.0 for r in refused)
    assert not started(send(a, "h1", "honest-1"))
    assert not started(send(a, "h2", "honest-2"))
    # One free slot each: the honest requesters go first, before any more of the flood.
    assert finish(a, "x0") == ["h1"]
    assert finish(a, "x1") == ["h2"]
    assert finish(a, "x2") == ["x4"]
    # A requester that already runs its share yields to one with nothing running ...
    assert not started(send(a, "h1b", "honest-1"))
    assert not started(send(a, "h3", "honest-3"))
    assert finish(a, "x3") == ["h3"]
    assert finish(a, "h2") == ["h1b"]


def test_a_flooder_over_its_share_yields_a_slot_and_resumes_later() -> None:
    """Issue 21: the flood keeps every slot busy with endless generations; with preemption the
    honest request gets a slot as soon as the flooder's longest-running one has made its
    quantum of tokens, and the flooder's preempted generation resumes, never dropped."""
    a = make(slots=4, max_new_tokens=65536, preempt_after_tokens=16, max_queued_per_peer=None)
    endless = SamplingParams(max_tokens=65536)
    for i in range(8):
        send(a, f"x{i}", "flooder", params=endless)
    assert a.load().running == 4 and a.load().queued == 4
    arrival = send(a, "h", "honest")
    # Not started yet: the slot it is entitled to is being freed by the oldest flood request.
    assert not started(arrival) and yields(arrival) == ["x0"]
    assert [e.after_tokens for e in arrival if isinstance(e, PreemptLocal)] == [16]
    assert a.phase(RequestId("x0")) is Phase.RUNNING  # until the engine says it yielded
    # Another event before the yield asks for no second one.
    assert not yields(send(a, "x8", "flooder", params=endless))  # refused: its queue is full
    assert started(preempted(a, "x0")) == ["h"]
    assert a.phase(RequestId("x0")) is Phase.PREEMPTED
    assert a.statistics().preempted == 1
    # The honest peer runs, so the flooder may use the other slots (nobody else waits).
    honest_2 = send(a, "h2", "honest-2")
    # Three requesters: entitled to 4/3 each; the flooder runs 3: its next-oldest yields.
    assert yields(honest_2) == ["x1"]
    assert started(preempted(a, "x1")) == ["h2"]
    # Both honest requests end: the preempted generations resume first, oldest first.
    assert resumes(a.handle(LocalFinished(RequestId("h"), ok=True, generated=4), 2.0)) == ["x0"]
    a.check_invariants()
    assert resumes(a.handle(LocalFinished(RequestId("h2"), ok=True, generated=4), 2.0)) == ["x1"]
    a.check_invariants()
    assert a.statistics().resumed == 2
    assert {a.phase(RequestId(f"x{i}")) for i in range(4)} == {Phase.RUNNING}


def test_local_clients_come_first_but_cannot_keep_every_slot() -> None:
    a = make(slots=4, preempt_after_tokens=8)
    for i in range(8):
        send(a, f"l{i}", "http:key-a", local=True)
    assert a.load().running == 4
    # A remote requester waits: the local one (weight 2 of 3: 2.67 slots) gives one back.
    assert yields(send(a, "p", "peer")) == ["l0"]
    assert started(preempted(a, "l0")) == ["p"]
    # The remote request ends: the local requester gets every slot again.
    assert resumes(a.handle(LocalFinished(RequestId("p"), ok=True), 1.0)) == ["l0"]


def test_a_generation_that_ends_before_yielding_frees_its_slot_as_usual() -> None:
    a = make(slots=1, preempt_after_tokens=32)
    send(a, "x", "flooder")
    assert yields(send(a, "h", "honest")) == ["x"]
    # It reached its end first: the engine reports LocalFinished, not LocalPreempted.
    assert finish(a, "x") == ["h"]
    assert preempted(a, "x") == []  # a late report for a request gone: ignored
    assert a.statistics().preempted == 0


def test_a_preempted_request_cancelled_ends_through_the_engine() -> None:
    a = make(slots=1, preempt_after_tokens=4)
    send(a, "x", "flooder")
    send(a, "h", "honest")
    preempted(a, "x")
    cancel = a.handle(Cancel(RequestId("x")), 1.0)
    assert [type(e) for e in cancel] == [CancelLocal]  # the engine holds its state
    assert a.phase(RequestId("x")) is Phase.PREEMPTED
    a.handle(LocalFinished(RequestId("x"), ok=False, error="cancelled"), 1.0)
    a.check_invariants()
    assert a.phase(RequestId("x")) is None and a.phase(RequestId("h")) is Phase.RUNNING


def test_one_slot_is_time_sliced_between_two_requesters() -> None:
    """More requesters than slots: each runs a quantum of tokens in turn."""
    a = make(slots=1, preempt_after_tokens=8)
    send(a, "x", "one")
    assert yields(send(a, "y", "two")) == ["x"]
    order = []
    running = "x"
    for _ in range(4):
        effects = preempted(a, running, generated=8)
        (nxt,) = started(effects) + resumes(effects)
        assert yields(effects) == [nxt]  # the other one waits: it yields after its quantum
        order.append(nxt)
        running = nxt
    assert order == ["y", "x", "y", "x"]
    assert a.statistics().preempted == 4 and a.statistics().resumed == 3


def test_turns_follow_the_tokens_served() -> None:
    """Among requesters below their share, the one served the fewest tokens goes first."""
    a = make(slots=1)
    send(a, "a1", "a")
    send(a, "a2", "a")
    send(a, "b1", "b")
    send(a, "c1", "c")
    a.handle(LocalFinished(RequestId("a1"), ok=True, generated=500), 1.0)  # b1 starts
    a.check_invariants()
    a.handle(LocalFinished(RequestId("b1"), ok=True, generated=10), 1.0)  # c1 (b left)
    a.check_invariants()
    send(a, "b2", "b")  # b comes back: its counter starts at the least one here (a's or c's)
    assert a.handle(LocalFinished(RequestId("c1"), ok=True, generated=10), 1.0)
    a.check_invariants()
    assert a.phase(RequestId("b2")) is Phase.RUNNING  # a was served 500 tokens, b 0


def test_equal_requesters_take_turns() -> None:
    a = make(slots=1, max_queued_per_peer=4)
    assert started(send(a, "x1", "x")) == ["x1"]
    for rid, who in [("x2", "x"), ("x3", "x"), ("y1", "y"), ("y2", "y"), ("z1", "z")]:
        assert not started(send(a, rid, who))
    order = []
    running = "x1"
    for _ in range(5):
        (running,) = finish(a, running)
        order.append(running)
    assert order == ["y1", "z1", "x2", "y2", "x3"]


def test_the_nodes_own_front_ends_go_first() -> None:
    a = make(slots=1)
    send(a, "p1", "peer")
    send(a, "p2", "peer")
    send(a, "o1", "other")
    send(a, "h1", "http", local=True)
    assert finish(a, "p1") == ["h1"]
    assert finish(a, "h1") == ["o1"]


def test_a_requester_over_its_share_is_refused_as_busy() -> None:
    a = make(slots=1, max_queued_per_peer=2, hard_max_queue=6)
    for rid in ("f1", "f2", "f3"):
        assert not [e for e in send(a, rid, "flooder") if isinstance(e, Reject)]
    refused = [e for e in send(a, "f4", "flooder") if isinstance(e, Reject)]
    assert [r.code for r in refused] == ["busy"]
    assert "flooder" in refused[0].message and "max_queued_per_peer 2" in refused[0].message
    assert not [e for e in send(a, "o1", "other") if isinstance(e, Reject)]
    # This node's own callers and front ends answer only to the node-wide limit.
    for rid in ("s1", "s2", "s3"):
        assert not [e for e in send(a, rid, "") if isinstance(e, Reject)]
    full = [e for e in send(a, "s4", "") if isinstance(e, Reject)]
    assert [r.message.split(";")[0] for r in full] == ["the local queue is full (hard_max_queue 6)"]
    stats = a.statistics()
    assert stats.rejected == 2 and stats.queued == 6 and stats.running == 1


def test_per_request_limits_are_refused_as_invalid_naming_the_limit() -> None:
    a = make(max_prompt_tokens=100, max_new_tokens=16)
    long = [e for e in send(a, "l", "c", tokens=prompt(1, 101)) if isinstance(e, Reject)]
    assert [r.code for r in long] == ["invalid"]
    assert "101 tokens" in long[0].message and "max_prompt_tokens of 100" in long[0].message
    many = send(a, "m", "c", params=SamplingParams(max_tokens=17))
    assert [(e.code, "max_new_tokens of 16" in e.message) for e in many
            if isinstance(e, Reject)] == [("invalid", True)]
    fwd = a.handle(ClientRequest(RequestId("p/1"), prompt(2, 101), PARAMS, forwarded=True,
                                 origin=PeerId("P")), 0.0)
    assert [e.code for e in fwd if isinstance(e, Reject)] == ["invalid"]
    assert started(send(a, "ok", "c", tokens=prompt(3, 100),
                        params=SamplingParams(max_tokens=16))) == ["ok"]
    with pytest.raises(Exception, match="max_new_tokens"):
        NodeConfig(peer_id=PeerId("A"), max_new_tokens=0)


def test_a_relayed_stream_that_fails_without_new_tokens_still_resumes_here() -> None:
    a = make(slots=2)
    shared = prompt(7, 256)
    b = with_peer_holding(a, shared)
    rid = RequestId("f")
    tokens = shared + prompt(8, 16)
    assert [e.peer for e in send(a, rid, "c", tokens=tokens) if isinstance(e, Forward)] == [b]
    a.handle(ForwardFirstToken(rid, b), 0.1)
    effects = a.handle(ForwardFailed(rid, b, "busy"), 0.2)
    a.check_invariants()
    assert not [e for e in effects if isinstance(e, Forward)]
    assert started(effects) == [rid]


def test_the_load_announced_carries_the_capacity() -> None:
    a = make(slots=3)
    for i in range(5):
        send(a, f"r{i}", "c")
    assert a.load() == Load(queued=2, running=3, slots=3)
    published = [e for e in a.tick(5.0) if isinstance(e, Publish)]
    assert published and published[-1].announce.load == Load(queued=2, running=3, slots=3)
