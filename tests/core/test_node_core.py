"""The node state machine's rules, driven by hand: no network, no clock, no engine."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest

from peerinfer.core.antientropy import MAX_REPLICA_ELEMENTS
from peerinfer.core.messages import Announce, Load, SamplingParams
from peerinfer.core.node import (
    AnnounceReceived,
    Cancel,
    CancelForward,
    CancelLocal,
    ClientRequest,
    DropPeer,
    Effect,
    Forward,
    ForwardFailed,
    ForwardFinished,
    ForwardFirstToken,
    LocalFinished,
    NodeConfig,
    NodeCore,
    PeerSeen,
    PingPeer,
    Publish,
    Reject,
    RunLocal,
    SendSyncRequest,
    SyncResponseReceived,
)
from peerinfer.core.prefix import PrefixHasher
from peerinfer.types import PeerId, RequestId

HASHER = PrefixHasher(b"test-model")
PARAMS = SamplingParams(max_tokens=4)


def make(pid: str, policy: str = "longest_prefix", **config: object) -> NodeCore:
    return NodeCore(
        NodeConfig(peer_id=PeerId(pid), policy=policy, **config),  # type: ignore[arg-type]
        HASHER,
        rng=random.Random(0),
        now=0.0,
    )


def prompt(seed: int, n: int = 64) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1, 30000) for _ in range(n))


def of(effects: Sequence[Effect], kind: type) -> list:  # type: ignore[type-arg]
    return [e for e in effects if isinstance(e, kind)]


#: Announcements each node published and nobody has delivered yet.
OUTBOX: dict[str, list[Announce]] = {}


def post(core: NodeCore, effects: Sequence[Effect]) -> list[Effect]:
    OUTBOX.setdefault(core.peer_id, []).extend(p.announce for p in of(effects, Publish))
    return list(effects)


def serve_locally(core: NodeCore, rid: str, tokens: tuple[int, ...], now: float) -> None:
    """Run a request to completion on ``core`` as its engine would, caching the prompt."""
    effects = post(core, core.handle(ClientRequest(RequestId(rid), tokens, PARAMS), now))
    runs = of(effects, RunLocal)
    assert runs, effects
    post(core, core.handle(
        LocalFinished(RequestId(rid), ok=True, cache_added=tuple(HASHER.chain(tokens))), now
    ))


def announcements(core: NodeCore, now: float) -> list[Announce]:
    """Everything ``core`` published so far, the announcement due at ``now`` included."""
    post(core, core.tick(now))
    return OUTBOX.pop(core.peer_id, [])


def announce_from(core: NodeCore, now: float) -> Announce:
    published = announcements(core, now)
    assert published, "expected an announcement"
    return published[-1]


def introduce(a: NodeCore, b: NodeCore, now: float) -> None:
    """``a`` learns of ``b`` (connection + every announcement ``b`` made)."""
    a.handle(PeerSeen(b.peer_id, rtt_s=0.001), now)
    for ann in announcements(b, now):
        assert not of(a.handle(AnnounceReceived(b.peer_id, ann), now), SendSyncRequest)


@pytest.fixture(autouse=True)
def _clear_outbox() -> None:
    OUTBOX.clear()


def test_repeated_prefix_is_forwarded_to_the_holder() -> None:
    a, b = make("A"), make("B")
    shared = prompt(1, 256)
    serve_locally(b, "warm", shared + prompt(2, 16), 0.0)
    introduce(a, b, 1.0)
    effects = a.handle(ClientRequest(RequestId("r1"), shared + prompt(3, 16), PARAMS), 1.1)
    forwards = of(effects, Forward)
    assert len(forwards) == 1
    assert forwards[0].peer == "B"
    assert forwards[0].decision.expected_cached_tokens == 256
    assert "B" in forwards[0].decision.reason


def test_local_policy_never_forwards() -> None:
    a, b = make("A", policy="local"), make("B")
    shared = prompt(1, 256)
    serve_locally(b, "warm", shared, 0.0)
    introduce(a, b, 1.0)
    effects = a.handle(ClientRequest(RequestId("r1"), shared + prompt(3, 16), PARAMS), 1.1)
    assert not of(effects, Forward)
    assert of(effects, RunLocal)


def test_forwarded_request_is_served_where_it_lands() -> None:
    a, b = make("A"), make("B")
    shared = prompt(1, 256)
    serve_locally(b, "warm", shared, 0.0)
    introduce(a, b, 1.0)
    effects = a.handle(
        ClientRequest(RequestId("x/r1"), shared + prompt(3, 16), PARAMS, forwarded=True), 1.1
    )
    assert not of(effects, Forward)
    assert of(effects, RunLocal)


def test_busy_refusal_for_forwarded_requests_but_clients_are_queued() -> None:
    a = make("A", max_queue=0)
    first = a.handle(ClientRequest(RequestId("p/1"), prompt(1), PARAMS, forwarded=True), 0.0)
    assert of(first, RunLocal)
    second = a.handle(ClientRequest(RequestId("p/2"), prompt(2), PARAMS, forwarded=True), 0.0)
    assert [r.code for r in of(second, Reject)] == ["busy"]
    # The node's own client is queued, not refused, and runs when the slot frees.
    third = a.handle(ClientRequest(RequestId("c/3"), prompt(3), PARAMS), 0.0)
    assert not of(third, Reject) and not of(third, RunLocal)
    assert a.load() == Load(queued=1, running=1, slots=1)
    after = a.handle(LocalFinished(RequestId("p/1"), ok=True), 0.5)
    assert [r.request_id for r in of(after, RunLocal)] == ["c/3"]


def test_a_forwarded_request_over_its_queue_limit_is_refused_as_busy() -> None:
    a = make("A")  # max_queue 8: the node-wide limit would take all of these
    first = a.handle(ClientRequest(RequestId("p/1"), prompt(1), PARAMS, True, None, 0), 0.0)
    assert of(first, RunLocal)  # nothing outstanding: within a limit of 0
    over = a.handle(ClientRequest(RequestId("p/2"), prompt(2), PARAMS, True, None, 0), 0.0)
    assert [r.code for r in of(over, Reject)] == ["busy"]
    assert "more than the 0" in of(over, Reject)[0].message
    within = a.handle(ClientRequest(RequestId("p/3"), prompt(3), PARAMS, True, None, 1), 0.0)
    assert not of(within, Reject)  # one running, a limit of 1: queued
    unlimited = a.handle(ClientRequest(RequestId("p/4"), prompt(4), PARAMS, True, None), 0.0)
    assert not of(unlimited, Reject)
    stats = a.statistics()
    assert stats.rejected == 1 and stats.rejected_over_limit == 1
    assert a.load() == Load(queued=2, running=1, slots=1)


def test_an_announcement_claiming_an_oversized_set_is_refused_and_never_fresh() -> None:
    a, b = make("A"), make("B")
    serve_locally(b, "warm", prompt(1, 64), 0.0)
    a.handle(PeerSeen(PeerId("B"), rtt_s=0.001), 0.0)  # a member: it answered a ping
    honest = announce_from(b, 0.0)
    huge = replace(honest, count=MAX_REPLICA_ELEMENTS + 1)
    effects = a.handle(AnnounceReceived(PeerId("B"), huge), 0.1)
    assert not of(effects, SendSyncRequest)  # no pull towards a set no replica may hold
    assert a.statistics().announces_refused == 1
    replica = a.index.replica(PeerId("B"))
    assert replica is not None and replica.refused == 1 and len(replica.digest) == 0
    assert a.index.digest_age(PeerId("B"), now=1.0) == float("inf")  # never confirmed


def test_stale_and_replayed_announcements_are_refused() -> None:
    a, b = make("A"), make("B")
    serve_locally(b, "warm", prompt(1, 64), 0.0)
    first = announce_from(b, 0.0)
    a.handle(PeerSeen(PeerId("B"), rtt_s=0.001), 0.0)  # a member: it answered a ping
    a.handle(AnnounceReceived(PeerId("B"), first), 0.1)
    refused = a.statistics().announces_refused
    assert a.handle(AnnounceReceived(PeerId("B"), first), 0.2) == []
    assert a.statistics().announces_refused == refused + 1
    # Someone relaying B's announcement as their own is refused too.
    a.handle(AnnounceReceived(PeerId("M"), first), 0.3)
    assert a.statistics().announces_refused == refused + 2
    # The sender's clock is never compared with ours: a new epoch whose timestamp is far off
    # (a skewed or stepped clock) is taken in.
    serve_locally(b, "more", prompt(5, 64), 0.5)
    late = replace(announce_from(b, 1.0), time_ms=10_000_000)
    a.handle(AnnounceReceived(PeerId("B"), late), 1.1)
    assert a.statistics().announces_refused == refused + 2
    assert a.index.replica(PeerId("B")).epoch == late.epoch  # type: ignore[union-attr]


def test_forward_failure_fails_over_and_finally_serves_locally() -> None:
    a, b, c = make("A"), make("B"), make("C")
    shared = prompt(1, 256)
    serve_locally(b, "warm", shared, 0.0)
    serve_locally(c, "warm", shared[:128], 0.0)
    introduce(a, b, 1.0)
    introduce(a, c, 1.0)
    rid = RequestId("r1")
    effects = a.handle(ClientRequest(rid, shared + prompt(3, 16), PARAMS), 1.1)
    assert of(effects, Forward)[0].peer == "B"
    effects = a.handle(ForwardFailed(rid, PeerId("B"), "busy"), 1.2)
    assert of(effects, Forward)[0].peer == "C"
    effects = a.handle(ForwardFailed(rid, PeerId("C"), "unavailable"), 1.3)
    runs = of(effects, RunLocal)
    assert [r.request_id for r in runs] == [rid]
    assert a.statistics().failovers == 2


def test_first_token_deadline_fails_over() -> None:
    a, b = make("A", first_token_timeout_s=2.0), make("B")
    shared = prompt(1, 256)
    serve_locally(b, "warm", shared, 0.0)
    introduce(a, b, 1.0)
    rid = RequestId("r1")
    a.handle(ClientRequest(rid, shared + prompt(3, 16), PARAMS), 1.0)
    assert a.next_deadline() <= 3.0
    effects = a.tick(3.01)
    assert of(effects, CancelForward)[0].peer == "B"
    assert of(effects, RunLocal)[0].request_id == rid


def test_first_token_clears_the_deadline() -> None:
    a, b = make("A", first_token_timeout_s=2.0), make("B")
    shared = prompt(1, 256)
    serve_locally(b, "warm", shared, 0.0)
    introduce(a, b, 1.0)
    rid = RequestId("r1")
    a.handle(ClientRequest(rid, shared + prompt(3, 16), PARAMS), 1.0)
    a.handle(ForwardFirstToken(rid, PeerId("B")), 1.5)
    assert not of(a.tick(3.5), RunLocal)
    a.handle(ForwardFinished(rid, PeerId("B")), 4.0)
    assert a.pending_requests() == []


def test_mid_stream_failure_resumes_locally_after_the_relayed_tokens() -> None:
    a, b = make("A"), make("B")
    shared = prompt(1, 256)
    serve_locally(b, "warm", shared, 0.0)
    introduce(a, b, 1.0)
    rid = RequestId("r1")
    tokens = shared + prompt(3, 16)
    a.handle(ClientRequest(rid, tokens, PARAMS), 1.0)
    a.handle(ForwardFirstToken(rid, PeerId("B")), 1.1)
    effects = a.handle(ForwardFailed(rid, PeerId("B"), "unavailable", generated=(7, 8)), 1.2)
    run = of(effects, RunLocal)[0]
    assert run.resume_after == (7, 8)
    assert run.tokens == tokens + (7, 8)
    assert run.params.max_tokens == PARAMS.max_tokens - 2


def test_silent_peer_leaves_and_its_requests_fail_over() -> None:
    a, b = make("A", peer_timeout_s=5.0, ping_after_s=1.0), make("B")
    shared = prompt(1, 256)
    serve_locally(b, "warm", shared, 0.0)
    introduce(a, b, 0.0)
    rid = RequestId("r1")
    a.handle(ClientRequest(rid, shared + prompt(3, 16), PARAMS), 0.5)
    assert of(a.tick(1.5), PingPeer)
    effects = a.tick(5.5)
    assert of(effects, DropPeer)[0].peer == "B"
    assert of(effects, RunLocal)[0].request_id == rid
    assert "B" not in a.index


def test_changes_are_announced_soon_but_rate_limited() -> None:
    b = make("B", min_announce_gap_s=0.5, announce_interval_s=10.0)
    of(b.tick(0.0), Publish)  # the first, periodic one
    serve_locally(b, "one", prompt(1), 0.1)
    serve_locally(b, "two", prompt(2), 0.2)
    assert not of(b.tick(0.3), Publish)
    published = of(b.tick(0.5), Publish)
    assert len(published) == 1
    assert len(published[0].announce.added) == 2 * 64 // HASHER.block_size


def test_missed_epoch_is_repaired_by_a_pull() -> None:
    a, b = make("A"), make("B")
    serve_locally(b, "one", prompt(1, 256), 0.0)
    introduce(a, b, 0.0)
    serve_locally(b, "two", prompt(2, 256), 1.0)
    announce_from(b, 1.0)  # lost on the way to A
    serve_locally(b, "three", prompt(3, 256), 2.0)
    effects = a.handle(AnnounceReceived(PeerId("B"), announce_from(b, 2.0)), 2.0)
    rounds = 0
    while sync := of(effects, SendSyncRequest):
        rounds += 1
        assert rounds < 20
        response = b.answer_sync(sync[0].request)
        effects = a.handle(SyncResponseReceived(PeerId("B"), response), 2.0 + rounds * 0.01)
    replica = a.index.replica(PeerId("B"))
    assert replica is not None
    assert set(replica.digest) == set(b.local.digest)
    assert a.statistics().syncs_converged == 1


def test_a_burst_with_a_new_prefix_does_not_scatter() -> None:
    """After routing to B, A assumes B will hold the prompt (speculatively)."""
    a, b, c = make("A"), make("B"), make("C")
    base = prompt(1, 128)
    serve_locally(b, "warm", base, 0.0)
    introduce(a, b, 1.0)
    introduce(a, c, 1.0)
    longer = base + prompt(9, 256)
    first = of(a.handle(ClientRequest(RequestId("r1"), longer + prompt(10, 8), PARAMS), 1.1), Forward)
    assert first[0].peer == "B"
    second = of(a.handle(ClientRequest(RequestId("r2"), longer + prompt(11, 8), PARAMS), 1.2), Forward)
    assert second and second[0].peer == "B"
    assert second[0].decision.expected_cached_tokens >= 128 + 256


def test_cancel_stops_the_work_wherever_it_is() -> None:
    a, b = make("A"), make("B")
    shared = prompt(1, 256)
    serve_locally(b, "warm", shared, 0.0)
    introduce(a, b, 1.0)
    a.handle(ClientRequest(RequestId("f"), shared + prompt(3, 16), PARAMS), 1.0)
    assert of(a.handle(Cancel(RequestId("f")), 1.1), CancelForward)
    local = make("L")
    local.handle(ClientRequest(RequestId("l"), prompt(4), PARAMS), 0.0)
    assert of(local.handle(Cancel(RequestId("l")), 0.1), CancelLocal)
    local.handle(LocalFinished(RequestId("l"), ok=False), 0.2)
    assert local.pending_requests() == []
    assert local.load().running == 0


@pytest.mark.parametrize("bad", [(), None])
def test_empty_prompt_is_rejected(bad: object) -> None:
    a = make("A")
    effects = a.handle(ClientRequest(RequestId("r"), bad or (), PARAMS), 0.0)  # type: ignore[arg-type]
    assert [r.code for r in of(effects, Reject)] == ["invalid"]


def test_the_load_a_node_announces_is_made_anew_whenever_a_figure_in_it_changes() -> None:
    """``Choice.load`` hands back its last ``Load`` while nothing in it changed (a route and
    an announcement ask for it each time): through queue figures, scaffold hints, the disk
    figure and a retuned config with other slots, each answer holds every field a fresh
    ``Load`` would (fails if the last one is kept past a change of any of them; ``Load``'s
    equality leaves the speed, hints and disk figure out, so they are compared one by one)."""
    from peerinfer.core.costmodel import CostModel

    core = make("A", policy="scaffold_hash")
    choice = core.choice
    rng = random.Random(14)
    kept = 0
    for step in range(400):
        if step % 50 == 49:
            core.config = replace(core.config, costs=CostModel().with_slots(rng.choice((1, 2, 4))))
        if step % 7 == 3:
            choice.served_scaffold(rng.randrange(1 << 60), float(step))
        if step % 11 == 5:
            choice.disk = (rng.randrange(1000), rng.randrange(10**6)) if rng.random() < 0.7 else ()
        queued, running = rng.randrange(3), rng.randrange(2)
        before = choice._last_load
        got = choice.load(queued, running)
        kept += got is before
        want = Load(queued=queued, running=running, slots=core.config.costs.slots,
                    speed=choice._speed, scaffolds=choice._scaffolds, disk=choice.disk)
        assert (got, got.slots, got.speed, got.scaffolds, got.disk) == \
            (want, want.slots, want.speed, want.scaffolds, want.disk), step
    assert kept > 50  # the last one is handed back while nothing changed
