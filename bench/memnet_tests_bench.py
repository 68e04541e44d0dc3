"""Wall time of the node tests moved onto the in-memory network (issue 22), before and after.

    python bench/memnet_tests_bench.py --before /path/to/checkout/of/main [--runs 2] [--group G]

Runs, alternating, ``--runs`` times each: the tests as they were on libp2p over 127.0.0.1
in real time (in the ``--before`` checkout, with its own .venv), then the same tests on
``peerinfer.testing.memnet`` under trio's virtual clock (in this checkout). Prints pytest's own
time and the wall time of each run, the load average, and after/before. The figures go to
docs/architecture.md ("Node tests on the in-memory network").

``--group first`` (the default): the first 20 moved (``--before`` a checkout of 29c908e or
older). ``--group second``: the 18 moved for the suite's time (the KV pulls on the simulated
engine, the wall-clock step and the request flood; ``--before`` a checkout of 68d5d27 or
older, where they keep the same names).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
INPROCESS = "tests/node/test_node_inprocess.py::"
FIVE = [INPROCESS + name for name in (
    "test_chain_bootstrap_converges_to_full_membership_and_digests",
    "test_repeated_prefix_is_forwarded_to_the_holder_and_served_from_cache",
    "test_bad_requests_are_refused_and_the_node_keeps_serving",
    "test_streaming_and_chat",
    "test_a_dead_peer_costs_no_request",
)]
FAIRNESS = "tests/node/test_fairness_nodes.py::"
THREE = [FAIRNESS + name for name in (
    "test_a_flooding_peer_cannot_starve_an_honest_one",
    "test_a_busy_refusal_reaches_the_client_with_its_retry_hint",
    "test_eight_requesters_are_served_fairly",
)]
LIARS = ["tests/node/test_trust_liars.py"]
GROUPS: dict[str, tuple[list[str], list[str]]] = {
    "first": (FIVE + LIARS + THREE, ["tests/node/test_node_memnet.py"] + LIARS + THREE),
}
KV_PULLS = "tests/node/test_kv_pull_nodes.py::"
ADMISSION = "tests/node/test_admission_nodes.py::"
SECOND = [KV_PULLS + name for name in (
    "test_a_pull_serves_the_tokens_of_a_recompute_with_the_prefix_cached",
    "test_a_probe_measures_the_link",
    "test_in_auto_mode_a_holder_without_a_link_figure_is_probed",
    "test_a_holder_bounds_each_peer_s_pull_rate_and_the_format",
    "test_a_holder_refuses_a_pull_of_blocks_larger_than_a_frame",
    "test_a_holder_serves_one_pull_per_peer_at_a_time_each_within_the_pull_timeout",
    "test_a_holder_refuses_a_peer_it_does_not_trust_and_the_request_is_recomputed",
    "test_without_the_open_swarm_opt_in_a_node_never_pulls",
    "test_a_holder_serving_altered_kv_is_caught_banned_and_the_request_answered",
    "test_a_pull_whose_checks_are_turned_off_meanwhile_blames_nobody",
    "test_a_holder_whose_engine_is_busy_a_while_still_serves_the_pull",
    "test_a_holder_that_vanishes_mid_pull_leaves_the_request_to_a_recompute",
    "test_a_block_of_the_wrong_length_is_refused_as_it_arrives",
)] + [ADMISSION + name for name in (
    "test_a_clock_step_or_skew_changes_nothing",
    "test_a_flood_of_maximal_requests_delays_an_honest_peer_by_one_service_at_most",
)]
GROUPS["second"] = (SECOND, SECOND)


def run(checkout: Path, tests: list[str]) -> tuple[float, float, str]:
    """(pytest's time, wall time, the summary line) of one pytest run in ``checkout``."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    cmd = [str(checkout / ".venv/bin/pytest"), "-q", "-p", "no:cacheprovider", *tests]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - started
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    found = re.search(r"in ([0-9.]+)s", summary)
    if done.returncode != 0 or found is None:
        sys.exit(f"pytest failed in {checkout}: {summary}")
    return float(found.group(1)), wall, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of main before the move")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--group", choices=sorted(GROUPS), default="first", help="which moved tests")
    args = parser.parse_args()
    before_tests, after_tests = GROUPS[args.group]
    before: list[float] = []
    after: list[float] = []
    for i in range(args.runs):
        for label, checkout, tests, into in (("before", args.before, before_tests, before), ("after", HERE, after_tests, after)):
            took, wall, summary = run(checkout, tests)
            into.append(took)
            print(f"run {i + 1} {label:6s} pytest {took:6.2f} s  wall {wall:6.2f} s  "
                  f"load {os.getloadavg()[0]:.2f}  ({summary})", flush=True)
    print(f"after/before (pytest's time, means): {sum(after) / len(after) / (sum(before) / len(before)):.2f}")


if __name__ == "__main__":
    main()
