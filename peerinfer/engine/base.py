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

The node keeps its own digest of the cache on the trio thread, so the engine *reports* changes
instead of letting anyone observe its cache: every ``Finished`` carries the block hashes added and
removed since the previous report (net: a block added and evicted in between is in neither), and
:meth:`Engine.cached_block_hashes` gives a snapshot for start-up. Reports are deltas: apply them
in the order they are made (with interleaved requests, as soon as each ``Finished`` arrives). A
backend without a cache reports ``cached_tokens=0`` and empty changes.
"""

from __future__ import annotations

import math
import operator
import os
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

from peerinfer.core.messages import MAX_PROMPT_TOKENS, ChatMessage, SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.core.radix import CacheStats, RadixCache, RadixNode
from peerinfer.errors import (
    ClosedError,
    ConfigError,
    EngineError,
    InvalidRequestError,
    PeerInferError,
)
from peerinfer.types import BlockHash

FinishReason = Literal["stop", "length", "cancelled"]

#: Limits on sampling parameters (the wire schema's bounds; local callers get the same checks).
MAX_NEW_TOKENS = 65_536
MAX_TEMPERATURE = 100.0
MIN_TOP_P = 1e-6
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_SEED = 2**64 - 1

# --------------------------------------------------------------------------------------------
# Events.


@dataclass(frozen=True, slots=True)
class Started:
    """The request was accepted; ``cached_tokens`` of its ``prompt_tokens`` come from cache."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Tokens:
    """Newly generated token ids and the newly *stable* text.

    Text is released only once it can no longer change: a multi-byte character split across
    tokens is held until complete, and text that could be the start of a stop sequence is held
    until it is not. So ``text`` may be empty, and a final ``Tokens((), text)`` may flush what
    was held. The concatenated texts are the completion (stop sequence excluded); the
    concatenated ids are every generated token, including an end-of-sequence token.
    """

    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True, slots=True)
class Finished:
    """The request ended. ``cache_added``/``cache_removed``: block hashes changed since the last
    report (sorted), for the node's digest."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_added: tuple[BlockHash, ...] = ()
    cache_removed: tuple[BlockHash, ...] = ()


EngineEvent = Started | Tokens | Finished


@dataclass(frozen=True, slots=True)
class CacheChanges:
    """Block hashes that entered and left the engine's cache since the previous report."""

    added: tuple[BlockHash, ...] = ()
    removed: tuple[BlockHash, ...] = ()


# --------------------------------------------------------------------------------------------
# Cancellation.


@runtime_checkable
class CancelToken(Protocol):
    """Anything with ``is_set()``; ``threading.Event`` is the usual one. Set it from any thread."""

    def is_set(self) -> bool: ...


class _NeverCancelled:
    __slots__ = ()

    def is_set(self) -> bool:
        return False

    def wait(self, timeout: float | None = None) -> bool:
        if timeout:
            time.sleep(timeout)
        return False


NEVER_CANCELLED: CancelToken = _NeverCancelled()


def wait_cancelled(cancel: CancelToken, seconds: float) -> bool:
    """Sleep ``seconds`` (real time) or until ``cancel`` is set; True if it was set."""
    if seconds <= 0:
        return cancel.is_set()
    wait = getattr(cancel, "wait", None)
    if callable(wait):
        return bool(wait(seconds)) or cancel.is_set()
    deadline = time.monotonic() + seconds
    while not cancel.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(left, 0.005))
    return True


# --------------------------------------------------------------------------------------------
# What a backend receives and returns.


class KVSegment(NamedTuple):
    """One block's KV state as the backend stores it, and the bytes it is accounted for."""

    payload: Any
    nbytes: int


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """The cached prefix a request reuses: ``tokens`` (a multiple of the block size) and one
    segment payload per block, in order. Empty when nothing was cached."""

    tokens: int = 0
    segments: tuple[Any, ...] = ()


NO_PREFIX = CachedPrefix()


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """Everything a backend needs to serve one validated request.

    ``tokens``: the prompt (non-empty, every id in ``[0, vocab_size)``, shorter than the
    context). ``rng``: seeded from ``params.seed`` when given (repeatable sampling), else from
    the OS. ``prefix``: the cached prefix to reuse (always empty unless the backend supports the
    prefix cache). ``block_size``: the cache's block size.
    """

    tokens: tuple[int, ...]
    params: SamplingParams
    cancel: CancelToken
    rng: random.Random
    prefix: CachedPrefix = NO_PREFIX
    block_size: int = 16

    @property
    def seed(self) -> int:
        """A 63-bit seed for the backend's own generator, drawn from ``rng`` (call once)."""
        return self.rng.getrandbits(63)


