"""The ``Node``: its lifecycle (serve, shutdown), feeding the core its events and executing
the effects it returns, and its timer."""

from __future__ import annotations

import collections
import functools
import math
import os
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import trio

from peerinfer.core.costmodel import DEFAULT_COSTS, default_costs
from peerinfer.core.messages import (
    ErrorMessage,
)
from peerinfer.core.node import (
    AuditForward,
    BanPeer,
    CacheChanged,
    CancelForward,
    CancelLocal,
    DropPeer,
    Effect,
    Event,
    Forward,
    NodeConfig,
    NodeCore,
    PingPeer,
    PreemptLocal,
    Publish,
    Reject,
    ResumeLocal,
    RunLocal,
    SendSyncRequest,
)
from peerinfer.core.prefix import PrefixHasher, derive_swarm_key
from peerinfer.engine.base import Engine
from peerinfer.engine.batch import BatchScheduler
from peerinfer.net import Host, HostConfig, open_host
from peerinfer.net.config import default_identity_path
from peerinfer.net.pacing import TokenBucket
from peerinfer.net.reach import ReachSettings, run_reach
from peerinfer.node.antientropy import AntiEntropyMixin
from peerinfer.node.door import DoorMixin, RoutingRecord, Submission, _Sink
from peerinfer.node.forwarding import ForwardingMixin
from peerinfer.node.options import (
    DEFAULT_REPLICA_BUDGET_BLOCKS,
    EPOCH_STRIDE,
    GENERATE_PROTOCOL,
    MIN_REPLICA_BUDGET_BLOCKS,
    PEER_DIAL_BURST,
    PEER_DIAL_RATE,
    PEERS_PROTOCOL,
    RECENT_DECISIONS,
    REPLICA_BUDGET_SHARE,
    REPLICA_BYTES_PER_BLOCK,
    SHUTDOWN_GRACE_S,
    STATUS_PROTOCOL,
    SYNC_PROTOCOL,
    NodeOptions,
    _load_engine,
    announce_topic,
    logger,
)
from peerinfer.node.peers import LostNode, PeersMixin
from peerinfer.node.worker import EngineWorkerMixin, _Control, _LocalRun
from peerinfer.trust import TrustKeeper
from peerinfer.types import PeerId, RequestId


