"""The ``cost`` policy: the smallest estimated time to first token, from the cost model, the
candidates' announced loads and cached prefixes, with hysteresis in favour of local (described
in :mod:`peerinfer.core.routing`); optionally charged for the extra prefill a placement puts
before the requests that come to a busy node after it (``extra_work_weight``)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Container, Sequence

from peerinfer.core.costmodel import DEFAULT_COSTS, CostModel
from peerinfer.core.messages import Load
from peerinfer.core.routing.candidates import (
    Candidate,
    RouteDecision,
    RouteRequest,
    Row,
    _age_text,
    _load_ratio,
    _load_text,
    _local_index,
    _who,
    make_candidate,
)
from peerinfer.errors import ConfigError
from peerinfer.types import PeerId

#: The most distinct peer speeds a ``cost`` policy keeps a cost model for (then it starts over).
_PEER_COSTS_MAX = 256
#: A decision's memo of service and backlog times, by slots (this node's model) or by
#: (slots, another node's model).
_Memo = dict[int | tuple[int, CostModel], float]


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
        extra_work_weight: float = 0.0,
    ) -> None:
        if not staleness_half_life_s > 0.0:
            raise ConfigError("cost policy: staleness_half_life_s must be > 0")
        if not (0.0 <= min_gain_s < math.inf):
            raise ConfigError("cost policy: min_gain_s must be a non-negative number")
        if not (0.0 <= min_gain_fraction < math.inf):
            raise ConfigError("cost policy: min_gain_fraction must be a non-negative number")
        if mean_service_s is not None and not (0.0 <= mean_service_s < math.inf):
            raise ConfigError("cost policy: mean_service_s must be a non-negative number")
        if not (0.0 <= extra_work_weight < math.inf):
            raise ConfigError("cost policy: extra_work_weight must be a non-negative number")
        self.costs = costs
        self.staleness_half_life_s = staleness_half_life_s
        self.min_gain_s = min_gain_s
        self.min_gain_fraction = min_gain_fraction
        self.mean_service_s = mean_service_s
        #: the extra-work charge's weight (0: off, the greedy choice; ``_charges``)
        self.extra_work_weight = extra_work_weight
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
        # A hit partly on disk loads those blocks first (Load.disk: the expected share).
        prefill += p * matched * load.disk_s_per_token
        rtt = 0.0 if c.is_local else c.rtt_s
        return rtt + wait + prefill, cached, wait

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], rng: random.Random
    ) -> RouteDecision:
        local_i = _local_index(candidates)
        memo: _Memo = {}
        ttfts = self._ttfts(request, candidates, memo)
        charges = self._charges(request, candidates) if self.extra_work_weight else None
        return self._choose(request, candidates, rng, local_i, ttfts, memo, charges)

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
        reason names as the best remote where left-out peers estimate the same to the bit.

        With the extra-work charge the same holds of the scores (estimate + charge): a plain
        non-holder's charge, ``w * M * saving * outstanding / slots`` (``_charges``), is
        non-decreasing in the outstanding count and does not depend on the round trip, and
        ``M`` is the same over both lists (every holder is in the pruned one)."""
        local_i = _local_index(candidates)
        memo: _Memo = {}
        ttfts = self._ttfts(request, candidates, memo)
        charges = self._charges(request, candidates) if self.extra_work_weight else None
        if charges is not None:
            ttfts = [t + c for t, c in zip(ttfts, charges, strict=True)]
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
        return self._choose(request, candidates, rng, local_i, ttfts, memo, charges, True)

    def choose_rows(
        self,
        request: RouteRequest,
        rows: Sequence[Row],
        rng: random.Random,
        stand_ins: Container[int],
        bound: RowBound | None = None,
        ttfts: list[float] | None = None,
    ) -> RouteDecision | None:
        """``choose_among_holders`` over the candidates given as ``rows`` (``make_candidate``'s
        arguments, the local one first: ``PeerIndex.holder_candidates(rows=True)``), without
        the extra-work charge: the same decision, field for field, ``ranked`` and the reason
        included. Only the candidates the decision reads are built (the local one, the
        target, the best remote, ties): a route's list holds ~17 candidates at 64 nodes and
        reads two or three of them. ``bound`` and ``ttfts``: the rows were scored as the
        index made them (``holder_candidates(bound=...)``), and those that could not matter
        were left out: the same decision but for ``ranked``, which ranks the rows given."""
        assert not self.extra_work_weight, "choose_rows: the charge needs every candidate"
        if ttfts is None:
            memo: _Memo = {}
            ttfts = self._row_ttfts(request, rows, memo)
        else:
            assert bound is not None
            memo = bound.memo
        # (``choose_among_holders``' scan, read off the stable order ``_choose`` needs anyway:
        # the best remote is the first non-local one in it, the lowest position among equals)
        order = sorted(range(len(ttfts)), key=ttfts.__getitem__)
        first = order[0]
        best_remote = first if first else (order[1] if len(order) > 1 else -1)
        if best_remote >= 0:
            best = ttfts[best_remote]
            floor = math.inf  # the best stand-in's estimate
            for i in stand_ins:  # type: ignore[attr-defined]  # (a set of positions)
                t = ttfts[i]
                if t < floor:
                    floor = t
            if best >= floor:
                local_ttft = ttfts[0]
                if local_ttft - best > max(self.min_gain_s, self.min_gain_fraction * local_ttft):
                    return None  # a remote wins, and left-out peers may tie with it
        return self._choose(
            request, _RowCandidates(rows), rng, 0, ttfts, memo, None, True,
            [row[0] for row in rows], order,
        )

    def _row_ttfts(self, request: RouteRequest, rows: Sequence[Row], memo: _Memo) -> list[float]:
        """The estimated TTFT of each candidate ``rows`` stand for (``make_candidate``'s
        arguments), in order (``_row_scorer``)."""
        return list(map(self._row_scorer(request, memo), rows))

    def _row_scorer(self, request: RouteRequest, memo: _Memo) -> Callable[[Row], float]:
        """The estimated TTFT of the candidate a row stands for (``make_candidate``'s
        arguments): ``_estimate``'s arithmetic, inlined (this runs once per peer per request).
        A node with nothing running or with one slot takes the first branch: no batch, the
        single-slot estimate (``RowBound.floor`` bounds that branch from below). A peer of
        another speed goes to ``_estimate`` with its cost model.
        tests/core/test_route_among_holders.py holds the result to ``_estimate``'s floats."""
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
        service_one = service(request, 1, memo)
        own_speed = self._speed

        def score(row: Row) -> float:
            _, is_local, matched, load, rtt, age, inflight = row
            speed = load.speed
            if speed and speed != own_speed:
                # Another machine's speed: the reference form, with its cost model.
                return self._estimate(make_candidate(*row), request, memo)[0]
            slots = load.slots
            n = load.queued + load.running
            if inflight > n:
                n = inflight
            m = matched if matched < prompt else prompt
            if is_local:
                p = 1.0
                rtt = 0.0
            else:
                if m == 0 and (n == 0 or slots <= 1):
                    # Nothing matched, no batch: the confidence multiplies 0 (most peers).
                    return rtt + ((n - 0.5) * service_one if n >= 1 else 0.0) + cold
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
            if load.disk:  # a hit partly on disk loads those blocks first (Load.disk)
                prefill += p * m * load.disk_s_per_token
            return rtt + wait + prefill

        return score

    def row_bound(self, request: RouteRequest) -> RowBound:
        """What a route needs to leave out the candidates that cannot matter to its decision
        (``RowBound``; ``PeerIndex.holder_candidates(bound=...)``, then ``choose_rows`` with
        its scores)."""
        assert not self.extra_work_weight, "row_bound: the charge needs every candidate"
        return RowBound(self, request)

    def _charges(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        """Each candidate's extra-work charge, in order: ``w * E(c) * n(c) / s(c)``.

        ``E(c) = (M - p(c) * m(c)) * (prefill_s_per_token - cached_s_per_token)`` at ``c``'s
        speed is the prefill ``c`` would run beyond what the best-placed candidate would (``M``:
        the most expected cached tokens, ``p * m``, of any candidate), ``n(c)`` its outstanding
        requests and ``s(c)`` its slots. The estimate counts only this request's own first
        token; a recompute also holds ``c`` for ``E(c)`` longer, and every request that comes
        to ``c`` while it is still busy waits that much more. How many do is not known here;
        the requests it has outstanding now stand in for them (a single-server queue holds on
        average as many as arrive during the rest of its busy period, ``rho / (1 - rho)``). So
        the charge is 0 on an idle node (spreading a hot prefix onto idle peers costs nobody),
        and grows with the queue where a recompute delays others: past saturation the greedy
        estimate sheds a busy holder's requests to busy non-holders, the extra prefills keep
        every node full, and the queues grow (docs/evaluation.md, "Pulling KV from a peer")."""
        prompt = request.prompt_tokens
        cached: list[float] = []
        for c in candidates:
            m = c.matched_tokens if c.matched_tokens < prompt else prompt
            cached.append(m * self.confidence(c))
        best = max(cached)
        w = self.extra_work_weight
        out: list[float] = []
        for c, e in zip(candidates, cached, strict=True):
            load = c.load
            n = load.queued + load.running
            if c.inflight > n:
                n = c.inflight
            if n <= 0 or not best > e:
                out.append(0.0)
                continue
            costs = self.costs_for(load)
            saving = costs.prefill_s_per_token - costs.cached_s_per_token
            out.append(w * (best - e) * saving * n / (load.slots if load.slots > 0 else 1))
        return out

    def _ttfts(
        self, request: RouteRequest, candidates: Sequence[Candidate], memo: _Memo
    ) -> list[float]:
        """Every candidate's estimated TTFT, in order: ``_row_ttfts`` over their figures (one
        arithmetic for both forms; a candidate of another speed goes to ``_estimate`` as it
        is)."""
        rows = [
            (c.peer, c.is_local, c.matched_tokens, c.load, c.rtt_s, c.digest_age_s, c.inflight)
            for c in candidates
        ]
        return self._row_ttfts(request, rows, memo)

    def _choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        rng: random.Random,
        local_i: int,
        ttfts: list[float],
        memo: _Memo,
        charges: list[float] | None = None,
        charged: bool = False,
        peers: Sequence[PeerId] | None = None,
        order: list[int] | None = None,
    ) -> RouteDecision:
        """The choice by ``ttfts``; with ``charges`` (the extra-work charge), by ``ttfts`` plus
        the charges (already added when ``charged``): the scores. ``peers``: the candidates'
        peers, in order, when ``candidates`` builds each one asked for (``_RowCandidates``);
        ``order``: the positions sorted by the scores, stably, if the caller has it."""
        prompt = request.prompt_tokens
        if charges is not None and not charged:
            ttfts = [t + c for t, c in zip(ttfts, charges, strict=True)]
            order = None
        # Stable: equal estimates keep the caller's order in the failover list.
        if order is None:
            order = sorted(range(len(ttfts)), key=ttfts.__getitem__)
        local_ttft = ttfts[local_i]
        first = order[0]
        best_remote: int | None = (
            first if first != local_i else (order[1] if len(order) > 1 else None)
        )
        margin = max(self.min_gain_s, self.min_gain_fraction * local_ttft)
        target_i = local_i
        if best_remote is not None and local_ttft - ttfts[best_remote] > margin:
            best_ttft = ttfts[best_remote]
            # The equals of the best are next to it in the order (but for the local one).
            tied = []
            for i in order:
                if i != local_i:
                    if ttfts[i] != best_ttft:
                        break
                    tied.append(i)
            if len(tied) > 1:
                lightest = min(_load_ratio(candidates[i]) for i in tied)
                tied = [i for i in tied if _load_ratio(candidates[i]) == lightest]
            target_i = tied[rng.randrange(len(tied))] if len(tied) > 1 else tied[0]
            best_remote = target_i
        local = candidates[local_i]
        target = candidates[target_i]
        if target_i != local_i:
            # (the best remote is the target) The runner-up is the best of the others, read
            # off the order; the local figure the reason gives is its match (``_estimate``'s
            # cached tokens at confidence 1).
            ttft, cached, wait = self._estimate(target, request, memo)
            runner_up = ttfts[first] if first != target_i else ttfts[order[1]]
            max_outstanding: int | None = self._outstanding_within(
                runner_up, target, request, memo,
                0.0 if charges is None else charges[target_i],
            )
            local_matched = local.matched_tokens
            local_cached = 1.0 * (local_matched if local_matched < prompt else prompt)
        else:
            ttft, cached, wait = self._estimate(local, request, memo)
            local_cached = cached
            max_outstanding = None
        if peers is None:
            ranked = (target.peer, *(candidates[i].peer for i in order if i != target_i))
        elif first == target_i:
            ranked = tuple(map(peers.__getitem__, order))
        else:
            ranked = (target.peer, *(peers[i] for i in order if i != target_i))
        # With the charge, ``local_ttft`` and the remotes' figures are scores; say so.
        charge_text = ""
        if charges is not None:
            charge_text = f"; extra-work charge local {charges[local_i]:.3f} s"
            if best_remote is not None:
                charge_text += f", {_who(candidates[best_remote])} {charges[best_remote]:.3f} s"

        if target.is_local:
            if best_remote is None:
                reason = (
                    f"cost: local is the only candidate; est. TTFT {local_ttft:.3f} s "
                    f"({local_cached:.0f}/{prompt} tokens cached)"
                )
            else:
                r = candidates[best_remote]
                r_ttft = self._estimate(r, request, memo)[0]
                reason = (
                    f"cost: local est. TTFT {local_ttft:.3f} s ({local_cached:.0f}/{prompt} "
                    f"tokens cached, queue {wait:.3f} s); best remote "
                    f"{_who(r)} {r_ttft:.3f} s does not beat it by the "
                    f"{margin:.3f} s margin{charge_text}"
                )
        else:
            reason = (
                f"cost: {_who(target)} est. TTFT {ttft:.3f} s (holds ~{cached:.0f}/{prompt} "
                f"tokens, {_age_text(target.digest_age_s)}, queue {wait:.3f} s, "
                f"rtt {target.rtt_s * 1000:.0f} ms) vs local {local_ttft:.3f} s "
                f"({local_cached:.0f} cached, {_load_text(local)}){charge_text}"
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
        self, runner_up_s: float, c: Candidate, request: RouteRequest, memo: _Memo,
        charge: float = 0.0,
    ) -> int:
        """The most requests ``c`` may have queued or running when this one arrives for the
        forward to still beat the runner-up: served there, the first token comes at ``rtt +
        estimate - rtt``; refused, at about ``rtt + runner_up_s``. The inverse of the estimate
        in the outstanding count: past a full batch it grows by ``T / slots`` per request;
        below, by the prefill backlog of one more running request. ``charge``: ``c``'s
        extra-work charge now (``_charges``), which grows in proportion to the count too; the
        runner-up is then a score, and so is what it is compared with."""
        slots = c.load.slots if c.load.slots > 0 else 1
        costs = self.costs_for(c.load)
        service = self._service(request, slots, memo, None if costs is self.costs else costs)
        if not service > 0.0 or not runner_up_s < math.inf:  # also NaN: no limit, as before
            return 1 << 30
        full = self._estimate(c, request, memo, slots)
        rtt = 0.0 if c.is_local else c.rtt_s
        if charge > 0.0:
            now = c.load.queued + c.load.running
            if c.inflight > now:
                now = c.inflight
            per = charge / now  # the charge per outstanding request (> 0 only when now > 0)
            base = runner_up_s - (full[0] - rtt) - per * slots
            n = math.floor(base / (service / slots + per) + slots + 1e-9)
            if n >= slots:
                return min(n, 1 << 30)
            for k in range(slots - 1, 0, -1):
                if self._estimate(c, request, memo, k)[0] - rtt + per * k <= runner_up_s:
                    return k
            return 0
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


