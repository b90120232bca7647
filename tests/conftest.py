"""Test-session setup: 8 virtual CPU devices, so mesh and sharding tests run on one machine, compiling
fast (tests/xla_flags.py); Python's collector as jaxrl's processes run it; one
persistent compilation cache for this process and its children; memory given back after each test
module; the longest file first; and a session that cannot exit fails instead of hanging."""

import ctypes
import faulthandler
import gc
import os
import sys
import threading
from pathlib import Path

import pytest

from jaxrl.host_memory import collect_less_often
from xla_flags import xla_flags

# Must happen before jax is first imported anywhere in the session.
for _flag in xla_flags(8).split():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

collect_less_often()  # as jaxrl's processes do: the collector's walks were a large share of this one's CPU

EXIT_WITHIN_S = 120


# Past this resident set, a test's end gives memory back too (its module's next tests compile again).
RESIDENT_LIMIT = 2 << 30


def _give_memory_back() -> None:
    """JAX's compiled programs dropped (a jitted function keeps every program it compiled for as long
    as the process lives: 2.5 GB by the end of test_jax_engine.py's engines), then the heap's free
    memory returned to the system (glibc keeps it otherwise). Without it the session's resident set
    grew past 6 GB."""
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's
    if trim is not None:
        trim(0)


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux
        return 0


# Where this process and the processes the tests start keep their compiled programs (JAX's persistent
# compilation cache), as `jaxrl train` gives its bridges one: the same programs compiled again in every bridge,
# engine and worker a test starts were most of their CPU, and this process compiles a program again after each
# module gives its memory back, or when a test builds another learner or engine of a shape seen before. Kept
# between sessions, as the run's own cache is.
COMPILATION_CACHE = Path.home() / ".cache" / "jaxrl" / "xla-tests"


@pytest.fixture(scope="session", autouse=True)
def _a_shared_compilation_cache():
    """This process's JAX caches its programs in COMPILATION_CACHE, and every child inherits the setting
    by its environment. Counts of compiles (`jaxrl.compilation.compiles`) leave out loaded programs."""
    from jaxrl.compilation import use_persistent_cache

    with pytest.MonkeyPatch.context() as mp:
        for key, value in use_persistent_cache(str(COMPILATION_CACHE)).items():
            mp.setenv(key, value)
        yield


@pytest.fixture(scope="module", autouse=True)
def _memory_back_after_each_module():
    yield  # after the module's own fixtures are gone (autouse fixtures of conftest come first)
    _give_memory_back()


@pytest.fixture(autouse=True)
def _memory_back_past_the_limit():
    yield
    if _resident_bytes() > RESIDENT_LIMIT:
        _give_memory_back()


# scripts/test.sh runs the files on two workers, each file whole on one, in collection order: the longest
# (a quarter of the suite) first, so that the other worker's files fill its time instead of following it.
LONGEST_FIRST = ("tests/test_train.py",)


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in LONGEST_FIRST)  # stable: the rest as collected


def pytest_sessionfinish(session, exitstatus):
    # Python joins every non-daemon thread at exit (a ThreadPoolExecutor's included): one a test left
    # waiting forever would hold CI until its time limit. Name them, and past EXIT_WITHIN_S print every
    # thread's stack and exit 1.
    left = [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    if left:
        print(f"\nthreads still running at the end of the session: {left}", file=sys.stderr)
    faulthandler.dump_traceback_later(EXIT_WITHIN_S, exit=True)
