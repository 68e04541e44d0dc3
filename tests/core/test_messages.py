"""The wire codec: every message round-trips, and nothing a peer sends escapes as anything but
ProtocolError.

Strategies are derived from each class's SCHEMA (the validators' closure variables give their
ranges and lengths), so a message class added later is covered without touching this file, and a
new kind of validator makes ``strategy_for`` fail loudly instead of going untested.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import struct
import tracemalloc
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from typing import Any

import cbor2
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerinfer.core import messages as wire
from peerinfer.core.messages import (
    PROTOCOL_VERSION,
    Message,
    Ping,
    Pong,
    Record,
    canonical_cbor,
    decode,
    encode,
    message_types,
)
from peerinfer.errors import ProtocolError

MESSAGE_CLASSES = sorted(message_types().values(), key=lambda cls: cls.TAG)
# msgpack refuses any array longer than this before our validators run (see decode()).
MSGPACK_ARRAY_CAP = max(wire.MAX_LIST, wire.MAX_PROMPT_TOKENS)
# Generated values stay small so hundreds of examples run in seconds; the length limits
# themselves are exercised by the boundary and mutation tests below.
GEN_LIST = 4
GEN_TEXT = 16
GEN_BYTES = 24

# --------------------------------------------------------------------------------------------
# Schema introspection.


def validator_kind(check: Any) -> tuple[str, dict[str, Any]]:
    """('UInt', {'minimum': 0, 'maximum': ...}) for a validator built by messages.UInt(...)."""
    kind = check.__qualname__.split(".<locals>")[0]
    return kind, dict(inspect.getclosurevars(check).nonlocals)


def record_fields(cls: type[Record]) -> list[tuple[str, Any]]:
    return [(f.name, check) for f, check in zip(fields(cls), cls.SCHEMA, strict=True)]  # type: ignore[arg-type]


def to_wire(value: Any) -> Any:
    """What encode() puts on the wire for a field value (records and tuples become lists)."""
    if is_dataclass(value) and isinstance(value, Record):
        names = [name for name, _ in record_fields(type(value))]
        defaults = {f.name: f.default for f in dataclasses.fields(value)}  # tails: no factories
        # Load leaves off only its last two fields (the scaffold_hash hint, the disk figure);
        # every other record its optional tail from the end while at its defaults (older
        # peers never send them).
        tail = 2 if type(value) is wire.Load else type(value).OPTIONAL_TAIL
        while tail and getattr(value, names[-1]) == defaults[names[-1]]:
            names.pop()
            tail -= 1
        return [to_wire(getattr(value, name)) for name in names]
    if isinstance(value, tuple | list):
        if len(value) > 1 and all(x is value[0] for x in value):
            # One element repeated (a field at its length limit): convert it once, not 65,536
            # times, which took most of that test's time.
            return [to_wire(value[0])] * len(value)
        return [to_wire(x) for x in value]
    return value


def frame_of(message: Message) -> list[Any]:
    return [PROTOCOL_VERSION, message.TAG, *to_wire(message)]


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------
# Strategies derived from the schema.


def strategy_for(check: Any) -> st.SearchStrategy[Any]:
    kind, env = validator_kind(check)
    if kind == "UInt":
        return st.integers(env["minimum"], env["maximum"])
    if kind == "Float":
        return st.floats(env["minimum"], env["maximum"], allow_nan=False, allow_infinity=False)
    if kind == "Bool":
        return st.booleans()
    if kind == "Text":
        if env["choices"] is not None:
            return st.sampled_from(sorted(env["choices"]))
        return st.text(
            st.characters(codec="utf-8"), max_size=min(env["max_chars"], GEN_TEXT)
        )
    if kind == "Bin":
        return st.binary(max_size=min(env["max_bytes"], GEN_BYTES))
    if kind == "Optional":
        return st.none() | strategy_for(env["inner"])
    if kind == "ListOf":
        inner = strategy_for(env["inner"])
        return st.lists(inner, max_size=min(env["max_len"], GEN_LIST)).map(tuple)
    if kind == "UIntList":
        item = st.integers(0, env["maximum"])
        return st.lists(item, max_size=min(env["max_len"], GEN_LIST)).map(tuple)
    if kind == "Nested":
        return records(env["cls"])
    raise AssertionError(f"no strategy for validator kind {kind!r}: teach strategy_for about it")


def records(cls: type[Record]) -> st.SearchStrategy[Any]:
    return st.builds(cls, **{name: strategy_for(check) for name, check in record_fields(cls)})


def any_message() -> st.SearchStrategy[Message]:
    return st.one_of([records(cls) for cls in MESSAGE_CLASSES])


def sample_value(check: Any) -> Any:
    """A small valid field value with one element in every list, so mutations reach inside."""
    kind, env = validator_kind(check)
    if kind == "UInt":
        return env["minimum"]
    if kind == "Float":
        return max(env["minimum"], 0.0) if math.isfinite(env["minimum"]) else 0.0
    if kind == "Bool":
        return False
    if kind == "Text":
        return min(env["choices"]) if env["choices"] is not None else "x"
    if kind == "Bin":
        return b"\x00"
    if kind == "Optional":
        return sample_value(env["inner"])
    if kind == "ListOf":
        return (sample_value(env["inner"]),)
    if kind == "UIntList":
        return (0,)
    if kind == "Nested":
        cls = env["cls"]
        return cls(**{name: sample_value(c) for name, c in record_fields(cls)})
    raise AssertionError(f"no sample for validator kind {kind!r}")


# --------------------------------------------------------------------------------------------
# Mutations: (wire path of the field, a wrong value, the path the error must name).

Mutation = tuple[tuple[int, ...], Any, str]


def bad_values(check: Any, wire_value: Any, path: str) -> Iterator[tuple[Any, str]]:
    """Wrong values for one field, each with the path ProtocolError must name."""
    kind, env = validator_kind(check)
    if kind == "Optional":
        yield from ((bad, p) for bad, p in bad_values(env["inner"], wire_value, path) if bad is not None)
        return
    wrong_types: list[Any] = {
        "UInt": ["7", 1.5, True, None, [1]],
        "Float": ["0.5", True, None, [0.5]],
        "Bool": [0, 1, "true", None],
        "Text": [5, b"bytes", None, ["x"]],
        "Bin": ["text", 5, None, [0]],
        "ListOf": [5, "abc", b"abc", None],
        "UIntList": [5, "abc", b"abc", None],
        "Nested": [5, "abc", None, True],
    }[kind]
    for bad in wrong_types:
        yield bad, path
    if kind == "UInt":
        if env["maximum"] < 2**64 - 1:
            yield env["maximum"] + 1, path
        yield env["minimum"] - 1, path
        yield -(2**63), path
    elif kind == "Float":
        yield math.nan, path
        yield math.inf, path
        yield -math.inf, path
        if math.isfinite(env["maximum"]):
            yield env["maximum"] * 2 + 1, path
        if math.isfinite(env["minimum"]):
            yield env["minimum"] - 1, path
    elif kind == "Text":
        yield "x" * (env["max_chars"] + 1), path
        if env["choices"] is not None:
            yield "not-one-of-the-choices", path
    elif kind == "Bin":
        if env["max_bytes"] < wire.MAX_FRAME_BYTES // 2:
            yield b"\x00" * (env["max_bytes"] + 1), path
    elif kind in ("ListOf", "UIntList"):
        if env["max_len"] + 1 <= MSGPACK_ARRAY_CAP:
            element = 0 if kind == "UIntList" else to_wire(sample_value(env["inner"]))
            yield [element] * (env["max_len"] + 1), path
        if kind == "UIntList":
            yield [-1], f"{path}[0]"
            yield ["1"], f"{path}[0]"
            if env["maximum"] < 2**64 - 1:
                yield [env["maximum"] + 1], f"{path}[0]"
    elif kind == "Nested":
        yield [], path  # wrong number of fields
        if wire_value is not None:  # an Optional record left out has no fields to add to
            yield [*wire_value, 0], path


def mutations(cls: type[Record], wire_fields: list[Any], path: str) -> Iterator[Mutation]:
    """Every single-field mutation of a record's wire fields, recursing into records and lists."""
    for index, (name, check) in enumerate(record_fields(cls)):
        if index >= len(wire_fields):
            break  # a tail field left off the wire (at its default): nothing to mutate
        field_path = f"{path}.{name}"
        value = wire_fields[index]
        for bad, named in bad_values(check, value, field_path):
            yield (index,), bad, named
        kind, env = validator_kind(check)
        if kind == "Optional":
            kind, env = validator_kind(env["inner"])
        if kind == "Nested" and value is not None:
            for sub, bad, named in mutations(env["cls"], value, field_path):
                yield (index, *sub), bad, named
        if kind == "ListOf" and value:
            inner_kind, inner_env = validator_kind(env["inner"])
            element_path = f"{field_path}[0]"
            for bad, named in bad_values(env["inner"], value[0], element_path):
                yield (index, 0), bad, named
            if inner_kind == "Nested":
                for sub, bad, named in mutations(inner_env["cls"], value[0], element_path):
                    yield (index, 0, *sub), bad, named


