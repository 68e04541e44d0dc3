"""Mixed machines: nodes announce their speed, the ``cost`` policy estimates each peer at its
own speed, and the simulator reports where the traffic went (peerinfer.sim.mix)."""

from __future__ import annotations

import json
import random

import pytest

from peerinfer.core.costmodel import DEFAULT_COSTS
from peerinfer.core.messages import Announce, Load, decode, encode
from peerinfer.core.routing import Candidate, CostPolicy, RouteRequest
from peerinfer.errors import ConfigError
from peerinfer.sim import SimConfig, simulate
from peerinfer.sim.config import COST_PRESETS
from peerinfer.sim.mix import node_class, node_costs, parse_mix
from peerinfer.types import PeerId

GPU = COST_PRESETS["gpu"]


def test_a_load_carries_the_speed_and_an_older_load_decodes_without_it() -> None:
    load = Load(queued=1, running=2, slots=3, speed=GPU.speed())
    a = Announce("p", 2, 1, 7, 0, load)
    back = decode(encode(a))
    assert isinstance(back, Announce) and back.load.speed == GPU.speed()
    # A three-field load (a node from before the field) is a load of unknown speed.
    old = [1, 1, "p", 2, 1, 7, 0, [1, 2, 3], [], [], False, 0]
    import msgpack

    legacy = decode(msgpack.packb(old, use_bin_type=True))
    assert isinstance(legacy, Announce) and legacy.load.speed == ()


def test_the_cost_model_round_trips_through_its_announced_speed() -> None:
    for costs in (DEFAULT_COSTS, GPU, COST_PRESETS["batched"]):
        again = costs.at_speed(costs.speed())
        assert again.speed() == costs.speed()
        assert again.prefill_s(437, 100, 0) == pytest.approx(costs.prefill_s(437, 100, 0))
    fast = DEFAULT_COSTS.at_speed(GPU.speed())
    assert fast.prefill_s_per_token == pytest.approx(GPU.prefill_s_per_token)


def _remote(peer: str, speed: tuple[int, ...], queued: int = 0) -> Candidate:
    return Candidate(PeerId(peer), False, 0, Load(queued, 0, 1, speed), 0.01, 1.0)


def test_cost_estimates_each_peer_at_its_announced_speed() -> None:
    policy = CostPolicy(DEFAULT_COSTS)
    local = Candidate(PeerId("me"), True, 0, Load(1, 1, 1, DEFAULT_COSTS.speed()), 0.0, 0.0)
    request = RouteRequest(prompt_tokens=437, max_tokens=8)
    slow = _remote("slow", DEFAULT_COSTS.speed())
    fast = _remote("fast", GPU.speed())
    unknown = _remote("old", ())  # no speed announced: estimated as this node's own
    decision = policy.choose(request, [local, slow, unknown, fast], random.Random(1))
    assert decision.target == "fast"
    # The fast peer's estimate is its own prefill, not this node's.
    assert decision.estimated_ttft_s == pytest.approx(0.01 + GPU.prefill_s(437, 0), rel=1e-6)
    assert policy.estimate(request, unknown)[0] == pytest.approx(policy.estimate(request, slow)[0])
    # Even with two requests queued there, the fast peer beats an idle slow one.
    busy_fast = _remote("fast", GPU.speed(), queued=2)
    assert policy.choose(request, [local, slow, busy_fast], random.Random(1)).target == "fast"


def test_the_mix_gives_exact_shares_and_is_checked() -> None:
    cfg = SimConfig(nodes=8, requests=10, mix="gpu:0.25,default:0.75", seed=4)
    names = [node_class(cfg, i).name for i in range(8)]  # type: ignore[union-attr]
    assert names.count("gpu") == 2 and names.count("default") == 6
    assert node_costs(cfg, names.index("gpu")) == GPU
    classes = parse_mix("gpu:1:32768,default:3", 8192)
    assert [(c.name, c.share, c.cache_tokens) for c in classes] == [
        ("gpu", 0.25, 32768), ("default", 0.75, 8192)
    ]
    for bad in ("tpu:1", "gpu", "gpu:-1", "gpu:1,gpu:2"):
        with pytest.raises(ConfigError):
            SimConfig(mix=bad)