class Decoder(ABC):
    """One request's decoding state, for backends that implement the prefix-cache hooks.

    ``step()`` computes the next token (the first call runs the prompt past ``request.prefix``);
    it returns None when the backend itself decides to stop. ``kv_tokens`` is how many leading
    tokens of ``prompt + generated`` the decoder holds KV state for. ``export_segments(b)``
    returns one segment for each full block from block ``b`` up to ``kv_tokens // block_size``,
    as new storage that the cache may keep (it must not alias the decoder's working memory).
    ``close()`` releases the working memory; it is always called, also after errors.
    """

    @abstractmethod
    def step(self) -> int | None: ...

    def prefill(self, max_tokens: int) -> bool:
        """Run up to ``max_tokens`` more prompt tokens (those past ``request.prefix`` not run yet).

        Return True once the whole prompt has run and the first token's logits are ready (the
        next ``step()`` then only samples). The default does nothing and returns True: ``step()``
        runs the whole prompt, so backends that do not chunk their prefill keep working. The
        :class:`~peerinfer.engine.batch.BatchScheduler` calls it (one chunk per scheduling
        step) so that a long prompt never stalls the requests already decoding.
        """
        return True

    @property
    def prefill_remaining(self) -> int:
        """Prompt tokens not run yet (default 0: the backend does not chunk its prefill)."""
        return 0

    @property
    def kv_tokens(self) -> int:
        return 0

    def export_segments(self, first_block: int) -> Sequence[KVSegment]:
        return ()

    def close(self) -> None:
        return None


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


# --------------------------------------------------------------------------------------------
# Validation.


def validate_sampling_params(params: object) -> SamplingParams:
    """Return ``params`` if it is a sane SamplingParams, else raise InvalidRequestError."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            f"sampling parameters must be a SamplingParams, got {type(params).__name__}"
        )
    mt = params.max_tokens
    if type(mt) is not int or not 1 <= mt <= MAX_NEW_TOKENS:
        raise InvalidRequestError(f"max_tokens must be an integer in [1, {MAX_NEW_TOKENS}], got {mt!r}")
    t = params.temperature
    if isinstance(t, bool) or not isinstance(t, int | float) or not (
        math.isfinite(t) and 0.0 <= t <= MAX_TEMPERATURE
    ):
        raise InvalidRequestError(f"temperature must be a number in [0, {MAX_TEMPERATURE}], got {t!r}")
    p = params.top_p
    if isinstance(p, bool) or not isinstance(p, int | float) or not (
        math.isfinite(p) and MIN_TOP_P <= p <= 1.0
    ):
        raise InvalidRequestError(f"top_p must be a number in [{MIN_TOP_P}, 1], got {p!r}")
    s = params.seed
    if s is not None and (type(s) is not int or not 0 <= s <= MAX_SEED):
        raise InvalidRequestError(f"seed must be None or an integer in [0, 2**64), got {s!r}")
    stop = params.stop
    if not isinstance(stop, tuple | list) or len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequestError(f"stop must be a list of at most {MAX_STOP_SEQUENCES} strings")
    for item in stop:
        if type(item) is not str or not 1 <= len(item) <= MAX_STOP_CHARS:
            raise InvalidRequestError(
                f"each stop sequence must be a string of 1 to {MAX_STOP_CHARS} characters, "
                f"got {item!r}"
            )
    return params


def validate_prompt(tokens: object, vocab_size: int, max_context_tokens: int) -> tuple[int, ...]:
    """The prompt as a tuple of ints, or InvalidRequestError saying what is wrong with it."""
    if isinstance(tokens, str | bytes):
        raise InvalidRequestError("the prompt must be a sequence of token ids; tokenize text first")
    if type(tokens) is tuple and tokens and set(map(type, tokens)) == {int}:
        # The common case, checked in C: a tuple of plain ints (bools are not plain ints).
        return _check_prompt_range(tokens, vocab_size, max_context_tokens)
    try:
        raw = list(tokens)  # type: ignore[call-overload]
    except TypeError as exc:
        raise InvalidRequestError(
            f"the prompt must be a sequence of token ids, got {type(tokens).__name__}"
        ) from exc
    if not raw:
        raise InvalidRequestError("the prompt is empty")
    try:
        if any(isinstance(t, bool) for t in raw):
            raise TypeError("booleans are not token ids")
        prompt = tuple(map(operator.index, raw))
    except TypeError as exc:
        raise InvalidRequestError(f"token ids must be integers: {exc}") from exc
    return _check_prompt_range(prompt, vocab_size, max_context_tokens)


def _check_prompt_range(
    prompt: tuple[int, ...], vocab_size: int, max_context_tokens: int
) -> tuple[int, ...]:
    if len(prompt) >= max_context_tokens:
        raise InvalidRequestError(
            f"the prompt has {len(prompt)} tokens; the model's context holds {max_context_tokens}, "
            "and at least one must be left to generate"
        )
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InvalidRequestError(
            f"token id {bad} is outside the model's vocabulary [0, {vocab_size})"
        )
    return prompt


# --------------------------------------------------------------------------------------------
# Incremental detokenization.


class TextStream:
    """Turns generated token ids into text chunks that never change once released.

    Decoding a window of recent tokens (after vLLM/TGI): text is released when the decoded
    window grew and does not end in U+FFFD (the replacement character a partial multi-byte
    character decodes to). The window starts with a few prompt tokens so that tokenizers that
    drop a leading space at the start of a sequence still produce it. Text that could be the
    beginning of a stop sequence is held back; when a stop sequence appears, the text before it
    is released and the stream reports that it stopped.
    """

    CONTEXT_TOKENS = 4

    def __init__(
        self,
        detokenize: Callable[[Sequence[int]], str],
        prompt: Sequence[int] = (),
        stop: Sequence[str] = (),
    ) -> None:
        self._detokenize = detokenize
        self._ids: list[int] = list(prompt[-self.CONTEXT_TOKENS :])
        self._prefix = 0
        self._read = len(self._ids)
        self._stop = tuple(s for s in stop if s)
        self._held = ""
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one token; return the text that became stable (possibly empty)."""
        if self.stopped:
            return ""
        self._ids.append(token)
        ids = self._ids
        before = self._detokenize(ids[self._prefix : self._read])
        after = self._detokenize(ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before) :]
            self._prefix, self._read = self._read, len(ids)
            return self._release(delta)
        return ""

    def finish(self) -> str:
        """The text still held (unstable tail, stop-sequence candidates) at the end."""
        if self.stopped:
            return ""
        ids = self._ids
        before = self._detokenize(ids[self._prefix : self._read])
        after = self._detokenize(ids[self._prefix :])
        tail = after[len(before) :] if len(after) > len(before) else ""
        self._prefix = self._read = len(ids)
        out = self._release(tail)
        if not self.stopped:
            out, self._held = out + self._held, ""
        return out

    def _release(self, delta: str) -> str:
        text = self._held + delta
        if not self._stop:
            self._held = ""
            return text
        cut = -1
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


