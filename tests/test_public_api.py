"""The public API, pinned: what ``import peerinfer`` gives, the error tree, and the documented
entry points (the ``peerinfer`` command, the engine entry points, the names docs/ import).

A name added to or dropped from ``peerinfer.__all__`` fails here on purpose: the change is then
made knowingly, with this list, peerinfer/__init__.py's docstring and the docs in one commit.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import peerinfer
import peerinfer.errors as errors

REPO = Path(__file__).resolve().parents[1]

#: ``peerinfer.__all__``: the curated surface (peerinfer/__init__.py's docstring draws it).
PUBLIC = {
    "Client", "GenerationResult", "SyncClient", "connect",            # peerinfer.client
    "Node", "NodeOptions",                                             # peerinfer.node
    "serve_node",                                                      # peerinfer.serve
    "PeerInferError", "LocalError", "ConfigError", "InvalidRequestError", "ClosedError",
    "RemoteError", "ProtocolError", "PeerUnavailableError", "PeerBusyError",
    "RequestTimeoutError", "EngineError",                              # peerinfer.errors
    "__version__",
}

#: Where each lazily loaded name lives (it must be that very object, not a copy).
LAZY_HOMES = {
    "Client": "peerinfer.client",
    "GenerationResult": "peerinfer.client",
    "SyncClient": "peerinfer.client",
    "connect": "peerinfer.client",
    "Node": "peerinfer.node",
    "NodeOptions": "peerinfer.node",
    "serve_node": "peerinfer.serve",
}

#: Module-level names of peerinfer/__init__.py that are not API but cannot be helped: the
#: ``from __future__`` flag and the typing helpers of its lazy loader.
NOT_API = {"annotations", "Any", "TYPE_CHECKING"}

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


def _fresh_interpreter(code: str) -> dict[str, list[str]]:
    """Run ``code`` (which prints one JSON object) in a new interpreter on this checkout."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


_IMPORT_PROBE = """
import json, sys
before = set(sys.modules)
import peerinfer
print(json.dumps({
    "loaded": sorted(set(sys.modules) - before),
    "names": sorted(n for n in vars(peerinfer) if not n.startswith("_")),
}))
"""


def test_all_is_the_pinned_list() -> None:
    assert sorted(peerinfer.__all__) == sorted(PUBLIC)
    assert len(peerinfer.__all__) == len(set(peerinfer.__all__))


