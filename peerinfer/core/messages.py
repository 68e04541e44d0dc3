"""Wire messages: every record and message peers exchange, by protocol.

Each is a frozen dataclass with a ``SCHEMA`` (one validator per field) and, for a top-level
message, a one-byte tag (``@register``). How they are framed, validated and encoded is
:mod:`peerinfer.core.wire`, re-exported here, so ``from peerinfer.core.messages import encode``
keeps working. To add a protocol: add its messages here under a new section, with fresh tags.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from peerinfer.core.quickinit import quick_init
from peerinfer.core.wire import (
    MAX_DELTA,
    MAX_FRAME_BYTES,
    MAX_ID_CHARS,
    MAX_LIST,
    MAX_NEW_TOKENS,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_TEXT_CHARS,
    PROTOCOL_VERSION,
    U8,
    U32,
    U64,
    Bin,
    Bool,
    Float,
    ListOf,
    Message,
    Nested,
    Optional,
    Record,
    Text,
    UInt,
    UIntList,
    Validator,
    canonical_cbor,
    decode,
    encode,
    message_types,
    register,
)

# --------------------------------------------------------------------------------------------
# Shared records.

PEER_ID = Text(MAX_ID_CHARS)
REQUEST_ID = Text(MAX_ID_CHARS)
HASH = UInt(U64)


@quick_init
@quick_init
@dataclass(frozen=True, slots=True)
class Load(Record):
    """A node's announced load: requests waiting, running, and how many it runs at once.

    ``speed`` is how fast the node serves, its own cost model's ``CostModel.speed()`` (four
    figures in nanoseconds: per uncached prompt token, per cached one, per generated token, per
    request), so a peer's ``cost`` policy estimates it at its own speed; empty: not announced
    (an older node; the receiver then assumes its own figures). Loads compare equal when
    they count the same requests, whatever the speed.
    """

    queued: int = 0
    running: int = 0
    slots: int = 1
    speed: tuple[int, ...] = field(default=(), compare=False)
    #: the scaffold hashes of the prompts this node served lately, newest last: the cache
    #: hints of the ``scaffold_hash`` policy (Mesh LLM's model: at most
    #: 128, ``routing.MAX_SCAFFOLD_HINTS``, none older than its lifetime). Empty unless that policy runs,
    #: and then left off the wire, so other swarms' loads are byte for byte as before.
    scaffolds: tuple[int, ...] = field(default=(), compare=False)
    #: the disk tier (``--disk-cache-bytes``), what a hit on this node costs beyond a memory
    #: hit: ``(per mille of the blocks it holds that are on disk only, nanoseconds to load
    #: one token's KV from disk)``; empty: no disk tier (and left off the wire)
    disk: tuple[int, ...] = field(default=(), compare=False)
    OPTIONAL_TAIL: ClassVar[int] = 3
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        UInt(U32),
        UInt(U32),
        UInt(U32, minimum=1),
        # below 10**15 ns (a million seconds): what a CostModel accepts
        UIntList(10**15 - 1, 4),
        UIntList(U64, 128),
        UIntList(10**15 - 1, 2),
    )

    def _to_fields(self) -> list[Any]:
        out = [self.queued, self.running, self.slots, list(self.speed)]
        if self.scaffolds or self.disk:
            out.append(list(self.scaffolds))
        if self.disk:
            out.append(list(self.disk))
        return out

    @property
    def disk_s_per_token(self) -> float:
        """The expected extra seconds per matched token of a hit here, for the share of
        blocks on disk (0.0 without a disk tier, or for a malformed figure)."""
        disk = self.disk
        if len(disk) != 2:
            return 0.0
        return min(disk[0], 1000) * disk[1] * 1e-12


#: Kinds of output constraint (``Constraint.kind``); see ``peerinfer.engine.constraints``.
CONSTRAINT_KINDS = frozenset({"json_object", "json_schema", "lark", "regex"})
#: The longest constraint specification (a JSON schema, a grammar), in characters.
MAX_CONSTRAINT_CHARS = 262_144
#: The most alternatives ``top_logprobs`` may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class Constraint(Record):
    """What the output must match, enforced token by token while sampling (constrained decoding).

    ``kind``: ``json_object`` (any JSON object; ``spec`` empty), ``json_schema`` (``spec``: the
    schema as JSON text), ``lark`` (``spec``: a Lark grammar in llguidance's dialect, which may
    embed ``%json {...}`` schemas), ``regex``. ``consumed``: tokens already generated under this
    constraint (a request resumed after its first server failed mid-stream, or an audit of such
    an answer): the state starts after them.
    """

    kind: str
    spec: str = ""
    consumed: tuple[int, ...] = ()
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        Text(32, CONSTRAINT_KINDS),
        Text(MAX_CONSTRAINT_CHARS),
        UIntList(U32, MAX_NEW_TOKENS),
    )


@dataclass(frozen=True, slots=True)
class SamplingParams(Record):
    """How to generate. ``temperature == 0`` is greedy; ``seed`` makes sampling repeatable.

    ``constraint``: the output must match it (None: free text). ``logprobs``: report each
    generated token's log-probability under the model (its raw log-softmax, before temperature,
    top-p or the constraint's mask), with the ``top_logprobs`` most likely alternatives.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    OPTIONAL_TAIL: ClassVar[int] = 3
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        UInt(MAX_NEW_TOKENS, minimum=1),
        Float(0.0, 100.0),
        Float(1e-6, 1.0),
        Optional(UInt(U64)),
        ListOf(Text(256), 16),
        Optional(Nested(Constraint)),
        Bool(),
        UInt(MAX_TOP_LOGPROBS),
    )