class Node(DoorMixin, EngineWorkerMixin, ForwardingMixin, AntiEntropyMixin, PeersMixin):
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
        #: the runs by request id, preemptions and resumes for the worker's next step, and
        #: preemptions asked for runs not handed over yet (engine worker: worker.py)
        self._runs_by_id: dict[RequestId, _LocalRun] = {}
        self._local_control: list[_Control] = []
        self._preempt_asked: dict[RequestId, int] = {}
        self._engine_wake = trio.Event()
        #: when the engine worker last completed a step (waiting requests wait while it moves)
        self._engine_progress_at = -math.inf
        self._sinks: dict[RequestId, _Sink] = {}
        self._nursery: trio.Nursery | None = None
        self._wake = trio.Event()
        self._closing = False
        self._open_handlers = 0
        #: members (nodes, not clients) we have swapped peer lists with (bounded)
        self._exchanged: OrderedDict[str, None] = OrderedDict()
        #: when peer exchange last made us dial each peer (bounded), and the dial pacer
        self._dialed_at: OrderedDict[str, float] = OrderedDict()
        self._dial_bucket = TokenBucket(PEER_DIAL_RATE, PEER_DIAL_BURST)
        #: nodes that answered peer exchange (bounded), and those of them lost, being redialed
        self._nodes_met: OrderedDict[str, None] = OrderedDict()
        self._lost: OrderedDict[str, LostNode] = OrderedDict()
        self._lost_wake = trio.Event()
        #: peers a dial of ours is under way to (one at a time each)
        self._dialing: set[str] = set()
        #: relayed peers a spare generate stream is being opened to (forwarding)
        self._spares_opening: set[str] = set()
        #: dials caused by peer exchange (statistics for tests and the attack bench)
        self.exchange_dials = 0
        self._topic = ""
        self._started_at = time.time()
        self.ready = trio.Event()
        #: the last routing decisions, newest last (bounded)
        self.recent_decisions: collections.deque[RoutingRecord] = collections.deque(
            maxlen=RECENT_DECISIONS
        )
        #: called with (submission, local) when a request submitted through the door ends
        #: with its final event (metrics); must not block or raise
        self.request_listeners: list[Callable[[Submission, bool], None]] = []
        #: anti-entropy bytes by (kind, direction): ("announce"|"sync", "sent"|"received")
        self.traffic: collections.Counter[tuple[str, str]] = collections.Counter()
        #: the HTTP API's URL once it accepts (None: off)
        self.http_url: str | None = None
        self._trust = TrustKeeper(self)

    @property
    def peer_id(self) -> str:
        assert self.host is not None, "the node is not running"
        return self.host.peer_id

    def addresses(self) -> list[str]:
        assert self.host is not None, "the node is not running"
        return self.host.dialable_addrs()

    async def serve(self, *, task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        opts = self.options
        http_address = None
        if opts.http is not None:
            from peerinfer.http import check_exposure, parse_http_address

            # Refuse a bad or unsafe address before the (slow) model load.
            http_address = parse_http_address(opts.http)
            if http_address is not None:
                check_exposure(http_address[0], opts.api_keys)
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
        # One capacity for the core and the scheduler: the engine's max_batch_size, unless the
        # cost model names its own number of slots (the default model's is 1: "not set"). If
        # the two differed, the scheduler would queue requests the core thinks are running, in
        # its own FIFO order, behind the core's fair share.
        # A node left on the default (single-slot) model whose engine batches gets the batched
        # default, whose step times grow with the batch as measured (docs/performance.md).
        costs = opts.costs
        if costs == DEFAULT_COSTS and engine.max_batch_size > 1:
            costs = default_costs(engine.max_batch_size)
        elif costs.slots == 1 and engine.max_batch_size > 1:
            costs = costs.with_slots(engine.max_batch_size)
        scheduler = BatchScheduler(engine, max_running=costs.slots)
        self._scheduler = scheduler  # read by the metrics (statistics() snapshots)
        self._topic = announce_topic(engine.fingerprint, secret)
        replica_budget = opts.replica_budget_blocks
        if replica_budget is None:
            stats = engine.statistics().cache
            capacity = stats.capacity_bytes if stats is not None else None
            replica_budget = (
                DEFAULT_REPLICA_BUDGET_BLOCKS if not capacity
                else max(MIN_REPLICA_BUDGET_BLOCKS,
                         int(capacity * REPLICA_BUDGET_SHARE) // REPLICA_BYTES_PER_BLOCK)
            )
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
            # A failed ping starts the probe with a fresh connection (net.host, PROBE_EVERY_S):
            # the sooner it is known, the sooner a restored link is used again.
            liveness_timeout_s=max(3.0, opts.peer_timeout_s / 2),
            swarm_key=secret,
        )
        async with open_host(host_config) as host:
            self.host = host
            epoch_base = self._epoch_base()
            self.core = NodeCore(
                NodeConfig(
                    peer_id=PeerId(host.peer_id),
                    policy=opts.policy,
                    costs=costs,
                    announce_interval_s=opts.announce_interval_s,
                    first_token_timeout_s=opts.first_token_timeout_s,
                    token_gap_timeout_s=opts.token_gap_timeout_s,
                    peer_timeout_s=opts.peer_timeout_s,
                    ping_after_s=max(0.5, opts.peer_timeout_s / 3),
                    max_queue=opts.max_queue,
                    max_new_tokens=opts.max_tokens,
                    max_prompt_tokens=opts.max_prompt_tokens,
                    max_queued_per_peer=opts.max_queued_per_requester,
                    preempt_after_tokens=opts.preempt_after_tokens,
                    audit_rate=opts.audit_rate,
                    trusted_peers=(
                        None if opts.trusted_peers is None
                        else frozenset(PeerId(p) for p in opts.trusted_peers)
                    ),
                    replica_budget_blocks=replica_budget,
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
                nursery.start_soon(self._redial_lost_loop)
                self._trust.load(host_config)
                nursery.start_soon(self._trust.run)
                nursery.start_soon(self._engine_worker, scheduler)
                await nursery.start(
                    functools.partial(run_reach, on_addrs_changed=self._spread_addrs),
                    host, ReachSettings.of(opts.relay_service, opts.relay_circuit_bytes, upnp=opts.upnp),
                )
                if snapshot:
                    self._feed(CacheChanged(added=snapshot))
                if http_address is not None:
                    from peerinfer.http import serve_http

                    await nursery.start(serve_http, self, *http_address, opts.api_keys)
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

    @staticmethod
    def _now() -> float:
        # Monotonic: a wall-clock step (sleep, NTP, a user) must not move any timer.
        return trio.current_time()

    def _epoch_base(self) -> int:
        """Where this incarnation's epochs start: above every epoch of the previous ones.

        The wall clock (microseconds) normally suffices; a base persisted beside a persistent
        identity covers a clock that stepped back between two runs. A throwaway identity has no
        previous incarnation to outgrow."""
        opts = self.options
        wall_base = max(0, int(opts.wall_clock() * 1_000_000))
        if not opts.persist_identity:
            return wall_base
        path = (opts.identity or default_identity_path()).with_suffix(".epoch")
        last = 0
        try:
            last = int(path.read_text().strip() or 0)
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            logger.warning("ignoring the unreadable epoch file %s: %s", path, exc)
        base = max(wall_base, last + EPOCH_STRIDE) if last else wall_base
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(f"{base}\n")
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("cannot persist the epoch base to %s: %s", path, exc)
        return base

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
        for peer, reason, detail in core.take_refusals():
            # Once per (peer, reason): the core deduplicates.
            logger.info("refused an announcement from %s: %s (%s)", peer, reason, detail)
        self._wake.set()

    def _execute(self, effects: Sequence[Effect]) -> None:
        nursery = self._nursery
        if nursery is None:
            return
        for eff in effects:
            if isinstance(eff, RunLocal | Forward):
                self._note_route(eff)
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
                    self._finish_sink(sink, ErrorMessage(sink.request_id, eff.code, eff.message,
                                                         eff.retry_after_s))
            elif isinstance(eff, CancelLocal):
                sink = self._sinks.get(eff.request_id)
                if sink is not None:
                    sink.cancel.set()
                self._control_local(None)  # a preempted request is not stepped: wake the worker
            elif isinstance(eff, PreemptLocal | ResumeLocal):
                self._control_local(eff)
            elif isinstance(eff, CancelForward):
                sink = self._sinks.get(eff.request_id)
                if sink is not None and sink.forward_scope is not None:
                    sink.forward_scope.cancel()
            elif isinstance(eff, PingPeer):
                nursery.start_soon(self._ping, eff.peer)
            elif isinstance(eff, DropPeer):
                logger.info("peer %s left the candidate set", eff.peer)
                self._exchanged.pop(eff.peer, None)
            elif isinstance(eff, AuditForward):
                self._trust.queue_audit(eff)
            elif isinstance(eff, BanPeer):
                nursery.start_soon(self._trust.ban, eff)

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
