"""The kernel's collector settings during a run (``SimKernel._run``: set-up objects frozen, the
youngest generation collected less often) and the set-up's (``run._no_collections``: paused)
change nothing a run decides, and are restored."""

from __future__ import annotations

import gc

import pytest

from peerinfer.sim import SimConfig, simulate
from peerinfer.sim import kernel as kernel_module
from peerinfer.sim import run as run_module


def _outcome(config: SimConfig) -> tuple[object, ...]:
    sim, s = simulate(config)
    return (
        list(sim.target), list(sim.first), list(sim.finish), list(sim.served), sim.events,
        s["hit_ratio"], s["ttft_mean_s"], s["anti_entropy"],
    )


def test_collecting_often_or_never_decides_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    config = SimConfig(nodes=12, requests=400, seed=7, skew="zipf:1.0", crash_rate=30.0)
    tuned = _outcome(config)
    monkeypatch.setattr(kernel_module, "GC_YOUNG_THRESHOLD", 50)
    monkeypatch.setattr(gc, "freeze", lambda: None)
    before = gc.get_threshold()
    gc.set_threshold(50, 2, 2)  # collect all the time
    try:
        often = _outcome(config)
    finally:
        gc.set_threshold(*before)
    gc.disable()
    try:
        never = _outcome(config)
    finally:
        gc.enable()
    assert tuned == often == never


def test_a_run_restores_the_collector() -> None:
    before = gc.get_threshold(), gc.get_freeze_count()
    simulate(SimConfig(nodes=4, requests=40, seed=1))
    assert (gc.get_threshold(), gc.get_freeze_count()) == before


def test_the_set_up_runs_with_the_collector_paused_and_restores_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[bool] = []
    making = run_module.sim_requests

    def watched(*args: object) -> object:
        seen.append(gc.isenabled())
        return making(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(run_module, "sim_requests", watched)
    config = SimConfig(nodes=4, requests=40, seed=1)
    simulate(config)
    assert seen == [False] and gc.isenabled()
    gc.disable()  # a caller's own choice is kept
    try:
        simulate(config)
        assert seen == [False, False] and not gc.isenabled()
    finally:
        gc.enable()
