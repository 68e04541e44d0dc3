"""Routing policies: given a prompt and the candidate peers, choose who serves it, and say why.

Every policy implements one interface, ``choose(request, candidates, rng) -> RouteDecision``.
It is a pure decision: the candidates carry everything known (matched prefix length, announced
load, round trip, digest age, requests we already sent there), randomness comes from ``rng``,
and the decision carries a human-readable ``reason`` and ``ranked``, the failover order (best
first, every candidate exactly once, the target first). Exactly one candidate is the local node,
and serving locally is always possible. ``round_robin`` keeps a turn counter; the others keep no
state between calls (``scaffold_hash``'s hints are the node's, ``ScaffoldHints``, read through
the candidates' loads).

Load below means ``outstanding / slots`` where ``outstanding = max(queued + running, inflight)``:
a peer's announced load already counts the requests we sent it once the announcement catches
up, so the larger of the two figures is used, not their sum.

The policies
------------
``local``
    Always serve locally: the paper's no-routing baseline. Failover order: local, then the
    others by load.

``random``
    A uniformly random candidate (local included). Failover order: a random permutation.

``round_robin``
    Candidates sorted by peer id; the policy's turn counter picks the next one (modulo the
    number of candidates) on each call. Failover order: the rotation starting at the target.

``least_loaded``
    The lowest load; ties prefer the local node (no network hop), then a random one among the
    tied. Failover order: by load.

``longest_prefix``
    The paper's rule: the longest estimated prefix match (``matched_tokens``, the local node's
    from its own radix cache, a remote's from its digest replica); ties broken by the lowest
    load, then at random. With no match anywhere this degrades to least loaded. Failover order:
    by (match descending, load).

``cost`` (the default)
    Estimate each candidate's time to first token (TTFT) and take the smallest::

        TTFT(c) = rtt(c)                      (0 for the local node)
                + wait(c)                     (expected queueing delay)
                + E[prefill(prompt, cached)]  (cost model, cached tokens discounted by staleness,
                                               next to the requests running there)

    * ``wait``: with ``n`` outstanding requests on ``s`` slots (a node runs up to ``s`` at
      once in one batch, ``core/costmodel.py``), a new request waits for a slot only when
      ``n >= s``; then ``n - s + 1`` requests must finish first, the oldest of them half done
      on average, a full batch freeing a slot every ``T / s``: ``(n - s + 0.5) * T / s``. ``T``
      is the mean service time of a request in a full batch, by default the cost model's
      ``service_s(..., running=s)`` of a request shaped like this one with half its prompt
      cached (option ``mean_service_s`` overrides it). Admitted next to ``d = min(n, s - 1)``
      running requests, it also waits for their prefills under way (the engine prefills one
      chunk at a time, oldest first: ``prefill_backlog_s``), and its own prefill is the cost
      model's next to ``d`` decoders (the busy rate, one decode step of theirs per chunk).
      With one slot both extras are 0: the single-slot estimate.
    * Speed: every term is the candidate's own machine's: a node announces its cost model's
      figures in its load (``Load.speed``, ``CostModel.speed()``), and a candidate that
      announced other figures than this node's is estimated with this node's model at its
      figures (``costs_for``, ``CostModel.at_speed``); one that announced none, as this node.
      So a GPU next to CPUs gets the work its speed earns, and a slow peer is not promised
      (and then held to) a fast node's first token.
    * Staleness: a remote's ``matched_tokens`` come from a digest that is ``digest_age_s`` old;
      the peer may have evicted them since. The match is trusted with confidence
      ``p = 0.5 ** (age / staleness_half_life_s)`` (1 for the local node, whose radix cache is
      exact; 0 for a digest never confirmed), and the prefill estimate is the expectation
      ``p * prefill(prompt, matched) + (1 - p) * prefill(prompt, 0)``.
    * Hysteresis: a remote wins only if it beats the local estimate by a margin,
      ``max(min_gain_s, min_gain_fraction * TTFT(local))``. So the policy never picks a remote
      peer unless, by its own estimate, that is better than serving locally; forwarding on a
      near tie is not worth the network risk. Among remotes with equal estimates, the less
      loaded, then a random one, wins.
    * Hot prefixes: the queueing term is the load-aware penalty that keeps a popular prefix from
      piling onto one node. Each request sent to the best holder raises its ``inflight`` (and,
      once announced, its load) by one, so its ``wait`` grows by ``T / s`` per request. As soon
      as ``wait(holder) > prefill(prompt, 0) - prefill(prompt, cached) + rtt differences``, an
      idle node that does not hold the prefix has the smaller TTFT and gets the request; the
      node marks it as a speculative holder (``PeerIndex.add_speculative``), so the next request
      for that prefix sees two holders and spreads over both. Load is shed exactly when waiting
      for the hot holder costs more than recomputing the prefix elsewhere.

    * Herding: the queue estimate sees the load a peer last announced and this node's own
      requests in flight there, not what the other nodes sent it meanwhile; on a hot prefix they
      all pick the same best holder at once. So a forward carries a limit, ``max_outstanding``:
      the queue the target may hold on arrival for the decision to still beat the runner-up.
      Served there after waiting ``w``, the first token comes at ``rtt + w + prefill``; refused,
      at about ``rtt + TTFT(runner-up)``; so the target may wait up to ``TTFT(runner-up) -
      prefill(target)``, which ``wait`` above turns into a count. The target refuses a request
      over its limit as busy (one round trip) and the origin routes it again without that
      peer. The other policies set no limit (only the node's ``max_queue`` applies).

``scaffold_hash``
    The rival's rule, modelled on Mesh LLM's cache hints, with their limits: a request is named
    by one salted hash of its exact prompt *scaffold* (the system, developer and tool messages,
    or else the first user message: ``peerinfer.core.prefix.scaffold_messages``), carried in
    ``RouteRequest.scaffold``. Each node advertises, in its announced load
    (``Load.scaffolds``), the scaffolds of the prompts it served lately: at most
    ``MAX_SCAFFOLD_HINTS`` (128) of them, none older than ``SCAFFOLD_HINT_LIFETIME_S`` (120 s)
    (``ScaffoldHints``, kept by the node core). No digest, no partial match, no repair: a
    candidate holds the prompt only if its hints carry exactly that hash; ``matched_tokens``
    is ignored. Among the holders the least loaded with a free slot wins (ties: local, then
    at random); with no holder, or every holder's slots full, the least loaded candidate (ties:
    a holder, then local, then at random), the way a hint-aware load balancer spills. A
    request without a scaffold (a plain completion prompt) has no hint: least loaded.
    Failover order: the holders by load, then the others by load.

Ranked lists are deterministic given the inputs: remaining ties keep the order of the
candidates as given (``cost``) or go by peer id (the others).
"""