def replaced(frame: list[Any], where: tuple[int, ...], bad: Any, offset: int) -> list[Any]:
    """A deep copy of ``frame`` with the value at ``where`` (offset by ``offset``) set to ``bad``."""
    out = msgpack.unpackb(pack(frame), raw=False, strict_map_key=False)
    target = out
    steps = [where[0] + offset, *where[1:]]  # type: ignore[operator]
    for step in steps[:-1]:
        target = target[step]
    target[steps[-1]] = bad
    return out  # type: ignore[no-any-return]


def sample_message(cls: type[Message]) -> Message:
    return cls(**{name: sample_value(check) for name, check in record_fields(cls)})


ALL_MUTATIONS = [
    pytest.param(cls, where, bad, named, id=f"{named}={str(bad)[:20]!r}")
    for cls in MESSAGE_CLASSES
    for where, bad, named in mutations(cls, to_wire(sample_message(cls)), cls.__name__)
]

# --------------------------------------------------------------------------------------------
# Round trips.


def test_the_schema_strategies_know_every_message_class() -> None:
    assert {cls.TAG for cls in MESSAGE_CLASSES} == set(message_types())
    assert len(MESSAGE_CLASSES) >= 12
    for cls in MESSAGE_CLASSES:
        records(cls).validate()  # raises if a validator kind is unknown


