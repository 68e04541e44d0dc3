"""bench/engine_bench.py's node figures: the same uncached prompt through a real node and
through raw llama-cpp-python, paired."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import engine_bench  # noqa: E402

from peerinfer.engine.llamacpp import LlamaCppEngine  # noqa: E402

WORKLOAD = [
    ("a", "The following are questions about colours.\n\nThe sky is", ["x", " Grass is"]),
    ("b", "The following are questions about numbers.\n\nTwo and two make", ["x", " Three and one make"]),
]


@pytest.fixture(scope="module")
def smol() -> Iterator[LlamaCppEngine]:
    engine = LlamaCppEngine(threads=1, capacity_bytes=256 << 20, extra_buffers=False)
    yield engine
    engine.close()


def test_a_request_through_a_node_is_paired_with_the_raw_run_of_its_tokens(smol: LlamaCppEngine) -> None:
    said: list[str] = []
    out = engine_bench.node_vs_raw(smol, WORKLOAD, 4, said.append)
    rows = out["node_rows"]
    assert out["node_samples"] == len(rows) == 2 == len(said)
    for row in rows:
        # The bench refuses a prompt the node found cached or tokenized otherwise, so each row
        # is one uncached prompt, run both ways, with the tokens asked for.
        assert row["tokens"] > 10
        assert row["node_tokens"] == row["raw_tokens"] == 4
        assert row["node_ttft_s"] > 0 and row["raw_ttft_s"] > 0
    # The same prefill both ways, give or take the node's own work: far apart means the two
    # sides ran different prompts (a loose bound: the machine may be busy).
    assert 0.2 < out["node_miss_over_raw"] < 5
    assert out["node_decode_tokens_per_s"] > 0
    assert smol.radix_cache.stats().tokens > 0  # the node's requests went through this engine
