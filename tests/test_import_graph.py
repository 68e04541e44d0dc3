"""The import graph of peerinfer, read from the source with ast: imports point inward.

- No cycles between modules. Every import counts: under ``TYPE_CHECKING``, inside functions,
  relative ones (resolved). A package's ``__init__`` is a module of its own; a module importing
  its own package's ``__init__`` is not counted (the re-export idiom). These are the rules of
  /work/shared/tools/structure_check.py, so the two agree on the count.
- The sans-IO core imports nothing of peerinfer outside ``peerinfer.core``, ``peerinfer.errors``
  and ``peerinfer.types``. (Which third-party libraries it may load: tests/core/test_core_boundary.py.)
- Once ``peerinfer/core/node/`` is a package, its sub-machines (every module but ``machine``,
  ``events``, ``config`` and ``__init__``) import no other module of it but ``events`` and
  ``config``: they exchange values through the composer.

The first two tests below run the checks on small packages written for them, so a check that
could never fail would show there.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CORE = "peerinfer.core"
CORE_MAY_IMPORT = ("peerinfer.errors", "peerinfer.types")
NODE_PACKAGE = "peerinfer.core.node"
NODE_SHARED = {"machine", "events", "config"}  # the composer and what every sub-machine may read


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    path: Path
    line: int
    #: the target is the package of an ``from package import submodule`` (its __init__ runs
    #: first, so it counts for cycles; the submodule is an import of its own)
    as_parent: bool = False

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line}"


def modules(root: Path, package: str = "peerinfer") -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _known(name: str, mods: dict[str, Path]) -> str | None:
    """The module ``name`` lands in: itself, or the nearest enclosing module we have."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _from_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imports(root: Path, package: str = "peerinfer") -> Iterator[Import]:
    """Every import of one of ``package``'s modules by another, wherever it is written."""
    mods = modules(root, package)
    for module, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            found: list[tuple[str, bool]] = []
            if isinstance(node, ast.Import):
                found = [(alias.name, False) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _from_base(module, is_package, node)
                names = [f"{base}.{alias.name}" for alias in node.names]
                parent_only = all(n in mods for n in names)
                found = [(base, parent_only)] + [(n, False) for n in names]
            for name, as_parent in found:
                target = _known(name, mods)
                if target is None or target == module:
                    continue
                # A module importing its own package's __init__: the re-export idiom, no tie.
                if module.startswith(target + ".") and mods[target].name == "__init__.py":
                    continue
                yield Import(module, target, path, node.lineno, as_parent)


def cycles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def describe_cycles(edges: list[Import], root: Path) -> str:
    """Each cycle with the imports that tie it, file:line, for the failure message."""
    lines = []
    for n, component in enumerate(cycles(edges), 1):
        members = set(component)
        lines.append(f"cycle {n} ({len(component)} modules): {' <-> '.join(component)}")
        ties = sorted({(e.importer, e.target, e.where(root)) for e in edges
                       if e.importer in members and e.target in members})
        lines += [f"    {importer} -> {target}  ({where})" for importer, target, where in ties]
    return "\n".join(lines)


def core_violations(edges: list[Import], root: Path, core: str = CORE,
                    allowed: tuple[str, ...] = CORE_MAY_IMPORT) -> list[str]:
    return sorted({
        f"{e.importer} imports {e.target} ({e.where(root)})" for e in edges
        if (e.importer == core or e.importer.startswith(core + "."))
        and not (e.target == core or e.target.startswith(core + ".") or e.target in allowed)
    })


def sub_machine_violations(edges: list[Import], root: Path, package: str = NODE_PACKAGE,
                           shared: set[str] = NODE_SHARED) -> list[str]:
    def sub_machine(module: str) -> bool:
        head, _, leaf = module.rpartition(".")
        return head == package and leaf not in shared

    may_read = {f"{package}.{leaf}" for leaf in shared - {"machine"}}
    return sorted({
        f"{e.importer} imports {e.target} ({e.where(root)})" for e in edges
        if sub_machine(e.importer) and not e.as_parent
        and (e.target == package or e.target.startswith(package + "."))
        and e.target not in may_read
    })


# ------------------------------------------------------------------ the checks, checked


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_see_a_type_checking_cycle_a_relative_import_and_a_core_escape(tmp_path: Path) -> None:
    _write(tmp_path, {
        "peerinfer/__init__.py": "",
        "peerinfer/errors.py": "",
        "peerinfer/node/__init__.py": "from peerinfer.node.runtime import Node\n",
        "peerinfer/node/runtime.py": "from peerinfer.node import helpers\nfrom ..http import app\n",
        "peerinfer/node/helpers.py": "import peerinfer.errors\n",
        "peerinfer/http/__init__.py": "",
        "peerinfer/http/app.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from peerinfer.node.runtime import Node\n"
        ),
        "peerinfer/core/__init__.py": "",
        "peerinfer/core/rules.py": "from peerinfer.errors import X\n\ndef f():\n    import peerinfer.http.app\n",
    })
    edges = list(imports(tmp_path))
    assert cycles(edges) == [["peerinfer.http.app", "peerinfer.node.runtime"]]
    message = describe_cycles(edges, tmp_path)
    assert "peerinfer.http.app -> peerinfer.node.runtime  (peerinfer/http/app.py:3)" in message
    assert "peerinfer.node.runtime -> peerinfer.http.app  (peerinfer/node/runtime.py:2)" in message
    # node/__init__ imports runtime, runtime imports its own package: the re-export idiom, no cycle.
    assert core_violations(edges, tmp_path) == [
        "peerinfer.core.rules imports peerinfer.http.app (peerinfer/core/rules.py:4)"
    ]


