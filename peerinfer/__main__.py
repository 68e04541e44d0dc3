"""``python -m peerinfer``, and the ``peerinfer`` program's entry point (``entry``)."""

import sys

from peerinfer.cli import main


def entry() -> None:
    """``main``, then exit with its status. After ``peerinfer sim`` the process ends without
    freeing the simulation's heap object by object (``exit_skipping_teardown``: a minute after
    a 1,024-node run). Tests call ``main`` and keep their process."""
    status = main()
    if sys.argv[1:2] == ["sim"]:
        from peerinfer.sim.cli import exit_skipping_teardown

        exit_skipping_teardown(status)
    sys.exit(status)


if __name__ == "__main__":
    entry()