@pytest.mark.parametrize("cls", MESSAGE_CLASSES, ids=lambda cls: cls.__name__)
@given(data=st.data())
def test_every_message_round_trips(cls: type[Message], data: st.DataObject) -> None:
    message = data.draw(records(cls))
    frame = encode(message)
    assert type(frame) is bytes
    decoded = decode(frame)
    assert type(decoded) is cls
    assert decoded == message
    assert decode(frame, expected=cls) == message
    assert encode(decoded) == frame


@pytest.mark.parametrize("cls", MESSAGE_CLASSES, ids=lambda cls: cls.__name__)
def test_sample_messages_round_trip(cls: type[Message]) -> None:
    message = sample_message(cls)
    assert decode(encode(message)) == message


def _length_limited_fields() -> Iterator[Any]:
    for cls in MESSAGE_CLASSES:
        for name, check in record_fields(cls):
            kind, env = validator_kind(check)
            if kind == "Optional":
                kind, env = validator_kind(env["inner"])
            if kind in ("ListOf", "UIntList") or (kind == "Text" and env["choices"] is None):
                yield pytest.param(cls, name, id=f"{cls.__name__}.{name}")


@pytest.mark.parametrize(("cls", "name"), list(_length_limited_fields()))
def test_a_field_at_its_length_limit_round_trips(cls: type[Message], name: str) -> None:
    """The schema's limit is reachable: a field exactly at it decodes, one past it does not."""
    check = dict(record_fields(cls))[name]
    kind, env = validator_kind(check)
    if kind == "Optional":
        kind, env = validator_kind(env["inner"])
    limit = env["max_chars"] if kind == "Text" else env["max_len"]
    if kind != "Text" and limit > MSGPACK_ARRAY_CAP:
        pytest.skip(f"limit {limit} is above decode()'s msgpack array cap {MSGPACK_ARRAY_CAP}")
    if kind == "Text":
        at_limit: Any = "é" * limit  # two UTF-8 bytes a character: the limit counts characters
    else:
        element = sample_value(check)[0]
        at_limit = (element,) * limit
    base = sample_message(cls)
    values = {n: getattr(base, n) for n, _ in record_fields(cls)}
    message = cls(**{**values, name: at_limit})
    assert decode(encode(message)) == message
    over = frame_of(message)
    index = [n for n, _ in record_fields(cls)].index(name)
    if kind == "Text":
        over[2 + index] = at_limit + "é"
    else:
        over[2 + index] = to_wire(at_limit) + [to_wire(at_limit[0])]
    with pytest.raises(ProtocolError) as info:
        decode(pack(over))
    if kind == "Text" or limit < MSGPACK_ARRAY_CAP:  # else msgpack refuses it, unnamed
        assert f"{cls.__name__}.{name}" in str(info.value)


