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


def test_decode_during_prefill_counts_overlap_on_the_same_node_once():
    out = cluster_bench.Outcome
    # a decodes from 2 to 6; b and c wait for their first tokens on a's node over 3-5 and
    # 4-7 (their union covers 3-6: 3 of a's 4 s); d's wait on another node does not count.
    a = out(0, 0, 0.0, sent_s=0.0, ttft_s=2.0, latency_s=6.0, served_by="n1")
    b = out(1, 0, 0.0, sent_s=3.0, ttft_s=2.0, latency_s=2.0, served_by="n1")
    c = out(2, 0, 0.0, sent_s=4.0, ttft_s=3.0, latency_s=3.0, served_by="n1")
    d = out(3, 0, 0.0, sent_s=2.0, ttft_s=4.0, latency_s=4.0, served_by="n2")
    assert cluster_bench._decode_during_prefill([a, b, c, d]) == pytest.approx(3.0 / 4.0)
    assert cluster_bench._decode_during_prefill([a, d]) == 0.0