# --------------------------------------------------------------------------------------------
# The engine.


class _ChangeLog:
    """A cache observer that keeps the net set difference since the last ``take()``."""

    __slots__ = ("added", "removed")

    def __init__(self) -> None:
        self.added: set[BlockHash] = set()
        self.removed: set[BlockHash] = set()

    def block_added(self, h: BlockHash) -> None:
        if h in self.removed:
            self.removed.discard(h)
        else:
            self.added.add(h)

    def block_removed(self, h: BlockHash) -> None:
        if h in self.added:
            self.added.discard(h)
        else:
            self.removed.add(h)

    def take(self) -> CacheChanges:
        out = CacheChanges(tuple(sorted(self.added)), tuple(sorted(self.removed)))
        self.added = set()
        self.removed = set()
        return out


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A snapshot of an engine's counters. ``cache`` is None for an engine without a cache."""

    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cache: CacheStats | None = None


@dataclass(slots=True)
class _Counters:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


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

    _cache: RadixCache | None = None
    _changes: _ChangeLog | None = None
    _counters: _Counters | None = None
    _closed: bool = False

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
        """Run up to ``max_tokens[i]`` more prompt tokens of each ``decoders[i]``, in as few
        forward passes as the backend can; entry ``i`` is True once that decoder's prompt is
        complete (as ``Decoder.prefill``). The default prefills them one by one. If it raises,
        the scheduler retries each decoder alone."""
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
        changes = self._changes if self._changes is not None else _ChangeLog()
        cache = RadixCache(
            hasher,
            capacity_tokens=capacity_tokens,
            capacity_bytes=capacity_bytes,
            on_evict=self._on_evict,
        )
        cache.add_observer(changes)
        self._cache = cache
        self._changes = changes

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
        return tuple(sorted(cache.block_hashes()))

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

    def _ensure_cache(self) -> RadixCache | None:
        if self._cache is None and self.supports_prefix_cache:
            self.configure_cache(PrefixHasher(self.fingerprint, block_size=self.default_block_size))
        return self._cache

    def _on_evict(self, node: RadixNode) -> None:
        payload, node.payload = node.payload, None
        if payload is not None:
            self.free_segment(payload)

    # ------------------------------------------------------------ requests

    def validate_request(self, tokens: Sequence[int], params: SamplingParams) -> tuple[int, ...]:
        """The prompt as a tuple, or InvalidRequestError for bad tokens or parameters."""
        validate_sampling_params(params)
        return validate_prompt(tokens, self.vocab_size, self.max_context_tokens)

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
        payloads: list[Any] = [None] * have + [s.payload for s in segments]
        sizes = [0] * have + [s.nbytes for s in segments]
        result = cache.insert(seq, payloads, sizes)
        for payload in result.unused_payloads:
            if payload is not None:
                self.free_segment(payload)

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