def test_a_mix_file(tmp_path) -> None:
    path = tmp_path / "mix.json"
    path.write_text(json.dumps([
        {"name": "fast", "share": 1, "costs": "gpu", "cache_tokens": 4096},
        {"name": "slow", "share": 1, "costs": DEFAULT_COSTS.to_dict()},
    ]))
    classes = parse_mix(str(path), None)
    assert [c.name for c in classes] == ["fast", "slow"] and classes[0].costs == GPU
    assert classes[1].cache_tokens is None


def test_a_fast_node_next_to_slow_ones_receives_more_traffic_under_cost() -> None:
    # One GPU node among seven CPU ones: `cost` sends it far more than its eighth, because
    # every node estimates it at its announced speed; `least_loaded`, blind to speed, does not.
    base = dict(nodes=8, requests=500, rate=0.25, mix="gpu:0.125,default:0.875", seed=2,
                skew="zipf:1.0")
    _, cost = simulate(SimConfig(policy="cost", **base), check=True)
    gpu = cost["mix"]["gpu"]
    assert gpu["nodes"] == 1
    assert gpu["served_share"] > 0.4
    assert gpu["served_per_node"] > 3 * cost["mix"]["default"]["served_per_node"]
    _, blind = simulate(SimConfig(policy="least_loaded", **base), check=True)
    assert blind["mix"]["gpu"]["served_share"] < gpu["served_share"] / 2


def test_the_node_announces_its_own_speed() -> None:
    from peerinfer.core.node import NodeConfig, NodeCore, Publish
    from peerinfer.core.prefix import PrefixHasher

    core = NodeCore(NodeConfig(PeerId("gpu-node"), costs=GPU), PrefixHasher(b"m"), rng=random.Random(0))
    published = [e for e in core.tick(0.0) if isinstance(e, Publish)]
    assert published and published[0].announce.load.speed == GPU.speed()
    assert core.load().speed == GPU.speed()


def test_the_llamacpp_preset_is_the_engines_calibration_and_runs_batched_in_a_mix() -> None:
    from peerinfer.core.costmodel import LLAMACPP_COSTS
    from peerinfer.sim.costs import load_costs

    llama, hf = COST_PRESETS["llamacpp"], COST_PRESETS["transformers"]
    assert load_costs("llamacpp") is llama == LLAMACPP_COSTS
    # As measured: it batches (8 slots, step times by batch size), decodes faster than the
    # Transformers preset and prefills slower, and a batch of 8 gains little over one request
    # (no batched Q4_1 kernel on the measuring CPU).
    assert llama.slots == 8 and [n for n, _ in llama.decode_step_s_by_batch] == [1, 2, 4, 8]
    assert llama.decode_s_per_token < hf.decode_s_per_token
    assert llama.prefill_s_per_token > hf.prefill_s_per_token
    assert 8 / llama.decode_step_s(8) < 2 * (1 / llama.decode_step_s(1))
    # Used: a mix's llama.cpp nodes run on it, and its traffic is reported by class.
    cfg = SimConfig(nodes=4, requests=80, rate=0.1, mix="llamacpp:0.5,transformers:0.5", seed=3,
                    policy="cost")
    names = [node_class(cfg, i).name for i in range(4)]  # type: ignore[union-attr]
    assert names.count("llamacpp") == 2
    assert all(node_costs(cfg, i) == llama for i, n in enumerate(names) if n == "llamacpp")
    _, report = simulate(cfg, check=True)
    assert report["mix"]["llamacpp"]["nodes"] == 2
    served = report["mix"]["llamacpp"]["served_share"] + report["mix"]["transformers"]["served_share"]
    assert report["mix"]["llamacpp"]["served_share"] > 0 and served == pytest.approx(1.0)
