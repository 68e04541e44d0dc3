"""The oracle router: the upper bound of routing, for the simulator only.

A central router with exact, instant knowledge of the whole swarm: for every node, the prompt
tokens its engine's radix cache holds right now (not a digest replica, not a lagging
announcement), and its queue as it is right now, counting the forwarded requests still on
their way to it. It decides with the ``cost`` policy's estimate (``CostPolicy``, the same
arithmetic, hysteresis and speeds), so the gap between ``cost`` and ``oracle`` is what
peerinfer's partial, lagging, per-node view costs, and nothing else.

It is a ``RoutingPolicy`` that the simulator installs in each node's core (``policy
"oracle"``): every entry node asks the same omniscient router, which is what one central
router is, the link delay to the chosen node included. It reads the simulator's state, so it
exists only there: no real node can know this much.

What it does not see: nothing of the swarm is hidden from it, but it estimates like ``cost``
(the cost model's TTFT), so it is the bound of *knowledge*, not of the estimate. The peers it
weighs are every node of the swarm, whatever the core's own candidate list holds, except nodes
whose queue is full (they would refuse a forward as busy); a failover (rare: a first-token
timeout) may therefore pick the same node again. Churn is not supported (``SimConfig``
refuses ``oracle`` with churn).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from peerinfer.core.costmodel import CostModel
from peerinfer.core.messages import Load
from peerinfer.core.routing import (
    Candidate,
    CostPolicy,
    RouteDecision,
    RouteRequest,
    make_candidate,
)
from peerinfer.sim.config import ORACLE


class OracleRouter:
    """``choose`` with the swarm's exact state; ``sim`` is the running ``Simulation``."""

    name = ORACLE

    def __init__(self, sim: Any, node: int, costs: CostModel) -> None:
        self.sim = sim
        self.node = node
        self.cost = CostPolicy(costs)

    def exact_candidates(self, request: RouteRequest) -> list[Candidate]:
        """Every node of the swarm with its exact cached tokens for ``request`` and its exact
        queue (forwards in transit counted as queued), this node first."""
        sim = self.sim
        me = self.node
        cap = max(0, request.prompt_tokens - 1)
        bs = sim.hasher.block_size
        chain = request.chain
        delay = sim.delay[me]
        max_queue = sim.config.max_queue
        out: list[Candidate] = []
        for k in [me, *range(sim.config.nodes)]:
            if k == me and out:
                continue
            core = sim.cores[k]
            load: Load = core.load()
            queued = load.queued + sim.in_transit[k]
            if k != me and queued >= max_queue and load.running >= load.slots:
                continue  # it would refuse a forward as busy
            cached = sim.engines[k].cached
            blocks = 0
            for h in chain:
                if not cached(h):
                    break
                blocks += 1
            out.append(
                make_candidate(
                    sim.peer_ids[k],
                    k == me,
                    min(blocks * bs, cap),
                    replace(load, queued=queued) if queued != load.queued else load,
                    2 * delay[k],
                    0.0,
                )
            )
        return out

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], rng: random.Random
    ) -> RouteDecision:
        decision = self.cost.choose(request, self.exact_candidates(request), rng)
        # Exact queues: no herding to guard against, no refusal limit.
        return replace(decision, reason="oracle: " + decision.reason, max_outstanding=None)


__all__ = ["ORACLE", "OracleRouter"]