@dataclass(frozen=True, slots=True)
class ChatMessage(Record):
    """One message of a chat. ``tool_calls``: an assistant's calls, as the JSON text of
    OpenAI's ``tool_calls`` list; ``tool_call_id`` (role ``tool``): the call this answers;
    ``name``: the tool's name for a ``tool`` message (optional)."""

    role: str
    content: str
    tool_calls: str = ""
    tool_call_id: str = ""
    name: str = ""
    OPTIONAL_TAIL: ClassVar[int] = 3
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        Text(32),
        Text(MAX_PROMPT_CHARS),
        Text(MAX_PROMPT_CHARS),
        Text(MAX_ID_CHARS),
        Text(MAX_ID_CHARS),
    )


@dataclass(frozen=True, slots=True)
class TopLogprob(Record):
    """One of the most likely tokens at a position: its id, text and log-probability."""

    token_id: int
    text: str
    logprob: float
    SCHEMA: ClassVar[tuple[Validator, ...]] = (UInt(U32), Text(256), Float(-1e9, 0.0))


@dataclass(frozen=True, slots=True)
class TokenLogprob(Record):
    """A generated token's log-probability, and the ``top`` alternatives at its position."""

    token_id: int
    text: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        UInt(U32),
        Text(256),
        Float(-1e9, 0.0),
        ListOf(Nested(TopLogprob), MAX_TOP_LOGPROBS),
    )


# --------------------------------------------------------------------------------------------
# Anti-entropy (gossip + sync stream).


@register(1)
@dataclass(frozen=True, slots=True)
class Announce(Message):
    """Broadcast on the model's gossip topic: 'my cache digest is now ``root`` at ``epoch``'.

    ``added``/``removed`` are the block hashes changed since ``prev_epoch`` when they fit; a peer
    whose replica is at ``prev_epoch`` applies them without a pull. ``truncated`` says the delta
    was too large to carry (then a pull repairs). ``time_ms`` is informational (the sender's
    clock; receivers never compare it with theirs: freshness is epochs and receive times).
    """

    sender: str
    epoch: int
    prev_epoch: int
    root: int
    count: int
    load: Load
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    truncated: bool = False
    time_ms: int = 0
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        PEER_ID,
        UInt(U64),
        UInt(U64),
        HASH,
        UInt(U64),
        Nested(Load),
        UIntList(U64, MAX_DELTA),
        UIntList(U64, MAX_DELTA),
        Bool(),
        UInt(U64),
    )


