"""Probes behind the analyses in docs/evaluation.md: where a simulated run's time and tail go.

Each subcommand prints a few lines; run from the repository root::

    python bench/sim_probes.py announce-cost     # us per recipient: empty / 11-change announcement
    python bench/sim_probes.py split             # event-loop time: announcements vs the rest
    python bench/sim_probes.py tail              # what the slowest requests of hot:2 are made of
    python bench/sim_probes.py service-estimate  # cost's p99 with other mean service times
    python bench/sim_probes.py fingerprint       # a digest of every per-request decision
    python bench/sim_probes.py where             # CPU inside routing, timers, engine, encoding
    python bench/sim_probes.py share-deltas      # CPU with replicas' delta results shared or not

``announce-cost`` times 64 ``NodeCore``s taking the same announcements (no simulator around
them). ``split`` times the simulator's announcement deliveries apart from everything else in the
64-node, 3,840-request run of ``bench/sim_bench.py``. ``tail`` and ``service-estimate`` use the
hot-subject setting of docs/evaluation.md (16 nodes, 4,000 requests, ``default`` costs, 5 ms).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peerinfer.core import routing  # noqa: E402
from peerinfer.core.digest import LocalDigest  # noqa: E402
from peerinfer.core.messages import Announce, Load  # noqa: E402
from peerinfer.core.node import AnnounceReceived, NodeConfig, NodeCore, PeerSeen  # noqa: E402
from peerinfer.core.node import choice as core_node  # noqa: E402  (where make_policy is called)
from peerinfer.core.prefix import PrefixHasher  # noqa: E402
from peerinfer.sim import simulator  # noqa: E402
from peerinfer.sim.config import SimConfig  # noqa: E402
from peerinfer.sim.run import simulate  # noqa: E402
from peerinfer.types import BlockHash, PeerId  # noqa: E402

HOT = SimConfig(
    nodes=16, requests=4000, policy="cost", delay_ms="5", skew="hot:2", cache_tokens=8192,
    rate=0.25, seed=1,
)
HOT_SUBJECTS = ("professional_law", "high_school_statistics")


def announce_cost(announcements: int = 2000, recipients: int = 64) -> None:
    hasher = PrefixHasher(b"probe")
    sender = PeerId(f"12D3KooW{99:044d}")
    cores = [
        NodeCore(NodeConfig(peer_id=PeerId(f"12D3KooW{i:044d}")), hasher,
                 rng=random.Random(i), now=0.0)
        for i in range(recipients)
    ]
    for core in cores:
        core.handle(PeerSeen(sender, rtt_s=0.01), 0.0)
    local = LocalDigest()
    rng = random.Random(1)
    live: list[BlockHash] = []

    def deliver(make_changes: bool, t0: float) -> float:
        batch = []
        for k in range(announcements):
            if make_changes:  # 3 evicted, 8 added: about what one request changes
                for _ in range(3):
                    if live:
                        local.block_removed(live.pop(0))
                for _ in range(8):
                    h = BlockHash(rng.getrandbits(64))
                    live.append(h)
                    local.block_added(h)
            d = local.seal_epoch()
            batch.append(Announce(
                sender=sender, epoch=d.epoch, prev_epoch=d.prev_epoch, root=d.root,
                count=d.count, load=Load(), added=tuple(d.added), removed=tuple(d.removed),
                truncated=d.truncated, time_ms=int((t0 + k) * 1000),
            ))
        started = time.perf_counter()
        for k, a in enumerate(batch):
            ev = AnnounceReceived(sender, a)
            for core in cores:
                core.handle(ev, t0 + k)
        return (time.perf_counter() - started) / announcements / recipients * 1e6

    changes = deliver(True, 0.0)
    empty = deliver(False, float(announcements))
    pulls = sum(c.statistics().syncs_started for c in cores)
    print(f"{recipients} recipients, {announcements} announcements each kind (pulls: {pulls})")
    print(f"  empty announcement:      {empty:6.2f} us per recipient")
    print(f"  11-change announcement:  {changes:6.2f} us per recipient")


def split(nodes: int = 64, requests: int = 3840, skew: str = "zipf:1.1", cpu: bool = False) -> None:
    """With ``cpu``, times are CPU seconds of this process (fairer on a shared machine)."""
    clock = time.process_time if cpu else time.perf_counter
    totals = {"empty": [0.0, 0], "changes": [0.0, 0]}
    original = simulator.Simulation._gossip

    def timed(self: simulator.Simulation, item: tuple, now: float) -> None:
        started = clock()
        original(self, item, now)
        a = item[4].announce
        entry = totals["changes" if a.added or a.removed else "empty"]
        entry[0] += clock() - started
        entry[1] += 1

    simulator.Simulation._gossip = timed  # type: ignore[method-assign]
    try:
        config = SimConfig(nodes=nodes, requests=requests, cache_tokens=8192, delay_ms="5",
                           skew=skew, policy="cost", seed=1)
        started = clock()
        _, s = simulate(config)
        whole = clock() - started
    finally:
        simulator.Simulation._gossip = original  # type: ignore[method-assign]
    loop = whole if cpu else s["loop_s"]
    gossip = sum(t for t, _ in totals.values())
    what = "whole run, CPU" if cpu else "event loop"
    print(f"{nodes} nodes, {requests} requests, {skew}: {what} {loop:.2f} s")
    for kind, (t, n) in totals.items():
        per = t / n / (nodes - 1) * 1e6 if n else 0.0
        print(f"  {kind:8} announcements: {n:6} delivered in {t:5.2f} s ({per:.1f} us per recipient)")
    print(f"  everything else:       {loop - gossip:5.2f} s")


def fingerprint(nodes: int = 64, requests: int = 3840, skew: str = "zipf:1.0") -> None:
    """Print the run's events, hit ratio, mean TTFT and a SHA-256 of every per-request decision
    and outcome (server, forwards, first decision, estimate, expected and actual cached tokens,
    status, first-token and finish times) and every node's statistics: equal digests before and
    after a speed change mean it decided nothing differently."""
    import hashlib

    config = SimConfig(nodes=nodes, requests=requests, cache_tokens=8192, delay_ms="5",
                       skew=skew, policy="cost", seed=1)
    started = time.process_time()
    sim, s = simulate(config)
    cpu = time.process_time() - started
    record = repr((sim.server, sim.forwards, sim.decided, sim.estimate, sim.expected_cached,
                   sim.cached, sim.status, sim.first, sim.finish,
                   [c.statistics() for c in sim.cores]))
    digest = hashlib.sha256(record.encode()).hexdigest()[:16]
    print(f"{nodes} nodes, {requests} requests, {skew}: events {s['events']}, "
          f"hit ratio {s['hit_ratio']}, mean TTFT {s['ttft_mean_s']} s, decisions {digest}, "
          f"wall {s['wall_s']} s, CPU {cpu:.2f} s")


def share_deltas(nodes: int = 64, requests: int = 2000, skew: str = "zipf:1.0") -> None:
    """CPU time of the same run with ``Simulation.share_deltas`` off and on, alternating twice
    (off, on, off, on: a shared machine's load drifts), with the hit ratio and mean TTFT, which
    must not change."""
    config = SimConfig(nodes=nodes, requests=requests, cache_tokens=8192, delay_ms="5",
                       skew=skew, policy="cost", seed=1)
    for share in (False, True, False, True):
        simulator.Simulation.share_deltas = share
        started = time.process_time()
        _, s = simulate(config)
        print(f"{nodes} nodes, {requests} requests, {skew}, shared deltas {'on ' if share else 'off'}: "
              f"CPU {time.process_time() - started:.2f} s, hit ratio {s['hit_ratio']}, "
              f"mean TTFT {s['ttft_mean_s']} s")
    simulator.Simulation.share_deltas = True


def where(nodes: int = 64, requests: int = 10000, skew: str = "zipf:1.0") -> None:
    """CPU time spent inside the methods that visit every peer (and the simulator's engine
    runs and encoding), each wrapped with ``time.process_time``; nested figures overlap
    (``_decide`` holds ``candidates``, ``choose`` and ``_routing_index``; ``tick`` holds the
    liveness loop, the rebalance and the announcing)."""
    from peerinfer.core import index as core_index

    spent: dict[str, float] = {}
    wrapped = [
        (core_index.PeerIndex, "candidates"), (routing.CostPolicy, "choose"),
        (NodeCore, "_routing_index"), (NodeCore, "_check_liveness"), (NodeCore, "_rebalance"),
        (NodeCore, "_maybe_announce"), (NodeCore, "tick"), (NodeCore, "_decide"),
        (simulator.Simulation, "_publish"), (simulator.Simulation, "_run_local"),
    ]
    originals = [(cls, name, getattr(cls, name)) for cls, name in wrapped]

    def timed(name: str, method):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            started = time.process_time()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.process_time() - started
        return call

    for cls, name, method in originals:
        setattr(cls, name, timed(name, method))
    try:
        config = SimConfig(nodes=nodes, requests=requests, cache_tokens=8192, delay_ms="5",
                           skew=skew, policy="cost", seed=1)
        started = time.process_time()
        simulate(config)
        whole = time.process_time() - started
    finally:
        for cls, name, method in originals:
            setattr(cls, name, method)
    print(f"{nodes} nodes, {requests} requests, {skew}: whole run {whole:.2f} s of CPU")
    for name, t in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:16} {t:6.2f} s  {100 * t / whole:5.1f}%")


def tail(policy: str, top: int = 60, warmup: int = 400) -> None:
    from dataclasses import replace

    sim, s = simulate(replace(HOT, policy=policy))
    latency = [sim.finish[i] - sim.arrival[i] for i in range(sim.total)]
    slowest = sorted(range(sim.total), key=latency.__getitem__)[-top:]
    cold = sum(1 for i in slowest if sim.cached[i] < 0.5 * sim.prompt[i])
    early = sum(1 for i in slowest[-40:] if i < warmup)
    steady = sorted(latency[warmup:])
    labels = Counter(sim.workload[i % len(sim.workload)].label for i in slowest)
    hot = sum(n for label, n in labels.items() if label in HOT_SUBJECTS)
    print(f"{policy}: mean {s['latency_mean_s']:.3f} s, p99 {s['latency_p99_s']:.3f} s")
    print(f"  of the {top} slowest: {cold} found less than half their prompt cached, "
          f"{hot} are hot subjects")
    print(f"  of the 40 slowest: {early} are among the first {warmup} requests")
    print(f"  p99 without the first {warmup}: {steady[int(0.99 * len(steady))]:.3f} s")


def service_estimate(values: tuple[float, ...] = (0.8, 1.2, 2.0)) -> None:
    original = routing.make_policy
    for value in (None, *values):

        def make(name: str, *, costs=routing.DEFAULT_COSTS, _v=value, **options):  # type: ignore[no-untyped-def]
            if name == "cost" and _v is not None:
                options.setdefault("mean_service_s", _v)
            return original(name, costs=costs, **options)

        core_node.make_policy = make  # type: ignore[assignment]
        try:
            _, s = simulate(HOT)
        finally:
            core_node.make_policy = original
        label = "the policy's own" if value is None else f"{value:.1f} s"
        print(f"  mean service time {label:>16}: p99 {s['latency_p99_s']:.3f} s, "
              f"mean {s['latency_mean_s']:.3f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "probe",
        choices=("announce-cost", "split", "tail", "service-estimate", "fingerprint", "where",
                 "share-deltas"),
    )
    parser.add_argument(
        "--skew", default=None, help="split, share-deltas: the workload skew (zipf:1.1, zipf:1.0)"
    )
    parser.add_argument("--cpu", action="store_true", help="split: CPU time, not wall time")
    parser.add_argument(
        "--requests", type=int, default=None,
        help="fingerprint: requests (default 3,840); where: requests (default 10,000); "
             "share-deltas: requests (default 2,000)",
    )
    parser.add_argument("--nodes", type=int, default=64, help="share-deltas: nodes")
    parser.add_argument(
        "--eager", action="store_true",
        help="take in every announcement at once (NodeConfig.lazy_announcements=False)",
    )
    args = parser.parse_args(argv)
    if args.eager:
        import functools

        simulator.Simulation.node_overrides = {"lazy_announcements": False}
        core_node_config = functools.partial(NodeConfig, lazy_announcements=False)
        globals()["NodeConfig"] = core_node_config  # announce-cost builds its cores with it
    if args.probe == "announce-cost":
        announce_cost()
    elif args.probe == "split":
        split(skew=args.skew or "zipf:1.1", cpu=args.cpu)
    elif args.probe == "fingerprint":
        fingerprint(requests=args.requests or 3840)
    elif args.probe == "share-deltas":
        share_deltas(nodes=args.nodes, requests=args.requests or 2000, skew=args.skew or "zipf:1.0")
    elif args.probe == "where":
        where(requests=args.requests or 10000)
    elif args.probe == "tail":
        for policy in ("cost", "longest_prefix"):
            tail(policy)
    else:
        print("cost on hot:2 (16 nodes, default costs, 5 ms) with its queue model's mean service")
        service_estimate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
