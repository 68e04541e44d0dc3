"""Loopback figures for peerinfer.net: request (stream open + 1 round trip), ping, gossip."""

import json
import sys
import time

import trio

from peerinfer.net import HostConfig, open_host


def cfg():
    return HostConfig(
        listen=("/ip4/127.0.0.1/tcp/0",), persist_identity=False, mdns=False, liveness_interval_s=0
    )


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


async def echo(stream):
    async for frame in stream:
        await stream.send(frame)


async def main(tries=50):
    out = {}
    t0 = time.perf_counter()
    async with open_host(cfg()) as a, open_host(cfg()) as b, open_host(cfg()) as c:
        out["start_3_hosts_s"] = time.perf_counter() - t0
        b.set_handler("/bench/echo/1", echo)
        t = time.perf_counter()
        await a.connect(b.listen_addrs()[0])
        out["connect_s"] = time.perf_counter() - t
        await c.connect(b.listen_addrs()[0])
        req = []
        for _ in range(tries):
            t = time.perf_counter()
            await a.request(b.peer_id, "/bench/echo/1", b"x" * 100)
            req.append(time.perf_counter() - t)
        out["request_open_plus_rtt_s"] = req
        stream = await a.open_stream(b.peer_id, "/bench/echo/1")
        rt = []
        for _ in range(tries):
            t = time.perf_counter()
            await stream.send(b"x" * 100)
            await stream.receive()
            rt.append(time.perf_counter() - t)
        await stream.aclose()
        out["round_trip_on_open_stream_s"] = rt
        out["ping_s"] = [await a.ping(b.peer_id) for _ in range(tries)]
        topic = "bench"
        at_b = await b.subscribe(topic)
        at_c = await c.subscribe(topic)
        await a.subscribe(topic)
        with trio.fail_after(10):
            while not (b.peer_id in a.mesh_peers(topic) and c.peer_id in b.mesh_peers(topic)):
                await trio.sleep(0.02)
        one_hop, two_hops = [], []
        for i in range(tries):
            t = time.perf_counter()
            await a.publish(topic, str(i).encode())
            await at_b.receive()
            one_hop.append(time.perf_counter() - t)
            await at_c.receive()
            two_hops.append(time.perf_counter() - t)
            await trio.sleep(0.02)
        out["gossip_1_hop_s"], out["gossip_2_hops_s"] = one_hop, two_hops
    t = time.perf_counter()
    out["note"] = "3 in-process hosts on 127.0.0.1, TCP+Noise+Yamux"
    summary = {
        k: (
            {"p50_ms": round(pct(v, 0.5) * 1e3, 2), "p90_ms": round(pct(v, 0.9) * 1e3, 2)}
            if isinstance(v, list)
            else v
        )
        for k, v in out.items()
    }
    if "--json" in sys.argv:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:32} {v}")


trio.run(main)
