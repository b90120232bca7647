"""Test-session setup: 8 virtual CPU devices, so mesh and sharding tests run on one machine; and a
session that cannot exit fails instead of hanging."""

import faulthandler
import os
import sys
import threading

# Must happen before jax is first imported anywhere in the session.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

EXIT_WITHIN_S = 120


def pytest_sessionfinish(session, exitstatus):
    # Python joins every non-daemon thread at exit (a ThreadPoolExecutor's included): one a test left
    # waiting forever would hold CI until its time limit. Name them, and past EXIT_WITHIN_S print every
    # thread's stack and exit 1.
    left = [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    if left:
        print(f"\nthreads still running at the end of the session: {left}", file=sys.stderr)
    faulthandler.dump_traceback_later(EXIT_WITHIN_S, exit=True)
