"""The compiled core (peerinfer/native.py) decides exactly as its source does, and is used only
where it is current.

make test builds it (``make native``) and sets PEERINFER_REQUIRE_NATIVE=1, so there these tests
fail, not skip, without it; elsewhere the comparison needs a build to compare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peerinfer import native

REPO = Path(__file__).resolve().parents[2]

# Runs that reach the most core code: the cost policy on a skewed load, churn (crashes, joins,
# lost caches), gossipsub's mesh with pulls of KV from peers, and longest_prefix on a uniform load.
_PROBE = r"""
import hashlib, json, sys
from peerinfer import native
from peerinfer.sim import SimConfig, simulate
import peerinfer.core.radix, peerinfer.core.node.machine
configs = [
    SimConfig(nodes=16, requests=900, cache_tokens=4096, delay_ms="5", skew="zipf:1.0",
              policy="cost", seed=4),
    SimConfig(nodes=12, requests=700, cache_tokens=2048, delay_ms="uniform:2:30", skew="zipf:1.2",
              policy="cost", seed=5, crash_rate=30.0, join_rate=30.0),
    SimConfig(nodes=10, requests=500, cache_tokens=4096, delay_ms="1", skew="zipf:1.0",
              policy="cost", seed=6, gossip="mesh", pull="auto"),
    SimConfig(nodes=8, requests=400, cache_tokens=4096, delay_ms="5", skew="uniform",
              policy="longest_prefix", seed=7),
]
digests = []
for config in configs:
    sim, summary = simulate(config)
    record = repr((sim.server, sim.forwards, sim.decided, sim.estimate, sim.expected_cached,
                   sim.cached, sim.status, sim.first, sim.finish,
                   [c.statistics() for c in sim.cores if hasattr(c, "statistics")]))
    digests.append([hashlib.sha256(record.encode()).hexdigest(), summary["events"]])
print(json.dumps({
    "core": native.describe(),
    "files": [peerinfer.core.radix.__file__, peerinfer.core.node.machine.__file__],
    "digests": digests,
}))
"""


def _run(pure: bool) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "PEERINFER_PURE"}
    env["PYTHONPATH"] = str(REPO)
    if pure:
        env["PEERINFER_PURE"] = "1"
    result = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def _require_build() -> None:
    if native.compiled():
        return
    if os.environ.get("PEERINFER_REQUIRE_NATIVE") == "1":
        pytest.fail(f"the compiled core is required here (make native): {native.describe()}")
    pytest.skip(f"nothing compiled to compare: {native.describe()}")


@pytest.mark.slow
def test_the_compiled_core_decides_as_the_pure_one() -> None:
    _require_build()
    compiled, pure = _run(pure=False), _run(pure=True)
    assert compiled["core"] == "compiled (mypyc)"
    assert all(str(f).endswith(".so") for f in compiled["files"]), compiled["files"]  # type: ignore[attr-defined]
    assert pure["core"] == "pure Python (PEERINFER_PURE is set)"
    assert all(str(f).endswith(".py") for f in pure["files"]), pure["files"]  # type: ignore[attr-defined]
    assert compiled["digests"] == pure["digests"]


def test_a_changed_source_makes_the_build_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """All or none: one source edited since the build, or one extension gone, and nothing
    compiled loads (mypyc's modules call one another directly)."""
    source = tmp_path / "peerinfer" / "core" / "thing.py"
    extension = tmp_path / "peerinfer" / "core" / "thing.cpython-311-x86_64-linux-gnu.so"
    source.parent.mkdir(parents=True)
    source.write_text('"""A module."""\n')
    extension.write_bytes(b"\x7fELF")
    manifest = tmp_path / "native_manifest.json"
    manifest.write_text(json.dumps({
        "cache_tag": sys.implementation.cache_tag,
        "sources": {"peerinfer/core/thing.py": native.source_hash(source)},
        "extensions": ["peerinfer/core/thing.cpython-311-x86_64-linux-gnu.so"],
    }))
    monkeypatch.setattr(native, "MANIFEST", manifest)
    monkeypatch.setattr(native, "_ROOT", tmp_path)
    monkeypatch.delenv("PEERINFER_PURE", raising=False)
    assert native._reason_for_pure() == ""
    monkeypatch.setenv("PEERINFER_PURE", "1")
    assert native._reason_for_pure() == "PEERINFER_PURE is set"
    monkeypatch.delenv("PEERINFER_PURE")
    source.write_text('"""A module, edited."""\n')
    assert native._reason_for_pure().startswith("stale: peerinfer/core/thing.py changed")
    source.write_text('"""A module."""\n')
    extension.unlink()
    assert native._reason_for_pure().startswith("incomplete: peerinfer/core/thing.cpython")
    manifest.write_text("{")
    assert native._reason_for_pure().startswith("unreadable native_manifest.json")
    manifest.unlink()
    assert native._reason_for_pure() == "not built (make native)"


def test_the_pure_finder_loads_sources_beside_extensions(tmp_path: Path) -> None:
    """Where the compiled modules must not load, the finder ahead of the standard ones takes
    each peerinfer module's ``.py``, though an extension of the same name sits beside it (which
    Python's own finders would prefer: here a file that is no extension at all, so loading it
    would fail)."""
    package = tmp_path / "peerinfer" / "fake"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text("WHERE = 'source'\n")
    (package / f"mod{_extension_suffix()}").write_bytes(b"not an extension")
    finder = native._SourceFirst()
    spec = finder.find_spec("peerinfer.fake.mod", [str(package)])
    assert spec is not None and spec.origin == str(package / "mod.py")
    assert finder.find_spec("peerinfer.fake", [str(tmp_path / "peerinfer")]) is None  # a package
    assert finder.find_spec("json.decoder", [str(package)]) is None  # not peerinfer's


def _extension_suffix() -> str:
    import importlib.machinery

    return importlib.machinery.EXTENSION_SUFFIXES[0]
