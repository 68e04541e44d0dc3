"""The blocks pending locally, kept per chain (``Requests``), against counting every block.

``Requests`` keeps the chains of the requests queued or running here, one entry per chain,
and ``local_match_blocks`` finds a chain's pending blocks as its longest common prefix with a
pending chain. The reference here counts every block of every local request's chain, as the
node did before, and walks the chain block by block (digest or pending); both must agree after
every step of random histories whose prompts share prefixes of every length.
"""

from __future__ import annotations

import random
from collections import Counter

from peerinfer.core.costmodel import DEFAULT_COSTS
from peerinfer.core.merkle import MerkleDigest
from peerinfer.core.messages import SamplingParams
from peerinfer.core.node import ClientRequest, Effect, NodeConfig
from peerinfer.core.node.requests import LOCAL_PHASES, Requests, _common_prefix
from peerinfer.core.prefix import PrefixHasher
from peerinfer.types import BlockHash, PeerId, RequestId

BS = 4
HASHER = PrefixHasher(b"pending-chains", block_size=BS, memo_size=16)
PARAMS = SamplingParams(max_tokens=4)


def reference(requests: Requests, held: list[RequestId], chain: tuple[BlockHash, ...],
              digest: MerkleDigest) -> tuple[int, Counter[BlockHash]]:
    pending: Counter[BlockHash] = Counter()
    for rid in held:
        req = requests.get(rid)
        if req is not None and req.phase in LOCAL_PHASES:
            pending.update(req.chain)
    n = 0
    for h in chain:
        if h in digest or h in pending:
            n += 1
        else:
            break
    return n, pending


def prompt_of(rng: random.Random, bases: list[tuple[int, ...]]) -> tuple[int, ...]:
    base = rng.choice(bases)
    keep = rng.randrange(0, len(base) + 1)
    tail = tuple(rng.randrange(1, 4) for _ in range(rng.randrange(0, 3 * BS)))
    return base[:keep] + tail


def test_local_match_blocks_counts_what_the_pending_blocks_and_the_digest_hold() -> None:
    for seed in range(8):
        rng = random.Random(seed)
        bases = [tuple(rng.randrange(1, 4) for _ in range(rng.randrange(BS, 12 * BS))) for _ in range(4)]
        cfg = NodeConfig(peer_id=PeerId("A"), policy="local",
                         costs=DEFAULT_COSTS.with_slots(rng.choice([1, 2, 3])))
        requests = Requests(cfg, PeerId("A"), now=0.0)
        digest = MerkleDigest(lazy=True)
        held: list[RequestId] = []
        asked = with_pending = 0
        for step in range(300):
            op = rng.random()
            if op < 0.35:
                # A new request (a prompt object of its own, or the same tuple again).
                tokens = prompt_of(rng, bases) if rng.random() < 0.7 or not held else None
                if tokens is None:
                    old = requests.get(rng.choice(held))
                    tokens = old.tokens if old is not None else prompt_of(rng, bases)
                if not tokens:
                    continue
                rid = RequestId(f"r{seed}-{step}")
                ev = ClientRequest(rid, tokens, PARAMS, True, PeerId(f"P{rng.randrange(3)}"), None)
                if requests.refusal(ev) is not None:
                    continue
                new = requests.hold(ev, HASHER.prompt_chain(tokens))
                effects: list[Effect] = []
                if requests.admit(new, None, effects):
                    requests.start_queued(effects)
                    held.append(rid)
            elif op < 0.55 and held:
                rid = rng.choice(held)
                running = requests.get(rid)
                effects = []
                if running is not None and running.phase.value == "running":
                    requests.local_finished(rid, 1, effects)
                    requests.start_queued(effects)
                    held.remove(rid)
            elif op < 0.75:
                chain = HASHER.prompt_chain(prompt_of(rng, bases))
                for h in chain[: rng.randrange(0, len(chain) + 1)]:
                    if rng.random() < 0.8:
                        digest.add(h)
            else:
                if len(digest):
                    digest.discard(rng.choice(list(digest)))
            for _ in range(3):
                tokens = prompt_of(rng, bases)
                pick = rng.random()
                if held and pick < 0.3:  # the very chain object of a pending request
                    picked = requests.get(rng.choice(held))
                    if picked is not None:
                        tokens = picked.tokens
                chain = HASHER.prompt_chain(tokens)
                want, pending = reference(requests, held, chain, digest)
                assert requests.local_match_blocks(chain, digest) == want
                assert requests.pending_local == dict(pending)
                asked += 1
                with_pending += bool(pending)
            requests.check_invariants()
        assert with_pending > asked // 4  # the histories do hold pending requests