from __future__ import annotations

import math
import random
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Protocol

from peerinfer.core.costmodel import DEFAULT_COSTS, CostModel
from peerinfer.core.messages import Load
from peerinfer.errors import ConfigError
from peerinfer.types import BlockHash, PeerId

POLICY_NAMES = (
    "local", "random", "round_robin", "least_loaded", "longest_prefix", "cost", "scaffold_hash"
)
#: Mesh LLM's cache-hint limits, which the ``scaffold_hash`` policy keeps: the most scaffold
#: hashes a node advertises, and how long after serving one it still does.
MAX_SCAFFOLD_HINTS = 128
SCAFFOLD_HINT_LIFETIME_S = 120.0
DEFAULT_POLICY = "cost"


@dataclass(frozen=True, slots=True)
class Candidate:
    """One node that could serve the request, with what we know about it.

    ``matched_tokens``: estimated prompt tokens it holds in cache (exact for the local node).
    ``rtt_s``: network round trip to it (ignored for the local node). ``digest_age_s``: seconds
    since its digest was confirmed current (0 for the local node, inf if never).
    ``inflight``: requests we routed there that have not finished.
    """

    peer: PeerId
    is_local: bool
    matched_tokens: int
    load: Load
    rtt_s: float
    digest_age_s: float
    inflight: int = 0


_new_candidate = Candidate.__new__
_set_peer, _set_is_local, _set_matched, _set_load, _set_rtt, _set_age, _set_inflight = (
    Candidate.__dict__[name].__set__
    for name in (
        "peer", "is_local", "matched_tokens", "load", "rtt_s", "digest_age_s", "inflight"
    )
)


