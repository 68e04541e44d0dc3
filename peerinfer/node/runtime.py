"""The ``Node``: it composes the components (``Door``, ``EngineWorker``, ``Forwarder``,
``AntiEntropy``, ``PeerKeeper``, ``TrustKeeper``) over one :class:`NodeContext`, runs their
tasks in one nursery, feeds the core its events and hands each effect it returns to the
component that executes it; and its timer."""

from __future__ import annotations

import collections
import functools
import os
import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from peerinfer.core.messages import ErrorMessage, GenerateRequest, Load, StatusResponse
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
    NodeCore,
    PeerSnapshot,
    PingPeer,
    PreemptLocal,
    ProbeLink,
    Publish,
    Reject,
    ResumeLocal,
    RunLocal,
    SendSyncRequest,
)
from peerinfer.core.node import NodeStatistics as CoreStatistics
from peerinfer.core.prefix import PrefixHasher, derive_swarm_key
from peerinfer.engine.base import Engine
from peerinfer.engine.batch import BatchScheduler, SchedulerStatistics
from peerinfer.net import Host, NodeHost, Transport, open_host
from peerinfer.net.config import default_identity_path
from peerinfer.net.reach import ReachSettings, run_reach
from peerinfer.node.antientropy import AntiEntropy
from peerinfer.node.context import NodeContext
from peerinfer.node.door import Door, RoutingRecord, Submission
from peerinfer.node.forwarding import Forwarder
from peerinfer.node.kvpull import KvExchange
from peerinfer.node.options import (
    EPOCH_STRIDE,
    GENERATE_PROTOCOL,
    KV_PROTOCOL,
    PEERS_PROTOCOL,
    SHUTDOWN_GRACE_S,
    STATUS_PROTOCOL,
    SYNC_PROTOCOL,
    NodeOptions,
    _load_engine,
    announce_topic,
    core_config,
    disk_cache_path,
    host_config,
    logger,
)
from peerinfer.node.peers import PeerKeeper
from peerinfer.node.trust import TrustKeeper
from peerinfer.node.worker import EngineWorker
from peerinfer.types import PeerId

if TYPE_CHECKING:
    # trio's own ``trio.TaskStatus``, as mypy sees it: libp2p depends on trio-typing, whose
    # trio-stubs shadow trio's inline types and name the class here.
    from trio_typing import TaskStatus



#: The longest a stopping node spends saving its memory cache to its disk tier.
DISK_SAVE_S = 30.0


@dataclass(frozen=True, slots=True)
class NodeStatistics:
    """A snapshot of a running node, for its HTTP API, metrics and dashboard
    (:meth:`Node.statistics`)."""

    peer_id: str
    #: seconds since the node object was made (wall clock)
    uptime_s: float
    #: the node's monotonic clock (the core's), when the snapshot was taken
    now: float
    core: CoreStatistics
    load: Load
    peers: tuple[PeerSnapshot, ...]
    #: anti-entropy bytes by (kind, direction), as in ``NodeContext.traffic``
    traffic: tuple[tuple[tuple[str, str], int], ...]
    #: the last routing decisions, newest first
    decisions: tuple[RoutingRecord, ...]
    #: the batch scheduler's counters (None: not started, or a read that raced a step)
    scheduler: SchedulerStatistics | None
    http_url: str | None


