"""Two small pacing policies, pure: the clock (``now``) and the dice (``rng``) are parameters.

``Backoff`` is the bootstrap redial schedule: capped exponential with "equal jitter" (half the
delay fixed, half random), reset on success, never giving up. py-libp2p 0.8.1's own bootstrap
discovery removes a bootstrap peer for good after 3 failed reconnects, so a 30-60 s outage of
the bootstrap node isolates us; this schedule keeps trying, at most every ``maximum`` seconds.

``TokenBucket`` paces our own gossip publishing: ``rate`` tokens per second, at most ``burst``
saved up. ``delay(now)`` says how long to wait before the next message may go; the caller sleeps
and calls ``take(now)``. Waiting instead of dropping turns libp2p's silent spam-protection drops
into visible backpressure.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class Backoff:
    """Capped exponential backoff with equal jitter; ``next_delay`` never exceeds ``maximum``."""

    minimum: float
    maximum: float
    failures: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.minimum <= self.maximum:
            raise ValueError("need 0 < minimum <= maximum")

    def next_delay(self, rng: random.Random) -> float:
        """Record one more failure and return how long to wait before the next attempt."""
        ceiling = min(self.maximum, self.minimum * 2.0 ** min(self.failures, 60))
        self.failures += 1
        return ceiling / 2 + rng.uniform(0, ceiling / 2)

    def reset(self) -> None:
        """A success: the next failure waits ``minimum`` again."""
        self.failures = 0


@dataclass(slots=True)
class TokenBucket:
    """``rate`` tokens per second, holding at most ``burst``; starts full."""

    rate: float
    burst: float
    _tokens: float = field(init=False)
    _updated: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst < 1:
            raise ValueError("need rate > 0 and burst >= 1")
        self._tokens = self.burst

    def _refill(self, now: float) -> None:
        if self._updated is not None and now > self._updated:
            self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.rate)
        if self._updated is None or now > self._updated:
            self._updated = now

    def delay(self, now: float) -> float:
        """Seconds until one token is available (0 if one is available now)."""
        self._refill(now)
        if self._tokens >= 1:
            return 0.0
        return (1 - self._tokens) / self.rate

    def take(self, now: float) -> bool:
        """Take one token if available; return whether one was taken."""
        self._refill(now)
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False


__all__ = ["Backoff", "TokenBucket"]
