"""Routing over the holders of a prompt and stand-ins for the rest decides as over every peer.

``PeerIndex.holder_candidates`` keeps the local node, the peers holding part of the prompt,
the peers estimated otherwise than by load (another speed, a batch at work) and, of the plain
non-holders, stand-ins on the (outstanding, rtt) front; ``CostPolicy.choose_among_holders``
decides over them, or asks for every candidate when a stand-in ties or wins. Here random
indexes (loads, round trips, holders, exclusions, stale digests, kept loads) are routed both
ways with a policy whose queue term is small (``mean_service_s``), so that a busy near peer
can beat an idle far one: every field of the decision but ``ranked`` and the dice after it
must be the same.
"""

from __future__ import annotations

import random

import pytest

from peerinfer.core.costmodel import DEFAULT_COSTS
from peerinfer.core.index import PeerIndex
from peerinfer.core.messages import Load
from peerinfer.core.routing import (
    Candidate,
    CostPolicy,
    RouteDecision,
    RouteRequest,
    Row,
    make_candidate,
)
from peerinfer.types import BlockHash, PeerId

BS = 16
OTHER_SPEED = DEFAULT_COSTS.at_speed(tuple(x // 2 or 1 for x in DEFAULT_COSTS.speed())).speed()


def _peer(i: int) -> PeerId:
    return PeerId(f"12D3KooW{i:044d}")


def _random_index(rng: random.Random, plain: bool) -> tuple[PeerIndex, dict[str, object]]:
    index = PeerIndex()
    peers = [_peer(i) for i in range(1, rng.randint(2, 40))]
    chain = [BlockHash(rng.getrandbits(62) + 1) for _ in range(rng.randint(1, 6))]
    rtts = [0.01, 0.02, 0.05, 0.1]
    rtt: dict[PeerId, float] = {}
    inflight: dict[PeerId, int] = {}
    heard: dict[PeerId, tuple[Load, float]] = {}
    for p in peers:
        replica = index.add_peer(p)
        if rng.random() < 0.3:
            for h in chain[: rng.randint(1, len(chain))]:
                replica.digest.add(h)
        slots = 1 if plain or rng.random() < 0.7 else 4
        speed = () if plain or rng.random() < 0.8 else OTHER_SPEED
        busy = rng.choice([0, 0, 0, 1, 2, 3, 5])
        index.set_load(p, Load(queued=max(0, busy - slots), running=min(busy, slots),
                               slots=slots, speed=speed), 1.0)
        if rng.random() < 0.9:
            index.mark_fresh(p, rng.uniform(0.0, 9.0))
        if rng.random() < 0.8:
            rtt[p] = rng.choice(rtts) if rng.random() < 0.7 else rng.uniform(0.005, 0.1)
        if rng.random() < 0.1:
            inflight[p] = rng.randint(1, 3)
        if rng.random() < 0.2:
            heard[p] = (Load(running=rng.randint(0, 1)), rng.uniform(5.0, 10.0))
    exclude = {p for p in peers if rng.random() < 0.1}
    options: dict[str, object] = dict(
        block_size=BS, local_peer=_peer(0), local_matched_tokens=BS * rng.randint(0, len(chain)),
        local_load=Load(running=rng.randint(0, 1), queued=rng.randint(0, 3)), now=10.0,
        rtt_s=rtt, default_rtt_s=0.03, inflight=inflight, exclude=exclude,
        max_digest_age_s=rng.choice([60.0, 5.0]), max_matched_tokens=len(chain) * BS - 1,
        heard=heard or None,
    )
    options["chain"] = chain
    return index, options


@pytest.mark.parametrize("weight", [0.0, 1.0])
@pytest.mark.parametrize("plain", [True, False])
def test_holder_candidates_decide_as_every_candidate(plain: bool, weight: float) -> None:
    # ``weight``: the extra-work charge (``CostPolicy.extra_work_weight``), off and on.
    asked_every = pruned = 0
    for trial in range(600):
        rng = random.Random(f"holders:{plain}:{trial}")
        index, options = _random_index(rng, plain)
        chain = options.pop("chain")
        policy = CostPolicy(DEFAULT_COSTS, mean_service_s=rng.choice([0.005, 0.02, 0.1, None]),
                            extra_work_weight=weight)
        request = RouteRequest(prompt_tokens=len(chain) * BS, max_tokens=8, chain=tuple(chain))
        every = index.candidates(chain, **options)  # type: ignore[arg-type]
        dice = random.Random(trial)
        want = policy.choose(request, every, dice)
        want_dice = dice.getstate()
        held = index.holder_candidates(
            chain, own_speed=DEFAULT_COSTS.speed(), plain_loads=plain, rtt_version=1,
            **options,  # type: ignore[arg-type]
        )
        assert [c.peer for c in held.candidates] == [c.peer for c in every if c in held.candidates]
        dice = random.Random(trial)
        got = policy.choose_among_holders(request, held.candidates, dice, held.stand_ins)
        if got is None:
            asked_every += 1
            assert held.every() == every
            got = policy.choose(request, held.every(), dice)
        else:
            pruned += 1
        assert dice.getstate() == want_dice, trial
        assert (got.target, got.is_local, got.expected_cached_tokens, got.estimated_ttft_s,
                got.max_outstanding) == (want.target, want.is_local, want.expected_cached_tokens,
                                         want.estimated_ttft_s, want.max_outstanding), trial
    # Both ways are exercised (with the charge a busy stand-in wins less often: fewer asks).
    assert pruned > 300 and asked_every > 20, (pruned, asked_every)


def _as_row(c: Candidate) -> Row:
    return (c.peer, c.is_local, c.matched_tokens, c.load, c.rtt_s, c.digest_age_s, c.inflight)


@pytest.mark.parametrize("plain", [True, False])
def test_choosing_over_rows_is_choosing_over_the_candidates(plain: bool) -> None:
    """``CostPolicy.choose_rows`` (the pruned list as ``make_candidate``'s arguments, of which
    it builds only those it reads) decides as ``choose_among_holders`` over the candidates,
    every field (``ranked`` and the reason too) and the dice after it; the rows
    ``holder_candidates(rows=True)`` gives are the candidates it gives otherwise. The loads
    are varied beyond what a route hands it (batches, other speeds, a disk tier, a busy
    local node), so that every branch of the estimate is held to ``_ttfts``' floats (fails
    if one operation of one branch is reordered)."""
    from dataclasses import replace

    by_rows = by_candidates = asked_every = 0
    for trial in range(600):
        rng = random.Random(f"rows:{plain}:{trial}")
        index, options = _random_index(rng, plain)
        chain = options.pop("chain")
        policy = CostPolicy(DEFAULT_COSTS, mean_service_s=rng.choice([0.005, 0.02, 0.1, None]))
        request = RouteRequest(prompt_tokens=len(chain) * BS, max_tokens=8, chain=tuple(chain))
        asked = dict(chain=chain, own_speed=DEFAULT_COSTS.speed(), plain_loads=plain,
                     rtt_version=1, **options)
        held = index.holder_candidates(**asked)  # type: ignore[arg-type]
        as_rows = index.holder_candidates(rows=True, **asked)  # type: ignore[arg-type]
        assert as_rows.stand_ins == held.stand_ins
        if as_rows.rows is not None:
            by_rows += 1
            assert [make_candidate(*r) for r in as_rows.rows] == held.candidates, trial
            assert as_rows.listed() == held.candidates
        else:
            by_candidates += 1
            assert as_rows.candidates == held.candidates
        candidates = held.listed()
        if rng.random() < 0.5:  # loads no route hands it, for the arithmetic's every branch
            candidates = [
                replace(c, load=replace(
                    c.load,
                    slots=rng.choice([1, 4]),
                    running=rng.randint(0, 4),
                    speed=rng.choice([(), (), OTHER_SPEED]),
                    disk=rng.choice([(), (), (500, 2000)]),
                ), matched_tokens=rng.choice([c.matched_tokens, 0, len(chain) * BS]))
                for c in candidates
            ]
        dice = random.Random(trial)
        want = policy.choose_among_holders(request, candidates, dice, held.stand_ins)
        want_dice = dice.getstate()
        rows = [_as_row(c) for c in candidates]
        assert policy._row_ttfts(request, rows, {}) == policy._ttfts(request, candidates, {})
        dice = random.Random(trial)
        got = policy.choose_rows(request, rows, dice, held.stand_ins)
        assert got == want, trial
        assert dice.getstate() == want_dice, trial
        asked_every += got is None
    assert asked_every > 10, asked_every
    # Rows only where the nearest plain non-holders were searched (``plain_loads``).
    assert by_rows > 300 if plain else by_rows == 0, (by_rows, by_candidates)


def _decide_over_rows(
    index: PeerIndex, asked: dict[str, object], policy: CostPolicy, request: RouteRequest,
    dice: random.Random, bounded: bool,
) -> tuple[RouteDecision, list[Row] | None, list[float]]:
    """``Choice.decide``'s route over rows, with the bound (``CostPolicy.row_bound``) or
    without; and the rows given to the policy, and each peer's hits counted by the walk."""
    before = {p: s.hits for p, s in index._states.items()}
    bound = policy.row_bound(request) if bounded else None
    held = index.holder_candidates(rows=True, bound=bound, **asked)  # type: ignore[arg-type]
    hits = [index._states[p].hits - before[p] for p in index._states]
    if held.rows is not None:
        assert held.plain
        if bound is not None:
            assert held.ttfts is not None
            # The scores made as the rows were made are the policy's.
            assert held.ttfts == policy._row_ttfts(request, held.rows, {})
        got = policy.choose_rows(request, held.rows, dice, held.stand_ins, bound, held.ttfts)
    else:
        got = policy.choose_among_holders(request, held.listed(), dice, held.stand_ins)
    if got is None:
        got = policy.choose(request, held.every(), dice)
    return got, held.rows, hits


def test_rows_that_cannot_matter_are_left_out_and_decide_the_same() -> None:
    """A route over rows with the bound (``RowBound``: the holders deepest first, each scored
    as it is made, those whose floor is above the second-best score left out, and the
    stand-ins' search with them) decides as without it, every field but ``ranked``, with the
    same dice and hits; its ``ranked`` is the full one less what was left out. Round trips
    and loads from few values, and a queue term from small to large, so that scores tie and
    a busy deep holder loses to a shallow one. Fails when the floor leaves out what can tie
    (``>=`` for ``>``), ignores the match (the holders' floor as the stand-ins') or the round
    trip."""
    from dataclasses import replace

    left_out = searches_skipped = routes = 0
    for trial in range(1500):
        rng = random.Random(f"bound:{trial}")
        index, options = _random_index(rng, True)
        chain = options.pop("chain")
        if trial % 2:
            # Ties at the floor: idle peers heard from just now (confidence 1) at the least
            # round trip, scoring exactly their floor.
            peers = index.peers()
            options["rtt_s"] = {p: rng.choice([0.01, 0.02]) for p in peers}
            heard = dict(options["heard"] or {})  # type: ignore[call-overload]
            for p in rng.sample(peers, (len(peers) + 1) // 2):
                heard[p] = (Load(), 10.0)
            options["heard"] = heard
        policy = CostPolicy(DEFAULT_COSTS, mean_service_s=rng.choice([0.005, 0.02, 0.1, 1.0, None]))
        request = RouteRequest(prompt_tokens=len(chain) * BS, max_tokens=8, chain=tuple(chain))
        asked = dict(chain=chain, own_speed=DEFAULT_COSTS.speed(), plain_loads=True,
                     rtt_version=1, **options)
        dice = random.Random(trial)
        want, want_rows, want_hits = _decide_over_rows(index, asked, policy, request, dice, False)
        want_dice = dice.getstate()
        dice = random.Random(trial)
        got, got_rows, got_hits = _decide_over_rows(index, asked, policy, request, dice, True)
        assert dice.getstate() == want_dice, trial
        assert got_hits == want_hits, trial
        assert replace(got, ranked=want.ranked) == want, trial
        kept = set(got.ranked)
        assert got.ranked == tuple(p for p in want.ranked if p in kept), trial
        if got_rows is not None:
            routes += 1
            left_out += len(want.ranked) - len(got.ranked)
            searches_skipped += want_rows is None or not any(r[2] == 0 for r in got_rows[1:])
    # Not vacuous: many rows left out, and stand-ins' searches too.
    assert routes > 1000 and left_out > 2000 and searches_skipped > 300, (
        routes, left_out, searches_skipped)
