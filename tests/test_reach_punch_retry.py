"""Hole punching is retried after py-libp2p's DCUtR spends its attempts (peerinfer.net.reach).

DCUtR tries a relayed peer 3 times and then never again while the relayed connection lasts;
a punch that lost one race would stay relayed for good. ``_give_back_punch_budgets`` gives the
budget back after ``PUNCH_RETRY_S``, doubling per peer. Driven with a fake DCUtR state on
trio's virtual clock: what matters is which attempt tables it edits, and when.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio
import trio.testing

from peerinfer.net.reach import (
    MAX_HOLE_PUNCH_ATTEMPTS,
    PUNCH_RETRY_MAX_S,
    PUNCH_RETRY_S,
    _give_back_punch_budgets,
)


def _dcutr() -> SimpleNamespace:
    return SimpleNamespace(_hole_punch_attempts={}, _direct_connections=set())


def test_spent_budgets_come_back_after_a_doubling_wait() -> None:
    async def main() -> None:
        dcutr = _dcutr()
        spent = MAX_HOLE_PUNCH_ATTEMPTS
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_give_back_punch_budgets, dcutr)
            dcutr._hole_punch_attempts.update({"stuck": spent, "trying": 1, "punched": spent})
            dcutr._direct_connections.add("punched")
            await trio.sleep(PUNCH_RETRY_S - 2)
            assert dcutr._hole_punch_attempts["stuck"] == spent  # not yet
            await trio.sleep(4)
            assert "stuck" not in dcutr._hole_punch_attempts  # given back
            assert dcutr._hole_punch_attempts["trying"] == 1  # still has attempts: untouched
            assert dcutr._hole_punch_attempts["punched"] == spent  # direct: nothing to retry
            # It fails its three attempts again: the next wait is twice as long.
            dcutr._hole_punch_attempts["stuck"] = spent
            await trio.sleep(PUNCH_RETRY_S + 2)
            assert dcutr._hole_punch_attempts["stuck"] == spent
            await trio.sleep(PUNCH_RETRY_S + 2)
            assert "stuck" not in dcutr._hole_punch_attempts
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_wait_is_capped() -> None:
    failures = 12  # 15 s doubled past the 600 s cap
    async def main() -> None:
        dcutr = _dcutr()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_give_back_punch_budgets, dcutr)
            waits = []
            for _ in range(failures):
                dcutr._hole_punch_attempts["symmetric"] = MAX_HOLE_PUNCH_ATTEMPTS
                start = trio.current_time()
                while "symmetric" in dcutr._hole_punch_attempts:
                    await trio.sleep(1)
                waits.append(trio.current_time() - start)
            nursery.cancel_scope.cancel()
        assert waits[0] == pytest.approx(PUNCH_RETRY_S, abs=2)
        assert waits[1] == pytest.approx(2 * PUNCH_RETRY_S, abs=2)
        assert max(waits) <= PUNCH_RETRY_MAX_S + 2
        assert waits[-1] == pytest.approx(PUNCH_RETRY_MAX_S, abs=2)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
