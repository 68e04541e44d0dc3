"""Churn in the simulator: nodes join, leave gracefully and crash while the swarm serves.

Theory of operation
-------------------
The simulator's node table has a *slot* per node that is ever part of the run: the starting
``nodes``, then room for the newcomers (``join_capacity``). A slot is *pending* (not joined
yet), *live*, *draining* (leaving) or *gone*. A pending or gone slot holds a ``GoneCore``: it
takes every event and does nothing, so whatever reaches a machine that is off (gossip, a relay,
a cancel) vanishes without the delivery code knowing about churn.

Churn events come from a Poisson process of ``(crash_rate + leave_rate + join_rate) x live
nodes`` per hour, each of the three kinds in proportion to its rate, the node drawn among the
live ones (a crash or leave never takes the last two). ``Simulation(churn_schedule=...)`` (tests)
gives the events instead: ``(time, kind, slot)``.

Everything a node decides stays its ``NodeCore``'s; this module is the part of the *shell* that
a machine going away or coming up changes, done as the real shell (``peerinfer.node``) does it:

* **Join.** A new ``NodeCore`` starts in the slot. It dials the live nodes (the bootstrap and
  peer exchange are not simulated: it learns all of them), and each side pings the other: after
  one round trip both hold a ``PeerSeen`` with the measured round trip and are members of each
  other. From then on the newcomer takes the others' announcements; its empty replicas start
  at epoch 0, so each first announcement asks for a pull and the core's Merkle reconciliation
  pulls every digest, exactly as a real newcomer does. The others take the newcomer's
  announcements and route to it as soon as their policy prefers it. Recorded: when it joined
  and when it was first forwarded a request.
* **Restart (runs with a disk tier).** A machine that went away comes back: there a join is
  the machine gone longest coming back (a newcomer joins only when none is gone), in its slot,
  with its peer id, its links and its users. Its process is new: a new ``NodeCore`` (its epochs
  above those of the core before, as the runtime's epoch base puts them), joined as a newcomer
  is; its engine's memory is lost and its disk tier kept, as a real node's files are
  (``SimulatedEngine.restart``; a leave first saved its memory to the tier, as the runtime's
  shutdown does, a crash did not). The new core is then told what the engine holds, exactly as
  the runtime tells it at start: ``CacheChanged(added=engine.cached_block_hashes())`` (the disk
  tier's blocks), then the tier's ``Load.disk`` figure (``Simulation.restart_engine``). So its
  digest and its first hits come from its disk, and every decision about them is the core's.
  Its counters are summed over its cores (``Churn.statistics``). Without a disk tier a join is
  always a newcomer, as before (a restart there would be a newcomer under an old name).
* **Leave (graceful).** As the real node's ``shutdown``: its users go elsewhere (new arrivals
  enter at live nodes), forwarded requests reaching it are refused ("shutdown", which the origin
  reads as ``unavailable`` and fails over from), and it keeps serving what it holds, up to the
  node's shutdown grace; then it is gone (as after a crash in ``reset`` mode, with nothing
  left in flight).
* **Crash.** ``reset`` (the process died; its machine resets the connections): every stream
  to it fails one link delay later, so each origin of a request it was serving gets
  ``ForwardFailed(unavailable)`` with the tokens already relayed, the peer serving one of *its*
  requests gets a ``Cancel``, a request forwarded to it later fails after a round trip, and a
  ping to it fails after a round trip (``PeerLost``). ``silent`` (the machine vanished): nothing
  answers; origins find out from the first-token deadline or from a ping failing after the
  shell's ping timeout (``PeerLost``), and the core's own liveness drops it. Either way the
  failover is the core's: ``ForwardFailed``/``PeerLost`` are its existing inputs. A pull sent
  to a machine that is off gets no answer: the requester's pull deadline ends it (simplified:
  in ``reset`` mode the real shell's request would fail sooner).

Requests lost with their entry node (its own users' requests in flight when it crashes: the
user's client was on the machine that died) are *orphaned*: ended, counted apart and left out of
TTFT; they are not the swarm's to fail over. Every other request must be served (``lost`` =
requests refused or failed = 0).
"""

from __future__ import annotations

import math
import random
from dataclasses import fields, replace
from typing import Any

from peerinfer.core.node import (
    Cancel,
    ClientRequest,
    ForwardFailed,
    NodeCore,
    NodeStatistics,
    PeerLost,
    PeerSeen,
    Phase,
)
from peerinfer.errors import error_kind
from peerinfer.sim.kernel import CHURN, NODE, SimKernel
from peerinfer.types import RequestId

