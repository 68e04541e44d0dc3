"""The wire format: validators, records, the message registry, and the codec.

How a message becomes bytes and back, whatever the message (the messages themselves are in
:mod:`peerinfer.core.messages`, which re-exports everything here).

Theory of operation
-------------------
Every message is a frozen dataclass registered under a one-byte *tag*. A frame is the msgpack
array ``[PROTOCOL_VERSION, tag, field_1, ..., field_n]``; nested records (``Load``,
``SamplingParams``, ...) are plain arrays of their fields, without version or tag. Each class
declares a ``SCHEMA``: one validator per field, in field order. Decoding is:

1. ``msgpack.unpackb`` with hard limits on every string, binary, array and map length and on the
   whole frame, so a hostile frame cannot make us allocate more than a small multiple of its own
   size, nor recurse without bound (msgpack's own nesting limit raises ``StackError``).
2. The version and tag are checked, then every field is checked against its validator: type,
   integer range, float finiteness and range, length. Nothing is coerced silently.
3. Any failure in 1 or 2, whatever the foreign exception, becomes ``ProtocolError`` here, and
   nowhere else, with the original as ``__cause__``.

Encoding is the inverse and never validates (our own values are built by our own code; tests
check that every constructed message round-trips). Maps are not used on the wire: arrays are
smaller and have no key-ordering question.

Where bytes must be deterministic (a hash or a signature over a record) use ``canonical_cbor``,
not msgpack: canonical CBOR (RFC 8949, section 4.2) fixes integer widths and map key order.

``decode`` knows the classes registered so far: import :mod:`peerinfer.core.messages` (every
importer does) so that all of them are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any, ClassVar, TypeVar

import cbor2
import msgpack

from peerinfer.errors import ProtocolError

PROTOCOL_VERSION = 1

#: The largest frame any peer may send us (bytes). Stream protocols enforce it before decoding.
MAX_FRAME_BYTES = 8 * 1024 * 1024
#: The longest prompt, in tokens, a peer may forward to us.
MAX_PROMPT_TOKENS = 131_072
#: The most tokens one request may ask to generate (``SamplingParams.max_tokens``).
MAX_NEW_TOKENS = 65_536
#: The longest prompt text, in characters.
MAX_PROMPT_CHARS = 1_048_576
MAX_ID_CHARS = 128
MAX_TEXT_CHARS = 65_536
MAX_LIST = 65_536
MAX_DELTA = 4096
U8 = 2**8 - 1
U32 = 2**32 - 1
U64 = 2**64 - 1

# --------------------------------------------------------------------------------------------
# Validators. Each is a callable (value, path) -> value that raises _Invalid with a message.


class _Invalid(Exception):
    pass


Validator = Callable[[Any, str], Any]


def UInt(maximum: int = U64, minimum: int = 0) -> Validator:
    def check(v: Any, path: str) -> int:
        if type(v) is not int:
            raise _Invalid(f"{path}: expected an integer, got {type(v).__name__}")
        if not minimum <= v <= maximum:
            raise _Invalid(f"{path}: {v} is outside [{minimum}, {maximum}]")
        return v

    return check


def Float(minimum: float = -math.inf, maximum: float = math.inf) -> Validator:
    def check(v: Any, path: str) -> float:
        if type(v) is int:
            v = float(v)
        if type(v) is not float:
            raise _Invalid(f"{path}: expected a number, got {type(v).__name__}")
        if not math.isfinite(v) or not minimum <= v <= maximum:
            raise _Invalid(f"{path}: {v!r} is outside [{minimum}, {maximum}]")
        return v

    return check


def Bool() -> Validator:
    def check(v: Any, path: str) -> bool:
        if type(v) is not bool:
            raise _Invalid(f"{path}: expected a boolean, got {type(v).__name__}")
        return v

    return check


def Text(max_chars: int = MAX_TEXT_CHARS, choices: frozenset[str] | None = None) -> Validator:
    def check(v: Any, path: str) -> str:
        if type(v) is not str:
            raise _Invalid(f"{path}: expected a string, got {type(v).__name__}")
        if len(v) > max_chars:
            raise _Invalid(f"{path}: string of {len(v)} characters exceeds {max_chars}")
        if choices is not None and v not in choices:
            raise _Invalid(f"{path}: {v!r} is not one of {sorted(choices)}")
        return v

    return check


def Bin(max_bytes: int = MAX_FRAME_BYTES) -> Validator:
    def check(v: Any, path: str) -> bytes:
        if type(v) is not bytes:
            raise _Invalid(f"{path}: expected bytes, got {type(v).__name__}")
        if len(v) > max_bytes:
            raise _Invalid(f"{path}: {len(v)} bytes exceeds {max_bytes}")
        return v

    return check


def Optional(inner: Validator) -> Validator:
    def check(v: Any, path: str) -> Any:
        return None if v is None else inner(v, path)

    return check


def ListOf(inner: Validator, max_len: int = MAX_LIST) -> Validator:
    def check(v: Any, path: str) -> tuple[Any, ...]:
        if type(v) is not list and type(v) is not tuple:
            raise _Invalid(f"{path}: expected a list, got {type(v).__name__}")
        if len(v) > max_len:
            raise _Invalid(f"{path}: list of {len(v)} items exceeds {max_len}")
        return tuple(inner(item, f"{path}[{i}]") for i, item in enumerate(v))

    return check


def UIntList(maximum: int = U64, max_len: int = MAX_LIST) -> Validator:
    """A list of unsigned integers, checked in one tight loop (digests carry thousands)."""

    def check(v: Any, path: str) -> tuple[int, ...]:
        if type(v) is not list and type(v) is not tuple:
            raise _Invalid(f"{path}: expected a list, got {type(v).__name__}")
        if len(v) > max_len:
            raise _Invalid(f"{path}: list of {len(v)} items exceeds {max_len}")
        for i, item in enumerate(v):
            if type(item) is not int or not 0 <= item <= maximum:
                raise _Invalid(f"{path}[{i}]: expected an integer in [0, {maximum}]")
        return tuple(v)

    return check


R = TypeVar("R", bound="Record")


def Nested(cls: type[R]) -> Validator:
    def check(v: Any, path: str) -> R:
        return cls._from_fields(v, path)

    return check


# --------------------------------------------------------------------------------------------
# Records and messages.


class Record:
    """A frozen dataclass with a SCHEMA; encoded as an array of its fields."""

    SCHEMA: ClassVar[tuple[Validator, ...]] = ()
    #: how many trailing fields (added later, with defaults) an older peer may leave out
    OPTIONAL_TAIL: ClassVar[int] = 0

    def _to_fields(self) -> list[Any]:
        record_fields = fields(self)  # type: ignore[arg-type]
        values = [getattr(self, f.name) for f in record_fields]
        # The optional tail is left off from the end while each field is at its default, as an
        # older peer sends the record: that peer refuses a record longer than it knows, and a
        # newer one fills the same defaults back in.
        keep = len(values)
        while keep > len(values) - self.OPTIONAL_TAIL and _at_default(
                record_fields[keep - 1], values[keep - 1]):
            keep -= 1
        return [_to_wire(v) for v in values[:keep]]

    @classmethod
    def _from_fields(cls: type[R], v: Any, path: str) -> R:
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        if type(v) is not list and type(v) is not tuple:
            raise _Invalid(f"{path}: expected a {cls.__name__} record (a list)")
        # The last OPTIONAL_TAIL fields (added later, with defaults) may be missing: a record
        # from an older peer.
        if not len(names) - cls.OPTIONAL_TAIL <= len(v) <= len(names):
            raise _Invalid(
                f"{path}: {cls.__name__} has {len(names)} fields, got {len(v)}"
            )
        values = {
            name: check(item, f"{path}.{name}")
            for name, check, item in zip(names[: len(v)], cls.SCHEMA, v, strict=False)
        }
        return cls(**values)


def _at_default(f: Any, value: Any) -> bool:
    if f.default is not MISSING:
        return bool(value == f.default)
    return f.default_factory is not MISSING and bool(value == f.default_factory())


def _to_wire(v: Any) -> Any:
    if isinstance(v, Record):
        return v._to_fields()
    if isinstance(v, tuple | list):
        return [_to_wire(x) for x in v]
    return v


class Message(Record):
    """A top-level wire message: a Record with a registered one-byte tag."""

    TAG: ClassVar[int] = -1


_REGISTRY: dict[int, type[Message]] = {}
M = TypeVar("M", bound=type[Message])


def register(tag: int) -> Callable[[M], M]:
    def wrap(cls: M) -> M:
        if tag in _REGISTRY:
            raise RuntimeError(f"duplicate message tag {tag}")
        cls.TAG = tag
        _REGISTRY[tag] = cls
        return cls

    return wrap


def encode(message: Message) -> bytes:
    """The msgpack frame of ``message``."""
    frame: list[Any] = [PROTOCOL_VERSION, message.TAG, *message._to_fields()]
    return msgpack.packb(frame, use_bin_type=True)  # type: ignore[no-any-return]


def decode(data: bytes, expected: type[Message] | tuple[type[Message], ...] | None = None) -> Message:
    """Decode and validate one frame; raise ProtocolError on anything else.

    ``expected`` restricts which message classes are acceptable in this context (a sync stream
    only accepts sync messages, for example).
    """
    if type(data) is not bytes:
        raise ProtocolError(f"a frame must be bytes, got {type(data).__name__}")
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        frame = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=MAX_PROMPT_CHARS * 4,
            max_bin_len=MAX_FRAME_BYTES,
            # No array can hold more items than the frame has bytes: bounding the claim by the
            # frame length keeps msgpack from preallocating for lies.
            max_array_len=min(max(MAX_LIST, MAX_PROMPT_TOKENS), len(data)),
            max_map_len=0,  # maps never appear on the wire
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types: translate them all, here only
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from exc
    try:
        if type(frame) is not list or len(frame) < 2:
            raise _Invalid("a frame is an array [version, tag, fields...]")
        version, tag = frame[0], frame[1]
        if version != PROTOCOL_VERSION or type(version) is not int:
            raise _Invalid(f"protocol version {version!r} is not supported (we speak {PROTOCOL_VERSION})")
        cls = _REGISTRY.get(tag) if type(tag) is int else None
        if cls is None:
            raise _Invalid(f"unknown message tag {tag!r}")
        if expected is not None and not issubclass(cls, expected):
            raise _Invalid(f"{cls.__name__} is not acceptable here")
        return cls._from_fields(frame[2:], cls.__name__)
    except _Invalid as exc:
        raise ProtocolError(str(exc)) from None
    except (TypeError, ValueError) as exc:  # a dataclass __post_init__ refusing a value
        raise ProtocolError(f"invalid message: {exc}") from exc


def canonical_cbor(value: Any) -> bytes:
    """Deterministic bytes for hashing or signing (canonical CBOR)."""
    return cbor2.dumps(_to_wire(value), canonical=True)


def message_types() -> dict[int, type[Message]]:
    """Every registered message class by tag (for tests and tooling)."""
    return dict(_REGISTRY)
