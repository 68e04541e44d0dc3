"""The discrete-event simulator: many ``NodeCore`` objects driven in virtual time.

Theory of operation
-------------------
The simulator is a second *shell* around ``peerinfer.core.node.NodeCore``, next to the real
trio + libp2p one (``peerinfer.net``). Every node of the simulated swarm is a real ``NodeCore``
with its own ``random.Random`` (seeded from the run's seed and the node's index) and a real
simulated engine (``peerinfer.engine.simulated``: the same radix cache as the real engine, with
service times from the cost model). The simulator decides nothing: routing, anti-entropy,
admission, failover and liveness are the cores'; the simulator only *executes* their effects,
delaying every message by the link model, and feeds the resulting events back.

The kernel
    The event heap, virtual time, the nodes' ticks and the loop are ``peerinfer.sim.kernel``'s
    (``SimKernel``, with the table of event kinds); ``Simulation`` is the kernel that says what
    each event means. Churn and the gossipsub mesh extend a run through the kernel's public
    calls only.

How effects are executed
    ``Publish``: the announcement is gossiped to every other node (``peerinfer.sim.broadcast``:
    a direct broadcast, unchanged announcements shared as one run with ``share_runs``; or the
    mesh, below). ``SendSyncRequest``: delivered to the responder after the
    link delay; the response is ``answer_sync`` there, back after another delay; both are
    encoded to count bytes, one round trip each. ``Forward``: the request arrives at the peer
    as a ``ClientRequest(forwarded=True)``; the peer's own core admits it or rejects it as busy
    (the ``Reject`` travels back as ``ForwardFailed(reason="busy")``). ``RunLocal``: the node's
    engine *plans* the request (``plan`` matches and inserts the prompt in its radix cache and
    returns the cached and generated token counts); ``LocalStarted`` is reported at once, and
    the request joins the node's batch (``peerinfer.sim.batch``: up to ``slots`` requests run
    at once, each decode step's duration set by how many run, a joiner's prefill chunks
    interleaved with the others' steps, all by the cost model). The batch reports the first
    token and the end; the end reports ``LocalFinished`` with the cache changes accumulated
    since the node's previous report. ``CancelForward`` sends ``Cancel`` to the peer;
    ``CancelLocal`` takes the run out of the batch and reports ``LocalFinished(ok=False)``. ``PingPeer`` is answered with
    ``PeerSeen(rtt)`` one round trip later. ``DropPeer`` only counts. With ``config.pull``, a local decision's
    KV pull and a ``ProbeLink`` are ``peerinfer.sim.pulls``'s (transfers over links with a
    bandwidth; their measurements come back as ``TransferMeasured``).

The client's view
    A request's TTFT is from its arrival at its entry node to the first token reaching the
    client there (a forwarded request's first token travels back one link delay); its latency
    is to the end of the stream. Only the stream of the forward the origin currently relays
    counts (``target``): a late token from a peer the origin gave up on is dropped, as the real
    shell's relay drops it. Every request completes exactly once, or the run fails loudly.

What is simplified
    A forwarded request costs its link delay plus ``forward_overhead_ms`` (a real node opens a
    libp2p stream per forward). Gossip is a direct broadcast with the pair's link delay
    (``gossip="mesh"``: gossipsub's mesh, with hops, duplicates and IHAVE/IWANT repair,
    ``peerinfer.sim.gossip``); bytes count one copy per recipient. Each
    delivery of an announcement may be lost with probability ``gossip_loss`` (the pulls then
    repair the replicas); every other message is reliable and in order. Nodes do not fail,
    join or leave unless churn is asked for (``peerinfer.sim.churn``), and are all the same
    machine unless a mix is (``peerinfer.sim.mix``). The
    batch is the cost model's: every request of a node's batch holds the same decode step
    time, whatever its context length, and KV memory never limits admission (``slots`` does).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from peerinfer.core.digest import DeltaMemo
from peerinfer.core.messages import encode
from peerinfer.core.node import (
    CacheChanged,
    Cancel,
    CancelForward,
    CancelLocal,
    ClientRequest,
    DropPeer,
    Forward,
    ForwardFailed,
    ForwardFinished,
    ForwardFirstToken,
    LocalFinished,
    LocalStarted,
    NodeCore,
    PeerSeen,
    PingPeer,
    ProbeLink,
    Publish,
    Reject,
    RunLocal,
    SendSyncRequest,
    SyncResponseReceived,
)
from peerinfer.core.prefix import PrefixHasher
from peerinfer.errors import error_kind
from peerinfer.sim.batch import BatchJob, BatchNode
from peerinfer.sim.broadcast import Broadcast
from peerinfer.sim.churn import Churn, GoneCore, join_capacity
from peerinfer.sim.config import ORACLE, SimConfig, peer_name
from peerinfer.sim.gossip import Mesh
from peerinfer.sim.inputs import EngineLike, PlanLike, SimRequest
from peerinfer.sim.kernel import (
    ARRIVAL,
    NODE,
    PULL,
    RELAY,
    STEP,
    SYNC,
    SimCore,
    SimKernel,
    SimulationError,
)
from peerinfer.sim.mix import node_costs
from peerinfer.sim.oracle import OracleRouter
from peerinfer.sim.pulls import KvPulls
from peerinfer.types import BlockHash, RequestId


class Simulation(SimKernel):
    """One run: ``Simulation(config, requests, hasher, make_engine).run()`` returns itself.

    ``requests`` are served in order, request ``i`` being the ``i``-th to arrive (the list is
    cycled if shorter than ``config.requests``). ``make_engine(node_index)`` builds each node's
    engine; its block hashes must use ``hasher``. ``arrivals`` (tests) fixes each request's
    ``(time, entry node)`` instead of the Poisson or closed-loop arrivals; ``check`` verifies
    ``check_invariants`` at the end; ``probe_top`` samples, every ``share_stride`` arrivals,
    which nodes cache the shared prefix of the ``probe_top`` most frequent labels.
    ``churn_schedule`` (tests) fixes the churn events, ``(time, "crash" | "leave" | "join",
    slot)``, instead of the config's rates (``peerinfer.sim.churn``: the slots from
    ``config.nodes`` on are the newcomers, in join order; a join's slot is not read).

    The figures are attributes, indexed by request: ``arrival``, ``first`` (first token at the
    client), ``finish``, ``origin`` (entry node), ``server``, ``cached`` and ``prompt`` (tokens
    of the serving run), ``status`` (1 served, 2 rejected), ``forwards``; per node: ``served``,
    ``busy_s``, ``waits``; anti-entropy counters; ``cores`` and ``engines`` themselves.
    """

    #: NodeConfig fields set on every node beyond what the run's config says
    #: (``SimConfig.node_config``): tests and benchmarks compare ``lazy_announcements`` or
    #: ``route_among_holders`` off and on
    node_overrides: ClassVar[dict[str, Any]] = {}
    #: hand a group's unchanged announcements to the nodes that follow them as one shared run
    #: (``AnnounceRun``; the cores decide who follows); False: to every node, one call each
    share_runs = True
    #: let replicas that hold the same set share the result of applying an announcement's
    #: delta (one ``peerinfer.core.digest.DeltaMemo`` per run); False: each applies it itself
    share_deltas = True
    #: index the shared runs' sets by block (``peerinfer.core.announcerun.RunHolders``), so a
    #: node's route counts every run's depth along the prompt's chain from their masks
    #: (``RunHolders.walk``) instead of asking every peer; False: every peer (the same decisions)
    index_runs = True

    def __init__(
        self,
        config: SimConfig,
        requests: Sequence[SimRequest],
        hasher: PrefixHasher,
        make_engine: Callable[[int], EngineLike],
        *,
        arrivals: Sequence[tuple[float, int]] | None = None,
        check: bool = False,
        probe_top: int = 0,
        churn_schedule: Sequence[tuple[float, str, int]] | None = None,
    ) -> None:
        if config.requests and not requests:
            raise SimulationError("the workload is empty")
        if arrivals is not None and len(arrivals) < config.requests:
            raise SimulationError(f"{len(arrivals)} arrivals for {config.requests} requests")
        self._fixed_arrivals = arrivals
        #: handed to every core this run makes (``share_deltas``), dropped when the run ends
        self.delta_memo = DeltaMemo() if self.share_deltas else None
        self.config = config
        self.workload = requests
        self.hasher = hasher
        self.check = check
        seed = config.seed
        churning = config.churn or churn_schedule is not None
        joins = sum(1 for _, kind, _ in churn_schedule or () if kind == "join")
        # One slot per node ever in the run: the starting ones, then room for newcomers.
        n = self.slots = config.nodes + (join_capacity(config, joins) if churning else 0)
        super().__init__(n)
        self.peer_ids = [peer_name(i) for i in range(n)]
        self.index_of = {p: i for i, p in enumerate(self.peer_ids)}
        self.cores: list[SimCore] = [
            self.make_core(i, 0.0) if i < config.nodes else GoneCore() for i in range(n)
        ]
        self.engines = [make_engine(i) for i in range(n)]
        #: each node's ``Load.disk`` figure as last told to its core (``_disk_load``)
        self._disk_announced: list[tuple[int, int] | None] = [None] * n
        self.delay = config.delay.matrix_s(config.nodes, random.Random(f"{seed}:network"))
        if n > config.nodes:  # newcomers' links: drawn apart, so the others' stay the same
            extra = config.delay.matrix_s(n, random.Random(f"{seed}:network:newcomers"))
            for i in range(config.nodes):
                self.delay[i].extend(extra[i][config.nodes:])
            self.delay.extend(extra[config.nodes:])
        self._forward_overhead_s = config.forward_overhead_ms / 1000.0
        self._arrival_rng = random.Random(f"{seed}:arrivals")
        #: the direct broadcast's gossip (``peerinfer.sim.broadcast``; built with the mesh too)
        self.broadcast = Broadcast(self, n, share_runs=self.share_runs, index_runs=self.index_runs)

        total = config.requests
        self.total = total
        self.arrival = [0.0] * total
        self.first = [-1.0] * total
        self.finish = [-1.0] * total
        self.origin = [-1] * total
        self.server = [-1] * total
        self.cached = [0] * total
        self.prompt = [0] * total
        self.status = [0] * total  # 0 pending, 1 served, 2 rejected
        self.forwards = [0] * total
        self.target = [-1] * total  # the node whose stream the origin relays now
        #: when the origin sent the request to its current target (its forward's TTFT starts)
        self.sent_at = [0.0] * total
        self.decided = [0] * total  # first routing decision: 1 local, 2 remote
        self.estimate = [math.nan] * total  # the policy's TTFT estimate for it, if any
        self.expected_cached = [0] * total  # the cached tokens the decision expected
        self.queue_wait = [0.0] * total  # time the serving run waited in its node's queue
        self.disk_tokens = [0] * total  # of its cached tokens, those its run read from disk
        self.rid_index: dict[RequestId, int] = {}
        self._client_of = [-1] * total
        self.completed = 0
        self.rejected = 0

        self._runs: list[dict[RequestId, int]] = [{} for _ in range(n)]
        self.batches = [BatchNode(node_costs(config, i)) for i in range(n)]
        self.enqueued: list[dict[RequestId, float]] = [{} for _ in range(n)]
        self._touched: list[set[BlockHash]] = [set() for _ in range(n)]
        self._reported: list[set[BlockHash]] = [set() for _ in range(n)]
        self._next_request = 0
        #: forwarded requests on their way to each node (the oracle router counts them)
        self.in_transit = [0] * n

        # per-node figures
        self.served = [0] * n
        self.busy_s = [0.0] * n
        self.waits: list[list[float]] = [[] for _ in range(n)]
        self.node_cached = [0] * n
        self.node_prompt = [0] * n
        # anti-entropy figures
        self.announces = 0
        self.announce_bytes = 0
        self.announce_deliveries = 0
        self.announces_lost = 0
        self.pull_requests = 0
        self.pull_request_bytes = 0
        self.pull_response_bytes = 0
        self.pings = 0
        self.drops = 0
        #: KV pulls and link probes (``config.pull``; ``peerinfer.sim.pulls``), None when off
        self.kv: KvPulls | None = None
        # Residency probes: which nodes cache the shared prefix of the ``probe_top`` most
        # frequent labels, sampled every ``share_stride`` arrivals.
        self.probe_hashes: dict[str, BlockHash] = {}
        self.residency: dict[str, list[tuple[int, list[int]]]] = {}
        if probe_top > 0 and total:
            freq: Counter[str] = Counter()
            first: dict[str, SimRequest] = {}
            for i in range(total):
                item = requests[i % len(requests)]
                freq[item.label] += 1
                first.setdefault(item.label, item)
            # the same order as the summary's (Counter: ties by first appearance)
            top = [label for label, _ in freq.most_common(probe_top)]
            bs = hasher.block_size
            for label in top:
                item = first[label]
                if item.prefix_blocks > 0:
                    chain = hasher.chain(item.tokens[: item.prefix_blocks * bs])
                    self.probe_hashes[label] = chain[-1]
                    self.residency[label] = []
        schedule = list(churn_schedule) if churn_schedule is not None else None
        self.churn: Churn | None = Churn(self, schedule) if churning else None
        #: gossipsub's mesh instead of the direct broadcast (peerinfer.sim.gossip)
        self.mesh: Mesh | None = Mesh(self) if config.gossip == "mesh" else None
        if config.pull:
            self.kv = KvPulls(self, self.engines, hasher)

    def make_core(self, i: int, now: float, epoch_base: int = 0) -> NodeCore:
        """Node ``i``'s core, started at ``now`` (a restart's epochs above ``epoch_base``)."""
        config = self.config
        # With shared runs, an index without masks: a run's changes wait in it for its
        # followers (``peerinfer.core.announcerun``) instead of each updating its masks.
        overrides = {"index_masks": not self.share_runs, **self.node_overrides}
        node_config = config.node_config(i, slots=self.slots, **overrides)
        rng = random.Random(f"{config.seed}:node:{i}")
        core = NodeCore(node_config, self.hasher, rng=rng, epoch_base=epoch_base, now=now,
                        delta_memo=self.delta_memo)
        if config.policy == ORACLE:
            # The simulator-only upper bound: the core's decisions read the swarm's exact
            # state instead of its own view (peerinfer.sim.oracle).
            core.policy = OracleRouter(self, i, node_costs(config, i))
        return core

    # ------------------------------------------------------------------ the loop

    def run(self) -> Simulation:
        """Run until every request has completed; returns ``self`` (the figures are attributes)."""
        # The replicas of one peer take the same announcement objects in: with the memo they
        # build each resulting set once and share it (``peerinfer.core.digest``, "Shared
        # deltas"; the same sets, so the same decisions).
        try:
            return self._run()
        finally:
            if self.delta_memo is not None:
                self.delta_memo.clear()

    def _start(self) -> None:
        """The run's first events: the nodes meet, the arrivals and churn begin."""
        n = self.config.nodes
        cores = self.cores
        delay = self.delay
        if self.mesh is not None:  # before the first announcements: they go along it
            self.mesh.start()
        # Everyone knows everyone from the start (the bootstrap and peer exchange are not
        # simulated); the round trips are measured by a first ping.
        for i in range(n):
            for j in range(n):
                if i != j:
                    cores[i].handle(PeerSeen(self.peer_ids[j], rtt_s=2 * delay[i][j]), 0.0)
            self.execute(i, cores[i].tick(0.0), 0.0)
            self.rearm(i, 0.0)
        self._start_arrivals()
        if self.churn is not None:
            self.churn.start()

    def _lost(self, now: float) -> None:
        pending = [i for i in range(self.total) if self.status[i] == 0 and self.arrival[i] >= 0]
        raise SimulationError(
            f"at t={now:.3f} s nothing is left to happen but {len(pending)} request(s) are "
            f"outstanding (first: {pending[:5]}); a request was lost"
        )

    def _deliver(self, n: int, event: Any, now: float) -> None:
        t = type(event)
        if t is ClientRequest:
            if event.forwarded:
                self.in_transit[n] -= 1
                churn = self.churn
                if churn is not None:
                    if not churn.live(n):  # a machine off or shutting down refuses it
                        churn.deliver_to_gone(n, event, now)
                        return
                    churn.note_delivery(n, event, now)
            # The request may join this node's queue now (queueing delay is measured from here).
            self.enqueued[n][event.request_id] = now
        elif t is ForwardFailed:
            self.enqueued[n][event.request_id] = now
        effects = self.cores[n].handle(event, now)
        if effects:
            self.execute(n, effects, now)
        if t is LocalFinished or t is CacheChanged:
            # An unannounced change sets a deadline (the minimum gap between announcements).
            self.rearm(n, now)

    # ------------------------------------------------------------------ arrivals

    def _start_arrivals(self) -> None:
        cfg = self.config
        if self.total == 0:
            return
        if self._fixed_arrivals is not None:
            for i in range(self.total):
                t, node = self._fixed_arrivals[i]
                if not 0 <= node < cfg.nodes:
                    raise SimulationError(f"arrival {i} names node {node} of {cfg.nodes}")
                self.origin[i] = node
                self.arrival[i] = t
                self.push(t, ARRIVAL, i)
            self._next_request = self.total
            return
        if cfg.clients > 0:
            for c in range(min(cfg.clients, self.total)):
                t = self._arrival_rng.expovariate(1.0 / cfg.think_s) if cfg.think_s > 0 else 0.0
                self._issue(c, t)
        else:
            t = self._arrival_rng.expovariate(cfg.rate * cfg.nodes)
            self._issue(-1, t)

    def _issue(self, client: int, t: float) -> None:
        """Schedule the next request of the workload to arrive at ``t`` (from ``client``)."""
        i = self._next_request
        if i >= self.total:
            return
        self._next_request = i + 1
        n = self.config.nodes
        if client >= 0:
            self.origin[i] = client % n
        else:
            home = self.workload[i % len(self.workload)].home
            if self.churn is not None:  # a live node, drawn among those live now
                self.origin[i] = self.churn.entry_node(home % n if home is not None else -1, self._arrival_rng)
            else:
                # Arrivals enter at the first ``entries`` nodes only (the dilution
                # experiment: fewer entry nodes, fewer routers), all nodes by default.
                e = self.config.entries or n
                self.origin[i] = home % e if home is not None else self._arrival_rng.randrange(e)
        self._client_of[i] = client
        self.arrival[i] = t
        self.push(t, ARRIVAL, i)

    def _arrive(self, i: int, now: float) -> None:
        cfg = self.config
        if cfg.clients == 0 and self._fixed_arrivals is None:
            self._issue(-1, now + self._arrival_rng.expovariate(cfg.rate * cfg.nodes))
        if self.probe_hashes and i % cfg.share_stride == 0:
            for label, h in self.probe_hashes.items():
                self.residency[label].append(
                    (i, [k for k, e in enumerate(self.engines) if e.cached(h)])
                )
        item = self.workload[i % len(self.workload)]
        rid = RequestId(f"r{i}")
        self.rid_index[rid] = i
        if self.churn is not None:  # its node may have gone since it was drawn: the user moves
            self.origin[i] = self.churn.entry_node(self.origin[i], self._arrival_rng)
        n = self.origin[i]
        self._deliver(n, ClientRequest(rid, item.tokens, item.params, scaffold=item.scaffold), now)

    def _complete(self, i: int, now: float, ok: bool) -> None:
        if self.status[i] != 0:
            raise SimulationError(f"request {i} completed twice")
        self.status[i] = 1 if ok else 2
        self.finish[i] = now
        self.completed += 1
        if not ok:
            self.rejected += 1
        client = self._client_of[i]
        if client >= 0:
            think = self.config.think_s
            self._issue(client, now + (self._arrival_rng.expovariate(1.0 / think) if think else 0.0))

    # ------------------------------------------------------------------ effects

    def execute(self, n: int, effects: list[Any], now: float) -> None:
        rearm = False
        for eff in effects:
            t = type(eff)
            if t is Publish:  # (the most frequent effect: about four a request)
                if self.mesh is None:
                    self.broadcast.publish(n, eff.announce, now)
                else:
                    self.mesh.publish(n, eff.announce, now)
            elif t is RunLocal:
                self._run_local(n, eff, now)
            elif t is Forward:
                self._forward(n, eff, now)
                rearm = True
            elif t is SendSyncRequest:
                p = self.index_of[eff.peer]
                self.pull_requests += 1
                self.pull_request_bytes += len(encode(eff.request))
                self.push(now + self.delay[n][p], SYNC, p, n, eff.request)
                rearm = True
            elif t is Reject:
                self._reject(n, eff, now)
            elif t is CancelForward:
                p = self.index_of[eff.peer]
                self.push(now + self.delay[n][p], NODE, p, Cancel(eff.request_id))
            elif t is CancelLocal:
                self._cancel_local(n, eff.request_id, now)
            elif t is PingPeer:
                slot = self.index_of.get(eff.peer)
                if slot is not None and self.churn is not None and not self.churn.up(slot):
                    self.pings += 1
                    self.churn.ping_unanswered(n, slot, now)
                elif slot is not None:
                    self.pings += 1
                    rtt = 2 * self.delay[n][slot]
                    self.push(now + rtt, NODE, n, PeerSeen(eff.peer, rtt_s=rtt))
            elif t is DropPeer:
                self.drops += 1
            elif t is ProbeLink and self.kv is not None:
                self.kv.probe(n, eff, now)
            else:  # pragma: no cover - a new effect type the simulator does not know
                raise SimulationError(f"the simulator cannot execute {t.__name__}")
        if rearm:
            self.rearm(n, now)

    def _gossip(self, item: tuple[Any, ...], now: float) -> None:
        self.broadcast.deliver(item, now)

    def _sync(self, responder: int, requester: int, request: Any, now: float) -> None:
        if self.churn is not None and not self.churn.up(responder):
            return  # no answer: the requester's deadline ends the pull
        core = self.cores[responder]
        assert isinstance(core, NodeCore)  # a machine that is on runs a real core
        response = core.answer_sync(request)
        self.pull_response_bytes += len(encode(response))
        self.push(
            now + self.delay[responder][requester],
            NODE,
            requester,
            SyncResponseReceived(self.peer_ids[responder], response),
        )

    def _forward(self, n: int, eff: Forward, now: float) -> None:
        p = self.index_of[eff.peer]
        i = self.rid_index[eff.request_id]
        self.target[i] = p
        self.sent_at[i] = now
        self.enqueued[n].pop(eff.request_id, None)
        if self.forwards[i] == 0 and self.decided[i] == 0:
            self._record_decision(i, eff.decision, remote=True)
        self.forwards[i] += 1
        self.push(
            now + self.delay[n][p] + self._forward_overhead_s,
            NODE,
            p,
            ClientRequest(
                eff.request_id,
                eff.tokens,
                eff.params,
                True,
                self.peer_ids[n],
                eff.decision.max_outstanding,
                scaffold=eff.scaffold,
            ),
        )
        self.in_transit[p] += 1

    def _reject(self, n: int, eff: Reject, now: float) -> None:
        i = self.rid_index[eff.request_id]
        origin = self.origin[i]
        self.enqueued[n].pop(eff.request_id, None)
        if origin == n:
            self._complete(i, now, ok=False)
            return
        # A peer refused a forwarded request: the refusal travels back to the origin.
        reason = error_kind(eff.code).forward_reason
        self.push(
            now + self.delay[n][origin],
            NODE,
            origin,
            ForwardFailed(eff.request_id, self.peer_ids[n], reason),
        )

    def _run_local(self, n: int, eff: RunLocal, now: float) -> None:
        rid = eff.request_id
        plan = self.engines[n].plan(eff.tokens, eff.params)
        touched = self._touched[n]
        touched.update(plan.cache_added)
        touched.update(plan.cache_removed)
        run = next(self._seq)
        self._runs[n][rid] = run
        i = self.rid_index[rid]
        if self.origin[i] == n:
            self.target[i] = n
            if self.decided[i] == 0 and eff.decision is not None:
                self._record_decision(i, eff.decision, remote=False)
        self.served[n] += 1
        self.node_cached[n] += plan.cached_tokens
        self.node_prompt[n] += plan.prompt_tokens
        wait = now - self.enqueued[n].pop(rid, now)
        self.waits[n].append(wait)
        self.queue_wait[i] = wait
        cached = plan.cached_tokens
        decision = eff.decision
        # Blocks read back from the disk tier are read before the run starts, like a pull.
        move = plan.disk_s
        if move:
            self.disk_tokens[i] = plan.disk_tokens
        if self.kv is not None and decision is not None and decision.pull_from is not None:
            cached, pull_s = self.kv.pull(n, i, eff.tokens, decision.pull_from, cached, now)
            move += pull_s
        job = BatchJob(rid, plan.prompt_tokens, cached, plan.completion_tokens, payload=run)
        if move > 0.0:
            # The run holds its slot while the KV comes (the core counts it running), and
            # joins the batch when the last byte is in.
            self.push(now + move, PULL, n, job)
        else:
            self._batch_moved(n, self.batches[n].join(job, now))
        self._deliver(n, LocalStarted(rid, cached), now)

    def _pulled(self, n: int, job: BatchJob, now: float) -> None:
        """A pull ended: its run joins the batch, unless it was cancelled meanwhile."""
        if self._runs[n].get(job.key) != job.payload:
            return
        self._batch_moved(n, self.batches[n].join(job, now))

    def _batch_moved(self, n: int, end: float | None) -> None:
        if end is not None:
            self.push(end, STEP, n, self.batches[n].epoch)

    def _step(self, n: int, epoch: int, now: float) -> None:
        """A segment of node ``n``'s batch ends: first tokens and ends, then the next one."""
        batch = self.batches[n]
        if batch.epoch != epoch:
            return  # superseded: the batch changed and rescheduled
        events = batch.finish(now)
        batch.in_boundary = True
        try:
            for job, first, finished in events:
                if first:
                    self._first(n, job.key, job.payload, now)
                if finished:
                    self._done(n, job.key, (job.payload, job.cached, job.prompt), now)
        finally:
            batch.in_boundary = False
        self.busy_s[n] = batch.busy_s
        self._batch_moved(n, batch.plan(now))

    def _record_decision(self, i: int, decision: Any, remote: bool) -> None:
        """The origin's first routing decision for request ``i``: where, and the policy's own
        TTFT estimate (``cost`` gives one), to compare with what happened."""
        self.decided[i] = 2 if remote else 1
        est = decision.estimated_ttft_s
        if est is not None:
            self.estimate[i] = est
        self.expected_cached[i] = decision.expected_cached_tokens

    def _flush_changes(self, n: int) -> tuple[tuple[BlockHash, ...], tuple[BlockHash, ...]]:
        """The node's cache changes since its last report, as the engine would report them."""
        touched = self._touched[n]
        if not touched:
            return (), ()
        reported = self._reported[n]
        cached = self.engines[n].cached
        added: list[BlockHash] = []
        removed: list[BlockHash] = []
        for h in touched:
            if cached(h):
                if h not in reported:
                    added.append(h)
                    reported.add(h)
            elif h in reported:
                removed.append(h)
                reported.discard(h)
        touched.clear()
        return tuple(added), tuple(removed)

    def _first(self, n: int, rid: RequestId, run: int, now: float) -> None:
        if self._runs[n].get(rid) != run:
            return  # cancelled
        i = self.rid_index[rid]
        origin = self.origin[i]
        if origin == n:
            if self.first[i] < 0:
                self.first[i] = now
        else:
            self.push(
                now + self.delay[n][origin],
                RELAY,
                origin,
                ForwardFirstToken(rid, self.peer_ids[n]),
                n,
                0,
                0,
            )

    def _done(self, n: int, rid: RequestId, info: tuple[int, int, int], now: float) -> None:
        run, cached, prompt = info
        runs = self._runs[n]
        if runs.get(rid) != run:
            return  # cancelled
        del runs[rid]
        i = self.rid_index[rid]
        origin = self.origin[i]
        if origin == n:
            if self.first[i] < 0:
                self.first[i] = now
            self.server[i] = n
            self.cached[i] = cached
            self.prompt[i] = prompt
            self._complete(i, now, ok=True)
        else:
            self.push(
                now + self.delay[n][origin],
                RELAY,
                origin,
                ForwardFinished(rid, self.peer_ids[n]),
                n,
                cached,
                prompt,
            )
        added, removed = self._flush_changes(n)
        self._deliver(n, LocalFinished(rid, True, added, removed), now)
        self._disk_load(n, now)

    def _relay(self, item: tuple[Any, ...], now: float) -> None:
        _, _, _, origin, event, server, cached, prompt = item
        i = self.rid_index[event.request_id]
        if self.target[i] == server and self.status[i] == 0:
            if type(event) is ForwardFirstToken:
                if self.first[i] < 0:
                    self.first[i] = now
            else:
                if self.first[i] < 0:
                    self.first[i] = now
                self.server[i] = server
                self.cached[i] = cached
                self.prompt[i] = prompt
                self._complete(i, now, ok=True)
                # What the node's shell measures and reports: the peer's cached tokens and the
                # first token's time since the forward was sent (reputation judges them).
                event = ForwardFinished(
                    event.request_id, event.peer, cached_tokens=cached, ttft_s=self.first[i] - self.sent_at[i]
                )
        self._deliver(origin, event, now)

    def _cancel_local(self, n: int, rid: RequestId, now: float) -> None:
        if self._runs[n].pop(rid, None) is None:
            return
        self._batch_moved(n, self.batches[n].leave(rid, now))
        added, removed = self._flush_changes(n)
        self._deliver(n, LocalFinished(rid, False, added, removed, "cancelled"), now)
        self._disk_load(n, now)

    def _disk_load(self, n: int, now: float) -> None:
        """Tell node ``n``'s core its disk tier's figure (``Load.disk``) when it changed, as a
        real node's runtime does (``CacheChanged(disk=...)``): here after each report of cache
        changes, which is when the share of blocks on disk moves."""
        figure_of = self.engines[n].disk_figure
        if figure_of is None:
            return
        # The blocks reported to the core so far: its digest, which the real runtime counts.
        figure = figure_of(len(self._reported[n]))
        if figure is not None and figure != self._disk_announced[n]:
            self._disk_announced[n] = figure
            self._deliver(n, CacheChanged(disk=figure), now)

    # ------------------------------------------------------------------ churn's calls

    def stop_engine(self, n: int) -> None:
        """Node ``n``'s machine went away: stale segment ends and runs are ignored from now
        on, and its queue is forgotten."""
        old = self.batches[n]
        batch = BatchNode(old.costs)
        batch.epoch = old.epoch + 1
        batch.busy_s = old.busy_s
        self.batches[n] = batch
        self._runs[n].clear()
        self.enqueued[n].clear()

    def restart_engine(self, n: int, now: float, saved: bool) -> None:
        """Node ``n``'s machine came back with a new core: its engine restarts warm from its
        disk tier (``_EngineAdapter.restart``), and the core is told what it holds as the real
        runtime tells it at start (``CacheChanged(added=snapshot)``), then the tier's figure."""
        snapshot = self.engines[n].restart(saved)
        self._touched[n].clear()
        self._reported[n] = set(snapshot)
        self._disk_announced[n] = None
        if snapshot:
            self._deliver(n, CacheChanged(added=tuple(snapshot)), now)
        self._disk_load(n, now)

    def end_orphaned(self, i: int, now: float) -> bool:
        """Request ``i`` ends as orphaned (status 3: its user's entry node went away), unless
        it had ended."""
        if self.status[i] != 0:
            return False
        self.status[i] = 3
        self.finish[i] = now
        self.completed += 1
        return True

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """After a run: every request completed exactly once, no core holds a request, no run
        is left, and every node's reported cache equals its engine's cache."""
        if self.completed != self.total or any(s == 0 for s in self.status):
            raise SimulationError("not every request completed")
        for n, core in enumerate(self.cores):
            if core.pending_requests():
                raise SimulationError(f"node {n} still holds {core.pending_requests()[:5]}")
            if self._runs[n]:
                raise SimulationError(f"node {n} still runs {list(self._runs[n])[:5]}")
            if self.batches[n].jobs:
                raise SimulationError(f"node {n}'s batch still holds {len(self.batches[n].jobs)}")
            st = core.statistics()
            if st.queued or st.running:
                raise SimulationError(f"node {n} still has {st.queued} queued, {st.running} running")


__all__ = ["EngineLike", "PlanLike", "SimRequest", "Simulation", "SimulationError", "peer_name"]
