"""Core benchmark: routing decision time, radix match time and anti-entropy sync cost.

Run ``python bench/core_bench.py`` for a table, ``--json`` for one JSON object with the keys
``route_p50_ms_64_peers``, ``route_p50_ms_1024_peers``, ``sync_bytes_ratio_1pct``,
``sync_round_trips_1pct`` and ``match_p50_us_2048`` (plus ``route_cpu_p50_ms_*``: the same
decisions in thread CPU time, which a busy machine's preemption does not inflate). Times are
wall clock (``time.perf_counter``) with the garbage collector on, as in a running node.

What is timed
-------------
*A routing decision*, as the node makes one: hash the chain of a 2,048-token prompt, peek at the
local radix cache (no touch), walk the peer index once (all peers' estimated matches), build one
``Candidate`` per peer, and run the ``cost`` policy. Every peer's replica holds 10,000 block
hashes: a few Zipf-popular shared prefixes (system prompts and documents, 8 to 128 blocks deep)
plus private prefixes. Each probe prompt extends a popular document to 2,048 tokens; a few peers
hold the whole prompt (they served that conversation before), many hold its popular part.

*A radix match*: ``RadixCache.match`` of a 2,048-token prompt that is fully cached.

*Sync*: ``peerinfer.core.antientropy.reconcile_in_memory`` between a 10,000-element digest and a
replica that differs in 1% of its elements (half added, half removed): bytes on the wire against
sending the whole set, and round trips.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peerinfer.core.index import PeerIndex, ReplicaFactory  # noqa: E402
from peerinfer.core.messages import Load  # noqa: E402
from peerinfer.core.prefix import PrefixHasher  # noqa: E402
from peerinfer.core.radix import RadixCache  # noqa: E402
from peerinfer.core.routing import RouteDecision, RouteRequest, make_policy  # noqa: E402
from peerinfer.types import BlockHash, PeerId  # noqa: E402

BLOCK = 16
VOCAB = 49_152
LOCAL = PeerId("12D3KooWLocalNodeBenchxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx")


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass
class Swarm:
    """A peer index over synthetic but realistic replicas, and the probe prompts."""

    index: PeerIndex
    peers: list[PeerId]
    radix: RadixCache
    prompts: dict[int, list[list[int]]]  # probe prompts by length in tokens
    rtt: dict[PeerId, float]
    build_s: float


class Content:
    """Popular shared prefixes: system prompts, and documents that extend them."""

    def __init__(self, hasher: PrefixHasher, rng: random.Random) -> None:
        self.hasher = hasher
        self.systems = [
            [rng.randrange(VOCAB) for _ in range(BLOCK * rng.randint(8, 32))] for _ in range(24)
        ]
        self.docs: list[list[int]] = []
        for _ in range(160):
            base = self.systems[min(int(rng.paretovariate(1.2)) - 1, len(self.systems) - 1)]
            extra = [rng.randrange(VOCAB) for _ in range(BLOCK * rng.randint(16, 96))]
            self.docs.append(base + extra)
        self.doc_chains = [hasher.chain(d) for d in self.docs]

    def popular_doc(self, rng: random.Random) -> int:
        return min(int(rng.paretovariate(1.0)) - 1, len(self.docs) - 1)


def build_swarm(
    n_peers: int,
    blocks_per_peer: int,
    content: Content,
    *,
    seed: int = 1,
    prompt_lengths: Sequence[int] = (2048,),
    prompts_per_length: int = 16,
    replica_factory: ReplicaFactory | None = None,
) -> Swarm:
    """``n_peers`` replicas of ``blocks_per_peer`` hashes each, and probe prompts.

    Every peer caches 4 to 24 Zipf-popular documents (each down to a random depth, prefix
    closed) and, for each probe prompt, with probability ``1/32`` (at least 2 peers in
    expectation) most of that prompt; private prefixes fill the rest.
    """
    t0 = time.perf_counter()
    rng = random.Random(seed)
    hasher = content.hasher
    index = PeerIndex(max_peers=max(4096, n_peers), replica_factory=replica_factory)
    peers = [PeerId(f"12D3KooW{rng.getrandbits(160):040x}") for _ in range(n_peers)]

    # Probe prompts: a popular document extended by a private conversation to the length.
    prompts: dict[int, list[list[int]]] = {}
    prompt_chains: list[list[BlockHash]] = []
    for length in prompt_lengths:
        for _ in range(prompts_per_length):
            doc = content.docs[content.popular_doc(rng)][:length]
            tokens = doc + [rng.randrange(VOCAB) for _ in range(length - len(doc))]
            prompts.setdefault(length, []).append(tokens)
            prompt_chains.append(hasher.chain(tokens))

    deep_share = max(2, n_peers // 32) / n_peers
    now = 100.0
    rtt: dict[PeerId, float] = {}
    for peer in peers:
        digest = index.add_peer(peer).digest
        add = digest.add  # type: ignore[attr-defined]
        # Shared popular prefixes, prefix-closed (a cache evicts leaves first).
        for _ in range(rng.randint(4, 24)):
            chain = content.doc_chains[content.popular_doc(rng)]
            for h in chain[: rng.randint(len(chain) // 4, len(chain))]:
                add(h)
        # A few peers served each probe conversation, most of it or all.
        for chain in prompt_chains:
            if rng.random() < deep_share:
                for h in chain[: rng.randint(len(chain) * 3 // 4, len(chain))]:
                    add(h)
        # Private prefixes fill the rest (never shared, so random hashes serve as well).
        for _ in range(max(0, blocks_per_peer - len(digest))):
            add(BlockHash(rng.getrandbits(64)))
        index.mark_fresh(peer, now - rng.uniform(0.0, 20.0))
        index.set_load(
            peer, Load(rng.choice((0, 0, 0, 1, 2)), rng.choice((0, 1)), rng.choice((1, 2))), now
        )
        rtt[peer] = rng.uniform(0.005, 0.08)

    # The local node's own cache: the most popular documents.
    radix = RadixCache(hasher)
    for d in content.docs[:20]:
        radix.insert(d)
    return Swarm(index, peers, radix, prompts, rtt, time.perf_counter() - t0)


@dataclass
class RouteTiming:
    totals_s: list[float]  # wall clock per decision
    cpu_s: list[float]  # this thread's CPU time per decision (excludes time preempted)
    phases_us: dict[str, float]  # p50 of each phase, timed in separate runs
    reasons: list[str]
    remote_share: float  # fraction of decisions that forwarded

    def p(self, q: float) -> float:
        return percentile(self.totals_s, q) * 1e3

    def cpu_p(self, q: float) -> float:
        return percentile(self.cpu_s, q) * 1e3


def time_route(swarm: Swarm, length: int, repeats: int, seed: int = 2) -> RouteTiming:
    """Time ``repeats`` full routing decisions for the swarm's ``length``-token prompts."""
    hasher = swarm.radix.hasher
    index = swarm.index
    radix = swarm.radix
    rtt = swarm.rtt
    policy = make_policy("cost")
    rng = random.Random(seed)
    prompts = swarm.prompts[length]
    now = 100.0
    local_load = Load(0, 1, 2)
    perf = time.perf_counter

    def decide(tokens: list[int]) -> RouteDecision:
        chain = hasher.chain(tokens)
        local_tokens = radix.match(tokens, touch=False).tokens
        cands = index.candidates(
            chain,
            block_size=BLOCK,
            local_peer=LOCAL,
            local_matched_tokens=local_tokens,
            local_load=local_load,
            now=now,
            rtt_s=rtt,
        )
        return policy.choose(RouteRequest(len(tokens), 128, tuple(chain)), cands, rng)

    for tokens in prompts:  # warm-up
        decide(tokens)
    totals: list[float] = []
    cpu: list[float] = []
    reasons: list[str] = []
    forwarded = 0
    cpu_clock = time.thread_time
    gc.collect()
    for r in range(repeats):
        tokens = prompts[r % len(prompts)]
        c0 = cpu_clock()
        t0 = perf()
        decision = decide(tokens)
        t1 = perf()
        cpu.append(cpu_clock() - c0)
        totals.append(t1 - t0)
        forwarded += not decision.is_local
        if r < len(prompts):
            reasons.append(decision.reason)

    phases: dict[str, list[float]] = {"hash": [], "radix": [], "candidates": [], "policy": []}
    for r in range(max(1, repeats // 2)):
        tokens = prompts[r % len(prompts)]
        t0 = perf()
        chain = hasher.chain(tokens)
        t1 = perf()
        local_tokens = radix.match(tokens, touch=False).tokens
        t2 = perf()
        cands = index.candidates(
            chain,
            block_size=BLOCK,
            local_peer=LOCAL,
            local_matched_tokens=local_tokens,
            local_load=local_load,
            now=now,
            rtt_s=rtt,
        )
        t3 = perf()
        policy.choose(RouteRequest(len(tokens), 128, tuple(chain)), cands, rng)
        t4 = perf()
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            phases[k].append(v)
    return RouteTiming(
        totals,
        cpu,
        {k: statistics.median(v) * 1e6 for k, v in phases.items()},
        reasons,
        forwarded / repeats,
    )


def time_radix_match(prompt_tokens: int = 2048, repeats: int = 2000, seed: int = 4) -> list[float]:
    rng = random.Random(seed)
    hasher = PrefixHasher(b"bench-model")
    cache = RadixCache(hasher)
    tokens = [rng.randrange(VOCAB) for _ in range(prompt_tokens)]
    cache.insert(tokens)
    for _ in range(200):  # other cached prompts sharing the first part
        cache.insert(tokens[: BLOCK * rng.randint(1, 64)] + [rng.randrange(VOCAB) for _ in range(512)])
    assert cache.match(tokens).tokens == prompt_tokens
    perf = time.perf_counter
    times = []
    gc.collect()
    for _ in range(repeats):
        t0 = perf()
        cache.match(tokens)
        times.append(perf() - t0)
    return times


def measure_sync(n: int = 10_000, changed: float = 0.01, seed: int = 5) -> dict[str, float]:
    """One Merkle pull of a replica that differs from a ``n``-element digest in ``changed``.

    Half the changes are removals, half additions (so the counts agree and only the tree can
    find them). The responder's change log does not reach back to the replica's epoch, so the
    pull is a Merkle descent, not a delta. Returns bytes, rounds and the ratio of bytes to
    sending the whole set (one SyncResponse listing every element, through the same codec).
    """
    from peerinfer.core.antientropy import Replica
    from peerinfer.core.digest import LocalDigest
    from peerinfer.core.messages import SyncResponse, encode
    from peerinfer.core.pull_in_memory import reconcile_in_memory

    rng = random.Random(seed)
    elements = [BlockHash(rng.getrandbits(64)) for _ in range(n)]
    replica = Replica()
    for h in elements:
        replica.digest.add(h)
    local = LocalDigest(epoch_base=1_000)
    for h in elements:
        local.block_added(h)
    k = max(1, round(n * changed))
    for h in rng.sample(elements, k // 2):
        local.block_removed(h)
    for _ in range(k - k // 2):
        local.block_added(BlockHash(rng.getrandbits(64)))
    local.seal_epoch()
    full = len(
        encode(SyncResponse(1, local.epoch, local.root, local.count, delta=True,
                            added=tuple(local.digest)))
    )
    out: dict[str, float] = {"n": n, "changed": changed, "full_bytes": full}
    for label, hint in (("", None), ("hinted_", k)):
        trial = Replica()
        for h in elements:
            trial.digest.add(h)
        stats = reconcile_in_memory(trial, local, estimated_difference=hint)
        assert stats.state == "converged", stats
        assert trial.matches(local.root, local.count)
        out[f"{label}bytes"] = stats.bytes_total
        out[f"{label}bytes_ratio"] = stats.bytes_total / full
        out[f"{label}round_trips"] = stats.rounds
        out[f"{label}passes"] = stats.passes
    del replica
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="peerinfer core benchmark")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--repeats", type=int, default=400, help="decisions timed per setting")
    parser.add_argument("--blocks", type=int, default=10_000, help="block hashes per replica")
    parser.add_argument("--no-sweep", action="store_true", help="skip the scaling sweeps")
    args = parser.parse_args(argv)
    sweep = not args.no_sweep and not args.json

    content = Content(PrefixHasher(b"bench-model"), random.Random(1))
    lengths = (256, 512, 1024, 2048, 4096, 8192) if sweep else (2048,)
    peer_counts = (16, 64, 256, 1024) if sweep else (64, 1024)

    results: dict[str, float] = {}
    by_peers: dict[int, RouteTiming] = {}
    by_length: dict[int, RouteTiming] = {}
    builds: dict[int, float] = {}
    memory: dict[int, tuple[int, int]] = {}
    for n_peers in peer_counts:
        swarm = build_swarm(
            n_peers,
            args.blocks,
            content,
            prompt_lengths=lengths if n_peers == 64 else (2048,),
            prompts_per_length=16 if n_peers in (64, 1024) else 8,
        )
        builds[n_peers] = swarm.build_s
        memory[n_peers] = (swarm.index.memory_entries(), swarm.index.replica_blocks())
        by_peers[n_peers] = time_route(swarm, 2048, args.repeats)
        if n_peers == 64:
            for length in lengths:
                by_length[length] = (
                    by_peers[64] if length == 2048 else time_route(swarm, length, args.repeats // 2)
                )
        del swarm
        gc.collect()
    results["route_p50_ms_64_peers"] = round(by_peers[64].p(0.5), 4)
    results["route_p50_ms_1024_peers"] = round(by_peers[1024].p(0.5), 4)
    # The same decisions in CPU time: what they cost without other processes' preemption.
    results["route_cpu_p50_ms_64_peers"] = round(by_peers[64].cpu_p(0.5), 4)
    results["route_cpu_p50_ms_1024_peers"] = round(by_peers[1024].cpu_p(0.5), 4)

    match_times = time_radix_match()
    results["match_p50_us_2048"] = round(percentile(match_times, 0.5) * 1e6, 2)

    sync = measure_sync()
    results["sync_bytes_ratio_1pct"] = round(sync["bytes_ratio"], 5)
    results["sync_round_trips_1pct"] = sync["round_trips"]

    if args.json:
        print(json.dumps(results))
        return 0

    print("Routing decision = hash the prompt's chain + local radix peek + one index walk")
    print("                   + one Candidate per peer + the cost policy")
    print(f"  2,048-token prompts; every replica holds {args.blocks:,} block hashes")
    print("  wall-clock p50/p99 per decision, its CPU-time p50, and each phase's wall p50")
    print(
        f"  {'peers':>6} {'p50 ms':>8} {'p99 ms':>8} {'cpu p50':>8} | {'hash':>6} {'radix':>6} "
        f"{'cands':>6} {'policy':>6} (p50 us) | {'forwarded':>9} {'index entries':>14} "
        f"{'build s':>8}"
    )
    for n_peers, t in by_peers.items():
        ph = t.phases_us
        entries, _ = memory[n_peers]
        print(
            f"  {n_peers:>6} {t.p(0.5):>8.3f} {t.p(0.99):>8.3f} {t.cpu_p(0.5):>8.3f} | "
            f"{ph['hash']:>6.0f} "
            f"{ph['radix']:>6.0f} {ph['candidates']:>6.0f} {ph['policy']:>6.0f}          | "
            f"{t.remote_share:>9.0%} {entries:>14,} {builds[n_peers]:>8.1f}"
        )
    print("  example reasons (64 peers):")
    for r in by_peers[64].reasons[:3]:
        print(f"    {r}")
    if by_length:
        print()
        print("Routing decision by prompt length (64 peers)")
        print(
            f"  {'tokens':>6} {'p50 ms':>8} {'p99 ms':>8} {'cpu p50':>8} | {'hash':>6} "
            f"{'cands':>6} {'policy':>6}"
        )
        for length, t in by_length.items():
            ph = t.phases_us
            print(
                f"  {length:>6} {t.p(0.5):>8.3f} {t.p(0.99):>8.3f} {t.cpu_p(0.5):>8.3f} | "
                f"{ph['hash']:>6.0f} "
                f"{ph['candidates']:>6.0f} {ph['policy']:>6.0f}"
            )
    print()
    print("Radix match of a fully cached 2,048-token prompt (RadixCache.match)")
    print(
        f"  p50 {percentile(match_times, 0.5) * 1e6:.1f} us   "
        f"p99 {percentile(match_times, 0.99) * 1e6:.1f} us"
    )
    print()
    print(
        f"Anti-entropy pull: {sync['n']:,.0f}-element digest, {sync['changed']:.0%} changed "
        f"(half added, half removed), Merkle descent"
    )
    print(f"  {'full set as one listing':>24}: {sync['full_bytes']:>9,.0f} bytes")
    for label, what in (("", "no hint"), ("hinted_", "difference hinted")):
        print(
            f"  {what:>24}: {sync[label + 'bytes']:>9,.0f} bytes "
            f"(ratio {sync[label + 'bytes_ratio']:.4f}), "
            f"{sync[label + 'round_trips']:.0f} round trips, {sync[label + 'passes']:.0f} pass(es)"
        )
    print()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
