"""A module's docstring read from its source: a module the core compiles (peerinfer/native.py)
keeps none at run time, and the tests that check a docstring against the code read the source."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType

import peerinfer


def source_path(module: ModuleType) -> Path:
    """The ``.py`` of ``module``, also where an extension compiled from it was loaded: found
    from its name, since mypyc gives a compiled module that another one imported first a wrong
    ``__file__`` (``peerinfer/peerinfer/core/...``: its group's library sits in ``peerinfer/``)."""
    root = Path(peerinfer.__file__).resolve().parent.parent
    base = root.joinpath(*module.__name__.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def source_docstring(module: ModuleType) -> str:
    return ast.get_docstring(ast.parse(source_path(module).read_text()), clean=False) or ""