@dataclass(frozen=True, slots=True)
class SyncQuery(Record):
    """One node of the requester's Merkle tree that it wants compared or exchanged.

    A node is named by ``level`` (its depth in bits, 0 to 64) and ``prefix`` (the top ``level``
    bits of the *positions* under it; see ``peerinfer.core.digest``).

    * ``span >= 1``, a *comparison*: ``summaries`` packs, for each of the node's ``2**span``
      descendants at depth ``level + span`` in prefix order, ``SUMMARY_BITS`` bits: a slice of
      the requester's hash of that descendant and, in the low 2 bits, its count modulo 4.
    * ``span == 0``, an *exchange*: ``summaries`` packs a fingerprint of each element the
      requester holds under the node (empty: a plain listing); the width is a function of their
      number (``digest.fingerprint_bits``).

    The cross-field rules (``prefix < 2**level``, ``level + span <= 64``, the length of
    ``summaries``) are checked by the responder, which raises ``ProtocolError`` on a query that
    breaks them.
    """

    level: int
    prefix: int
    span: int = 0
    summaries: bytes = b""
    #: Bits per descendant in a comparison: a hash slice and a 2-bit count residue.
    SUMMARY_BITS: ClassVar[int] = 10
    #: The widest comparison one query may ask for (2**MAX_SPAN descendants).
    MAX_SPAN: ClassVar[int] = 16
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        UInt(64),
        UInt(U64),
        UInt(16),
        Bin(MAX_FRAME_BYTES // 4),
    )


@dataclass(frozen=True, slots=True)
class SyncNode(Record):
    """The responder's answers to the first ``answered`` queries of a request, batched.

    For each answered query in order, ``counts`` holds the responder's number of elements under
    the node, followed by, for a comparison, the count of each descendant marked in its bitmap,
    or, for an exchange, the number of elements it sends. ``bitmaps`` concatenates one bitmap per
    answered query (bit ``i`` is ``0x80 >> i % 8`` of byte ``i // 8``): for a comparison, over
    its ``2**span`` descendants, marking those that differ; for an exchange, over the requester's
    fingerprints, marking those of elements the responder does not hold. ``hashes``
    concatenates, for each marked descendant whose count difference is odd (known to both sides
    from the count residues), its 64-bit hash (difference +1 modulo 4) or the low 32 bits of it
    (-1 modulo 4), unless more than 90% of that comparison's descendants differ (then none).
    ``elements`` concatenates the elements each exchange sends (8 bytes each, big-endian).
    Every field is packed, so a response costs no bytes per node beyond its content.
    """

    answered: int = 0
    counts: tuple[int, ...] = ()
    bitmaps: bytes = b""
    hashes: bytes = b""
    elements: bytes = b""
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        UInt(MAX_LIST),
        UIntList(U64, MAX_PROMPT_TOKENS),
        Bin(MAX_FRAME_BYTES),
        Bin(MAX_FRAME_BYTES),
        Bin(MAX_FRAME_BYTES),
    )


@register(2)
@dataclass(frozen=True, slots=True)
class SyncRequest(Message):
    """A pull of the parts of a digest whose hashes differ from the requester's replica.

    ``since_epoch``: the epoch the requester's replica last matched (0 for none); a responder
    whose change log reaches back that far answers with the delta alone (and ignores
    ``queries``). ``slice`` selects which hash function derives the truncated summaries, so a
    rare truncated-hash collision is not repeated on the next pass. The responder answers a
    prefix of ``queries`` (at least one when there are any), in order.
    """

    session: int
    since_epoch: int
    slice: int
    queries: tuple[SyncQuery, ...] = ()
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        UInt(U64),
        UInt(U64),
        UInt(U8),
        ListOf(Nested(SyncQuery), MAX_LIST),
    )


@register(3)
@dataclass(frozen=True, slots=True)
class SyncResponse(Message):
    """The responder's current state (``epoch``: its last sealed epoch; ``root`` and ``count``:
    its live set, which may include changes not sealed yet) and its answers.

    When ``delta`` is true, ``added``/``removed`` pack (8 bytes each, big-endian) every net change
    since the request's ``since_epoch`` and ``answers`` is empty; otherwise ``answers`` answers a
    prefix of the request's queries (at least one, if there were any).
    """

    session: int
    epoch: int
    root: int
    count: int
    answers: SyncNode = SyncNode()
    delta: bool = False
    added: bytes = b""
    removed: bytes = b""
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        UInt(U64),
        UInt(U64),
        HASH,
        UInt(U64),
        Nested(SyncNode),
        Bool(),
        Bin(MAX_FRAME_BYTES),
        Bin(MAX_FRAME_BYTES),
    )