def make_candidate(
    peer: PeerId,
    is_local: bool,
    matched_tokens: int,
    load: Load,
    rtt_s: float,
    digest_age_s: float,
    inflight: int = 0,
) -> Candidate:
    """Exactly ``Candidate(...)``, about twice as fast, for the once-per-peer loop of a decision.

    The frozen dataclass's generated ``__init__`` sets each slot through
    ``object.__setattr__``; this sets the same slots through their descriptors directly.
    ``Candidate`` has no ``__post_init__``, so nothing is skipped (a test pins the equality).
    """
    c = _new_candidate(Candidate)
    _set_peer(c, peer)
    _set_is_local(c, is_local)
    _set_matched(c, matched_tokens)
    _set_load(c, load)
    _set_rtt(c, rtt_s)
    _set_age(c, digest_age_s)
    _set_inflight(c, inflight)
    return c


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the policy knows of the request: its size and its block-hash chain."""

    prompt_tokens: int
    max_tokens: int
    chain: tuple[BlockHash, ...] = ()
    #: the salted hash of the prompt's scaffold (``PrefixHasher.scaffold_hash``), None if it
    #: has none; only ``scaffold_hash`` reads it
    scaffold: int | None = None


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The chosen node, why, and the failover order (``ranked[0] == target``)."""

    target: PeerId
    is_local: bool
    expected_cached_tokens: int
    reason: str
    estimated_ttft_s: float | None = None
    ranked: tuple[PeerId, ...] = ()
    #: For a remote target: the most requests it may have queued or running when the request
    #: arrives for the decision to still hold (None: no limit). The target refuses it as busy
    #: beyond that, and the origin routes again without it (see ``CostPolicy``, "Herding").
    max_outstanding: int | None = None


class RoutingPolicy(Protocol):
    name: str

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], rng: random.Random
    ) -> RouteDecision: ...


# ------------------------------------------------------------------------------- helpers


def describe_peer(peer: PeerId) -> str:
    """A short form of a peer id for reasons and logs (libp2p ids share a long prefix)."""
    return f"peer {peer}" if len(peer) <= 16 else f"peer ..{peer[-8:]}"


def _who(c: Candidate) -> str:
    return "local" if c.is_local else describe_peer(c.peer)


def _outstanding(c: Candidate) -> int:
    load = c.load
    return max(load.queued + load.running, c.inflight)


def _load_ratio(c: Candidate) -> float:
    return _outstanding(c) / max(1, c.load.slots)


def _load_text(c: Candidate) -> str:
    load = c.load
    extra = f", {c.inflight} sent by us" if c.inflight else ""
    return f"{load.queued} queued + {load.running} running on {load.slots} slot(s){extra}"


def _age_text(age_s: float) -> str:
    return "digest never confirmed" if math.isinf(age_s) else f"digest {age_s:.1f} s old"


def _local_index(candidates: Sequence[Candidate]) -> int:
    """The position of the one local candidate; ValueError if there is not exactly one."""
    found = -1
    for i, c in enumerate(candidates):
        if c.is_local:
            if found >= 0:
                raise ValueError("routing: more than one local candidate")
            found = i
    if found < 0:
        raise ValueError("routing: the local node must be among the candidates")
    return found


def _ranked(target: Candidate, ordered: Sequence[Candidate]) -> tuple[PeerId, ...]:
    return (target.peer, *(c.peer for c in ordered if c is not target))


# ------------------------------------------------------------------------------ policies


class LocalPolicy:
    """Always serve locally (the no-routing baseline)."""

    name = "local"

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], rng: random.Random
    ) -> RouteDecision:
        local = candidates[_local_index(candidates)]
        ordered = sorted(candidates, key=lambda c: (_load_ratio(c), c.peer))
        cached = min(local.matched_tokens, request.prompt_tokens)
        return RouteDecision(
            local.peer,
            True,
            cached,
            f"local: serving locally without routing (local cache holds "
            f"{cached}/{request.prompt_tokens} tokens)",
            ranked=_ranked(local, ordered),
        )


class RandomPolicy:
    """A uniformly random candidate."""

    name = "random"

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], rng: random.Random
    ) -> RouteDecision:
        _local_index(candidates)
        order = list(candidates)
        rng.shuffle(order)
        target = order[0]
        return RouteDecision(
            target.peer,
            target.is_local,
            min(target.matched_tokens, request.prompt_tokens),
            f"random: picked {_who(target)} uniformly among {len(candidates)} candidates",
            ranked=tuple(c.peer for c in order),
        )


class RoundRobinPolicy:
    """The next candidate in peer-id order, one turn per call."""

    name = "round_robin"

    def __init__(self) -> None:
        self.turn = 0

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], rng: random.Random
    ) -> RouteDecision:
        _local_index(candidates)
        order = sorted(candidates, key=lambda c: c.peer)
        turn = self.turn
        self.turn += 1
        start = turn % len(order)
        rotation = order[start:] + order[:start]
        target = rotation[0]
        return RouteDecision(
            target.peer,
            target.is_local,
            min(target.matched_tokens, request.prompt_tokens),
            f"round_robin: turn {turn} -> {_who(target)} "
            f"({start + 1} of {len(order)} candidates by peer id)",
            ranked=tuple(c.peer for c in rotation),
        )


