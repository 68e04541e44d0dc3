"""``peerinfer sim``: the command line of the simulator (also ``python -m peerinfer.sim``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, NoReturn

from peerinfer.errors import ConfigError, PeerInferError
from peerinfer.sim.config import SIM_POLICY_NAMES, SimConfig, load_costs

_D = SimConfig()


def _cache_tokens(text: str) -> int | None:
    if text.lower() in ("none", "inf", "unbounded"):
        return None
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}") from exc
    if value < 0:
        raise argparse.ArgumentTypeError("the cache capacity must be >= 0")
    return value


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every simulator option to ``parser`` (the ``peerinfer sim`` subcommand uses it)."""
    g = parser.add_argument_group("swarm")
    g.add_argument("--nodes", type=int, default=_D.nodes, help="number of nodes (default %(default)s)")
    g.add_argument(
        "--policy",
        choices=SIM_POLICY_NAMES,
        default=_D.policy,
        help="routing policy of every node (default %(default)s; 'local' is the paper's "
        "no-routing baseline, 'longest_prefix' the paper's router, 'scaffold_hash' Mesh LLM's "
        "cache hints, 'oracle' a central router with exact, instant knowledge: simulator only)",
    )
    g.add_argument(
        "--entries",
        type=int,
        default=_D.entries,
        metavar="E",
        help="arrivals enter at the first E nodes only (0: every node; default %(default)s)",
    )
    g.add_argument(
        "--delay-ms",
        default=_D.delay_ms,
        metavar="SPEC",
        help="one-way link delay in ms: a number, uniform:LO:HI, lognormal:MEDIAN:SIGMA or "
        "exp:MEAN (random specs draw each pair's delay once; default %(default)s)",
    )
    g.add_argument(
        "--forward-overhead-ms",
        type=float,
        default=_D.forward_overhead_ms,
        metavar="MS",
        help="added to the link delay of each forwarded request: opening a stream and handing "
        "over the request, as bench/cluster_bench.py measures it (default %(default)s)",
    )
    g.add_argument(
        "--cache-tokens",
        type=_cache_tokens,
        default=_D.cache_tokens,
        metavar="N",
        help="prefix cache capacity per node in tokens, or 'none' for unbounded "
        "(default %(default)s)",
    )
    g.add_argument(
        "--disk-cache-tokens",
        type=int,
        default=_D.disk_cache_tokens,
        metavar="N",
        help="a disk tier per node of N tokens' KV: evicted blocks spill to it (LRU) and a hit "
        "on them is read back instead of recomputed (0: none; default %(default)s)",
    )
    g.add_argument(
        "--disk-read-mb-s",
        type=float,
        default=_D.disk_read_mb_s,
        metavar="MB_S",
        help="the disk tier's read rate in MB/s (also a pull's disk read; default %(default)s)",
    )
    g.add_argument(
        "--costs",
        metavar="FILE|PRESET",
        help="cost model: a JSON file (the output of 'peerinfer calibrate') or a preset, "
        "'default' (a small model on a CPU), 'batched' (the same, calibrated by batch size "
        "and served 8 at a time) or 'gpu' (a 7-8B model on a home GPU); default: 'default'",
    )
    g.add_argument(
        "--batch",
        action="store_true",
        help="batched nodes: the same as --costs batched (use --slots for another capacity)",
    )
    g.add_argument(
        "--slots",
        type=int,
        metavar="K",
        help="requests each node serves at once, in one batch (its engine's max_batch_size; "
        f"default: the cost model's, {_D.costs.slots} for 'default', 8 for 'batched')",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=_D.max_queue,
        help="a node refuses forwarded requests as busy beyond this many queued "
        "(default %(default)s)",
    )
    g.add_argument(
        "--first-token-timeout",
        type=float,
        default=_D.first_token_timeout_s,
        metavar="S",
        help="a forward gives no first token within S seconds: fail over (default %(default)s)",
    )

    g = parser.add_argument_group("anti-entropy")
    g.add_argument(
        "--announce-interval",
        type=float,
        default=_D.announce_interval_s,
        metavar="S",
        help="each node announces its digest every S seconds (default %(default)s)",
    )
    g.add_argument(
        "--min-announce-gap",
        type=float,
        default=_D.min_announce_gap_s,
        metavar="S",
        help="after a cache change a node announces early, but never within S seconds of its "
        "previous announcement (default %(default)s)",
    )
    g.add_argument(
        "--sync-timeout",
        type=float,
        default=_D.sync_timeout_s,
        metavar="S",
        help="a digest pull (Merkle reconciliation) gives up after S seconds (default %(default)s)",
    )

    g.add_argument(
        "--gossip-loss",
        type=float,
        default=_D.gossip_loss,
        metavar="P",
        help="probability that one delivery of an announcement is lost; the replicas that miss "
        "an epoch then pull (default %(default)s)",
    )

    g = parser.add_argument_group("churn, mixed machines, gossip mesh")
    for name, what in (
        ("crash", "crashes per node-hour (in-flight requests fail over at their origins)"),
        ("leave", "graceful leaves per node-hour (the node drains, then goes)"),
        ("join", "new nodes joining per node-hour (they bootstrap and pull every digest; with "
                 "--disk-cache-tokens a join is the node gone longest restarting warm from its disk)"),
    ):
        g.add_argument(
            f"--{name}-rate",
            type=float,
            default=getattr(_D, f"{name}_rate"),
            metavar="R",
            help=f"{what} (default %(default)s)",
        )
    g.add_argument(
        "--crash-mode",
        choices=("reset", "silent"),
        default=_D.crash_mode,
        help="'reset': a crashed node's connections are reset, streams to it fail at once; "
        "'silent': it vanishes, timeouts and pings tell (default %(default)s)",
    )
    g.add_argument(
        "--mix",
        default=_D.mix,
        metavar="SPEC|FILE",
        help="mixed machines: CLASS:SHARE,... of cost presets (e.g. gpu:0.25,default:0.75) or "
        "a JSON file of classes (name, share, costs, cache_tokens); see peerinfer.sim.mix",
    )
    g.add_argument(
        "--gossip",
        choices=("broadcast", "mesh"),
        default=_D.gossip,
        help="how announcements spread: 'broadcast' (direct to every node, what the real node "
        "measures) or 'mesh' (gossipsub's mesh: degree, heartbeats, hops, IHAVE/IWANT) "
        "(default %(default)s)",
    )
    g.add_argument("--mesh-degree", type=int, default=_D.mesh_degree, metavar="D",
                   help="the mesh's degree D (default %(default)s)")
    g.add_argument("--mesh-heartbeat", type=float, default=_D.mesh_heartbeat_s, metavar="S",
                   help="the mesh's heartbeat interval (default %(default)s)")

    g = parser.add_argument_group("workload")
    g.add_argument(
        "--requests", type=int, default=_D.requests, help="requests to simulate (default %(default)s)"
    )
    g.add_argument(
        "--workload",
        default=_D.workload,
        metavar="mmlu|multiturn|rag|FILE",
        help="MMLU 5-shot prompts (prefix: a subject's dev examples, suffix: a test question), "
        "synthetic multi-turn conversations, RAG-style prompts (long documents, drawn by "
        "--skew, under four system prompts), or a workload file saved by peerinfer.workload "
        "(default %(default)s)",
    )
    g.add_argument(
        "--skew",
        default=_D.skew,
        metavar="uniform|zipf:A|hot:K",
        help="popularity of subjects: uniform, Zipf with exponent A, or K hot subjects taking "
        "most requests (default %(default)s)",
    )
    g.add_argument(
        "--data",
        metavar="DIR",
        help="MMLU directory with dev/ and test/ CSVs (default: the excerpt packaged with "
        "peerinfer)",
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="tokens generated per request (default: the workload's)",
    )
    g.add_argument(
        "--rate",
        type=float,
        default=_D.rate,
        metavar="R",
        help="Poisson arrivals per node per second (default %(default)s; ignored with --clients)",
    )
    g.add_argument(
        "--clients",
        type=int,
        default=_D.clients,
        metavar="C",
        help="closed loop instead of Poisson: C clients, client c attached to node c %% nodes, "
        "each sending its next request when the previous one completes (default: Poisson)",
    )
    g.add_argument(
        "--think-s",
        type=float,
        default=_D.think_s,
        metavar="S",
        help="closed-loop clients wait an exponential time of mean S before their next request "
        "(default %(default)s)",
    )
    g.add_argument("--seed", type=int, default=_D.seed, help="the run's seed (default %(default)s)")

    g = parser.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    g.add_argument("--figures", metavar="DIR", help="write PNG figures of the run into DIR")
    g.add_argument(
        "--series",
        type=int,
        default=0,
        metavar="K",
        help="add to the JSON the per-node share over time of the K most frequent subjects",
    )
    g.add_argument(
        "--share-window",
        type=int,
        default=_D.share_window,
        metavar="N",
        help="moving window (requests) of the subject share series (default %(default)s)",
    )
    g.add_argument(
        "--share-stride",
        type=int,
        default=_D.share_stride,
        metavar="N",
        help="stride (requests) of the subject share series (default %(default)s)",
    )
    g.add_argument(
        "--check",
        action="store_true",
        help="verify the run's invariants at the end (every request completed once, nothing "
        "left queued)",
    )
    g.add_argument("--profile", metavar="FILE", help="write a cProfile of the run to FILE")
    g.add_argument(
        "--memory",
        action="store_true",
        help="add what the run cost the machine: replica entries and measured replica bytes per "
        "node, CPU seconds, peak resident memory ('memory' and 'usage' in the JSON)",
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The ``SimConfig`` the parsed arguments describe."""
    costs = _D.costs
    source = "default"
    if getattr(args, "batch", False):
        if args.costs and args.costs != "batched":
            raise ConfigError("--batch is --costs batched: give one of them")
        args.costs = "batched"
    if args.costs:
        costs = load_costs(args.costs)
        source = str(args.costs)
    if args.slots is not None:
        costs = costs.with_slots(args.slots)
    return SimConfig(
        nodes=args.nodes,
        requests=args.requests,
        policy=args.policy,
        entries=args.entries,
        delay_ms=str(args.delay_ms),
        forward_overhead_ms=args.forward_overhead_ms,
        announce_interval_s=args.announce_interval,
        min_announce_gap_s=args.min_announce_gap,
        sync_timeout_s=args.sync_timeout,
        cache_tokens=args.cache_tokens,
        disk_cache_tokens=args.disk_cache_tokens,
        disk_read_mb_s=args.disk_read_mb_s,
        costs=costs,
        costs_source=source,
        rate=args.rate,
        clients=args.clients,
        think_s=args.think_s,
        workload=args.workload,
        skew=args.skew,
        data=args.data,
        max_tokens=args.max_tokens,
        max_queue=args.max_queue,
        first_token_timeout_s=args.first_token_timeout,
        gossip_loss=args.gossip_loss,
        crash_rate=args.crash_rate,
        leave_rate=args.leave_rate,
        join_rate=args.join_rate,
        crash_mode=args.crash_mode,
        mix=args.mix,
        gossip=args.gossip,
        mesh_degree=args.mesh_degree,
        mesh_heartbeat_s=args.mesh_heartbeat,
        seed=args.seed,
        share_window=args.share_window,
        share_stride=args.share_stride,
    )


def format_table(summary: dict[str, Any]) -> str:
    """A short human-readable report of one run."""
    p = summary["params"]
    ae = summary["anti_entropy"]
    lines = [
        f"peerinfer sim: {p['nodes']} nodes, {summary['requests']} requests, policy {p['policy']}, "
        f"delay {p['delay_ms']} ms, workload {p['workload']} ({p['skew']}), seed {p['seed']}",
        f"  costs {p['costs_source']}, {p['costs']['slots']} slot(s) per node"
        + (", batched by the measured decode step times" if p["costs"].get("decode_step_s_by_batch") else ""),
        "",
        f"  {'':<22}{'mean':>10}{'p50':>10}{'p99':>10}",
        f"  {'TTFT (s)':<22}{summary['ttft_mean_s']:>10.4f}{summary['ttft_p50_s']:>10.4f}"
        f"{summary['ttft_p99_s']:>10.4f}",
        f"  {'latency (s)':<22}{summary['latency_mean_s']:>10.4f}"
        f"{summary['latency_p50_s']:>10.4f}{summary['latency_p99_s']:>10.4f}",
        "",
        f"  token hit ratio        {summary['hit_ratio']:.3f}",
        f"  forwarded              {summary['forwarded_fraction']:.3f} of requests "
        f"({summary['failovers']} failovers, {summary['rejected']} rejected)",
        f"  load                   busiest node served {summary['load']['served_max_over_mean']}x "
        f"the mean; max utilization {summary['load']['utilization_max']}",
        f"  anti-entropy           {ae['bytes']:,} bytes ({ae['bytes_per_request']} per request), "
        f"{ae['announces']} announcements, {ae['pulls_started']} pulls / "
        f"{ae['pull_round_trips']} round trips",
    ]
    churn = summary.get("churn")
    if churn:
        routed = churn["newcomer_first_routed_s_mean"]
        lines.append(
            f"  churn                  {churn['crashes']} crashes, {churn['leaves']} leaves, "
            f"{churn['joins']} joins; {churn['lost']} lost, {churn['orphaned']} orphaned; "
            f"newcomers first routed to after {routed} s on average"
        )
    for name, row in (summary.get("mix") or {}).items():
        lines.append(
            f"  machines {name:<14}{row['nodes']} nodes served {row['served_share']:.3f} of "
            f"requests ({row['served_per_node']} each), utilization {row['utilization_mean']}, "
            f"TTFT {row['ttft_mean_s']} s"
        )
    mem, use = summary.get("memory"), summary.get("usage")
    if mem and use:
        lines.append(
            f"  replicas               {mem['replica_entries_per_node']:,} entries per node, "
            f"{mem['index_bytes_per_node'] / 1e6:.2f} MB per node (measured on "
            f"{len(mem['sampled_nodes'])} nodes); run: {use['cpu_s']} s CPU, peak RSS "
            f"{use['peak_rss_mb']} MB"
        )
    spec = summary.get("specialization") or {}
    if spec.get("subject"):
        lines.append(
            f"  top subject            {spec['subject']}: largest node share "
            f"{spec['top_share_mean']} on average, leader changed {spec['leader_changes']} times"
        )
    lines += [
        "",
        f"  virtual time {summary['virtual_s']} s, {summary['events']:,} events, wall "
        f"{summary['wall_s']} s ({summary['requests_per_wall_s']} requests/s)",
    ]
    return "\n".join(lines)


def run_sim_command(args: argparse.Namespace) -> int:
    """Run ``peerinfer sim`` with parsed arguments; returns the exit status."""
    from peerinfer.sim.metrics import ProcessUsage, replica_memory
    from peerinfer.sim.run import simulate

    usage = ProcessUsage()
    try:
        config = config_from_args(args)
        if args.profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            sim, summary = simulate(config, series=args.series, check=args.check)
            profiler.disable()
            profiler.dump_stats(args.profile)
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
        else:
            sim, summary = simulate(config, series=args.series, check=args.check)
        if getattr(args, "memory", False):
            summary["usage"] = usage.figures()
            summary["memory"] = replica_memory(sim)
        if args.figures:
            from peerinfer.sim.figures import run_figures

            paths = run_figures(sim, summary, args.figures)
            summary["figures"] = [str(p) for p in paths]
    except PeerInferError as exc:
        print(f"peerinfer sim: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(format_table(summary))
        for path in summary.get("figures", []):
            print(f"  figure: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="peerinfer sim",
        description="Simulate a peerinfer swarm in virtual time: every node runs the real routing "
        "and anti-entropy logic (NodeCore) with a simulated engine; prints latency, cache hit "
        "ratio, load and anti-entropy cost.",
    )
    add_sim_arguments(parser)
    return run_sim_command(parser.parse_args(argv))


def exit_skipping_teardown(status: int) -> NoReturn:
    """End a finished simulator command without freeing its heap object by object.

    A large run ends with tens of millions of live objects (the nodes' replicas, their indexes,
    the runs of announcements, many of them in cycles the kernel froze out of the collector's
    sight). CPython's exit frees each one: after 1,024 nodes x 100,000 requests printed its
    figures, the process took another 68 s of wall time and ~45 s of CPU to end, while the
    operating system takes the pages back at once. Only for a process's last act, where
    nothing of ours waits on a finalizer: output and logs are flushed first. Programs that call
    ``main`` or ``run_sim_command`` themselves (tests) keep their normal exit."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (closed or gone: nothing more can reach it anyway)
            pass
    logging.shutdown()
    os._exit(status)


__all__ = [
    "add_sim_arguments", "config_from_args", "exit_skipping_teardown", "format_table", "main",
    "run_sim_command",
]
