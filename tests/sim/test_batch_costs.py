"""The batched cost model, and the three places that use it: the cost policy, the simulated
engine and the simulator's batching nodes. Hand-worked cases, with the arithmetic in comments."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

import peerinfer
from peerinfer.core.costmodel import DEFAULT_COSTS, CostModel
from peerinfer.core.messages import Load, SamplingParams
from peerinfer.core.routing import Candidate, CostPolicy, RouteRequest
from peerinfer.engine import simulated as simulated_module
from peerinfer.engine.base import NEVER_CANCELLED, DecodeRequest
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.errors import ConfigError
from peerinfer.sim import SimConfig, SimRequest, Simulation, simulate
from peerinfer.sim.batch import BatchJob, BatchNode
from peerinfer.sim.run import engine_factory

#: Easy arithmetic: 1 ms per uncached prompt token alone, 2 ms while others decode, chunks of
#: 100; decode steps of 10 ms alone, 12 ms for two, 16 ms for four (20 ms for six: the last
#: segment's slope continues).
BATCHED = CostModel(
    prefill_s_per_token=0.001,
    cached_s_per_token=0.0,
    decode_s_per_token=0.010,
    overhead_s=0.0,
    slots=4,
    decode_step_s_by_batch=((1, 0.010), (2, 0.012), (4, 0.016)),
    prefill_busy_s_per_token=0.002,
    prefill_chunk_tokens=100,
)


# ------------------------------------------------------------------------- the model


def test_decode_step_interpolates_and_extrapolates() -> None:
    assert BATCHED.decode_step_s(0) == 0.0
    assert BATCHED.decode_step_s(1) == pytest.approx(0.010)
    assert BATCHED.decode_step_s(3) == pytest.approx(0.014)
    assert BATCHED.decode_step_s(6) == pytest.approx(0.020)
    assert BATCHED.decode_step_s(100) == pytest.approx(0.016 + 96 * 0.002)
    # Without points (an old model): every step costs decode_s_per_token.
    old = CostModel(decode_s_per_token=0.05)
    assert [old.decode_step_s(n) for n in (1, 2, 8, 100)] == [0.05] * 4


def test_prefill_next_to_decoders_pays_the_busy_rate_and_one_step_per_chunk() -> None:
    assert BATCHED.prefill_s(250, 0) == pytest.approx(0.250)
    # 250 uncached tokens = 3 chunks; busy rate 2 ms; 3 decode steps of 2 others (12 ms)
    assert BATCHED.prefill_s(250, 0, decoders=2) == pytest.approx(0.500 + 3 * 0.012)
    # service at a full batch of 4: prefill next to 3 (3 chunks of 14 ms), 9 more tokens at 16 ms
    assert BATCHED.service_s(250, 0, 10, running=4) == pytest.approx(0.500 + 3 * 0.014 + 9 * 0.016)


def test_estimate_waits_for_a_slot_only_when_full_and_for_the_prefills_under_way() -> None:
    service = 1.0
    # 2 running on 4 slots: no slot wait. Each of the 2 is in prefill with probability
    # P / (P + D), P = prefill next to 2 decoders = 0.5 + 3 * 0.012 = 0.536, D = 9 steps of 3
    # (14 ms) = 0.126: k = 2 * 0.536 / 0.662 = 1.619 expected in prefill, the first half done.
    backlog = 0.536 * (2 * 0.536 / 0.662 - 0.5)
    assert BATCHED.prefill_backlog_s(2, 250, 0, 10) == pytest.approx(backlog)
    ttft, wait = BATCHED.estimate_ttft_s(250, 0, 10, outstanding=2, slots=4, service_s=service)
    assert wait == pytest.approx(backlog) and ttft == pytest.approx(backlog + 0.536)
    # Fewer than one expected in prefill: half of it. None running: nothing.
    p1, d1 = BATCHED.prefill_s(250, 0, 1), 9 * 0.012
    assert BATCHED.prefill_backlog_s(1, 250, 0, 10) == pytest.approx(p1 * (p1 / (p1 + d1)) / 2)
    assert BATCHED.prefill_backlog_s(0, 250, 0, 10) == 0.0
    # 5 outstanding on 4 slots: 2 must finish first, the oldest half done, one per T/4; then
    # it joins 3 running.
    ttft, wait = BATCHED.estimate_ttft_s(250, 0, 10, outstanding=5, slots=4, service_s=service)
    slot_wait = 1.5 * service / 4
    assert wait == pytest.approx(slot_wait + BATCHED.prefill_backlog_s(3, 250, 0, 10))
    assert ttft == pytest.approx(wait + BATCHED.prefill_s(250, 0, 3))
    # One slot: the single-slot estimate, no backlog.
    one = replace(BATCHED, slots=1)
    ttft, wait = one.estimate_ttft_s(250, 0, 10, outstanding=3, slots=1, service_s=service)
    assert wait == pytest.approx(2.5) and ttft == pytest.approx(2.5 + 0.250)


def test_cost_model_round_trips_and_old_files_still_load() -> None:
    assert CostModel.from_dict(json.loads(json.dumps(BATCHED.to_dict()))) == BATCHED
    assert CostModel.from_dict(DEFAULT_COSTS.to_dict()) == DEFAULT_COSTS
    old = {"prefill_s_per_token": 0.002, "cached_s_per_token": 0.0001,
           "decode_s_per_token": 0.05, "overhead_s": 0.01, "slots": 2}
    model = CostModel.from_dict(old)
    assert model.decode_step_s_by_batch == () and model.prefill_busy_s_per_token is None
    assert model.prefill_busy_rate == 0.002
    # calibrate's measurement form: {"batch size": seconds}
    table = CostModel.from_dict({**old, "decode_step_s_by_batch": {"8": 0.2, "1": 0.05}})
    assert table.decode_step_s_by_batch == ((1, 0.05), (8, 0.2))


@pytest.mark.parametrize(
    "bad",
    [
        {"decode_step_s_by_batch": ((2, 0.1), (1, 0.05))},
        {"decode_step_s_by_batch": ((0, 0.1),)},
        {"decode_step_s_by_batch": ((1, -0.1),)},
        {"decode_step_s_by_batch": ((1,),)},
        {"prefill_busy_s_per_token": -1.0},
        {"prefill_chunk_tokens": 0},
        {"slots": 0},
    ],
)
def test_cost_model_refuses_nonsense(bad: dict) -> None:
    with pytest.raises(ConfigError):
        replace(BATCHED, **bad)


# ------------------------------------------------------------------------- routing


def _cand(peer: str, n_running: int, slots: int, *, local: bool = False, matched: int = 0) -> Candidate:
    return Candidate(peer, local, matched, Load(0, n_running, slots), 0.0 if local else 0.01, 0.0)


def test_cost_policy_estimate_follows_the_batched_model() -> None:
    policy = CostPolicy(BATCHED)
    request = RouteRequest(prompt_tokens=250, max_tokens=10)
    # 2 running on 4 slots: no slot wait; the backlog of 2 requests shaped like this one (half
    # cached); prefill next to 2 decoders
    ttft, cached, wait = policy.estimate(request, _cand("a", 2, 4))
    assert wait == pytest.approx(BATCHED.prefill_backlog_s(2, 250, 125, 10))
    assert ttft == pytest.approx(0.01 + wait + BATCHED.prefill_s(250, 0, 2))
    # 6 on 4: waits (6 - 4 + 0.5) * T / 4 with T = service at a full batch, half cached
    service = BATCHED.service_s(250, 125, 10, running=4)
    ttft, _, wait = policy.estimate(request, _cand("a", 6, 4))
    assert wait == pytest.approx(2.5 * service / 4 + BATCHED.prefill_backlog_s(3, 250, 125, 10))
    assert ttft == pytest.approx(0.01 + wait + BATCHED.prefill_s(250, 0, 3))
    # For a long answer, a batching node with room beats a single-slot one with one running:
    # joining costs the busy prefill (530 ms) and a small backlog (the one running is in
    # prefill with probability P / (P + D), P = 125 * 0.002 + 2 chunks * 0.010 = 0.270, D = 63
    # steps of 2 at 12 ms); waiting costs half a 755 ms
    # service first.
    long = RouteRequest(prompt_tokens=250, max_tokens=64)
    single = policy.estimate(long, _cand("b", 1, 1))[0]
    assert single == pytest.approx(0.01 + 0.5 * (0.125 + 63 * 0.010) + 0.250)
    phi = 0.270 / (0.270 + 63 * 0.012)
    batched = policy.estimate(long, _cand("a", 1, 4))[0]
    assert batched == pytest.approx(0.01 + 0.270 * phi / 2 + 0.530) and batched < single


def test_the_forward_limit_is_the_inverse_of_the_batched_estimate() -> None:
    policy = CostPolicy(BATCHED)
    request = RouteRequest(prompt_tokens=400, max_tokens=10)
    holder = _cand("holder", 0, 4, matched=384)
    cands = [_cand("me", 0, 4, local=True), holder]
    d = policy.choose(request, cands, random.Random(0))
    assert d.target == "holder" and d.max_outstanding is not None
    runner_up = policy.estimate(request, cands[0])[0]

    def at(n: int) -> float:  # the holder's estimate with n outstanding, round trip aside
        return policy.estimate(request, replace(holder, load=Load(0, n, 4)))[0] - holder.rtt_s

    limit = d.max_outstanding
    assert limit >= 1  # what the decision saw (0) and one more fit
    assert at(limit) <= runner_up + 1e-12 < at(limit + 1)


def test_choose_and_estimate_agree_on_batched_candidates() -> None:
    policy = CostPolicy(BATCHED)
    rng = random.Random(3)
    for _ in range(200):
        prompt = rng.randrange(1, 900)
        request = RouteRequest(prompt_tokens=prompt, max_tokens=rng.randrange(1, 40))
        cands = [
            Candidate(
                f"p{i}", i == 0, rng.randrange(0, prompt + 1),
                Load(rng.randrange(0, 6), rng.randrange(0, 6), rng.choice((1, 2, 4, 8))),
                0.0 if i == 0 else rng.random() * 0.05, rng.choice((0.0, 5.0, math.inf)),
                rng.randrange(0, 6),
            )
            for i in range(6)
        ]
        d = policy.choose(request, cands, rng)
        estimates = {c.peer: policy.estimate(request, c)[0] for c in cands}
        assert d.estimated_ttft_s == pytest.approx(estimates[d.target])
        rest = [estimates[p] for p in d.ranked[1:]]
        assert rest == pytest.approx(sorted(rest))


# ------------------------------------------------------------------------- simulated engine


def test_simulated_decode_batch_sleeps_one_step_for_the_whole_batch(monkeypatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(simulated_module, "wait_cancelled", lambda cancel, s: slept.append(s) or False)
    engine = SimulatedEngine(costs=BATCHED, time_scale=1.0)
    assert engine.max_batch_size == 4
    assert SimulatedEngine(costs=BATCHED, max_batch_size=2).max_batch_size == 2
    decoders = [
        engine.open_decoder(
            DecodeRequest(tuple(range(10 + i, 260 + i)), SamplingParams(max_tokens=5),
                          NEVER_CANCELLED, random.Random(i))
        )
        for i in range(3)
    ]
    # The first prefills alone: chunk of 100 at 1 ms/token, then the rest.
    assert decoders[0].prefill(100) is False and slept == [pytest.approx(0.100)]
    assert decoders[0].prefill(1000) is True
    first = engine.decode_batch(decoders[:1])  # only samples the first token: no sleep
    assert slept == [pytest.approx(0.100), pytest.approx(0.150)] and first[0] is not None
    # With one decoding, the others' prefill takes the busy rate.
    for d in decoders[1:]:
        assert d.prefill(1000) is True
    assert slept[2:] == [pytest.approx(0.500), pytest.approx(0.500)]
    slept.clear()
    tokens = engine.decode_batch(decoders)
    # One decode step for the one past its first token: 10 ms, once.
    assert slept == [pytest.approx(0.010)] and all(t is not None for t in tokens)
    slept.clear()
    engine.decode_batch(decoders)
    assert slept == [pytest.approx(BATCHED.decode_step_s(3))]
    for d in decoders:
        d.close()
    assert engine._decoding == 0


# ------------------------------------------------------------------------- the batch model


def test_batch_node_by_hand() -> None:
    node = BatchNode(BATCHED)
    a = BatchJob("a", prompt=160, cached=0, tokens=3)
    b = BatchJob("b", prompt=160, cached=0, tokens=3)
    # Both start at 0. A's prefill runs alone, 160 ms, but B's arrival ends the segment at A's
    # first chunk (100 ms): the scheduler picks each chunk anew, the fewest tokens left first.
    assert node.join(a, 0.0) == pytest.approx(0.160)
    assert node.join(b, 0.0) == pytest.approx(0.100)
    assert node.finish(0.100) == [] and a.uncached == 60
    # A has 60 left, B 160: A goes on.
    assert node.plan(0.100) == pytest.approx(0.160)
    assert [(j.key, f, d) for j, f, d in node.finish(0.160)] == [("a", True, False)]
    # B's first chunk (100 tokens at 2 ms) next to A's decode step (10 ms): 210 ms.
    assert node.plan(0.160) == pytest.approx(0.370)
    assert node.finish(0.370) == []
    # B's last 60 tokens (120 ms) complete its prompt: its first token comes back at once and
    # A's decode step waits for the next segment (the previous one decoded, so it may).
    assert node.plan(0.370) == pytest.approx(0.490)
    assert [(j.key, f, d) for j, f, d in node.finish(0.490)] == [("b", True, False)]
    # Both decode one step of two (12 ms): A's third token ends it.
    assert node.plan(0.490) == pytest.approx(0.502)
    assert [(j.key, f, d) for j, f, d in node.finish(0.502)] == [("a", False, True)]
    # B alone: its third token, 10 ms.
    assert node.plan(0.502) == pytest.approx(0.512)
    assert [(j.key, f, d) for j, f, d in node.finish(0.512)] == [("b", False, True)]
    assert node.plan(0.512) is None and node.busy_s == pytest.approx(0.512)


def test_a_short_prompt_overtakes_a_long_one_at_the_next_chunk() -> None:
    node = BatchNode(BATCHED)
    long = BatchJob("long", prompt=400, cached=0, tokens=1)
    assert node.join(long, 0.0) == pytest.approx(0.400)
    # A 30-token prompt arrives at 0.150, in the long one's second chunk (0.100-0.200).
    short = BatchJob("short", prompt=30, cached=0, tokens=1)
    assert node.join(short, 0.150) == pytest.approx(0.200)
    assert node.finish(0.200) == [] and long.uncached == 200
    # The short one's 30 tokens run next (nothing decodes: 1 ms each), then the long one's rest.
    assert node.plan(0.200) == pytest.approx(0.230)
    assert [(j.key, d) for j, _, d in node.finish(0.230)] == [("short", True)]
    assert node.plan(0.230) == pytest.approx(0.430)
    assert [(j.key, d) for j, _, d in node.finish(0.430)] == [("long", True)]


def test_a_joiner_ends_the_decode_segment_at_the_step_under_way() -> None:
    node = BatchNode(BATCHED)
    a = BatchJob("a", prompt=100, cached=0, tokens=11)
    assert node.join(a, 0.0) == pytest.approx(0.100)
    node.finish(0.100)
    # A decodes 10 tokens, 10 ms each: the segment would end at 0.200.
    assert node.plan(0.100) == pytest.approx(0.200)
    # B joins at 0.125, in A's third step: the segment now ends at 0.130 (3 steps done).
    b = BatchJob("b", prompt=50, cached=0, tokens=2)
    assert node.join(b, 0.125) == pytest.approx(0.130)
    assert node.finish(0.130) == [] and a.produced == 4
    # B's prefill (50 tokens at 2 ms, one chunk) completes its prompt: its first token comes
    # back at once (100 ms) and A's step waits for the next segment.
    assert node.plan(0.130) == pytest.approx(0.230)
    assert [(j.key, f) for j, f, _ in node.finish(0.230)] == [("b", True)]
    assert a.produced == 4
    # Both decode at 12 ms a step until B (1 token left) ends.
    assert node.plan(0.230) == pytest.approx(0.242)
    assert [(j.key, d) for j, _, d in node.finish(0.242)] == [("b", True)]
    assert a.produced == 5
    # A alone again: 6 tokens left at 10 ms.
    assert node.plan(0.242) == pytest.approx(0.302)


def _one_node(costs: CostModel, prompts, arrivals, max_tokens: int) -> Simulation:
    config = SimConfig(nodes=1, delay_ms="0", costs=costs, cache_tokens=None, policy="local",
                       requests=len(prompts))
    hasher, make = engine_factory(config)
    params = SamplingParams(max_tokens=max_tokens)
    requests = [SimRequest(p, params, label=str(i)) for i, p in enumerate(prompts)]
    return Simulation(config, requests, hasher, make, arrivals=arrivals, check=True).run()


def test_a_batched_node_in_the_simulator_follows_the_hand_worked_times() -> None:
    # The case of test_batch_node_by_hand, through the real NodeCore: 2 requests at t=0.
    p, q = tuple(range(1000, 1160)), tuple(range(5000, 5160))
    sim = _one_node(BATCHED, [p, q], [(0.0, 0), (0.0, 0)], max_tokens=3)
    assert sim.first == pytest.approx([0.160, 0.490])
    assert sim.finish == pytest.approx([0.502, 0.512])
    assert sim.queue_wait == [0.0, 0.0]  # both admitted at once: 4 slots
    # With 1 slot the second waits for the first: FIFO, each at its single-request times.
    sim = _one_node(replace(BATCHED, slots=1), [p, q], [(0.0, 0), (0.0, 0)], max_tokens=3)
    assert sim.first == pytest.approx([0.160, 0.180 + 0.160])
    assert sim.finish == pytest.approx([0.180, 0.360])


def test_capacity_one_is_the_single_slot_model() -> None:
    """With one slot every request's times are a FIFO single server's with the
    single-request cost model, whatever the batch table says."""
    costs = replace(DEFAULT_COSTS, slots=1, decode_step_s_by_batch=((1, 0.07), (8, 0.2)))
    rng = random.Random(5)
    prompts = [tuple(rng.randrange(5, 30000) for _ in range(rng.randrange(20, 300))) for _ in range(30)]
    prompts += prompts[:10]  # some hits
    t = 0.0
    arrivals = []
    for _ in prompts:
        t += rng.expovariate(1.0)
        arrivals.append((t, 0))
    sim = _one_node(costs, prompts, arrivals, max_tokens=6)
    free = 0.0
    for i, prompt in enumerate(prompts):
        start = max(arrivals[i][0], free)
        first = start + costs.prefill_s(len(prompt), sim.cached[i])
        free = first + 5 * costs.decode_step_s(1)
        assert sim.first[i] == pytest.approx(first, abs=1e-9)
        assert sim.finish[i] == pytest.approx(free, abs=1e-9)
    assert any(sim.cached)


def test_capacity_one_ignores_the_table_across_a_swarm() -> None:
    """Four nodes, every policy: one slot with a batch table and the same model without one
    give the same run."""
    base = replace(DEFAULT_COSTS, slots=1, decode_step_s_by_batch=())
    table = replace(base, decode_step_s_by_batch=((1, base.decode_s_per_token), (4, 0.3)))
    for policy in ("cost", "longest_prefix"):
        cfg = SimConfig(nodes=4, requests=300, policy=policy, skew="hot:2", rate=0.3, seed=2)
        _, a = simulate(replace(cfg, costs=base))
        _, b = simulate(replace(cfg, costs=table))
        for key in ("ttft_mean_s", "ttft_p99_s", "latency_mean_s", "hit_ratio", "forwarded_fraction"):
            assert a[key] == b[key]


def test_batching_carries_a_load_one_slot_cannot_and_stays_deterministic() -> None:
    # 6 requests/s per node keeps a single slot busy all the time (its queue grows); four
    # slots share each decode step and keep up.
    costs = replace(BATCHED, prefill_busy_s_per_token=None)
    # The packaged excerpt, whatever ../shared holds: the figure depends on the prompts.
    excerpt = str(Path(peerinfer.__file__).parent / "data" / "mmlu_excerpt.json")
    cfg = SimConfig(nodes=4, requests=400, policy="cost", skew="hot:2", rate=6.0, seed=3,
                    costs=replace(costs, slots=1), data=excerpt)
    _, single = simulate(cfg)
    assert single["load"]["utilization_max"] > 0.99
    batched_cfg = replace(cfg, costs=costs)
    _, batched = simulate(batched_cfg)
    _, again = simulate(batched_cfg)
    assert batched["ttft_mean_s"] < 0.5 * single["ttft_mean_s"]
    drop = ("wall_s", "setup_s", "loop_s", "requests_per_wall_s")
    assert {k: v for k, v in batched.items() if k not in drop} == {
        k: v for k, v in again.items() if k not in drop
    }


# ------------------------------------------------------------------------- calibration


def test_calibration_measures_batches_through_the_engine_and_says_how(tmp_path) -> None:
    from pathlib import Path

    from peerinfer.engine.calibrate import (
        METHOD_DECODE_BATCH,
        METHOD_SERIAL,
        calibrate_report,
        measure_batch_costs,
    )
    from peerinfer.engine.registry import load_engine

    engine = SimulatedEngine(time_scale=0.0)
    m = measure_batch_costs(engine, sizes=(1, 2, 4), context_tokens=32, steps=2, chunk_tokens=16,
                            busy_decoders=2, repeats=1)
    assert m.method == METHOD_DECODE_BATCH and sorted(m.step_s_by_batch) == [1, 2, 4]
    assert engine._decoding == 0  # every decoder it opened was closed
    example = Path(__file__).resolve().parents[2] / "examples" / "custom_backend.py"
    echo = load_engine(f"{example}:EchoEngine")
    m = measure_batch_costs(echo, sizes=(1, 2), context_tokens=16, steps=1, chunk_tokens=8,
                            busy_decoders=1, repeats=1)
    assert m.method == METHOD_SERIAL
    report = calibrate_report(
        SimulatedEngine(time_scale=0.0), lengths=(8, 16), prefixes=(16, 32), decode_tokens=4,
        repeats=1,
        batch_options={"sizes": (1, 2), "context_tokens": 16, "steps": 1, "chunk_tokens": 8,
                       "busy_decoders": 1},
    )
    costs = report.costs
    assert [n for n, _ in costs.decode_step_s_by_batch] == [1, 2]
    assert costs.slots == 1  # this engine runs one at a time by default
    data = report.to_dict()
    assert data["measurements"]["batch"]["method"] == METHOD_DECODE_BATCH
    assert CostModel.from_dict(data["costs"]) == costs


def test_calibration_stops_at_the_batch_the_engine_can_hold() -> None:
    # An engine with a fixed number of sequences (llama.cpp: max_batch_size + 2) refuses the
    # decoder past them; the curve ends at the largest size it held, and nothing stays open.
    from peerinfer.engine.calibrate import measure_batch_costs
    from peerinfer.errors import EngineError

    class Held(SimulatedEngine):
        def open_decoder(self, request: DecodeRequest):  # type: ignore[no-untyped-def]
            if self._decoding >= 5:
                raise EngineError("all 5 sequences are busy")
            return super().open_decoder(request)

    engine = Held(time_scale=0.0)
    m = measure_batch_costs(engine, sizes=(1, 2, 4, 8, 16), context_tokens=16, steps=1,
                            chunk_tokens=8, busy_decoders=2, repeats=1)
    assert sorted(m.step_s_by_batch) == [1, 2, 4]
    assert engine._decoding == 0
    with pytest.raises(EngineError):  # not even one: that is a failure, not a curve
        measure_batch_costs(Held(time_scale=0.0), sizes=(8,), context_tokens=16, steps=1,
                            chunk_tokens=8, busy_decoders=2, repeats=1)


def test_sim_command_line_batch_and_slots() -> None:
    import argparse

    from peerinfer.core.costmodel import BATCHED_COSTS
    from peerinfer.sim.cli import add_sim_arguments, config_from_args

    def config(*argv: str) -> SimConfig:
        parser = argparse.ArgumentParser()
        add_sim_arguments(parser)
        return config_from_args(parser.parse_args(list(argv)))

    assert config("--batch").costs == BATCHED_COSTS and BATCHED_COSTS.slots == 8
    assert config("--batch", "--slots", "4").costs == BATCHED_COSTS.with_slots(4)
    assert config("--costs", "batched", "--slots", "1").costs.slots == 1
    assert config().costs == DEFAULT_COSTS
    with pytest.raises(ConfigError, match="--batch"):
        config("--batch", "--costs", "gpu")


def test_the_simulated_engine_under_the_batch_scheduler_keeps_the_simulators_times(monkeypatch) -> None:
    """The real scheduler over the simulated engine, on a fake clock that its sleeps advance,
    gives each request the first-token and end times the simulator's batch model gives it."""
    from peerinfer.engine.base import Finished, Tokens
    from peerinfer.engine.batch import BatchScheduler

    clock = [0.0]

    def sleep(cancel, seconds):  # the engine's only way to spend time
        clock[0] += max(0.0, seconds)
        return False

    monkeypatch.setattr(simulated_module, "wait_cancelled", sleep)
    rng = random.Random(11)
    for case in range(6):
        n = rng.randrange(1, 5)
        shapes = [(rng.randrange(2, 450), rng.randrange(1, 9)) for _ in range(n)]
        if case == 0:
            shapes = [(160, 3), (160, 3)]  # test_batch_node_by_hand's case
        engine = SimulatedEngine(costs=BATCHED, time_scale=1.0)
        scheduler = BatchScheduler(engine)
        node = BatchNode(BATCHED)
        clock[0] = 0.0
        for k, (prompt, tokens) in enumerate(shapes):
            ids = [1000 * (k + 1) + i for i in range(prompt)]
            scheduler.submit(k, ids, SamplingParams(max_tokens=tokens))
            node.jobs.append(BatchJob(k, prompt, 0, tokens))  # all at 0, planned below
        first: dict[int, float] = {}
        end: dict[int, float] = {}
        for _ in range(10_000):
            if scheduler.idle:
                break
            for key, ev in scheduler.step():
                if isinstance(ev, Tokens) and ev.token_ids and key not in first:
                    first[key] = clock[0]
                if isinstance(ev, Finished):
                    end[key] = clock[0]
        assert scheduler.idle
        model_first: dict[int, float] = {}
        model_end: dict[int, float] = {}
        t = 0.0
        for _ in range(10_000):
            for job, got_first, finished in node.finish(t):
                if got_first:
                    model_first[job.key] = t
                if finished:
                    model_end[job.key] = t
            nxt = node.plan(t)
            if nxt is None:
                break
            t = nxt
        assert first == pytest.approx(model_first) and end == pytest.approx(model_end), shapes
        if case == 0:
            # 0 prefills alone (0.1 + 0.06: first token at 0.16, handed back at once); then 1's
            # chunk of 100 at the busy rate with 0's decode step (0.2 + 0.01 = 0.37); 1's last
            # 60 (0.12: its first token at 0.49, the decode put off); both decode (0.012: 0
            # ends at 0.502); 1 alone (0.01: 0.512).
            assert first == pytest.approx({0: 0.160, 1: 0.490})
            assert end == pytest.approx({0: 0.502, 1: 0.512})
