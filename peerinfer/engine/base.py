"""The inference backend interface: one small contract every engine implements.

Theory of operation
-------------------
An engine is **plain synchronous code**. The node runs every call into it in one worker thread
(``trio.to_thread``) and relays the events it yields back to the trio loop, so the event loop
never blocks on model compute. Engines are therefore not thread-safe and need not be: all calls
come from one thread at a time (several requests may be interleaved, step by step, in that
thread: ``generate`` iterators, or the :class:`~peerinfer.engine.batch.BatchScheduler`, which
decodes many at once through :meth:`Engine.decode_batch`). A request is cancelled through a
:class:`CancelToken` (a ``threading.Event`` will do) that the engine checks before the first
forward pass and between decode steps. The per-request logic is one class,
:class:`RequestJob`, shared by ``generate`` and the scheduler.

Where things are: this module holds the :class:`Engine` base class and re-exports the rest of
the interface, which lives in small modules of its own: ``events`` (what an engine reports),
``decoder`` (what a backend receives and returns: ``DecodeRequest``, ``Decoder``,
``KVSegment``, ``CancelToken``), ``validation`` (request checks), ``textstream`` (incremental
detokenization) and ``job`` (``RequestJob``, one request's life).

A backend author implements the identity (``fingerprint``, ``vocab_size``), ``tokenize`` /
``detokenize`` and one method producing token ids, :meth:`Engine.generate_tokens`. The base class
does everything else around it: request validation (clear :class:`InvalidRequestError`, the
engine keeps serving), sampling-parameter checks, the ``max_tokens`` and context limits,
end-of-sequence and stop sequences, incremental detokenization that never emits half a
character, cancellation, the event stream, and translating the backend's own failures into
:class:`EngineError`.

``generate(tokens, params, cancel)`` yields, in order::

    Started(prompt_tokens, cached_tokens)
    Tokens(token_ids, text)  ...          one per generated token; text may lag (held until
                                          stable) and a last Tokens(() , text) may flush it
    Finished(finish_reason, prompt_tokens, completion_tokens, cached_tokens,
             cache_added, cache_removed)

**Prefix cache hooks.** A backend that can reuse KV state sets ``supports_prefix_cache = True``
and overrides :meth:`Engine.open_decoder` instead of ``generate_tokens``. The engine then owns a
:class:`~peerinfer.core.radix.RadixCache` (configured with the node's ``PrefixHasher`` through
:meth:`Engine.configure_cache`, confined to the worker thread like everything else) and drives it
the same way for every backend:

1. *Reuse.* The longest cached prefix of ``prompt[:-1]`` is matched (never the last prompt token:
   the first generated token needs the logits at the last prompt position, so at least one token
   is always run) and its path is **locked** for the request. The backend receives it as
   ``request.prefix``: how many tokens, and one opaque segment (payload) per block.
2. *Store.* When generation ends, the decoder reports how many tokens of ``prompt + generated``
   it holds KV for (``kv_tokens``) and exports one :class:`KVSegment` (payload, nbytes) per full
   block not cached yet; the engine inserts them, so the next turn of a conversation hits too.
3. *Free.* Whenever the cache drops a payload (eviction under the byte/token budget, or a block
   someone else cached first) the engine calls :meth:`Engine.free_segment`.
4. *Spill and load* (optional). An engine that names a ``kv_format()`` and encodes its payloads
   as bytes (``encode_block``/``decode_block``) can keep a disk tier (``configure_disk``;
   :mod:`peerinfer.engine.disktier`): every evicted block is written to it, and before step 1
   the blocks continuing the prompt's cached prefix are loaded from it back into the cache.
   The same bytes serve peers (``encode_blocks`` by hash) and take in their blocks
   (``adopt_blocks``).

The node keeps its own digest of the cache on the trio thread, so the engine *reports* changes
instead of letting anyone observe its cache: every ``Finished`` carries the block hashes added and
removed since the previous report (net: a block added and evicted in between is in neither; with
a disk tier, "cached" means in memory or on disk), and :meth:`Engine.cached_block_hashes` gives a
snapshot for start-up. Reports are deltas: apply them
in the order they are made (with interleaved requests, as soon as each ``Finished`` arrives). A
backend without a cache reports ``cached_tokens=0`` and empty changes.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Container, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from peerinfer.core.messages import MAX_PROMPT_TOKENS, ChatMessage, SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.core.radix import RadixCache, RadixNode
from peerinfer.engine.changelog import ChangeLog
from peerinfer.engine.decoder import (
    NEVER_CANCELLED,
    NO_PREFIX,
    CachedPrefix,
    CancelToken,
    Decoder,
    DecodeRequest,
    KVSegment,
    wait_cancelled,
)
from peerinfer.engine.disktier import DiskTier, DiskTierStatistics, load_prefix, save_blocks
from peerinfer.engine.events import (
    CacheChanges,
    EngineEvent,
    EngineStatistics,
    Finished,
    FinishReason,
    Started,
    Tokens,
)
from peerinfer.engine.job import RequestJob, _Counters
from peerinfer.engine.kvmemo import OwnBlocks, dropped, remember_stored
from peerinfer.engine.textstream import TextStream
from peerinfer.engine.validation import validate_prompt, validate_sampling_params
from peerinfer.errors import (
    ClosedError,
    ConfigError,
    EngineError,
    InvalidRequestError,
)
from peerinfer.types import BlockHash

if TYPE_CHECKING:
    from peerinfer.core.costmodel import CostModel
    from peerinfer.engine.constraints import GrammarTokenizer, TokenGuide


class _IteratorDecoder(Decoder):
    """Adapts a backend's ``generate_tokens`` iterator (no KV export)."""

    __slots__ = ("_it",)

    def __init__(self, it: Iterator[int]) -> None:
        self._it = it

    def step(self) -> int | None:
        return next(self._it, None)

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if callable(close):
            close()


