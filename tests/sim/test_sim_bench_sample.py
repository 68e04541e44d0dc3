"""bench/sim_bench.py's --sample view and its rows' announcement bytes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import sim_bench  # noqa: E402


def test_sample_prints_where_the_cpu_went_beside_the_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert sim_bench.main(["--nodes", "6", "--requests", "150", "--json", "--sample"]) == 0
    out, err = capsys.readouterr()
    row = json.loads(out)["runs"][0]
    assert row["announce_bytes"] > 0 and row["announce_deliveries"] > 0
    head, _, rest = err.partition("\nself:\n")
    assert int(head.split()[0]) > 0  # samples taken
    own, _, inclusive = rest.partition("\ninclusive:\n")
    assert "simulator.py:run" in inclusive or "kernel.py:_run" in inclusive
    shares = [float(line.split("%")[0]) for line in own.splitlines()]
    # Each share is printed to 0.01 %, so their sum may pass 100 by half that per line.
    assert shares and sum(shares) <= 100.0 + 0.005 * len(shares) + 1e-9
