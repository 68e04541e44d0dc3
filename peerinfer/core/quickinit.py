"""``quick_init``: a cheaper ``__init__`` for a frozen, slotted dataclass.

A frozen dataclass's generated ``__init__`` sets each field with ``object.__setattr__(self,
name, value)`` (its own ``__setattr__`` refuses), which looks the name up on the class and calls
the slot's descriptor: about twice the cost of setting the slot through its descriptor
directly. The simulator makes a few dozen such objects per request (events, effects, loads,
route decisions), so ``quick_init`` gives the hot ones an ``__init__`` that calls each slot's
descriptor itself. Nothing else changes: the same parameters, defaults and keyword-only
markers, the same stored values, so equality, hashing, ``repr``, pickling and immutability are
the dataclass's own (``tests/core/test_quick_init.py`` checks this for every class that uses
it).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import TypeVar

__all__ = ["quick_init", "quickened"]

T = TypeVar("T", bound=type)

#: every class given a quick ``__init__``, with the one dataclasses generated (for the tests)
_quickened: list[tuple[type, object]] = []


def quickened() -> tuple[tuple[type, object], ...]:
    """The classes ``quick_init`` changed so far, each with its generated ``__init__``."""
    return tuple(_quickened)


def quick_init(cls: T) -> T:
    """Replace the generated ``__init__`` of ``cls`` (put it above ``@dataclass(frozen=True,
    slots=True)``) by one that sets each slot through its descriptor.

    Raises TypeError for a class it cannot speed up without changing what ``__init__`` does:
    not a frozen dataclass with a slot per field, a ``__post_init__``, a default factory, a field
    left out of ``__init__``, an ``InitVar``, or a hand-written ``__init__``. (An error rather
    than keeping the slow ``__init__`` quietly: the decorator promises the speed.)"""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or not params.init:
        raise TypeError(f"quick_init: {cls.__qualname__} is not a frozen dataclass with __init__")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"quick_init: {cls.__qualname__} has a __post_init__")
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    if getattr(cls, "__slots__", None) != tuple(names):
        raise TypeError(f"quick_init: {cls.__qualname__}'s slots are not its fields")
    setters = {}
    for f in fields:
        descriptor = vars(cls).get(f.name)
        if type(descriptor) is not types.MemberDescriptorType:
            raise TypeError(f"quick_init: {cls.__qualname__}.{f.name} is not a plain slot")
        if not f.init or f.default_factory is not dataclasses.MISSING:
            raise TypeError(
                f"quick_init: {cls.__qualname__}.{f.name} has a default factory or no init"
            )
        setters[f"_set_{f.name}"] = descriptor.__set__
    generated = vars(cls).get("__init__")
    if generated is None:
        raise TypeError(f"quick_init: {cls.__qualname__} inherits its __init__")
    # The generated __init__'s own parameters must be exactly the fields, in order (an InitVar
    # or a hand-written __init__ would add or change some): then the new one takes the same.
    signature = inspect.signature(generated)
    parameters = list(signature.parameters.values())[1:]
    if [p.name for p in parameters] != names:
        raise TypeError(f"quick_init: {cls.__qualname__}'s __init__ takes more than its fields")

    defaults = {}
    args = []
    keyword_only = False
    for p, f in zip(parameters, fields, strict=True):
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not keyword_only:
            args.append("*")
            keyword_only = True
        if f.default is dataclasses.MISSING:
            args.append(p.name)
        else:
            defaults[f"_default_{p.name}"] = f.default
            args.append(f"{p.name}=_default_{p.name}")
    body = "".join(f"\n        _set_{name}(self, {name})" for name in names) or "\n        pass"
    # A closure over the setters and defaults (read as fast locals of the enclosing frame),
    # the way dataclasses builds its own functions.
    closed = ", ".join([*setters, *defaults])
    source = (
        f"def _make({closed}):\n"
        f"    def __init__(self, {', '.join(args)}):{body}\n"
        f"    return __init__\n"
    )
    namespace: dict[str, object] = {}
    exec(source, {}, namespace)  # noqa: S102 - source made above from the field names only
    init = namespace["_make"](**setters, **defaults)  # type: ignore[operator]
    init.__qualname__ = generated.__qualname__
    init.__module__ = generated.__module__
    init.__annotations__ = dict(generated.__annotations__)
    init.__doc__ = generated.__doc__
    cls.__init__ = init  # type: ignore[misc]
    _quickened.append((cls, generated))
    return cls