def test_common_prefix_is_the_first_place_two_chains_differ() -> None:
    rng = random.Random(5)
    for _ in range(2000):
        base = tuple(rng.randrange(1, 3) for _ in range(rng.randrange(0, 10 * BS)))
        a = HASHER.chain(base + tuple(rng.randrange(1, 3) for _ in range(rng.randrange(0, 4 * BS))))
        b = HASHER.chain(base[: rng.randrange(0, len(base) + 1)]
                         + tuple(rng.randrange(1, 3) for _ in range(rng.randrange(0, 4 * BS))))
        want = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            want += 1
        assert _common_prefix(a, b) == want == _common_prefix(b, a)


def test_the_timers_read_the_forwarded_requests_in_the_order_they_were_held() -> None:
    """``deadlines`` and ``expired_forwards`` read the FORWARDED requests kept aside; they must
    give what reading every held request gives, in the same order, through forwards,
    failovers (which keep a request's place), first tokens, ends and fallbacks to the local
    engine."""
    from peerinfer.core.node.requests import Phase

    for seed in range(6):
        rng = random.Random(seed)
        cfg = NodeConfig(peer_id=PeerId("A"), policy="local", costs=DEFAULT_COSTS.with_slots(2))
        requests = Requests(cfg, PeerId("A"), now=0.0)
        forwards = 0
        for step in range(400):
            now = step * 0.1
            requests.clock = now
            held = requests.held()
            op = rng.random()
            effects: list[Effect] = []
            if op < 0.35 or not held:
                rid = RequestId(f"r{seed}-{step}")
                ev = ClientRequest(rid, (1, 2, 3, 4, 5), PARAMS)
                if requests.refusal(ev) is not None:
                    continue
                req = requests.hold(ev, HASHER.prompt_chain(ev.tokens))
                if rng.random() < 0.75:
                    peer = PeerId(f"P{rng.randrange(3)}")
                    req.tried.append(peer)
                    requests.stats["forwarded"] += 1  # (as the node counts its forwards)
                    requests.transition(req, Phase.FORWARDED, target=peer,
                                        deadline=now + rng.uniform(0.0, 3.0))
                    forwards += 1
                elif requests.admit(req, None, effects):
                    requests.start_queued(effects)
            else:
                req = rng.choice(held)
                pick = rng.random()
                if (req.phase is Phase.FORWARDED and pick < 0.3
                        and len(req.tried) < cfg.max_forward_attempts):  # a failover
                    peer = PeerId(f"P{rng.randrange(3)}")
                    req.tried.append(peer)
                    requests.stats["forwarded"] += 1  # (as the node counts its forwards)
                    requests.transition(req, Phase.FORWARDED, target=peer,
                                        deadline=now + rng.uniform(0.0, 3.0))
                elif req.phase is Phase.FORWARDED and pick < 0.55:
                    requests.transition(req, Phase.RELAYING)
                elif req.phase is Phase.FORWARDED and pick < 0.7:
                    requests.transition(req, Phase.QUEUED)
                    requests.start_queued(effects)
                elif req.phase in (Phase.FORWARDED, Phase.RELAYING):
                    requests.end(req, effects)
                elif req.phase is Phase.RUNNING:
                    requests.local_finished(req.request_id, 1, effects)
                    requests.start_queued(effects)
            every = requests.held()
            assert requests.deadlines() == [r.deadline for r in every if r.deadline is not None]
            for when in (now, now + 1.0, now + 5.0):
                want = [r for r in every if r.phase is Phase.FORWARDED and r.deadline is not None
                        and r.deadline <= when]
                got = requests.expired_forwards(when)
                assert [r.request_id for r in got] == [r.request_id for r in want]
            requests.check_invariants()
        assert forwards > 50
