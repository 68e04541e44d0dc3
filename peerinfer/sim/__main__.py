"""``python -m peerinfer.sim``: the same as ``peerinfer sim``."""

from peerinfer.sim.cli import exit_skipping_teardown, main

exit_skipping_teardown(main())
