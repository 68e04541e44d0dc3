"""One role of the circuit-relay probe (run inside an emulated-internet namespace; see
bench/reach_bench.py and docs/reach.md). Prints one JSON line per event.

    reach_probe.py relay  --listen MADDR
    reach_probe.py dest   --listen MADDR --relay MADDR/p2p/ID
    reach_probe.py source --listen MADDR --relay MADDR/p2p/ID --target CIRCUIT_MADDR --n N
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import trio

from peerinfer.net import FramedStream, HostConfig, open_host
from peerinfer.net.relay import RelaySettings, open_relay

try:  # hole punching (DCUtR), measured when asked for (--dcutr)
    from libp2p.peer.id import ID
    from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
    from libp2p.tools.anyio_service import background_trio_service
except ImportError:  # pragma: no cover
    DCUtRProtocol = None

ECHO = "/peerinfer-probe/echo/1.0.0"


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def echo(stream: FramedStream) -> None:
    async for frame in stream:
        await stream.send(frame)


async def main(args: argparse.Namespace) -> None:
    cfg = HostConfig(listen=(args.listen,), persist_identity=False, mdns=False,
                     liveness_interval_s=0.0, swarm_key=None if args.swarm_key is None else args.swarm_key.encode())
    async with open_host(cfg) as host:
        host.set_handler(ECHO, echo)
        dcutr = DCUtRProtocol(host._h) if args.dcutr and args.role != "relay" else None
        async with open_relay(host, RelaySettings(service=args.role == "relay")) as relay, \
                contextlib.AsyncExitStack() as stack:
            async def start_dcutr() -> None:
                # Started late: its auto-drive loop punches every relayed connection within
                # 2 s, and the relayed round trips are timed first.
                if dcutr is not None:
                    await stack.enter_async_context(background_trio_service(dcutr))
                    await dcutr.event_started.wait()

            say(event="up", peer_id=host.peer_id, addrs=host.listen_addrs())
            if args.role == "relay":
                await trio.sleep(args.lifetime)
                return
            relay_addr, relay_id = args.relay.rsplit("/p2p/", 1)
            if args.role == "dest":
                t0 = time.monotonic()
                try:
                    addr = await relay.reserve(relay_id, relay_addr)
                    say(event="reserved", addr=addr, s=round(time.monotonic() - t0, 4))
                except Exception as exc:
                    say(event="reserve_failed", error=f"{type(exc).__name__}: {exc}")
                await start_dcutr()
                await trio.sleep(args.lifetime)
                return
            # source
            target_id = args.target.rsplit("/p2p/", 1)[1]
            t0 = time.monotonic()
            try:
                peer = await relay.dial(args.target)
            except Exception as exc:
                say(event="relay_dial_failed", error=f"{type(exc).__name__}: {exc}"[:300])
                return
            say(event="relay_dial_ok", peer=peer, s=round(time.monotonic() - t0, 4))

            async def timed() -> list[float]:
                rtts = []
                for _ in range(args.n):
                    t1 = time.monotonic()
                    reply = await host.request(target_id, ECHO, b"x" * 64, timeout=10)
                    rtts.append(time.monotonic() - t1)
                    assert reply == b"x" * 64
                return rtts

            async def timed_reused() -> list[float]:
                rtts = []
                stream = await host.open_stream(target_id, ECHO, timeout=10)
                async with stream:
                    for _ in range(args.n):
                        t1 = time.monotonic()
                        await stream.send(b"x" * 64)
                        reply = await stream.receive(timeout=10)
                        rtts.append(time.monotonic() - t1)
                        assert reply == b"x" * 64
                return rtts

            async def timed_kept(peer: str) -> list[float]:
                """What a node's repeated forwards to one peer see: each request on the stream
                kept from the last one (Host.take_idle_stream/keep_idle_stream, as
                node/forwarding.py does), the first on a lazily negotiated new one."""
                rtts = []
                for _ in range(args.n):
                    t1 = time.monotonic()
                    stream = host.take_idle_stream(peer, ECHO)
                    if stream is None:
                        stream = await host.open_stream(peer, ECHO, timeout=10, lazy=True)
                    await stream.send(b"x" * 64)
                    reply = await stream.receive(timeout=10)
                    host.keep_idle_stream(stream)
                    rtts.append(time.monotonic() - t1)
                    assert reply == b"x" * 64
                return rtts

            async def timed_spare(peer: str) -> list[float]:
                """What a forward on a spare stream sees (node/forwarding.py opens one, negotiated,
                ahead of the next forward to a peer reached only through a relay): each request
                on a stream opened and negotiated beforehand, untimed, and kept a moment."""
                rtts = []
                while (left := host.take_idle_stream(peer, ECHO)) is not None:
                    await left.aclose()  # those kept by timed_kept would be taken first
                for _ in range(args.n):
                    spare = await host.open_stream(peer, ECHO, timeout=10)
                    host.keep_idle_stream(spare, ttl_s=60.0)
                    await trio.sleep(0.05)
                    t1 = time.monotonic()
                    stream = host.take_idle_stream(peer, ECHO)
                    assert stream is spare
                    await stream.send(b"x" * 64)
                    reply = await stream.receive(timeout=10)
                    rtts.append(time.monotonic() - t1)
                    await stream.aclose()
                    assert reply == b"x" * 64
                return rtts

            async def timed_open() -> list[float]:
                rtts = []
                for _ in range(args.n):
                    t1 = time.monotonic()
                    stream = await host.open_stream(target_id, ECHO, timeout=10)
                    rtts.append(time.monotonic() - t1)
                    await stream.aclose()
                return rtts

            rtts = await timed()
            kept = await timed_kept(target_id)
            spares = await timed_spare(target_id)
            reused = await timed_reused()
            opens = await timed_open()
            say(event="reuse", relayed_reused_p50_ms=round(statistics.median(reused) * 1000, 2),
                relayed_kept_p50_ms=round(statistics.median(kept) * 1000, 2),
                relayed_spare_p50_ms=round(statistics.median(spares) * 1000, 2),
                relayed_open_p50_ms=round(statistics.median(opens) * 1000, 2))
            await start_dcutr()
            if dcutr is not None:
                t0 = time.monotonic()
                ok = False
                with trio.move_on_after(30):
                    try:
                        ok = await dcutr.initiate_hole_punch(ID.from_base58(target_id))
                    except Exception as exc:
                        say(event="dcutr_error", error=f"{type(exc).__name__}: {exc}"[:300])
                conns = [c.muxed_conn.get_remote_address() for c in host._live_connections(ID.from_base58(target_id))]
                say(event="dcutr", ok=ok, s=round(time.monotonic() - t0, 3), remote_addrs=[str(c) for c in conns])
            after = await timed() if dcutr is not None else []
            direct = []
            with trio.move_on_after(10):
                await host.connect(args.relay, timeout=5)
                for _ in range(args.n):
                    t1 = time.monotonic()
                    await host.request(relay_id, ECHO, b"x" * 64, timeout=10)
                    direct.append(time.monotonic() - t1)
                dkept = await timed_kept(relay_id)
                dspares = await timed_spare(relay_id)
                dreused = []
                stream = await host.open_stream(relay_id, ECHO, timeout=10)
                async with stream:
                    for _ in range(args.n):
                        t1 = time.monotonic()
                        await stream.send(b"x" * 64)
                        await stream.receive(timeout=10)
                        dreused.append(time.monotonic() - t1)
                say(event="direct_reuse", direct_reused_p50_ms=round(statistics.median(dreused) * 1000, 2),
                    direct_kept_p50_ms=round(statistics.median(dkept) * 1000, 2),
                    direct_spare_p50_ms=round(statistics.median(dspares) * 1000, 2))
            say(event="rtt", relayed_before_punch_p50_ms=round(statistics.median(rtts) * 1000, 2),
                after_punch_p50_ms=round(statistics.median(after) * 1000, 2) if after else None,
                direct_to_relay_p50_ms=round(statistics.median(direct) * 1000, 2) if direct else None,
                n=args.n)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("relay", "dest", "source"))
    p.add_argument("--listen", required=True)
    p.add_argument("--relay")
    p.add_argument("--target")
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--lifetime", type=float, default=60.0)
    p.add_argument("--swarm-key")
    p.add_argument("--dcutr", action="store_true", help="run DCUtR on dest and source; source tries a hole punch")
    trio.run(main, p.parse_args())
    sys.exit(0)
