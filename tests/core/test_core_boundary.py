"""The import boundary of the sans-IO core, as Python sees it: importing every core module loads
no I/O or ML library. (Which peerinfer modules core may import: tests/test_import_graph.py;
the error tree's public names: tests/test_public_api.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("trio", "libp2p", "torch", "transformers")
# The core may use the standard library and these, nothing else.
# cython_runtime comes with msgpack's compiled extension; mypy_extensions marks the classes the
# compiled core leaves as Python (peerinfer/native.py).
ALLOWED_THIRD_PARTY = {"peerinfer", "msgpack", "cbor2", "cython_runtime", "mypy_extensions"}

# (The docstring is read from the source, found by the module's name: a compiled module keeps
# none, and may have a wrong __file__, tests/sourcedoc.py.)
_PROBE = """
import ast, importlib, json, pathlib, pkgutil, sys
before = set(sys.modules)
import peerinfer.core
names = ["peerinfer.core"]
for info in pkgutil.walk_packages(peerinfer.core.__path__, "peerinfer.core."):
    importlib.import_module(info.name)
    names.append(info.name)
def doc(name):
    base = pathlib.Path(peerinfer.__file__).parent.parent.joinpath(*name.split("."))
    source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    return ast.get_docstring(ast.parse(source.read_text())) or ""
docless = [n for n in names if not doc(n).strip()]
loaded = sorted(set(sys.modules) - before)
print(json.dumps({"modules": names, "loaded": loaded, "docless": docless}))
"""


def _import_core_in_a_fresh_interpreter() -> dict[str, list[str]]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_importing_every_core_module_loads_no_io_or_ml_library() -> None:
    probe = _import_core_in_a_fresh_interpreter()
    assert "peerinfer.core.messages" in probe["modules"]
    assert "peerinfer.core.prefix" in probe["modules"]
    roots = {name.split(".")[0] for name in probe["loaded"]}
    assert not roots & set(FORBIDDEN), sorted(roots & set(FORBIDDEN))
    third_party = {r for r in roots if r not in sys.stdlib_module_names and not r.startswith("_")}
    assert third_party <= ALLOWED_THIRD_PARTY, sorted(third_party - ALLOWED_THIRD_PARTY)


def test_every_core_module_opens_with_a_docstring() -> None:
    assert _import_core_in_a_fresh_interpreter()["docless"] == []


def test_the_probe_would_see_a_forbidden_import() -> None:
    """The subprocess check can fail: a module that imports trio shows up in its report."""
    result = subprocess.run(
        [sys.executable, "-c", "import sys, trio; print('trio' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.stdout.strip() == "True"