class LeastLoadedPolicy:
    """The lowest outstanding-per-slot load; ties prefer local, then random."""

    name = "least_loaded"

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], rng: random.Random
    ) -> RouteDecision:
        _local_index(candidates)
        ordered = sorted(candidates, key=lambda c: (_load_ratio(c), not c.is_local, c.peer))
        best = ordered[0]
        best_ratio = _load_ratio(best)
        if not best.is_local:
            tied = [c for c in ordered if _load_ratio(c) == best_ratio]
            best = tied[rng.randrange(len(tied))] if len(tied) > 1 else best
        return RouteDecision(
            best.peer,
            best.is_local,
            min(best.matched_tokens, request.prompt_tokens),
            f"least_loaded: {_who(best)} has the lowest load ({_load_text(best)})",
            ranked=_ranked(best, ordered),
        )


class LongestPrefixPolicy:
    """The longest estimated prefix match; ties by load, then at random."""

    name = "longest_prefix"

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], rng: random.Random
    ) -> RouteDecision:
        _local_index(candidates)
        prompt = request.prompt_tokens

        def matched(c: Candidate) -> int:
            return min(c.matched_tokens, prompt)

        ordered = sorted(candidates, key=lambda c: (-matched(c), _load_ratio(c), c.peer))
        first = ordered[0]
        top = (matched(first), _load_ratio(first))
        tied = [c for c in ordered if (matched(c), _load_ratio(c)) == top]
        best = tied[rng.randrange(len(tied))] if len(tied) > 1 else first
        held = matched(best)
        if held == 0:
            reason = (
                f"longest_prefix: no candidate holds any of the {prompt} prompt tokens; "
                f"{_who(best)} is least loaded ({_load_text(best)})"
            )
        else:
            where = "local cache holds" if best.is_local else f"{_who(best)} holds"
            age = "" if best.is_local else f" ({_age_text(best.digest_age_s)})"
            ties = (
                f"; picked at random among {len(tied)} equally long and loaded"
                if len(tied) > 1
                else ""
            )
            reason = f"longest_prefix: {where} {held}/{prompt} tokens{age}{ties}"
        return RouteDecision(best.peer, best.is_local, held, reason, ranked=_ranked(best, ordered))