# --------------------------------------------------------------------------------------------
# Inference (client -> node, and node -> node when forwarding).

ERROR_CODES = frozenset(
    {"busy", "invalid", "timeout", "unavailable", "protocol", "internal", "shutdown"}
)


@register(10)
@dataclass(frozen=True, slots=True)
class GenerateRequest(Message):
    """Generate a completion.

    A client sends ``prompt`` (text) or ``messages`` (chat). A node forwarding to a peer sends
    ``tokens`` (already tokenized, so the target's cache is matched on exactly these ids) and
    ``forwarded=True``: a forwarded request is served where it lands, never forwarded again.
    ``tools`` (with ``messages``): the JSON text of OpenAI's ``tools`` list, rendered into the
    prompt (``Engine.chat_prompt_tokens``), so a forwarded request's tokens include them.
    ``deadline_ms`` is a relative budget for the first token. ``max_outstanding`` (forwarded
    requests only): refuse it as busy if more requests than this are queued or running when it
    arrives (the origin's routing assumed no more; None: no limit).
    """

    request_id: str
    params: SamplingParams
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] = ()
    tokens: tuple[int, ...] = ()
    forwarded: bool = False
    origin: str = ""
    deadline_ms: int = 0
    max_outstanding: int | None = None
    tools: str = ""
    #: forwarded requests: the salted hash of the prompt's scaffold (``PrefixHasher.
    #: scaffold_hash``), which the target records as a cache hint (``scaffold_hash`` policy)
    scaffold: int | None = None
    OPTIONAL_TAIL: ClassVar[int] = 2
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        REQUEST_ID,
        Nested(SamplingParams),
        Optional(Text(MAX_PROMPT_CHARS)),
        ListOf(Nested(ChatMessage), 1024),
        UIntList(U32, MAX_PROMPT_TOKENS),
        Bool(),
        PEER_ID,
        UInt(U32),
        Optional(UInt(U32)),
        Text(MAX_PROMPT_CHARS),
        Optional(UInt(U64)),
    )


