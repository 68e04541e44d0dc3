"""The simulator's kernel: the event heap, virtual time, node ticks and the event loop.

``peerinfer.sim.simulator.Simulation`` is the one kernel there is: it says what each event
means (a core's effects executed, a request served, a stream relayed). The parts that extend a
run, churn (``peerinfer.sim.churn``) and the gossipsub mesh (``peerinfer.sim.gossip``), are
handed the running simulation as a ``SimKernel`` and use only what this class declares: they
schedule events, hand a node's effects to ``execute``, re-arm its tick, and start a core. So
they import this module and never the simulator, and the simulator imports them.

The event heap
    holds tuples ``(time, seq, kind, ...)``; ``seq`` grows by one per push, so events at equal
    times run in the order they were scheduled and a run is deterministic. ``kind`` is a small
    integer; the payload depends on it:

    ==============  ===========================================================================
    ``NODE``        ``(node, event)``: hand a core event to a node (``NodeCore.handle``)
    ``TICK``        ``(node,)``: the node's timers are due (``NodeCore.tick``); each node has
                    at most one live tick, at its ``next_deadline()``, re-armed earlier when an
                    effect sets a nearer deadline (a forward, a pull, an unannounced change)
    ``ARRIVAL``     ``(request,)``: a client request reaches its entry node
    ``GOSSIP``      ``(sender, sender's id, Announce, group, sent_at)``: an announcement reaches
                    every recipient at one link delay from the sender (groups of recipients
                    with equal delays are delivered together, then the next group is scheduled)
    ``SYNC``        ``(responder, requester, SyncRequest)``: a pull reaches its responder,
                    which answers from its digest as it is *then*; the response travels back
                    one link delay later as a ``SyncResponseReceived``
    ``STEP``        ``(node, epoch)``: the node's batch ends a segment of decode/prefill steps
                    (``peerinfer.sim.batch``); stale when the batch's epoch has moved on
    ``RELAY``       ``(origin, event, server, cached, prompt)``: a forwarded request's first
                    token or end reaches its origin (which relays it to the client)
    ``CHURN``       ``(action, node)``: a node joins, leaves or crashes (``peerinfer.sim.churn``)
    ``MESH``        ``(kind, src, dst, payload)``: a gossipsub transmission arrives (message,
                    IHAVE, IWANT: ``peerinfer.sim.gossip``); ``MESH_BEAT`` ``(node,)``: its
                    heartbeat
    ``PULL``        ``(node, job)``: a KV pull ends, the run joins the node's batch
    ==============  ===========================================================================

    Events pushed with ``push`` are *live*: while one is in the heap, the run has something
    left to happen. Ticks, churn and heartbeats are pushed with ``push_background``: they never
    keep a run going, and a run whose heap holds only them while requests are outstanding has
    lost a request (``SimulationError``, after the longest timeout the cores could still be
    waiting on).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import time
from collections.abc import Iterator
from typing import Any, Protocol, Self

from peerinfer.core.node import NodeCore, NodeStatistics
from peerinfer.errors import PeerInferError
from peerinfer.sim.batch import BatchNode
from peerinfer.sim.config import SimConfig
from peerinfer.types import PeerId, RequestId

NODE, TICK, ARRIVAL, GOSSIP, SYNC, STEP, RELAY, CHURN, MESH, MESH_BEAT, PULL = range(11)
_INF = math.inf
#: allocations between collections of the youngest generation during a run (Python: 700)
GC_YOUNG_THRESHOLD = 100_000


class SimulationError(PeerInferError):
    """The simulation broke one of its own invariants (a lost or twice-completed request)."""


class SimCore(Protocol):
    """A node slot's core: a ``NodeCore``, or churn's ``GoneCore`` for a machine that is off."""

    def handle(self, event: Any, now: float) -> list[Any]: ...

    def tick(self, now: float) -> list[Any]: ...

    def next_deadline(self) -> float: ...

    def pending_requests(self) -> list[RequestId]: ...

    def statistics(self) -> NodeStatistics: ...


class ChurnHooks(Protocol):
    """What the kernel and the mesh ask of a run's churn (``peerinfer.sim.churn.Churn``)."""

    joined_at: dict[int, float]

    def up(self, n: int) -> bool: ...

    def held(self) -> bool: ...

    def fire(self, action: str, node: int, now: float) -> None: ...


