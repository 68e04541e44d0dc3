"""Circuit relay and hole punching on the emulated internet (peerinfer.testing.netns).

Per run: a relay in ``pub``, a destination behind a NAT (``--dest home2``: cone NAT, or
``home3``: symmetric NAT) that reserves a slot, a source in ``home1`` (cone NAT) that dials the
destination through the relay, times 30 echo requests (each on a new stream), then tries a
DCUtR hole punch and times 30 more; and 30 straight to the relay for comparison.
Prints one JSON object. Needs root and nft. Usage::

    python bench/reach_bench.py --dest home2 --runs 3 [--swarm-key K]
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
            return result
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dest", default="home2", choices=("home2", "home3"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--swarm-key")
    args = p.parse_args()
    runs = [one_run(args.dest, args.swarm_key) for _ in range(args.runs)]
    ok = [r for r in runs if isinstance(r.get("relay_dial"), dict) and r["relay_dial"]["event"] == "relay_dial_ok"]
    punched = [r for r in ok if r["dcutr"]["ok"]]
    relayed_p50 = [r["rtt"]["relayed_before_punch_p50_ms"] for r in ok]
    after_p50 = [r["rtt"]["after_punch_p50_ms"] for r in ok]
    direct_p50 = [r["rtt"]["direct_to_relay_p50_ms"] for r in ok if r["rtt"]["direct_to_relay_p50_ms"]]
    print(json.dumps({
        "dest": args.dest, "nat": "cone" if args.dest == "home2" else "symmetric",
        "runs": args.runs, "relayed_ok": len(ok), "hole_punched": len(punched),
        "reserve_s_median": statistics.median(r["reserve_s"] for r in ok) if ok else None,
        "relayed_dial_s_median": statistics.median(r["relay_dial"]["s"] for r in ok) if ok else None,
        "punch_s_median": statistics.median(r["dcutr"]["s"] for r in punched) if punched else None,
        "request_relayed_p50_ms_median": statistics.median(relayed_p50) if relayed_p50 else None,
        "request_after_punch_p50_ms_median": statistics.median(after_p50) if after_p50 else None,
        "request_direct_to_relay_p50_ms_median": statistics.median(direct_p50) if direct_p50 else None,
        "load": os.getloadavg()[0],
    }))


if __name__ == "__main__":
    main()