@register(11)
@dataclass(frozen=True, slots=True)
class TokenChunk(Message):
    """Some generated tokens (and their text) of a request, in order."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    #: one per token of ``token_ids`` (end of sequence excepted) when the request asked for them
    logprobs: tuple[TokenLogprob, ...] = ()
    OPTIONAL_TAIL: ClassVar[int] = 1
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        REQUEST_ID,
        UIntList(U32, 65_536),
        Text(MAX_TEXT_CHARS),
        ListOf(Nested(TokenLogprob), 65_536),
    )


@register(12)
@dataclass(frozen=True, slots=True)
class GenerateDone(Message):
    """The end of a successful generation, with its accounting."""

    request_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    served_by: str
    ttft_s: float
    latency_s: float
    finish_reason: str
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        REQUEST_ID,
        UInt(U32),
        UInt(U32),
        UInt(U32),
        PEER_ID,
        Float(0.0, 1e9),
        Float(0.0, 1e9),
        Text(32),
    )


@register(13)
@dataclass(frozen=True, slots=True)
class ErrorMessage(Message):
    """A request (or a whole stream) failed. ``code`` says who must act; ``retry_after_s``:
    for a ``busy`` refusal, when retrying may be worth it (0: no hint; older peers omit it)."""

    request_id: str
    code: str
    message: str
    retry_after_s: float = 0.0
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        Text(MAX_ID_CHARS),
        Text(32, ERROR_CODES),
        Text(4096),
        Float(0.0, 86_400.0),
    )
    OPTIONAL_TAIL: ClassVar[int] = 1


# --------------------------------------------------------------------------------------------
# Status, liveness and peer exchange.


@register(20)
@dataclass(frozen=True, slots=True)
class StatusRequest(Message):
    SCHEMA: ClassVar[tuple[Validator, ...]] = ()


@dataclass(frozen=True, slots=True)
class PeerStatus(Record):
    peer_id: str
    digest_age_s: float
    load: Load
    cached_tokens: int
    rtt_ms: float
    #: the reporting node's reputation of this peer: "score standing: why" ("" from older nodes)
    reputation: str = ""
    OPTIONAL_TAIL: ClassVar[int] = 1
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        PEER_ID,
        Float(0.0, 1e12),
        Nested(Load),
        UInt(U64),
        Float(0.0, 1e12),
        Text(256),
    )


@dataclass(frozen=True, slots=True)
class CacheStatus(Record):
    tokens: int
    bytes: int
    capacity_bytes: int
    SCHEMA: ClassVar[tuple[Validator, ...]] = (UInt(U64), UInt(U64), UInt(U64))


@dataclass(frozen=True, slots=True)
class RequestCounters(Record):
    """What a node did with the requests it saw since it started (``NodeCore.statistics``):
    ``requests`` received (from clients and peers), ``served_locally``, ``forwarded`` to a peer,
    ``failovers`` (a forward that failed and was routed again), ``rejected`` (refused: busy,
    invalid, full), ``rejected_over_limit`` (forwarded requests refused because more were
    outstanding here than the origin's routing assumed)."""

    requests: int = 0
    served_locally: int = 0
    forwarded: int = 0
    failovers: int = 0
    rejected: int = 0
    rejected_over_limit: int = 0
    SCHEMA: ClassVar[tuple[Validator, ...]] = tuple(UInt(U64) for _ in range(6))


@register(21)
@dataclass(frozen=True, slots=True)
class StatusResponse(Message):
    peer_id: str
    addrs: tuple[str, ...]
    model: str
    peers: tuple[PeerStatus, ...]
    cache: CacheStatus
    load: Load
    counters: RequestCounters = RequestCounters()
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        PEER_ID,
        ListOf(Text(512), 64),
        Text(512),
        ListOf(Nested(PeerStatus), 4096),
        Nested(CacheStatus),
        Nested(Load),
        Nested(RequestCounters),
    )


@register(22)
@dataclass(frozen=True, slots=True)
class Ping(Message):
    nonce: int
    SCHEMA: ClassVar[tuple[Validator, ...]] = (UInt(U64),)


@register(23)
@dataclass(frozen=True, slots=True)
class Pong(Message):
    nonce: int
    load: Load
    SCHEMA: ClassVar[tuple[Validator, ...]] = (UInt(U64), Nested(Load))


@dataclass(frozen=True, slots=True)
class PeerAddrs(Record):
    peer_id: str
    addrs: tuple[str, ...]
    SCHEMA: ClassVar[tuple[Validator, ...]] = (PEER_ID, ListOf(Text(512), 16))


@register(24)
@dataclass(frozen=True, slots=True)
class PeerExchange(Message):
    """Peers the sender knows that serve the same model, so a newcomer learns the network."""

    peers: tuple[PeerAddrs, ...]
    SCHEMA: ClassVar[tuple[Validator, ...]] = (ListOf(Nested(PeerAddrs), 1024),)


# --------------------------------------------------------------------------------------------
# KV pulls (node -> node, ``/peerinfer/kv/1.0.0``; issue 24): the KV of a run of blocks by hash,
# or bounded filler bytes that measure the link (``NodeCore``'s ``ProbeLink``).

#: The most blocks one pull may ask for (4,096 tokens at 16-token blocks: the node's default
#: prompt limit), and the most filler bytes one probe may ask for.
MAX_KV_PULL_BLOCKS = 256
MAX_KV_FILLER_BYTES = 8 * 1024 * 1024
#: One ``KvBlocks`` frame carries at most this many bytes of blocks (the frame limit is 8 MiB):
#: a block larger than this travels alone.
KV_FRAME_TARGET_BYTES = 4 * 1024 * 1024
#: Why a holder refused a pull (``KvPullDone.refused``; "" when it served).
KV_REFUSALS = frozenset({"", "off", "untrusted", "format", "busy", "too_large"})


