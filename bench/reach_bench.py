"""Circuit relay and hole punching on the emulated internet (peerinfer.testing.netns).

Per run: a relay in ``pub``, a destination behind a NAT (``--dest home2``: cone NAT, or
``home3``: symmetric NAT) that reserves a slot, a source in ``home1`` (cone NAT) that dials the
destination through the relay, times 30 echo requests (each on a new stream), 30 as a node's
repeated forwards send them (each on the stream kept from the last: Host.keep_idle_stream),
30 round trips on one open stream and 30 bare stream opens, then tries a DCUtR hole punch and
times 30 more requests; and 30 straight to the relay (new streams, kept stream, one open
stream) for comparison.
Prints one JSON object. Needs root and nft. Usage::

    python bench/reach_bench.py --dest home2 --runs 3 [--swarm-key K]
    python bench/reach_bench.py --join [--dest home3] --runs 3
    python bench/reach_bench.py --heal cut|partition --runs 3 [--announce-interval 1]
    python bench/reach_bench.py --targets --runs 10 --heal-runs 3

``--join``: real ``peerinfer node`` processes instead (pub, home1, and the holder ``--dest``);
the holder caches a prefix as soon as it is up; the time from starting the home nodes until
home1's status lists it as a routing candidate holding it (digest and a ping round trip),
whether home1's next request for that prefix is then served by it, and the path (direct after
hole punching, or relayed). ``--heal``: see :func:`heal_run`. ``--targets``: all of them, as
the ratios of issue 13's targets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from peerinfer.testing.cluster import child_environment
from peerinfer.testing.netns import Internet, emulated_internet

PROBE = str(Path(__file__).with_name("reach_probe.py"))


def start(net: Internet, site: str, role: str, *extra: str) -> subprocess.Popen[bytes]:
    s = net.sites[site]
    with (net.workdir / f"{role}.out").open("wb") as out, (net.workdir / f"{role}.err").open("wb") as err:
        return subprocess.Popen(
            ["ip", "netns", "exec", s.namespace, sys.executable, PROBE, role,
             "--listen", f"/ip4/{s.addr}/tcp/4800", *extra],
            stdout=out, stderr=err, env=child_environment("simulated"),
        )


def events(net: Internet, role: str) -> list[dict[str, object]]:
    try:
        text = (net.workdir / f"{role}.out").read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def wait_event(net: Internet, role: str, names: set[str], timeout_s: float) -> dict[str, object]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for e in events(net, role):
            if e["event"] in names:
                return e
        time.sleep(0.1)
    raise RuntimeError(f"{role}: none of {sorted(names)} within {timeout_s} s:\n"
                       + (net.workdir / f"{role}.err").read_text()[-2000:])


def one_run(dest: str, key: str | None) -> dict[str, object]:
    extra = ("--swarm-key", key) if key else ()
    with emulated_internet() as net:
        procs = []
        try:
            procs.append(start(net, "pub", "relay", "--lifetime", "90", *extra))
            up = wait_event(net, "relay", {"up"}, 60)
            relay = f"/ip4/{net.sites['pub'].addr}/tcp/4800/p2p/{up['peer_id']}"
            procs.append(start(net, dest, "dest", "--relay", relay, "--lifetime", "90", "--dcutr", *extra))
            reserved = wait_event(net, "dest", {"reserved", "reserve_failed"}, 60)
            if reserved["event"] != "reserved":
                return {"reserved": False}
            procs.append(start(net, "home1", "source", "--relay", relay, "--target", str(reserved["addr"]),
                               "--n", "30", "--dcutr", *extra))
            dial = wait_event(net, "source", {"relay_dial_ok", "relay_dial_failed"}, 60)
            result: dict[str, object] = {"reserve_s": reserved["s"], "relay_dial": dial}
            if dial["event"] == "relay_dial_ok":
                result["dcutr"] = wait_event(net, "source", {"dcutr"}, 90)
                result["rtt"] = wait_event(net, "source", {"rtt"}, 90)
                result["reuse"] = wait_event(net, "source", {"reuse"}, 5)
                result["direct_reuse"] = wait_event(net, "source", {"direct_reuse"}, 5)
            return result
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()


SHARED = " ".join(f"shared{i}" for i in range(300))
#: extra flags for every node of --heal (diagnosis: PEERINFER_BENCH_NODE_ARGS="-vv")
EXTRA_NODE_ARGS = os.environ.get("PEERINFER_BENCH_NODE_ARGS", "").split()


def join_run(dest: str = "home2", keep: str | None = None) -> dict[str, object]:
    """pub, home1 and ``dest`` (home2: cone NAT, home3: symmetric) as real nodes: seconds from
    starting the home processes until home1 has ``dest`` as a routing candidate holding the
    prefix ``dest`` cached (digest and a ping round trip), whether home1's next request for it
    is served by ``dest``, and then the path: for a cone NAT the seconds until home1's router
    shows a direct (hole-punched) flow to ``dest``'s router (at most 30 s more), for the
    symmetric NAT whether ``dest``'s router talks to pub only (relayed)."""
    from peerinfer.client import Client
    from peerinfer.core.costmodel import CostModel
    from peerinfer.testing.netns import run_in_netns

    costs = CostModel(prefill_s_per_token=0.002, cached_s_per_token=0.00001,
                      decode_s_per_token=0.002, overhead_s=0.002, slots=1)
    with emulated_internet(workdir=keep) as net:
        path = net.workdir / "costs.json"
        path.write_text(json.dumps(costs.to_dict()))
        args = ["--costs", str(path), *EXTRA_NODE_ARGS]
        pub = net.spawn_node("pub", extra_args=args)
        net.wait_ready([pub])
        t0 = time.monotonic()
        print(f"home nodes started at {time.time():.2f}", file=sys.stderr)
        h1, h2 = (net.spawn_node(h, bootstrap=[pub.addr], extra_args=args) for h in ("home1", dest))
        net.wait_ready([h1, h2])
        ready = time.monotonic() - t0

        def call(site: str, node, fn):  # noqa: ANN001
            async def go():  # noqa: ANN202
                async with Client.connect(node.addr, timeout_s=30) as client:
                    return await fn(client)
            return run_in_netns(net.sites[site].namespace, go)

        call(dest, h2, lambda c: c.generate(SHARED + " warm", max_tokens=3))
        known = None
        for _ in range(600):
            st = call("home1", h1, lambda c: c.status())
            view = next((p for p in st["peers"] if p["peer_id"] == h2.peer_id), None)
            if view is not None and view["cached_tokens"] >= 256 and view["rtt_ms"] is not None:
                known = time.monotonic() - t0
                break
            time.sleep(0.1)
        served = call("home1", h1, lambda c: c.generate(SHARED + " q", max_tokens=3)).served_by
        served_s = time.monotonic() - t0
        result: dict[str, object] = {
            "dest": dest, "processes_ready_s": round(ready, 2),
            "candidate_s": None if known is None else round(known, 2),
            "served_by_holder": served == h2.peer_id, "served_s": round(served_s, 2),
        }
        if dest == "home2":
            direct = None
            end = time.monotonic() + 30
            while time.monotonic() < end:
                if net.sites[dest].uplink in net.established_tcp_peers("home1"):
                    direct = time.monotonic() - t0
                    break
                time.sleep(0.2)
            result["direct_s"] = None if direct is None else round(direct, 2)
        else:
            result["relayed_only"] = net.established_tcp_peers(dest) <= {net.sites["pub"].addr}
        return result