class Engine(ABC):
    """The inference backend interface (see the module docstring for the contract).

    Subclasses must provide ``fingerprint``, ``vocab_size``, ``tokenize``, ``detokenize`` and
    either ``generate_tokens`` (simple backends) or ``open_decoder`` (backends with KV reuse,
    together with ``supports_prefix_cache = True`` and ``free_segment``). Class attributes may
    replace the abstract properties (``fingerprint = b"my-model-v1"``).
    """

    #: Whether ``open_decoder`` consumes ``request.prefix`` and exports KV segments.
    supports_prefix_cache: bool = False
    #: Whether ``tokenize`` and ``chat_tokens`` may run on another thread while a generation
    #: runs in the worker thread. The node then tokenizes incoming prompts (to route them)
    #: without waiting for the current decode step; otherwise it queues behind it.
    thread_safe_tokenizer: bool = False
    #: The KV byte budget used when ``configure_cache`` is given none (None: unbounded).
    default_capacity_bytes: int | None = None
    #: Block size of the cache configured on first use when the node configured none.
    default_block_size: int = 16
    #: How many requests the engine decodes at once (its capacity; the node's ``slots``).
    #: Backends whose ``decode_batch`` runs one forward pass for many decoders raise it.
    max_batch_size: int = 1
    #: KV bytes one token of a running request takes (0 = unknown: no memory accounting). The
    #: scheduler reserves ``(prompt + max_tokens) * kv_bytes_per_token`` per running request
    #: out of the cache's byte budget.
    kv_bytes_per_token: int = 0
    #: The cost model a node running this engine announces when given none (``--costs``):
    #: a backend's own calibration (llama.cpp's CPU figures); None: the node's default.
    default_costs: CostModel | None = None
    #: Whether the backend reports logprobs through ``DecodeRequest.guide``.
    supports_logprobs: bool = False

    _cache: RadixCache | None = None
    _disk: DiskTier | None = None
    _changes: ChangeLog | None = None
    _counters: _Counters | None = None
    _closed: bool = False
    _own_blocks: OwnBlocks | None = None  # digests of the blocks it computed (engine/kvmemo.py)

    # ------------------------------------------------------------ identity and tokenizer

    @property
    @abstractmethod
    def fingerprint(self) -> bytes:
        """Identifies the model and tokenizer; prefix hashes are seeded with it. Stable across
        processes and machines; available right after construction."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``."""

    @property
    def max_context_tokens(self) -> int:
        """The longest sequence (prompt + completion) the model handles."""
        return MAX_PROMPT_TOKENS

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a generation (reported, with empty text, then 'stop')."""
        return frozenset()

    @property
    def model_name(self) -> str:
        """A human-readable name of the model (status pages, logs)."""
        return type(self).__name__

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """The token ids of ``text`` as a prompt (with the model's usual special tokens)."""

    @abstractmethod
    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens`` (special tokens dropped). Called on short windows while
        streaming, so it must be cheap and deterministic."""

    @property
    def has_chat_template(self) -> bool:
        """True when ``chat_tokens`` uses the model's own chat template."""
        return False

    def chat_tokens(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The prompt for a chat, ready for the assistant's reply.

        The default is a plain ``role: content`` transcript ending in ``assistant:``; backends
        whose model has a chat template override this.
        """
        if not messages:
            raise InvalidRequestError("a chat needs at least one message")
        lines = [f"{m.role}: {m.content}" for m in messages]
        lines.append("assistant:")
        return self.tokenize("\n".join(lines))

    def chat_prompt_tokens(self, messages: Sequence[ChatMessage], tools: str = "") -> list[int]:
        """The prompt for a chat that may offer ``tools`` (the JSON text of OpenAI's list) and
        hold tool calls and results: the node's one entry point for chats.

        The default renders tools, calls and results in peerinfer's generic tool format
        (``peerinfer.engine.tools``) as plain messages, then ``chat_tokens``; a backend whose
        chat template renders tools itself overrides this.
        """
        from peerinfer.engine.tools import generic_messages

        return self.chat_tokens(generic_messages(messages, tools))

    def grammar_tokenizer(self) -> GrammarTokenizer | None:
        """This engine's vocabulary for constrained decoding (built once, then cached), or None
        when the backend does not apply ``DecodeRequest.guide``'s mask (constrained requests
        are then refused)."""
        return None

    # ------------------------------------------------------------ backend hooks

    def generate_tokens(self, request: DecodeRequest) -> Iterator[int]:
        """Yield generated token ids one at a time (simple backends implement this).

        The base class stops iterating when it has enough (``max_tokens``, end of sequence,
        stop sequence, context full, cancellation) and closes the iterator; ending the iterator
        early finishes the request with ``'stop'``. Check ``request.cancel`` inside long
        computations if you can.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must implement generate_tokens() or open_decoder()"
        )
        yield 0  # pragma: no cover - makes this a generator function for type checkers

    def open_decoder(self, request: DecodeRequest) -> Decoder:
        """Start decoding ``request`` (backends with KV reuse override this)."""
        return _IteratorDecoder(self.generate_tokens(request))

    def free_segment(self, payload: Any) -> None:
        """Release a KV segment payload the cache no longer holds (default: drop it)."""
        return None

    def decode_batch(self, decoders: Sequence[Decoder]) -> list[int | None]:
        """One new token for each decoder (each has finished its prefill), in one forward pass
        where the backend can. Entry ``i`` is ``decoders[i]``'s token, or None when the backend
        stops it. The default steps them one by one (backends that cannot batch keep working).

        If it raises, the scheduler retries each decoder alone (``decode_batch([d])``) to find
        the failing request, so a batching backend should raise before it advances any decoder.
        """
        return [d.step() for d in decoders]

    def prefill_batch(self, decoders: Sequence[Decoder], max_tokens: Sequence[int]) -> list[bool]:
        """Run, for each decoder ``i``, up to ``max_tokens[i]`` more prompt tokens, in as few
        forward passes as the backend can; entry ``i`` says whether ``decoders[i]``'s prompt is
        now complete (as :meth:`Decoder.prefill` returns). The default prefills them one by one.

        The :class:`~peerinfer.engine.batch.BatchScheduler` calls it with the requests still
        prefilling, shortest first, within one step's token budget. If it raises, the scheduler
        retries each decoder alone (``Decoder.prefill``) to find the failing request, so a
        batching backend should raise before it advances any decoder.
        """
        return [d.prefill(n) for d, n in zip(decoders, max_tokens, strict=True)]

    # ------------------------------------------------------------ cache

    def configure_cache(
        self,
        hasher: PrefixHasher,
        *,
        capacity_bytes: int | None = None,
        capacity_tokens: int | None = None,
    ) -> None:
        """Use ``hasher`` (the node's swarm key and block size) for this engine's cache.

        ``capacity_bytes`` None means the engine's ``default_capacity_bytes``; ``capacity_tokens``
        None means unbounded in tokens. Any previous cache is cleared (its payloads freed); this
        must not be called while requests are in flight. Engines without a prefix cache accept
        the call and keep nothing.
        """
        self._check_open()
        if hasher.fingerprint != self.fingerprint:
            raise ConfigError("the prefix hasher was built for another model fingerprint")
        old = self._cache
        if old is not None:
            if old.stats().locked_blocks:
                raise ConfigError("cannot reconfigure the cache while requests are running")
            old.clear()
        if not self.supports_prefix_cache:
            self._cache = None
            return
        if capacity_bytes is None:
            capacity_bytes = self.default_capacity_bytes
        changes = self._changes if self._changes is not None else ChangeLog()
        cache = RadixCache(
            hasher,
            capacity_tokens=capacity_tokens,
            capacity_bytes=capacity_bytes,
            on_evict=self._on_evict,
        )
        cache.add_observer(changes)
        self._cache = cache
        self._changes = changes
        disk = self._disk
        if disk is not None and (disk.kv_format != self.kv_format() or disk.hash_key != hasher.key):
            # Blocks of another block size, or hashed under another swarm key: of no use here.
            self.configure_disk(None)

    @property
    def radix_cache(self) -> RadixCache | None:
        """The engine's cache (worker thread only; None before first use or without one)."""
        return self._cache

    def cached_block_hashes(self) -> tuple[BlockHash, ...]:
        """Every cached block's hash (sorted). Later reports are relative to this snapshot."""
        cache = self._ensure_cache()
        if self._changes is not None:
            self._changes.take()
        if cache is None:
            return ()
        held = set(cache.block_hashes())
        if self._disk is not None:
            held.update(self._disk.hashes())
        return tuple(sorted(held))

    def take_cache_changes(self) -> CacheChanges:
        """Hashes added/removed since the last report (for generations abandoned mid-way)."""
        if self._changes is None:
            return CacheChanges()
        return self._changes.take()

    def statistics(self) -> EngineStatistics:
        c = self._counters or _Counters()
        return EngineStatistics(
            requests=c.requests,
            errors=c.errors,
            prompt_tokens=c.prompt_tokens,
            cached_tokens=c.cached_tokens,
            completion_tokens=c.completion_tokens,
            cache=None if self._cache is None else self._cache.stats(),
        )

    # ------------------------------------------------------------ KV blocks as bytes

    def kv_format(self) -> str | None:
        """The name of this engine's KV block format, or None when its blocks cannot be
        exported (no prefix cache, or a backend that does not implement the codec).

        Two engines can exchange KV blocks exactly when their formats are equal strings. A
        format is ``<kind>/<numerics>/<fingerprint hex>/b<block size>``: ``kind`` names the
        engine and its layout version (``hf-kv1``, ``llamacpp-kv1``, ``sim-kv1``), ``numerics``
        what else changes the bytes or their values (dtype and device for Transformers, the
        llama.cpp version and its K/V cell types), then the model fingerprint and the block
        size of the configured cache. Blocks of one format are interchangeable by block hash.
        """
        return None

    def encode_block(self, payload: Any) -> bytes:
        """One cached block's payload as bytes of ``kv_format()`` (for a disk or a peer)."""
        raise NotImplementedError(f"{type(self).__name__} cannot export KV blocks")

    def decode_block(self, data: bytes | memoryview, first_token: int) -> KVSegment:
        """The payload (and its accounted size) of a block encoded by ``encode_block`` in this
        engine's ``kv_format()``, the block holding positions ``first_token`` onwards.

        The bytes may come from a hostile peer or a damaged file: a decoder checks every size
        and shape against what this engine expects, never executes anything, and raises
        :class:`~peerinfer.errors.ProtocolError` on bytes that are not such a block.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot import KV blocks")

    def encoded_block_bytes(self) -> int | None:
        """The length of every block ``encode_block`` makes in ``kv_format()``, where the format
        fixes it (a puller refuses a block of any other length as it arrives, before buffering
        it); None when unknown (the default)."""
        return None

    def encode_blocks(self, hashes: Sequence[BlockHash], max_bytes: int | None = None) -> list[bytes]:
        """The encoded blocks (``encode_block``) of the leading run of ``hashes`` this engine
        holds, in order: it stops at the first hash it does not hold, and before the block that
        would take the total past ``max_bytes`` (so a pull's byte cap bounds the memory its
        answer takes here, not only what is sent). What a peer serves a pull from; the puller
        hands the bytes to ``adopt_blocks`` with its prompt."""
        self._check_open()
        cache = self._ensure_cache()
        if cache is None or self.kv_format() is None:
            return []
        out: list[bytes] = []
        total = 0
        disk = self._disk
        for h in hashes:
            node = cache.node_by_hash(h)
            data: bytes | None
            if node is not None:
                data = self.encode_block(node.payload)
            else:
                data = None if disk is None else disk.get(h, None)
            if data is None:
                break
            total += len(data)
            if max_bytes is not None and total > max_bytes:
                break
            out.append(data)
        return out

    def adopt_blocks(self, tokens: Sequence[int], blocks: Sequence[bytes | memoryview]) -> int:
        """Insert ``blocks`` (encoded KV of full blocks ``0 .. len(blocks)`` of ``tokens``, in
        order) into the cache, so that a request whose prompt starts with them hits.

        Blocks already cached are not decoded. Returns how many leading tokens of ``tokens``
        are cached afterwards (fewer than ``len(blocks) * block_size`` when the cache could not
        make room). All or nothing: every block is decoded before any is inserted, and when one
        does not decode it raises ProtocolError having inserted none. The bytes may come from a
        peer that is banned for the bad block; the well-formed blocks before it from the same
        peer (altered, perhaps, past the sampled check) must not stay in the cache.
        """
        self._check_open()
        cache = self._ensure_cache()
        if cache is None or self.kv_format() is None:
            raise EngineError(f"{type(self).__name__} cannot adopt KV blocks")
        bs = cache.block_size
        n = len(blocks)
        if n * bs > len(tokens):
            raise ValueError(f"{n} blocks need {n * bs} tokens, got {len(tokens)}")
        seq = tuple(tokens[: n * bs])
        have = cache.match(seq, touch=False).tokens // bs
        segments: list[KVSegment] = []
        try:
            for i in range(have, n):
                segments.append(self.decode_block(blocks[i], i * bs))
        except BaseException:
            for segment in segments:
                if segment.payload is not None:
                    self.free_segment(segment.payload)
            raise
        if segments:
            self._insert_segments(cache, seq, have, segments)
        return cache.match(seq, touch=False).tokens

    def _insert_segments(
        self, cache: RadixCache, seq: tuple[int, ...], have: int, segments: Sequence[KVSegment]
    ) -> None:
        """Insert ``segments`` as the blocks ``have ..`` of ``seq`` (the first ``have`` are
        cached), freeing those the cache did not take (already there, or no room)."""
        payloads: list[Any] = [None] * have + [s.payload for s in segments]
        sizes = [0] * have + [s.nbytes for s in segments]
        result = cache.insert(seq, payloads, sizes)
        for payload in result.unused_payloads:
            if payload is not None:
                self.free_segment(payload)

    #: Whether ``token_errors`` is implemented: a node pulls KV from peers only into an engine
    #: that can check what it pulled.
    verifies_kv_blocks: bool = False
    #: The run of consecutive tokens ``token_errors`` recomputes for about the price of one
    #: (``PullVerifier.sample``'s ``run``): 1 where every checked token costs the same anyway.
    verify_run_tokens: int = 1

    def token_errors(
        self,
        tokens: Sequence[int],
        first_block: int,
        blocks: Sequence[bytes | memoryview],
        checks: Sequence[int],
    ) -> list[tuple[int, float]]:
        """Recompute the KV of some pulled tokens locally and say how far each is from what was
        pulled.

        ``blocks`` are the encoded blocks ``first_block ..`` of ``tokens`` (from a peer, not
        adopted yet); the blocks before ``first_block`` must be in this engine's cache. Each
        ``c`` in ``checks`` is a token of the pulled run (``0 <= c < len(blocks) * block
        size``: token ``first_block * block size + c`` of ``tokens``). Its KV (every layer) is
        recomputed from the KV before it as pulled (cached or pulled: about one token's
        prefill), and compared with the pulled KV of that token: ``(c, relative error)``, the
        largest difference over the largest magnitude of the pulled block holding it (as
        ``peerinfer.core.kvpull.relative_error``). Raises ProtocolError when a needed block
        does not decode, EngineError when a block before ``first_block`` is not cached,
        ValueError for a check outside the pulled tokens.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot verify KV blocks")

    def _ensure_cache(self) -> RadixCache | None:
        if self._cache is None and self.supports_prefix_cache:
            self.configure_cache(PrefixHasher(self.fingerprint, block_size=self.default_block_size))
        return self._cache

    def _on_evict(self, node: RadixNode) -> None:
        payload, node.payload = node.payload, None
        if payload is None and self._disk is None and self._own_blocks is None:
            return  # nothing to spill, to digest or to free (a simulated engine's blocks)
        try:
            data = None if self._disk is None else self._spill(node, payload)
            dropped(self, node.hash, payload, data)  # a block it computed: digested now
        finally:
            if payload is not None:
                self.free_segment(payload)

    # ------------------------------------------------------------ the disk tier

    def configure_disk(self, directory: str | os.PathLike[str] | None, capacity_bytes: int = 0) -> None:
        """Spill blocks the cache evicts to files under ``directory`` (a subdirectory per
        ``kv_format()`` and swarm hash key), at most ``capacity_bytes`` of them, and load them back on a hit
        (:mod:`peerinfer.engine.disktier`). The blocks already there (a restart) count as
        cached at once. None or 0 bytes: no disk tier. Call it after ``configure_cache``
        (the format names the block size); a later ``configure_cache`` keeps the tier only if
        the format is unchanged."""
        self._check_open()
        cache = self._ensure_cache()
        old = self._disk
        changes = self._changes
        if directory is None or not capacity_bytes:
            new = None
        else:
            fmt = self.kv_format()
            if fmt is None:
                raise ConfigError(f"{type(self).__name__} cannot keep KV blocks on disk")
            hash_key = cache.hasher.key if cache is not None else b""
            new = DiskTier(directory, fmt, capacity_bytes, hash_key=hash_key)
        self._disk = new
        if changes is not None:
            changes.elsewhere = new if new is not None else ()
            in_memory: Container[BlockHash] = cache if cache is not None else ()
            if old is not None:
                for h in old.hashes():
                    if h not in in_memory and (new is None or h not in new):
                        changes._removed(h)
            if new is not None:
                for h in new.hashes():
                    if h not in in_memory and (old is None or h not in old):
                        changes._added(h)

    def save_to_disk(self, budget_s: float | None = None) -> int:
        """Write every block in memory that the disk tier lacks to it, least recently used
        first, keeping them in memory too (a node does this as it stops, so that it restarts
        warm), for at most ``budget_s`` seconds (None: no limit; a stop must not hang on a slow
        disk, and a thread cannot be interrupted from outside). Returns how many blocks were
        written."""
        self._check_open()
        disk, cache = self._disk, self._cache
        if disk is None or cache is None:
            return 0
        return save_blocks(disk, cache, self.encode_block, self._disk_removed, budget_s)

    def disk_figure(self, held: int) -> tuple[int, int] | None:
        """What a node's load says of this disk tier (``Load.disk``), None without one: per
        mille of the ``held`` blocks it announces that are on disk only, and ns to load one
        token's KV from disk at the rate measured on hits so far (read and decode), else the
        default. Safe from any thread (statistics only); the node and the simulator both use it."""
        disk = self.disk_statistics()
        if disk is None:
            return None
        cache = self.statistics().cache
        in_memory = cache.blocks if cache is not None else 0
        share = 0 if held <= 0 else min(1000, max(0, (held - in_memory) * 1000 // held))
        return share, int(self.kv_bytes_per_token / disk.load_bytes_per_s * 1e9)

    def disk_statistics(self) -> DiskTierStatistics | None:
        """The disk tier's counters (None without one); safe from any thread."""
        disk = self._disk
        return None if disk is None else disk.statistics()

    def _spill(self, node: RadixNode, payload: Any) -> bytes | None:
        """Write an evicted block to the disk tier (or touch it there); its bytes if encoded."""
        disk = self._disk
        assert disk is not None
        if node.hash in disk:
            disk.touch(node.hash)
            return None
        if payload is None and self.kv_format() is None:
            return None  # (the memo of own blocks reuses the bytes: kvmemo.dropped)
        try:
            data = self.encode_block(payload)
        except Exception:  # an export that fails loses the block, as eviction always did
            return None
        for h in disk.put(node.hash, node.key, data):
            self._disk_removed(h)
        return data

    def _disk_removed(self, h: BlockHash) -> None:
        cache, changes = self._cache, self._changes
        if changes is not None and (cache is None or h not in cache):
            changes._removed(h)

    def _load_from_disk(self, cache: RadixCache, tokens: Sequence[int]) -> int:
        """Bring the blocks that continue ``tokens``' cached prefix from the disk tier into the
        cache (before a request matches it); how many blocks came from disk."""
        disk = self._disk
        if disk is None or not len(disk):
            return 0
        return load_prefix(
            disk, cache, tokens, self.decode_block, self.free_segment, self._disk_removed
        )

    # ------------------------------------------------------------ requests

    def validate_request(self, tokens: Sequence[int], params: SamplingParams) -> tuple[int, ...]:
        """The prompt as a tuple, or InvalidRequestError for bad tokens or parameters."""
        validate_sampling_params(params)
        if params.logprobs and not self.supports_logprobs:
            raise InvalidRequestError(f"{type(self).__name__} does not report logprobs")
        if params.constraint is not None and self.grammar_tokenizer() is None:
            raise InvalidRequestError(
                f"{type(self).__name__} does not support constrained decoding "
                "(response_format, tool_choice 'required' or a named tool)"
            )
        return validate_prompt(tokens, self.vocab_size, self.max_context_tokens)

    def open_guide(self, params: SamplingParams) -> TokenGuide | None:
        """The per-request sampling helper for ``params`` (None: unconstrained, no logprobs)."""
        if params.constraint is None and not params.logprobs:
            return None
        from peerinfer.engine.constraints import TokenGuide

        state = None
        if params.constraint is not None:
            grammar = self.grammar_tokenizer()
            if grammar is None:
                raise InvalidRequestError(
                    f"{type(self).__name__} does not support constrained decoding"
                )
            state = grammar.matcher(params.constraint)
        return TokenGuide(state, params.logprobs, params.top_logprobs, self.detokenize)

    def generate(
        self,
        tokens: Sequence[int],
        params: SamplingParams | None = None,
        cancel: CancelToken | None = None,
    ) -> Iterator[EngineEvent]:
        """Generate a completion of ``tokens`` as a stream of events (see the module docstring).

        Raises InvalidRequestError (before any event) for a bad request, EngineError if the
        backend fails; either way the engine keeps serving. Closing the iterator early
        abandons the request (its cache changes are reported with the next ``Finished``).
        """
        self._check_open()
        if params is None:
            params = SamplingParams()
        prompt = self.validate_request(tokens, params)
        if cancel is None:
            cancel = NEVER_CANCELLED
        return self._generate(prompt, params, cancel)

    def _generate(
        self, prompt: tuple[int, ...], params: SamplingParams, cancel: CancelToken
    ) -> Iterator[EngineEvent]:
        job = RequestJob(self, prompt, params, cancel)
        try:
            yield job.start()
            while not job.done:
                events = job.before_step()
                if not job.done:
                    events = job.accept(job.step())
                yield from events
        except Exception as exc:
            error = job.fail(exc)
            if error is exc:
                raise
            raise error from exc
        finally:
            job.close()

    def _store(
        self,
        cache: RadixCache,
        decoder: Decoder,
        prompt: tuple[int, ...],
        generated: list[int],
        prefix: CachedPrefix,
    ) -> None:
        """Insert the blocks the decoder holds KV for and the cache lacks."""
        bs = cache.block_size
        kv = min(decoder.kv_tokens, len(prompt) + len(generated))
        n_full = kv // bs
        if n_full * bs <= prefix.tokens:
            return
        seq = prompt + tuple(generated) if generated else prompt
        seq = seq[: n_full * bs]
        # Blocks cached meanwhile (by an interleaved request) need no export.
        have = cache.match(seq, touch=False).tokens // bs
        if have >= n_full:
            cache.insert(seq)  # stamps the path as recently used
            return
        segments = list(decoder.export_segments(have))
        if len(segments) != n_full - have:
            for seg in segments:
                self.free_segment(seg.payload)
            raise EngineError(
                f"{type(self).__name__} exported {len(segments)} segments, expected {n_full - have}"
            )
        self._insert_segments(cache, seq, have, segments)
        remember_stored(self, cache, seq, have)  # a pull of them later is checked for free

    # ------------------------------------------------------------ lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{type(self).__name__} was closed")

    def close(self) -> None:
        """Free the cache and the model; later calls raise ClosedError. Idempotent."""
        if self._closed:
            return
        if self._cache is not None:
            self._cache.clear()
        self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "NEVER_CANCELLED",
    "NO_PREFIX",
    "CacheChanges",
    "CachedPrefix",
    "CancelToken",
    "DecodeRequest",
    "Decoder",
    "Engine",
    "EngineEvent",
    "EngineStatistics",
    "FinishReason",
    "Finished",
    "KVSegment",
    "RequestJob",
    "Started",
    "TextStream",
    "Tokens",
    "validate_prompt",
    "validate_sampling_params",
    "wait_cancelled",
]
