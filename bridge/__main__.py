"""`python -m bridge`: the bridge process's own entry point (see bridge/cli.py)."""

import sys

from jaxrl.host_memory import restart_tuned

# Before anything allocates: XLA's scratch memory reused between calls. `env` (an environment server)
# runs no XLA: JAX's import alone was a third of its start-up.
restart_tuned(runs_xla=sys.argv[1:2] != ["env"])

from bridge.cli import main  # noqa: E402

sys.exit(main())