@register(40)
@dataclass(frozen=True, slots=True)
class KvPullRequest(Message):
    """Ask a holder for the KV of the blocks ``hashes`` (in chain order) in the engine format
    ``format`` (``Engine.kv_format()``), or, with ``filler_bytes`` > 0 and no hashes, for that
    many filler bytes (a link probe). The holder answers ``KvBlocks`` frames, then ``KvPullDone``.
    """

    format: str
    hashes: tuple[int, ...] = ()
    filler_bytes: int = 0
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        Text(256),
        UIntList(U64, MAX_KV_PULL_BLOCKS),
        UInt(MAX_KV_FILLER_BYTES),
    )


@register(41)
@dataclass(frozen=True, slots=True)
class KvBlocks(Message):
    """The next encoded blocks of a pull, in order (``Engine.encode_block``), or filler."""

    blocks: tuple[bytes, ...] = ()
    filler: bytes = b""
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        ListOf(Bin(MAX_FRAME_BYTES), MAX_KV_PULL_BLOCKS),
        Bin(MAX_FRAME_BYTES),
    )


@register(42)
@dataclass(frozen=True, slots=True)
class KvPullDone(Message):
    """The end of a pull's answer: ``blocks`` blocks were sent (the leading run of the hashes
    asked for that the holder held), or the pull was ``refused`` (``KV_REFUSALS``) and why."""

    blocks: int = 0
    refused: str = ""
    detail: str = ""
    SCHEMA: ClassVar[tuple[Validator, ...]] = (
        UInt(MAX_KV_PULL_BLOCKS),
        Text(32, KV_REFUSALS),
        Text(512),
    )


def _check_schemas(classes: Sequence[type[Record]]) -> None:
    for cls in classes:
        n = len(fields(cls))  # type: ignore[arg-type]
        if len(cls.SCHEMA) != n:
            raise RuntimeError(f"{cls.__name__}.SCHEMA has {len(cls.SCHEMA)} validators for {n} fields")


_check_schemas(
    [Load, Constraint, SamplingParams, ChatMessage, TopLogprob, TokenLogprob, SyncQuery, SyncNode, PeerStatus, CacheStatus, PeerAddrs]
    + list(message_types().values())
)


#: Everything public here, the wire format (:mod:`peerinfer.core.wire`) included.
__all__ = [
    "Announce",
    "Bin",
    "Bool",
    "CONSTRAINT_KINDS",
    "CacheStatus",
    "ChatMessage",
    "Constraint",
    "ERROR_CODES",
    "ErrorMessage",
    "Float",
    "GenerateDone",
    "GenerateRequest",
    "HASH",
    "KV_FRAME_TARGET_BYTES",
    "KV_REFUSALS",
    "KvBlocks",
    "KvPullDone",
    "KvPullRequest",
    "ListOf",
    "Load",
    "MAX_CONSTRAINT_CHARS",
    "MAX_DELTA",
    "MAX_FRAME_BYTES",
    "MAX_ID_CHARS",
    "MAX_KV_FILLER_BYTES",
    "MAX_KV_PULL_BLOCKS",
    "MAX_LIST",
    "MAX_NEW_TOKENS",
    "MAX_PROMPT_CHARS",
    "MAX_PROMPT_TOKENS",
    "MAX_TEXT_CHARS",
    "MAX_TOP_LOGPROBS",
    "Message",
    "Nested",
    "Optional",
    "PEER_ID",
    "PROTOCOL_VERSION",
    "PeerAddrs",
    "PeerExchange",
    "PeerStatus",
    "Ping",
    "Pong",
    "REQUEST_ID",
    "Record",
    "RequestCounters",
    "SamplingParams",
    "StatusRequest",
    "StatusResponse",
    "SyncNode",
    "SyncQuery",
    "SyncRequest",
    "SyncResponse",
    "Text",
    "TokenChunk",
    "TokenLogprob",
    "TopLogprob",
    "U32",
    "U64",
    "U8",
    "UInt",
    "UIntList",
    "Validator",
    "canonical_cbor",
    "decode",
    "encode",
    "message_types",
    "register",
]