# --------------------------------------------------------------------------------------------
# Mutated frames name the field at fault.


@pytest.mark.parametrize(("cls", "where", "bad", "named"), ALL_MUTATIONS)
def test_a_mutated_field_is_refused_naming_it(
    cls: type[Message], where: tuple[int, ...], bad: Any, named: str
) -> None:
    frame = replaced(frame_of(sample_message(cls)), where, bad, offset=2)
    with pytest.raises(ProtocolError) as info:
        decode(pack(frame))
    assert named in str(info.value)


def test_mutations_cover_every_kind_of_error() -> None:
    assert len(ALL_MUTATIONS) > 300
    named = {param.values[3] for param in ALL_MUTATIONS}
    assert "Announce.load.slots" in named
    assert "GenerateRequest.params.stop[0]" in named
    assert "GenerateRequest.messages[0].role" in named
    assert "StatusResponse.peers[0].load.queued" in named


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(message=st.one_of([records(cls) for cls in MESSAGE_CLASSES if cls.SCHEMA]), data=st.data())
def test_any_mutation_of_any_message_is_refused(message: Message, data: st.DataObject) -> None:
    cls = type(message)
    frame = frame_of(message)
    options = list(mutations(cls, frame[2:], cls.__name__))
    where, bad, named = data.draw(st.sampled_from(options))
    with pytest.raises(ProtocolError) as info:
        decode(pack(replaced(frame, where, bad, offset=2)))
    assert named in str(info.value)


def test_new_fields_at_their_defaults_stay_off_the_wire_for_older_peers() -> None:
    # An older peer refuses a record longer than it knows: a plain request (no tools, no
    # constraint, no logprobs) and its token chunks must be the frames it always got.
    plain = wire.GenerateRequest("r1", wire.SamplingParams(max_tokens=5), prompt="hi")
    frame = msgpack.unpackb(encode(plain), raw=False)
    assert len(frame) == 2 + 9 and len(frame[3]) == 5, frame
    assert decode(encode(plain)) == plain
    chunk = wire.TokenChunk("r1", (1, 2), "ab")
    assert len(msgpack.unpackb(encode(chunk), raw=False)) == 2 + 3
    # A field set past the defaults travels, with every field before it.
    constrained = wire.SamplingParams(top_logprobs=2)
    frame = msgpack.unpackb(encode(wire.GenerateRequest("r2", constrained, prompt="hi")), raw=False)
    assert frame[3] == [64, 0.0, 1.0, None, [], None, False, 2], frame[3]
    chat = wire.ChatMessage("user", "hi")
    assert to_wire(chat) == ["user", "hi"] and wire.ChatMessage("tool", "x", tool_call_id="c")._to_fields() == [
        "tool", "x", "", "c"]


@pytest.mark.parametrize("cls", MESSAGE_CLASSES, ids=lambda cls: cls.__name__)
def test_a_missing_or_extra_field_is_refused(cls: type[Message]) -> None:
    frame = frame_of(sample_message(cls))
    # A tail field left off at its default (GenerateRequest's scaffold): the extra field goes
    # after the whole schema.
    left_off = [None] * (len(record_fields(cls)) + 2 - len(frame))
    with pytest.raises(ProtocolError, match=cls.__name__):
        decode(pack([*frame, *left_off, 0]))
    tail = cls.OPTIONAL_TAIL  # fields added later: a frame from an older peer may omit them
    required = len(record_fields(cls)) - tail
    if required > 0:
        with pytest.raises(ProtocolError, match=cls.__name__):
            decode(pack(frame[: 2 + required - 1]))
    if tail:
        older = decode(pack(frame[: 2 + required]))
        assert isinstance(older, cls)
        assert all(getattr(older, f.name) == f.default
                   for f in dataclasses.fields(cls)[-tail:])  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Versions, tags and the ``expected`` restriction.