def test_every_public_name_resolves_and_star_import_gives_exactly_all() -> None:
    for name in peerinfer.__all__:
        assert getattr(peerinfer, name) is not None, name
    namespace: dict[str, object] = {}
    exec("from peerinfer import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(peerinfer.__all__)


def test_lazy_names_are_the_objects_of_their_home_modules() -> None:
    for name, home in LAZY_HOMES.items():
        assert getattr(peerinfer, name) is getattr(importlib.import_module(home), name), name
        # Public homes only: nothing reaches users from a private module.
        assert not any(part.startswith("_") for part in getattr(peerinfer, name).__module__.split("."))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nodes'"):
        peerinfer.Nodes  # type: ignore[attr-defined]  # noqa: B018


def test_importing_peerinfer_loads_only_the_error_tree_and_leaks_nothing() -> None:
    """The docstring's promise: libp2p, torch, trio (and the node) load on first use only. (The
    import loads ``native`` too, which decides before any core module loads whether the compiled
    core may run.)"""
    probe = _fresh_interpreter(_IMPORT_PROBE)
    ours = [m for m in probe["loaded"] if m.split(".")[0] not in sys.stdlib_module_names]
    assert sorted(ours) == ["peerinfer", "peerinfer.errors", "peerinfer.native"], ours
    eager = PUBLIC - set(LAZY_HOMES) - {"__version__"}
    assert set(probe["names"]) == eager | NOT_API | {"errors", "native"}


def test_the_version_is_the_packages() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert peerinfer.__version__ == project["version"]


def test_the_public_names_of_errors_are_pinned() -> None:
    assert sorted(errors.__all__) == sorted(set(ERROR_TREE) | ERROR_TABLE_NAMES)
    public = {name for name in vars(errors) if not name.startswith("_") and name != "annotations"}
    assert public == set(ERROR_TREE) | ERROR_TABLE_NAMES
    for name in ERROR_TREE:
        assert getattr(peerinfer, name) is getattr(errors, name), name


def test_the_error_tree_has_its_documented_shape() -> None:
    for name, parent in ERROR_TREE.items():
        cls = getattr(errors, name)
        assert [base.__name__ for base in cls.__bases__] == [parent], name
        assert name in (errors.__doc__ or ""), f"{name} missing from the drawn tree"


def test_generation_result_has_the_fields_the_quickstart_names() -> None:
    fields = {f.name for f in dataclasses.fields(peerinfer.GenerationResult)}
    documented = {"text", "prompt_tokens", "completion_tokens", "cached_tokens", "served_by",
                  "ttft_s", "latency_s"}
    assert documented <= fields, sorted(documented - fields)


def test_the_clients_documented_entry_points() -> None:
    # ``with peerinfer.connect(addr) as c`` and ``async with peerinfer.Client.connect(addr)``.
    assert inspect.signature(peerinfer.connect).parameters["multiaddr"].kind.name == "POSITIONAL_OR_KEYWORD"
    assert callable(peerinfer.Client.connect)
    for method in ("generate", "stream", "status"):
        assert callable(getattr(peerinfer.SyncClient, method)), method
        assert callable(getattr(peerinfer.Client, method)), method


def _resolve(target: str) -> object:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_the_console_script_and_engine_entry_points_resolve() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert set(project["scripts"]) == {"peerinfer"}
    assert callable(_resolve(project["scripts"]["peerinfer"]))

    from peerinfer.engine import Engine

    engines = project["entry-points"]["peerinfer.engines"]
    assert set(engines) == {"hf", "llamacpp", "simulated"}
    for name, target in engines.items():
        cls = _resolve(target)
        assert isinstance(cls, type) and issubclass(cls, Engine), name


#: Names the docs import, by module (docs/backends.md; peerinfer.testing is a documented
#: helper package for programs built on peerinfer, see its docstring).
DOCUMENTED_IMPORTS = {
    "peerinfer.engine": {"DecodeRequest", "Engine", "Tokens", "load_engine"},
    "peerinfer.core.messages": {"SamplingParams"},
    "peerinfer.testing": {"BatchRecordingEngine", "Cluster", "ClusterError", "NodeHandle",
                          "open_cluster", "start_cluster", "wait_for", "wait_until"},
    "peerinfer.client": {"Client", "GenerationResult", "SyncClient", "connect"},
    "peerinfer.node": {"Node", "NodeOptions"},
}


@pytest.mark.parametrize("module", sorted(DOCUMENTED_IMPORTS))
def test_documented_imports_are_exported_and_public(module: str) -> None:
    mod = importlib.import_module(module)
    missing = sorted(name for name in DOCUMENTED_IMPORTS[module] if not hasattr(mod, name))
    assert not missing, f"{module} lacks {missing}"
    if not hasattr(mod, "__all__"):
        return  # a module without __all__ (core.messages): what it defines is what it exports
    exported = set(mod.__all__)
    assert DOCUMENTED_IMPORTS[module] <= exported, sorted(DOCUMENTED_IMPORTS[module] - exported)
    for name in exported:
        assert not name.startswith("_"), f"{module} exports {name}"
        assert hasattr(mod, name), f"{module}.__all__ names {name}, which it does not define"


def test_peerinfer_testing_exports_exactly_its_documented_helpers() -> None:
    import peerinfer.testing

    assert sorted(peerinfer.testing.__all__) == sorted(DOCUMENTED_IMPORTS["peerinfer.testing"])
