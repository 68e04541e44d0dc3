"""HTTP API figures on loopback with the simulated engine (docs/performance.md).

Three measurements:

1. **Overhead**: the same request (a short prompt, ``max_tokens`` 8, near-zero engine costs)
   through the libp2p client and through ``POST /v1/completions`` (httpx, keep-alive), both
   against one node process, interleaved; ``overhead_p50_ms`` = p50(HTTP) - p50(libp2p).
2. **SSE first byte**: an in-process node (so the node's and the client's clocks are one
   trio clock): the time from the first token's arrival at the node's door (the sink's
   ``first_token_at``) to the client reading the first byte of the SSE body.
3. **64 concurrent streaming clients** against the node process: errors, and the node's
   resident memory (``/proc/<pid>/status`` VmRSS) before, right after and 2 s after.

``--json`` prints one JSON object; otherwise one line per figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peerinfer.client import Client  # noqa: E402
from peerinfer.core.costmodel import CostModel  # noqa: E402
from peerinfer.engine.simulated import SimulatedEngine  # noqa: E402
from peerinfer.node import Node, NodeOptions  # noqa: E402
from peerinfer.serve import serve_node

#: Engine costs small enough that the front ends' own costs dominate.
FAST = CostModel(prefill_s_per_token=1e-6, cached_s_per_token=1e-7, decode_s_per_token=2e-4,
                 overhead_s=0.0, slots=1)
PROMPT = "the quick brown fox jumps over the lazy dog"
START_TIMEOUT_S = 60.0


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class NodeProcess:
    """``peerinfer node`` (simulated engine) as a child process; stopped on exit."""

    def __init__(self, workdir: Path) -> None:
        costs = workdir / "costs.json"
        costs.write_text(json.dumps(FAST.to_dict()))
        self.argv = [sys.executable, "-m", "peerinfer", "node", "--engine", "simulated",
                     "--costs", str(costs), "--no-mdns", "--listen", "/ip4/127.0.0.1/tcp/0",
                     "--identity", str(workdir / "node.key"), "--http", "127.0.0.1:0"]
        self.log = open(workdir / "node.err", "wb")  # noqa: SIM115
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=self.log, env=env)
        self.addr = ""
        self.url = ""
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self.proc.stdout is not None
        while not (self.addr and self.url):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("the node did not start: " + (workdir / "node.err").read_text())
            line = self.proc.stdout.readline().decode()
            if " listening on " in line and "127.0.0.1" in line:
                self.addr = line.split(" listening on ")[1].strip()
            elif " HTTP API at " in line:
                self.url = line.split(" HTTP API at ")[1].strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


async def overhead(node: NodeProcess, tries: int) -> dict[str, float]:
    p2p: list[float] = []
    web: list[float] = []
    body = {"model": "simulated", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    async with Client.connect(node.addr) as client, httpx.AsyncClient(base_url=node.url) as http:
        for i in range(tries + 10):  # the first 10 of each warm up (connections, caches)
            t = time.perf_counter()
            await client.generate(PROMPT, max_tokens=8)
            a = time.perf_counter() - t
            t = time.perf_counter()
            r = await http.post("/v1/completions", json=body)
            b = time.perf_counter() - t
            assert r.status_code == 200, r.text
            if i >= 10:
                p2p.append(a)
                web.append(b)
    return {
        "libp2p_p50_ms": statistics.median(p2p) * 1e3,
        "http_p50_ms": statistics.median(web) * 1e3,
        "overhead_p50_ms": (statistics.median(web) - statistics.median(p2p)) * 1e3,
        "libp2p_p99_ms": pct(p2p, 0.99) * 1e3,
        "http_p99_ms": pct(web, 0.99) * 1e3,
        "requests_each": tries,
    }


async def sse_first_byte(tries: int) -> dict[str, float]:
    node = Node(NodeOptions(engine="simulated", listen=("/ip4/127.0.0.1/tcp/0",), mdns=False,
                            persist_identity=False, costs=FAST, http="127.0.0.1:0"),
                engine=SimulatedEngine(costs=FAST))
    arrivals: dict[str, float] = {}

    def remember(submission, local):  # type: ignore[no-untyped-def]
        sink = submission._sink
        if sink is not None and sink.first_token_at is not None:
            arrivals[submission.request_id] = sink.first_token_at

    seen: list[tuple[str, float]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_node, node)
        node.request_listeners.append(remember)
        body = {"model": "simulated", "prompt": PROMPT, "max_tokens": 4, "stream": True}
        async with httpx.AsyncClient(base_url=node.http_url) as http:
            for i in range(tries + 10):
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    rid = r.headers["x-request-id"]
                    first_byte = None
                    async for _ in r.aiter_raw():
                        if first_byte is None:
                            first_byte = trio.current_time()
                assert first_byte is not None
                if i >= 10:
                    seen.append((rid, first_byte))
        await trio.sleep(0.5)  # the last handlers leave the door
        nursery.cancel_scope.cancel()
    gaps = [first_byte - arrivals[rid] for rid, first_byte in seen if rid in arrivals]
    assert len(gaps) == len(seen), "a request's arrival time was not recorded"
    return {
        "sse_first_byte_after_token_p50_ms": statistics.median(gaps) * 1e3,
        "sse_first_byte_after_token_p99_ms": pct(gaps, 0.99) * 1e3,
        "sse_requests": len(gaps),
    }


async def concurrent_streams(node: NodeProcess, clients: int, rounds: int) -> dict[str, float]:
    body = {"model": "simulated", "prompt": PROMPT, "max_tokens": 32, "stream": True}
    errors = 0
    done = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=node.url, limits=limits,
                                 timeout=httpx.Timeout(120.0)) as http:
        for _ in range(3):  # warm-up: a few sequential requests
            r = await http.post("/v1/completions", json={**body, "stream": False})
            assert r.status_code == 200
        await trio.sleep(1.0)
        before = rss_bytes(node.proc.pid)

        async def one() -> None:
            nonlocal errors, done
            try:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    lines = [line async for line in r.aiter_lines() if line]
                if r.status_code != 200 or lines[-1] != "data: [DONE]":
                    errors += 1
                else:
                    done += 1
            except httpx.HTTPError:
                errors += 1

        started = time.perf_counter()
        peak = before
        for _ in range(rounds):
            async with trio.open_nursery() as nursery:
                for _ in range(clients):
                    nursery.start_soon(one)
            peak = max(peak, rss_bytes(node.proc.pid))
        took = time.perf_counter() - started
        right_after = rss_bytes(node.proc.pid)
        await trio.sleep(2.0)
        after = rss_bytes(node.proc.pid)
    return {
        "concurrent_clients": clients,
        "rounds": rounds,
        "streams_ok": done,
        "stream_errors": errors,
        "wall_s": took,
        "rss_before_mib": before / 2**20,
        "rss_peak_mib": peak / 2**20,
        "rss_right_after_mib": right_after / 2**20,
        "rss_2s_after_mib": after / 2**20,
        "rss_growth_pct": 100.0 * (after - before) / before,
    }


async def main(args: argparse.Namespace) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="peerinfer-http-bench-") as tmp:
        node = NodeProcess(Path(tmp))
        try:
            out.update(await overhead(node, args.tries))
            out.update(await concurrent_streams(node, args.clients, args.rounds))
        finally:
            node.stop()
    out.update(await sse_first_byte(args.tries))
    out["load_avg_1m"] = os.getloadavg()[0]
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tries", type=int, default=200, help="requests per front end")
    parser.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of concurrent clients")
    arguments = parser.parse_args()
    result = trio.run(main, arguments)
    if arguments.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:40s} {value:.3f}" if isinstance(value, float) else f"{key:40s} {value}")