class RowBound:
    """A route's scores of its candidates as the index makes them, deepest holders first
    (``score``), and a floor under the score of a candidate not made yet (``floor``): one
    whose floor is above the second-best score so far (``second``) cannot matter to the
    decision, and ``PeerIndex.holder_candidates(bound=...)`` leaves it out, unscored and
    unbuilt; ``CostPolicy.choose_rows`` decides over the rest.

    What a decision reads of its scores (``_choose``, ``choose_rows``): the local one, the
    best remote with its equals, the runner-up (the best but the target) and the stand-ins'
    best. Each of the first is the best or the second-best score of all, or equal to it; so
    a candidate whose score is above the second-best one so far (``second``, which only
    falls as more are scored) is none of them, and neither is any candidate left out once
    it is known to score above it. The stand-ins' best matters only where the best remote
    is at least it, so never when all stand-ins are left out that way.

    The floor: only for routes where every load is plain (one slot, this
    node's speed or none: ``plain_loads``, for which the index builds rows), without the
    extra-work charge. A remote candidate matching ``m`` tokens is then estimated at
    ``(rtt + wait) + (cold - p * m * saving)``, plus a disk term that is never negative
    (validated figures), with ``wait >= 0`` and a confidence ``p <= 1``: at least
    ``rtt_floor + (cold - m * saving)`` for a round trip of at least ``rtt_floor`` and a
    positive ``saving`` (else at least ``rtt_floor + cold``), in floats too, since each
    operation rounds monotonically. A candidate is left out only where that floor is above
    ``second``: strictly, so it ties with nothing the decision reads."""

    __slots__ = ("memo", "_score", "best", "second", "_prompt", "_cold", "_saving")

    def __init__(self, policy: CostPolicy, request: RouteRequest) -> None:
        #: the memo of service and backlog times, shared with the decision
        self.memo: _Memo = {}
        self._score = policy._row_scorer(request, self.memo)
        #: the best and second-best scores so far
        self.best = math.inf
        self.second = math.inf
        costs = policy.costs
        self._prompt = request.prompt_tokens
        self._cold = costs.prefill_s(self._prompt, 0)  # (as ``_row_scorer`` has it)
        self._saving = costs.prefill_s_per_token - costs.cached_s_per_token

    def score(self, row: Row) -> float:
        """The row's estimated TTFT (``CostPolicy._row_scorer``), kept among the best two."""
        t = self._score(row)
        if t < self.second:
            if t < self.best:
                self.best, self.second = t, self.best
            else:
                self.second = t
        return t

    def floor(self, matched_tokens: int, rtt_floor: float) -> float:
        """At most the score of any remote candidate matching ``matched_tokens`` with a round
        trip of at least ``rtt_floor`` (see above): one above ``second`` cannot matter."""
        saving = self._saving
        if saving > 0.0:
            m = matched_tokens if matched_tokens < self._prompt else self._prompt
            return rtt_floor + (self._cold - m * saving)
        return rtt_floor + self._cold


class _RowCandidates(Sequence[Candidate]):
    """The candidates ``rows`` stand for, each built when first asked for (``choose_rows``)."""

    __slots__ = ("_rows", "_made")

    def __init__(self, rows: Sequence[Row]) -> None:
        self._rows = rows
        self._made: dict[int, Candidate] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> Candidate:  # type: ignore[override]
        c = self._made.get(i)
        if c is None:
            c = self._made[i] = make_candidate(*self._rows[i])
        return c
