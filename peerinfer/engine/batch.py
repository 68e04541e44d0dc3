"""The batch scheduler: many requests at once on one engine, joining and leaving at any step.

Algorithm
---------
Every request is a :class:`~peerinfer.engine.base.RequestJob` (the same per-request logic as
``Engine.generate()``: prefix match and lock, events, stop sequences, limits, cache store,
error translation). A request is *waiting* (FIFO), then *running*: first *prefilling*, then
*decoding*. One call of :meth:`BatchScheduler.step` is one scheduling iteration:

1. **Leave.** Running requests that are cancelled end now (``Finished('cancelled')``); waiting
   ones that are cancelled end without ever touching the engine.
2. **Admit.** While fewer than ``max_running`` run, the oldest waiting request is admitted if
   its KV fits: it reserves ``(prompt + max_tokens) * engine.kv_bytes_per_token`` bytes of the
   cache's byte budget (:meth:`RadixCache.reserve`, which evicts unpinned LRU blocks for it).
   The reservation is held until the request has stored its blocks and closed, so the cache
   plus the running requests' KV never exceed the budget, not even while one stores. If it
   does not fit, admission stops (FIFO: no request overtakes the head, so a large request
   is not starved) and waits for running requests to end. A request that could not fit even
   alone is refused at ``submit`` with InvalidRequestError; one that cannot fit when nothing
   runs (memory pinned by someone else) fails instead of waiting forever. The head also
   waits while a running request is prefilling blocks of its prompt that the cache lacks:
   when that prefill completes its prompt's blocks are stored at once (not at its end), and
   the head, admitted at the next step, finds them cached instead of computing them a second
   time beside it (the node's core already counts such blocks as cached).
3. **Prefill.** Requests whose decoder reports no ``prefill_remaining`` (backends that do not
   chunk) are ready at once. The others are prefilled **together**: taken by fewest prompt
   tokens left (ties: the oldest), each given all it has left until one step's budget of
   ``prefill_chunk_tokens`` tokens is spent (the first always gets a chunk, cut to the budget),
   and run in one ``engine.prefill_batch`` call (one forward pass where the backend can). When
   some prompts complete within the budget, the budget's rest is not topped up with a chunk
   of a longer prompt that would not complete: their first tokens do not wait for it. That
   chunk runs at the next step, which is always topped up, so the longer prompt loses every
   other step at most. So
   a long prompt never stalls the requests already decoding (it costs each of their steps one
   chunk at most) nor a short prompt that joins after it, and several newcomers' uncached
   suffixes cost one pass instead of one step each. An engine that keeps the base class's
   one-by-one ``prefill_batch`` gets one request's chunk per step, as before batched prefill
   existed: several would cost it the same compute in a longer step, and the simulator's batch
   model (``peerinfer.sim.batch``), which the simulated engine's times must match, plans one
   chunk per step. When the call completes prompts, their
   first tokens are taken at once (through one ``decode_batch`` of those requests, which only
   samples the logits their prefill kept) and the step ends there: the decode below runs at
   the next step, and is never put off twice in a row, so a newcomer's first token does not
   wait for the others' decode step, and a stream of newcomers cannot stall the requests
   already decoding.
4. **Decode.** One ``engine.decode_batch`` over every ready request gives each its next token;
   a request that reaches its end (eos, stop sequence, ``max_tokens``, context, cancelled in
   the meantime) leaves in this same step, and its place is offered at the next one.

**Preemption** (the caller's fair share: peerinfer.core.fairshare). ``preempt(key, n)`` asks a
running request to yield its slot once it has made ``n`` tokens since it last (re)started: at
the start of the first step where it has, it leaves the running set and is *suspended*, with a
``Preempted`` event (a request that ends first just ends). A suspended request keeps its
decoder, so its KV stays in memory, and its reservation, as long as memory allows: when a
request waiting for admission (or one resuming) does not fit, suspended requests *spill*,
oldest first: their blocks so far go into the prefix cache, their decoders close and their
reservations are given back (``keep_preempted_kv=False`` spills at once). ``resume(key)`` puts
it back: it is admitted before any waiting request, its KV reserved again and, if it spilled,
recomputed through a new decoder over its prompt plus the tokens it generated, which the
prefix cache mostly holds (``RequestJob.restart``). Either way it continues the same job: its
stop sequences, text and token count carry on, and a greedy request gives the tokens it would
have given without the pause. A suspended request that is cancelled ends at the next step.

**Failures stay local.** An exception in one request's start, prefill or store ends that request
with the error (translated by the job: backend exceptions become EngineError) and nothing
else. If ``decode_batch`` raises, every decoder of the batch is retried alone
(``decode_batch([d])``) and only the ones that fail again end; if ``prefill_batch`` raises,
every decoder of it is retried alone (``Decoder.prefill``) the same way. Engines that keep the
base class's one-by-one ``decode_batch`` or ``prefill_batch`` are stepped one decoder at a time
directly, so a failure never costs a neighbour a token.

Everything here runs in the engine's worker thread, like every other engine call.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from peerinfer.core.messages import SamplingParams
from peerinfer.engine.base import (
    NEVER_CANCELLED,
    CancelToken,
    Decoder,
    Engine,
    EngineEvent,
    Finished,
    RequestJob,
)
from peerinfer.errors import ConfigError, EngineError, InvalidRequestError, PeerInferError

#: Prefill chunk when neither the caller nor the engine (``prefill_chunk_tokens``) sets one.
DEFAULT_PREFILL_CHUNK_TOKENS = 512

Key = Hashable
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Preempted:
    """The request yielded its running slot as ``preempt`` asked, after ``generated`` tokens
    since it last (re)started; it waits, suspended, for ``resume``."""

    generated: int


StepResult = list[tuple[Key, EngineEvent | Preempted | PeerInferError]]


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    """A snapshot of the scheduler.

    ``running`` (``prefilling`` of them still in prefill) and ``waiting``: requests now.
    ``steps``: ``step()`` calls that had work; ``decode_steps``/``prefill_chunks``: decode
    batches and prefill chunks (one request's share of a ``prefill_batch``) run;
    ``prefill_batches``: ``prefill_batch`` calls (several chunks each when newcomers are
    prefilled together). ``batch_sizes``: (batch size, decode steps of that size),
    ascending; ``mean_batch``: decoders per decode step. ``kv_reserved_bytes``: the running
    and suspended requests' reservations; ``kv_budget_bytes``: the cache's byte budget they
    share with it (None: not accounted). ``admitted``/``finished``/``failed``/``cancelled``: lifetime counts
    (``cancelled`` is part of ``finished``); ``batch_retries``: decode batches that raised and
    were retried one by one; ``prefill_batch_retries``: the same for prefill batches.
    """

    running: int
    prefilling: int
    waiting: int
    max_running: int
    steps: int
    decode_steps: int
    prefill_chunks: int
    batch_sizes: tuple[tuple[int, int], ...]
    mean_batch: float
    kv_reserved_bytes: int
    kv_budget_bytes: int | None
    admitted: int
    finished: int
    failed: int
    cancelled: int
    batch_retries: int
    prefill_batches: int = 0
    prefill_batch_retries: int = 0
    #: requests suspended now (preempted, waiting to resume), and lifetime counts of
    #: preemptions, resumes and spills (a suspended request's KV given up)
    suspended: int = 0
    preempted: int = 0
    resumed: int = 0
    spilled: int = 0


class _Failed(enum.Enum):
    FAILED = 0


_FAILED = _Failed.FAILED


def _decoder(job: RequestJob) -> Decoder:
    assert job.decoder is not None, "a running request has a decoder"
    return job.decoder


def _prefill_remaining(job: RequestJob) -> int:
    return int(job.prefill_remaining)


def _accept(job: RequestJob, token: int | None) -> list[EngineEvent]:
    """The token's events, then the end if the request is now complete: it leaves at once."""
    return [*job.accept(token), *job.before_step()]


class _Running:
    __slots__ = ("job", "ready")

    def __init__(self, job: RequestJob) -> None:
        self.job = job
        self.ready = False  # past prefill: decodes in the next batch


class BatchScheduler:
    """Runs many requests on one engine (see the module docstring). Worker thread only.

    ``max_running`` defaults to ``engine.max_batch_size``; ``prefill_chunk_tokens`` to the
    engine's ``prefill_chunk_tokens`` attribute, else 512.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_running: int | None = None,
        prefill_chunk_tokens: int | None = None,
        keep_preempted_kv: bool = True,
    ) -> None:
        if max_running is None:
            max_running = engine.max_batch_size
        if type(max_running) is not int or max_running < 1:
            raise ConfigError(f"max_running must be an integer >= 1, got {max_running!r}")
        if prefill_chunk_tokens is None:
            prefill_chunk_tokens = getattr(engine, "prefill_chunk_tokens", None)
        if prefill_chunk_tokens is None:
            prefill_chunk_tokens = DEFAULT_PREFILL_CHUNK_TOKENS
        if type(prefill_chunk_tokens) is not int or prefill_chunk_tokens < 1:
            raise ConfigError(
                f"prefill_chunk_tokens must be an integer >= 1, got {prefill_chunk_tokens!r}"
            )
        self.engine = engine
        self.max_running = max_running
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._waiting: deque[tuple[Key, RequestJob]] = deque()
        self._running: dict[Key, _Running] = {}  # admission order: oldest first
        self._keys: dict[Key, RequestJob] = {}
        # The base class's decode_batch steps decoders one by one: do that here, one decoder
        # per call, so that a failing decoder never takes its neighbours' tokens with it.
        self._one_by_one = type(engine).decode_batch is Engine.decode_batch
        self._prefill_one_by_one = type(engine).prefill_batch is Engine.prefill_batch
        self._steps = 0
        self._decode_steps = 0
        #: the last step handed back a first token instead of decoding (see ``step``)
        self._deferred_decode = False
        self._prefill_chunks = 0
        #: the last prefill left a longer prompt's chunk out for those that completed
        self._topped_up_deferred = False
        self._prefill_batches = 0
        self._prefill_batch_retries = 0
        self._batch_sizes: Counter[int] = Counter()
        self._admitted = 0
        self._finished = 0
        self._failed = 0
        self._cancelled = 0
        self._batch_retries = 0
        #: preemption: requests asked to yield (key -> tokens to make first), those
        #: suspended (oldest first), those to resume (admitted first)
        self.keep_preempted_kv = keep_preempted_kv
        self._yield_after: dict[Key, int] = {}
        self._suspended: dict[Key, _Running] = {}
        self._resuming: deque[Key] = deque()
        self._preempted = 0
        self._resumed = 0
        self._spilled = 0

    # ------------------------------------------------------------ requests

    def submit(
        self,
        key: Key,
        tokens: Sequence[int],
        params: SamplingParams | None = None,
        cancel: CancelToken | None = None,
    ) -> None:
        """Queue a request under ``key`` (its events come back from ``step()`` with it).

        Raises InvalidRequestError now, queueing nothing, for a bad prompt or parameters, a key
        already in use, or a request whose KV could not fit the cache's budget even alone.
        """
        if key in self._keys:
            raise InvalidRequestError(f"request {key!r} was already submitted")
        engine = self.engine
        if params is None:
            params = SamplingParams()
        prompt = engine.validate_request(tokens, params)
        job = RequestJob(engine, prompt, params, NEVER_CANCELLED if cancel is None else cancel)
        budget = job.kv_budget()
        if budget is not None and job.kv_bytes > budget:
            raise InvalidRequestError(
                f"the request needs {job.kv_bytes} bytes of KV memory ({len(prompt)} prompt + "
                f"{job.limit} new tokens x {engine.kv_bytes_per_token} bytes), more than the "
                f"cache's whole budget of {budget} bytes; lower max_tokens or shorten the prompt"
            )
        self._keys[key] = job
        self._waiting.append((key, job))

    def cancel(self, key: Key) -> None:
        """Cancel the request (it ends at the next ``step()``); unknown keys are ignored."""
        job = self._keys.get(key)
        if job is not None:
            job.abort()

    def preempt(self, key: Key, after_tokens: int) -> None:
        """Suspend the request once it has made ``after_tokens`` tokens since it last (re)
        started (see the module docstring). The mark holds for a request not admitted yet,
        or suspended with its resume asked for: it counts once the request runs. Unknown
        keys are ignored."""
        if key in self._keys:
            self._yield_after[key] = max(0, after_tokens)

    def resume(self, key: Key) -> None:
        """Give a suspended request its slot back (admitted first at the next step)."""
        if key in self._suspended and key not in self._resuming:
            self._resuming.append(key)

    @property
    def suspended(self) -> int:
        return len(self._suspended)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        """Nothing to do: no request running, waiting or resuming, and no suspended request
        cancelled (it must end)."""
        return not (
            self._running or self._waiting or self._resuming
            or any(e.job.cancelled for e in self._suspended.values())
        )

    # ------------------------------------------------------------ one iteration

    def step(self) -> StepResult:
        """One scheduling iteration (see the module docstring): the events it produced, in
        order, each with its request's key, or the error that ended a request."""
        out: StepResult = []
        if self.idle:
            return out
        self._steps += 1
        self._leave_cancelled(out)
        self._yield_asked(out)
        self._admit(out)
        completed = self._prefill(out)
        if completed and not self._deferred_decode:
            # Requests just finished their prefill: hand their first tokens back now rather
            # than after the others' decode step (which would add a whole step to their time
            # to first token). The decode runs at the next step, and is never put off twice in
            # a row, so a stream of newcomers cannot stall the requests already decoding.
            self._take_tokens(out, [(key, entry.job) for key, entry in completed])
            self._deferred_decode = True
            return out
        self._deferred_decode = False
        self._decode(out)
        return out

    def _leave_cancelled(self, out: StepResult) -> None:
        # Through _attempt: a cancel token is the caller's object, and if it raises, that
        # request fails, not the step.
        for key, entry in list(self._running.items()):
            job = entry.job
            self._emit(out, key, job, self._attempt(out, key, job, job.before_step))
        for key, entry in list(self._suspended.items()):
            job = entry.job
            if self._attempt(out, key, job, lambda job=job: job.cancelled) is True:
                end = job.before_step if job.started else job.cancel_unstarted
                self._emit(out, key, job, self._attempt(out, key, job, end))
        kept: deque[tuple[Key, RequestJob]] = deque()
        for key, job in self._waiting:
            cancelled = self._attempt(out, key, job, lambda job=job: job.cancelled)
            if cancelled is True:
                self._emit(out, key, job, self._attempt(out, key, job, job.cancel_unstarted))
            elif cancelled is False:
                kept.append((key, job))
        self._waiting = kept

    def _yield_asked(self, out: StepResult) -> None:
        """Suspend the running requests asked to yield that have made their tokens."""
        for key, after in list(self._yield_after.items()):
            entry = self._running.get(key)
            if entry is None:  # not admitted yet, or about to resume: it counts once it runs
                if key not in self._keys:
                    del self._yield_after[key]
                continue
            job = entry.job
            if job.done or not entry.ready or job.generated_this_run < after:
                continue
            del self._yield_after[key]
            del self._running[key]
            self._suspended[key] = entry
            self._preempted += 1
            out.append((key, Preempted(job.generated_this_run)))
            if not self.keep_preempted_kv:
                self._spill(out, key, entry)

    def _spill(self, out: StepResult, key: Key, entry: _Running) -> None:
        job = entry.job
        if job.decoder is None:
            return
        self._spilled += 1
        entry.ready = False
        self._attempt(out, key, job, job.spill)
        if job.done:  # the spill failed: it ended with the error
            self._suspended.pop(key, None)

    def _spill_for(self, out: StepResult, keep: Key | None = None) -> bool:
        """Spill the oldest suspended request still holding KV (not ``keep``, nor one about
        to resume); whether there was one."""
        for key, entry in self._suspended.items():
            if key != keep and key not in self._resuming and entry.job.decoder is not None:
                self._spill(out, key, entry)
                return True
        return False

    def _resume_suspended(self, out: StepResult) -> bool:
        """Admit the requests to resume (before any waiting one); False while the next one's
        KV does not fit yet (it waits for running requests to give memory back)."""
        while self._resuming and len(self._running) < self.max_running:
            key = self._resuming[0]
            entry = self._suspended.get(key)
            if entry is None:  # it ended meanwhile
                self._resuming.popleft()
                continue
            job = entry.job
            if not job.started:  # preempted before it was admitted: admitted as usual, first
                self._resuming.popleft()
                del self._suspended[key]
                self._waiting.appendleft((key, job))
                self._resumed += 1
                continue
            if job.decoder is None:
                fits = self._attempt(out, key, job, job.reserve_kv)
                while fits is False and self._spill_for(out, keep=key):
                    fits = self._attempt(out, key, job, job.reserve_kv)
                if fits is _FAILED:
                    self._resuming.popleft()
                    self._suspended.pop(key, None)
                    continue
                if not fits:
                    return False
                if self._attempt(out, key, job, job.restart) is _FAILED:
                    self._resuming.popleft()
                    self._suspended.pop(key, None)
                    continue
            else:
                job.mark_run_start()
            self._resuming.popleft()
            del self._suspended[key]
            self._running[key] = entry
            self._resumed += 1
        return True

    def _admit(self, out: StepResult) -> None:
        if not self._resume_suspended(out):
            return
        while self._waiting and len(self._running) < self.max_running:
            key, job = self._waiting[0]
            if self._prefilling_its_prefix(job):
                return  # admitted once that prefill has stored the blocks (FIFO: none overtakes)
            fits = self._attempt(out, key, job, job.reserve_kv)
            while fits is False and self._spill_for(out):
                fits = self._attempt(out, key, job, job.reserve_kv)
            if fits is _FAILED:
                self._waiting.popleft()
                continue
            if not fits:
                if self._running:
                    return  # wait for running requests to give memory back
                self._waiting.popleft()
                self._end(out, key, job, InvalidRequestError(
                    f"the request needs {job.kv_bytes} bytes of KV memory and no request is "
                    "running, yet the cache cannot free that much (blocks pinned elsewhere)"
                ))
                continue
            self._waiting.popleft()
            self._running[key] = _Running(job)
            self._admitted += 1
            started = self._attempt(out, key, job, job.start)
            if started is not _FAILED:
                self._emit(out, key, job, (started,))

    def _prefilling_its_prefix(self, job: RequestJob) -> bool:
        """Whether a running request is prefilling blocks of ``job``'s prompt that the cache
        lacks. Started now, ``job`` would compute them a second time beside it, and both
        prompts would prefill at half speed; held until that prefill ends (its blocks are then
        stored: ``RequestJob.store_prompt``), it finds them cached. The node's core counts
        them so (blocks of requests queued or running here are as good as cached), and so
        does the simulated engine; before this hold, a llama.cpp node took 39.6 s to the
        first token of a request the core expected in 4.8 s (docs/performance.md)."""
        cache = self.engine.radix_cache
        if cache is None:
            return False
        bs = cache.block_size
        head = job.prompt[: len(job.prompt) - 1]  # what ``start`` matches
        cached_blocks: int | None = None
        for entry in self._running.values():
            if entry.ready:
                continue
            other = entry.job.prompt
            n = min(len(head), len(other))
            if n < bs or head[:bs] != other[:bs]:
                continue
            common = next((i for i in range(n) if head[i] != other[i]), n)
            if cached_blocks is None:
                cached_blocks = cache.match(head, touch=False).tokens // bs
            if common // bs > cached_blocks:
                return True
        return False

    def _prefill(self, out: StepResult) -> list[tuple[Key, _Running]]:
        """Run one prefill batch; the requests whose prompts it completed (their decoders'
        next step only samples the logits they kept)."""
        # Shortest remaining prompt first (ties: the oldest): a short prompt that joins behind
        # long ones gets its first token after one step, not after their whole prefill, so a
        # requester flooding the node with maximal prompts cannot delay another's first token
        # by more than a chunk per step. Long prompts still advance whenever the budget is not
        # spent on shorter ones, and at most ``max_running`` requests prefill at once, so none
        # starves.
        candidates: list[tuple[int, int, Key, _Running]] = []
        for order, (key, entry) in enumerate(list(self._running.items())):
            if entry.ready:
                continue
            job = entry.job
            remaining = self._attempt(out, key, job, _prefill_remaining, job)
            if remaining is _FAILED:
                continue
            if remaining <= 0:
                entry.ready = True  # a backend that does not chunk: step() runs the prompt
                continue
            candidates.append((remaining, order, key, entry))
        candidates.sort(key=lambda c: (c[0], c[1]))
        chosen: list[tuple[Key, _Running, int]] = []
        budget = self.prefill_chunk_tokens
        deferred = False
        for remaining, _, key, entry in candidates:
            if budget <= 0:
                break
            share = min(remaining, budget)
            if chosen and share < remaining and not self._topped_up_deferred:
                # Prompts that complete in this step do not share it with a chunk of a longer
                # one: the step's time is their first tokens' wait (measured on llama.cpp: a
                # 30-token suffix waited 5-20 s for the 480 tokens that topped up its step).
                # The longer prompt's chunk runs at the next step, which tops up whatever
                # completes in it, so a stream of short prompts delays it every other step at
                # most and cannot starve it.
                deferred = True
                break
            chosen.append((key, entry, share))
            budget -= share
            if self._prefill_one_by_one:
                break  # one request's chunk per step: see the module docstring
        self._topped_up_deferred = deferred
        if not chosen:
            return []
        self._prefill_chunks += len(chosen)
        self._prefill_batches += 1
        done: list[bool | _Failed]
        if self._prefill_one_by_one:
            done = [
                self._attempt(out, key, entry.job, entry.job.prefill, share)
                for key, entry, share in chosen
            ]
        else:
            try:
                done = list(self._prefill_batch(
                    [_decoder(entry.job) for _, entry, _ in chosen],
                    [share for _, _, share in chosen],
                ))
            except Exception:
                # Find the failing request(s): each alone; the others carry on.
                self._prefill_batch_retries += 1
                done = [
                    self._attempt(out, key, entry.job, entry.job.prefill, share)
                    for key, entry, share in chosen
                ]
        completed: list[tuple[Key, _Running]] = []
        for (key, entry, _), finished in zip(chosen, done, strict=True):
            if finished is True:
                entry.ready = True
                completed.append((key, entry))
                if any(self._shares_first_block(entry.job, job) for _, job in self._waiting):
                    self._attempt(out, key, entry.job, entry.job.store_prompt)
        return completed

    def _shares_first_block(self, leader: RequestJob, job: RequestJob) -> bool:
        cache = self.engine.radix_cache
        bs = 1 if cache is None else cache.block_size
        return len(job.prompt) > bs and job.prompt[:bs] == leader.prompt[:bs]

    def _prefill_batch(self, decoders: Sequence[Decoder], shares: Sequence[int]) -> list[bool]:
        done = self.engine.prefill_batch(decoders, shares)
        if len(done) != len(decoders):
            raise EngineError(
                f"{type(self.engine).__name__}.prefill_batch returned {len(done)} results "
                f"for {len(decoders)} decoders"
            )
        return [bool(d) for d in done]

    def _decode(self, out: StepResult) -> None:
        batch = [(key, e.job) for key, e in self._running.items() if e.ready]
        if not batch:
            return
        self._decode_steps += 1
        self._batch_sizes[len(batch)] += 1
        self._take_tokens(out, batch)

    def _take_tokens(self, out: StepResult, batch: list[tuple[Key, RequestJob]]) -> None:
        """One token for every request of ``batch`` (one ``decode_batch`` where the engine
        batches), each accepted into its request; a failing batch is retried one by one."""
        tokens: list[int | None | _Failed]
        if self._one_by_one:
            tokens = [self._attempt(out, key, job, job.step) for key, job in batch]
        elif len(batch) == 1:
            key, job = batch[0]
            tokens = [self._attempt(out, key, job, self._decode_alone, job)]
        else:
            try:
                tokens = list(self._decode_batch([_decoder(job) for _, job in batch]))
            except Exception:
                # Find the failing request(s): each alone; the others carry on.
                self._batch_retries += 1
                tokens = [
                    self._attempt(out, key, job, self._decode_alone, job) for key, job in batch
                ]
        for (key, job), token in zip(batch, tokens, strict=True):
            if token is _FAILED:
                continue
            self._emit(out, key, job, self._attempt(out, key, job, _accept, job, token))

    def _decode_alone(self, job: RequestJob) -> int | None:
        return self._decode_batch([_decoder(job)])[0]

    def _decode_batch(self, decoders: Sequence[Decoder]) -> list[int | None]:
        tokens = self.engine.decode_batch(decoders)
        if len(tokens) != len(decoders):
            raise EngineError(
                f"{type(self.engine).__name__}.decode_batch returned {len(tokens)} tokens "
                f"for {len(decoders)} decoders"
            )
        return tokens

    # ------------------------------------------------------------ bookkeeping

    def _attempt(
        self, out: StepResult, key: Key, job: RequestJob, call: Callable[..., _T], *args: Any
    ) -> _T | _Failed:
        """Run one call for ``job``; if it fails, the job ends with the error (and only it)."""
        try:
            return call(*args)
        except Exception as exc:
            self._end(out, key, job, job.fail(exc))
            return _FAILED

    def _emit(
        self, out: StepResult, key: Key, job: RequestJob, events: Sequence[EngineEvent] | _Failed
    ) -> None:
        if events is _FAILED:
            return
        out.extend((key, ev) for ev in events)
        if job.done:
            self._end(out, key, job, None)

    def _end(
        self, out: StepResult, key: Key, job: RequestJob, error: PeerInferError | None
    ) -> None:
        if self._keys.get(key) is not job:
            return  # already ended
        del self._keys[key]
        self._running.pop(key, None)
        self._suspended.pop(key, None)
        self._yield_after.pop(key, None)
        try:
            job.close()
        except Exception as exc:
            # A decoder that fails to close: an error for a request still running; after its
            # Finished it is only counted (the client already has its answer).
            failure = job.fail(exc)
            if error is None and not job.generated and not self._has_finished(out, key):
                error = failure
        if error is not None:
            self._failed += 1
            out.append((key, error))
        else:
            self._finished += 1
            if job.cancelled:
                self._cancelled += 1

    @staticmethod
    def _has_finished(out: StepResult, key: Key) -> bool:
        return any(k == key and isinstance(ev, Finished) for k, ev in out)

    def close(self) -> None:
        """End every request without events (shutdown): decoders closed, pins and KV
        reservations given back."""
        jobs = list(self._keys.values())
        self._keys.clear()
        self._running.clear()
        self._waiting.clear()
        self._suspended.clear()
        self._resuming.clear()
        self._yield_after.clear()
        for job in jobs:
            job.close()

    def statistics(self) -> SchedulerStatistics:
        decoded = sum(size * n for size, n in self._batch_sizes.items())
        budget: int | None = None
        cache = self.engine.radix_cache
        if self.engine.kv_bytes_per_token > 0 and cache is not None:
            budget = cache.capacity_bytes
        return SchedulerStatistics(
            running=len(self._running),
            prefilling=sum(1 for e in self._running.values() if not e.ready),
            waiting=len(self._waiting),
            max_running=self.max_running,
            steps=self._steps,
            decode_steps=self._decode_steps,
            prefill_chunks=self._prefill_chunks,
            batch_sizes=tuple(sorted(self._batch_sizes.items())),
            mean_batch=decoded / self._decode_steps if self._decode_steps else 0.0,
            kv_reserved_bytes=sum(e.job.kv_reserved for e in self._running.values())
            + sum(e.job.kv_reserved for e in self._suspended.values()),
            kv_budget_bytes=budget,
            admitted=self._admitted,
            finished=self._finished,
            failed=self._failed,
            cancelled=self._cancelled,
            batch_retries=self._batch_retries,
            prefill_batches=self._prefill_batches,
            prefill_batch_retries=self._prefill_batch_retries,
            suspended=len(self._suspended),
            preempted=self._preempted,
            resumed=self._resumed,
            spilled=self._spilled,
        )


__all__ = ["DEFAULT_PREFILL_CHUNK_TOKENS", "BatchScheduler", "Preempted", "SchedulerStatistics"]
