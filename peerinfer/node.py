"""A running peerinfer node: the libp2p host, the engine and the sans-IO ``NodeCore``, composed.

Theory of operation
-------------------
Everything the node *decides* lives in ``peerinfer.core.node.NodeCore``. This module only
executes its effects and feeds it events, on one trio thread:

* ``_feed(event)`` runs ``core.handle(event, now)`` and starts the effects it returns (publish
  an announcement, a sync round, a local run, a forward, a rejection, a ping). A timer task
  calls ``core.tick(now)`` no later than ``core.next_deadline()``.
* The engine is synchronous; every call into it runs in a worker thread, one at a time (a
  ``trio.Lock``), so the event loop never blocks on compute. One *engine worker* task owns a
  :class:`~peerinfer.engine.batch.BatchScheduler` and is the only caller into the engine while
  requests run: ``_run_local`` hands it the requests the core started, and it calls
  ``scheduler.step()`` (one prefill chunk and one batched decode step) in the thread while any
  run, routing each event to its request's sink and reporting cache changes to the core in
  the engine's order. The core admits up to the engine's ``max_batch_size`` at once.
* Each request, whoever serves it, has a *sink*: a memory channel whose receiver is the stream
  handler that answers the client (or the forwarding peer). Local runs and forwards write
  ``TokenChunk`` frames into it and end it with ``GenerateDone`` or ``ErrorMessage``.

Protocols (all frames are ``peerinfer.core.messages``, varint length-prefixed):

=========================================  ===============================================
``/peerinfer/generate/1.0.0``              GenerateRequest -> TokenChunk* -> GenerateDone
                                           or ErrorMessage (clients, and peers forwarding)
``/peerinfer/sync/1.0.0``                  SyncRequest -> SyncResponse (one round)
``/peerinfer/status/1.0.0``                StatusRequest -> StatusResponse
``/peerinfer/peers/1.0.0``                 PeerExchange -> PeerExchange (who we know)
gossip ``peerinfer/1/<model>/announce``    Announce (digest root, epoch, load, delta)
=========================================  ===============================================
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from peerinfer.core.costmodel import DEFAULT_COSTS, CostModel
from peerinfer.core.messages import (
    MAX_PROMPT_TOKENS,
    Announce,
    CacheStatus,
    ErrorMessage,
    GenerateDone,
    GenerateRequest,
    Message,
    PeerAddrs,
    PeerExchange,
    PeerStatus,
    RequestCounters,
    StatusRequest,
    StatusResponse,
    SyncRequest,
    SyncResponse,
    TokenChunk,
    decode,
    encode,
)
from peerinfer.core.node import (
    AnnounceReceived,
    CacheChanged,
    Cancel,
    CancelForward,
    CancelLocal,
    ClientRequest,
    DropPeer,
    Effect,
    Event,
    Forward,
    ForwardFailed,
    ForwardFinished,
    ForwardFirstToken,
    LocalFinished,
    LocalStarted,
    NodeConfig,
    NodeCore,
    PeerLost,
    PeerSeen,
    PingPeer,
    Publish,
    Reject,
    RunLocal,
    SendSyncRequest,
    SyncFailed,
    SyncResponseReceived,
)
from peerinfer.core.prefix import PrefixHasher, derive_swarm_key
from peerinfer.engine.base import Engine, Finished, Started, Tokens
from peerinfer.engine.batch import BatchScheduler, StepResult
from peerinfer.errors import (
    EngineError,
    InvalidRequestError,
    PeerInferError,
    ProtocolError,
    RemoteError,
    RequestTimeoutError,
)
from peerinfer.net import FramedStream, GossipMessage, Host, HostConfig, PeerEvent, open_host
from peerinfer.net.config import DEFAULT_PORT
from peerinfer.types import PeerId, RequestId

logger = logging.getLogger("peerinfer.node")

GENERATE_PROTOCOL = "/peerinfer/generate/1.0.0"
SYNC_PROTOCOL = "/peerinfer/sync/1.0.0"
STATUS_PROTOCOL = "/peerinfer/status/1.0.0"
PEERS_PROTOCOL = "/peerinfer/peers/1.0.0"
PROTOCOL_GENERATION = 1

#: How long a node waits for in-flight requests to finish on shutdown before failing them.
SHUTDOWN_GRACE_S = 30.0
#: Peers we tell a newcomer about, at most.
MAX_EXCHANGED_PEERS = 64
#: How often we ask a random connected peer whom it knows (peer exchange).
PEER_EXCHANGE_INTERVAL_S = 10.0
#: The client handler's wait for the next token of a request served here or relayed.
TOKEN_GAP_TIMEOUT_S = 120.0


def announce_topic(fingerprint: bytes, swarm_secret: bytes | None = None) -> str:
    """The gossip topic of one model (and, for a private swarm, one swarm key)."""
    tag = fingerprint.hex()[:16]
    if swarm_secret is not None:
        tag += "-" + hashlib.blake2b(swarm_secret, digest_size=6).hexdigest()
    return f"peerinfer/{PROTOCOL_GENERATION}/{tag}/announce"


@dataclass(frozen=True, slots=True)
class NodeOptions:
    """How to run a node (the ``peerinfer node`` flags)."""

    engine: str = "hf"
    model: str | None = None
    device: str | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)
    listen: tuple[str, ...] = (f"/ip4/0.0.0.0/tcp/{DEFAULT_PORT}",)
    bootstrap: tuple[str, ...] = ()
    mdns: bool = True
    identity: Path | None = None
    persist_identity: bool = True
    cache_bytes: int | None = None
    cache_tokens: int | None = None
    policy: str = "cost"
    swarm_key: bytes | None = None
    costs: CostModel = DEFAULT_COSTS
    announce_interval_s: float = 1.0
    first_token_timeout_s: float = 30.0
    peer_timeout_s: float = 6.0
    max_queue: int = 8
    seed: int | None = None
    expected_peers: int = 64


@dataclass(slots=True)
class _Sink:
    """Where a request's frames go: the stream handler that owns the request reads them."""

    send: trio.MemorySendChannel[Message]
    request_id: str  # the id the client used (frames carry it)
    started: float
    prompt_tokens: int
    first_token_at: float | None = None
    completion_ids: list[int] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)
    forward_scope: trio.CancelScope | None = None
    done: bool = False


