"""``Engine._on_evict`` returns at once for a block with nothing to spill, digest or free (a
simulated engine's blocks without a disk tier): the plans, the cache and its change reports
are those of the full path, which is the reference here."""

from __future__ import annotations

import random

import pytest

from peerinfer.core.costmodel import CostModel
from peerinfer.core.messages import SamplingParams
from peerinfer.core.prefix import PrefixHasher
from peerinfer.core.radix import RadixNode
from peerinfer.engine import base as base_module
from peerinfer.engine.simulated import SimulatedEngine

COSTS = CostModel(
    prefill_s_per_token=0.001, cached_s_per_token=0.0001, decode_s_per_token=0.01, overhead_s=0.005
)


class _FullPathEngine(SimulatedEngine):
    """The eviction callback as it was before the early return (the reference)."""

    def _on_evict(self, node: RadixNode) -> None:
        payload, node.payload = node.payload, None
        try:
            data = None if self._disk is None else self._spill(node, payload)
            base_module.dropped(self, node.hash, payload, data)
        finally:
            if payload is not None:
                self.free_segment(payload)


def _engine(cls: type[SimulatedEngine], disk: bool) -> SimulatedEngine:
    engine = cls(costs=COSTS, time_scale=0.0, vocab_size=1000)
    engine.configure_cache(PrefixHasher(engine.fingerprint), capacity_tokens=320)
    if disk:
        engine.configure_sim_disk(200 * engine.kv_bytes_per_token * 16, 5e8)
    return engine


@pytest.mark.parametrize("disk", [False, True])
def test_evicting_without_the_full_path_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, disk: bool
) -> None:
    calls: list[int] = []
    full = base_module.dropped

    def counted(*args: object) -> None:
        calls.append(1)
        full(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(base_module, "dropped", counted)
    rng = random.Random(f"evict-{disk}")
    heads = [tuple(rng.randrange(4, 1000) for _ in range(rng.randint(0, 120))) for _ in range(6)]
    fast, reference = _engine(SimulatedEngine, disk), _engine(_FullPathEngine, disk)
    params = SamplingParams(max_tokens=12)
    for _ in range(150):
        prompt = rng.choice(heads) + tuple(rng.randrange(4, 1000) for _ in range(rng.randint(1, 60)))
        assert fast.plan(prompt, params) == reference.plan(prompt, params)
        assert sorted(fast.cached_block_hashes()) == sorted(reference.cached_block_hashes())
    assert fast.statistics() == reference.statistics()
    # Evictions happened; without a disk tier the fast one never took the full path.
    evictions = reference.radix_cache.stats().evicted_blocks  # type: ignore[union-attr]
    assert evictions > 100
    fast_calls = len(calls) - evictions
    assert fast_calls == (evictions if disk else 0)
