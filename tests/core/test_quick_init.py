"""``quick_init`` gives frozen, slotted dataclasses an ``__init__`` that sets each slot through
its descriptor: every class that uses it must take the same arguments and make the same object
as the ``__init__`` dataclasses generated for it (kept beside it, ``quickened()``)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

# The modules whose classes use quick_init (importing them registers the classes).
import peerinfer.core.messages
import peerinfer.core.node.events
import peerinfer.core.routing.candidates
import peerinfer.engine.events
import peerinfer.engine.simulated
import peerinfer.sim.inputs
import peerinfer.workload  # noqa: F401
from peerinfer.core.quickinit import quick_init, quickened


def _classes() -> list[tuple[type, Any]]:
    return list(quickened())


def test_the_hot_classes_are_quickened() -> None:
    names = {cls.__qualname__ for cls, _ in _classes()}
    assert {
        "ClientRequest", "ForwardFinished", "ForwardFirstToken", "LocalFinished",
        "LocalStarted", "Forward", "RunLocal", "Publish", "PeerSeen", "Load", "RouteDecision",
        "RouteRequest", "CacheChanges", "Plan", "SimRequest", "WorkloadItem", "MMLUQuestion",
    } <= names


def _slots(obj: object) -> list[Any]:
    return [getattr(obj, f.name) for f in dataclasses.fields(obj)]  # type: ignore[arg-type]


def _same(cls: type, generated: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    made = cls(*args, **kwargs)
    plain = object.__new__(cls)
    generated(plain, *args, **kwargs)
    assert type(made) is cls
    got, want = _slots(made), _slots(plain)
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want, strict=True))
    assert made == plain and repr(made) == repr(plain)
    if cls.__hash__ is not None:
        assert hash(made) == hash(plain)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, dataclasses.fields(cls)[0].name, None)


@pytest.mark.parametrize("cls_generated", _classes(), ids=lambda c: c[0].__qualname__)
def test_a_quick_init_makes_what_the_generated_one_makes(cls_generated: tuple[type, Any]) -> None:
    cls, generated = cls_generated
    assert cls.__init__ is not generated
    assert inspect.signature(cls.__init__) == inspect.signature(generated)
    assert cls.__init__.__qualname__ == generated.__qualname__
    fields = dataclasses.fields(cls)
    # A distinct value per field, so a value set in the wrong slot shows.
    values = [("value", i, f.name) for i, f in enumerate(fields)]
    required = [f for f in fields if f.default is dataclasses.MISSING]
    positional = [f for f in fields if not f.kw_only]
    keyword_only = {f.name: v for f, v in zip(fields, values, strict=True) if f.kw_only}
    # Every field given, positionally where it may be.
    _same(cls, generated, tuple(values[: len(positional)]), keyword_only)
    # Every field by keyword.
    _same(cls, generated, (), {f.name: v for f, v in zip(fields, values, strict=True)})
    # Only the required ones: the rest take their defaults.
    _same(cls, generated, (), {f.name: ("only", f.name) for f in required})
    # The same errors for a missing, an extra and an unknown argument.
    for args, kwargs in (
        ((), {}), (tuple(values) + ("extra",), {}), ((), {"not_a_field": 1}),
    ):
        if not required and not args and not kwargs:
            continue
        with pytest.raises(TypeError) as quick:
            cls(*args, **kwargs)
        with pytest.raises(TypeError) as slow:
            generated(object.__new__(cls), *args, **kwargs)
        assert str(quick.value) == str(slow.value)


def test_keyword_only_fields_and_defaults() -> None:
    @quick_init
    @dataclasses.dataclass(frozen=True, slots=True)
    class Mixed:
        a: int
        b: str = "b"
        _: dataclasses.KW_ONLY
        c: float
        d: tuple[int, ...] = ()

    generated = quickened()[-1][1]
    assert quickened()[-1][0] is Mixed
    _same(Mixed, generated, (1,), {"c": 2.0})
    _same(Mixed, generated, (1, "x"), {"c": 2.0, "d": (3,)})
    with pytest.raises(TypeError):
        Mixed(1, "x", 2.0)  # type: ignore[misc]  # (c is keyword-only)


def test_what_quick_init_refuses() -> None:
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclasses.dataclass(slots=True)
    class NotFrozen:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class PostInit:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass(frozen=True, slots=True)
    class Factory:
        a: list[int] = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True, slots=True)
    class NotInInit:
        a: int = dataclasses.field(default=0, init=False)

    @dataclasses.dataclass(frozen=True, slots=True)
    class WithInitVar:
        a: int
        b: dataclasses.InitVar[int]

    for cls in (NoSlots, NotFrozen, PostInit, Factory, NotInInit, WithInitVar, int):
        with pytest.raises(TypeError, match="quick_init"):
            quick_init(cls)
