"""An audit waits for the local engine to be idle (peerinfer/node/trust.py), woken by the core's
moves rather than by polling; in trio's virtual time."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from peerinfer.node import NodeOptions
from peerinfer.node.context import NodeContext
from peerinfer.node.trust import AUDIT_IDLE_S, AUDIT_MAX_WAIT_S, _wait_engine_idle


class _Core:
    """What the wait reads of the core: its queued and running counts."""

    def __init__(self, queued: int, running: int) -> None:
        self.queued, self.running = queued, running

    def statistics(self) -> Any:
        return SimpleNamespace(queued=self.queued, running=self.running)


def _ctx() -> NodeContext:
    return NodeContext(NodeOptions(engine="simulated"), feed=lambda event: None)


async def _waited(ctx: NodeContext, core: _Core) -> float:
    start = trio.current_time()
    await _wait_engine_idle(ctx, core)  # type: ignore[arg-type]
    return trio.current_time() - start


async def test_an_idle_engine_is_audited_after_the_idle_period(autojump_clock: trio.testing.MockClock) -> None:
    assert await _waited(_ctx(), _Core(0, 0)) == pytest.approx(AUDIT_IDLE_S)


async def test_the_audit_waits_while_requests_run_and_the_idle_period_starts_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ctx, core = _ctx(), _Core(queued=1, running=1)

    async def engine_moves() -> None:
        await trio.sleep(2.0)
        core.queued = core.running = 0  # the last request ended
        ctx.note_core_moved()
        await trio.sleep(AUDIT_IDLE_S / 2)
        core.running = 1  # another came before the idle period passed
        ctx.note_core_moved()
        await trio.sleep(1.0)
        core.running = 0
        ctx.note_core_moved()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine_moves)
        waited = await _waited(ctx, core)
    assert waited == pytest.approx(2.0 + AUDIT_IDLE_S / 2 + 1.0 + AUDIT_IDLE_S)


async def test_a_busy_engine_is_audited_after_the_longest_wait(autojump_clock: trio.testing.MockClock) -> None:
    assert await _waited(_ctx(), _Core(queued=0, running=3)) == pytest.approx(AUDIT_MAX_WAIT_S)
