"""The anchors' policies (issue 25): ``scaffold_hash`` (Mesh LLM's cache hints, with their
limits), the simulator's ``oracle`` router, the RAG workload and scaffolds, and the policy
comparison on a seed nothing was tuned on, at small scale."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from peerinfer.core.messages import GenerateRequest, Load, SamplingParams, decode, encode
from peerinfer.core.prefix import PrefixHasher, scaffold_messages
from peerinfer.core.routing import (
    MAX_SCAFFOLD_HINTS,
    SCAFFOLD_HINT_LIFETIME_S,
    RouteRequest,
    ScaffoldHints,
    make_candidate,
    make_policy,
)
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.errors import ConfigError
from peerinfer.sim.config import COST_PRESETS, SimConfig
from peerinfer.sim.run import engine_factory, simulate
from peerinfer.sim.simulator import SimRequest, Simulation
from peerinfer.types import PeerId
from peerinfer.workload import rag_workload

# ---------------------------------------------------------------------------- the hints


def test_hints_keep_at_most_128_scaffolds_forgetting_the_oldest() -> None:
    hints = ScaffoldHints()
    assert MAX_SCAFFOLD_HINTS == 128
    for h in range(MAX_SCAFFOLD_HINTS + 1):
        hints.served(h, now=float(h) * 0.01)
    live = hints.current(2.0)
    assert len(live) == 128 and 0 not in live and live[-1] == 128
    # Serving one again makes it the newest: the next newcomer pushes out another.
    hints.served(1, now=2.0)
    hints.served(1000, now=2.0)
    live = hints.current(2.0)
    assert 1 in live and 2 not in live and 1000 in live and len(live) == 128


def test_a_hint_lives_120_s_after_it_was_last_served() -> None:
    assert SCAFFOLD_HINT_LIFETIME_S == 120.0
    hints = ScaffoldHints()
    hints.served(7, now=10.0)
    hints.served(8, now=50.0)
    assert hints.current(129.9) == (7, 8)
    assert hints.current(130.1) == (8,)
    hints.served(8, now=160.0)  # served again: lives on
    assert hints.current(200.0) == (8,)
    assert hints.current(280.5) == ()


def _cand(peer: str, local: bool, *, scaffolds: tuple[int, ...] = (), queued: int = 0,
          running: int = 0, matched: int = 0):
    load = Load(queued=queued, running=running, slots=1, scaffolds=scaffolds)
    return make_candidate(PeerId(peer), local, matched, load, 0.01, 0.0)


def _route(candidates, scaffold: int | None, seed: int = 0):
    policy = make_policy("scaffold_hash")
    request = RouteRequest(prompt_tokens=600, max_tokens=8, scaffold=scaffold)
    return policy.choose(request, candidates, random.Random(seed))


def test_scaffold_hash_goes_to_the_exact_holder_and_ignores_digests() -> None:
    cands = [
        _cand("a", True),
        _cand("b", False, matched=590),  # a digest says it holds nearly all: not read
        _cand("c", False, scaffolds=(11, 42)),
    ]
    d = _route(cands, 42)
    assert d.target == "c" and not d.is_local and d.ranked[0] == "c"
    assert sorted(d.ranked) == ["a", "b", "c"]
    # No partial or near match: another hash is a miss, and the idle local node wins.
    d = _route(cands, 43)
    assert d.target == "a" and d.is_local
    # No scaffold at all: least loaded (local on a tie).
    assert _route(cands, None).target == "a"


def test_scaffold_hash_spills_when_every_holder_is_busy() -> None:
    cands = [
        _cand("a", True, running=1, queued=2),
        _cand("b", False, running=1, scaffolds=(42,)),
        _cand("c", False),
    ]
    assert _route(cands, 42).target == "c"
    # A free holder beats an idle non-holder; among free holders the less loaded.
    cands.append(_cand("d", False, scaffolds=(42,)))
    assert _route(cands, 42).target == "d"


def test_the_hints_ride_in_the_load_and_are_left_off_when_empty() -> None:
    plain = Load(queued=1, running=1, slots=2, speed=(1, 2, 3, 4))
    hinted = replace(plain, scaffolds=(5, 2**64 - 1))
    assert len(encode(GenerateRequest("r", SamplingParams(), scaffold=9))) > len(
        encode(GenerateRequest("r", SamplingParams()))
    )
    assert plain._to_fields() == [1, 1, 2, [1, 2, 3, 4]]  # as before the hints existed
    assert hinted._to_fields()[-1] == [5, 2**64 - 1]
    got = decode(encode(GenerateRequest("r", SamplingParams(), scaffold=2**64 - 1)))
    assert isinstance(got, GenerateRequest) and got.scaffold == 2**64 - 1


def test_a_scaffold_is_the_system_developer_and_tool_messages_else_the_first_user() -> None:
    chat = [("system", "S"), ("user", "U1"), ("developer", "D"), ("assistant", "A"),
            ("tool", "T"), ("user", "U2")]
    assert scaffold_messages(chat) == (("system", "S"), ("developer", "D"), ("tool", "T"))
    assert scaffold_messages([("user", "U1"), ("assistant", "A"), ("user", "U2")]) == (
        ("user", "U1"),
    )
    assert scaffold_messages([("assistant", "A")]) == ()
    hasher = PrefixHasher(b"model")
    h = hasher.scaffold_hash((("system", "S"),))
    assert h is not None and h == hasher.scaffold_hash((("system", "S"),))
    assert h != hasher.scaffold_hash((("system", "S "),))  # exact bytes only
    assert h != hasher.scaffold_hash((("user", "S"),))
    assert h != PrefixHasher(b"model", key=b"other swarm").scaffold_hash((("system", "S"),))
    assert hasher.scaffold_hash(()) is None


# ------------------------------------------------------------- the core, through the simulator


def _prompt(seed: int, n: int = 600) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(5, 30000) for _ in range(n))


def _sim(policy: str, requests: list[SimRequest], arrivals: list[tuple[float, int]],
         nodes: int = 3) -> Simulation:
    config = SimConfig(nodes=nodes, requests=len(requests), policy=policy, seed=3)
    hasher, make = engine_factory(config)
    return Simulation(config, requests, hasher, make, arrivals=arrivals, check=True).run()


def test_a_node_advertises_what_it_served_and_peers_route_that_scaffold_to_it() -> None:
    params = SamplingParams(max_tokens=4)
    a, b = _prompt(1), _prompt(2)
    reqs = [
        SimRequest(a, params, scaffold=101),
        SimRequest(a[:300] + _prompt(3, 300), params, scaffold=101),  # same scaffold
        SimRequest(b, params, scaffold=202),  # another: nobody holds it
        SimRequest(a[:300] + _prompt(4, 300), params, scaffold=101),  # after 120 s
    ]
    arrivals = [(0.0, 0), (20.0, 1), (25.0, 1), (150.0, 2)]
    sim = _sim("scaffold_hash", reqs, arrivals)
    assert sim.server[:3] == [0, 0, 1]
    assert sim.server[3] == 2  # node 0's hint expired 120 s after it served the scaffold
    # What each node advertises in its load at the end (~150 s): node 2 the scaffold it just
    # served; nodes 0 and 1 nothing, theirs (served at 20 and 25 s) aged out.
    assert sim.cores[2].load().scaffolds == (101,)
    assert sim.cores[1].load().scaffolds == ()
    assert sim.cores[0].load().scaffolds == ()


def test_the_oracle_knows_a_cache_before_any_announcement_could_tell() -> None:
    params = SamplingParams(max_tokens=4)
    a = _prompt(5, 1500)
    reqs = [SimRequest(a, params), SimRequest(a[:1480] + _prompt(6, 20), params)]
    # The second arrives 1 ms after the first started on node 0: no digest can have told
    # node 1 yet (5 ms links), but the prompt's blocks are in node 0's cache.
    arrivals = [(0.0, 0), (0.001, 1)]
    oracle = _sim("oracle", reqs, arrivals)
    cost = _sim("cost", reqs, arrivals)
    assert oracle.server[1] == 0 and oracle.cached[1] >= 1400
    assert cost.server[1] != 0 and cost.cached[1] == 0


def test_the_oracle_counts_exact_cache_and_queue_and_forwards_in_transit() -> None:
    config = SimConfig(nodes=3, requests=0, policy="oracle", seed=1)
    hasher, make = engine_factory(config)
    sim = Simulation(config, [], hasher, make)
    tokens = _prompt(7, 100)
    sim.engines[2].plan(tokens, SamplingParams(max_tokens=2))  # node 2 caches the prompt
    sim.in_transit[1] = 3
    chain = hasher.prompt_chain(tokens)
    request = RouteRequest(prompt_tokens=100, max_tokens=2, chain=chain)
    cands = sim.cores[0].policy.exact_candidates(request)  # type: ignore[attr-defined]
    by = {c.peer: c for c in cands}
    assert cands[0].is_local and len(cands) == 3
    assert by[sim.peer_ids[2]].matched_tokens == 96  # six whole blocks, exact
    assert by[sim.peer_ids[0]].matched_tokens == 0
    assert by[sim.peer_ids[1]].load.queued == 3
    assert all(c.digest_age_s == 0.0 for c in cands)


def test_the_oracle_and_entries_are_refused_where_they_do_not_apply() -> None:
    with pytest.raises(ConfigError, match="oracle"):
        SimConfig(policy="oracle", crash_rate=1.0, join_rate=1.0)
    with pytest.raises(ConfigError, match="entries"):
        SimConfig(nodes=4, entries=5)
    with pytest.raises(ConfigError, match="unknown policy"):
        SimConfig(policy="oracles")


def test_arrivals_enter_only_at_the_entry_nodes() -> None:
    config = SimConfig(nodes=5, requests=80, entries=2, seed=5, workload="rag")
    sim, _ = simulate(config, check=True)
    assert set(sim.origin) == {0, 1}
    assert len(set(sim.server)) > 2  # the others serve what is routed to them


# ------------------------------------------------------------------------------ workloads


def test_rag_workload_is_deterministic_by_seed_and_shares_documents() -> None:
    one = rag_workload(300, documents=20, seed=4)
    assert one == rag_workload(300, documents=20, seed=4)
    assert one != rag_workload(300, documents=20, seed=5)
    docs: dict[str, set[str]] = {}
    for item in one:
        system, doc = item.prefix_key.split(":")[1:]
        assert item.scaffold == (("system", item.prefix[: len(item.scaffold[0][1])]),)
        assert item.prefix.startswith(item.scaffold[0][1])
        docs.setdefault(doc, set()).add(system)
    # The same document comes back under different system prompts (long shared prefixes
    # under different scaffolds), and some documents are much more popular (Zipf).
    assert max(len(s) for s in docs.values()) >= 3
    with pytest.raises(ConfigError):
        rag_workload(10, documents=0, seed=1)


def test_the_sim_workloads_carry_scaffold_hashes() -> None:
    engine = SimulatedEngine()
    from peerinfer.sim.run import sim_requests

    for workload, scaffolds in (("mmlu", None), ("multiturn", 1), ("rag", 4)):
        reqs = sim_requests(SimConfig(requests=150, workload=workload, seed=2), engine)
        distinct = {r.scaffold for r in reqs}
        assert None not in distinct
        if scaffolds is not None:
            assert len(distinct) == scaffolds
        assert reqs == sim_requests(SimConfig(requests=150, workload=workload, seed=2), engine)


def test_the_transformers_preset_is_the_probes_figures() -> None:
    hf = COST_PRESETS["transformers"]
    assert round(1 / hf.prefill_s_per_token) == 380
    assert round(1 / hf.decode_s_per_token, 1) == 15.7
    SimConfig(mix="llamacpp:0.375,transformers:0.375,gpu:0.25")  # a valid mix


# --------------------------------------------------------------- the comparison, small scale


@pytest.mark.slow
def test_cost_beats_scaffold_hash_on_rag_and_the_oracle_bounds_it_on_an_unseen_seed() -> None:
    base = SimConfig(nodes=6, requests=300, workload="rag", skew="zipf:1.0", seed=11)
    got = {p: simulate(replace(base, policy=p), check=True)[1]
           for p in ("cost", "scaffold_hash", "oracle")}
    assert got["cost"]["ttft_mean_s"] < got["scaffold_hash"]["ttft_mean_s"]
    assert got["cost"]["hit_ratio"] > got["scaffold_hash"]["hit_ratio"]
    assert got["oracle"]["hit_ratio"] >= 0.95 * got["cost"]["hit_ratio"]


def test_the_door_hashes_a_chats_scaffold_only_for_scaffold_hash_nodes() -> None:
    from types import SimpleNamespace

    from peerinfer.core.messages import ChatMessage
    from peerinfer.node.door import Door

    hasher = PrefixHasher(b"model")
    chat = (ChatMessage("system", "S"), ChatMessage("user", "Q"))
    req = GenerateRequest("r", SamplingParams(), messages=chat)

    def door(policy: str) -> Door:
        core = SimpleNamespace(config=SimpleNamespace(policy=policy), hasher=hasher)
        return Door(SimpleNamespace(core=core))  # type: ignore[arg-type]

    expected = hasher.scaffold_hash((("system", "S"),))
    assert door("scaffold_hash")._scaffold_of(req) == expected
    assert door("cost")._scaffold_of(req) is None
    forwarded = GenerateRequest("r", SamplingParams(), tokens=(1, 2), forwarded=True, scaffold=5)
    assert door("scaffold_hash")._scaffold_of(forwarded) == 5
    plain = GenerateRequest("r", SamplingParams(), prompt="text")
    assert door("scaffold_hash")._scaffold_of(plain) is None
