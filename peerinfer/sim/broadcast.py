"""Gossip as a direct broadcast, the simulator's default (``SimConfig(gossip="broadcast")``).

A ``Publish`` is encoded once (its length is the bytes per recipient) and reaches every other
node one link delay after it was published: the recipients of each sender are grouped by equal
delay, nearest first, and a group is handed the announcement together (one ``GOSSIP`` event per
group, ``Simulation._gossip``). Each delivery may be lost with probability ``gossip_loss`` (the
pulls then repair the replicas). Without loss, each group's announcements form a shared
``AnnounceRun`` (those that change nothing, and, once it has followers, those whose changes
keep its followers in step): the nodes that follow it (each core decides) are not handed
them, and read them from the run instead (``Simulation.share_runs``; the same decisions).
``peerinfer.sim.gossip`` is the alternative, gossipsub's mesh.
"""

from __future__ import annotations

import random
from typing import Any

from peerinfer.core.announcerun import RunHolders
from peerinfer.core.messages import Announce, encode
from peerinfer.core.node import AnnounceReceived, AnnounceRun
from peerinfer.sim.kernel import GOSSIP, SimKernel
from peerinfer.types import PeerId

__all__ = ["Broadcast"]


class Broadcast:
    """A run's direct broadcast; it adds to the kernel's anti-entropy figures (``announces``,
    ``announce_bytes``, ``announce_deliveries``, ``announces_lost``)."""

    def __init__(self, sim: SimKernel, n: int, *, share_runs: bool, index_runs: bool = True) -> None:
        """``n``: the run's node slots; ``share_runs``: hand unchanged announcements to their
        followers as one shared run; ``index_runs``: index the runs' sets by block for every
        node's routing (``RunHolders``; the same decisions)."""
        self.sim = sim
        self.share_runs = share_runs
        #: every run's set, indexed once per change for every node's routing
        self.run_holders = RunHolders() if index_runs else None
        self._loss_rng = random.Random(f"{sim.config.seed}:loss")
        self._loss = sim.config.gossip_loss
        delay = sim.delay
        # Gossip recipients of each sender, grouped by equal delay, nearest first.
        self._groups: list[list[tuple[float, list[int]]]] = []
        for s in range(n):
            by_delay: dict[float, list[int]] = {}
            for r in range(n):
                if r != s:
                    by_delay.setdefault(delay[s][r], []).append(r)
            self._groups.append(sorted(by_delay.items()))
        #: announcements with changes pushed onto a run with followers (``_shared_run``)
        self.changes_shared = 0
        # Per sender and group, the run of announcements the group shares (below).
        self._runs_of: list[list[AnnounceRun | None]] = [[None] * len(g) for g in self._groups]

    def publish(self, n: int, announce: Announce, now: float) -> None:
        """Node ``n`` publishes ``announce``: its first group's delivery is scheduled."""
        sim = self.sim
        size = len(encode(announce))
        recipients = sim.config.nodes - 1
        sim.announces += 1
        sim.announce_bytes += size * recipients
        sim.announce_deliveries += recipients
        if recipients:
            groups = self._groups[n]
            ev = AnnounceReceived(sim.peer_ids[n], announce)
            sim.push(now + groups[0][0], GOSSIP, n, ev, 0, now)

    def deliver(self, item: tuple[Any, ...], now: float) -> None:
        """A ``GOSSIP`` event: the announcement reaches one group, and the next is scheduled."""
        sim = self.sim
        _, _, _, s, ev, g, sent = item
        groups = self._groups[s]
        cores = sim.cores
        loss = self._loss
        recipients = groups[g][1]
        if not loss and self.share_runs:
            ev, recipients = self._shared_run(s, g, ev, recipients, now)
        for r in recipients:
            if loss and self._loss_rng.random() < loss:
                sim.announces_lost += 1
                continue
            effects = cores[r].handle(ev, now)
            if effects:
                sim.execute(r, effects, now)
        g += 1
        if g < len(groups):
            sim.push(sent + groups[g][0], GOSSIP, s, ev, g, sent)

    def _shared_run(
        self, s: int, g: int, ev: AnnounceReceived, recipients: list[int], now: float
    ) -> tuple[AnnounceReceived, list[int]]:
        """The group's shared run with ``ev`` in it, and the recipients that do not follow it
        (the followers take it from the run when they next read; ``AnnounceRun``). Lossless
        gossip only: a loss is drawn per recipient. An announcement with changes extends a run
        that has followers when its delta leads the run's set to the announced one
        (``AnnounceRun.advances``); the followers it would put over their replica allowance
        are handed it first, alone (they refuse it and leave the run, nothing else)."""
        a = ev.announce
        runs = self._runs_of[s]
        run = runs[g]
        over: list[PeerId] = []
        if run is not None and run.extends(a):
            run.push(a, now)
        elif run is not None and run.followers and (after := run.advances(a)) is not None:
            over = run.over_limit(a)
            if over:
                alone = AnnounceReceived(ev.sender, a)
                sim = self.sim
                cores = sim.cores
                index_of = sim.index_of
                for peer in over:
                    r = index_of[peer]
                    effects = cores[r].handle(alone, now)
                    if effects:
                        sim.execute(r, effects, now)
                    if peer in run.followers:  # (a core that stayed would be a bug)
                        raise AssertionError(f"{peer} follows a run over its allowance")
            run.push_changes(a, now, after)
            self.changes_shared += 1
        else:
            run = runs[g] = AnnounceRun(a, now, self.run_holders)
            return AnnounceReceived(ev.sender, a, run), recipients
        followers = run.followers
        if len(followers) == len(recipients):
            recipients = []  # every one follows (only the group's recipients can)
        elif followers or over:
            ids = self.sim.peer_ids
            handed = set(over)
            recipients = [r for r in recipients if ids[r] not in followers and ids[r] not in handed]
        return AnnounceReceived(ev.sender, a, run), recipients
