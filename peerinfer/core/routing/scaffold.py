"""The ``scaffold_hash`` policy (Mesh LLM's cache hints) and the hints a node advertises for
it (described in :mod:`peerinfer.core.routing`)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from peerinfer.core.routing.candidates import (
    Candidate,
    RouteDecision,
    RouteRequest,
    _load_ratio,
    _load_text,
    _local_index,
    _outstanding,
    _ranked,
    _who,
)
from peerinfer.errors import ConfigError
from peerinfer.types import PeerId

#: Mesh LLM's cache-hint limits, which the ``scaffold_hash`` policy keeps: the most scaffold
#: hashes a node advertises, and how long after serving one it still does.
MAX_SCAFFOLD_HINTS = 128
SCAFFOLD_HINT_LIFETIME_S = 120.0


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