class MeshHooks(Protocol):
    """What the kernel and churn ask of the gossip mesh (``peerinfer.sim.gossip.Mesh``)."""

    def fire(self, kind: int, src: int, dst: int, payload: Any, now: float) -> None: ...

    def heartbeat(self, n: int, now: float) -> None: ...

    def joined(self, n: int, now: float) -> None: ...


class SimKernel:
    """The heap, the clock and the loop of a run, and what churn and the mesh may use of it.

    The subclass (``Simulation``) sets the swarm's tables and implements ``execute``,
    ``make_core``, ``stop_engine``, ``end_orphaned`` and the event handlers the loop calls.
    """

    config: SimConfig
    check: bool
    #: the virtual time of the event being handled
    now: float
    #: node slots: the starting nodes, then room for churn's newcomers
    slots: int
    cores: list[SimCore]
    peer_ids: list[PeerId]
    #: a peer id's slot
    index_of: dict[PeerId, int]
    #: one-way link delay between two slots, in seconds
    delay: list[list[float]]
    batches: list[BatchNode]
    churn: ChurnHooks | None
    mesh: MeshHooks | None
    # Requests, indexed by request (see ``Simulation``): the figures churn reads and ends.
    total: int
    completed: int
    rejected: int
    rid_index: dict[RequestId, int]
    origin: list[int]
    target: list[int]
    first: list[float]
    status: list[int]
    finish: list[float]
    served: list[int]
    #: per node: when each request joined its queue (queueing delay is measured from there)
    enqueued: list[dict[RequestId, float]]
    # Anti-entropy figures the gossip models add to.
    announces: int
    announce_bytes: int
    announce_deliveries: int
    announces_lost: int

    def __init__(self, nodes: int) -> None:
        self._heap: list[tuple[Any, ...]] = []
        self._seq: Iterator[int] = itertools.count()
        self._tick_at = [_INF] * nodes
        self._live_events = 0  # events other than ticks in the heap
        self.now = 0.0
        self.events = 0
        self.wall_s = 0.0

    # ------------------------------------------------------------------ scheduling

    def push(self, t: float, kind: int, *payload: Any) -> None:
        """Schedule a live event (see the module docstring) at virtual time ``t``."""
        self._live_events += 1
        heapq.heappush(self._heap, (t, next(self._seq), kind, *payload))

    def push_background(self, t: float, kind: int, *payload: Any) -> None:
        """Schedule an event that never keeps a finished run going (churn, heartbeats)."""
        heapq.heappush(self._heap, (t, next(self._seq), kind, *payload))

    def rearm(self, n: int, now: float) -> None:
        """Arm node ``n``'s tick at its core's next deadline (just after ``now`` if it is due),
        unless an earlier one is armed (each node has at most one live tick)."""
        d = self.cores[n].next_deadline()
        t = d if d > now else now + 1e-9
        if t < self._tick_at[n]:
            self._tick_at[n] = t
            heapq.heappush(self._heap, (t, next(self._seq), TICK, n))

    # ------------------------------------------------------------------ what the subclass does

    def execute(self, n: int, effects: list[Any], now: float) -> None:
        """Carry out node ``n``'s effects at ``now``."""
        raise NotImplementedError

    def make_core(self, i: int, now: float, epoch_base: int = 0) -> NodeCore:
        """Node ``i``'s core, started at ``now`` (a restart's epochs above ``epoch_base``)."""
        raise NotImplementedError

    def restart_engine(self, n: int, now: float, saved: bool) -> None:
        """Node ``n``'s machine came back: its engine restarts warm from its disk tier, and its
        new core is told what the engine holds."""
        raise NotImplementedError

    def stop_engine(self, n: int) -> None:
        """Node ``n``'s machine went away: its engine's runs and queue are forgotten."""
        raise NotImplementedError

    def end_orphaned(self, i: int, now: float) -> bool:
        """End request ``i`` as orphaned (its entry node went away); False if it had ended."""
        raise NotImplementedError

    def check_invariants(self) -> None:
        raise NotImplementedError

    def _start(self) -> None:
        raise NotImplementedError

    def _lost(self, now: float) -> None:
        raise NotImplementedError

    def _deliver(self, n: int, event: Any, now: float) -> None:
        raise NotImplementedError

    def _gossip(self, item: tuple[Any, ...], now: float) -> None:
        raise NotImplementedError

    def _step(self, n: int, epoch: int, now: float) -> None:
        raise NotImplementedError

    def _arrive(self, i: int, now: float) -> None:
        raise NotImplementedError

    def _sync(self, responder: int, requester: int, request: Any, now: float) -> None:
        raise NotImplementedError

    def _relay(self, item: tuple[Any, ...], now: float) -> None:
        raise NotImplementedError

    def _pulled(self, n: int, job: Any, now: float) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ the loop

    def _run(self) -> Self:
        # The run allocates millions of short-lived objects over a heap of long-lived ones (the
        # workload, the tables, the cores' indexes): the collector's default pace scans that
        # heap again and again for nothing (about 5% of a 64-node run's CPU). Objects made
        # before the loop are frozen (never scanned), and the youngest generation is collected
        # less often; both restored after. Collection never changes what the run decides: no
        # decision reads an object's lifetime.
        thresholds = gc.get_threshold()
        freeze = gc.get_freeze_count() == 0  # (a caller's own frozen objects: left as they are)
        if freeze:
            gc.freeze()
        gc.set_threshold(max(thresholds[0], GC_YOUNG_THRESHOLD), *thresholds[1:])
        try:
            return self._loop()
        finally:
            gc.set_threshold(*thresholds)
            if freeze:
                gc.unfreeze()

    def _loop(self) -> Self:
        started = time.perf_counter()
        cfg = self.config
        cores = self.cores
        self._start()

        heap = self._heap
        pop = heapq.heappop
        tick_at = self._tick_at
        idle_since = -1.0
        patience = cfg.first_token_timeout_s + cfg.sync_timeout_s + 3 * cfg.announce_interval_s
        total = self.total
        events = 0
        # With churn, orphaned requests may end while peers still serve them (a cancel on its
        # way): run on until no node holds anything.
        while self.completed < total or self.churn is not None and self.churn.held():
            if not heap:
                raise SimulationError("the event heap ran dry with requests outstanding")
            item = pop(heap)
            now = item[0]
            kind = item[2]
            events += 1
            if kind == TICK:
                node = item[3]
                if tick_at[node] != now:
                    continue  # superseded by an earlier tick
                tick_at[node] = _INF
                self.now = now
                effects = cores[node].tick(now)
                if effects:
                    self.execute(node, effects, now)
                self.rearm(node, now)
                if self._live_events == 0:
                    if idle_since < 0:
                        idle_since = now
                    elif now - idle_since > patience:
                        self._lost(now)
                continue
            if kind == CHURN:
                self.churn.fire(item[3], item[4], now)  # type: ignore[union-attr]
                continue
            if kind == MESH_BEAT:
                self.mesh.heartbeat(item[3], now)  # type: ignore[union-attr]
                continue
            self._live_events -= 1
            idle_since = -1.0
            self.now = now
            if kind == NODE:
                self._deliver(item[3], item[4], now)
            elif kind == GOSSIP:
                self._gossip(item, now)
            elif kind == STEP:
                self._step(item[3], item[4], now)
            elif kind == ARRIVAL:
                self._arrive(item[3], now)
            elif kind == SYNC:
                self._sync(item[3], item[4], item[5], now)
            elif kind == RELAY:
                self._relay(item, now)
            elif kind == MESH:
                self.mesh.fire(item[3], item[4], item[5], item[6], now)  # type: ignore[union-attr]
            elif kind == PULL:
                self._pulled(item[3], item[4], now)
        self.events = events
        self.wall_s = time.perf_counter() - started
        if self.check:
            self.check_invariants()
        return self


__all__ = [
    "ARRIVAL",
    "CHURN",
    "GOSSIP",
    "MESH",
    "MESH_BEAT",
    "NODE",
    "PULL",
    "RELAY",
    "STEP",
    "SYNC",
    "TICK",
    "ChurnHooks",
    "MeshHooks",
    "SimCore",
    "SimKernel",
    "SimulationError",
]

