"""``peerinfer node``'s limit flags (issue 21): ``--max-tokens``, ``--max-prompt-tokens``,
``--max-queued-per-requester``, ``--preempt-after-tokens`` reach the node's options and its
core's configuration; a bad value is one line of error, exit status 2, before any model load."""

from __future__ import annotations

import dataclasses

import pytest
import trio

from peerinfer.cli import build_parser, main, node_options
from peerinfer.core.costmodel import CostModel
from peerinfer.engine.simulated import SimulatedEngine
from peerinfer.node import Node
from peerinfer.node.options import (
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PREEMPT_AFTER_TOKENS,
)

BASE = ("node", "--engine", "simulated", "--listen", "/ip4/127.0.0.1/tcp/0", "--no-mdns",
        "--http", "none")
LIMITS = ("--max-tokens", "100", "--max-prompt-tokens", "200",
          "--max-queued-per-requester", "3", "--preempt-after-tokens", "5")


def options_of(*flags: str):  # type: ignore[no-untyped-def]
    return node_options(build_parser("node").parse_args([*BASE, *flags]))


def test_the_flags_reach_the_options_and_defaults_stay() -> None:
    given = options_of(*LIMITS)
    assert (given.max_tokens, given.max_prompt_tokens, given.max_queued_per_requester,
            given.preempt_after_tokens) == (100, 200, 3, 5)
    plain = options_of()
    assert (plain.max_tokens, plain.max_prompt_tokens, plain.max_queued_per_requester,
            plain.preempt_after_tokens) == (DEFAULT_MAX_TOKENS, DEFAULT_MAX_PROMPT_TOKENS, None,
                                            DEFAULT_PREEMPT_AFTER_TOKENS)
    assert options_of("--preempt-after-tokens", "0").preempt_after_tokens is None  # never


@pytest.mark.parametrize(
    ("flags", "queued", "preempt"),
    [(LIMITS, 3, 5), (("--preempt-after-tokens", "0"), 4, None)],
)
def test_the_flags_reach_the_running_nodes_core(
    flags: tuple[str, ...], queued: int, preempt: int | None
) -> None:
    costs = CostModel(prefill_s_per_token=0.0001, cached_s_per_token=0.00001,
                      decode_s_per_token=0.001, overhead_s=0.001, slots=4)
    opts = dataclasses.replace(options_of(*flags), persist_identity=False, costs=costs)

    async def run() -> None:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                node = Node(opts, engine=SimulatedEngine(costs=costs))
                await nursery.start(node.serve)
                assert node.core is not None
                cfg = node.core.config
                assert (cfg.max_new_tokens, cfg.max_prompt_tokens) == (
                    opts.max_tokens, opts.max_prompt_tokens)
                # Unset: one requester waits for at most the engine's slots.
                assert cfg.queued_per_requester == queued
                assert cfg.preempt_after_tokens == preempt
                nursery.cancel_scope.cancel()

    trio.run(run)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--max-tokens", "0"), "--max-tokens must be an integer >= 1, got 0"),
        (("--max-tokens", "100000"), "--max-tokens must be at most 65536"),
        (("--max-prompt-tokens", "-5"), "--max-prompt-tokens must be an integer >= 1, got -5"),
        (("--max-prompt-tokens", "200000"), "--max-prompt-tokens must be at most 131072"),
        (("--max-queued-per-requester", "0"), "--max-queued-per-requester must be an integer >= 1"),
        (("--preempt-after-tokens", "-1"), "--preempt-after-tokens must be >= 0 (0: never preempt)"),
        (("--max-tokens", "many"), "argument --max-tokens: invalid int value: 'many'"),
    ],
)
def test_a_bad_value_is_one_line_of_error(
    flags: tuple[str, ...], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        status = main([*BASE, *flags])
    except SystemExit as exc:  # argparse's own refusal of a non-integer
        status = int(exc.code or 0)
    err = capsys.readouterr().err
    assert status == 2
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and says in errors[0], err