@pytest.mark.parametrize("version", [0, 2, PROTOCOL_VERSION + 1, -1, 2**64 - 1, 1.0, True, "1", None, [1]])
def test_a_wrong_protocol_version_is_refused_naming_it(version: Any) -> None:
    frame = frame_of(Ping(nonce=7))
    frame[0] = version
    with pytest.raises(ProtocolError, match="version"):
        decode(pack(frame))


UNUSED_TAGS = [tag for tag in range(256) if tag not in message_types()]


@pytest.mark.parametrize(
    "tag", [UNUSED_TAGS[0], UNUSED_TAGS[-1], 256, -1, 2**64 - 1, "1", 1.0, None, True]
)
def test_an_unknown_tag_is_refused(tag: Any) -> None:
    with pytest.raises(ProtocolError, match="tag"):
        decode(pack([PROTOCOL_VERSION, tag, 0]))


@pytest.mark.parametrize("frame", [[], [PROTOCOL_VERSION], 5, "frame", b"frame", None, {}])
def test_a_frame_that_is_not_an_array_of_two_or_more_is_refused(frame: Any) -> None:
    with pytest.raises(ProtocolError):
        decode(pack(frame))


def test_decode_refuses_anything_but_bytes() -> None:
    data = encode(Ping(nonce=1))
    for not_bytes in (bytearray(data), memoryview(data), data.decode("latin-1"), None):
        with pytest.raises(ProtocolError, match="bytes"):
            decode(not_bytes)  # type: ignore[arg-type]


def test_expected_restricts_the_acceptable_classes() -> None:
    ping = Ping(nonce=3)
    assert decode(encode(ping), expected=Ping) == ping
    assert decode(encode(ping), expected=(Pong, Ping)) == ping
    assert decode(encode(ping), expected=Message) == ping
    with pytest.raises(ProtocolError, match="Ping is not acceptable"):
        decode(encode(ping), expected=Pong)
    with pytest.raises(ProtocolError, match="not acceptable"):
        decode(encode(ping), expected=(Pong, wire.Announce))


@given(message=any_message(), expected=st.sampled_from(MESSAGE_CLASSES))
def test_expected_accepts_exactly_its_own_class(message: Message, expected: type[Message]) -> None:
    if type(message) is expected:
        assert decode(encode(message), expected=expected) == message
    else:
        with pytest.raises(ProtocolError, match="not acceptable"):
            decode(encode(message), expected=expected)


# --------------------------------------------------------------------------------------------
# Hostile input: only ProtocolError, bounded work.


def decode_or_protocol_error(data: bytes) -> Message | None:
    try:
        message = decode(data)
    except ProtocolError:
        return None
    assert isinstance(message, Message)
    return message


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=256))
def test_arbitrary_bytes_raise_only_protocol_error(data: bytes) -> None:
    decode_or_protocol_error(data)


@settings(deadline=None)
@given(message=any_message(), cut=st.integers(0, 10_000), junk=st.binary(max_size=8))
def test_truncated_or_extended_frames_raise_only_protocol_error(
    message: Message, cut: int, junk: bytes
) -> None:
    frame = encode(message)
    cut %= len(frame)
    assert decode_or_protocol_error(frame[:cut]) is None
    if junk:
        assert decode_or_protocol_error(frame + junk) is None
    flipped = bytearray(frame)
    flipped[cut] ^= 0xFF
    decode_or_protocol_error(bytes(flipped))


msgpack_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.sampled_from([0, 1, -1, 2**32, 2**63 - 1, -(2**63), 2**64 - 1, 255, 256, -129])
    | st.floats()  # nan, inf, -0.0 and subnormals included
    | st.text(st.characters(codec="utf-8"), max_size=24)
    | st.binary(max_size=24)
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.text(max_size=4) | st.binary(max_size=4), children, max_size=3),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(value=msgpack_values)
def test_arbitrary_msgpack_values_raise_only_protocol_error(value: Any) -> None:
    decode_or_protocol_error(pack(value))