def join_summary(joins: list[dict[str, object]]) -> dict[str, object]:
    """The issue's join and punch ratios over ``join_run`` results."""
    served = [float(r["served_s"]) for r in joins if r["served_by_holder"]]  # type: ignore[arg-type]
    out: dict[str, object] = {
        "runs": len(joins),
        "served_by_holder": len(served),
        "served_within_10s": sum(1 for r in joins if r["served_by_holder"] and float(r["served_s"]) <= 10.0),  # type: ignore[arg-type]
        "served_s_median": round(statistics.median(served), 2) if served else None,
        "processes_ready_s_median": round(statistics.median(float(r["processes_ready_s"]) for r in joins), 2),  # type: ignore[arg-type]
    }
    if any("direct_s" in r for r in joins):
        out["direct_after_hole_punching"] = sum(1 for r in joins if r.get("direct_s") is not None)
    if any("relayed_only" in r for r in joins):
        out["relayed_only"] = sum(1 for r in joins if r.get("relayed_only"))
    return out


def probe_summary(runs: list[dict[str, object]], dest: str) -> dict[str, object]:
    ok = [r for r in runs if isinstance(r.get("relay_dial"), dict) and r["relay_dial"]["event"] == "relay_dial_ok"]
    punched = [r for r in ok if r["dcutr"]["ok"]]
    relayed_p50 = [r["rtt"]["relayed_before_punch_p50_ms"] for r in ok]
    after_p50 = [r["rtt"]["after_punch_p50_ms"] for r in ok]
    direct_p50 = [r["rtt"]["direct_to_relay_p50_ms"] for r in ok if r["rtt"]["direct_to_relay_p50_ms"]]
    overhead = [r["rtt"]["relayed_before_punch_p50_ms"] - r["rtt"]["direct_to_relay_p50_ms"]
                for r in ok if r["rtt"]["direct_to_relay_p50_ms"]]
    kept = [(r["reuse"]["relayed_kept_p50_ms"], r["direct_reuse"]["direct_kept_p50_ms"])
            for r in ok if "relayed_kept_p50_ms" in r.get("reuse", {}) and "direct_kept_p50_ms" in r.get("direct_reuse", {})]
    kept_relayed = [k[0] for k in kept]
    kept_direct = [k[1] for k in kept]
    kept_overhead = [k[0] - k[1] for k in kept]
    spare = [(r["reuse"]["relayed_spare_p50_ms"], r["direct_reuse"]["direct_spare_p50_ms"])
             for r in ok if "relayed_spare_p50_ms" in r.get("reuse", {}) and "direct_spare_p50_ms" in r.get("direct_reuse", {})]
    med = lambda xs: round(statistics.median(xs), 2) if xs else None  # noqa: E731
    return {
        "dest": dest, "nat": "cone" if dest == "home2" else "symmetric",
        "runs": len(runs), "relayed_ok": len(ok), "hole_punched": len(punched),
        "reserve_s_median": med([r["reserve_s"] for r in ok]),
        "relayed_dial_s_median": med([r["relay_dial"]["s"] for r in ok]),
        "punch_s_median": med([r["dcutr"]["s"] for r in punched]),
        "request_relayed_p50_ms_median": med(relayed_p50),
        "request_after_punch_p50_ms_median": med(after_p50),
        "request_direct_to_relay_p50_ms_median": med(direct_p50),
        "relayed_overhead_p50_ms_median": med(overhead),
        # What a node's repeated forwards see (node/forwarding.py): the stream kept from the
        # last request to that peer (Host.keep_idle_stream), relayed against straight to the
        # relay the same way.
        "request_kept_relayed_p50_ms_median": med(kept_relayed),
        "request_kept_direct_to_relay_p50_ms_median": med(kept_direct),
        "relayed_overhead_kept_stream_p50_ms_median": med(kept_overhead),
        # A forward's first request to a relayed peer since the last one's stream went (or
        # ever, once the node has opened it a spare): on a stream opened and negotiated ahead.
        "request_spare_relayed_p50_ms_median": med([x[0] for x in spare]),
        "request_spare_direct_to_relay_p50_ms_median": med([x[1] for x in spare]),
        "relayed_overhead_spare_stream_p50_ms_median": med([x[0] - x[1] for x in spare]),
        # Where the relayed time goes: opening a stream (yamux + multistream negotiation, ~3
        # round trips through the relay) against one round trip on an open stream.
        "relayed_stream_open_p50_ms_median": med([r["reuse"]["relayed_open_p50_ms"] for r in ok if "reuse" in r]),
        "relayed_open_stream_rtt_p50_ms_median": med([r["reuse"]["relayed_reused_p50_ms"] for r in ok if "reuse" in r]),
        "direct_open_stream_rtt_p50_ms_median": med([r["direct_reuse"]["direct_reused_p50_ms"] for r in ok if "direct_reuse" in r]),
    }