@dataclass(eq=False, slots=True)
class _LocalRun:
    """A request the core runs here; the engine worker's key for it in the scheduler."""

    effect: RunLocal
    sink: _Sink


def _load_engine(options: NodeOptions) -> Engine:
    from peerinfer.engine.registry import load_engine

    kwargs = dict(options.engine_options)
    if options.model is not None:
        kwargs.setdefault("model", options.model)
    if options.device is not None:
        kwargs.setdefault("device", options.device)
    return load_engine(options.engine, **kwargs)


class Node:
    """One peerinfer node. ``await node.serve(task_status=...)`` runs it until cancelled.

    ``engine`` may be given ready-made (tests, embedding); otherwise it is loaded from
    ``options`` in a worker thread at start.
    """

    def __init__(self, options: NodeOptions, engine: Engine | None = None) -> None:
        self.options = options
        self.engine = engine
        self.host: Host | None = None
        self.core: NodeCore | None = None
        self._engine_lock = trio.Lock()
        #: Requests for the engine worker: handed over, and running in its scheduler.
        self._local_new: list[_LocalRun] = []
        self._local_runs: set[_LocalRun] = set()
        self._engine_wake = trio.Event()
        self._sinks: dict[RequestId, _Sink] = {}
        self._nursery: trio.Nursery | None = None
        self._wake = trio.Event()
        self._closing = False
        self._open_handlers = 0
        #: peers (nodes, not clients) we have swapped peer lists with at least once
        self._exchanged: set[str] = set()
        self._topic = ""
        self._started_at = time.time()
        self.ready = trio.Event()

    # ------------------------------------------------------------------ lifecycle

    @property
    def peer_id(self) -> str:
        assert self.host is not None, "the node is not running"
        return self.host.peer_id

    def addresses(self) -> list[str]:
        assert self.host is not None, "the node is not running"
        return self.host.dialable_addrs()

    async def serve(self, *, task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        opts = self.options
        if self.engine is None:
            self.engine = await trio.to_thread.run_sync(_load_engine, opts)
        engine = self.engine
        secret = opts.swarm_key
        hasher = PrefixHasher(engine.fingerprint, derive_swarm_key(engine.fingerprint, secret))
        await self._in_engine(
            engine.configure_cache,
            hasher,
            capacity_bytes=opts.cache_bytes,
            capacity_tokens=opts.cache_tokens,
        )
        scheduler = BatchScheduler(engine)
        # The core admits as many requests as the engine runs at once, unless the cost model
        # names its own number of slots (the default model's is 1: "not set").
        costs = opts.costs
        if costs.slots == 1 and engine.max_batch_size > 1:
            costs = costs.with_slots(engine.max_batch_size)
        self._topic = announce_topic(engine.fingerprint, secret)
        host_config = HostConfig(
            listen=opts.listen,
            identity_path=opts.identity,
            persist_identity=opts.persist_identity,
            bootstrap=opts.bootstrap,
            mdns=opts.mdns,
            gossip_topics=(self._topic,),
            expected_peers=opts.expected_peers,
            announce_interval_s=opts.announce_interval_s,
            liveness_interval_s=max(2.0, opts.peer_timeout_s / 2),
        )
        async with open_host(host_config) as host:
            self.host = host
            # Epochs must grow across restarts: start them from the wall clock (microseconds).
            epoch_base = int(time.time() * 1_000_000)
            self.core = NodeCore(
                NodeConfig(
                    peer_id=PeerId(host.peer_id),
                    policy=opts.policy,
                    costs=costs,
                    announce_interval_s=opts.announce_interval_s,
                    first_token_timeout_s=opts.first_token_timeout_s,
                    peer_timeout_s=opts.peer_timeout_s,
                    ping_after_s=max(0.5, opts.peer_timeout_s / 3),
                    max_queue=opts.max_queue,
                ),
                hasher,
                rng=random.Random(opts.seed),
                epoch_base=epoch_base,
                now=self._now(),
            )
            snapshot = await self._in_engine(engine.cached_block_hashes)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                host.set_handler(GENERATE_PROTOCOL, self._serve_generate)
                host.set_handler(SYNC_PROTOCOL, self._serve_sync)
                host.set_handler(STATUS_PROTOCOL, self._serve_status)
                host.set_handler(PEERS_PROTOCOL, self._serve_peers)
                messages = await host.subscribe(self._topic, self._validate_announce)
                nursery.start_soon(self._gossip_loop, messages)
                nursery.start_soon(self._peer_event_loop, host.peer_events())
                nursery.start_soon(self._timer_loop)
                nursery.start_soon(self._peer_exchange_loop)
                nursery.start_soon(self._engine_worker, scheduler)
                if snapshot:
                    self._feed(CacheChanged(added=snapshot))
                self.ready.set()
                task_status.started(self)
                try:
                    await trio.sleep_forever()
                finally:
                    # Whatever shutdown() did not let finish is answered with an error, never
                    # dropped silently.
                    self._drain_now()
                    nursery.cancel_scope.cancel()

    async def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Stop taking requests and wait up to ``grace_s`` for in-flight ones to finish; the
        caller then cancels ``serve``, which fails whatever is left with a 'shutdown' error."""
        self._closing = True
        with trio.move_on_after(grace_s):
            while self._sinks:
                await trio.sleep(0.05)
        self._drain_now()
        # Let the stream handlers write those errors before the host goes away.
        with trio.move_on_after(1.0):
            while self._open_handlers:
                await trio.sleep(0.02)

    def _drain_now(self) -> None:
        self._closing = True
        for sink in list(self._sinks.values()):
            sink.cancel.set()
            if sink.forward_scope is not None:
                sink.forward_scope.cancel()
            self._finish_sink(
                sink, ErrorMessage(sink.request_id, "shutdown", "the node is shutting down")
            )

    # ------------------------------------------------------------------ core plumbing

    @staticmethod
    def _now() -> float:
        # Wall clock: announcements carry it, and peers compare it within a freshness window.
        return time.time()

    def _feed(self, event: Event) -> None:
        core = self.core
        if core is None:
            return
        try:
            effects = core.handle(event, self._now())
        except Exception:  # a bug in the core must not take the node down
            logger.exception("node core failed on %s", type(event).__name__)
            return
        self._execute(effects)
        self._wake.set()

    def _execute(self, effects: Sequence[Effect]) -> None:
        nursery = self._nursery
        if nursery is None:
            return
        for eff in effects:
            if isinstance(eff, Publish):
                nursery.start_soon(self._publish, eff.announce)
            elif isinstance(eff, SendSyncRequest):
                nursery.start_soon(self._sync_round, eff)
            elif isinstance(eff, RunLocal):
                nursery.start_soon(self._run_local, eff)
            elif isinstance(eff, Forward):
                nursery.start_soon(self._forward, eff)
            elif isinstance(eff, Reject):
                sink = self._sinks.get(eff.request_id)
                if sink is not None:
                    self._finish_sink(sink, ErrorMessage(sink.request_id, eff.code, eff.message))
            elif isinstance(eff, CancelLocal):
                sink = self._sinks.get(eff.request_id)
                if sink is not None:
                    sink.cancel.set()
            elif isinstance(eff, CancelForward):
                sink = self._sinks.get(eff.request_id)
                if sink is not None and sink.forward_scope is not None:
                    sink.forward_scope.cancel()
            elif isinstance(eff, PingPeer):
                nursery.start_soon(self._ping, eff.peer)
            elif isinstance(eff, DropPeer):
                logger.info("peer %s left the candidate set", eff.peer)

    async def _timer_loop(self) -> None:
        while True:
            core = self.core
            assert core is not None
            deadline = core.next_deadline()
            delay = min(1.0, max(0.005, deadline - self._now()))
            self._wake = trio.Event()
            with trio.move_on_after(delay):
                await self._wake.wait()
            if self._now() >= core.next_deadline():
                try:
                    effects = core.tick(self._now())
                except Exception:
                    logger.exception("node core failed on tick")
                    continue
                self._execute(effects)

    async def _in_engine(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one engine call in the worker thread (engines are not thread-safe)."""
        async with self._engine_lock:
            return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))

    # ------------------------------------------------------------------ requests: the door

    async def _serve_generate(self, stream: FramedStream) -> None:
        """A client (or a peer forwarding) asks for a completion; stream it back."""
        try:
            frame = await stream.receive()
            req = decode(frame, expected=GenerateRequest)
            assert isinstance(req, GenerateRequest)
        except ProtocolError as exc:
            with contextlib.suppress(PeerInferError, trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.send(encode(ErrorMessage("", "protocol", str(exc))))
            return
        except trio.EndOfChannel:
            return
        if self._closing:
            await stream.send(encode(ErrorMessage(req.request_id, "shutdown", "the node is shutting down")))
            return
        try:
            tokens = await self._prompt_tokens(req)
        except InvalidRequestError as exc:
            await stream.send(encode(ErrorMessage(req.request_id, "invalid", str(exc))))
            return
        rid = RequestId(f"{stream.remote_peer}/{req.request_id}")
        if rid in self._sinks:
            await stream.send(encode(ErrorMessage(req.request_id, "invalid", "duplicate request id")))
            return
        send, receive = trio.open_memory_channel[Message](math.inf)
        sink = _Sink(send, req.request_id, trio.current_time(), len(tokens))
        self._sinks[rid] = sink
        self._open_handlers += 1
        self._feed(
            ClientRequest(
                request_id=rid,
                tokens=tuple(tokens),
                params=req.params,
                forwarded=req.forwarded,
                origin=PeerId(stream.remote_peer) if req.forwarded else None,
                max_outstanding=req.max_outstanding if req.forwarded else None,
            )
        )
        try:
            async with receive:
                while True:
                    with trio.fail_after(TOKEN_GAP_TIMEOUT_S):
                        item = await receive.receive()
                    await stream.send(encode(item))
                    if isinstance(item, GenerateDone | ErrorMessage):
                        break
        except (PeerInferError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, trio.EndOfChannel) as exc:
            logger.info("request %s: client stream ended early (%s)", rid, type(exc).__name__)
        finally:
            self._open_handlers -= 1
            if rid in self._sinks and not sink.done:
                # The client went away: stop the work, wherever it runs.
                self._feed(Cancel(rid))
                sink.cancel.set()
                if sink.forward_scope is not None:
                    sink.forward_scope.cancel()
                self._sinks.pop(rid, None)

    async def _prompt_tokens(self, req: GenerateRequest) -> list[int]:
        engine = self.engine
        assert engine is not None
        # Routing needs the tokens: with a thread-safe tokenizer they are computed beside the
        # running generation instead of queueing behind its current (possibly long) step.
        run = trio.to_thread.run_sync if engine.thread_safe_tokenizer else self._in_engine
        if req.forwarded or req.tokens:
            tokens = list(req.tokens)
        elif req.messages:
            tokens = await run(engine.chat_tokens, list(req.messages))
        elif req.prompt:
            tokens = await run(engine.tokenize, req.prompt)
        else:
            raise InvalidRequestError("the request has no prompt, messages or tokens")
        if not tokens:
            raise InvalidRequestError("the prompt is empty")
        if len(tokens) >= min(engine.max_context_tokens, MAX_PROMPT_TOKENS):
            raise InvalidRequestError(
                f"the prompt has {len(tokens)} tokens; the model's context holds "
                f"{engine.max_context_tokens} and at least one must be left to generate"
            )
        vocab = engine.vocab_size
        if any(t < 0 or t >= vocab for t in tokens):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})")
        return tokens

    def _finish_sink(self, sink: _Sink, final: Message) -> None:
        if sink.done:
            return
        sink.done = True
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            sink.send.send_nowait(final)
        for rid, s in list(self._sinks.items()):
            if s is sink:
                del self._sinks[rid]

    def _relay_tokens(self, sink: _Sink, ids: Sequence[int], text: str) -> None:
        if sink.done:
            return
        if sink.first_token_at is None and (ids or text):
            sink.first_token_at = trio.current_time()
        sink.completion_ids.extend(ids)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            sink.send.send_nowait(TokenChunk(sink.request_id, tuple(ids), text))

    # ------------------------------------------------------------------ requests: served here

    async def _run_local(self, eff: RunLocal) -> None:
        sink = self._sinks.get(eff.request_id)
        if sink is None:  # the client left while the request was queued
            self._feed(LocalFinished(eff.request_id, ok=False, error="client gone"))
            return
        if eff.decision is not None:
            logger.info("request %s served here: %s", eff.request_id, eff.decision.reason)
        # The engine worker submits it at its next step; the client's going away sets
        # sink.cancel, which the scheduler sees at every step.
        self._local_new.append(_LocalRun(eff, sink))
        self._engine_wake.set()

    async def _engine_worker(self, scheduler: BatchScheduler) -> None:
        """The engine's one driver while requests run: submit what ``_run_local`` handed over,
        step the scheduler in the worker thread while anything runs, route the events."""
        try:
            while True:
                if not self._local_new and scheduler.idle:
                    self._engine_wake = trio.Event()
                    await self._engine_wake.wait()
                    continue
                new, self._local_new = self._local_new, []
                self._local_runs.update(new)
                try:
                    async with self._engine_lock:
                        results, changes = await trio.to_thread.run_sync(
                            self._engine_step, scheduler, new
                        )
                except Exception as exc:  # a bug in the scheduler: fail what runs, keep serving
                    logger.exception("the batch scheduler failed")
                    changes = None
                    try:
                        async with self._engine_lock:
                            await trio.to_thread.run_sync(scheduler.close)
                            changes = await trio.to_thread.run_sync(self.engine.take_cache_changes)  # type: ignore[union-attr]
                    except Exception:
                        logger.exception("the batch scheduler failed to close")
                    failure = EngineError(f"engine failure: {type(exc).__name__}")
                    results = [(run, failure) for run in list(self._local_runs)]
                for run, item in results:
                    assert isinstance(run, _LocalRun)
                    self._route_local(run, item)
                if changes is not None and (changes.added or changes.removed):
                    # Left over by requests that failed: reported after every Finished of the
                    # step, so the digest still applies the engine's reports in order.
                    self._feed(CacheChanged(added=changes.added, removed=changes.removed))
        finally:
            with trio.CancelScope(shield=True):
                async with self._engine_lock:
                    await trio.to_thread.run_sync(scheduler.close)

    def _engine_step(self, scheduler: BatchScheduler, new: list[_LocalRun]) -> tuple[StepResult, Any]:
        """Worker thread: submit ``new``, run one scheduling step; the events, and the cache
        changes left unreported when a request failed (None otherwise)."""
        out: StepResult = []
        for run in new:
            try:
                scheduler.submit(run, run.effect.tokens, run.effect.params, run.sink.cancel)
            except PeerInferError as exc:
                out.append((run, exc))
        out.extend(scheduler.step())
        changes = None
        if any(isinstance(item, PeerInferError) for _, item in out):
            assert self.engine is not None
            changes = self.engine.take_cache_changes()
        return out, changes

    def _route_local(self, run: _LocalRun, item: object) -> None:
        """One scheduler event of a local run: to the core and to the request's sink."""
        eff, sink = run.effect, run.sink
        if isinstance(item, Started):
            self._feed(LocalStarted(eff.request_id, item.cached_tokens))
        elif isinstance(item, Tokens):
            self._relay_tokens(sink, item.token_ids, item.text)
        elif isinstance(item, Finished):
            self._local_runs.discard(run)
            # Fed here, in the order the engine made them: the digest applies every report in
            # the engine's order.
            self._feed(
                LocalFinished(
                    eff.request_id, ok=True, cache_added=item.cache_added,
                    cache_removed=item.cache_removed,
                )
            )
            now = trio.current_time()
            self._finish_sink(
                sink,
                GenerateDone(
                    request_id=sink.request_id,
                    prompt_tokens=sink.prompt_tokens,
                    completion_tokens=len(eff.resume_after) + item.completion_tokens,
                    cached_tokens=item.cached_tokens,
                    served_by=self.peer_id,
                    ttft_s=(sink.first_token_at or now) - sink.started,
                    latency_s=now - sink.started,
                    finish_reason=item.finish_reason,
                ),
            )
        else:
            assert isinstance(item, PeerInferError)
            self._local_runs.discard(run)
            code = "invalid" if isinstance(item, InvalidRequestError) else "internal"
            if not isinstance(item, InvalidRequestError | EngineError):
                logger.warning("request %s failed in the engine: %r", eff.request_id, item)
            self._feed(LocalFinished(eff.request_id, ok=False, error=str(item)))
            self._finish_sink(sink, ErrorMessage(sink.request_id, code, str(item)))

    # ------------------------------------------------------------------ requests: forwarded

    async def _forward(self, eff: Forward) -> None:
        sink = self._sinks.get(eff.request_id)
        host = self.host
        assert host is not None
        if sink is None:
            return
        logger.info("request %s -> %s: %s", eff.request_id, eff.peer, eff.decision.reason)
        generated: list[int] = []
        outcome: Event | None = None
        done: GenerateDone | None = None
        with trio.CancelScope() as scope:
            sink.forward_scope = scope
            try:
                outcome, done = await self._forward_attempt(host, eff, sink, generated)
            except ProtocolError as exc:
                outcome = ForwardFailed(eff.request_id, eff.peer, "protocol", tuple(generated))
                logger.info("forward to %s: %s", eff.peer, exc)
            except RequestTimeoutError:
                outcome = ForwardFailed(eff.request_id, eff.peer, "timeout", tuple(generated))
            except (RemoteError, trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel) as exc:
                outcome = ForwardFailed(eff.request_id, eff.peer, "unavailable", tuple(generated))
                logger.info("forward to %s failed: %s", eff.peer, exc)
        if sink.forward_scope is scope:
            sink.forward_scope = None
        if scope.cancelled_caught:
            return  # the core cancelled it (deadline, peer lost, client gone): it knows
        if done is not None:
            now = trio.current_time()
            self._finish_sink(
                sink,
                GenerateDone(
                    request_id=sink.request_id,
                    prompt_tokens=sink.prompt_tokens,
                    completion_tokens=done.completion_tokens,
                    cached_tokens=done.cached_tokens,
                    served_by=done.served_by,
                    ttft_s=(sink.first_token_at or now) - sink.started,
                    latency_s=now - sink.started,
                    finish_reason=done.finish_reason,
                ),
            )
        if outcome is not None:
            self._feed(outcome)

    async def _forward_attempt(
        self, host: Host, eff: Forward, sink: _Sink, generated: list[int]
    ) -> tuple[Event, GenerateDone | None]:
        deadline = trio.current_time() + eff.first_token_timeout_s
        stream = await host.open_stream(eff.peer, GENERATE_PROTOCOL, timeout=eff.first_token_timeout_s)
        async with stream:
            await stream.send(
                encode(
                    GenerateRequest(
                        request_id=eff.request_id.rsplit("/", 1)[-1][:64] + f"~{eff.attempt}",
                        params=eff.params,
                        tokens=eff.tokens,
                        forwarded=True,
                        origin=self.peer_id,
                        max_outstanding=eff.decision.max_outstanding,
                    )
                ),
                timeout=max(0.01, deadline - trio.current_time()),
            )
            first = True
            while True:
                timeout = max(0.01, deadline - trio.current_time()) if first else TOKEN_GAP_TIMEOUT_S
                frame = await stream.receive(timeout=timeout)
                msg = decode(frame, expected=(TokenChunk, GenerateDone, ErrorMessage))
                if isinstance(msg, TokenChunk):
                    generated.extend(msg.token_ids)
                    self._relay_tokens(sink, msg.token_ids, msg.text)
                    if first:
                        first = False
                        self._feed(ForwardFirstToken(eff.request_id, eff.peer))
                elif isinstance(msg, GenerateDone):
                    return ForwardFinished(eff.request_id, eff.peer), msg
                else:
                    assert isinstance(msg, ErrorMessage)
                    reason = msg.code if msg.code in ("busy", "invalid", "timeout") else "unavailable"
                    if msg.code == "invalid":
                        # The peer found the request itself bad: it would be bad anywhere.
                        self._finish_sink(sink, ErrorMessage(sink.request_id, "invalid", msg.message))
                        return ForwardFinished(eff.request_id, eff.peer), None
                    return ForwardFailed(eff.request_id, eff.peer, reason, tuple(generated)), None

    # ------------------------------------------------------------------ anti-entropy

    async def _publish(self, announce: Announce) -> None:
        host = self.host
        assert host is not None
        try:
            await host.publish(self._topic, encode(announce))
        except PeerInferError as exc:
            logger.warning("announcement not published: %s", exc)

    async def _validate_announce(self, message: GossipMessage) -> bool:
        # True for anything well-formed (stale ones are dropped by the core, not penalised);
        # False only for provable garbage or a sender speaking for someone else.
        try:
            announce = decode(message.data, expected=Announce)
        except ProtocolError:
            return False
        assert isinstance(announce, Announce)
        return announce.sender == message.sender

    async def _gossip_loop(self, messages: trio.MemoryReceiveChannel[GossipMessage]) -> None:
        async for message in messages:
            try:
                announce = decode(message.data, expected=Announce)
            except ProtocolError:
                continue
            assert isinstance(announce, Announce)
            if message.sender not in self._exchanged and self._nursery is not None:
                # A node we have not swapped peer lists with yet (clients never announce, so
                # they are never asked for a protocol they do not speak).
                self._exchanged.add(message.sender)
                self._nursery.start_soon(self._exchange_peers, message.sender)
            self._feed(AnnounceReceived(PeerId(message.sender), announce))

    async def _sync_round(self, eff: SendSyncRequest) -> None:
        host = self.host
        assert host is not None
        try:
            reply = await host.request(eff.peer, SYNC_PROTOCOL, encode(eff.request), timeout=eff.timeout_s)
            response = decode(reply, expected=SyncResponse)
            assert isinstance(response, SyncResponse)
        except PeerInferError as exc:
            self._feed(SyncFailed(eff.peer, eff.request.session, str(exc)))
            return
        self._feed(SyncResponseReceived(eff.peer, response))

    async def _serve_sync(self, stream: FramedStream) -> None:
        core = self.core
        assert core is not None
        async for frame in stream:
            request = decode(frame, expected=SyncRequest)
            assert isinstance(request, SyncRequest)
            await stream.send(encode(core.answer_sync(request)))

    # ------------------------------------------------------------------ status and peers

    def status(self) -> StatusResponse:
        core, host, engine = self.core, self.host, self.engine
        assert core is not None and host is not None and engine is not None
        now = self._now()
        peers = tuple(
            PeerStatus(
                peer_id=p.peer_id,
                digest_age_s=min(p.digest_age_s, 1e11),
                load=p.load,
                cached_tokens=p.cached_tokens,
                rtt_ms=(p.rtt_s or 0.0) * 1000.0,
            )
            for p in core.peers(now)
        )
        cache_tokens = len(core.local.digest) * core.hasher.block_size
        stats = engine.statistics().cache
        capacity = (stats.capacity_bytes or 0) if stats is not None else 0
        counts = core.statistics()
        cache_bytes = stats.bytes if stats is not None else 0
        return StatusResponse(
            peer_id=host.peer_id,
            addrs=tuple(host.dialable_addrs())[:64],
            model=engine.model_name[:512],
            peers=peers[:4096],
            cache=CacheStatus(tokens=cache_tokens, bytes=cache_bytes, capacity_bytes=capacity),
            load=core.load(),
            counters=RequestCounters(
                requests=counts.requests,
                served_locally=counts.served_locally,
                forwarded=counts.forwarded,
                failovers=counts.failovers,
                rejected=counts.rejected,
                rejected_over_limit=counts.rejected_over_limit,
            ),
        )

    async def _serve_status(self, stream: FramedStream) -> None:
        decode(await stream.receive(), expected=StatusRequest)
        await stream.send(encode(self.status()))

    def _known_peers(self) -> PeerExchange:
        host = self.host
        assert host is not None
        peers = [PeerAddrs(host.peer_id, tuple(host.dialable_addrs())[:16])]
        # Only nodes (peers that announced on our topic), never clients: a client is not a
        # routing candidate and should not be dialed by every node it is told about.
        others = [p for p in host.connected_peers() if p in self._exchanged]
        random.shuffle(others)
        for peer in others[:MAX_EXCHANGED_PEERS]:
            addrs = tuple(host.known_addrs(peer))[:16]
            if addrs:
                peers.append(PeerAddrs(peer, addrs))
        return PeerExchange(tuple(peers))

    async def _learn_peers(self, exchange: PeerExchange) -> None:
        host = self.host
        assert host is not None
        connected = set(host.connected_peers())
        for entry in exchange.peers[:MAX_EXCHANGED_PEERS]:
            if entry.peer_id == host.peer_id or entry.peer_id in connected:
                continue
            try:
                host.add_known_peer(entry.peer_id, entry.addrs)
            except ProtocolError:
                continue
            assert self._nursery is not None
            self._nursery.start_soon(self._dial_quietly, entry.peer_id)

    async def _dial_quietly(self, peer: str) -> None:
        host = self.host
        assert host is not None
        with contextlib.suppress(PeerInferError):
            await host.dial(peer, timeout=5.0)

    async def _serve_peers(self, stream: FramedStream) -> None:
        exchange = decode(await stream.receive(), expected=PeerExchange)
        assert isinstance(exchange, PeerExchange)
        await stream.send(encode(self._known_peers()))
        await self._learn_peers(exchange)

    async def _exchange_peers(self, peer: str) -> None:
        host = self.host
        assert host is not None
        try:
            reply = await host.request(peer, PEERS_PROTOCOL, encode(self._known_peers()), timeout=5.0)
            exchange = decode(reply, expected=PeerExchange)
        except PeerInferError:
            return
        assert isinstance(exchange, PeerExchange)
        await self._learn_peers(exchange)

    async def _peer_exchange_loop(self) -> None:
        host = self.host
        assert host is not None
        while True:
            await trio.sleep(PEER_EXCHANGE_INTERVAL_S * (0.5 + random.random()))
            peers = [p for p in host.connected_peers() if p in self._exchanged]
            if peers:
                await self._exchange_peers(random.choice(peers))

    async def _peer_event_loop(self, events: trio.MemoryReceiveChannel[PeerEvent]) -> None:
        assert self._nursery is not None
        async for ev in events:
            if ev.kind == "connected":
                self._feed(PeerSeen(PeerId(ev.peer_id)))
            elif ev.kind in ("unresponsive", "misbehaved"):
                self._feed(PeerLost(PeerId(ev.peer_id)))
            # A plain disconnect may be churn: the core's liveness pings decide whether the
            # peer is gone, so its replica is not thrown away on every reconnect.

    async def _ping(self, peer: PeerId) -> None:
        host = self.host
        assert host is not None
        try:
            rtt = await host.ping(peer, timeout=2.0)
        except PeerInferError:
            self._feed(PeerLost(peer))
            return
        self._feed(PeerSeen(peer, rtt_s=rtt))


__all__ = [
    "GENERATE_PROTOCOL",
    "PEERS_PROTOCOL",
    "STATUS_PROTOCOL",
    "SYNC_PROTOCOL",
    "Node",
    "NodeOptions",
    "announce_topic",
]