#: How long the shell's ping waits for an answer (peerinfer.node.peers: host.ping timeout).
PING_TIMEOUT_S = 2.0
#: The real node's shutdown grace (peerinfer.node.options.SHUTDOWN_GRACE_S): in-flight work
#: may finish for this long after a leave begins.
LEAVE_GRACE_S = 30.0
#: How often a draining node is looked at to see whether it holds nothing more.
_DRAIN_POLL_S = 0.25

PENDING, LIVE, DRAINING, GONE = range(4)

_ZERO_STATS = NodeStatistics(**dict.fromkeys((f.name for f in fields(NodeStatistics)), 0))


class GoneCore:
    """The core of a machine that is off (not joined yet, or gone): takes every event, does
    nothing. ``core`` is the one it ran before it went away (its counters are kept)."""

    def __init__(self, core: NodeCore | None = None) -> None:
        self.core = core

    def handle(self, event: Any, now: float) -> list[Any]:
        return []

    def tick(self, now: float) -> list[Any]:
        return []

    def next_deadline(self) -> float:
        return math.inf

    def pending_requests(self) -> list[RequestId]:
        return []

    def statistics(self) -> NodeStatistics:
        if self.core is None:
            return _ZERO_STATS
        # What it held went away with it (failed over at the origins, or orphaned): it holds
        # nothing now, and completed only what it completed before.
        return replace(self.core.statistics(), queued=0, running=0)


def join_capacity(config: Any, scheduled_joins: int) -> int:
    """Slots for newcomers: the scheduled joins, or for random churn about three times the
    expected joins over the run's expected length (arrivals at ``rate`` per starting node per
    second), plus 4. A join beyond it is skipped and counted (``joins_skipped``)."""
    if scheduled_joins:
        return scheduled_joins
    if not config.join_rate:
        return 0
    horizon_s = config.requests / (config.rate * config.nodes) + 120.0
    expected = config.join_rate / 3600.0 * config.nodes * horizon_s
    return int(3 * expected) + 4


