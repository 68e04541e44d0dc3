"""bench/cluster_floor.py: the oracle bound on the 3-node cluster bench's workload."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import cluster_floor  # noqa: E402

from peerinfer.engine.simulated import SimulatedEngine  # noqa: E402
from peerinfer.sim.run import sim_requests  # noqa: E402
from peerinfer.workload import default_data_dir  # noqa: E402


def test_the_bench_point_prints_the_oracle_below_random(capsys: pytest.CaptureFixture[str]) -> None:
    assert cluster_floor.main(["--quick", "--seeds", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert (row["skew"], row["requests"], row["cache_tokens"]) == ("zipf:1.1", 40, None)
    # A central router that knows every cache must beat routing at random on a skewed workload
    # (by a wide margin: ~0.7 on 3 nodes); a broken oracle or a swapped column would not.
    assert 0.2 < row["oracle_over_random"] < 0.95
    assert row["cost_over_random"] == pytest.approx(row["oracle_over_random"] * row["cost_over_oracle"], abs=0.01)
    assert row["random_ttft_mean_s"] > 0
    # The floor bounds every policy, the oracle included; and it is far above nothing (the
    # first request of each subject pays a full prefill in it).
    assert 0.3 < row["floor_over_random"] <= row["oracle_over_random"]
    assert "lowest floor / random where the caches hold everything: 0." in err


def test_the_floor_charges_a_prompt_only_for_what_no_earlier_prompt_shares() -> None:
    full = default_data_dir()  # None: the packaged excerpt
    config = cluster_floor.point_config("random", "zipf:1.1", 40, None, 0.035, 1, 3, None if full is None else str(full))
    requests = sim_requests(config, SimulatedEngine(costs=config.costs))
    costs = config.costs
    cold = sum(costs.prefill_s(len(r.tokens), 0) for r in requests) / len(requests)
    floor = cluster_floor.floor_ttft(config)
    # Subjects repeat under Zipf 1.1, so most requests find their 5-shot prefix; the first one
    # finds nothing.
    assert floor < 0.6 * cold
    first = requests[0]
    assert floor * len(requests) >= costs.prefill_s(len(first.tokens), 0)
