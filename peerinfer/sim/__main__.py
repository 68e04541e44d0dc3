"""``python -m peerinfer.sim``: the same as ``peerinfer sim``."""

import sys

from peerinfer.sim.cli import main

sys.exit(main())
