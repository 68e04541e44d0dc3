"""A simulated node's engine serving a batch, in virtual time, by the cost model.

Algorithm
---------
The node's engine runs the requests its core started (the core admits at most ``slots``; the
rest wait in the core's queue), the way the batch scheduler (``peerinfer.engine.batch``) runs
them: every scheduling step runs at most one prefill chunk, of the request in prefill with
the fewest prompt tokens left (ties: the oldest), then one decode step that gives every request past its prefill one more token
(``peerinfer.core.costmodel`` gives each its duration). A request's first token is ready when
its last chunk has run; each further token takes one decode step of the batch.

Stepping every token through the event heap would cost an event per step per node, so the
batch advances in *segments* of identical steps, and the simulator holds one event per node,
at the segment's end (``end``):

* **Prefill, nothing decoding**: that request's whole remaining prefill, chunk after chunk:
  one segment.
* **Prefill next to decoders**: one chunk step (``chunk`` prompt tokens plus one decode step
  of the decoders), then the batch is looked at again.
* **Decode only**: ``k`` steps of ``decode_step_s(n)``, ``k`` the fewest tokens any of the
  ``n`` has left, so the segment ends when the first of them finishes.

A request that joins or leaves during a multi-step segment ends it at the end of the step (or
chunk) under way (the scheduler changes the batch, and picks the next chunk, only between
steps); the steps done so far are kept. At
a segment's end the progress is applied, and the requests whose first token came or who
finished are returned, in admission order; then ``plan`` starts the next segment.

With one slot no two requests ever share a step, and a request's times are the single-request
model's: first token ``prefill_s(prompt, cached)`` after it starts, the end ``(tokens - 1) *
decode_step_s(1)`` later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from peerinfer.core.costmodel import CostModel

_IDLE, _PREFILL, _CHUNK, _DECODE = range(4)
#: Step boundaries closer than this (relative to the step) count as reached (float sums).
_EPS = 1e-9


@dataclass(slots=True, eq=False)
class BatchJob:
    """One running request: ``key`` (the caller's), its prompt, what it has left to do."""

    key: Any
    prompt: int
    cached: int
    tokens: int
    uncached: int = -1
    started: bool = False  # its first chunk (overhead, cached tokens) has run
    produced: int = 0
    alive: bool = True
    payload: Any = None

    def __post_init__(self) -> None:
        if self.uncached < 0:
            self.uncached = self.prompt - min(self.cached, self.prompt)

    @property
    def in_prefill(self) -> bool:
        return not self.started or self.uncached > 0


@dataclass(slots=True)
class BatchNode:
    """The batch of one simulated engine (see the module docstring)."""

    costs: CostModel
    jobs: list[BatchJob] = field(default_factory=list)
    kind: int = _IDLE
    start: float = 0.0
    end: float = math.inf
    step: float = 0.0
    steps: int = 0
    #: ids of the jobs decoding in this segment (those that joined meanwhile are not)
    members: set[int] = field(default_factory=set)
    prefilling: BatchJob | None = None
    chunk: int = 0
    #: bumped whenever ``end`` moves: the caller's event for an older epoch is stale
    epoch: int = 0
    #: virtual seconds the engine was running something
    busy_s: float = 0.0
    #: set while the caller handles a segment's end: joins then only queue (``plan`` follows)
    in_boundary: bool = False

    # ------------------------------------------------------------------ changes

    def join(self, job: BatchJob, now: float) -> float | None:
        """Add a running request at ``now``; the new segment end if it moved (else None)."""
        self.jobs.append(job)
        return self._changed(now)

    def leave(self, key: Any, now: float) -> float | None:
        """Drop a request (cancelled) at ``now``; the new segment end if it moved."""
        for i, job in enumerate(self.jobs):
            if job.key == key:
                job.alive = False
                del self.jobs[i]
                return self._changed(now)
        return None

    def _changed(self, now: float) -> float | None:
        if self.in_boundary:
            return None
        if self.kind == _IDLE:
            return self.plan(now)
        if self.kind == _PREFILL:
            return self._cut_prefill(now)
        if self.kind != _DECODE:
            return None  # a prefill step is one step: the batch is looked at when it ends
        done = math.floor((now - self.start) / self.step + _EPS) if self.step > 0 else self.steps
        if self.start + done * self.step < now - _EPS * max(self.step, 1.0):
            done += 1  # a step is under way: it runs to its end
        if done >= self.steps:
            return None
        self.steps = max(done, 0)
        self.end = self.start + self.steps * self.step
        self.epoch += 1
        return self.end if self.end > now else now

    def _cut_prefill(self, now: float) -> float | None:
        """End a back-to-back prefill at the end of its chunk under way (the next chunk may be
        another request's, with fewer tokens left)."""
        p = self.prefilling
        if p is None:
            return None
        costs = self.costs
        size = costs.prefill_chunk_tokens
        rate = costs.prefill_s_per_token
        extra = self.step - self.chunk * rate  # what the first chunk pays besides its tokens
        elapsed = now - self.start - extra
        tol = _EPS * max(self.step, 1.0)
        done = 0
        while done < self.chunk and (done == 0 or done * rate < elapsed - tol):
            done = min(self.chunk, done + size)
        if done >= self.chunk:
            return None
        self.chunk = done
        self.end = self.start + extra + done * rate
        self.step = self.end - self.start
        self.epoch += 1
        return self.end if self.end > now else now

    # ------------------------------------------------------------------ segments

    def finish(self, now: float) -> list[tuple[BatchJob, bool, bool]]:
        """Apply the segment that ends at ``now``: ``(job, first_token, finished)`` for every
        request whose first token came or that finished, in admission order."""
        kind = self.kind
        self.busy_s += self.end - self.start if kind != _IDLE else 0.0
        out: list[tuple[BatchJob, bool, bool]] = []
        if kind == _PREFILL or kind == _CHUNK:
            p = self.prefilling
            for job in self.jobs:
                first = False
                if job is p:
                    job.started = True
                    job.uncached -= self.chunk
                    if job.uncached == 0:
                        job.produced = 1
                        first = True
                elif kind == _CHUNK and job.produced > 0 and self._member(job):
                    job.produced += 1
                else:
                    continue
                if first or job.produced >= job.tokens:
                    out.append((job, first, job.produced >= job.tokens))
        elif kind == _DECODE:
            for job in self.jobs:
                if self._member(job):
                    job.produced += self.steps
                    if job.produced >= job.tokens:
                        out.append((job, False, True))
        ended = {id(job) for job, _, finished in out if finished}
        if ended:
            self.jobs = [j for j in self.jobs if id(j) not in ended]
        self.kind = _IDLE
        self.start = now
        self.end = math.inf
        self.members = set()
        self.prefilling = None
        return out

    def _member(self, job: BatchJob) -> bool:
        return id(job) in self.members

    def plan(self, now: float) -> float | None:
        """Start the next segment at ``now``; its end, or None when nothing runs."""
        self.epoch += 1
        self.start = now
        jobs = self.jobs
        if not jobs:
            self.kind = _IDLE
            self.end = math.inf
            return None
        costs = self.costs
        decoders = [j for j in jobs if j.produced > 0]
        p = None
        for j in jobs:  # the fewest prompt tokens left; ties: the oldest
            if j.in_prefill and (p is None or j.uncached < p.uncached):
                p = j
        if p is not None:
            extra = 0.0 if p.started else costs.overhead_s + p.cached * costs.cached_s_per_token
            self.prefilling = p
            if not decoders:
                # Nothing decodes: its whole prefill runs back to back.
                self.kind = _PREFILL
                self.chunk = p.uncached
                duration = (
                    p.uncached * costs.prefill_s_per_token
                    if p.started
                    else costs.prefill_s(p.prompt, p.cached)
                )
                self.members = set()
            else:
                self.kind = _CHUNK
                self.chunk = min(costs.prefill_chunk_tokens, p.uncached)
                duration = (
                    extra
                    + self.chunk * costs.prefill_busy_rate
                    + costs.decode_step_s(len(decoders))
                )
                self.members = {id(j) for j in decoders}
            self.steps = 1
            self.step = duration
            self.end = now + duration
            return self.end
        self.kind = _DECODE
        self.members = {id(j) for j in decoders}
        self.step = costs.decode_step_s(len(decoders))
        self.steps = min(j.tokens - j.produced for j in decoders)
        self.end = now + self.steps * self.step
        return self.end


__all__ = ["BatchJob", "BatchNode"]