class CostPolicy:
    """The smallest estimated time to first token, with hysteresis in favour of local."""

    name = "cost"

    def __init__(
        self,
        costs: CostModel = DEFAULT_COSTS,
        *,
        staleness_half_life_s: float = 60.0,
        min_gain_s: float = 0.01,
        min_gain_fraction: float = 0.1,
        mean_service_s: float | None = None,
    ) -> None:
        if not staleness_half_life_s > 0.0:
            raise ConfigError("cost policy: staleness_half_life_s must be > 0")
        if not (0.0 <= min_gain_s < math.inf):
            raise ConfigError("cost policy: min_gain_s must be a non-negative number")
        if not (0.0 <= min_gain_fraction < math.inf):
            raise ConfigError("cost policy: min_gain_fraction must be a non-negative number")
        if mean_service_s is not None and not (0.0 <= mean_service_s < math.inf):
            raise ConfigError("cost policy: mean_service_s must be a non-negative number")
        self.costs = costs
        self.staleness_half_life_s = staleness_half_life_s
        self.min_gain_s = min_gain_s
        self.min_gain_fraction = min_gain_fraction
        self.mean_service_s = mean_service_s
        self._decay = math.log(2.0) / staleness_half_life_s  # per second
        self._speed: tuple[int, ...] = costs.speed()
        #: the cost models of peers that announced another speed (bounded: cleared when full)
        self._peer_costs: dict[tuple[int, ...], CostModel] = {}

    def costs_for(self, load: Load) -> CostModel:
        """The cost model a candidate announcing ``load`` is estimated with: this node's own
        when the candidate announced the same speed or none (an older node), else this model
        at the candidate's speed (``CostModel.at_speed``)."""
        speed = load.speed
        if not speed or speed == self._speed or len(speed) != 4:
            return self.costs
        model = self._peer_costs.get(speed)
        if model is None:
            if len(self._peer_costs) >= _PEER_COSTS_MAX:
                self._peer_costs.clear()
            model = self._peer_costs[speed] = self.costs.at_speed(speed)
        return model

    def confidence(self, c: Candidate) -> float:
        """How far ``c.matched_tokens`` is trusted: 1 for local, halving per half-life of age."""
        if c.is_local:
            return 1.0
        age = c.digest_age_s
        if not age > 0.0:
            return 1.0
        return math.exp(-age * self._decay)  # 0.0 for age == inf

    def estimate(self, request: RouteRequest, c: Candidate) -> tuple[float, float, float]:
        """``(ttft_s, expected_cached_tokens, wait_s)`` for serving ``request`` on ``c``."""
        return self._estimate(c, request, {})

    def _service(
        self, request: RouteRequest, slots: int, memo: _Memo, costs: CostModel | None = None
    ) -> float:
        """The mean service time ``T`` of the queue estimate on a node of ``slots``: a request
        shaped like this one, half its prompt cached, in a full batch (memoized per call;
        ``costs``: another node's model, default this one's)."""
        key: int | tuple[int, CostModel] = slots if costs is None else (slots, costs)
        service = memo.get(key)
        if service is None:
            if self.mean_service_s is not None:
                service = self.mean_service_s
            else:
                prompt = request.prompt_tokens
                service = (costs or self.costs).service_s(
                    prompt, prompt // 2, request.max_tokens, slots
                )
            memo[key] = service
        return service

    def _backlog(
        self, request: RouteRequest, ahead: int, memo: _Memo, costs: CostModel | None = None
    ) -> float:
        """The prefill backlog ahead of a joiner next to ``ahead`` running requests shaped
        like this one, half their prompt cached (memoized per call under ``-ahead``)."""
        if ahead <= 0:
            return 0.0
        key: int | tuple[int, CostModel] = -ahead if costs is None else (-ahead, costs)
        backlog = memo.get(key)
        if backlog is None:
            prompt = request.prompt_tokens
            backlog = (costs or self.costs).prefill_backlog_s(
                ahead, prompt, prompt // 2, request.max_tokens
            )
            memo[key] = backlog
        return backlog

    def _estimate(
        self, c: Candidate, request: RouteRequest, memo: _Memo, outstanding: int = -1
    ) -> tuple[float, float, float]:
        """The reference form of the estimate (``choose`` inlines the same arithmetic); with
        ``outstanding`` >= 0, as if ``c`` had that many requests queued or running. ``c`` is
        estimated at its announced speed (``costs_for``)."""
        load = c.load
        costs = self.costs_for(load)
        other = None if costs is self.costs else costs
        prompt = request.prompt_tokens
        slots = load.slots if load.slots > 0 else 1
        if outstanding >= 0:
            n = outstanding
        else:
            queued = load.queued + load.running
            n = queued if queued > c.inflight else c.inflight
        if n >= slots:
            wait = (n - slots + 0.5) * self._service(request, slots, memo, other) / slots
            decoders = slots - 1
        else:
            wait = 0.0
            decoders = n
        if decoders > 0:
            wait += self._backlog(request, decoders, memo, other)
        matched = c.matched_tokens if c.matched_tokens < prompt else prompt
        if c.is_local:
            p = 1.0
        else:
            age = c.digest_age_s
            p = 1.0 if not age > 0.0 else math.exp(-age * self._decay)
        cached = p * matched
        # The expectation over a hit (probability p) and a miss: prefill_s is linear in the
        # cached count but for its whole chunks, taken at both ends.
        prefill = p * costs.prefill_s(prompt, matched, decoders) + (1.0 - p) * costs.prefill_s(
            prompt, 0, decoders
        )
        rtt = 0.0 if c.is_local else c.rtt_s
        return rtt + wait + prefill, cached, wait

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], rng: random.Random
    ) -> RouteDecision:
        local_i = _local_index(candidates)
        memo: _Memo = {}
        ttfts = self._ttfts(request, candidates, memo)
        return self._choose(request, candidates, rng, local_i, ttfts, memo)

    def choose_among_holders(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        stand_ins: Container[int],
    ) -> RouteDecision | None:
        """``choose`` over a pruned candidate list, or None when only every candidate decides.

        The list (a subsequence of the full one, in its order) holds the local candidate, every
        peer holding part of the prompt and every peer estimated otherwise than by its load
        alone; of the *plain non-holders* (no match, this node's speed, idle or one slot, whose
        estimate is ``rtt + wait(outstanding) + prefill(prompt, 0)``, non-decreasing in both the
        round trip and the outstanding count), only ``stand_ins``: at the positions given, the
        first of each (outstanding, rtt) pair on the pairs' Pareto front
        (``PeerIndex.holder_candidates``). Every plain non-holder left out is then estimated at
        no less than some stand-in. So when the best remote estimate beats every stand-in's,
        the target, its estimate, the runner-up (``max_outstanding``) and the reason are those
        of the full list; when a stand-in ties it or is it and a remote wins, the left-out ones
        could tie too, and the tie-break draws among all of them: None, before ``rng`` is
        touched (the caller asks ``choose`` with every candidate). When the local node wins,
        every field is the full list's (the best remote estimate, the only one it reads, is
        the same), but for ``ranked``, which ranks the candidates given, and the peer the
        reason names as the best remote where left-out peers estimate the same to the bit."""
        local_i = _local_index(candidates)
        memo: _Memo = {}
        ttfts = self._ttfts(request, candidates, memo)
        best_remote = -1
        best = math.inf
        floor = math.inf  # the best stand-in's estimate
        for i, t in enumerate(ttfts):
            if i != local_i and t < best:
                best, best_remote = t, i
            if t < floor and i in stand_ins:
                floor = t
        if best_remote >= 0 and best >= floor:
            local_ttft = ttfts[local_i]
            if local_ttft - best > max(self.min_gain_s, self.min_gain_fraction * local_ttft):
                return None  # a remote wins, and left-out peers may tie with it
        return self._choose(request, candidates, rng, local_i, ttfts, memo)

    def _ttfts(
        self, request: RouteRequest, candidates: Sequence[Candidate], memo: _Memo
    ) -> list[float]:
        """Every candidate's estimated TTFT, in order (``_estimate``'s arithmetic, inlined)."""
        prompt = request.prompt_tokens
        costs = self.costs
        cold = costs.prefill_s(prompt, 0)
        saving = costs.prefill_s_per_token - costs.cached_s_per_token
        # While others decode: the busy prefill rate, and one decode step per prompt chunk.
        cold_busy = costs.prefill_s(prompt, 0, 1) - costs.prefill_chunks(prompt) * costs.decode_step_s(1)
        saving_busy = costs.prefill_busy_rate - costs.cached_s_per_token
        chunk = costs.prefill_chunk_tokens
        cold_chunks = costs.prefill_chunks(prompt)
        step = costs.decode_step_s
        service = self._service
        backlog = self._backlog
        decay = self._decay
        exp = math.exp
        # The hot loop: the same arithmetic as ``_estimate``, inlined (this runs once per peer
        # per request). A node with nothing running or with one slot takes the first branch:
        # no batch, the single-slot estimate.
        service_one = service(request, 1, memo)
        own_speed = self._speed
        ttfts: list[float] = []
        append = ttfts.append
        for c in candidates:
            load = c.load
            speed = load.speed
            if speed and speed != own_speed:
                # Another machine's speed: the reference form, with its cost model.
                append(self._estimate(c, request, memo)[0])
                continue
            slots = load.slots
            n = load.queued + load.running
            if c.inflight > n:
                n = c.inflight
            m = c.matched_tokens if c.matched_tokens < prompt else prompt
            if c.is_local:
                p = 1.0
                rtt = 0.0
            else:
                rtt = c.rtt_s
                if m == 0 and (n == 0 or slots <= 1):
                    # Nothing matched, no batch: the confidence multiplies 0 (most peers).
                    append(rtt + ((n - 0.5) * service_one if n >= 1 else 0.0) + cold)
                    continue
                age = c.digest_age_s
                p = 1.0 if not age > 0.0 else exp(-age * decay)
            if n == 0 or slots <= 1:
                wait = (n - 0.5) * service_one if n >= 1 else 0.0
                prefill = cold - p * m * saving
            else:
                if n >= slots:
                    wait = (n - slots + 0.5) * service(request, slots, memo) / slots
                    decoders = slots - 1
                else:
                    wait = 0.0
                    decoders = n
                wait += backlog(request, decoders, memo)
                hit_chunks = (prompt - m + chunk - 1) // chunk if m < prompt else 1
                prefill = (
                    cold_busy
                    - p * m * saving_busy
                    + step(decoders) * (p * hit_chunks + (1.0 - p) * cold_chunks)
                )
            append(rtt + wait + prefill)
        return ttfts

    def _choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        local_i: int,
        ttfts: list[float],
        memo: _Memo,
    ) -> RouteDecision:
        prompt = request.prompt_tokens
        # Stable: equal estimates keep the caller's order in the failover list.
        order = sorted(range(len(ttfts)), key=ttfts.__getitem__)
        local_ttft = ttfts[local_i]
        best_remote = next((i for i in order if i != local_i), None)
        margin = max(self.min_gain_s, self.min_gain_fraction * local_ttft)
        target_i = local_i
        if best_remote is not None and local_ttft - ttfts[best_remote] > margin:
            best_ttft = ttfts[best_remote]
            tied = [i for i in order if ttfts[i] == best_ttft and i != local_i]
            if len(tied) > 1:
                lightest = min(_load_ratio(candidates[i]) for i in tied)
                tied = [i for i in tied if _load_ratio(candidates[i]) == lightest]
            target_i = tied[rng.randrange(len(tied))] if len(tied) > 1 else tied[0]
            best_remote = target_i
        estimates = {
            i: self._estimate(candidates[i], request, memo)
            for i in {local_i, target_i, best_remote}
            if i is not None
        }
        max_outstanding = None
        if target_i != local_i:
            runner_up = min(ttfts[i] for i in range(len(ttfts)) if i != target_i)
            max_outstanding = self._outstanding_within(
                runner_up, candidates[target_i], request, memo
            )
        local = candidates[local_i]
        local_cached = estimates[local_i][1]
        target = candidates[target_i]
        ttft, cached, wait = estimates[target_i]
        ranked = (target.peer, *(candidates[i].peer for i in order if i != target_i))

        if target.is_local:
            if best_remote is None:
                reason = (
                    f"cost: local is the only candidate; est. TTFT {local_ttft:.3f} s "
                    f"({local_cached:.0f}/{prompt} tokens cached)"
                )
            else:
                r = candidates[best_remote]
                r_ttft = estimates[best_remote][0]
                reason = (
                    f"cost: local est. TTFT {local_ttft:.3f} s ({local_cached:.0f}/{prompt} "
                    f"tokens cached, queue {estimates[local_i][2]:.3f} s); best remote "
                    f"{_who(r)} {r_ttft:.3f} s does not beat it by the "
                    f"{margin:.3f} s margin"
                )
        else:
            reason = (
                f"cost: {_who(target)} est. TTFT {ttft:.3f} s (holds ~{cached:.0f}/{prompt} "
                f"tokens, {_age_text(target.digest_age_s)}, queue {wait:.3f} s, "
                f"rtt {target.rtt_s * 1000:.0f} ms) vs local {local_ttft:.3f} s "
                f"({local_cached:.0f} cached, {_load_text(local)})"
            )
        return RouteDecision(
            target.peer,
            target.is_local,
            int(cached),
            reason,
            estimated_ttft_s=ttft,
            ranked=ranked,
            max_outstanding=max_outstanding,
        )


    def _outstanding_within(
        self, runner_up_s: float, c: Candidate, request: RouteRequest, memo: _Memo
    ) -> int:
        """The most requests ``c`` may have queued or running when this one arrives for the
        forward to still beat the runner-up: served there, the first token comes at ``rtt +
        estimate - rtt``; refused, at about ``rtt + runner_up_s``. The inverse of the estimate
        in the outstanding count: past a full batch it grows by ``T / slots`` per request;
        below, by the prefill backlog of one more running request."""
        slots = c.load.slots if c.load.slots > 0 else 1
        costs = self.costs_for(c.load)
        service = self._service(request, slots, memo, None if costs is self.costs else costs)
        if not service > 0.0 or not runner_up_s < math.inf:  # also NaN: no limit, as before
            return 1 << 30
        full = self._estimate(c, request, memo, slots)
        rtt = 0.0 if c.is_local else c.rtt_s
        # full - rtt = 0.5 * T / slots + the backlog and prefill next to slots - 1 decoders
        # (+1e-9: a tie with the runner-up must not round down below what it already runs)
        n = math.floor((runner_up_s - (full[0] - rtt)) * slots / service + slots + 1e-9)
        if n >= slots:
            return min(n, 1 << 30)
        # Not even a full batch fits: the most running requests whose backlog still does.
        for k in range(slots - 1, 0, -1):
            if self._estimate(c, request, memo, k)[0] - rtt <= runner_up_s:
                return k
        return 0


