"""Fixtures shared by the engine tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from peerinfer.engine.base import Engine


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """A Transformers engine over a tiny llama built from a config (one thread), per module, in
    float32: the tests that use it hold it to float32's exactness and formats, whatever the CPU
    (``dtype="auto"`` picks bfloat16 on a CPU with native bfloat16 arithmetic)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from peerinfer.engine.hf import TransformersEngine
    from tests.engine.test_engine_hf import _make_tiny_model

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    directory: Path = tmp_path_factory.mktemp("tiny-llama")
    _make_tiny_model(directory)
    engine = TransformersEngine(directory, device="cpu", dtype="float32")
    yield engine
    engine.close()
    torch.set_num_threads(before)
