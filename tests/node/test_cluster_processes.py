"""Clusters of real ``peerinfer node`` processes on 127.0.0.1 (``peerinfer.testing.cluster``).

Each test starts its own nodes as OS processes (simulated engine unless said otherwise), talks
to them only as a client would (``peerinfer.client.Client``: generate and status), and leaves
no process behind: the cluster context manager stops every node, and a test that kills or
stops one checks that it exited. Waits are bounded polls of observable state, never sleeps
standing in for "long enough".
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from peerinfer.client import Client, GenerationResult
from peerinfer.core.costmodel import CostModel
from peerinfer.engine.simulated import DEFAULT_KV_BYTES_PER_TOKEN
from peerinfer.errors import PeerInferError, PeerUnavailableError
from peerinfer.testing import Cluster, ClusterError, NodeHandle, open_cluster
from peerinfer.testing.cluster import convergence_problem
from peerinfer.testing.waiting import wait_for

pytestmark = pytest.mark.slow

BLOCK = 16
#: Fast, but prefill dominates, so where a prompt is cached matters to the cost policy.
FAST = CostModel(
    prefill_s_per_token=0.0004, cached_s_per_token=0.00001, decode_s_per_token=0.002,
    overhead_s=0.002, slots=1,
)
SHARED = " ".join(f"shared{i}" for i in range(300))


def costs_file(tmp_path: Path, costs: CostModel = FAST) -> Path:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs.to_dict()))
    return path


def peer_view(status: dict[str, Any], peer_id: str) -> dict[str, Any] | None:
    return next((p for p in status["peers"] if p["peer_id"] == peer_id), None)


async def knows_holder(
    cluster: Cluster, holder: NodeHandle, askers: list[NodeHandle], min_tokens: int = 256
) -> None:
    """Wait until every asker's view of ``holder`` shows the prefix cached there."""

    def holder_known(statuses: list[dict[str, Any]]) -> bool:
        views = [peer_view(s, holder.peer_id) for s in statuses]
        return all(v is not None and v["cached_tokens"] >= min_tokens for v in views)

    await wait_for(
        lambda: cluster.statuses(askers), holder_known, 30, "the holder's digest reached its peers"
    )


async def generate(addr: str, prompt: str, max_tokens: int, **kw: Any) -> GenerationResult:
    with trio.fail_after(120):
        async with Client.connect(addr, timeout_s=60) as client:
            return await client.generate(prompt, max_tokens=max_tokens, **kw)


# --------------------------------------------------------------------------------------------
# Membership and digests.


@pytest.mark.parametrize(("n", "topology"), [(8, "chain"), (5, "star")])
async def test_bootstrap_converges_to_full_membership(n: int, topology: str, tmp_path: Path) -> None:
    """Node i only knows node i-1 (chain) or node 0 (star) at start; soon each knows all."""
    async with open_cluster(
        n, topology=topology, costs_file=costs_file(tmp_path), wait_converged=False  # type: ignore[arg-type]
    ) as cluster:
        ids = {h.peer_id for h in cluster}
        assert len(ids) == n

        def full(statuses: list[dict[str, Any]]) -> bool:
            return all({p["peer_id"] for p in s["peers"]} == ids - {s["peer_id"]} for s in statuses)

        statuses = await wait_for(cluster.statuses, full, 60, "every node knows every other")
        assert sorted(s["peer_id"] for s in statuses) == sorted(ids)
        processes = [h.process for h in cluster]
    # Leaving the block stopped every process.
    assert all(p.poll() is not None for p in processes)


async def test_a_node_that_cannot_start_fails_the_cluster_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="invalid choice") as info:
        async with open_cluster(2, extra_args=("--policy", "no-such-policy"), workdir=tmp_path):
            raise AssertionError("the cluster should not have started")
    assert "exited with status 2" in str(info.value)
    assert not processes_mentioning(str(tmp_path)), "a node process outlived its cluster"