class ScaffoldHints:
    """What a node advertises for the ``scaffold_hash`` policy: the scaffold hashes of the
    prompts it served, newest last, at most ``capacity`` (the oldest is forgotten first), each
    for ``lifetime_s`` after it was last served. Nothing else: a hint is not withdrawn when the
    cache evicts the prompt (no repair), only when it ages out or is pushed out."""

    __slots__ = ("capacity", "lifetime_s", "_served")

    def __init__(
        self, capacity: int = MAX_SCAFFOLD_HINTS, lifetime_s: float = SCAFFOLD_HINT_LIFETIME_S
    ) -> None:
        if capacity < 1 or not lifetime_s > 0:
            raise ConfigError("scaffold hints need a capacity >= 1 and a positive lifetime")
        self.capacity = capacity
        self.lifetime_s = lifetime_s
        #: hash -> when last served, oldest first (dicts keep insertion order)
        self._served: dict[int, float] = {}

    def served(self, scaffold: int, now: float) -> None:
        """This node served (admitted) a prompt of ``scaffold``."""
        served = self._served
        served.pop(scaffold, None)
        served[scaffold] = now
        if len(served) > self.capacity:
            del served[next(iter(served))]

    def current(self, now: float) -> tuple[int, ...]:
        """The hints alive at ``now``, oldest first (expired ones are forgotten)."""
        served = self._served
        horizon = now - self.lifetime_s
        while served:
            oldest = next(iter(served))
            if served[oldest] >= horizon:
                break
            del served[oldest]
        return tuple(served)

    def __len__(self) -> int:
        return len(self._served)