class Node:
    """One peerinfer node. ``await node.serve(task_status=...)`` runs it until cancelled
    (``peerinfer.serve`` runs it with its HTTP API).

    ``engine`` may be given ready-made (tests, embedding); otherwise it is loaded from
    ``options`` in a worker thread at start.

    ``transport`` opens the node's host: by default ``peerinfer.net.open_host`` (libp2p, which
    alone also runs reachability, ``peerinfer.net.reach``); tests pass an in-memory network's
    (``peerinfer.testing.memnet``). ``inline_engine``: call the engine on trio's thread
    (``NodeContext.inline_engine``; only for tests under trio's virtual clock).
    """

    def __init__(
        self, options: NodeOptions, engine: Engine | None = None, *,
        transport: Transport | None = None, inline_engine: bool = False,
    ) -> None:
        self.options = options
        self.ctx = NodeContext(options, feed=self._feed, engine=engine, inline_engine=inline_engine)
        self._transport = transport
        self.door = Door(self.ctx)
        self.worker = EngineWorker(self.ctx)
        self.forwarder = Forwarder(self.ctx)
        self.peers = PeerKeeper(self.ctx)
        self.antientropy = AntiEntropy(self.ctx, on_announcer=self.peers.on_announcer)
        self.trust = TrustKeeper(self.ctx)
        self.kv = KvExchange(self.ctx, run_after=self.worker.run_local)
        self._scheduler: BatchScheduler | None = None
        self._wake = trio.Event()
        #: the disk tier figure last put in this node's load (``_disk_figure``)
        self._disk_announced: tuple[int, int] | None = None
        self._started_at = time.time()
        self.ready = trio.Event()
        #: the HTTP API's URL once it accepts (set by ``peerinfer.serve``; None: off)
        self.http_url: str | None = None

    # ------------------------------------------------------------------ the public face

    @property
    def engine(self) -> Engine | None:
        return self.ctx.engine

    @property
    def host(self) -> NodeHost | None:
        return self.ctx.host

    @property
    def core(self) -> NodeCore | None:
        return self.ctx.core

    @property
    def peer_id(self) -> str:
        return self.ctx.peer_id

    @property
    def topic(self) -> str:
        """The gossip topic of the node's model (and swarm key); "" before it serves."""
        return self.ctx.topic

    @property
    def traffic(self) -> collections.Counter[tuple[str, str]]:
        """Anti-entropy bytes by (kind, direction): ("announce"|"sync", "sent"|"received");
        live (``statistics()`` has a snapshot)."""
        return self.ctx.traffic

    @property
    def request_listeners(self) -> list[Callable[[Submission, bool], None]]:
        """Called with (submission, local) when a request submitted through the door ends
        with its final event (metrics); must not block or raise."""
        return self.door.request_listeners

    @property
    def recent_decisions(self) -> Sequence[RoutingRecord]:
        """The last routing decisions, newest last."""
        return self.door.recent_decisions

    @property
    def exchange_dials(self) -> int:
        """Dials caused by peer exchange (tests and the attack bench)."""
        return self.peers.exchange_dials

    def addresses(self) -> list[str]:
        assert self.host is not None, "the node is not running"
        return self.host.dialable_addrs()

    def submit(
        self, req: GenerateRequest, *, requester: str, local: bool
    ) -> AbstractAsyncContextManager[Submission]:
        """Submit a request through the node's door (see :meth:`Door.submit`)."""
        return self.door.submit(req, requester=requester, local=local)

    def status(self) -> StatusResponse:
        """What ``peerinfer status`` shows (the status protocol's answer)."""
        return self.peers.status()

    def statistics(self) -> NodeStatistics:
        """A snapshot of the running node (``serve`` must have started it)."""
        core = self.core
        assert core is not None, "the node is not running"
        now = self.ctx.now()
        scheduler = None
        if self._scheduler is not None:
            try:
                # Read from the trio thread while the worker steps: a snapshot of plain
                # counters; one that races a step is left out, never fatal.
                scheduler = self._scheduler.statistics()
            except Exception as exc:
                logger.debug("scheduler statistics skipped: %r", exc)
        return NodeStatistics(
            peer_id=self.peer_id,
            uptime_s=time.time() - self._started_at,
            now=now,
            core=core.statistics(),
            load=core.load(),
            peers=tuple(core.peers(now)),
            traffic=tuple(sorted(self.ctx.traffic.items())),
            decisions=tuple(reversed(self.door.recent_decisions)),
            scheduler=scheduler,
            http_url=self.http_url,
        )

    # ------------------------------------------------------------------ lifecycle

    async def serve(
        self, *,
        task_status: TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Load the engine, join the swarm and serve until cancelled; ``task_status.started(self)``
        once it accepts requests. The HTTP API (``NodeOptions.http``) is not this method's:
        ``peerinfer.serve_node`` runs it beside the node."""
        ctx, opts = self.ctx, self.options
        if ctx.engine is None:
            ctx.engine = await ctx.in_thread(_load_engine, opts)
        engine = ctx.engine
        secret = opts.swarm_key
        hasher = PrefixHasher(engine.fingerprint, derive_swarm_key(engine.fingerprint, secret))
        await ctx.in_engine(
            engine.configure_cache,
            hasher,
            capacity_bytes=opts.cache_bytes,
            capacity_tokens=opts.cache_tokens,
        )
        if opts.disk_cache_bytes:
            # Before the snapshot below: a restarted node announces what its disk kept.
            await ctx.in_engine(engine.configure_disk, disk_cache_path(opts), opts.disk_cache_bytes)
        ctx.topic = announce_topic(engine.fingerprint, secret)
        cache = engine.statistics().cache
        hosting = host_config(opts, ctx.topic)
        transport: Transport = self._transport or open_host
        async with transport(hosting) as host:
            ctx.host = host
            epoch_base = self._epoch_base()
            config = core_config(
                opts, PeerId(host.peer_id), max_batch_size=engine.max_batch_size,
                cache_capacity_bytes=cache.capacity_bytes if cache is not None else None,
                kv_bytes_per_token=engine.kv_bytes_per_token or None,
                engine_costs_default=engine.default_costs,
            )
            scheduler = BatchScheduler(engine, max_running=config.costs.slots)
            self._scheduler = scheduler
            ctx.core = NodeCore(
                config, hasher, rng=random.Random(opts.seed), epoch_base=epoch_base, now=ctx.now()
            )
            snapshot = await ctx.in_engine(engine.cached_block_hashes)
            async with trio.open_nursery() as nursery:
                ctx.nursery = nursery
                host.set_handler(GENERATE_PROTOCOL, self.door.serve_generate)
                host.set_handler(SYNC_PROTOCOL, self.antientropy.serve_sync)
                host.set_handler(STATUS_PROTOCOL, self.peers.serve_status)
                host.set_handler(PEERS_PROTOCOL, self.peers.serve_peers)
                host.set_handler(KV_PROTOCOL, self.kv.serve_kv)
                messages = await host.subscribe(ctx.topic, self.antientropy.validate_announce)
                nursery.start_soon(self.antientropy.gossip_loop, messages)
                nursery.start_soon(self.peers.peer_event_loop, host.peer_events())
                if opts.kv_pull is not None:
                    nursery.start_soon(self.kv.link_event_loop, host.peer_events())
                nursery.start_soon(self._timer_loop)
                nursery.start_soon(self.peers.peer_exchange_loop)
                nursery.start_soon(self.peers.redial_lost_loop)
                self.trust.load(hosting)
                nursery.start_soon(self.trust.run)
                nursery.start_soon(self.worker.run, scheduler)
                if isinstance(host, Host):  # relays, hole punching, UPnP: libp2p's alone
                    await nursery.start(
                        functools.partial(run_reach, on_addrs_changed=self.peers.spread_addrs),
                        host, ReachSettings.of(opts.relay_service, opts.relay_circuit_bytes, upnp=opts.upnp),
                    )
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
                    if opts.disk_cache_bytes:
                        # Save what memory holds, so that the node restarts warm (bounded:
                        # a stop must not hang on a slow disk).
                        with trio.CancelScope(shield=True), trio.move_on_after(DISK_SAVE_S):
                            await ctx.in_engine(engine.save_to_disk, DISK_SAVE_S)

    async def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Stop taking requests and wait up to ``grace_s`` for in-flight ones to finish; the
        caller then cancels ``serve``, which fails whatever is left with a 'shutdown' error."""
        self.ctx.closing = True
        with trio.move_on_after(grace_s):
            await self.ctx.sinks.wait_empty()
        self._drain_now()
        # Let the stream handlers write those errors before the host goes away.
        with trio.move_on_after(1.0):
            await self.door.wait_handlers_gone()

    def _drain_now(self) -> None:
        self.ctx.closing = True
        for sink in self.ctx.sinks:
            sink.stop()
            self.ctx.sinks.finish(
                sink, ErrorMessage(sink.request_id, "shutdown", "the node is shutting down")
            )

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
        core = self.ctx.core
        if core is None:
            return
        try:
            effects = core.handle(event, self.ctx.now())
        except Exception:  # a bug in the core must not take the node down
            logger.exception("node core failed on %s", type(event).__name__)
            return
        self._execute(effects)
        for peer, reason, detail in core.take_refusals():
            # Once per (peer, reason): the core deduplicates.
            logger.info("refused an announcement from %s: %s (%s)", peer, reason, detail)
        self._wake.set()

    def _execute(self, effects: Sequence[Effect]) -> None:
        """Each effect to the component that executes it."""
        ctx = self.ctx
        nursery, sinks = ctx.nursery, ctx.sinks
        if nursery is None:
            return
        ctx.note_core_moved()
        for eff in effects:
            if isinstance(eff, RunLocal | Forward):
                self.door.note_route(eff)
            if isinstance(eff, Publish):
                nursery.start_soon(self.antientropy.publish, eff.announce)
            elif isinstance(eff, SendSyncRequest):
                nursery.start_soon(self.antientropy.sync_round, eff)
            elif isinstance(eff, RunLocal):
                if eff.decision is not None and eff.decision.pull_from is not None:
                    nursery.start_soon(self.kv.run_local, eff)  # pull, then the worker's
                else:
                    nursery.start_soon(self.worker.run_local, eff)
            elif isinstance(eff, Forward):
                nursery.start_soon(self.forwarder.forward, eff)
            elif isinstance(eff, Reject):
                sink = sinks.get(eff.request_id)
                if sink is not None:
                    sinks.finish(sink, ErrorMessage(sink.request_id, eff.code, eff.message,
                                                    eff.retry_after_s))
            elif isinstance(eff, CancelLocal):
                sink = sinks.get(eff.request_id)
                if sink is not None:
                    sink.cancel.set()
                self.worker.control(None)  # a preempted request is not stepped: wake the worker
            elif isinstance(eff, PreemptLocal | ResumeLocal):
                self.worker.control(eff)
            elif isinstance(eff, CancelForward):
                sink = sinks.get(eff.request_id)
                if sink is not None and sink.forward_scope is not None:
                    sink.forward_scope.cancel()
            elif isinstance(eff, PingPeer):
                nursery.start_soon(self.peers.ping, eff.peer)
            elif isinstance(eff, DropPeer):
                logger.info("peer %s left the candidate set", eff.peer)
                self.peers.forget(eff.peer)
            elif isinstance(eff, AuditForward):
                self.trust.queue_audit(eff)
            elif isinstance(eff, BanPeer):
                nursery.start_soon(self.trust.ban, eff)
            elif isinstance(eff, ProbeLink):
                nursery.start_soon(self.kv.probe, eff)

    def _disk_figure(self) -> tuple[int, int] | None:
        """What this node's load says of its disk tier (``Load.disk``), None without one:
        the share of held blocks that are on disk only, and the time to load a token's KV
        from disk at the rate measured on hits so far (read and decode), else the default."""
        engine, core = self.ctx.engine, self.ctx.core
        if engine is None or core is None:
            return None
        return engine.disk_figure(len(core.local.digest))

    async def _timer_loop(self) -> None:
        while True:
            core = self.ctx.core
            assert core is not None
            deadline = core.next_deadline()
            delay = min(1.0, max(0.005, deadline - self.ctx.now()))
            self._wake = trio.Event()
            with trio.move_on_after(delay):
                await self._wake.wait()
            self.kv.refresh_pull_limits()
            disk = self._disk_figure()
            if disk is not None and disk != self._disk_announced:
                self._disk_announced = disk
                self._feed(CacheChanged(disk=disk))
            if self.ctx.now() >= core.next_deadline():
                try:
                    effects = core.tick(self.ctx.now())
                except Exception:
                    logger.exception("node core failed on tick")
                    continue
                self._execute(effects)
