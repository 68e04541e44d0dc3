import sys

from peerinfer.cli import main

sys.exit(main())