class ScaffoldHashPolicy:
    """Mesh LLM's cache hints as a routing policy: exact scaffold-hash holders first, by load."""

    name = "scaffold_hash"

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], rng: random.Random
    ) -> RouteDecision:
        _local_index(candidates)
        key = request.scaffold
        holders = (
            [c for c in candidates if key in c.load.scaffolds] if key is not None else []
        )
        holder_ids = {c.peer for c in holders}

        def order_key(c: Candidate) -> tuple[float, bool, bool, PeerId]:
            return (_load_ratio(c), c.peer not in holder_ids, not c.is_local, c.peer)

        free = sorted((c for c in holders if _outstanding(c) < max(1, c.load.slots)), key=order_key)
        if free:
            pool = free
            why = "holds the scaffold and has a free slot"
        else:
            pool = sorted(candidates, key=order_key)
            why = (
                "no candidate advertises the scaffold" if not holders
                else "every holder of the scaffold is busy; least loaded"
            )
            if key is None:
                why = "the prompt has no scaffold; least loaded"
        best = pool[0]
        first = order_key(best)[:2]
        tied = [c for c in pool if order_key(c)[:2] == first]
        if len(tied) > 1 and not best.is_local:
            best = tied[rng.randrange(len(tied))]
        ordered = sorted(candidates, key=lambda c: (c.peer not in holder_ids, *order_key(c)))
        return RouteDecision(
            best.peer,
            best.is_local,
            0,
            f"scaffold_hash: {_who(best)} {why} ({len(holders)} holder(s) of "
            f"{len(candidates)}; {_load_text(best)})",
            ranked=_ranked(best, ordered),
        )


