"""``peerinfer node`` starts without importing what only other commands use (peerinfer.cli).

Under load every second of a node's start-up counts against joining (issue 13: joined and
serving within 10 s of start); the simulator and the calibration module are imported only
for their own commands, whose arguments and help stay complete."""

from __future__ import annotations

import subprocess
import sys

import pytest

from peerinfer.cli import build_parser, main


def test_parsing_node_imports_neither_the_simulator_nor_calibration() -> None:
    code = (
        "import sys\n"
        "from peerinfer.cli import build_parser\n"
        "words = ['node', '--engine', 'simulated', '--http', 'none']\n"
        "args = build_parser(words[0]).parse_args(words)\n"
        "assert args.command == 'node'\n"
        "print(sorted(m for m in ('peerinfer.sim', 'peerinfer.engine.calibrate') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("command", "option"), [("sim", "--nodes"), ("calibrate", "--repeats")])
def test_the_other_commands_keep_their_arguments(
    command: str, option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert option in capsys.readouterr().out
    # Built whole (no command named), as tests and tools call it.
    assert build_parser().parse_args([command, option, "3"]).command == command
