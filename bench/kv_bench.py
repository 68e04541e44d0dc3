"""Issue 24's KV benchmarks: a small argparse dispatcher, one subcommand per study.

    python bench/kv_bench.py pull       # TTFT of pulling a 2,000-token prefix's KV from a peer
                                        # plus the suffix, against a local recompute, on real
                                        # nodes (bench/kv_pull_bench.py; docs/performance.md)

Each subcommand is a module beside this one with ``add_parser(subparsers)``, which sets the
function to run (``run``) on its parser; add a study by adding its module to ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: subcommand -> the module (in bench/) that adds its parser
SUBCOMMANDS = {"pull": "kv_pull_bench"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for module in dict.fromkeys(SUBCOMMANDS.values()):
        importlib.import_module(module).add_parser(sub)
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], None] = args.run
    run(args)


if __name__ == "__main__":
    main()