# --------------------------------------------------------------------------------------------
# One request's life on an engine.


class RequestJob:
    """One request's life on an engine: the per-request logic that ``Engine.generate()`` and the
    :class:`~peerinfer.engine.batch.BatchScheduler` share (worker thread only).

    The owner drives it in this order: ``start()`` (match and lock the cached prefix, open the
    decoder: the ``Started`` event), then, while not ``done``, optionally ``prefill(n)`` chunks,
    ``before_step()`` (ends the request when it is cancelled or has all its tokens), a token from
    ``step()`` or the engine's ``decode_batch``, and ``accept(token)`` (eos, stop sequences,
    text; the events it produced). The ending call stores the request's KV blocks in the cache
    and reports the cache changes in ``Finished``. ``fail(exc)`` turns any failure into the
    error the caller raises or reports (a backend's own exception becomes an EngineError, here
    and only here); ``close()`` always runs last, frees the decoder, unlocks the prefix and
    gives back the request's KV reservation.
    """

    __slots__ = (
        "engine",
        "prompt",
        "params",
        "cancel",
        "limit",
        "decoder",
        "done",
        "generated",
        "kv_reserved",
        "_cache",
        "_locked",
        "_prefix",
        "_text",
        "_aborted",
        "_counted",
        "_closed",
    )

    def __init__(
        self, engine: Engine, prompt: tuple[int, ...], params: SamplingParams, cancel: CancelToken
    ) -> None:
        self.engine = engine
        self.prompt = prompt
        self.params = params
        self.cancel = cancel
        #: The most tokens this request may generate (``max_tokens``, or what the context has).
        self.limit = min(params.max_tokens, engine.max_context_tokens - len(prompt))
        self.decoder: Decoder | None = None
        self.done = False
        self.generated: list[int] = []
        #: Bytes of the cache's budget set aside for this request's KV (0: none reserved).
        self.kv_reserved = 0
        self._cache: RadixCache | None = None
        self._locked: RadixNode | None = None
        self._prefix = NO_PREFIX
        self._text: TextStream | None = None
        self._aborted = False
        self._counted = False
        self._closed = False

    # ------------------------------------------------------------ state

    @property
    def cancelled(self) -> bool:
        """The caller's token is set, or ``abort()`` was called."""
        return self._aborted or self.cancel.is_set()

    def abort(self) -> None:
        """Cancel the request from the owner's side (the token may belong to someone else)."""
        self._aborted = True

    @property
    def cached_tokens(self) -> int:
        return self._prefix.tokens

    @property
    def prefill_remaining(self) -> int:
        """Prompt tokens the decoder has not run yet (0 for decoders that do not chunk)."""
        return 0 if self.decoder is None else self.decoder.prefill_remaining

    # ------------------------------------------------------------ KV memory

    @property
    def kv_bytes(self) -> int:
        """The KV bytes this request may come to hold: ``(prompt + limit) * kv_bytes_per_token``
        (0 when the engine does not know its KV size)."""
        return (len(self.prompt) + self.limit) * max(0, self.engine.kv_bytes_per_token)

    def kv_budget(self) -> int | None:
        """The byte budget running requests and the cache share (None: not accounted)."""
        if self.engine.kv_bytes_per_token <= 0:
            return None
        cache = self.engine._ensure_cache()
        return None if cache is None else cache.capacity_bytes

    def reserve_kv(self) -> bool:
        """Reserve ``kv_bytes`` in the cache's budget, evicting unpinned blocks for it; False
        (nothing evicted) while pinned blocks and other reservations leave too little room."""
        if self.kv_reserved or self.kv_budget() is None:
            return True
        cache = self._cache = self.engine._ensure_cache()
        assert cache is not None
        need = self.kv_bytes
        if need and not cache.reserve(need):
            return False
        self.kv_reserved = need
        return True

    # ------------------------------------------------------------ the life of a request

    def _count(self) -> _Counters:
        counters = self.engine._counters
        if counters is None:
            counters = self.engine._counters = _Counters()
        if not self._counted:
            self._counted = True
            counters.requests += 1
        return counters

    def start(self) -> Started:
        """Match and lock the cached prefix and open the decoder."""
        engine = self.engine
        counters = self._count()
        cache = self._cache = engine._ensure_cache()
        bs = cache.block_size if cache is not None else engine.default_block_size
        prompt = self.prompt
        if cache is not None:
            match = cache.match(prompt[: len(prompt) - 1])
            if match.nodes:
                self._locked = match.last_node
                cache.lock(self._locked)
                self._prefix = CachedPrefix(match.tokens, tuple(match.payloads))
        params = self.params
        rng = random.Random(params.seed if params.seed is not None else os.urandom(16))
        request = DecodeRequest(prompt, params, self.cancel, rng, self._prefix, bs)
        self.decoder = engine.open_decoder(request)
        counters.prompt_tokens += len(prompt)
        counters.cached_tokens += self._prefix.tokens
        self._text = TextStream(engine.detokenize, prompt, params.stop)
        return Started(len(prompt), self._prefix.tokens)

    def cancel_unstarted(self) -> list[EngineEvent]:
        """End a request cancelled before it started: no cache lookup, no decoder."""
        self._count()
        self.done = True
        changes = self.engine.take_cache_changes()
        n = len(self.prompt)
        return [Started(n, 0), Finished("cancelled", n, 0, 0, changes.added, changes.removed)]

    def prefill(self, max_tokens: int) -> bool:
        """Run one prefill chunk of at most ``max_tokens``; True once the prompt has run."""
        assert self.decoder is not None, "prefill() before start()"
        return bool(self.decoder.prefill(max_tokens))

    def step(self) -> int | None:
        """The decoder's next token (single-request path; the scheduler batches instead)."""
        assert self.decoder is not None, "step() before start()"
        return self.decoder.step()

    def before_step(self) -> list[EngineEvent]:
        """The events that end the request if it must not take another step (cancelled, or
        all its tokens generated), else no events."""
        if self.done:
            return []
        if self.cancelled:
            return self._end("cancelled")
        if len(self.generated) >= self.limit:
            return self._end("length")
        return []

    def accept(self, token: int | None) -> list[EngineEvent]:
        """Take the token a step produced; the events it makes (the request may end)."""
        if self.done:
            return []
        if self.cancelled:  # cancelled during the step: drop its token
            return self._end("cancelled")
        if token is None:
            return self._end("stop")
        assert self._text is not None
        self.generated.append(token)
        counters = self._count()
        counters.completion_tokens += 1
        if token in self.engine.eos_token_ids:  # reported, never spelled out
            return [Tokens((token,), ""), *self._end("stop")]
        events: list[EngineEvent] = [Tokens((token,), self._text.push(token))]
        if self._text.stopped:
            events.extend(self._end("stop"))
        return events

    def _end(self, reason: FinishReason) -> list[EngineEvent]:
        assert self._text is not None and self.decoder is not None
        self.done = True
        events: list[EngineEvent] = []
        tail = self._text.finish()
        if tail:
            events.append(Tokens((), tail))
        if self._cache is not None:
            self.engine._store(self._cache, self.decoder, self.prompt, self.generated, self._prefix)
        changes = self.engine.take_cache_changes()
        events.append(
            Finished(
                reason,
                len(self.prompt),
                len(self.generated),
                self._prefix.tokens,
                changes.added,
                changes.removed,
            )
        )
        return events

    def fail(self, exc: BaseException) -> PeerInferError:
        """The error that ends the request for ``exc`` (counted once; the request is done).

        Our own errors pass through unchanged; anything else is the backend's failure and
        becomes an EngineError whose ``__cause__`` is ``exc``.
        """
        self.done = True
        self._count().errors += 1
        if isinstance(exc, PeerInferError):
            return exc
        error = EngineError(
            f"{type(self.engine).__name__} failed: {type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
        return error

    def close(self) -> None:
        """Free the decoder, unlock the prefix, release the KV reservation (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.done = True
        cache = self._cache
        try:
            if self.decoder is not None:
                self.decoder.close()
        finally:
            try:
                locked = self._locked
                if locked is not None and cache is not None and not locked.evicted:
                    cache.unlock(locked)
            finally:
                if self.kv_reserved and cache is not None:
                    cache.release(self.kv_reserved)
                self.kv_reserved = 0


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
