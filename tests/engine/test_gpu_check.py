"""bench/gpu_check.py: its arguments, its refusal without CUDA, and its CPU dry run (tiny model)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gpu_check  # noqa: E402

from tests.engine.test_engine_hf import _make_tiny_model  # noqa: E402


def test_bad_arguments_are_refused():
    for argv in (["--dtypes", "float8"], ["--batch-sizes", "0"], ["--batch-sizes", "x"], ["--device", "tpu"]):
        with pytest.raises(SystemExit) as exc:
            gpu_check.parse_args(argv)
        assert exc.value.code == 2


def test_quick_shrinks_every_part():
    args = gpu_check.parse_args(["--quick", "--device", "cpu"])
    assert args.batch_sizes == [1] and args.tokens <= 4 and args.agree_requests <= 3
    assert args.dtypes == ["float32", "bfloat16"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_without_cuda_it_stops_at_once_saying_why(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert gpu_check.main(["--output", str(out)]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert not out.exists()


def test_cpu_dry_run_writes_every_part(tmp_path):
    model = tmp_path / "tiny"
    _make_tiny_model(model)
    out = tmp_path / "r.json"
    before = torch.get_num_threads()
    try:
        rc = gpu_check.main(["--device", "cpu", "--quick", "--model", str(model), "--output", str(out)])
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    result = json.loads(out.read_text())
    assert set(result["dtypes"]) == {"float32", "bfloat16"}
    for part in result["dtypes"].values():
        agreement = part["agreement"]
        assert agreement["requests"] == 3
        assert agreement["equal"] + agreement["tie"] + agreement["mismatch"] == 3
        assert part["throughput"]["1"]["tokens"] > 0
        assert part["ttft"]["miss_s"] > 0 and part["ttft"]["hit_s"] > 0
    assert result["dtypes"]["float32"]["agreement"]["mismatch"] == 0


def test_llamacpp_without_a_gpu_build_stops_at_once_saying_why(tmp_path, capsys):
    llama_cpp = pytest.importorskip("llama_cpp")
    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("this llama-cpp-python build offloads to a GPU")
    out = tmp_path / "r.json"
    assert gpu_check.main(["--engine", "llamacpp", "--output", str(out)]) == 2
    assert "cannot offload" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_llamacpp_cpu_dry_run_writes_every_part(tmp_path):
    pytest.importorskip("llama_cpp")
    out = tmp_path / "r.json"
    rc = gpu_check.main(["--engine", "llamacpp", "--device", "cpu", "--quick", "--budget-s", "3600",
                         "--output", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    part = result["llamacpp"]
    assert part["gpu_layers"] == 0  # --device cpu offloads nothing
    agreement = part["agreement"]
    assert agreement["requests"] == 3
    assert agreement["equal"] + agreement["tie"] + agreement["mismatch"] == 3
    assert agreement["mismatch"] == 0
    assert part["throughput"]["1"]["tokens"] > 0
    assert part["ttft"]["miss_s"] > 0 and part["ttft"]["hit_s"] > 0
    assert max(part["ttft"]["hit_cached_tokens"]) > 0  # the warm prefix was reused
