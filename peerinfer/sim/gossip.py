"""Gossip as gossipsub spreads it: a mesh of degree D, hops, duplicates, IHAVE/IWANT repair.

The simulator's default gossip is a direct broadcast (every announcement reaches every node
one link delay after it was published), which is what the real node's loopback measurements
match for small swarms. ``SimConfig(gossip="mesh")`` replaces it with this model of gossipsub
(v1.0 mesh routing on one topic, the real node's settings: ``peerinfer.net.gossip``):

Mesh
    Every node keeps a *mesh* of about ``D`` peers (``mesh_degree``, 6), symmetric (a GRAFT is
    accepted by its peer). It is built at the start by each node grafting random peers until it
    has ``D``; at every *heartbeat* (``mesh_heartbeat_s``, 1 s, each node at its own phase) a
    node drops mesh peers that are gone (churn), grafts random peers while it has fewer than
    ``D_lo = D - 2`` (up to ``D``), and prunes random ones while it has more than
    ``D_hi = 2 D`` (down to ``D``).
Eager push
    A node publishes an announcement to its mesh peers. A node receiving one for the first time
    hands it to its core and forwards it to its mesh peers except the one it came from and its
    publisher; every copy after the first is a *duplicate* (counted, dropped). Each hop costs
    the pair's link delay; each transmission is lost with probability ``gossip_loss``.
Lazy repair
    Each node keeps the ids of the messages it saw in its last 3 heartbeats (gossipsub's
    ``history_gossip``). At each heartbeat it sends IHAVE with those ids to ``D_lazy = D``
    random peers outside its mesh; a peer that lacks some answers IWANT, and gets them in full.
    IHAVE, IWANT and the repaired copies are transmissions like any other (delayed, lossy).
    What is still missing after that is the anti-entropy's job (the core's pulls), as on the
    real node.

Bytes: an announcement costs its encoded length plus ``RPC_OVERHEAD_BYTES`` per transmission;
IHAVE and IWANT cost ``RPC_OVERHEAD_BYTES`` plus ``MESSAGE_ID_BYTES`` per id (a gossipsub
message id is the publisher's peer id and a sequence number). GRAFT/PRUNE and the subscription
messages are not counted (a few per node per minute). Not modelled: flood publishing, peer
scoring, the fanout of non-subscribers, opportunistic grafting.

Reported (``summary()``): deliveries, duplicates per delivery, transmissions and losses,
deliveries repaired by IWANT (or forwarded on from a repaired copy), the delay from publication to delivery (mean, p50, p99, max) and
by hop count, the share of (message, node) pairs delivered, and bytes per node per second.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from peerinfer.core.messages import Announce, encode
from peerinfer.core.node import AnnounceReceived
from peerinfer.sim.kernel import MESH, MESH_BEAT, SimKernel

#: Protobuf RPC framing of one gossipsub frame (length prefix, RPC and message headers,
#: topic, signature fields are not sent: the announcement is the node's own signed payload).
RPC_OVERHEAD_BYTES = 16
#: A message id: the publisher's peer id (38 bytes, binary) and an 8-byte sequence number.
MESSAGE_ID_BYTES = 46
#: Heartbeats of message ids announced in IHAVE (gossipsub's history_gossip).
HISTORY_GOSSIP = 3
#: Message ids are forgotten this long after publication (gossipsub's seen cache, ~2 min).
SEEN_TTL_S = 120.0
#: Messages published this close to the end of the run are left out of the coverage.
_COVERAGE_MARGIN_S = 2.0

_MSG, _IHAVE, _IWANT = range(3)


@dataclass(slots=True)
class _Message:
    sender: int
    event: AnnounceReceived
    size: int
    published_at: float
    #: nodes that were up when it was published (the coverage's denominator)
    audience: int
    delivered: int = 0


@dataclass(slots=True)
class _NodeState:
    mesh: set[int] = field(default_factory=set)
    seen: set[int] = field(default_factory=set)
    #: ids seen in the last HISTORY_GOSSIP heartbeats, newest window first
    windows: deque[list[int]] = field(default_factory=lambda: deque([[]], maxlen=HISTORY_GOSSIP))
    bytes_sent: int = 0


class Mesh:
    """The gossipsub model of one run; the simulator calls ``publish`` and ``fire``."""

    def __init__(self, sim: SimKernel) -> None:
        self.sim = sim
        cfg = sim.config
        self.d = cfg.mesh_degree
        self.d_lo = max(1, self.d - 2)
        self.d_hi = 2 * self.d
        self.d_lazy = self.d
        self.heartbeat_s = cfg.mesh_heartbeat_s
        self.loss = cfg.gossip_loss
        self._rng = random.Random(f"{cfg.seed}:mesh")
        self._loss_rng = random.Random(f"{cfg.seed}:mesh:loss")
        self.nodes = [_NodeState() for _ in range(sim.slots)]
        self.messages: dict[int, _Message] = {}
        self._order: deque[int] = deque()  # message ids by publication time
        self._next_id = 0
        # figures
        self.published = 0
        self.deliveries = 0
        self.duplicates = 0
        self.transmissions = 0
        self.lost = 0
        self.repaired = 0
        self.data_bytes = 0
        self.control_bytes = 0
        self.delays: list[float] = []
        self.by_hops: dict[int, list[float]] = {}
        self._covered = 0
        self._audience = 0
        #: nodes whose heartbeat is scheduled (a chain ends at the first beat after it went)
        self._beating: set[int] = set()

    # ------------------------------------------------------------ membership

    def _up(self, n: int) -> bool:
        churn = self.sim.churn
        return churn is None or churn.up(n)

    def _up_nodes(self) -> list[int]:
        return [n for n in range(self.sim.slots) if self._up(n)]

    def _graft(self, n: int, up: list[int], target: int) -> None:
        mesh = self.nodes[n].mesh
        others = [p for p in up if p != n and p not in mesh]
        self._rng.shuffle(others)
        for p in others[: max(0, target - len(mesh))]:
            mesh.add(p)
            self.nodes[p].mesh.add(n)

    def start(self) -> None:
        up = self._up_nodes()
        for n in up:
            self._graft(n, up, self.d)
        for n in up:
            self._beating.add(n)
            self.schedule_heartbeat(n, self._rng.uniform(0.0, self.heartbeat_s))

    def joined(self, n: int, now: float) -> None:
        """A newcomer (churn), or a machine back (a restart: its mesh and the ids it saw start
        over), grafts its mesh and starts its heartbeat, unless its heartbeat from before it
        went is still scheduled (it went and came back between two beats): that one goes on."""
        for state in self.nodes:  # the others' links to it broke when it went
            state.mesh.discard(n)
        self.nodes[n] = _NodeState(bytes_sent=self.nodes[n].bytes_sent)
        self._graft(n, self._up_nodes(), self.d)
        if n not in self._beating:
            self._beating.add(n)
            self.schedule_heartbeat(n, now + self._rng.uniform(0.0, self.heartbeat_s))

    def schedule_heartbeat(self, n: int, t: float) -> None:
        # Not a "live" event: heartbeats never keep a finished run going.
        self.sim.push_background(t, MESH_BEAT, n)

    # ------------------------------------------------------------ sending

    def _send(self, src: int, dst: int, kind: int, payload: Any, size: int, now: float) -> None:
        self.transmissions += 1
        self.nodes[src].bytes_sent += size
        if kind == _MSG:
            self.data_bytes += size
        else:
            self.control_bytes += size
        self.sim.announce_bytes += size
        if self.loss and self._loss_rng.random() < self.loss:
            self.lost += 1
            self.sim.announces_lost += 1
            return
        self.sim.push(now + self.sim.delay[src][dst], MESH, kind, src, dst, payload)

    def publish(self, n: int, announce: Announce, now: float) -> None:
        """Node ``n`` publishes ``announce``: to its mesh peers."""
        sim = self.sim
        mid = self._next_id
        self._next_id += 1
        size = len(encode(announce)) + RPC_OVERHEAD_BYTES
        audience = sum(1 for k in range(sim.slots) if k != n and self._up(k))
        msg = _Message(n, AnnounceReceived(sim.peer_ids[n], announce), size, now, audience)
        self.messages[mid] = msg
        self._order.append(mid)
        self.published += 1
        sim.announces += 1
        state = self.nodes[n]
        state.seen.add(mid)
        state.windows[0].append(mid)
        for p in sorted(state.mesh):
            self._send(n, p, _MSG, (mid, 1), size, now)

    # ------------------------------------------------------------ receiving

    def fire(self, kind: int, src: int, dst: int, payload: Any, now: float) -> None:
        if not self._up(dst):
            return  # the machine is off: the copy vanishes
        if kind == _MSG:
            self._receive(src, dst, payload[0], payload[1], now)
        elif kind == _IHAVE:
            seen = self.nodes[dst].seen
            wanted = [m for m in payload if m not in seen and m in self.messages]
            if wanted:
                size = RPC_OVERHEAD_BYTES + MESSAGE_ID_BYTES * len(wanted)
                self._send(dst, src, _IWANT, wanted, size, now)
        else:  # IWANT: send the full messages still cached
            for mid in payload:
                msg = self.messages.get(mid)
                if msg is not None:
                    self._send(dst, src, _MSG, (mid, 0), msg.size, now)

    def _receive(self, src: int, dst: int, mid: int, hops: int, now: float) -> None:
        msg = self.messages.get(mid)
        if msg is None:
            return  # forgotten (older than the seen cache): dropped
        state = self.nodes[dst]
        if mid in state.seen:
            self.duplicates += 1
            return
        state.seen.add(mid)
        state.windows[0].append(mid)
        msg.delivered += 1
        self.deliveries += 1
        self.sim.announce_deliveries += 1
        delay = now - msg.published_at
        self.delays.append(delay)
        if hops == 0:
            self.repaired += 1
        else:
            self.by_hops.setdefault(hops, []).append(delay)
        sim = self.sim
        effects = sim.cores[dst].handle(msg.event, now)
        if effects:
            sim.execute(dst, effects, now)
        # Forward along the mesh (a repaired copy too: gossipsub forwards what it validated).
        nxt = hops + 1 if hops else 0
        for p in sorted(state.mesh):
            if p != src and p != msg.sender:
                self._send(dst, p, _MSG, (mid, nxt), msg.size, now)

    # ------------------------------------------------------------ heartbeat

    def heartbeat(self, n: int, now: float) -> None:
        if not self._up(n):
            self._beating.discard(n)
            return  # gone: no more heartbeats
        state = self.nodes[n]
        up = self._up_nodes()
        for p in [p for p in state.mesh if not self._up(p)]:
            state.mesh.discard(p)
        if len(state.mesh) < self.d_lo:
            self._graft(n, up, self.d)
        elif len(state.mesh) > self.d_hi:
            extra = sorted(state.mesh)
            self._rng.shuffle(extra)
            for p in extra[: len(state.mesh) - self.d]:
                state.mesh.discard(p)
                self.nodes[p].mesh.discard(n)
        ids = [m for window in state.windows for m in window if m in self.messages]
        if ids:
            lazy = [p for p in up if p != n and p not in state.mesh]
            self._rng.shuffle(lazy)
            size = RPC_OVERHEAD_BYTES + MESSAGE_ID_BYTES * len(ids)
            for p in lazy[: self.d_lazy]:
                self._send(n, p, _IHAVE, ids, size, now)
        state.windows.appendleft([])
        self._forget(now)
        self.schedule_heartbeat(n, now + self.heartbeat_s)

    def _forget(self, now: float) -> None:
        """Drop messages older than the seen cache, and count their coverage."""
        order = self._order
        while order and self.messages[order[0]].published_at < now - SEEN_TTL_S:
            mid = order.popleft()
            msg = self.messages.pop(mid)
            self._covered += msg.delivered
            self._audience += msg.audience
            for state in self.nodes:
                state.seen.discard(mid)

    # ------------------------------------------------------------ figures

    def summary(self, makespan: float) -> dict[str, Any]:
        covered, audience = self._covered, self._audience
        for msg in self.messages.values():
            if msg.published_at <= makespan - _COVERAGE_MARGIN_S:
                covered += msg.delivered
                audience += msg.audience
        delays = sorted(self.delays)

        def pct(q: float) -> float | None:
            if not delays:
                return None
            return round(delays[min(len(delays) - 1, int(q / 100 * len(delays)))], 6)

        ever_up = self.sim.config.nodes + (len(self.sim.churn.joined_at) if self.sim.churn else 0)
        return {
            "degree": self.d,
            "published": self.published,
            "deliveries": self.deliveries,
            "coverage": round(covered / audience, 6) if audience else None,
            "duplicates_per_delivery": round(self.duplicates / self.deliveries, 3) if self.deliveries else None,
            "transmissions": self.transmissions,
            "lost": self.lost,
            "repaired_by_iwant": self.repaired,
            "delay_mean_s": round(sum(delays) / len(delays), 6) if delays else None,
            "delay_p50_s": pct(50),
            "delay_p99_s": pct(99),
            "delay_max_s": round(delays[-1], 6) if delays else None,
            "delay_by_hops_s": {
                str(h): round(sum(v) / len(v), 6) for h, v in sorted(self.by_hops.items())
            },
            "hops_mean": round(
                sum(h * len(v) for h, v in self.by_hops.items())
                / max(1, sum(len(v) for v in self.by_hops.values())),
                3,
            ),
            "data_bytes": self.data_bytes,
            "control_bytes": self.control_bytes,
            "bytes_per_node_per_s": round(
                (self.data_bytes + self.control_bytes) / ever_up / makespan, 1
            ) if makespan else None,
        }


__all__ = ["MESSAGE_ID_BYTES", "RPC_OVERHEAD_BYTES", "Mesh"]
