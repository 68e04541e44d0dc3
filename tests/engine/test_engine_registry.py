"""Choosing engines by name, entry point or module:Class; the example custom backend."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from peerinfer.core.messages import SamplingParams
from peerinfer.engine import (
    Engine,
    Finished,
    SimulatedEngine,
    Started,
    Tokens,
    available_engines,
    load_engine,
    resolve_engine_class,
)
from peerinfer.engine.calibrate import calibrate
from peerinfer.errors import ConfigError, InvalidRequestError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_backend.py"


def _text(engine: Engine, prompt: str, **params: object) -> tuple[str, Finished]:
    events = list(engine.generate(engine.tokenize(prompt), SamplingParams(**params)))  # type: ignore[arg-type]
    assert isinstance(events[0], Started) and isinstance(events[-1], Finished)
    return "".join(ev.text for ev in events if isinstance(ev, Tokens)), events[-1]


def test_builtin_names():
    engine = load_engine("simulated", time_scale=0.0)
    assert isinstance(engine, SimulatedEngine)
    assert {"hf", "simulated"} <= set(available_engines())


def test_choosing_simulated_never_imports_torch():
    code = (
        "import sys; from peerinfer.engine import load_engine;"
        "e = load_engine('simulated', time_scale=0.0);"
        "list(e.generate(e.tokenize('hi there'), None));"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_hf_resolves_to_the_transformers_engine():
    pytest.importorskip("torch")
    cls = resolve_engine_class("hf")
    assert cls.__name__ == "TransformersEngine" and issubclass(cls, Engine)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope", "unknown engine 'nope': choose one of"),
        ("", "engine name is required"),
        ("no.such.module:Engine", "cannot import"),
        ("peerinfer.engine.simulated:Missing", "has no attribute"),
        ("os.path:join", "not a peerinfer.engine.Engine subclass"),
        ("peerinfer.engine.base:Engine", "does not implement"),
        ("missing/file.py:Engine", "no file"),
        ("peerinfer.engine.simulated:", "expected 'module:Class'"),
    ],
)
def test_unknown_or_wrong_engines_are_config_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        load_engine(spec)


def test_unknown_engine_lists_the_choices():
    with pytest.raises(ConfigError) as info:
        load_engine("llama.cpp")
    assert "hf" in str(info.value) and "simulated" in str(info.value)


def test_options_the_engine_does_not_take_are_config_errors():
    with pytest.raises(ConfigError, match="does not take"):
        load_engine("simulated", no_such_option=1)


def test_example_backend_by_file_path_generates():
    engine = load_engine(f"{EXAMPLE}:EchoEngine")
    text, done = _text(engine, "héllo wörld. ", max_tokens=20, stop=("rld",))
    assert text == "héllo wö" and done.finish_reason == "stop"
    assert done.cached_tokens == 0 and done.cache_added == ()
    text, done = _text(engine, "ab", max_tokens=5)
    assert text == "ababa" and done.finish_reason == "length"
    with pytest.raises(InvalidRequestError):
        engine.generate([], SamplingParams())


def test_example_backend_by_module_path_and_cancellation(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    engine = load_engine("custom_backend:EchoEngine", delay_s=0.001)
    cancel = threading.Event()
    got = []
    for ev in engine.generate(engine.tokenize("xyz"), SamplingParams(max_tokens=1000), cancel):
        if isinstance(ev, Tokens):
            got.extend(ev.token_ids)
            if len(got) == 4:
                cancel.set()
        elif isinstance(ev, Finished):
            assert ev.finish_reason == "cancelled" and ev.completion_tokens == 4
    assert bytes(got) == b"xyzx"


def test_example_backend_can_be_calibrated():
    engine = load_engine(f"{EXAMPLE}:EchoEngine")
    costs = calibrate(engine, lengths=(8, 16), prefixes=(16, 32), decode_tokens=4, repeats=1)
    assert costs.slots == 1 and costs.decode_s_per_token >= 0


def test_entry_point_registration(tmp_path, monkeypatch):
    """An installed package registers a backend under a name of its own."""
    (tmp_path / "echo_plugin.py").write_text(EXAMPLE.read_text(encoding="utf-8"), encoding="utf-8")
    info = tmp_path / "echo_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[peerinfer.engines]\necho = echo_plugin:EchoEngine\nbroken = echo_plugin:Nothing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert available_engines()["echo"] == "echo_plugin:EchoEngine"
    engine = load_engine("echo")
    assert _text(engine, "ok", max_tokens=3)[0] == "oko"
    with pytest.raises(ConfigError, match="entry point"):
        load_engine("broken")


def test_calibrate_command_writes_a_cost_model(tmp_path, capsys):
    import json

    from peerinfer.core.costmodel import CostModel
    from peerinfer.engine.calibrate import main_calibrate

    out = tmp_path / "costs.json"
    assert main_calibrate(["--engine", f"{EXAMPLE}:EchoEngine", "--quick", "--json", "--output", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    costs = CostModel.from_dict(printed["costs"])
    assert costs.slots == 1 and printed["model"] == "EchoEngine"
    with pytest.raises(ConfigError):
        main_calibrate(["--engine", "nope"])


def test_calibrate_passes_gpu_layers_to_the_engine():
    from peerinfer.engine.calibrate import main_calibrate

    # The echo engine takes no gpu_layers: the option reached its constructor (llamacpp takes it).
    with pytest.raises(ConfigError, match="gpu_layers"):
        main_calibrate(["--engine", f"{EXAMPLE}:EchoEngine", "--gpu-layers", "2", "--quick"])
