"""Test-session setup: 8 virtual CPU devices, so mesh and sharding tests run on one machine, compiling
fast (tests/xla_flags.py); Python's collector as jaxrl's processes run it; one
persistent compilation cache for this process and its children; memory given back after each test
module; the longest files first; and a session that cannot exit fails instead of hanging."""

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


# scripts/test.sh runs the files on three workers (`--dist loadfile`), in this order: the files that take
# longest first (wall seconds of each in a run of the whole suite, heaviest first), then the rest as
# collected, so that short files fill the workers' ends instead of one long file running on alone.
HEAVIEST_FIRST = tuple(f"tests/{name}.py" for name in (
    "test_train", "test_reliability", "test_launchers", "test_distributed", "test_bench_gpu", "test_learner",
    "test_checkpoints", "test_train_step", "test_env_rollouts", "test_packing", "test_jax_engine", "test_cli",
    "test_experiment_loss_variants", "test_slots", "test_experiment_offline_learner", "test_replay",
    "test_decoder", "test_experiment_critique_revise", "test_harness", "test_processes", "test_lora",
    "test_experiment_distillation", "test_bench_lora", "test_api", "test_bench_multiturn", "test_bench_train_step",
    "test_snapshots", "test_server", "test_losses", "test_bench_compile_apart", "test_snapshot_store", "test_export",
    "test_bench_learner", "test_client", "test_bench_engines", "test_teacher", "test_warm_start", "test_logprobs",
    "test_bench_packing", "test_gin_config", "test_bench_pod", "test_bundled_envs", "test_openenv_episode"))

# A file stays whole on one worker (its module fixtures are built once), except these: each of their test
# functions is a run of jaxrl of its own and their module fixture a tiny model built in a second, and one
# worker running a whole file of them was CI's longest wait.
SPREAD = ("tests/test_train.py", "tests/test_reliability.py", "tests/test_cli.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest as collected


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with the test functions of SPREAD's files each a unit of their own. (xdist 3.8's
    `loadgroup` cannot do it under pytest 9: the group it appends to a test's id is not read.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SpreadScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return nodeid.split("[")[0] if path in SPREAD else path

    return SpreadScheduling(config, log)


def pytest_sessionfinish(session, exitstatus):
    # Python joins every non-daemon thread at exit (a ThreadPoolExecutor's included): one a test left
    # waiting forever would hold CI until its time limit. Name them, and past EXIT_WITHIN_S print every
    # thread's stack and exit 1.
    left = [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    if left:
        print(f"\nthreads still running at the end of the session: {left}", file=sys.stderr)
    faulthandler.dump_traceback_later(EXIT_WITHIN_S, exit=True)
