"""The simulator's requests are the workload's prompts tokenized whole: ``sim_requests``
tokenizes each distinct part once and keeps each distinct prompt's tokens, prefix blocks and
label; this checks every request against doing it plainly, item by item."""

from __future__ import annotations

from importlib import resources

import pytest

from peerinfer.core.prefix import DEFAULT_BLOCK_SIZE
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.sim import SimConfig
from peerinfer.sim.run import sim_requests, workload_items
from peerinfer.workload import EXCERPT_RESOURCE


@pytest.mark.parametrize("workload", ["mmlu", "multiturn", "rag"])
def test_each_request_is_its_item_tokenized_whole(workload: str) -> None:
    excerpt = str(resources.files("peerinfer").joinpath("data", EXCERPT_RESOURCE))
    config = SimConfig(
        nodes=4, requests=1_500, seed=5, skew="zipf:1.0", workload=workload, data=excerpt
    )
    items = workload_items(config)
    requests = sim_requests(config, SimulatedEngine())
    plain = SimulatedEngine()
    assert len(requests) == len(items) == 1_500
    repeats = 0
    seen: set[tuple[int, ...]] = set()
    for item, request in zip(items, requests, strict=True):
        tokens = tuple(plain.tokenize(item.prompt))
        assert request.tokens == tokens
        repeats += tokens in seen
        seen.add(tokens)
        head = tuple(plain.tokenize(item.prefix))
        blocks = len(head) // DEFAULT_BLOCK_SIZE if tokens[: len(head)] == head else 0
        assert request.prefix_blocks == blocks
        if item.conversation is not None:
            assert request.label == f"conversation {item.conversation}"
        else:
            assert request.label == item.prefix_key.removeprefix("mmlu:")
        assert request.params.max_tokens == item.max_tokens
    assert repeats > 100 or workload != "mmlu"  # the memos were asked again