class Churn:
    """The churn of one run (see the module docstring); ``sim`` calls its hooks."""

    def __init__(self, sim: SimKernel, schedule: list[tuple[float, str, int]] | None) -> None:
        self.sim = sim
        cfg = sim.config
        self.state = [LIVE] * cfg.nodes + [PENDING] * (sim.slots - cfg.nodes)
        self._next_slot = cfg.nodes
        self._schedule = schedule
        self._rng = random.Random(f"{cfg.seed}:churn")
        rate = cfg.crash_rate + cfg.leave_rate + cfg.join_rate
        self._rate_per_node_s = rate / 3600.0
        self._kinds = ("crash", "leave", "join")
        self._weights = (cfg.crash_rate, cfg.leave_rate, cfg.join_rate)
        self._mode = cfg.crash_mode
        #: figures
        self.crashes = 0
        self.leaves = 0
        self.joins = 0
        self.joins_skipped = 0
        self.orphaned = 0
        self.joined_at: dict[int, float] = {}
        self.gone_at: dict[int, float] = {}
        self.first_routed_at: dict[int, float] = {}
        self._drain_until: dict[int, float] = {}
        #: machines brought back (runs with a disk tier): when, and whether each had stopped
        #: gracefully (saving its memory to disk) until it comes back
        self.restarts = 0
        self.restarted_at: dict[int, list[float]] = {}
        self._saved: dict[int, bool] = {}
        #: the counters of a restarted machine's earlier cores (``statistics``)
        self._earlier: dict[int, NodeStatistics] = {}
        self._restarting = cfg.disk_cache_tokens > 0

    # ------------------------------------------------------------ state

    def live(self, n: int) -> bool:
        return self.state[n] == LIVE

    def up(self, n: int) -> bool:
        """The machine is on (live or draining)."""
        s = self.state[n]
        return s == LIVE or s == DRAINING

    def held(self) -> bool:
        """Whether a machine that is on still holds a request."""
        cores = self.sim.cores
        return any(cores[n].pending_requests() for n, s in enumerate(self.state) if s in (LIVE, DRAINING))

    def live_nodes(self) -> list[int]:
        return [n for n, s in enumerate(self.state) if s == LIVE]

    def entry_node(self, wanted: int, rng: random.Random) -> int:
        """Where a user's request enters: ``wanted`` if it is live, else a live node drawn
        with ``rng`` (its user moved; ``wanted`` < 0: any live node)."""
        if wanted >= 0 and self.state[wanted] == LIVE:
            return wanted
        live = self.live_nodes()
        return live[rng.randrange(len(live))]

    # ------------------------------------------------------------ events

    def start(self) -> None:
        if self._schedule is not None:
            for t, kind, slot in self._schedule:
                if kind not in self._kinds:
                    raise ValueError(f"unknown churn event {kind!r}")
                self._push(t, kind, slot if slot >= 0 else -2)  # -1 marks a random event
        elif self._rate_per_node_s > 0:
            self._push_next(0.0)

    def _push(self, t: float, action: str, node: int) -> None:
        # Not a "live" event: churn never keeps a finished run going.
        self.sim.push_background(t, CHURN, action, node)

    def _push_next(self, now: float) -> None:
        live = len(self.live_nodes())
        if live == 0:
            return
        t = now + self._rng.expovariate(self._rate_per_node_s * live)
        kind = self._rng.choices(self._kinds, weights=self._weights)[0]
        self._push(t, kind, -1)

    def fire(self, action: str, node: int, now: float) -> None:
        sim = self.sim
        if action == "drain":
            self._drain_check(node, now)
            return
        if node == -1:  # a random event: draw its node now, and the next event
            self._push_next(now)
            if action != "join":
                live = self.live_nodes()
                if len(live) <= 2:
                    return
                node = live[self._rng.randrange(len(live))]
        if action == "join":
            self._join(now)
        elif action == "crash" and self.up(node):
            self._crash(node, now, self._mode)
        elif action == "leave" and self.live(node):
            self.leaves += 1
            self.state[node] = DRAINING
            self._drain_until[node] = now + LEAVE_GRACE_S
            self._drain_check(node, now)
        sim.now = now

    def _drain_check(self, n: int, now: float) -> None:
        if self.state[n] != DRAINING:
            return
        if not self.sim.cores[n].pending_requests() or now >= self._drain_until[n]:
            self._crash(n, now, "reset", crash=False)
        else:
            self._push(now + _DRAIN_POLL_S, "drain", n)

    # ------------------------------------------------------------ join

    def _join(self, now: float) -> None:
        sim = self.sim
        back = self._returning()
        epoch_base = 0
        if back is not None:
            # The machine that went away first comes back, with its peer id and its disk.
            k = back
            self.restarts += 1
            self.restarted_at.setdefault(k, []).append(now)
            old = sim.cores[k]
            self._earlier[k] = self.statistics(k)
            if isinstance(old, GoneCore) and isinstance(old.core, NodeCore):
                # Above every epoch it announced before, as the runtime's epoch base is.
                epoch_base = old.core.local.epoch
        else:
            k = self._next_slot
            if k >= sim.slots:
                self.joins_skipped += 1
                return
            self._next_slot += 1
            self.joins += 1
            self.joined_at[k] = now
        self.state[k] = LIVE
        sim.cores[k] = sim.make_core(k, now, epoch_base)
        # It dials every live node; each side's ping answers after one round trip.
        for j, s in enumerate(self.state):
            if j != k and s == LIVE:
                rtt = 2 * sim.delay[k][j]
                sim.push(now + rtt, NODE, k, PeerSeen(sim.peer_ids[j], rtt_s=rtt))
                sim.push(now + rtt, NODE, j, PeerSeen(sim.peer_ids[k], rtt_s=rtt))
        if sim.mesh is not None:
            sim.mesh.joined(k, now)
        if back is not None:
            sim.restart_engine(k, now, self._saved.pop(k))
        sim.execute(k, sim.cores[k].tick(now), now)
        sim.rearm(k, now)

    def _returning(self) -> int | None:
        """With a disk tier, a join is the machine gone longest coming back (a restart: its
        disk tier survived, ``Simulation.restart_engine``); None: a newcomer joins (every run
        without a disk tier, or no machine is gone)."""
        if not self._restarting:
            return None
        gone = [n for n, s in enumerate(self.state) if s == GONE]
        return min(gone, key=lambda n: (self.gone_at[n], n)) if gone else None

    def note_delivery(self, n: int, event: Any, now: float) -> None:
        """A newcomer's milestones (called for events reaching newcomer slots)."""
        if type(event) is ClientRequest and event.forwarded and n not in self.first_routed_at:
            self.first_routed_at[n] = now

    # ------------------------------------------------------------ the machine goes away

    def _crash(self, x: int, now: float, mode: str, *, crash: bool = True) -> None:
        """``x`` goes away (a crash, or the end of a leave): its streams fail (``reset``) or
        go silent, its own users' requests in flight are orphaned, its engine stops."""
        sim = self.sim
        core = sim.cores[x]
        assert isinstance(core, NodeCore)
        if crash:
            self.crashes += 1
        self.state[x] = GONE
        self.gone_at[x] = now
        self._saved[x] = not crash  # a leave's shutdown saves its memory to disk; a crash not
        for rid in core.pending_requests():
            i = sim.rid_index[rid]
            origin = sim.origin[i]
            if origin == x:
                target = sim.target[i]
                forwarded = core.phase(rid) in (Phase.FORWARDED, Phase.RELAYING)
                if mode == "reset" and forwarded and target not in (-1, x):
                    # The serving peer's stream to the origin breaks: its door cancels.
                    sim.push(now + sim.delay[x][target], NODE, target, Cancel(rid))
                self._orphan(i, now)
            elif mode == "reset":
                generated = self._relayed(x, rid, i)
                sim.push(
                    now + sim.delay[x][origin],
                    NODE,
                    origin,
                    ForwardFailed(rid, sim.peer_ids[x], "unavailable", generated),
                )
        sim.stop_engine(x)
        sim.cores[x] = GoneCore(core)

    def _relayed(self, x: int, rid: RequestId, i: int) -> tuple[int, ...]:
        """Token ids the origin already relayed of ``rid``, running on ``x``: as many as
        ``x``'s batch produced, once the first token reached the origin (the ids are stand-ins:
        the simulated engine's output has no content)."""
        sim = self.sim
        if sim.first[i] < 0:
            return ()
        for job in sim.batches[x].jobs:
            if job.key == rid:
                return (0,) * max(1, job.produced)
        return (0,)

    def _orphan(self, i: int, now: float) -> None:
        if self.sim.end_orphaned(i, now):
            self.orphaned += 1

    def deliver_to_gone(self, n: int, event: Any, now: float) -> None:
        """An event reached a machine that is off, or is shutting down (``n`` draining: only
        forwarded requests are refused, as the door refuses them; the caller delivers the
        rest)."""
        sim = self.sim
        if type(event) is ClientRequest and event.forwarded:
            draining = self.state[n] == DRAINING
            if draining or self._mode == "reset":
                # Refused ("shutdown", read as the error table says, as the node's forwarding
                # reads it) or the connection refused (a stream that fails: "unavailable"):
                # the origin fails over.
                reason = error_kind("shutdown").forward_reason if draining else "unavailable"
                o = sim.index_of[event.origin] if event.origin is not None else -1
                if o >= 0:
                    sim.enqueued[n].pop(event.request_id, None)
                    sim.push(
                        now + sim.delay[n][o],
                        NODE,
                        o,
                        ForwardFailed(event.request_id, sim.peer_ids[n], reason),
                    )

    def ping_unanswered(self, n: int, p: int, now: float) -> None:
        """``n`` pinged ``p``, which is off: the ping fails (refused after a round trip in
        ``reset`` mode, after the shell's ping timeout when silent)."""
        sim = self.sim
        wait = 2 * sim.delay[n][p] if self._mode == "reset" else PING_TIMEOUT_S
        sim.push(now + wait, NODE, n, PeerLost(sim.peer_ids[p]))

    # ------------------------------------------------------------ figures

    def statistics(self, n: int) -> NodeStatistics:
        """Node ``n``'s core counters, summed over every core its machine ran (a restart
        starts a new one)."""
        now = self.sim.cores[n].statistics()
        earlier = self._earlier.get(n)
        if earlier is None:
            return now
        return NodeStatistics(**{f.name: getattr(now, f.name) + getattr(earlier, f.name)
                                 for f in fields(NodeStatistics)})

    def summary(self) -> dict[str, Any]:
        sim = self.sim
        routed = [self.first_routed_at[k] - t for k, t in self.joined_at.items() if k in self.first_routed_at]
        served_by_newcomers = sum(sim.served[k] for k in self.joined_at)
        return {
            "crashes": self.crashes,
            "leaves": self.leaves,
            "joins": self.joins,
            "joins_skipped": self.joins_skipped,
            "orphaned": self.orphaned,
            "lost": sim.rejected,
            "live_at_end": len(self.live_nodes()),
            "newcomers_routed_to": len(routed),
            "newcomer_first_routed_s_mean": round(sum(routed) / len(routed), 3) if routed else None,
            "newcomer_first_routed_s_max": round(max(routed), 3) if routed else None,
            "served_by_newcomers": served_by_newcomers,
            **({"restarts": self.restarts} if self._restarting else {}),
        }


__all__ = ["GoneCore", "Churn", "join_capacity"]
