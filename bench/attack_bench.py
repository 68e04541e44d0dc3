"""Issues 11 and 21's attacks, measured: prints the figures docs/security.md reports.

    PYTHONPATH=. python bench/attack_bench.py [--flood-s 60] [--fair-s 60]
        [--only dial,flood,forged,clock,slots,keys,jain]

* ``dial``: how long a wrong-key and a keyless host take to be refused by a private member
  (10 tries each; the target is < 2 s).
* ``flood``: two ``peerinfer node`` processes (simulated engine, default replica budget); one
  attacker identity, connected to node 0 only, publishes valid announcements of fresh hashes
  as fast as its gossip pacer lets it for ``--flood-s`` seconds; prints both nodes' resident
  memory (VmRSS) before and after, and node 0's view of the attacker (target: < 50 MB growth).
* ``forged``: 300 identities' announcements relayed over one connection to an in-process node,
  claiming the blocks of the prompt asked next: members, forwards, dials, request latency.
* ``clock``: three in-process nodes; one node's wall clock steps by -300 s or +700 s, or is
  skewed by 15 minutes from the start; is it still a candidate everywhere 12 s later, and how
  many announcements did it take in meanwhile?

* ``slots`` (issue 21): one peer opens 32 generate streams, each for the node's maximal
  ``max_tokens`` (the default, 2,048), on a 4-slot node (simulated engine), and reads them; an
  honest peer asks for 4 tokens once alone and then four at once. Prints the honest TTFT
  against 2x its idle TTFT + 1 s, the flooder's running slots while the honest peer waited
  (its yields made; and the raw maximum, the yield's own step included), what of the flood
  was admitted, refused as busy or lost, and whether every preempted completion is the
  engine's own. Then the same without preemption (``preempt_after_tokens=None``), the ratio.
* ``keys``: the same flood through the HTTP API from one API key, the honest request from
  another key.
* ``jain``: 8 requesters x 8 requests of mixed lengths (64 to 2,048 tokens) at once on the same
  4-slot node; the tokens streamed to each requester in the first ``--fair-s`` seconds (every
  requester still has work then); Jain's index, with and without preemption.

Prints one JSON object per figure. Every network address is 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: E402
from libp2p.peer.id import ID  # noqa: E402
from libp2p.pubsub.pb import rpc_pb2  # noqa: E402
from libp2p.pubsub.validators import PUBSUB_SIGNING_PREFIX  # noqa: E402

from peerinfer.client import Client  # noqa: E402
from peerinfer.core.costmodel import CostModel  # noqa: E402
from peerinfer.core.digest import LocalDigest  # noqa: E402
from peerinfer.core.messages import Announce, Load, encode  # noqa: E402
from peerinfer.engine.simulated import SimulatedEngine  # noqa: E402
from peerinfer.errors import PeerUnavailableError  # noqa: E402
from peerinfer.net import HostConfig, open_host  # noqa: E402
from peerinfer.node import Node, NodeOptions, announce_topic  # noqa: E402
from peerinfer.serve import serve_node
from peerinfer.testing import open_cluster  # noqa: E402
from peerinfer.types import BlockHash, PeerId  # noqa: E402

COSTS = CostModel(
    prefill_s_per_token=0.0002, cached_s_per_token=0.00001, decode_s_per_token=0.001,
    overhead_s=0.002, slots=1,
)
PROMPT = " ".join(f"word{i}" for i in range(200))


def emit(name: str, **figures: object) -> None:
    print(json.dumps({"figure": name, **figures, "loadavg": os.getloadavg()[0]}), flush=True)


def host_config(**overrides: object) -> HostConfig:
    base: dict[str, object] = dict(
        listen=("/ip4/127.0.0.1/tcp/0",), persist_identity=False, mdns=False,
        liveness_interval_s=0, stream_timeout_s=5.0, announce_interval_s=0.3,
    )
    base.update(overrides)
    return HostConfig(**base)  # type: ignore[arg-type]


def node_options(**overrides: object) -> NodeOptions:
    base: dict[str, object] = dict(
        engine="simulated", listen=("/ip4/127.0.0.1/tcp/0",), mdns=False, persist_identity=False,
        policy="longest_prefix", costs=COSTS, announce_interval_s=0.3, peer_timeout_s=3.0, seed=1,
    )
    base.update(overrides)
    return NodeOptions(**base)  # type: ignore[arg-type]


async def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.05)


def announce_of(digest: LocalDigest, sender: str) -> Announce:
    d = digest.seal_epoch()
    return Announce(
        sender=sender, epoch=d.epoch, prev_epoch=d.prev_epoch, root=d.root, count=d.count,
        load=Load(), added=tuple(d.added), removed=tuple(d.removed), truncated=d.truncated,
        time_ms=int(time.time() * 1000),
    )


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


# ---------------------------------------------------------------------------------- dial


async def dial_refusal(tries: int = 10) -> None:
    key = b"members"
    async with open_host(host_config(swarm_key=key)) as member:
        for label, outsider_key in (("wrong_key", b"guess"), ("no_key", None)):
            times = []
            for _ in range(tries):
                async with open_host(host_config(swarm_key=outsider_key)) as outsider:
                    started = time.perf_counter()
                    try:
                        with trio.fail_after(10):
                            await outsider.connect(member.listen_addrs()[0])
                            while outsider.is_connected(member.peer_id):
                                await trio.sleep(0.005)
                    except PeerUnavailableError:
                        pass
                    times.append(time.perf_counter() - started)
            emit(f"dial_refusal_{label}", tries=tries, p50_s=statistics.median(times),
                 max_s=max(times), refused=member.statistics().admissions_refused)


# ---------------------------------------------------------------------------------- flood


async def flood(duration_s: float, per_message: int) -> None:
    async with open_cluster(2, engine="simulated", announce_interval_s=1.0) as cluster:
        a, b = cluster[0], cluster[1]
        topic = announce_topic(SimulatedEngine().fingerprint)
        await trio.sleep(3)  # let start-up allocations settle
        before = {"a": rss_mb(a.pid), "b": rss_mb(b.pid)}
        config = host_config(gossip_topics=(topic,), announce_interval_s=1.0)
        async with open_host(config) as attacker:
            await attacker.subscribe(topic)
            await attacker.connect(a.addr)
            await wait_until(lambda: a.peer_id in attacker.mesh_peers(topic), 20)
            digest = LocalDigest()
            rng = random.Random(1)
            sent = 0
            peak = dict(before)
            until = trio.current_time() + duration_s
            while trio.current_time() < until:
                for _ in range(per_message):
                    digest.block_added(BlockHash(rng.getrandbits(64)))
                await attacker.publish(topic, encode(announce_of(digest, attacker.peer_id)))
                sent += 1
                if sent % 50 == 0:
                    peak = {"a": max(peak["a"], rss_mb(a.pid)), "b": max(peak["b"], rss_mb(b.pid))}
            await trio.sleep(2)
            after = {"a": rss_mb(a.pid), "b": rss_mb(b.pid)}
            status = await cluster.status(a)
            seen = [p for p in status["peers"] if p["peer_id"] == attacker.peer_id]
        emit(
            "flood_memory", duration_s=duration_s, announcements=sent, hashes_claimed=len(digest.digest),
            rss_before_mb=before, rss_after_mb=after, rss_peak_mb=peak,
            growth_mb={k: round(max(peak[k], after[k]) - before[k], 1) for k in before},
            attacker_cached_tokens_at_a=seen[0]["cached_tokens"] if seen else 0,
        )


# ---------------------------------------------------------------------------------- forged


def forged_message(topic: str, chain: list[BlockHash], seqno: int) -> tuple[str, rpc_pb2.Message]:
    keys = create_new_key_pair()
    sender = ID.from_pubkey(keys.public_key)
    digest = LocalDigest()
    for h in chain:
        digest.block_added(h)
    msg = rpc_pb2.Message(
        data=encode(announce_of(digest, sender.to_base58())), topicIDs=[topic],
        from_id=sender.to_bytes(), seqno=seqno.to_bytes(8, "big"),
    )
    msg.signature = keys.private_key.sign(PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString())
    msg.key = keys.public_key.serialize()
    return sender.to_base58(), msg


async def start_nodes(nursery: trio.Nursery, *per_node: dict[str, object]) -> list[Node]:
    started: list[Node] = []
    for overrides in per_node:
        extra = dict(overrides)
        if started:
            extra.setdefault("bootstrap", (started[0].addresses()[0],))
        node = Node(node_options(**extra), engine=SimulatedEngine(costs=COSTS))
        await nursery.start(serve_node, node)
        started.append(node)
    return started


def candidate_at(observer: Node, peer: Node) -> bool:
    core = observer.core
    assert core is not None
    pid = PeerId(peer.peer_id)
    return core.is_member(pid) and core.index.digest_age(pid, trio.current_time()) < core.config.max_digest_age_s


async def forged(count: int = 300) -> None:
    async with trio.open_nursery() as nursery:
        a, b = await start_nodes(nursery, {}, {})
        await wait_until(lambda: candidate_at(a, b) and candidate_at(b, a))
        assert a.core is not None and a.engine is not None
        async with Client.connect(a.addresses()[0]) as client:
            t = time.perf_counter()
            await client.generate(PROMPT + " before", max_tokens=4)
            before_s = time.perf_counter() - t
        chain = a.core.hasher.chain(a.engine.tokenize(PROMPT + " after"))
        config = host_config(gossip_topics=(a.topic,))
        async with open_host(config) as attacker:
            await attacker.subscribe(a.topic)
            await attacker.connect(a.addresses()[0])
            await wait_until(lambda: a.peer_id in attacker.mesh_peers(a.topic), 20)
            ids = []
            for i in range(count):
                sender, msg = forged_message(a.topic, chain, i + 1)
                ids.append(sender)
                await attacker._pubsub.push_msg(attacker._pubsub.my_id, msg)
                if i % 10 == 9:
                    await trio.sleep(0.1)
            await trio.sleep(1.0)
            stats = a.core.statistics()
            async with Client.connect(a.addresses()[0]) as client:
                t = time.perf_counter()
                result = await client.generate(PROMPT + " after", max_tokens=4)
                after_s = time.perf_counter() - t
            candidates = [c.peer for c in a.core.index.candidates(
                chain, block_size=a.core.hasher.block_size, local_peer=a.core.peer_id,
                local_matched_tokens=0, local_load=a.core.load(), now=trio.current_time(),
                rtt_s={}, max_digest_age_s=a.core.config.max_digest_age_s)[1:]]
            emit(
                "forged_identities", identities=count,
                heard=stats.announces_unverified,
                members=sum(a.core.is_member(PeerId(p)) for p in ids),
                candidates=sum(p in ids for p in candidates),
                forwards_total=a.core.statistics().forwarded,
                served_by=("A" if result.served_by == a.peer_id else "B" if result.served_by == b.peer_id
                           else "forged" if result.served_by in ids else result.served_by),
                exchange_dials=a.exchange_dials,
                latency_before_s=round(before_s, 4), latency_after_s=round(after_s, 4),
            )
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------------- slots (21)

FAIR_SLOTS = 4
#: 4 slots, a decode step of about 10 ms: a maximal request (2,048 tokens) runs 20-30 s.
FAIR_COSTS = CostModel(
    prefill_s_per_token=0.0002, cached_s_per_token=0.00001, decode_s_per_token=0.01,
    overhead_s=0.002, slots=FAIR_SLOTS,
)
FLOOD_STREAMS = 32


class ShareWatch:
    """After every core event: the flooder's running slots while another requester waits,
    split into settled (no yield pending) and raw."""

    def __init__(self, node: Node, flooder: str) -> None:
        self.settled: list[int] = []
        self.raw: list[int] = []
        core = node.core
        assert core is not None
        handle = core.handle

        def watched(event: object, now: float) -> object:
            effects = handle(event, now)  # type: ignore[arg-type]
            shares = core.shares
            flood = next((s for (_, who), s in shares.items() if who == flooder), None)
            if flood is not None and any(s.waiting for (_, who), s in shares.items() if who != flooder):
                self.raw.append(flood.running)
                if not flood.yielding:
                    self.settled.append(flood.running)
            return effects

        core.handle = watched  # type: ignore[method-assign,assignment]


def fair_options(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {"costs": FAIR_COSTS, "peer_timeout_s": 20.0}
    base.update(overrides)
    return base


async def flood_one(host: object, node: Node, i: int, max_tokens: int, out: dict[str, object]) -> None:
    from peerinfer.core.messages import (
        ErrorMessage,
        GenerateDone,
        GenerateRequest,
        SamplingParams,
        TokenChunk,
        decode,
    )
    from peerinfer.errors import PeerInferError
    from peerinfer.node import GENERATE_PROTOCOL

    prompt = f"flood number {i} asks for everything"
    try:
        stream = await host.open_stream(node.peer_id, GENERATE_PROTOCOL, timeout=10)  # type: ignore[attr-defined]
        await stream.send(encode(GenerateRequest(
            request_id=f"flood{i}", params=SamplingParams(max_tokens=max_tokens), prompt=prompt)))
        tokens: list[int] = []
        while True:
            msg = decode(await stream.receive(timeout=600), expected=(TokenChunk, GenerateDone, ErrorMessage))
            if isinstance(msg, TokenChunk):
                tokens.extend(msg.token_ids)
            elif isinstance(msg, GenerateDone):
                out["served"] = int(out["served"]) + 1  # type: ignore[call-overload]
                engine = node.engine
                assert isinstance(engine, SimulatedEngine)
                expected = engine.completion_ids(engine.tokenize(prompt), SamplingParams(max_tokens=max_tokens), max_tokens)
                out["exact"] = int(out["exact"]) + (tokens == expected)  # type: ignore[call-overload]
                break
            else:
                key = "busy" if msg.code == "busy" else "other"
                out[key] = int(out[key]) + 1  # type: ignore[call-overload]
                if msg.code == "busy":
                    out["retry_hint_s"] = msg.retry_after_s
                break
        await stream.aclose()
    except PeerInferError as exc:
        out["other"] = int(out["other"]) + 1  # type: ignore[call-overload]
        out["errors"].append(type(exc).__name__)  # type: ignore[attr-defined]


async def slot_flood(preempt: bool) -> None:
    extra = {} if preempt else {"preempt_after_tokens": None}
    async with trio.open_nursery() as nursery:
        (node,) = await start_nodes_with(nursery, FAIR_COSTS, fair_options(**extra))
        max_tokens = node.options.max_tokens
        config = host_config(gossip_topics=(), stream_timeout_s=30.0)
        async with open_host(config) as attacker, Client.connect(node.addresses()[0]) as honest:
            async def ask(prompt: str) -> float:
                return (await honest.generate(prompt, max_tokens=4)).ttft_s
            idle = min([await ask(f"an idle question {i}") for i in range(3)])
            await attacker.connect(node.addresses()[0])
            watch = ShareWatch(node, attacker.peer_id)
            out: dict[str, object] = {"served": 0, "exact": 0, "busy": 0, "other": 0, "errors": [],
                                      "retry_hint_s": 0.0}
            async with trio.open_nursery() as flood:
                for i in range(FLOOD_STREAMS):
                    flood.start_soon(flood_one, attacker, node, i, max_tokens, out)
                await wait_until(lambda: node.core is not None and node.core.load().running >= FAIR_SLOTS, 20)
                await trio.sleep(2.0)
                ttft = await ask("an honest question")
                batch: list[float] = []
                async with trio.open_nursery() as four:
                    for i in range(4):
                        four.start_soon(lambda i=i: _append(batch, ask(f"honest batch {i}")))
            assert node.core is not None
            stats = node.core.statistics()
            ended = int(out["served"]) + int(out["busy"]) + int(out["other"])  # type: ignore[call-overload]
            emit(
                "slot_flood_peer" + ("" if preempt else "_no_preemption"), slots=FAIR_SLOTS,
                streams=FLOOD_STREAMS, max_tokens=max_tokens,
                idle_ttft_s=round(idle, 4), honest_ttft_s=round(ttft, 4),
                bound_s=round(2 * idle + 1.0, 4), within_bound=ttft <= 2 * idle + 1.0,
                honest_batch_ttft_max_s=round(max(batch), 4),
                flooder_slots_while_honest_waited_max=max(watch.settled, default=None),
                flooder_slots_raw_max=max(watch.raw, default=None),
                admitted=int(out["served"]), refused_busy=out["busy"], other=out["other"],  # type: ignore[call-overload]
                errors=out["errors"], lost=FLOOD_STREAMS - ended, retry_hint_s=out["retry_hint_s"],
                completions_exact=f"{out['exact']}/{out['served']}",
                preempted=stats.preempted, resumed=stats.resumed,
            )
        nursery.cancel_scope.cancel()


async def _append(into: list[float], value: object) -> None:
    into.append(await value)  # type: ignore[misc]


async def start_nodes_with(nursery: trio.Nursery, costs: CostModel, overrides: dict[str, object]) -> list[Node]:
    node = Node(node_options(**overrides), engine=SimulatedEngine(costs=costs))
    await nursery.start(serve_node, node)
    return [node]


async def key_flood() -> None:
    import httpx

    from peerinfer.http.app import requester_name

    keys = ("flooder-key-0001", "honest-key-00002")
    async with trio.open_nursery() as nursery:
        (node,) = await start_nodes_with(nursery, FAIR_COSTS, fair_options(http="127.0.0.1:0", api_keys=keys))
        max_tokens = node.options.max_tokens
        out = {"served": 0, "busy": 0, "other": 0}

        async def stream(http: httpx.AsyncClient, key: str, prompt: str, n: int, count: bool) -> float:
            started = trio.current_time()
            first = math.inf
            body = {"model": "simulated", "prompt": prompt, "max_tokens": n, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body,
                                   headers={"authorization": f"Bearer {key}"}) as response:
                if response.status_code != 200:
                    if count:
                        out["busy" if response.status_code == 429 else "other"] += 1
                    return first
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and first == math.inf:
                        first = trio.current_time() - started
                    if line == "data: [DONE]" and count:
                        out["served"] += 1
            return first

        assert node.http_url is not None
        async with httpx.AsyncClient(base_url=node.http_url, timeout=httpx.Timeout(900.0)) as http:
            idle = min([await stream(http, keys[1], f"idle {i}", 4, False) for i in range(3)])
            watch = ShareWatch(node, requester_name(keys[0].encode(), "127.0.0.1"))
            async with trio.open_nursery() as flood:
                for i in range(FLOOD_STREAMS):
                    flood.start_soon(stream, http, keys[0], f"flood {i}", max_tokens, True)
                await wait_until(lambda: node.core is not None and node.core.load().running >= FAIR_SLOTS, 20)
                await trio.sleep(2.0)
                ttft = await stream(http, keys[1], "an honest question", 4, False)
                async with trio.open_nursery() as four:
                    for i in range(4):
                        four.start_soon(stream, http, keys[1], f"honest batch {i}", 4, False)
        emit(
            "slot_flood_api_key", slots=FAIR_SLOTS, streams=FLOOD_STREAMS, max_tokens=max_tokens,
            idle_ttft_s=round(idle, 4), honest_ttft_s=round(ttft, 4), bound_s=round(2 * idle + 1.0, 4),
            within_bound=ttft <= 2 * idle + 1.0,
            flooder_slots_while_honest_waited_max=max(watch.settled, default=None),
            flooder_slots_raw_max=max(watch.raw, default=None),
            admitted=out["served"], refused_busy=out["busy"], other=out["other"],
            lost=FLOOD_STREAMS - sum(out.values()),
        )
        nursery.cancel_scope.cancel()


def jain_index(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else 0.0


async def jain(window_s: float, preempt: bool, quantum: int | None = None) -> None:
    extra: dict[str, object] = {"max_queued_per_requester": 8}
    if not preempt:
        extra["preempt_after_tokens"] = None
    elif quantum is not None:
        extra["preempt_after_tokens"] = quantum
    mix = (64, 256, 2048, 128, 1024, 512, 96, 1536)
    served = dict.fromkeys(range(8), 0)
    async with trio.open_nursery() as nursery:
        (node,) = await start_nodes_with(nursery, FAIR_COSTS, fair_options(**extra))

        async def requester(r: int) -> None:
            def count(text: str) -> None:
                served[r] += 1

            async with Client.connect(node.addresses()[0], timeout_s=900) as client, trio.open_nursery() as n:
                for k in range(8):
                    n.start_soon(lambda k=k: client.generate(
                        f"requester {r} request {k}", max_tokens=mix[(r + k) % 8], on_text=count))

        async with trio.open_nursery() as users:
            for r in range(8):
                users.start_soon(requester, r)
            await wait_until(lambda: node.core is not None and len(node.core.shares) == 8, 60)
            start = dict(served)
            await trio.sleep(window_s)
            window = [float(served[r] - start[r]) for r in range(8)]
            active = len(node.core.shares) if node.core is not None else 0
            users.cancel_scope.cancel()
        stats = node.core.statistics() if node.core is not None else None
        emit("jain_8_requesters" + ("" if preempt else "_no_preemption"), window_s=window_s,
             quantum=node.options.preempt_after_tokens if preempt else None,
             requests=64, tokens_per_requester=window, tokens=sum(window),
             jain=round(jain_index(window), 4),
             requesters_still_active_at_end=active,
             preempted=stats.preempted if stats else None)
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------------- clock


class SteppedClock:
    def __init__(self, offset_s: float = 0.0) -> None:
        self.offset_s = offset_s

    def __call__(self) -> float:
        return time.time() + self.offset_s


async def clock(watch_s: float = 12.0) -> None:
    for label, skew, step in (("step-300s", 0.0, -300.0), ("step+700s", 0.0, 700.0),
                              ("skew15min", 900.0, 0.0)):
        wall = SteppedClock(skew)
        async with trio.open_nursery() as nursery:
            a, b, c = await start_nodes(nursery, {}, {}, {"wall_clock": wall})
            others = (a, b)
            await wait_until(
                lambda c=c, others=others: all(candidate_at(o, c) and candidate_at(c, o) for o in others), 60
            )
            assert c.core is not None
            wall.offset_s += step
            refused_before = c.core.statistics().announces_refused
            epochs = {o.peer_id: c.core.index.replica(PeerId(o.peer_id)).epoch for o in (a, b)}  # type: ignore[union-attr]
            dropped = 0
            until = trio.current_time() + watch_s
            while trio.current_time() < until:
                dropped += sum(not candidate_at(o, c) for o in (a, b))
                await trio.sleep(0.1)
            advanced = {o.peer_id[-6:]: c.core.index.replica(PeerId(o.peer_id)).epoch - epochs[o.peer_id]  # type: ignore[union-attr]
                        for o in (a, b)}
            emit(f"clock_{label}", watch_s=watch_s, samples_not_candidate=dropped,
                 epochs_taken_in=advanced,
                 announces_refused=c.core.statistics().announces_refused - refused_before)
            nursery.cancel_scope.cancel()


async def main(args: argparse.Namespace) -> None:
    only = set(args.only.split(","))
    if "slots" in only:
        await slot_flood(preempt=True)
        await slot_flood(preempt=False)
    if "keys" in only:
        await key_flood()
    if "jain" in only:
        await jain(args.fair_s, preempt=True, quantum=args.quantum)
        if args.quantum is None:
            await jain(args.fair_s, preempt=False)
    if "dial" in only:
        await dial_refusal()
    if "forged" in only:
        await forged()
    if "clock" in only:
        await clock()
    if "flood" in only:
        await flood(args.flood_s, args.per_message)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood-s", type=float, default=60.0)
    parser.add_argument("--per-message", type=int, default=100, help="fresh hashes per flood announcement")
    parser.add_argument("--fair-s", type=float, default=60.0, help="the Jain window, seconds")
    parser.add_argument("--quantum", type=int, help="jain: only the preemption run, with this preempt_after_tokens")
    parser.add_argument("--only", default="dial,forged,clock,flood,slots,keys,jain")
    trio.run(main, parser.parse_args())
