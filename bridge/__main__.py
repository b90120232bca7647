"""`python -m bridge`: the bridge process's own entry point (see bridge/cli.py)."""

import sys

from bridge.cli import main

sys.exit(main())
