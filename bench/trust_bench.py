"""How fast lying peers are caught (issue 12's figures), printed as text or ``--json``.

Run ``python bench/trust_bench.py --json``. Scenarios:

``digest`` and ``tarpit``
    A network of ``--nodes`` nodes (default 8) in one process (real nodes: libp2p on 127.0.0.1, the simulated engine,
    policy ``cost``), 7 honest nodes and one liar, every node bootstrapped from the first. The
    liar is first warmed with every prefix of the workload (so its digest claims them all), then
    lies: ``digest`` serves the right tokens but with no cache (``cached_tokens=0``) and announces
    zero load; ``tarpit`` accepts each request and never answers. Clients send ``--requests``
    requests (``--prefixes`` shared prefixes, a distinct suffix each), round-robin over the
    honest nodes (7 of 8), one at a time. Reported: the liar's share of the forwarded requests (served_by
    is the authenticated peer), the forwards it received per origin, and its failures at each
    origin before that origin stopped preferring it (standing demoted/excluded).
``core_digest_loaded``
    ``core_digest`` with every honest core holding ``--backlog`` requests of its own that never
    finish: their announced load is high, so the liar (zero load) is chosen on load even once
    demoted, and each choice is another shortfall; reported: its failures at each origin until
    it is no longer a candidate (target <= 20). Few forwards happen between loaded honest cores,
    so the liar's share of *requests* is the figure to read here, not its share of forwards.
``audit``
    The core alone (NodeCore origin, a liar core answering every forward wrongly), ``--runs``
    runs at ``--audit-rate``: forwarded requests until the ban, p50/p95/max. And 1,000 forwards
    to each of 7 honest peers with random evictions (at most one forward in six falls short),
    delays (first token up to 2x the estimate) and float noise (every audit passes: the noise is
    inside the tolerance, see tests/engine/test_trust_audit.py): honest peers banned or excluded.
``audit_cost``
    With ``--hf``: the default real model (1 torch thread), for ``--cost-prompts`` prompts of
    about 200 tokens and 32 greedy tokens each: the engine time of serving (prefix cached, as on
    the peer that was chosen for its cache) versus one audit pass. Compute on audits over compute
    serving is ``audit_rate * audit_s / serve_s``; the target is <= ``audit_rate * 1.2``. Then
    ``--noise-prompts`` honest float32 answers are re-scored with the model in bfloat16 (another
    precision, as on another device): how many would fail the audit; and the same prompts
    sampled (temperature 0.8, top-p 0.9, one seed each), re-scored against the nucleus, and as
    many answers of random ids with those parameters (a liar): how many the audit catches.

``--only digest`` / ``--only tarpit`` run the network scenarios on ``--nodes`` (default 8) real
in-process nodes over libp2p instead of NodeCores in memory. With 8 nodes in one process on a
loaded 2-core machine the network did not settle (pings and syncs timed out, no origin learned
the liar's digest); ``--nodes 4`` does. The decisions are the same ``NodeCore``'s either way:
the node's shell executes its ``Forward`` effects and reports what came back.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

from peerinfer.client import Client  # noqa: E402
from peerinfer.core.costmodel import CostModel  # noqa: E402
from peerinfer.core.messages import (  # noqa: E402
    GenerateDone,
    GenerateRequest,
    Load,
    TokenChunk,
    decode,
    encode,
)
from peerinfer.net import FramedStream  # noqa: E402
from peerinfer.node import GENERATE_PROTOCOL, Node, NodeOptions  # noqa: E402
from peerinfer.types import PeerId  # noqa: E402

COSTS = CostModel(
    prefill_s_per_token=0.0004, cached_s_per_token=0.00001, decode_s_per_token=0.002,
    overhead_s=0.002, slots=2,
)


def _prompt(prefix: int, k: int) -> str:
    return f"context {prefix}: " + " ".join(f"p{prefix}w{i}" for i in range(120)) + f" question {k}?"


async def _network(
    kind: str, requests: int, prefixes: int, seed: int, settle_s: float, n_nodes: int = 8,
    gap_s: float = 0.0,
) -> dict[str, Any]:
    from peerinfer.engine.simulated import SimulatedEngine

    rng = random.Random(seed)
    liar_log: list[str] = []  # origins of the requests the liar received
    async with trio.open_nursery() as nursery:
        nodes: list[Node] = []
        for i in range(n_nodes):
            options = NodeOptions(
                engine="simulated", listen=("/ip4/127.0.0.1/tcp/0",), mdns=False,
                persist_identity=False, policy="local" if i == 0 else "cost", costs=COSTS,
                announce_interval_s=1.0, peer_timeout_s=30.0, first_token_timeout_s=1.0,
                seed=seed + i, audit_rate=0.0,
                bootstrap=(nodes[0].addresses()[0],) if nodes else (),
            )
            node = Node(options, engine=SimulatedEngine(costs=COSTS, time_scale=0.25))
            await nursery.start(node.serve)
            nodes.append(node)
        liar, honest = nodes[0], nodes[1:]
        assert liar.core is not None and liar.engine is not None
        with trio.fail_after(120):
            async with Client.connect(liar.addresses()[0], timeout_s=30) as client:
                for p in range(prefixes):
                    await client.generate(_prompt(p, -1), max_tokens=2)
            # Wait (up to --settle-s) until every honest node routes a workload prompt to the
            # liar's digest; on a loaded machine some pulls lag, so the figure says how many did.
            def routing_to_liar() -> int:
                return sum(
                    n.core.route(  # type: ignore[union-attr]
                        n.engine.tokenize(_prompt(0, 0)), _params(), trio.current_time()  # type: ignore[union-attr]
                    ).target == liar.peer_id
                    for n in honest
                )

        with trio.move_on_after(settle_s):
            while routing_to_liar() < len(honest):
                await trio.sleep(0.2)
        at_start = routing_to_liar()
        engine = liar.engine
        assert isinstance(engine, SimulatedEngine)

        async def digest_liar(stream: FramedStream) -> None:
            req = decode(await stream.receive(timeout=10), expected=GenerateRequest)
            assert isinstance(req, GenerateRequest)
            liar_log.append(stream.remote_peer)
            ids = engine.completion_ids(req.tokens, req.params, req.params.max_tokens)
            await trio.sleep(COSTS.prefill_s(len(req.tokens), 0) * 0.25)  # it really recomputes
            for t in ids:
                await stream.send(encode(TokenChunk(req.request_id, (t,), engine.detokenize([t]))))
            await stream.send(encode(GenerateDone(
                req.request_id, len(req.tokens), len(ids), 0, liar.peer_id, 0.01, 0.02, "length"
            )))

        async def tarpit(stream: FramedStream) -> None:
            req = decode(await stream.receive(timeout=10), expected=GenerateRequest)
            assert isinstance(req, GenerateRequest)
            liar_log.append(stream.remote_peer)
            with trio.move_on_after(60):
                try:
                    await stream.receive(timeout=60)
                except Exception:
                    return

        assert liar.host is not None
        liar.host.set_handler(GENERATE_PROTOCOL, digest_liar if kind == "digest" else tarpit)
        liar.core.load = lambda: Load(0, 0, COSTS.slots)  # type: ignore[method-assign]
        lid = PeerId(liar.peer_id)
        served_by: Counter[str] = Counter()
        forwarded = 0
        failures_until_demoted: dict[str, int | None] = {n.peer_id: None for n in honest}
        failures_until_excluded: dict[str, int | None] = {n.peer_id: None for n in honest}
        started = time.perf_counter()
        clients = [await nursery.start(_open_client, n) for n in honest]
        for i in range(requests):
            o = i % len(honest)
            origin = honest[o]
            core = origin.core
            assert core is not None
            before = core.statistics().forwarded
            p = rng.randrange(prefixes)
            result = await clients[o].generate(_prompt(p, i), max_tokens=8)
            await trio.sleep(gap_s)  # --gap-s: time for announcements between requests
            served_by[result.served_by] += 1
            forwarded += core.statistics().forwarded - before
            now_s = trio.current_time()
            if failures_until_demoted[origin.peer_id] is None and core.reputation.standing(lid, now_s) != "good":
                failures_until_demoted[origin.peer_id] = liar_log.count(origin.peer_id)
            if failures_until_excluded[origin.peer_id] is None and not core.reputation.is_candidate(lid, now_s):
                failures_until_excluded[origin.peer_id] = liar_log.count(origin.peer_id)
        elapsed = time.perf_counter() - started
        per_origin = Counter(liar_log)
        standings = Counter(n.core.reputation.standing(lid, trio.current_time()) for n in honest)  # type: ignore[union-attr]
        nursery.cancel_scope.cancel()
    return {
        "nodes": n_nodes,
        "requests": requests,
        "prefixes": prefixes,
        "origins_routing_to_liar_at_start": at_start,
        "forwards_attempted": forwarded,
        "liar_forwards": len(liar_log),
        "liar_share_of_forwards": round(len(liar_log) / max(1, forwarded), 4),
        "liar_served": served_by.get(liar.peer_id, 0),
        "liar_forwards_per_origin_max": max(per_origin.values(), default=0),
        "liar_forwards_per_origin": sorted(per_origin.values()),
        "failures_until_not_preferred_per_origin": sorted(
            v for v in failures_until_demoted.values() if v is not None
        ),
        "origins_still_preferring_liar": sum(v is None for v in failures_until_demoted.values()),
        "failures_until_excluded_per_origin": sorted(
            v for v in failures_until_excluded.values() if v is not None
        ),
        "liar_standing_at_origins": dict(standings),
        "wall_s": round(elapsed, 2),
        "gap_s": gap_s,
    }


def _params() -> Any:
    from peerinfer.core.messages import SamplingParams

    return SamplingParams(max_tokens=8)


async def _open_client(node: Node, task_status: trio.TaskStatus[Client] = trio.TASK_STATUS_IGNORED) -> None:
    async with Client.connect(node.addresses()[0], timeout_s=30) as client:
        task_status.started(client)
        await trio.sleep_forever()


def _core_network(kind: str, requests: int, prefixes: int, seed: int, backlog: int = 0) -> dict[str, Any]:
    """The same scenario on 8 NodeCores wired in memory, one request at a time (virtual time).

    Every decision is the real core's (routing with policy ``cost``, reputation, failover);
    engines are ``SimulatedEngine.plan`` (the cost model's timings, the real radix cache). Each
    round every core ticks and its announcements reach every other core, pulls answered at once.
    The liar (core 0) holds every prefix in its digest; as ``digest`` it serves with no cache
    (``cached_tokens=0``, first token after a full prefill), as ``tarpit`` it never answers.
    """
    from peerinfer.core.messages import SamplingParams
    from peerinfer.core.node import (
        ClientRequest,
        Forward,
        ForwardFailed,
        ForwardFinished,
        LocalFinished,
        NodeConfig,
        NodeCore,
        RunLocal,
    )
    from peerinfer.core.prefix import PrefixHasher
    from peerinfer.engine.simulated import SimulatedEngine
    from peerinfer.types import RequestId

    rng = random.Random(seed)
    ids = [PeerId(f"node{i}") for i in range(8)]
    engines = [SimulatedEngine(costs=COSTS, time_scale=0.0) for _ in range(8)]
    hasher = PrefixHasher(engines[0].fingerprint)
    for e in engines:
        e.configure_cache(hasher)
    cores = [
        NodeCore(NodeConfig(peer_id=ids[i], policy="local" if i == 0 else "cost", costs=COSTS,
                            first_token_timeout_s=1.0, audit_rate=0.0), hasher,
                 rng=random.Random(seed + i), now=0.0)
        for i in range(8)
    ]
    params = SamplingParams(max_tokens=8)
    now = 0.0
    texts = {p: _prompt(p, -1) for p in range(prefixes)}

    def serve_local(n: int, eff: RunLocal) -> None:
        plan = engines[n].plan(eff.tokens, eff.params)
        cores[n].handle(LocalFinished(eff.request_id, True, plan.cache_added, plan.cache_removed), now)

    def gossip() -> None:
        from peerinfer.core.node import AnnounceReceived, PeerSeen, Publish

        published = [[e.announce for e in c.tick(now) if isinstance(e, Publish)] for c in cores]
        for a in cores:
            for b, anns in zip(cores, published, strict=True):
                if a is not b:
                    a.handle(PeerSeen(b.peer_id, rtt_s=0.005), now)
                    for ann in anns:
                        _pull(a, b, a.handle(AnnounceReceived(b.peer_id, ann), now), now)

    for p in range(prefixes):  # the liar really held them once: its digest claims them all
        rid = RequestId(f"warm{p}")
        for eff in cores[0].handle(ClientRequest(rid, tuple(engines[0].tokenize(texts[p])), params), now):
            if isinstance(eff, RunLocal):
                serve_local(0, eff)
    for n in range(1, 8):
        # ``backlog``: every honest core has that many requests of its own that never finish,
        # so its announced load is high and a liar announcing zero load wins on load alone
        # (once demoted, that is the only way it is chosen).
        for b in range(backlog):
            cores[n].handle(ClientRequest(RequestId(f"backlog{n}.{b}"), tuple(range(10 + b, 74 + b)), params), now)
    gossip()
    liar_forwards: Counter[int] = Counter()
    failures_until_demoted: dict[int, int | None] = dict.fromkeys(range(1, 8))
    failures_until_excluded: dict[int, int | None] = dict.fromkeys(range(1, 8))
    forwarded = 0
    served_by: Counter[int] = Counter()
    for i in range(requests):
        now += 0.5
        gossip()
        o = 1 + i % 7
        core = cores[o]
        tokens = tuple(engines[o].tokenize(_prompt(rng.randrange(prefixes), i)))
        rid = RequestId(f"r{i}")
        pending = core.handle(ClientRequest(rid, tokens, params), now)
        for _ in range(10):  # failover steps, bounded
            effects, pending = pending, []
            for eff in effects:
                if isinstance(eff, RunLocal):
                    serve_local(o, eff)
                    served_by[o] += 1
                elif isinstance(eff, Forward):
                    forwarded += 1
                    t = ids.index(eff.peer)
                    if t == 0:
                        liar_forwards[o] += 1
                        if kind == "tarpit":
                            pending += core.tick(now + 1.01)  # the first-token deadline
                            continue
                        ttft = COSTS.prefill_s(len(eff.tokens), 0)
                        done = ForwardFinished(rid, eff.peer, 0, ttft, ())
                        served_by[0] += 1
                    else:
                        fwd = ClientRequest(rid, eff.tokens, eff.params, True, core.peer_id,
                                            eff.decision.max_outstanding)
                        runs = [e for e in cores[t].handle(fwd, now) if isinstance(e, RunLocal)]
                        if not runs:
                            pending += core.handle(ForwardFailed(rid, eff.peer, "busy"), now)
                            continue
                        plan = engines[t].plan(runs[0].tokens, runs[0].params)
                        cores[t].handle(LocalFinished(rid, True, plan.cache_added, plan.cache_removed), now)
                        done = ForwardFinished(rid, eff.peer, plan.cached_tokens, plan.ttft_s + 0.005, ())
                        served_by[t] += 1
                    pending += core.handle(done, now)
            if not pending:
                break
        if failures_until_demoted[o] is None and core.reputation.standing(ids[0], now) != "good":
            failures_until_demoted[o] = liar_forwards[o]
        if failures_until_excluded[o] is None and not core.reputation.is_candidate(ids[0], now):
            failures_until_excluded[o] = liar_forwards[o]
    standings = Counter(c.reputation.standing(ids[0], now) for c in cores[1:])
    return {
        "requests": requests,
        "prefixes": prefixes,
        "backlog_per_honest_core": backlog,
        "forwards": forwarded,
        "liar_forwards": sum(liar_forwards.values()),
        "liar_share_of_forwards": round(sum(liar_forwards.values()) / max(1, forwarded), 4),
        "liar_share_of_requests": round(served_by[0] / requests, 4) if kind == "digest" else 0.0,
        "liar_forwards_per_origin": sorted(liar_forwards.values()),
        "failures_until_not_preferred_per_origin": sorted(
            v for v in failures_until_demoted.values() if v is not None
        ),
        "origins_still_preferring_liar": sum(v is None for v in failures_until_demoted.values()),
        "failures_until_excluded_per_origin": sorted(
            v for v in failures_until_excluded.values() if v is not None
        ),
        "liar_standing_at_origins": dict(standings),
    }


def _pull(a: Any, b: Any, effects: list[Any], now: float) -> None:
    """Answer ``a``'s sync requests to ``b`` at once, until its replica converges."""
    from peerinfer.core.node import SendSyncRequest, SyncResponseReceived

    pending = [e for e in effects if isinstance(e, SendSyncRequest)]
    for _ in range(100):
        if not pending:
            return
        req = pending.pop()
        pending += [e for e in a.handle(SyncResponseReceived(b.peer_id, b.answer_sync(req.request)), now)
                    if isinstance(e, SendSyncRequest)]


def _learn(a: Any, b: Any, now: float) -> None:
    """Core ``a`` hears ``b``'s announcements (pulling its digest when it must)."""
    from peerinfer.core.node import (
        AnnounceReceived,
        PeerSeen,
        Publish,
        SendSyncRequest,
        SyncResponseReceived,
    )

    a.handle(PeerSeen(b.peer_id, rtt_s=0.001), now)
    pending = []
    for eff in b.tick(now):
        if isinstance(eff, Publish):
            pending += [e for e in a.handle(AnnounceReceived(b.peer_id, eff.announce), now)
                        if isinstance(e, SendSyncRequest)]
    for _ in range(100):
        if not pending:
            return
        req = pending.pop()
        pending += [e for e in a.handle(SyncResponseReceived(b.peer_id, b.answer_sync(req.request)), now)
                    if isinstance(e, SendSyncRequest)]


def _forwards_until_ban(run: int, seed: int, rate: float, shared: tuple[int, ...], *, strategic: bool) -> int:
    """Forwarded requests a wrong-answer liar receives from one origin before its ban (the
    real NodeCore path: route, forward, finish, audit sampled by the core, verdict, ban). A
    ``strategic`` liar answers rightly while it is on probation (its first audits), then lies."""
    from peerinfer.core.messages import SamplingParams
    from peerinfer.core.node import (
        AuditFinished,
        AuditForward,
        BanPeer,
        ClientRequest,
        Forward,
        ForwardFinished,
        LocalFinished,
        NodeConfig,
        NodeCore,
    )
    from peerinfer.core.prefix import PrefixHasher
    from peerinfer.types import RequestId

    hasher = PrefixHasher(b"bench")
    params = SamplingParams(max_tokens=8)
    prng = random.Random(seed * 7919 + run)
    origin = NodeCore(NodeConfig(peer_id=PeerId(f"origin-{seed}-{run}"), policy="longest_prefix",
                                 audit_rate=rate), hasher, rng=random.Random(run), now=0.0)
    origin.trust.audit_rng = random.Random(prng.random())  # independent runs
    liar = NodeCore(NodeConfig(peer_id=PeerId("liar")), hasher, rng=random.Random(run), now=0.0)
    liar.handle(ClientRequest(RequestId("warm"), shared, params), 0.0)
    liar.handle(LocalFinished(RequestId("warm"), ok=True, cache_added=tuple(hasher.chain(shared))), 0.0)
    n = 0
    lying = not strategic
    for i in range(10_000):
        now = 1.0 + i
        _learn(origin, liar, now)
        rid = RequestId(f"r{i}")
        effects = origin.handle(ClientRequest(rid, shared + (5 + i % 1000, 6), params), now)
        forwards = [e for e in effects if isinstance(e, Forward)]
        if not forwards:
            break  # banned: no longer a candidate
        fwd = forwards[0]
        if lying:
            n += 1
        answer = tuple(prng.randrange(4, 30000) for _ in range(params.max_tokens))
        effects = origin.handle(ForwardFinished(
            rid, fwd.peer, fwd.decision.expected_cached_tokens, 0.01, answer
        ), now)
        if any(isinstance(e, AuditForward) for e in effects):
            # The simulated engine audits exactly: a wrong answer always fails.
            out = origin.handle(AuditFinished(fwd.peer, ok=not lying, detail="audit"), now)
            if lying:
                assert any(isinstance(e, BanPeer) for e in out)
            elif origin.reputation.audits(fwd.peer) >= origin.config.audit_first:
                lying = True  # probation over: from now on it lies
    return n


def _audit_scenario(runs: int, rate: float, seed: int) -> dict[str, Any]:
    """Forwards until a wrong-answer liar is banned (the real NodeCore path: route, forward,
    finish, audit sampled by the core, audit verdict, ban), and honest peers under noise."""
    from peerinfer.core.reputation import Reputation, judge_finished

    prng = random.Random(seed)
    shared = tuple(prng.randrange(4, 30000) for _ in range(256))
    until_ban: list[int] = []
    naive_until_ban: list[int] = []
    for run in range(runs):
        naive_until_ban.append(_forwards_until_ban(run, seed, rate, shared, strategic=False))
        until_ban.append(_forwards_until_ban(run, seed, rate, shared, strategic=True))
    # Honest peers: 1,000 forwards each through the same judging and table.
    rng = random.Random(seed)
    rep = Reputation()
    banned = excluded = 0
    for peer_no in range(7):
        peer = PeerId(f"honest{peer_no}")
        now, last_short = 0.0, -10
        ever_bad = False
        for i in range(1000):
            now += rng.expovariate(2.0)
            est = 0.05 + rng.random()
            ttft = est * (1 + rng.random()) + abs(rng.gauss(0, 0.01))
            short = rng.random() < 0.1 and i - last_short >= 6
            last_short = i if short else last_short
            cached = rng.randrange(0, 64) if short else 640 - 16 * rng.randrange(0, 3)
            outcome = judge_finished(
                rep.config, expected_cached_tokens=640, cached_tokens=cached,
                estimated_ttft_s=est, ttft_s=ttft,
            )
            rep.record(peer, outcome, now)
            if rng.random() < rate:
                rep.record(peer, "audit_passed", now)
            ever_bad |= not rep.is_candidate(peer, now)
        banned += rep.is_banned(peer, now)
        excluded += ever_bad
    ordered = sorted(until_ban)
    return {
        "audit_rate": rate,
        "runs": runs,
        "naive_liar_forwards_until_ban_max": max(naive_until_ban),
        "strategic_liar_forwards_until_ban_p50": statistics.median(ordered),
        "strategic_liar_forwards_until_ban_p95": ordered[int(0.95 * (len(ordered) - 1))],
        "strategic_liar_forwards_until_ban_max": ordered[-1],
        "share_of_runs_banned_within_59": round(sum(n <= 59 for n in ordered) / len(ordered), 4),
        "honest_peers": 7,
        "honest_forwards_each": 1000,
        "honest_banned": banned,
        "honest_ever_excluded": excluded,
    }


def _audit_cost(prompts: int, rate: float, noise_prompts: int) -> dict[str, Any]:
    import torch

    from peerinfer.core.messages import SamplingParams
    from peerinfer.core.prefix import PrefixHasher
    from peerinfer.engine.audit import audit_answer, audit_greedy
    from peerinfer.engine.base import Tokens
    from peerinfer.engine.hf import TransformersEngine

    torch.set_num_threads(1)
    engine = TransformersEngine()
    engine.configure_cache(PrefixHasher(engine.fingerprint))
    serve_s: list[float] = []
    audit_s: list[float] = []
    lengths: list[int] = []
    params = SamplingParams(max_tokens=32)
    for k in range(prompts):
        prompt = engine.tokenize(f"Document {k}. " + " ".join(f"fact {k}.{i} is stated here." for i in range(40)))
        lengths.append(len(prompt))
        for _ in engine.generate(prompt, SamplingParams(max_tokens=1)):
            pass  # the peer was chosen because it holds the prompt: warm its cache
        started = time.perf_counter()
        ids = [t for ev in engine.generate(prompt, params) if isinstance(ev, Tokens) for t in ev.token_ids]
        serve_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        verdict = audit_greedy(engine, prompt, ids)
        audit_s.append(time.perf_counter() - started)
        assert verdict is not None and verdict.ok, verdict
    ratio = sum(audit_s) / sum(serve_s)
    # Honest numeric noise: the same float32 answers re-scored with bfloat16 weights (another
    # precision, as on another device): how many would fail the audit (a false ban)?
    answers = []
    sampled = []  # the same prompts sampled (temperature 0.8, top-p 0.9, a seed each)
    for k in range(prompts, prompts + noise_prompts):
        prompt = engine.tokenize(f"Question {k}: explain, in a few sentences, topic number {k} of " + " ".join(f"item{k}.{i}" for i in range(30)))
        ids = [t for ev in engine.generate(prompt, params) if isinstance(ev, Tokens) for t in ev.token_ids]
        answers.append((prompt, ids))
        hot = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=k)
        ids = [t for ev in engine.generate(prompt, hot) if isinstance(ev, Tokens) for t in ev.token_ids]
        sampled.append((prompt, hot, ids))
    engine.model = engine.model.to(torch.bfloat16)
    false_failures = 0
    for prompt, ids in answers:
        verdict = audit_greedy(engine, prompt, ids)
        assert verdict is not None
        false_failures += not verdict.ok
    sampled_false_failures = 0
    random_caught = 0  # a liar's answer: random ids, same params (bfloat16 model, as above)
    vocab_rng = random.Random(0)
    for prompt, hot, ids in sampled:
        verdict = audit_answer(engine, prompt, hot, ids)
        assert verdict is not None
        sampled_false_failures += not verdict.ok
        fake = [vocab_rng.randrange(engine.vocab_size) for _ in ids]
        verdict = audit_answer(engine, prompt, hot, fake)
        assert verdict is not None
        random_caught += not verdict.ok
    return {
        "model": engine.model_name,
        "prompts": prompts,
        "prompt_tokens_mean": round(statistics.mean(lengths), 1),
        "completion_tokens": 32,
        "serve_s_mean": round(statistics.mean(serve_s), 4),
        "audit_s_mean": round(statistics.mean(audit_s), 4),
        "audit_over_serve": round(ratio, 4),
        "audit_compute_share_at_rate": round(rate * ratio, 5),
        "target_share": round(rate * 1.2, 5),
        "bf16_rescored_honest_answers": len(answers),
        "bf16_rescored_false_failures": false_failures,
        "bf16_rescored_sampled_answers": len(sampled),
        "bf16_rescored_sampled_false_failures": sampled_false_failures,
        "random_sampled_answers_caught": random_caught,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prefixes", type=int, default=20)
    ap.add_argument("--tarpit-requests", type=int, default=60)
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--audit-rate", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=8, help="nodes in the real-node scenarios (--only digest/tarpit), the liar included")
    ap.add_argument("--gap-s", type=float, default=0.0,
                    help="real-node scenarios: pause after each request (announcements are 1 s apart)")
    ap.add_argument("--settle-s", type=float, default=60.0, help="how long the network may take to learn the liar's digest")
    ap.add_argument("--hf", action="store_true", help="also measure the audit cost on the real model")
    ap.add_argument("--cost-prompts", type=int, default=5)
    ap.add_argument("--noise-prompts", type=int, default=10, help="honest answers re-scored in bfloat16 (with --hf)")
    ap.add_argument("--backlog", type=int, default=4, help="never-finishing requests each honest core holds in core_digest_loaded")
    ap.add_argument("--only", choices=("core_digest", "core_digest_loaded", "core_tarpit", "digest", "tarpit", "audit", "audit_cost"), action="append")
    args = ap.parse_args()
    only = set(args.only or ("core_digest", "core_digest_loaded", "core_tarpit", "audit", "audit_cost"))
    out: dict[str, Any] = {}
    if "core_digest" in only:
        out["core_digest"] = _core_network("digest", args.requests, args.prefixes, args.seed)
    if "core_digest_loaded" in only:
        out["core_digest_loaded"] = _core_network("digest", args.requests, args.prefixes, args.seed, args.backlog)
    if "core_tarpit" in only:
        out["core_tarpit"] = _core_network("tarpit", args.requests, args.prefixes, args.seed)
    if "digest" in only:
        out["digest"] = trio.run(_network, "digest", args.requests, args.prefixes, args.seed, args.settle_s, args.nodes, args.gap_s)
    if "tarpit" in only:
        out["tarpit"] = trio.run(_network, "tarpit", args.tarpit_requests, args.prefixes, args.seed, args.settle_s, args.nodes, args.gap_s)
    if "audit" in only:
        out["audit"] = _audit_scenario(args.runs, args.audit_rate, args.seed)
    if "audit_cost" in only and args.hf:
        out["audit_cost"] = _audit_cost(args.cost_prompts, args.audit_rate, args.noise_prompts)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for name, figures in out.items():
            print(name)
            for k, v in figures.items():
                print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