#: The most distinct peer speeds a ``cost`` policy keeps a cost model for (then it starts over).
_PEER_COSTS_MAX = 256
#: A decision's memo of service and backlog times, by slots (this node's model) or by
#: (slots, another node's model).
_Memo = dict[int | tuple[int, CostModel], float]


_COST_OPTIONS = frozenset(
    {"staleness_half_life_s", "min_gain_s", "min_gain_fraction", "mean_service_s"}
)


def make_policy(name: str, *, costs: CostModel = DEFAULT_COSTS, **options: float) -> RoutingPolicy:
    """A fresh policy by name (one of ``POLICY_NAMES``); ConfigError on an unknown name/option."""
    if name == "cost":
        unknown = set(options) - _COST_OPTIONS
        if unknown:
            raise ConfigError(f"routing policy 'cost' has no option(s) {sorted(unknown)}")
        try:
            return CostPolicy(costs, **options)
        except TypeError as exc:
            raise ConfigError(f"routing policy 'cost': {exc}") from exc
    classes: dict[str, type[LocalPolicy | RandomPolicy | RoundRobinPolicy | LeastLoadedPolicy
                                 | LongestPrefixPolicy | ScaffoldHashPolicy]] = {
        "local": LocalPolicy,
        "random": RandomPolicy,
        "round_robin": RoundRobinPolicy,
        "least_loaded": LeastLoadedPolicy,
        "longest_prefix": LongestPrefixPolicy,
        "scaffold_hash": ScaffoldHashPolicy,
    }
    cls = classes.get(name)
    if cls is None:
        raise ConfigError(
            f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}"
        )
    if options:
        raise ConfigError(f"routing policy {name!r} takes no options, got {sorted(options)}")
    return cls()


__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "Candidate",
    "CostPolicy",
    "LeastLoadedPolicy",
    "LocalPolicy",
    "LongestPrefixPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
    "MAX_SCAFFOLD_HINTS",
    "SCAFFOLD_HINT_LIFETIME_S",
    "ScaffoldHashPolicy",
    "ScaffoldHints",
    "describe_peer",
    "make_candidate",
    "make_policy",
]