def test_the_sub_machine_check_allows_events_and_config_only(tmp_path: Path) -> None:
    _write(tmp_path, {
        "peerinfer/__init__.py": "",
        "peerinfer/core/__init__.py": "",
        "peerinfer/core/node/__init__.py": "from .machine import NodeCore\n",
        "peerinfer/core/node/machine.py": "from . import requests, trust\nfrom .events import E\n",
        "peerinfer/core/node/events.py": "",
        "peerinfer/core/node/config.py": "",
        "peerinfer/core/node/requests.py": "from . import events, config\nfrom ..index import PeerIndex\n",
        "peerinfer/core/node/trust.py": "from .requests import Phase\n",
        "peerinfer/core/node/members.py": "from peerinfer.core.node.machine import NodeCore\n",
        "peerinfer/core/index.py": "",
    })
    edges = list(imports(tmp_path))
    assert sub_machine_violations(edges, tmp_path) == [
        "peerinfer.core.node.members imports peerinfer.core.node.machine (peerinfer/core/node/members.py:1)",
        "peerinfer.core.node.trust imports peerinfer.core.node.requests (peerinfer/core/node/trust.py:1)",
    ]


# ------------------------------------------------------------------ peerinfer itself


def test_no_import_cycles_between_peerinfers_modules() -> None:
    edges = list(imports(REPO))
    found = cycles(edges)
    assert not found, (
        f"{len(found)} import cycle(s), {sum(map(len, found))} modules:\n"
        + describe_cycles(edges, REPO)
    )


def test_core_imports_nothing_of_peerinfer_outside_core_errors_and_types() -> None:
    assert modules(REPO).get("peerinfer.core.messages"), "the check must see the core"
    violations = core_violations(list(imports(REPO)), REPO)
    assert not violations, "core imports outside itself:\n" + "\n".join(violations)


def test_no_core_node_sub_machine_imports_another() -> None:
    if not (REPO / "peerinfer" / "core" / "node" / "__init__.py").exists():
        pytest.skip("core/node.py is still one module: no sub-machines to keep apart yet")
    violations = sub_machine_violations(list(imports(REPO)), REPO)
    assert not violations, (
        "core/node sub-machines exchange values through machine.py, never import each other:\n"
        + "\n".join(violations)
    )