def targets(runs: int, heal_runs: int) -> dict[str, object]:
    """Every figure of issue 13's targets on the emulated net, ``runs`` runs each (the heal
    scenarios ``heal_runs`` each, at the default 1 s announce interval)."""
    started = time.monotonic()
    cone = [join_run("home2") for _ in range(runs)]
    sym = [join_run("home3") for _ in range(runs)]
    probe = probe_summary([one_run("home3", None) for _ in range(runs)], "home3")
    heals = {kind: [heal_run(kind, 1.0) for _ in range(heal_runs)] for kind in ("cut", "partition")}
    within = lambda r: r["served_by_holder"] and r["served_s"] <= 10.0  # noqa: E731
    return {
        "runs": runs,
        "cone_joined_and_serving_within_10s": sum(1 for r in cone if within(r)),
        "cone_direct_after_hole_punching": sum(1 for r in cone if r.get("direct_s") is not None),
        "cone_served_s_median": statistics.median(r["served_s"] for r in cone),
        "symmetric_served_through_relay": sum(1 for r in sym if r["served_by_holder"] and r["relayed_only"]),
        "symmetric_served_s_median": statistics.median(r["served_s"] for r in sym),
        "relayed_overhead_over_direct_p50_ms_median": probe["relayed_overhead_p50_ms_median"],
        "relayed_overhead_over_direct_kept_stream_p50_ms_median": probe["relayed_overhead_kept_stream_p50_ms_median"],
        "relayed_overhead_over_direct_spare_stream_p50_ms_median": probe["relayed_overhead_spare_stream_p50_ms_median"],
        "probe": probe,
        "heal": {kind: {
            "runs": len(rs), "lost_requests": sum(r["lost"] for r in rs),
            "requests": sum(r["requests"] for r in rs),
            "reconverged_intervals": [r["reconverged_intervals"] for r in rs],
        } for kind, rs in heals.items()},
        "cone": cone, "symmetric": sym, "heal_runs": heals,
        "wall_s": round(time.monotonic() - started, 1), "load": os.getloadavg(),
    }


