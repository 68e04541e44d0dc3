"""Choosing an engine by name.

``load_engine(spec, **options)`` accepts, in this order:

1. a built-in name: ``hf`` (:class:`~peerinfer.engine.hf.TransformersEngine`), ``llamacpp``
   (:class:`~peerinfer.engine.llamacpp.LlamaCppEngine`) or ``simulated``
   (:class:`~peerinfer.engine.simulated.SimulatedEngine`);
2. the name of an entry point in the group ``peerinfer.engines`` (how an installed package
   registers its backend: ``[project.entry-points."peerinfer.engines"] mine = "pkg.mod:Class"``);
3. a ``module.path:ClassName`` reference, or ``path/to/file.py:ClassName``.

Built-ins are imported lazily, so choosing ``simulated`` never imports torch. Anything unknown,
unimportable, not an :class:`~peerinfer.engine.base.Engine` subclass, or given options its
constructor does not take is a :class:`~peerinfer.errors.ConfigError` that says what to do.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from peerinfer.engine.base import Engine
from peerinfer.errors import ConfigError

ENTRY_POINT_GROUP = "peerinfer.engines"

BUILTIN_ENGINES: dict[str, str] = {
    "hf": "peerinfer.engine.hf:TransformersEngine",
    "llamacpp": "peerinfer.engine.llamacpp:LlamaCppEngine",
    "simulated": "peerinfer.engine.simulated:SimulatedEngine",
}


def available_engines() -> dict[str, str]:
    """Every engine name that ``load_engine`` knows, with its ``module:Class`` target."""
    names = dict(BUILTIN_ENGINES)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        names.setdefault(ep.name, ep.value)
    return names


def _import_target(target: str, what: str) -> object:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what}: expected 'module:Class', got {target!r}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser()
            if not path.is_file():
                raise ConfigError(f"{what}: no file {module_name}")
            digest = hashlib.blake2b(str(path.resolve()).encode(), digest_size=6).hexdigest()
            name = f"_peerinfer_engine_{path.stem}_{digest}"
            module = sys.modules.get(name)
            if module is None:
                spec = importlib.util.spec_from_file_location(name, path)
                if spec is None or spec.loader is None:
                    raise ConfigError(f"{what}: cannot import {module_name}")
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[name]
                    raise
        else:
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except ImportError as exc:
        raise ConfigError(f"{what}: cannot import {module_name!r}: {exc}") from exc
    obj: object = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{what}: {module_name!r} has no attribute {attr!r}") from None
    return obj


def resolve_engine_class(spec: str) -> type[Engine]:
    """The Engine subclass that ``spec`` names (see the module docstring)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("an engine name is required (e.g. 'hf', 'simulated' or 'module:Class')")
    spec = spec.strip()
    what = f"engine {spec!r}"
    if spec in BUILTIN_ENGINES:
        obj = _import_target(BUILTIN_ENGINES[spec], what)
    else:
        eps = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
        if eps:
            try:
                obj = eps[0].load()
            except Exception as exc:  # a broken plugin: any import-time failure
                raise ConfigError(f"{what}: its entry point {eps[0].value!r} failed: {exc}") from exc
        elif ":" in spec:
            obj = _import_target(spec, what)
        else:
            known = ", ".join(sorted(available_engines()))
            raise ConfigError(
                f"unknown engine {spec!r}: choose one of {known}, or give 'module:Class' "
                f"(or 'file.py:Class'), or install a package with a {ENTRY_POINT_GROUP!r} "
                "entry point"
            )
    if not (isinstance(obj, type) and issubclass(obj, Engine)):
        raise ConfigError(f"{what} is {obj!r}, not a peerinfer.engine.Engine subclass")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise ConfigError(f"{what}: {obj.__name__} does not implement {missing}")
    return obj


def load_engine(spec: str, **options: Any) -> Engine:
    """Construct the engine ``spec`` names with ``options`` as its keyword arguments."""
    cls = resolve_engine_class(spec)
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as exc:
        raise ConfigError(f"engine {spec!r} does not take these options: {exc}") from exc
    return cls(**options)


__all__ = [
    "BUILTIN_ENGINES",
    "ENTRY_POINT_GROUP",
    "available_engines",
    "load_engine",
    "resolve_engine_class",
]
