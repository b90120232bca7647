"""`python -m bridge`: the bridge process's own entry point (see bridge/cli.py)."""

import sys

from jaxrl.host_memory import restart_tuned

restart_tuned()  # before anything allocates: XLA's scratch memory reused between calls

from bridge.cli import main  # noqa: E402

sys.exit(main())