def heal_run(kind: str, announce_s: float, keep: str | None = None) -> dict[str, object]:
    """One cut (``kind="cut"``: home2's uplink) or partition ({pub, home1} | {pub2, home2,
    home3}) and its healing, with real nodes announcing every ``announce_s``: requests sent
    during and after (all must be answered), and the time from the heal until every node's view
    of every digest is right again (status timelines, see netns.StatusWatch), in seconds and in
    announce intervals, per node too."""
    from peerinfer.client import Client
    from peerinfer.core.costmodel import CostModel
    from peerinfer.testing.netns import run_in_netns

    costs = CostModel(prefill_s_per_token=0.002, cached_s_per_token=0.00001,
                      decode_s_per_token=0.002, overhead_s=0.002, slots=1)
    with emulated_internet(workdir=keep) as net:
        path = net.workdir / "costs.json"
        path.write_text(json.dumps(costs.to_dict()))
        args = ["--costs", str(path), "--announce-interval", str(announce_s), *EXTRA_NODE_ARGS]
        nodes = {"pub": net.spawn_node("pub", extra_args=args)}
        net.wait_ready([nodes["pub"]])
        if kind == "partition":
            nodes["pub2"] = net.spawn_node("pub2", bootstrap=[nodes["pub"].addr], extra_args=args)
            net.wait_ready([nodes["pub2"]])
        boot = [n.addr for n in nodes.values()]
        for h in ("home1", "home2", "home3"):
            nodes[h] = net.spawn_node(h, bootstrap=boot, extra_args=args)
        net.wait_ready(list(nodes.values()))
        lost = 0
        sent = 0

        def ask(site: str, prompt: str) -> str | None:
            nonlocal lost, sent

            async def go() -> str:
                async with Client.connect(nodes[site].addr, timeout_s=30) as client:
                    return (await client.generate(prompt, max_tokens=3)).served_by
            sent += 1
            try:
                return run_in_netns(net.sites[site].namespace, go)
            except Exception as exc:
                print(f"lost: {site}: {exc}", file=sys.stderr)
                lost += 1
                return None

        words = lambda tag: " ".join(f"{tag}{i}" for i in range(300))  # noqa: E731
        ask("home2", SHARED + " warm")
        ask("home1", words("prea") + " warm")
        with net.watch_statuses(nodes) as watch:
            before_s = watch.wait_converged(time.monotonic(), 120)
            t_split = time.monotonic()
            if kind == "partition":
                net.partition(("pub", "home1"), ("pub2", "home2", "home3"))
            else:
                net.set_uplink("home2", False)
            try:
                for i in range(3):
                    ask("home1", SHARED + f" split {i}")
                ask("home1", words("sidea") + " warm")
                ask("home2", words("sideb") + " warm")
                for i in range(2):
                    ask("home3", words("prea") + f" q{i}")
            finally:
                if kind == "partition":
                    net.heal()
                else:
                    net.set_uplink("home2", True)
            healed = time.monotonic()
            print(f"healed at monotonic {healed:.2f}", file=sys.stderr)
            for i in range(2):
                ask("home1", SHARED + f" healing {i}")
            try:
                heal_s: float | None = watch.wait_converged(healed, 120)
            except Exception as exc:
                print(f"not reconverged: {exc}", file=sys.stderr)
                heal_s = None
            each = watch.converged_each(healed)
            if os.environ.get("PEERINFER_BENCH_TRACE"):
                print("\n".join(watch.problems_timeline(healed)), file=sys.stderr)
        served_after = ask("home1", words("sideb") + " after") == nodes["home2"].peer_id
        return {
            "kind": kind, "announce_s": announce_s, "split_s": round(healed - t_split, 1),
            "converged_before_s": round(before_s, 2),
            "reconverged_s": None if heal_s is None else round(heal_s, 2),
            "reconverged_intervals": None if heal_s is None else round(heal_s / announce_s, 1),
            "per_node_s": {k: None if v is None else round(v - healed, 2) for k, v in each.items()},
            "requests": sent, "lost": lost, "home1_served_by_home2_after": served_after,
        }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dest", default="home2", choices=("home2", "home3"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--swarm-key")
    p.add_argument("--join", action="store_true", help="join runs (real nodes) with --dest as the holder")
    p.add_argument("--heal", choices=("cut", "partition"), help="a cut relay link or a partition, healed")
    p.add_argument("--targets", action="store_true", help="every figure of the issue's targets (--runs each)")
    p.add_argument("--heal-runs", type=int, default=3, help="--targets: runs of each heal scenario")
    p.add_argument("--announce-interval", type=float, default=1.0)
    p.add_argument("--keep", metavar="DIR", help="--heal, --join: keep the node logs in DIR (one run)")
    args = p.parse_args()
    if args.targets:
        print(json.dumps(targets(args.runs, args.heal_runs)))
        return
    if args.heal:
        heals = [heal_run(args.heal, args.announce_interval, args.keep) for _ in range(args.runs)]
        print(json.dumps({"heal": heals, "load": os.getloadavg()[0]}))
        return
    if args.join:
        load_before = os.getloadavg()[0]
        joins = [join_run(args.dest, args.keep) for _ in range(args.runs)]
        print(json.dumps({"summary": join_summary(joins), "join": joins,
                          "load": [round(load_before, 2), round(os.getloadavg()[0], 2)]}))
        return
    runs = [one_run(args.dest, args.swarm_key) for _ in range(args.runs)]
    print(json.dumps({**probe_summary(runs, args.dest), "load": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
