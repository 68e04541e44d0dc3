"""bench/cluster_floor.py: the oracle bound on the 3-node cluster bench's workload."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import cluster_floor  # noqa: E402


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
    assert "lowest oracle / random over the grid" in err
