"""The compiled core: which of peerinfer's pure modules run as C extensions, and when.

``make native`` (``scripts/build_native.py``) compiles the typed, pure modules of
``peerinfer/core`` with mypyc into C extensions beside their sources, and writes
``native_manifest.json`` here: the hash of every source the build read. Python's import system
prefers an extension to the ``.py`` beside it, so nothing else changes. What mypyc compiles
behaves as the source does for every well-typed call; the simulator's decisions are the same,
bit for bit (tests/sim/test_native_core.py), and it runs 1.14-1.24x faster (docs/evaluation.md,
"The compiled core, kept this time").

The extensions are used only when every source the build read still has the hash it had: an
edited source with a stale extension beside it would run the old code (or, for a module left
uncompiled, compiled code built against its old constants), and since mypyc's modules call one
another directly, not through the import system, one stale module poisons all of them. So it
is all or none. Otherwise, or with ``PEERINFER_PURE=1`` (the tests that patch
core internals, which compiled classes do not allow), a finder placed ahead of the standard ones
loads every peerinfer module from its source. ``import peerinfer`` calls ``choose()`` before any
of these modules can load.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

#: where the build lists what it compiled (git ignores it, with the extensions)
MANIFEST = Path(__file__).with_name("native_manifest.json")
_ROOT = Path(__file__).resolve().parent.parent
#: why the pure modules run, or "" where the compiled ones do (set by ``choose``)
_why_pure: str | None = None


def source_hash(path: Path) -> str:
    return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()


def _reason_for_pure() -> str:
    """Why the compiled modules must not load ("" when they may)."""
    if os.environ.get("PEERINFER_PURE", "") not in ("", "0"):
        return "PEERINFER_PURE is set"
    try:
        manifest = json.loads(MANIFEST.read_text())
    except FileNotFoundError:
        return "not built (make native)"
    except (OSError, ValueError) as exc:
        return f"unreadable {MANIFEST.name} ({exc})"
    if manifest.get("cache_tag") != sys.implementation.cache_tag:
        return f"built for {manifest.get('cache_tag')}, not {sys.implementation.cache_tag}"
    for name, digest in manifest.get("sources", {}).items():
        try:
            if source_hash(_ROOT / name) != digest:
                return f"stale: {name} changed since the build (make native)"
        except OSError:
            return f"stale: {name} is gone (make native)"
    for name in manifest.get("extensions", []):
        if not (_ROOT / name).is_file():
            return f"incomplete: {name} is gone (make native)"
    return ""


class _SourceFirst(importlib.abc.MetaPathFinder):
    """Loads a peerinfer module from its ``.py`` where an extension of it may sit beside."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("peerinfer.") or path is None:
            return None
        leaf = fullname.rpartition(".")[2]
        for entry in path:
            if os.path.isfile(os.path.join(entry, leaf, "__init__.py")):
                return None  # a package: the standard finders load its __init__.py
            source = os.path.join(entry, leaf + ".py")
            if os.path.isfile(source):
                return importlib.util.spec_from_file_location(fullname, source)
        return None


def choose() -> None:
    """Decide, once per process, whether the compiled modules may load (``import peerinfer``)."""
    global _why_pure
    if _why_pure is not None:
        return
    _why_pure = _reason_for_pure()
    if _why_pure:
        sys.meta_path.insert(0, _SourceFirst())


def compiled() -> bool:
    """Whether this process runs the compiled modules."""
    choose()
    return _why_pure == ""


def describe() -> str:
    """One line for reports: "compiled (mypyc)" or "pure Python (<why>)"."""
    choose()
    return "compiled (mypyc)" if _why_pure == "" else f"pure Python ({_why_pure})"
