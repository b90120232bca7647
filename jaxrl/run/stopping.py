"""Ctrl-C and SIGTERM for `jaxrl train`: the first asks the run to stop after the step under way
(its checkpoint is written first), a second stops at once; child processes are stopped either way."""

from __future__ import annotations

import signal
import sys


class Interrupted(KeyboardInterrupt):
    """A second SIGINT/SIGTERM: stop now (children are still stopped on the way out)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signal = signal.Signals(signum)


class GracefulStop:
    """SIGINT/SIGTERM: the first asks the loop to stop after this step, the second stops now."""

    def __init__(self):
        self.signal: signal.Signals | None = None
        self._old = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise Interrupted(signum)
        self.signal = signal.Signals(signum)
        print(f"\njaxrl train: {signal.Signals(signum).name}: stopping after this step "
              "(its checkpoint will be written); again to stop now", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
