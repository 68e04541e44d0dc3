"""What a simulation is given: the workload's requests, and each node's engine as it uses it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from peerinfer.core.messages import SamplingParams
from peerinfer.core.quickinit import quick_init
from peerinfer.types import BlockHash


@quick_init
@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of the workload: its tokens, sampling and a label (its subject) for series."""

    tokens: tuple[int, ...]
    params: SamplingParams
    label: str = ""
    #: a user who always enters through the same node (a conversation): node ``home % nodes``
    home: int | None = None
    #: full blocks of the prompt that are the label's shared prefix (for residency probes)
    prefix_blocks: int = 0
    #: the salted hash of the prompt's scaffold (``PrefixHasher.scaffold_hash``), the key of
    #: the ``scaffold_hash`` policy; None: the prompt has none
    scaffold: int | None = None


class PlanLike(Protocol):
    """What serving one request costs (``peerinfer.engine.simulated.Plan``); read only."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def cached_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...

    @property
    def ttft_s(self) -> float: ...

    @property
    def service_s(self) -> float: ...

    @property
    def cache_added(self) -> Sequence[BlockHash]: ...

    @property
    def cache_removed(self) -> Sequence[BlockHash]: ...

    @property
    def disk_tokens(self) -> int: ...

    @property
    def disk_s(self) -> float: ...


class EngineLike(Protocol):
    """What the simulator needs of a node's engine (``SimulatedEngine`` provides it)."""

    def plan(self, tokens: Sequence[int], params: SamplingParams) -> PlanLike: ...

    def cached(self, h: BlockHash) -> bool: ...

    #: ``Load.disk``'s figure given the blocks the node announces (None: no disk tier)
    disk_figure: Callable[[int], tuple[int, int] | None] | None

    def restart(self, saved: bool) -> Sequence[BlockHash]:
        """The machine comes back: memory lost, disk tier kept; the blocks it holds now."""
        ...


__all__ = ["EngineLike", "PlanLike", "SimRequest"]