def processes_mentioning(text: str) -> list[int]:
    """Pids of running processes whose command line contains ``text``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                pids.append(int(entry.name))
    return pids


async def test_digests_converge_after_inserts_and_evictions(tmp_path: Path) -> None:
    """Each node caches prompts (policy 'local': served where sent) in a cache of 128 blocks,
    so most of them are evicted again; every node's view of every other node's cache size
    converges to that node's own figure, after the inserts and again after more evictions.
    (The budget also holds a running request's KV, ~800 tokens here, beside the cache.)"""
    capacity_blocks = 128
    cache_bytes = capacity_blocks * BLOCK * DEFAULT_KV_BYTES_PER_TOKEN
    async with open_cluster(
        4, costs_file=costs_file(tmp_path), policy="local", cache_bytes=cache_bytes
    ) as cluster:

        async def load_round(tag: str) -> None:
            async with trio.open_nursery() as nursery:
                for h in cluster:
                    for k in range(4):
                        # ~800 tokens (50 blocks) each: 4 prompts need more than 128 blocks.
                        text = " ".join(f"{tag}-{h.index}-{k}-w{i}" for i in range(100))
                        nursery.start_soon(generate, h.addr, text, 3)

        for tag in ("first", "second"):
            await load_round(tag)
            statuses = await cluster.wait_converged(30, digests=True)
            assert convergence_problem(statuses, digests=True) is None
            for s in statuses:
                cache = s["cache"]
                assert 0 < cache["tokens"] <= capacity_blocks * BLOCK
                assert cache["bytes"] <= cache["capacity_bytes"] == cache_bytes
                # Every peer's figure as seen here equals that peer's own.
                for other in statuses:
                    if other is not s:
                        view = peer_view(s, other["peer_id"])
                        assert view is not None
                        assert view["cached_tokens"] == other["cache"]["tokens"]


# --------------------------------------------------------------------------------------------
# Routing.


async def test_repeated_prefix_is_forwarded_to_its_holder_and_served_from_cache(
    tmp_path: Path,
) -> None:
    async with open_cluster(3, costs_file=costs_file(tmp_path)) as cluster:
        holder, *askers = list(cluster)
        warm = await generate(holder.addr, SHARED + " warm up", 3)
        assert warm.served_by == holder.peer_id
        await knows_holder(cluster, holder, askers)
        for i, asker in enumerate(askers):
            result = await generate(asker.addr, SHARED + f" question {i}", 3)
            assert result.served_by == holder.peer_id
            assert result.cached_tokens >= 256
            assert result.completion_tokens == 3 and result.text
        # A prompt nobody holds is served where it arrives.
        fresh = await generate(askers[0].addr, "an unrelated prompt " * 30, 3)
        assert fresh.served_by == askers[0].peer_id
        assert fresh.cached_tokens == 0


# --------------------------------------------------------------------------------------------
# Failures.


async def test_killing_a_holder_under_load_loses_no_request(tmp_path: Path) -> None:
    """Six clients keep sending requests for a prefix that one node holds, through the three
    other nodes; that node is SIGKILLed while requests are in flight. Every request completes
    with its full result (forwards to the dead node fail over, or resume elsewhere)."""
    slow = CostModel(
        prefill_s_per_token=0.0004, cached_s_per_token=0.00001, decode_s_per_token=0.03,
        overhead_s=0.002, slots=1,
    )
    max_tokens, per_client = 8, 6
    async with open_cluster(4, costs_file=costs_file(tmp_path, slow)) as cluster:
        *entries, victim = list(cluster)
        await generate(victim.addr, SHARED + " warm", max_tokens)
        await knows_holder(cluster, victim, entries)

        results: list[tuple[float, float, GenerationResult]] = []
        errors: list[BaseException] = []
        served_by_victim = trio.Event()
        killed_at: list[float] = []

        async def client(entry: NodeHandle, c: int) -> None:
            async with Client.connect(entry.addr, timeout_s=60) as conn:
                for k in range(per_client):
                    started = trio.current_time()
                    try:
                        r = await conn.generate(SHARED + f" client {c} question {k}", max_tokens=max_tokens)
                    except PeerInferError as exc:
                        errors.append(exc)
                        continue
                    results.append((started, trio.current_time(), r))
                    if r.served_by == victim.peer_id:
                        served_by_victim.set()

        async def killer() -> None:
            await served_by_victim.wait()
            killed_at.append(trio.current_time())
            victim.kill()

        with trio.fail_after(150):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(killer)
                async with trio.open_nursery() as clients:
                    for c in range(6):
                        clients.start_soon(client, entries[c % len(entries)], c)
                nursery.cancel_scope.cancel()  # the killer, if no request ever reached the victim

        assert not errors, errors
        assert len(results) == 6 * per_client
        assert all(r.completion_tokens == max_tokens for _, _, r in results)
        assert killed_at, "no request was ever served by the holder"
        assert victim.returncode == -signal.SIGKILL
        t_kill = killed_at[0]
        # Requests were outstanding when the holder died (the clients never pause), and every
        # request that started after the kill was served by a survivor.
        assert any(s < t_kill < e for s, e, _ in results)
        after = [r for s, _, r in results if s > t_kill]
        assert after and all(r.served_by != victim.peer_id for r in after)
        for h in entries:
            assert h.alive, h.log_tail()


async def test_sigterm_finishes_the_request_in_flight(tmp_path: Path) -> None:
    """SIGTERM while a request streams: it completes (or ends with a clear 'shutdown' error),
    new requests are refused, and the process exits on its own."""
    slow = CostModel(
        prefill_s_per_token=0.0004, cached_s_per_token=0.00001, decode_s_per_token=0.1,
        overhead_s=0.002, slots=1,
    )
    async with open_cluster(1, costs_file=costs_file(tmp_path, slow)) as cluster:
        (node,) = list(cluster)
        first_text = trio.Event()
        outcome: list[Any] = []

        async def in_flight() -> None:
            try:
                outcome.append(
                    await generate(node.addr, "a long answer please", 25, on_text=lambda _: first_text.set())
                )
            except PeerUnavailableError as exc:
                outcome.append(exc)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(in_flight)
                await first_text.wait()
                node.terminate()
                # While it drains, a new request is refused (or cannot connect at all).
                with pytest.raises(PeerUnavailableError):
                    await generate(node.addr, "too late", 2)
            code = await node.wait_exit(30)
        assert code == 0, node.log_tail()
        (result,) = outcome
        if isinstance(result, PeerUnavailableError):
            assert "shutdown" in str(result)
        else:
            assert result.completion_tokens == 25 and result.finish_reason == "length"


# --------------------------------------------------------------------------------------------
# The real model.


async def test_real_model_prefix_held_elsewhere_is_served_there_with_the_same_text() -> None:
    """Two nodes with the default model (SmolLM2-135M-Instruct, hf engine, CPU). A prompt
    whose prefix node B holds, sent to node A, is served by B from its cache; greedy decoding
    gives exactly the text B gives when asked directly."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    shared = (
        "The following is a conversation between a curious student and a patient teacher about "
        "the history of astronomy, the motion of the planets, the nature of light, and how "
        "telescopes changed what people believed about the sky. The teacher answers briefly, "
        "precisely and kindly, and always gives one concrete example from history. "
    ) * 2
    async with open_cluster(2, engine="hf", extra_args=("--device", "cpu")) as cluster:
        node_a, node_b = list(cluster)
        warm = await generate(node_b.addr, shared + "Student: Who was Kepler?\nTeacher:", 6)
        assert warm.served_by == node_b.peer_id
        await knows_holder(cluster, node_b, [node_a], min_tokens=64)
        prompt = shared + "Student: What did Galileo see?\nTeacher:"
        via_a = await generate(node_a.addr, prompt, 8)
        assert via_a.served_by == node_b.peer_id
        assert via_a.cached_tokens > 0
        direct = await generate(node_b.addr, prompt, 8)
        assert direct.served_by == node_b.peer_id
        assert via_a.text == direct.text and via_a.text.strip()
        assert via_a.completion_tokens == direct.completion_tokens
