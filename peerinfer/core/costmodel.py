"""The cost model: how long a node takes to serve a request, from token counts alone.

Used by the ``cost`` routing policy (to estimate a candidate's time to first token), by the
simulated engine (to decide how long to sleep) and by the simulator (virtual service times), so
that all three agree. ``peerinfer calibrate`` measures the figures on a real model; the defaults
below are such a measurement (see ``DEFAULT_COSTS``'s note).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from peerinfer.errors import ConfigError


@dataclass(frozen=True, slots=True)
class CostModel:
    """Per-token costs in seconds and the number of requests a node serves at once.

    ``prefill_s_per_token``: one prompt token that is not in the cache.
    ``cached_s_per_token``: one prompt token taken from the cache (rebuilding the model's cache
    from stored segments and attending over it is cheap, not free).
    ``decode_s_per_token``: one generated token.
    ``overhead_s``: fixed cost per request (tokenizing, scheduling, the first sampling step).
    ``slots``: how many requests run concurrently; more wait in the queue.
    """

    prefill_s_per_token: float = 0.00296
    cached_s_per_token: float = 0.000055
    decode_s_per_token: float = 0.0759
    overhead_s: float = 0.0474
    slots: int = 1

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "cached_s_per_token", "decode_s_per_token", "overhead_s"):
            v = getattr(self, name)
            if not (v >= 0.0 and v < 1e6):
                raise ConfigError(f"cost model: {name} must be a non-negative number, got {v!r}")
        if self.slots < 1:
            raise ConfigError(f"cost model: slots must be >= 1, got {self.slots}")

    def prefill_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        """Time to first token once the request runs: overhead plus prefill of the rest."""
        cached = min(cached_tokens, prompt_tokens)
        return (
            self.overhead_s
            + (prompt_tokens - cached) * self.prefill_s_per_token
            + cached * self.cached_s_per_token
        )

    def decode_s(self, generated_tokens: int) -> float:
        """Time for the tokens after the first."""
        return max(0, generated_tokens - 1) * self.decode_s_per_token

    def service_s(self, prompt_tokens: int, cached_tokens: int, generated_tokens: int) -> float:
        return self.prefill_s(prompt_tokens, cached_tokens) + self.decode_s(generated_tokens)

    def with_slots(self, slots: int) -> CostModel:
        return replace(self, slots=slots)

    def to_dict(self) -> dict[str, float | int]:
        return {
            "prefill_s_per_token": self.prefill_s_per_token,
            "cached_s_per_token": self.cached_s_per_token,
            "decode_s_per_token": self.decode_s_per_token,
            "overhead_s": self.overhead_s,
            "slots": self.slots,
        }

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> CostModel:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        try:
            return cls(**known)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ConfigError(f"cost model: {exc}") from exc


#: SmolLM2-135M-Instruct (float32, CPU, one torch thread) as measured by
#: ``peerinfer calibrate --clock cpu`` on the 2-core development machine (docs/performance.md).
#: A GPU or more threads are faster: run ``peerinfer calibrate`` on your machine and pass
#: ``--costs`` to the node.
DEFAULT_COSTS = CostModel()

__all__ = ["DEFAULT_COSTS", "CostModel"]
