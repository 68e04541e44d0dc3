"""One request's life on an engine: :class:`RequestJob`, the per-request logic that
``Engine.generate()`` and the :class:`~peerinfer.engine.batch.BatchScheduler` share (worker
thread only), and the engine's request counters.

A job drives its engine through :class:`JobEngine`, the part of
:class:`~peerinfer.engine.base.Engine` it uses (the engine's cache, counters and backend
hooks). It is a Protocol so that this module does not import ``base``, which runs jobs.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from peerinfer.core.messages import SamplingParams, TokenLogprob
from peerinfer.core.radix import RadixCache, RadixNode
from peerinfer.engine.decoder import NO_PREFIX, CachedPrefix, CancelToken, Decoder, DecodeRequest
from peerinfer.engine.events import (
    CacheChanges,
    EngineEvent,
    Finished,
    FinishReason,
    Started,
    Tokens,
)
from peerinfer.engine.textstream import TextStream
from peerinfer.errors import EngineError, PeerInferError

if TYPE_CHECKING:
    from peerinfer.engine.constraints import TokenGuide


@dataclass(slots=True)
class _Counters:
    """An engine's running totals (``Engine.statistics()`` reads them; jobs count into them)."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class JobEngine(Protocol):
    """What a :class:`RequestJob` uses of its engine; :class:`~peerinfer.engine.base.Engine`
    provides all of it."""

    kv_bytes_per_token: int
    default_block_size: int
    _counters: _Counters | None

    @property
    def max_context_tokens(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def detokenize(self, tokens: Sequence[int]) -> str: ...

    def open_guide(self, params: SamplingParams) -> TokenGuide | None: ...

    def open_decoder(self, request: DecodeRequest) -> Decoder: ...

    def take_cache_changes(self) -> CacheChanges: ...

    def _ensure_cache(self) -> RadixCache | None: ...

    def _load_from_disk(self, cache: RadixCache, tokens: Sequence[int]) -> int: ...

    def _store(
        self,
        cache: RadixCache,
        decoder: Decoder,
        prompt: tuple[int, ...],
        generated: list[int],
        prefix: CachedPrefix,
    ) -> None: ...


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
        "_rng",
        "_run_start",
        "_first_cached",
        "guide",
    )

    def __init__(
        self, engine: JobEngine, prompt: tuple[int, ...], params: SamplingParams, cancel: CancelToken
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
        self._rng: random.Random | None = None
        #: ``len(generated)`` when it last (re)started (preemption counts tokens from there)
        self._run_start = 0
        self._first_cached = 0
        #: the constraint state and logprobs wish (None: neither), made in ``start()``
        self.guide: TokenGuide | None = None

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
        return self._first_cached

    @property
    def generated_this_run(self) -> int:
        """Tokens generated since it last (re)started (``mark_run_start``)."""
        return len(self.generated) - self._run_start

    def mark_run_start(self) -> None:
        """It (re)takes a running slot now: count its tokens from here."""
        self._run_start = len(self.generated)

    @property
    def started(self) -> bool:
        """``start()`` ran (its decoder opened, or given up since: ``spilled``)."""
        return self._text is not None

    @property
    def spilled(self) -> bool:
        """Preempted and its decoder given up (``spill``): ``restart`` recomputes its KV."""
        return self.decoder is None and self._text is not None and not self.done

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
            engine._load_from_disk(cache, prompt[: len(prompt) - 1])
            match = cache.match(prompt[: len(prompt) - 1])
            if match.nodes:
                self._locked = match.last_node
                cache.lock(self._locked)
                self._prefix = CachedPrefix(match.tokens, tuple(match.payloads))
        params = self.params
        rng = self._rng = random.Random(params.seed if params.seed is not None else os.urandom(16))
        self.guide = engine.open_guide(params)
        request = DecodeRequest(prompt, params, self.cancel, rng, self._prefix, bs, self.guide)
        self.decoder = engine.open_decoder(request)
        counters.prompt_tokens += len(prompt)
        counters.cached_tokens += self._prefix.tokens
        self._first_cached = self._prefix.tokens
        self._text = TextStream(engine.detokenize, prompt, params.stop)
        return Started(len(prompt), self._prefix.tokens)

    def spill(self) -> None:
        """A preempted request gives up its KV: its blocks so far (prompt and generated) go
        into the prefix cache, its decoder closes, its prefix lock and KV reservation are given
        back. Its tokens and text state stay; ``restart`` continues it."""
        assert self.decoder is not None and not self.done, "spill() of a request not running"
        cache = self._cache
        decoder, self.decoder = self.decoder, None
        try:
            if cache is not None:
                self.engine._store(cache, decoder, self.prompt, self.generated, self._prefix)
        finally:
            try:
                decoder.close()
            finally:
                locked, self._locked = self._locked, None
                if locked is not None and cache is not None and not locked.evicted:
                    cache.unlock(locked)
                self._prefix = NO_PREFIX
                if self.kv_reserved and cache is not None:
                    cache.release(self.kv_reserved)
                self.kv_reserved = 0

    def restart(self) -> None:
        """Continue a spilled request: a new decoder over the prompt plus the tokens generated
        so far, reusing whatever of them the prefix cache still holds (``reserve_kv`` first)."""
        assert self.spilled, "restart() of a request that was not spilled"
        engine = self.engine
        cache = self._cache
        bs = cache.block_size if cache is not None else engine.default_block_size
        seq = self.prompt + tuple(self.generated)
        if cache is not None:
            engine._load_from_disk(cache, seq[: len(seq) - 1])
            match = cache.match(seq[: len(seq) - 1])
            if match.nodes:
                self._locked = match.last_node
                cache.lock(self._locked)
                self._prefix = CachedPrefix(match.tokens, tuple(match.payloads))
        params = dataclasses.replace(self.params, max_tokens=max(1, self.limit - len(self.generated)))
        assert self._rng is not None
        request = DecodeRequest(seq, params, self.cancel, self._rng, self._prefix, bs,
                                guide=self.guide, continues=len(self.generated))
        self.decoder = engine.open_decoder(request)
        self.mark_run_start()

    def store_prompt(self) -> None:
        """Put the prompt's blocks in the cache now that its prefill is done, not at the end:
        a request with the same prefix, held back while this one prefilled it
        (``BatchScheduler``), then finds them (the end stores only the blocks after them)."""
        if self._cache is not None and self.decoder is not None:
            self.engine._store(self._cache, self.decoder, self.prompt, [], self._prefix)

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
        guide = self.guide
        eos = token in self.engine.eos_token_ids
        logprobs: tuple[TokenLogprob, ...] = ()
        if guide is not None:
            entry = guide.take_logprob(token)
            if entry is not None and not eos:
                logprobs = (entry,)
            guide.advance(token)
        self.generated.append(token)
        counters = self._count()
        counters.completion_tokens += 1
        if eos:  # reported, never spelled out
            return [Tokens((token,), ""), *self._end("stop")]
        events: list[EngineEvent] = [Tokens((token,), self._text.push(token), logprobs)]
        if self._text.stopped:
            events.extend(self._end("stop"))
        return events

    def _end(self, reason: FinishReason) -> list[EngineEvent]:
        assert self._text is not None
        self.done = True
        events: list[EngineEvent] = []
        tail = self._text.finish()
        if tail:
            events.append(Tokens((), tail))
        if self._cache is not None and self.decoder is not None:  # a spilled one stored already
            self.engine._store(self._cache, self.decoder, self.prompt, self.generated, self._prefix)
        changes = self.engine.take_cache_changes()
        events.append(
            Finished(
                reason,
                len(self.prompt),
                len(self.generated),
                self._first_cached,
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


__all__ = ["JobEngine", "RequestJob"]
