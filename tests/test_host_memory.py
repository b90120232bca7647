import subprocess
import sys

import pytest

from jaxrl.host_memory import GC_THRESHOLDS, OPT_OUT, TUNABLES, tuned_environ

ALL = ":".join(f"{k}={v}" for k, v in TUNABLES.items())


def test_tunables_are_added_to_the_users_and_theirs_win():
    assert tuned_environ({"PATH": "/bin"}) == {"PATH": "/bin", "GLIBC_TUNABLES": ALL}
    env = tuned_environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4:glibc.malloc.tcache_count=0"})
    items = env["GLIBC_TUNABLES"].split(":")
    assert items[:2] == ["glibc.malloc.arena_max=4", "glibc.malloc.tcache_count=0"]
    assert sorted(i.split("=")[0] for i in items[2:]) == sorted(k for k in TUNABLES if k != "glibc.malloc.arena_max")


def test_nothing_to_do_when_tuned_or_opted_out():
    assert tuned_environ({"GLIBC_TUNABLES": ALL}) is None
    assert tuned_environ({OPT_OUT: "1"}) is None
    assert tuned_environ({OPT_OUT: "0"}) is not None


# Frees a 256 MB block on a worker thread (as XLA's executor does) and allocates it again: under the
# tunables the second allocation reuses the heap's pages; under glibc's defaults it faults them all in.
PROBE = """
import ctypes, resource, sys, threading
from jaxrl.host_memory import restart_tuned
if sys.argv[1] == "tuned":
    restart_tuned()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def touch():
    block = libc.malloc(1 << 28)
    ctypes.memset(block, 1, 1 << 28)
    libc.free(block)
t = threading.Thread(target=touch); t.start(); t.join()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = threading.Thread(target=touch); t.start(); t.join()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(tuned_environ({}) is None, reason="glibc only")
def test_a_tuned_process_reuses_freed_scratch_memory_without_faults():
    def faults(mode: str, env: dict) -> int:
        out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, check=True)
        return int(out.stdout)

    base = {k: v for k, v in __import__("os").environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT)}
    pages = (1 << 28) // 4096
    assert faults("system", base) > pages // 2
    assert faults("tuned", base) < pages // 8
    assert faults("tuned", {**base, OPT_OUT: "1"}) > pages // 2


@pytest.mark.parametrize("opted_out", [False, True])
def test_a_tuned_process_collects_garbage_at_the_thresholds_whatever_its_malloc(opted_out):
    base = {k: v for k, v in __import__("os").environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT)}
    probe = "import gc; from jaxrl.host_memory import restart_tuned; restart_tuned(); print(gc.get_threshold())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**base, OPT_OUT: "1"} if opted_out else base)
    assert out.stdout.strip() == str(GC_THRESHOLDS)


def test_a_program_that_runs_no_xla_never_imports_jax():
    probe = ("import sys; from jaxrl.host_memory import restart_tuned; restart_tuned(runs_xla=sys.argv[1] == 'xla'); "
             "print('jax' in sys.modules)")
    base = {k: v for k, v in __import__("os").environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT)}
    ran = {mode: subprocess.run([sys.executable, "-c", probe, mode], capture_output=True, text=True, check=True,
                                env=base).stdout.strip() for mode in ("xla", "no-xla")}
    assert ran["no-xla"] == "False"
    if tuned_environ({}) is not None:  # only a tuned process compiles apart, which needs JAX
        assert ran["xla"] == "True"
