"""The engine worker: one task owns the ``BatchScheduler`` and is the only caller into the
engine (one worker thread); it runs what the core starts, preempts and resumes what the core's
fair share says (``PreemptLocal``, ``ResumeLocal``: handed to the scheduler at its next step),
and routes the events to each request.

:class:`EngineWorker` is a component of the node (see ``peerinfer.node``): it takes the node's
:class:`~peerinfer.node.context.NodeContext` and the scheduler ``Node.serve`` built."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import trio

from peerinfer.core.messages import (
    ErrorMessage,
    GenerateDone,
)
from peerinfer.core.node import (
    CacheChanged,
    LocalFinished,
    LocalPreempted,
    LocalStarted,
    PreemptLocal,
    ResumeLocal,
    RunLocal,
)
from peerinfer.engine.base import CacheChanges, Finished, Started, Tokens
from peerinfer.engine.batch import BatchScheduler, Preempted, StepResult
from peerinfer.errors import (
    EngineError,
    InvalidRequestError,
    PeerInferError,
)
from peerinfer.node.context import NodeContext
from peerinfer.node.options import logger
from peerinfer.node.sinks import Sink
from peerinfer.types import RequestId


@dataclass(eq=False, slots=True)
class _LocalRun:
    """A request the core runs here; the engine worker's key for it in the scheduler.
    ``reported``: its tokens already reported to the core as service (``LocalPreempted``)."""

    effect: RunLocal
    sink: Sink
    reported: int = 0


#: What the core asked of a run, for the scheduler's next step: preempt (after n tokens), resume.
_Control = tuple[str, "_LocalRun", int]


class EngineWorker:
    """The engine's one driver while requests run (:meth:`run`, a task of the node)."""

    def __init__(self, ctx: NodeContext) -> None:
        self._ctx = ctx
        #: requests handed over, and running in the scheduler
        self._local_new: list[_LocalRun] = []
        self._local_runs: set[_LocalRun] = set()
        #: the runs by request id, preemptions and resumes for the next step, and preemptions
        #: asked for runs not handed over yet
        self._runs_by_id: dict[RequestId, _LocalRun] = {}
        self._local_control: list[_Control] = []
        self._preempt_asked: dict[RequestId, int] = {}
        self._engine_wake = trio.Event()

    @property
    def in_flight(self) -> int:
        """Requests handed to the worker and not finished: waiting for its next step or in
        the scheduler."""
        return len(self._local_new) + len(self._local_runs)

    async def run_local(self, eff: RunLocal) -> None:
        sink = self._ctx.sinks.get(eff.request_id)
        if sink is None:  # the client left while the request was queued
            self._preempt_asked.pop(eff.request_id, None)
            self._ctx.feed(LocalFinished(eff.request_id, ok=False, error="client gone"))
            return
        if eff.decision is not None:
            logger.info("request %s served here: %s", eff.request_id, eff.decision.reason)
        # The engine worker submits it at its next step; the client's going away sets
        # sink.cancel, which the scheduler sees at every step.
        run = _LocalRun(eff, sink)
        self._local_new.append(run)
        self._runs_by_id[eff.request_id] = run
        after = self._preempt_asked.pop(eff.request_id, None)
        if after is not None:  # asked to yield before it was handed over
            self._local_control.append(("preempt", run, after))
        self._engine_wake.set()

    def control(self, eff: PreemptLocal | ResumeLocal | None) -> None:
        """Hand a preemption or a resume to the engine worker (at its next step); a preempt
        for a run not handed over yet waits for it (``run_local``). ``None``: only wake the
        worker (a cancel: a suspended request must end)."""
        if eff is not None:
            run = self._runs_by_id.get(eff.request_id)
            if isinstance(eff, PreemptLocal):
                if run is None:
                    self._preempt_asked[eff.request_id] = eff.after_tokens
                else:
                    self._local_control.append(("preempt", run, eff.after_tokens))
            elif run is not None:
                self._local_control.append(("resume", run, 0))
        self._engine_wake.set()

    async def run(self, scheduler: BatchScheduler) -> None:
        """The engine's one driver while requests run: submit what ``run_local`` handed over,
        step the scheduler in the worker thread while anything runs, route the events."""
        ctx = self._ctx
        try:
            while True:
                if not self._local_new and not self._local_control and scheduler.idle:
                    self._engine_wake = trio.Event()
                    await self._engine_wake.wait()
                    continue
                new, self._local_new = self._local_new, []
                control, self._local_control = self._local_control, []
                self._local_runs.update(new)
                try:
                    async with ctx.engine_lock:
                        results, changes = await ctx.in_thread(
                            self._engine_step, scheduler, new, control
                        )
                except Exception as exc:  # a bug in the scheduler: fail what runs, keep serving
                    logger.exception("the batch scheduler failed")
                    changes = None
                    engine = ctx.engine
                    assert engine is not None
                    try:
                        async with ctx.engine_lock:
                            await ctx.in_thread(scheduler.close)
                            changes = await ctx.in_thread(engine.take_cache_changes)
                    except Exception:
                        logger.exception("the batch scheduler failed to close")
                    failure = EngineError(f"engine failure: {type(exc).__name__}")
                    results = [(run, failure) for run in list(self._local_runs)]
                # Waiting requests wait as long as this moves (NodeCore.silence).
                ctx.engine_progress_at = trio.current_time()
                for run, item in results:
                    assert isinstance(run, _LocalRun)
                    self._route_local(run, item)
                if changes is not None and (changes.added or changes.removed):
                    # Left over by requests that failed: reported after every Finished of the
                    # step, so the digest still applies the engine's reports in order.
                    ctx.feed(CacheChanged(added=changes.added, removed=changes.removed))
        finally:
            with trio.CancelScope(shield=True):
                async with ctx.engine_lock:
                    await ctx.in_thread(scheduler.close)

    def _engine_step(
        self, scheduler: BatchScheduler, new: list[_LocalRun], control: Sequence[_Control] = ()
    ) -> tuple[StepResult, CacheChanges | None]:
        """Worker thread: submit ``new``, hand over ``control`` (preempt, resume), run one
        scheduling step; the events, and the cache changes left unreported when a request
        failed (None otherwise)."""
        out: StepResult = []
        for run in new:
            try:
                scheduler.submit(run, run.effect.tokens, run.effect.params, run.sink.cancel)
            except PeerInferError as exc:
                out.append((run, exc))
        for what, run, after in control:
            if what == "preempt":
                scheduler.preempt(run, after)
            else:
                scheduler.resume(run)
        out.extend(scheduler.step())
        changes = None
        if any(isinstance(item, PeerInferError) for _, item in out):
            engine = self._ctx.engine
            assert engine is not None
            changes = engine.take_cache_changes()
        return out, changes

    def _route_local(self, run: _LocalRun, item: object) -> None:
        """One scheduler event of a local run: to the core and to the request's sink."""
        ctx = self._ctx
        eff, sink = run.effect, run.sink
        if isinstance(item, Started):
            ctx.feed(LocalStarted(eff.request_id, item.cached_tokens))
        elif isinstance(item, Preempted):
            run.reported += item.generated
            ctx.feed(LocalPreempted(eff.request_id, item.generated))
        elif isinstance(item, Tokens):
            ctx.sinks.relay_tokens(sink, item.token_ids, item.text, item.logprobs)
        elif isinstance(item, Finished):
            self._forget_run(run)
            # Fed here, in the order the engine made them: the digest applies every report in
            # the engine's order.
            ctx.feed(
                LocalFinished(
                    eff.request_id, ok=True, cache_added=item.cache_added,
                    cache_removed=item.cache_removed,
                    generated=max(0, item.completion_tokens - run.reported),
                )
            )
            now = trio.current_time()
            ctx.sinks.finish(
                sink,
                GenerateDone(
                    request_id=sink.request_id,
                    prompt_tokens=sink.prompt_tokens,
                    completion_tokens=len(eff.resume_after) + item.completion_tokens,
                    cached_tokens=item.cached_tokens,
                    served_by=ctx.peer_id,
                    ttft_s=(sink.first_token_at or now) - sink.started,
                    latency_s=now - sink.started,
                    finish_reason=item.finish_reason,
                ),
            )
        else:
            assert isinstance(item, PeerInferError)
            self._forget_run(run)
            code = "invalid" if isinstance(item, InvalidRequestError) else "internal"
            if not isinstance(item, InvalidRequestError | EngineError):
                logger.warning("request %s failed in the engine: %r", eff.request_id, item)
            ctx.feed(LocalFinished(eff.request_id, ok=False, error=str(item)))
            ctx.sinks.finish(sink, ErrorMessage(sink.request_id, code, str(item)))

    def _forget_run(self, run: _LocalRun) -> None:
        self._local_runs.discard(run)
        rid = run.effect.request_id
        if self._runs_by_id.get(rid) is run:
            del self._runs_by_id[rid]
        self._preempt_asked.pop(rid, None)
