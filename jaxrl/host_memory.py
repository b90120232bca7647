"""glibc malloc settings under which XLA:CPU reuses its scratch memory from one call to the next.

XLA:CPU allocates an execution's temporaries with malloc (a train step's: one block of up to
several GB) and frees them when the call returns. glibc serves a block that large with mmap,
from a worker thread's arena, and gives it back with munmap, so every call faults every page in
again, which at a real workload's learner shape took as long as the step's own arithmetic
(docs/benchmarks.md). With one arena, no mmap and no trimming, a freed block stays in the heap and
the next call gets it back without a fault. The price: the process keeps its peak heap, which the
next step needs again anyway.

glibc reads these settings (`GLIBC_TUNABLES`) only when a process starts, so a program applies
them by starting itself again, same PID and arguments (`restart_tuned`); its children inherit
them. `JAXRL_SYSTEM_MALLOC=1` keeps glibc's defaults. A program so started compiles its large
programs in a child (`jaxrl.compilation.compile_apart`): a compile's garbage left in the one heap made
every later step slower.

Python's own collector too (`collect_less_often`): by default it walks every young object each 700
allocations and the whole heap each 70,000 or so, and a process that imports JAX, transformers and
OpenEnv and traces programs allocates millions of objects that live as long as it does.
"""

from __future__ import annotations

import gc
import os
import platform
import sys
from collections.abc import Mapping

TUNABLES = {
    "glibc.malloc.arena_max": "1",  # a worker thread's big block comes from the main heap...
    "glibc.malloc.mmap_max": "0",  # ... never from its own mapping ...
    "glibc.malloc.trim_threshold": str(1 << 40),  # ... and stays there when freed
}
OPT_OUT = "JAXRL_SYSTEM_MALLOC"

# Young objects walked each 10,000 net allocations, the whole heap each 2,000,000 (ten older sweeps of
# twenty young ones each): reference cycles are still freed, within seconds rather than milliseconds.
GC_THRESHOLDS = (10_000, 20, 10)


def tuned_environ(environ: Mapping[str, str]) -> dict[str, str] | None:
    """`environ` with `TUNABLES` added to `GLIBC_TUNABLES` (settings already there win); None when
    there is nothing to add, when opted out, or off glibc."""
    if environ.get(OPT_OUT, "") not in ("", "0") or sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    missing = [f"{key}={value}" for key, value in TUNABLES.items() if key not in _present(environ)]
    if not missing:
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join(([current] if current else []) + missing)}


def _present(environ: Mapping[str, str]) -> set[str]:
    return {item.split("=", 1)[0] for item in environ.get("GLIBC_TUNABLES", "").split(":") if item}


def collect_less_often() -> None:
    """Python's cyclic garbage collector at `GC_THRESHOLDS`, so that its walks of the heap stop being
    a large share of a jaxrl process's CPU (docs/benchmarks.md)."""
    gc.set_threshold(*GC_THRESHOLDS)


def restart_tuned(runs_xla: bool = True) -> None:
    """Starts this program again under `tuned_environ` (never returns) unless it already runs so;
    running so, it compiles apart from then on. Either way it collects garbage less often. A program
    that runs no XLA (an environment server) passes `runs_xla=False` and never imports JAX."""
    env = tuned_environ(os.environ)
    if env is not None:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    collect_less_often()
    if runs_xla and TUNABLES.keys() <= _present(os.environ):
        from jaxrl.compilation import compile_apart

        compile_apart()
