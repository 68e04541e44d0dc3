"""The simulated network: one-way link delays between every pair of nodes.

A delay spec is text, in milliseconds:

* ``5``: every link has a one-way delay of 5 ms;
* ``uniform:2:20``: each pair's delay drawn once, uniformly in [2, 20] ms;
* ``lognormal:10:0.5``: each pair's delay drawn once from a log-normal distribution with a
  median of 10 ms and a log-space standard deviation of 0.5 (heavy-tailed home links);
* ``exp:10``: each pair's delay drawn once from an exponential distribution of mean 10 ms.

A pair's delay is drawn once per run and is the same in both directions and for every message
between them: a pair of libp2p peers talk over one long-lived connection, which keeps messages
in order, so per-message jitter (which would reorder them) is not modelled. The draws come from
their own ``random.Random``, so the same seed gives the same network whatever else changes.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from peerinfer.errors import ConfigError

_KINDS = ("constant", "uniform", "lognormal", "exp")


@dataclass(frozen=True, slots=True)
class DelayModel:
    """A parsed delay spec (all figures in milliseconds)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str | float | int) -> DelayModel:
        """Parse ``5`` | ``uniform:LO:HI`` | ``lognormal:MEDIAN:SIGMA`` | ``exp:MEAN`` (ms)."""
        if isinstance(spec, (int, float)):
            return cls._checked("constant", float(spec), 0.0)
        text = str(spec).strip().lower()
        parts = text.split(":")
        try:
            if len(parts) == 1:
                return cls._checked("constant", float(parts[0]), 0.0)
            kind, args = parts[0], [float(p) for p in parts[1:]]
        except ValueError as exc:
            raise ConfigError(f"bad delay spec {spec!r}: {exc}") from exc
        if kind == "constant" and len(args) == 1:
            return cls._checked(kind, args[0], 0.0)
        if kind == "uniform" and len(args) == 2:
            return cls._checked(kind, args[0], args[1])
        if kind == "lognormal" and len(args) == 2:
            return cls._checked(kind, args[0], args[1])
        if kind == "exp" and len(args) == 1:
            return cls._checked(kind, args[0], 0.0)
        raise ConfigError(
            f"bad delay spec {spec!r}: use MS, uniform:LO:HI, lognormal:MEDIAN:SIGMA or exp:MEAN"
        )

    @classmethod
    def _checked(cls, kind: str, a: float, b: float) -> DelayModel:
        if not (math.isfinite(a) and math.isfinite(b)) or a < 0 or b < 0:
            raise ConfigError(f"delay figures must be finite and non-negative, got {a}, {b}")
        if kind == "uniform" and b < a:
            raise ConfigError(f"uniform delay needs LO <= HI, got {a}, {b}")
        return cls(kind, a, b)

    def spec(self) -> str:
        """The canonical text form (what ``parse`` reads back)."""
        if self.kind == "constant":
            return f"{self.a:g}"
        if self.kind == "exp":
            return f"exp:{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"

    def mean_ms(self) -> float:
        if self.kind == "constant":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "lognormal":
            return self.a * math.exp(self.b * self.b / 2)
        return self.a

    def draw_ms(self, rng: random.Random) -> float:
        if self.kind == "constant":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        if self.kind == "lognormal":
            return self.a * math.exp(rng.gauss(0.0, self.b)) if self.a > 0 else 0.0
        return rng.expovariate(1.0 / self.a) if self.a > 0 else 0.0

    def matrix_s(self, nodes: int, rng: random.Random) -> list[list[float]]:
        """A symmetric ``nodes x nodes`` matrix of one-way delays in seconds (0 on the diagonal)."""
        m = [[0.0] * nodes for _ in range(nodes)]
        for i in range(nodes):
            for j in range(i + 1, nodes):
                d = self.draw_ms(rng) / 1000.0
                m[i][j] = m[j][i] = d
        return m


__all__ = ["DelayModel"]
