"""Issue 24's pull decision, link-bandwidth estimator and pull verifier (peerinfer.core.kvpull,
peerinfer.core.routing.pull), alone and inside NodeCore: pure, no network, no clock."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerinfer.core.costmodel import DEFAULT_COSTS
from peerinfer.core.kvpull import (
    LinkEstimator,
    PullSettings,
    PullVerifier,
    relative_error,
)
from peerinfer.core.messages import Load
from peerinfer.core.node import (
    BanPeer,
    ClientRequest,
    Forward,
    LocalFinished,
    NodeConfig,
    ProbeLink,
    PullChecked,
    PullFailed,
    PullLimit,
    RunLocal,
    TransferMeasured,
)
from peerinfer.core.routing import Candidate, CostPolicy, RouteRequest, consider_pull
from peerinfer.errors import ConfigError
from peerinfer.types import PeerId, RequestId
from tests.core.test_node_core import PARAMS, introduce, make, of, prompt, serve_locally

ME, H, H2 = PeerId("me"), PeerId("holder"), PeerId("holder2")
POLICY = CostPolicy(DEFAULT_COSTS)
PULL = PullSettings()
MB = 1e6 / 8  # bytes per second in one megabit per second


def local(matched: int = 0, queued: int = 0) -> Candidate:
    return Candidate(ME, True, matched, Load(queued=queued, running=0, slots=1), 0.0, 0.0)


def holder(matched: int, queued: int = 0, peer: PeerId = H, rtt: float = 0.01,
           age: float = 0.0) -> Candidate:
    return Candidate(peer, False, matched, Load(queued=queued, running=0, slots=1), rtt, age)


def decide(cands: list[Candidate], mbps: float | dict[PeerId, float | None], prompt_tokens: int = 2000,
           trusted: frozenset[PeerId] | None = None, pull: PullSettings = PULL,
           limits: dict[PeerId, int] | None = None, block_size: int = 1):  # type: ignore[no-untyped-def]
    request = RouteRequest(prompt_tokens=prompt_tokens, max_tokens=16)
    base = POLICY.choose(request, cands, random.Random(0))
    rates = mbps if isinstance(mbps, dict) else {c.peer: mbps for c in cands}

    def bandwidth(p: PeerId) -> float | None:
        r = rates.get(p)
        return None if r is None else r * MB

    probed: list[PeerId] = []
    out = consider_pull(
        POLICY, request, cands, base, pull,
        trusted=lambda p: trusted is None or p in trusted,
        bandwidth=bandwidth, probe=probed.append,
        limit=(limits or {}).get, block_size=block_size,
    )
    return base, out, probed


# --------------------------------------------------------------------------- the decision


def test_a_busy_holder_on_a_fast_link_is_pulled_from_and_a_slow_link_is_not() -> None:
    cands = [local(), holder(1984, queued=3)]
    base, fast, _ = decide(cands, 10_000)
    assert base.is_local or base.target == H
    assert fast.is_local and fast.pull_from == H and fast.pull_tokens == 1984
    assert fast.pull_bytes == 1984 * PULL.kv_bytes_per_token
    assert fast.estimated_ttft_s is not None and base.estimated_ttft_s is not None
    assert fast.estimated_ttft_s < base.estimated_ttft_s
    assert fast.ranked[0] == ME and set(fast.ranked) == {ME, H}
    _, slow, _ = decide(cands, 10)
    assert slow.pull_from is None and slow == base


def test_an_idle_holder_is_forwarded_to_rather_than_pulled_from() -> None:
    # Forwarding costs a round trip; pulling costs the round trip and the bytes.
    _, out, _ = decide([local(), holder(1984)], 10_000)
    assert not out.is_local and out.target == H and out.pull_from is None


def test_the_break_even_bandwidth_is_where_prefill_and_transfer_cross() -> None:
    # Serving here: recompute 1984 tokens (~5.9 s) or pull them: 1984 * 46 KB at the link's
    # rate. A queue at the holder rules the forward out. ~125 Mb/s is the crossing.
    cands = [local(), holder(1984, queued=20)]
    assert decide(cands, 100)[1].pull_from is None
    assert decide(cands, 200)[1].pull_from == H


def test_no_figure_for_a_link_means_no_pull_and_a_probe() -> None:
    cands = [local(), holder(1984, queued=3)]
    base, out, probed = decide(cands, {H: None})
    assert out == base and probed == [H]


def test_small_gains_are_not_pulled() -> None:
    cands = [local(matched=1900), holder(1984, queued=3)]
    _, out, probed = decide(cands, {H: None})
    assert out.pull_from is None and probed == []  # 84 tokens: below min_pull_tokens


def test_a_holder_with_a_byte_bound_is_pulled_from_for_the_whole_blocks_that_fit() -> None:
    """A relayed link's budget (``PullLimit``): the pull is planned, and estimated, for the
    blocks that fit it; a bound that leaves too little gains nothing and is not probed."""
    cands = [local(), holder(1984, queued=3)]
    per_block = 16 * PULL.kv_bytes_per_token
    _, full, _ = decide(cands, 10_000, block_size=16)
    assert full.pull_tokens == 1984
    _, part, _ = decide(cands, 10_000, limits={H: 100 * per_block + per_block // 2}, block_size=16)
    assert part.pull_from == H and part.pull_tokens == 1600
    assert part.pull_bytes is not None and part.pull_bytes <= 100 * per_block + per_block // 2
    assert full.estimated_ttft_s is not None and part.estimated_ttft_s is not None
    assert part.estimated_ttft_s > full.estimated_ttft_s  # the rest is recomputed here
    # A local match counts first: the bound is on what comes beyond it.
    _, beyond, _ = decide([local(matched=320), holder(1984, queued=3)], 10_000,
                          limits={H: 100 * per_block}, block_size=16)
    assert beyond.pull_tokens == 1600
    base, spent, probed = decide(cands, {H: None}, limits={H: per_block}, block_size=16)
    assert spent == base and probed == []  # 16 tokens: below min_pull_tokens, not probed
    always = PullSettings(mode="always")
    request = RouteRequest(prompt_tokens=2000, max_tokens=16)
    local_only = POLICY.choose(request, [cands[0]], random.Random(0))
    out = consider_pull(None, request, cands, local_only, always, trusted=lambda p: True,
                        bandwidth=lambda p: 1.0 * MB, limit={H: 20 * per_block}.get, block_size=16)
    assert out.pull_from == H and out.pull_tokens == 320
    out = consider_pull(None, request, cands, local_only, always, trusted=lambda p: True,
                        bandwidth=lambda p: 1.0 * MB, limit={H: 0}.get, block_size=16)
    assert out == local_only


def test_always_mode_pulls_from_the_longest_trusted_holder() -> None:
    always = PullSettings(mode="always")
    cands = [local(), holder(1024, peer=H), holder(1984, peer=H2, queued=50)]
    request = RouteRequest(prompt_tokens=2000, max_tokens=16)
    base = POLICY.choose(request, [cands[0]], random.Random(0))  # a local decision
    out = consider_pull(None, request, cands, base, always, trusted=lambda p: True,
                        bandwidth=lambda p: 1.0 * MB)
    assert out.pull_from == H2 and out.pull_tokens == 1984
    out = consider_pull(None, request, cands, base, always, trusted=lambda p: p != H2,
                        bandwidth=lambda p: 1.0 * MB)
    assert out.pull_from == H


def test_settings_are_checked() -> None:
    for bad in ({"mode": "sometimes"}, {"kv_bytes_per_token": 0}, {"verify_rate": 1.5},
                {"verify_granularity": "layer"},
                {"probe_gap_s": 0.0}, {"min_gain_fraction": -1.0}):
        with pytest.raises(ConfigError):
            PullSettings(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cost policy"):
        NodeConfig(peer_id=ME, policy="longest_prefix", kv_pull=PullSettings())
    NodeConfig(peer_id=ME, policy="local", kv_pull=PullSettings(mode="always"))


candidates_st = st.lists(
    st.tuples(
        st.integers(0, 4000),  # matched
        st.integers(0, 12),  # queued
        st.floats(0.0, 0.2),  # rtt
        st.sampled_from([0.0, 5.0, 60.0, math.inf]),  # digest age
    ),
    min_size=1, max_size=5,
)


def _build(local_q: int, local_m: int, spec: list[tuple[int, int, float, float]]) -> list[Candidate]:
    cands = [local(matched=local_m, queued=local_q)]
    for i, (m, q, rtt, age) in enumerate(spec):
        cands.append(holder(m, queued=q, peer=PeerId(f"p{i}"), rtt=rtt, age=age))
    return cands


@settings(max_examples=150, deadline=None)
@given(
    spec=candidates_st,
    local_q=st.integers(0, 12),
    local_m=st.integers(0, 2000),
    prompt_tokens=st.integers(200, 4000),
    low=st.floats(1.0, 20_000.0),
    factor=st.floats(1.0, 100.0),
)
def test_pulling_is_monotonic_in_bandwidth(spec, local_q, local_m, prompt_tokens, low, factor) -> None:  # type: ignore[no-untyped-def]
    cands = _build(local_q, min(local_m, prompt_tokens - 1), spec)
    _, slow, _ = decide(cands, low, prompt_tokens)
    _, fast, _ = decide(cands, low * factor, prompt_tokens)
    if slow.pull_from is not None:
        assert fast.pull_from is not None
        assert fast.estimated_ttft_s is not None and slow.estimated_ttft_s is not None
        assert fast.estimated_ttft_s <= slow.estimated_ttft_s + 1e-9


@settings(max_examples=150, deadline=None)
@given(spec=candidates_st, mbps=st.floats(1.0, 100_000.0), mask=st.integers(0, 31),
       mode=st.sampled_from(["auto", "always"]))
def test_never_pulls_from_an_untrusted_peer(spec, mbps, mask, mode) -> None:  # type: ignore[no-untyped-def]
    cands = _build(0, 0, spec)
    trusted = frozenset(c.peer for i, c in enumerate(cands[1:]) if mask >> i & 1)
    _, out, probed = decide(cands, mbps, trusted=trusted, pull=PullSettings(mode=mode))
    assert out.pull_from is None or out.pull_from in trusted
    assert set(probed) <= trusted
    if out.pull_from is not None:
        assert out.is_local and out.target == ME


# --------------------------------------------------------------------------- the estimator


def test_the_estimator_measures_decays_and_expires() -> None:
    links = LinkEstimator(half_life_s=10.0, max_age_s=100.0, probe_gap_s=30.0)
    assert links.bandwidth(H, 0.0) is None
    assert not links.observe(H, 1000, 0.01, 0.0)  # too small to say anything of bandwidth
    assert links.observe(H, 10_000_000, 1.1, 0.0, rtt_s=0.1)  # 10 MB in 1 s once the rtt is off
    assert links.bandwidth(H, 0.0) == pytest.approx(10e6)
    # The link got slower: recent samples count more, old ones fade by the half-life.
    links.observe(H, 10_000_000, 10.0, 50.0)
    assert links.bandwidth(H, 50.0) == pytest.approx((10e6 * 0.5**5 + 1e6) / (0.5**5 + 1))
    for t in range(51, 60):
        links.observe(H, 10_000_000, 10.0, float(t))
    assert links.bandwidth(H, 60.0) == pytest.approx(1e6, rel=0.03)  # the 10 MB/s sample: ~2%
    assert links.bandwidth(H, 160.0) is None  # expired
    assert not links.observe(H, 10_000_000, 0.05, 161.0, rtt_s=0.1)  # no time left for bytes


def test_the_estimator_asks_for_a_bounded_probe_only_without_a_recent_figure() -> None:
    links = LinkEstimator(max_age_s=100.0, probe_gap_s=30.0, probe_bytes=1 << 20)
    assert links.probe(H, 0.0) == 1 << 20
    assert links.probe(H, 10.0) is None  # asked 10 s ago
    assert links.probe(H, 31.0) == 1 << 20  # no answer in the gap: ask again
    links.observe(H, 1 << 20, 0.5, 32.0)
    assert links.probe(H, 40.0) is None  # a fresh figure
    # 108 s after the last sample the figure has expired, and the last ask is older than the
    # gap: a probe is due again.
    assert links.bandwidth(H, 140.0) is None
    assert links.probe(H, 140.0) == 1 << 20
    assert links.probe(H, 150.0) is None


def test_the_estimator_is_bounded() -> None:
    links = LinkEstimator(max_links=3)
    for i in range(10):
        links.observe(PeerId(f"p{i}"), 1 << 20, 1.0, float(i))
        links.probe(PeerId(f"q{i}"), float(i))
    assert len(links) <= 3
    assert links.bandwidth(PeerId("p9"), 9.0) is not None


# --------------------------------------------------------------------------- the verifier


def test_the_sample_is_deterministic_given_the_seed_and_has_the_rate() -> None:
    a, b = PullVerifier("s", rate=0.08), PullVerifier("s", rate=0.08)
    draws = [a.sample(125, 16) for _ in range(200)]
    assert draws == [b.sample(125, 16) for _ in range(200)]
    assert draws != [PullVerifier("t", rate=0.08).sample(125, 16) for _ in range(200)]
    assert sum(map(len, draws)) / 200 == pytest.approx(160.0, abs=1.0)  # 8% of 2,000 tokens
    for d in draws:
        assert list(d) == sorted(set(d)) and all(0 <= i < 2000 for i in d)
        per_block = [sum(1 for t in d if t // 16 == blk) for blk in range(125)]
        assert min(per_block) >= 1 and max(per_block) <= 2  # spread: every block, 1 or 2
    # Offsets within blocks are not fixed: a liar cannot keep to the unchecked ones.
    assert len({t % 16 for d in draws for t in d}) == 16
    small = PullVerifier("s", rate=0.08, min_blocks=1)
    assert all(len({t // 16 for t in small.sample(4, 16)}) == 4 for _ in range(50))
    assert {len(small.sample(4, 16)) for _ in range(200)} == {5, 6}  # 8% of 64 tokens
    few = [PullVerifier("s", rate=0.02).sample(10, 16) for _ in range(20)]
    assert all(len({t // 16 for t in d}) == len(d) for d in few)  # under 1 a block: 1 each
    # Blocks as the unit (block_size 1, or the "block" granularity: every token of a block).
    assert all(len(small.sample(4)) == 1 for _ in range(50))
    assert PullVerifier("s", rate=1.0).sample(7) == tuple(range(7))
    assert PullVerifier("s", rate=1.0).sample(2, 3) == tuple(range(6))
    assert PullVerifier("s", rate=0.0, min_blocks=0).sample(7, 16) == ()
    whole = PullVerifier("s", rate=0.08, granularity="block").sample(125, 16)
    assert len(whole) % 16 == 0 and all(t % 16 == i % 16 for i, t in enumerate(whole))
    assert a.sample(0, 16) == ()
    # Runs of 4 consecutive tokens at aligned slots of a block; the share of tokens stays.
    runs = [PullVerifier("r", rate=0.0625).sample(125, 16, 4) for _ in range(100)]
    assert sum(map(len, runs)) / 100 == pytest.approx(125.0, abs=2.0)
    for d in runs:
        assert len(d) % 4 == 0
        for i in range(0, len(d), 4):
            assert d[i] % 4 == 0 and list(d[i:i + 4]) == list(range(d[i], d[i] + 4))
    assert len({t % 16 for d in runs for t in d}) == 16
    assert len(PullVerifier("r", rate=0.0).sample(3, 16, 4)) == 4  # min_blocks 1: one run
    with pytest.raises(ConfigError):
        PullVerifier("s", granularity="layer")


def test_judging_within_and_beyond_the_tolerance() -> None:
    v = PullVerifier("s", tolerance=0.02)
    block = [1.0, -2.0, 0.5]
    assert relative_error(block, [1.001, -2.002, 0.5]) == pytest.approx(0.001)
    assert relative_error(block, block) == 0.0
    assert relative_error(block, [1.0]) == math.inf
    assert relative_error([0.0], [0.1]) == math.inf
    assert relative_error([1.0, math.nan], [1.0, 1.0]) == math.inf
    ok = v.judge([(0, 0.001), (5, 0.019)])
    assert ok.ok and ok.checked == 2 and ok.worst_block == 5
    bad = v.judge([(0, 0.001), (7, 0.3), (9, 0.05)])
    assert not bad.ok and bad.worst_block == 7 and "block 7" in bad.detail
    assert not v.judge([(3, math.nan)]).ok
    assert v.judge([(0, 0.0), (37, 0.5)], 16).worst_block == 2  # token 37 of 16-token blocks
    assert v.judge([]).ok  # nothing checked: nothing against the pull


# --------------------------------------------------------------------------- in NodeCore


def _busy_holder_and_puller(**pull: object):  # type: ignore[no-untyped-def]
    """``b`` holds a 1,024-token prompt and has 6 requests queued; ``a`` knows it."""
    private = pull.pop("_private", True)
    settings_ = PullSettings(**pull)  # type: ignore[arg-type]
    a = make("A", policy="cost", kv_pull=settings_, private_swarm=private)
    b = make("B", policy="cost")
    shared = prompt(1, 1024)
    serve_locally(b, "warm", shared, 0.0)
    for k in range(6):  # queued behind a running one
        b.handle(ClientRequest(RequestId(f"q{k}"), prompt(100 + k, 512), PARAMS), 0.5)
    introduce(a, b, 1.0)
    return a, b, shared


def test_a_node_probes_then_pulls_from_a_busy_holder() -> None:
    a, b, shared = _busy_holder_and_puller()
    tokens = shared + prompt(9, 16)
    first = a.handle(ClientRequest(RequestId("r1"), tokens, PARAMS), 2.0)
    assert of(first, ProbeLink) == [ProbeLink(b.peer_id, PULL.probe_bytes)]
    run = of(first, RunLocal)[0]
    assert run.decision is not None and run.decision.pull_from is None
    # r1 fails here, caching nothing (so this node still holds none of the prompt).
    a.handle(LocalFinished(RequestId("r1"), ok=False), 2.05)
    assert a.handle(TransferMeasured(b.peer_id, 1 << 20, 0.0011, 0.001), 2.1) == []  # ~8 Gb/s
    d = a.route(tokens, PARAMS, 2.2)
    assert d.is_local and d.pull_from == b.peer_id and d.pull_tokens == 1024
    assert d.reason.startswith("pull:")
    second = a.handle(ClientRequest(RequestId("r2"), tokens, PARAMS), 2.2)
    assert not of(second, ProbeLink)
    assert [r.decision.pull_from for r in of(second, RunLocal)] == [b.peer_id]


def test_no_pulls_in_an_open_swarm_unless_allowed() -> None:
    a, b, shared = _busy_holder_and_puller(_private=False)
    a.handle(TransferMeasured(b.peer_id, 1 << 20, 0.0011, 0.001), 1.5)
    effects = a.handle(ClientRequest(RequestId("r1"), shared + prompt(9, 16), PARAMS), 2.0)
    assert not of(effects, ProbeLink)
    assert all(e.decision is None or e.decision.pull_from is None
               for e in effects if isinstance(e, (RunLocal, Forward)))
    a, b, shared = _busy_holder_and_puller(_private=False, open_swarm=True)
    a.handle(TransferMeasured(b.peer_id, 1 << 20, 0.0011, 0.001), 1.5)
    effects = a.handle(ClientRequest(RequestId("r1"), shared + prompt(9, 16), PARAMS), 2.0)
    assert any(e.decision is not None and e.decision.pull_from == b.peer_id
               for e in effects if isinstance(e, RunLocal))


def test_pulls_off_change_no_decision() -> None:
    # The same node with pulls off and with pulls on but no bandwidth figure: same decisions
    # (the extra-work charge off: it is the routing's, not the pull step's; with it on, on
    # idle nodes it charges nothing and only the reason tells of it).
    for kv_pull in (None, PullSettings(extra_work_weight=0.0), PullSettings()):
        a = make("A", policy="cost", kv_pull=kv_pull, private_swarm=True)
        b = make("B", policy="cost")
        shared = prompt(1, 1024)
        serve_locally(b, "warm", shared, 0.0)
        introduce(a, b, 1.0)
        effects = a.handle(ClientRequest(RequestId("r"), shared + prompt(9, 16), PARAMS), 2.0)
        fwd = of(effects, Forward)
        assert fwd and fwd[0].decision.pull_from is None
        if kv_pull is None:
            off = fwd[0].decision
            assert not of(effects, ProbeLink)
        elif kv_pull.extra_work_weight == 0.0:
            assert replace(fwd[0].decision) == off
        else:
            assert "extra-work charge local 0.000 s" in fwd[0].decision.reason
            assert replace(fwd[0].decision, reason=off.reason) == off


def test_a_failed_pull_holds_off_pulls_from_that_holder_for_a_while_or_for_good() -> None:
    """``PullFailed``: no pull from that holder for ``PULL_HOLDOFF_S`` (it is no ban: the
    holder still gets forwards, and this node still serves it); after a format refusal, never."""
    from peerinfer.core.node.choice import PULL_HOLDOFF_S

    a, b, shared = _busy_holder_and_puller()
    tokens = shared + prompt(9, 16)
    a.handle(TransferMeasured(b.peer_id, 1 << 20, 0.0011, 0.001), 1.5)
    assert a.route(tokens, PARAMS, 2.0).pull_from == b.peer_id
    assert a.handle(PullFailed(b.peer_id, "busy", "serving other pulls"), 2.0) == []
    held = a.route(tokens, PARAMS, 2.1)
    assert held.pull_from is None
    assert a.is_member(b.peer_id) and b.peer_id not in a.trust.reputation.blocked()
    assert a.choice.may_pull_from(b.peer_id, 2.1)  # serving b's pulls is not affected
    a.handle(TransferMeasured(b.peer_id, 1 << 20, 0.0011, 0.001), 2.0 + PULL_HOLDOFF_S)
    assert a.route(tokens, PARAMS, 2.1 + PULL_HOLDOFF_S).pull_from == b.peer_id
    a.handle(PullFailed(b.peer_id, "format", "this node's KV format is x"), 2.2 + PULL_HOLDOFF_S)
    assert a.route(tokens, PARAMS, 2.3 + PULL_HOLDOFF_S).pull_from is None
    assert a.choice.pull_held_off(b.peer_id, 1e9)


def test_a_pull_limit_bounds_the_pulls_planned_from_that_holder() -> None:
    """``PullLimit``: the shell's byte bound for a relayed holder; the pull is planned for what
    fits, not at all once it is spent, and in full again when the bound is lifted."""
    a, b, shared = _busy_holder_and_puller()
    tokens = shared + prompt(9, 16)
    a.handle(TransferMeasured(b.peer_id, 1 << 20, 0.0011, 0.001), 1.5)
    assert a.route(tokens, PARAMS, 2.0).pull_tokens == 1024
    block = a.hasher.block_size * PULL.kv_bytes_per_token
    assert a.handle(PullLimit(b.peer_id, 40 * block + 7), 2.0) == []
    assert a.choice.pull_limit(b.peer_id) == 40 * block + 7
    d = a.route(tokens, PARAMS, 2.1)
    assert d.pull_from == b.peer_id and d.pull_tokens == 40 * a.hasher.block_size
    a.handle(PullLimit(b.peer_id, 0), 2.1)
    assert a.route(tokens, PARAMS, 2.2).pull_from is None
    a.handle(PullLimit(b.peer_id, None), 2.2)
    assert a.choice.pull_limit(b.peer_id) is None
    assert a.route(tokens, PARAMS, 2.3).pull_tokens == 1024


def test_a_pull_that_fails_its_check_bans_the_peer() -> None:
    a, b, _ = _busy_holder_and_puller()
    assert a.pull_sample(125) and all(0 <= i < 125 for i in a.pull_sample(125))
    assert all(0 <= i < 2000 for i in a.pull_sample(125, 16))
    assert a.handle(PullChecked(b.peer_id, True, ""), 3.0) == []
    effects = a.handle(PullChecked(b.peer_id, False, "block 3 differs"), 3.0)
    bans = of(effects, BanPeer)
    assert bans and bans[0].peer == b.peer_id and bans[0].until > 3.0
    assert "altered KV" in bans[0].reason
    assert not a.is_member(b.peer_id)
    assert make("C").pull_sample(125) == ()  # pulls off: nothing to check


@settings(max_examples=40, deadline=None)
@given(
    queued=st.integers(0, 8),
    length=st.integers(200, 1500),
    mbps=st.floats(1.0, 100_000.0),
    setup=st.sampled_from(["off", "open swarm", "not trusted"]),
)
def test_never_pulls_when_off_or_not_allowed(queued, length, mbps, setup) -> None:  # type: ignore[no-untyped-def]
    # Pulls off; on in an open swarm without the option; on in a private swarm with the holder
    # outside ``trusted_peers``: no decision ever pulls, whatever the link and the queues.
    kw: dict[str, object] = {
        "off": {"kv_pull": None, "private_swarm": True},
        "open swarm": {"kv_pull": PullSettings(), "private_swarm": False},
        "not trusted": {"kv_pull": PullSettings(), "private_swarm": True,
                        "trusted_peers": frozenset({PeerId("someone else")})},
    }[setup]
    a = make("A", policy="cost", **kw)
    b = make("B", policy="cost")
    shared = prompt(1, length)
    serve_locally(b, "warm", shared, 0.0)
    for k in range(queued):
        b.handle(ClientRequest(RequestId(f"q{k}"), prompt(100 + k, 512), PARAMS), 0.5)
    introduce(a, b, 1.0)
    a.handle(TransferMeasured(b.peer_id, 1 << 22, (1 << 22) / (mbps * MB)), 1.5)
    effects = a.handle(ClientRequest(RequestId("r"), shared + prompt(9, 16), PARAMS), 2.0)
    assert not of(effects, ProbeLink)
    assert all(e.decision is None or e.decision.pull_from is None
               for e in effects if isinstance(e, (RunLocal, Forward)))
    assert a.route(shared + prompt(9, 16), PARAMS, 2.1).pull_from is None
