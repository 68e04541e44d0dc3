"""A simulation writes no attribute of any class of the package: CPython 3.11 drops what it
specialized for a class's attribute reads, its instances' and its subclasses' too, whenever an
attribute of the class is written. A counter kept as a class attribute and bumped on every
route, tick or rebalance made the index's and the members' reads take the slow path all run
long (1% of a 64-node run's instructions each); counters live on objects instead
(``Members.counts``, ``ReplicaIndex.walk_counts``, ``ReplicaBudget.rebalance_counts``)."""

from __future__ import annotations

import sys
from typing import Any

from peerinfer.sim.config import SimConfig
from peerinfer.sim.run import simulate


def _class_attributes() -> dict[tuple[str, str], dict[str, int]]:
    """Every class of every loaded ``peerinfer`` module: its own attributes, each by identity."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("peerinfer") or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                attrs: dict[str, Any] = dict(vars(value))
                out[(name, value.__qualname__)] = {k: id(v) for k, v in attrs.items()}
    return out


def test_a_simulation_writes_no_class_attribute() -> None:
    # A first run loads every module and fills what a class fills once (its first use).
    simulate(SimConfig(nodes=12, requests=60, rate=2.0, seed=2))
    before = _class_attributes()
    sim, summary = simulate(SimConfig(nodes=12, requests=300, rate=2.0, seed=3))
    after = _class_attributes()
    assert summary["completed"] == 300
    changed = {
        cls: sorted(k for k in set(attrs) | set(after.get(cls, {}))
                    if attrs.get(k) != after.get(cls, {}).get(k))
        for cls, attrs in before.items()
    }
    assert {cls: names for cls, names in changed.items() if names} == {}
