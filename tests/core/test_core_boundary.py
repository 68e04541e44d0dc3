"""The import boundary of the sans-IO core, and the pinned public names of the error tree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import peerinfer.errors as errors

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("trio", "libp2p", "torch", "transformers")
# The core may use the standard library and these, nothing else.
# cython_runtime comes with msgpack's compiled extension.
ALLOWED_THIRD_PARTY = {"peerinfer", "msgpack", "cbor2", "cython_runtime"}

_PROBE = """
import importlib, json, pkgutil, sys
before = set(sys.modules)
import peerinfer.core
names = ["peerinfer.core"]
for info in pkgutil.walk_packages(peerinfer.core.__path__, "peerinfer.core."):
    importlib.import_module(info.name)
    names.append(info.name)
docless = [n for n in names if not (sys.modules[n].__doc__ or "").strip()]
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


ERROR_TREE = {
    "PeerInferError": "Exception",
    "LocalError": "PeerInferError",
    "ConfigError": "LocalError",
    "InvalidRequestError": "LocalError",
    "ClosedError": "LocalError",
    "RemoteError": "PeerInferError",
    "ProtocolError": "RemoteError",
    "PeerUnavailableError": "RemoteError",
    "PeerBusyError": "RemoteError",
    "RequestTimeoutError": "RemoteError",
    "EngineError": "PeerInferError",
}


#: The error table beside the tree (wire code -> exception, HTTP status, forward reason).
ERROR_TABLE_NAMES = {"ERROR_TABLE", "ErrorKind", "error_from_code", "error_kind"}


def test_the_public_names_of_errors_are_pinned() -> None:
    assert sorted(errors.__all__) == sorted(set(ERROR_TREE) | ERROR_TABLE_NAMES)
    public = {name for name in vars(errors) if not name.startswith("_") and name != "annotations"}
    assert public == set(ERROR_TREE) | ERROR_TABLE_NAMES


def test_the_error_tree_has_its_documented_shape() -> None:
    for name, parent in ERROR_TREE.items():
        cls = getattr(errors, name)
        assert [base.__name__ for base in cls.__bases__] == [parent], name
        assert name in (errors.__doc__ or ""), f"{name} missing from the drawn tree"
