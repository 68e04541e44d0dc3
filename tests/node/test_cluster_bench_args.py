"""bench/cluster_bench.py's --engine option: what the llama.cpp engine refuses, at once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import cluster_bench  # noqa: E402


def _refusal(argv: list[str]) -> str | None:
    args = cluster_bench.build_parser().parse_args(argv)
    return cluster_bench.engine_refusal(args, args.policies.split(","))


def test_the_simulated_engine_keeps_every_option():
    assert cluster_bench.build_parser().parse_args([]).engine == "simulated"
    assert _refusal(["--policies", "cost,random,oracle", "--sim", "--speedup", "4"]) is None


def test_llamacpp_runs_node_policies_only():
    assert _refusal(["--engine", "llamacpp", "--policies", "cost,random,least_loaded"]) is None


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--policies", "cost,oracle"], "the oracle policy"),
        (["--policies", "cost", "--sim"], "--sim"),
        (["--policies", "cost", "--speedup", "2"], "--speedup"),
    ],
)
def test_llamacpp_refuses_what_models_the_simulated_engine_in_one_line(extra, named, tmp_path):
    # A missing data directory: should the refusal not come first, the run fails at once
    # instead of starting nodes.
    with pytest.raises(SystemExit) as exc:
        cluster_bench.main(["--engine", "llamacpp", "--data", str(tmp_path / "none"), *extra])
    message = str(exc.value.code)
    assert named in message and "--engine llamacpp" in message and "\n" not in message


def test_an_unknown_engine_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        cluster_bench.build_parser().parse_args(["--engine", "hf"])
    assert exc.value.code == 2
