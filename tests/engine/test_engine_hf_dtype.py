"""``--dtype``: the rule ``auto`` follows, the CLI's plumbing, and the engine in bfloat16."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from peerinfer import cli  # noqa: E402
from peerinfer.core.messages import SamplingParams  # noqa: E402
from peerinfer.core.prefix import PrefixHasher  # noqa: E402
from peerinfer.engine import Tokens  # noqa: E402
from peerinfer.engine.batch import BatchScheduler  # noqa: E402
from peerinfer.engine.hf import (  # noqa: E402
    DTYPE_CHOICES,
    TransformersEngine,
    _pick_dtype,
    auto_dtype,
    cpu_flags,
)
from peerinfer.errors import ConfigError, PeerInferError  # noqa: E402
from tests.engine.test_engine_hf import _make_tiny_model  # noqa: E402

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma"})  # this project's CI machine (AMD Zen 3)


def test_auto_picks_bfloat16_on_a_cpu_only_with_native_bf16_arithmetic() -> None:
    assert auto_dtype("cpu", flags=AVX2_ONLY) == torch.float32
    assert auto_dtype("cpu", flags=AVX2_ONLY | {"avx512f", "avx512bw"}) == torch.float32
    assert auto_dtype("cpu", flags=AVX2_ONLY | {"avx512f", "avx512_bf16"}) == torch.bfloat16
    assert auto_dtype("cpu", flags=AVX2_ONLY | {"amx_tile", "amx_bf16"}) == torch.bfloat16
    assert auto_dtype("cpu") == torch.float32  # flags unknown (not Linux): the safe choice


def test_auto_picks_bfloat16_on_cuda_where_supported_else_float16() -> None:
    assert auto_dtype("cuda", cuda_bf16=True) == torch.bfloat16
    assert auto_dtype("cuda", cuda_bf16=False) == torch.float16
    assert auto_dtype("mps", flags=frozenset({"amx_bf16"})) == torch.float32


def test_pick_dtype_applies_the_rule_to_this_machine_and_names_the_choices() -> None:
    cpu = torch.device("cpu")
    assert _pick_dtype(None, cpu) == _pick_dtype("auto", cpu) == auto_dtype("cpu", flags=cpu_flags())
    assert [_pick_dtype(name, cpu) for name in DTYPE_CHOICES[1:]] == [
        torch.float32, torch.bfloat16, torch.float16,
    ]
    with pytest.raises(ConfigError, match="auto, float32, bfloat16, float16"):
        _pick_dtype("float8", cpu)


def test_the_cli_offers_the_engines_choices_and_passes_dtype_to_the_engine() -> None:
    assert cli.DTYPE_CHOICES == DTYPE_CHOICES
    parser = cli.build_parser()
    args = parser.parse_args(["node", "--dtype", "bfloat16", "--threads", "1"])
    assert cli._engine_options(args, costs=None) == {"threads": 1, "dtype": "bfloat16"}
    assert "dtype" not in cli._engine_options(parser.parse_args(["node"]), costs=None)
    with pytest.raises(SystemExit):
        parser.parse_args(["node", "--dtype", "int4"])
    calibrate = parser.parse_args(["calibrate", "--dtype", "float16"])
    assert calibrate.dtype == "float16"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-dtype")
    _make_tiny_model(directory)
    return directory


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_engine_serves_batches_in_bfloat16(tiny_dir: Path, one_thread: None) -> None:
    fp32 = TransformersEngine(tiny_dir, device="cpu", dtype="float32")
    bf16 = TransformersEngine(tiny_dir, device="cpu", dtype="bfloat16")
    try:
        assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
        assert bf16.kv_bytes_per_token * 2 == fp32.kv_bytes_per_token
        assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
        bf16.configure_cache(PrefixHasher(bf16.fingerprint, block_size=4))
        sched = BatchScheduler(bf16, max_running=3, prefill_chunk_tokens=64)
        prompts = {k: [7 + k, 30, 31, 32, 33, 34, 35, 36 + k] for k in range(3)}
        for k, p in prompts.items():
            sched.submit(k, p, SamplingParams(max_tokens=5))
        got: dict[object, list[int]] = {k: [] for k in prompts}
        for _ in range(100):
            if sched.idle:
                break
            for key, ev in sched.step():
                assert not isinstance(ev, PeerInferError), ev
                if isinstance(ev, Tokens):
                    got[key].extend(ev.token_ids)
        assert sched.idle and all(len(t) == 5 for t in got.values())
        assert sched.statistics().prefill_batches == 1  # the three prefilled together
        # The first token, right after the batched prefill, is the lone bfloat16 run's.
        for k, p in prompts.items():
            alone = [t for ev in bf16.generate(p, SamplingParams(max_tokens=5))
                     if isinstance(ev, Tokens) for t in ev.token_ids]
            assert got[k][:1] == alone[:1]
    finally:
        fp32.close()
        bf16.close()
