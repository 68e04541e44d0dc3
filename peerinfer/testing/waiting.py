"""Bounded waits for tests: poll a condition until it holds, fail after a bound, never hang.

``wait_until`` polls a synchronous predicate (state the test can read at once: a host's
connections, a node's core); ``wait_for`` awaits a probe (a status request to a running node)
and fails with the last value it saw, so a failed wait says what it was waiting on.
Both poll in real time; the bound is the caller's, since only the caller knows how long its
condition may take on a loaded machine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

__all__ = ["wait_for", "wait_until"]

T = TypeVar("T")


async def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, *, poll_s: float = 0.02) -> None:
    """Return once ``predicate()`` is true; ``trio.TooSlowError`` after ``timeout`` seconds."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(poll_s)


async def wait_for(
    probe: Callable[[], Awaitable[T]], ok: Callable[[T], bool], timeout_s: float, what: str,
    *, poll_s: float = 0.2,
) -> T:
    """Poll ``await probe()`` until ``ok(value)`` and return that value; after ``timeout_s``
    fail with an ``AssertionError`` naming ``what`` and the last value seen."""
    last: T | None = None
    try:
        with trio.fail_after(timeout_s):
            while True:
                last = await probe()
                if ok(last):
                    return last
                await trio.sleep(poll_s)
    except trio.TooSlowError:
        raise AssertionError(f"not within {timeout_s} s: {what}; last seen: {last!r}") from None