@settings(max_examples=600, deadline=None)
@given(
    version=st.just(PROTOCOL_VERSION) | msgpack_scalars,
    tag=st.sampled_from(sorted(message_types())) | msgpack_scalars,
    fields_=st.lists(msgpack_values, max_size=12),
)
def test_frames_with_a_known_tag_and_arbitrary_fields_raise_only_protocol_error(
    version: Any, tag: Any, fields_: list[Any]
) -> None:
    decode_or_protocol_error(pack([version, tag, *fields_]))


def peak_allocation(data: bytes) -> int:
    """Bytes allocated at peak while decoding ``data``, which must be refused."""
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            decode(data)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


HOSTILE_FRAMES = {
    "array nested 100,000 deep": b"\x91" * 100_000 + b"\xc0",
    "map nested 100,000 deep": b"\x81\xa1k" * 100_000 + b"\xc0",
    "array claiming 2^32-1 items": b"\xdd\xff\xff\xff\xff",
    "array claiming 2^32-1 items inside a frame": b"\x93\x01\x16\xdd\xff\xff\xff\xff",
    "map claiming 2^32-1 items": b"\xdf\xff\xff\xff\xff",
    "string claiming 4 GiB": b"\x93\x01\x0a\xdb\xff\xff\xff\xff",
    "binary claiming 4 GiB": b"\x93\x01\x02\xc6\xff\xff\xff\xff",
    "ext claiming 4 GiB": b"\xc9\xff\xff\xff\xff\x05",
    "frame larger than the limit": b"\x00" * (wire.MAX_FRAME_BYTES + 1),
}


@pytest.mark.parametrize("data", list(HOSTILE_FRAMES.values()), ids=list(HOSTILE_FRAMES))
def test_hostile_frames_are_refused_without_a_big_allocation(data: bytes) -> None:
    assert peak_allocation(data) < 4 * 1024 * 1024


def test_deeply_nested_array_claims_stay_bounded() -> None:
    """1,000 nested arrays each claiming the cap: msgpack preallocates only part of each claim
    and stops at its 1,024-level stack, so this 5 kB frame costs tens of MiB, not gigabytes."""
    frame = (b"\xdd" + struct.pack(">I", MSGPACK_ARRAY_CAP)) * 1000
    assert peak_allocation(frame) < 256 * 1024 * 1024


def test_an_array_claim_past_the_cap_is_refused_before_allocating() -> None:
    claim = b"\x93\x01\x0a\xdd" + struct.pack(">I", MSGPACK_ARRAY_CAP + 1)
    assert peak_allocation(claim) < 1024 * 1024


# --------------------------------------------------------------------------------------------
# Canonical CBOR.

cbor_keys = st.text(max_size=6) | st.integers(-1000, 1000)
cbor_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(cbor_keys, children, max_size=5),
    max_leaves=30,
)


def reversed_dicts(value: Any) -> Any:
    """The same value with every dict's insertion order reversed."""
    if isinstance(value, dict):
        return {k: reversed_dicts(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [reversed_dicts(x) for x in value]
    return value


@given(value=cbor_values)
def test_canonical_cbor_is_deterministic_and_ignores_key_order(value: Any) -> None:
    data = canonical_cbor(value)
    assert canonical_cbor(value) == data
    assert canonical_cbor(reversed_dicts(value)) == data


@given(
    items=st.dictionaries(st.text(max_size=8), st.integers(), min_size=2, max_size=8),
    data=st.data(),
)
def test_canonical_cbor_of_a_dict_does_not_depend_on_insertion_order(
    items: dict[str, int], data: st.DataObject
) -> None:
    order = data.draw(st.permutations(list(items)))
    shuffled = {key: items[key] for key in order}
    assert canonical_cbor(shuffled) == canonical_cbor(items)


@given(message=any_message())
def test_canonical_cbor_of_a_message_is_its_wire_fields(message: Message) -> None:
    data = canonical_cbor(message)
    assert canonical_cbor(message) == data
    assert cbor2.loads(data) == to_wire(message)


def test_canonical_cbor_uses_the_shortest_forms() -> None:
    assert canonical_cbor(1) == b"\x01"
    assert canonical_cbor(1000) == b"\x19\x03\xe8"
    assert canonical_cbor({"b": 1, "a": 2}) == canonical_cbor({"a": 2, "b": 1}) == bytes.fromhex(
        "a2616102616201"
    )
