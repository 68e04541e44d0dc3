"""The simple routing policies: ``local``, ``random``, ``round_robin``, ``least_loaded`` and
``longest_prefix`` (described in :mod:`peerinfer.core.routing`)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from peerinfer.core.routing.candidates import (
    Candidate,
    RouteDecision,
    RouteRequest,
    _age_text,
    _load_ratio,
    _load_text,
    _local_index,
    _ranked,
    _who,
)


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
