"""XLA compilations of this process: the bucketed shapes that keep them few, JAX's persistent
compilation cache, and counts of programs.

A run needs a small set of programs, one per shape fixed by its config. With the persistent cache on
(jaxrl's default) a second run of the same config loads every executable instead of compiling it.
Two counts: `programs()`, every executable this process needed (compiled or loaded), which shows a
shape that turns up mid-run whatever the cache holds; and `compiles()`, those the cache did not
have.

`compile_apart()`: from then on this process's large XLA:CPU programs compile in a child process that
writes them to the persistent cache, and this one loads them (`python -m jaxrl.compilation` is that
child). Under `jaxrl.host_memory`'s malloc settings every thread allocates from one heap, and a
compile leaves it fragmented by its garbage: each later call's allocations then walk that heap's
free lists, and every train step of the rest of the run took much longer (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import jax

# JAX reports a backend compile also when the executable came from the persistent cache.
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"

# Compiled by a child for this process (`compile_apart`): compiles, though JAX counts a cache hit.
COMPILED_APART = "compiled_apart"

_events = {BACKEND_COMPILE: 0, CACHE_HIT: 0, COMPILED_APART: 0}


def _count(event: str, *args, **kwargs) -> None:
    if event in _events:
        _events[event] += 1


jax.monitoring.register_event_duration_secs_listener(_count)
jax.monitoring.register_event_listener(_count)


def bucket(n: int, minimum: int = 16) -> int:
    """The power of two >= n (and >= minimum): shapes that compile once and get reused."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def programs() -> int:
    """Executables this process needed so far: compiled, or loaded from the persistent cache. A new
    one mid-run is a shape the config missed, even when a warm cache spares its compile."""
    return _events[BACKEND_COMPILE]


def compiles() -> int:
    """XLA compilations in this process so far (executables loaded from the persistent cache excluded)."""
    return _events[BACKEND_COMPILE] - _events[CACHE_HIT] + _events[COMPILED_APART]


def use_persistent_cache(directory: str | None) -> dict[str, str]:
    """Caches every compilation of this process (however small or quick) in `directory`; returns the
    environment variables that do the same for a child process. None: no cache, no variables."""
    if directory is None:
        return {}
    settings = {"jax_compilation_cache_dir": os.path.expanduser(directory),
                "jax_persistent_cache_min_compile_time_secs": 0.0,
                "jax_persistent_cache_min_entry_size_bytes": 0}
    for key, value in settings.items():
        jax.config.update(key, value)
    return {key.upper(): str(value) for key, value in settings.items()}


# A module's bytecode below this compiles in-process: an eager op or a small helper compiles in
# milliseconds, leaves little behind, and would wait longer for a child to start.
APART_MIN_BYTES = 1 << 16
CHILD = [sys.executable, "-m", "jaxrl.compilation"]
PR_SET_PDEATHSIG = 1
_apart_failed = threading.Event()


def compile_apart() -> None:
    """Large XLA:CPU programs of this process compile in a child when the persistent cache is on
    (see the module's docstring); anything else, or a child that fails, compiles here as before."""
    from jax._src import compiler

    original = compiler.compile_or_get_cached
    if getattr(original, "compiles_apart", False):
        return

    def compile_or_get_cached(backend, computation, devices, compile_options, host_callbacks,
                              executable_devices, *args, **kwargs):
        if backend.platform == "cpu" and not host_callbacks and not _apart_failed.is_set():
            _compile_in_child(backend, computation, devices, compile_options, executable_devices)
        return original(backend, computation, devices, compile_options, host_callbacks,
                        executable_devices, *args, **kwargs)

    compile_or_get_cached.compiles_apart = True
    compiler.compile_or_get_cached = compile_or_get_cached


def _compile_in_child(backend, computation, devices, compile_options, executable_devices) -> None:
    from jax._src import compilation_cache, compiler
    from jax._src import config as jax_config
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    module = mlir.module_to_bytecode(computation)
    if len(module) < APART_MIN_BYTES or len({d.process_index for d in devices.flat}) > 1:
        return
    key = compiler._get_cache_key(compile_options, backend, computation, devices)
    if key is None or compilation_cache.is_executable_in_cache(backend, key):
        return
    job = {"module": module, "options": compile_options.SerializeAsString(), "key": key,
           "name": ir.StringAttr(computation.operation.attributes["sym_name"]).value,
           "devices": [d.id for d in executable_devices], "cache_dir": jax_config.compilation_cache_dir.value,
           "parent": os.getpid()}
    # glibc's own malloc settings for the child: its compile threads each get an arena, not one heap's lock.
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    done = subprocess.run(CHILD, input=pickle.dumps(job), capture_output=True, env=env)
    if done.returncode == 0:
        _events[COMPILED_APART] += 1
        return
    _apart_failed.set()
    last = (done.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
    print(f"jaxrl: compiling in this process from now on: the compile child exited {done.returncode} "
          f"({last})", file=sys.stderr)


def _compile_job(job: dict) -> None:
    """The child's side: compiles one module and writes it to the persistent cache under the parent's key."""
    # Linux's parent-death signal: a parent killed mid-compile takes this child along (the thread
    # that started it waits on it, so it dies only with its process).
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != job["parent"]:
        return
    from jax._src import compilation_cache, compiler, xla_bridge
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir

    use_persistent_cache(job["cache_dir"])
    backend = xla_bridge.get_backend("cpu")
    by_id = {d.id: d for d in backend.devices()}
    devices = xc.DeviceList(tuple(by_id[i] for i in job["devices"]))
    options = xc.CompileOptions.ParseFromString(job["options"])
    with mlir.make_ir_context():
        start = time.monotonic()
        executable = compiler.backend_compile_and_load(backend, ir.Module.parse(job["module"]), devices, options, [])
    compilation_cache.put_executable_and_time(job["key"], job["name"], executable, backend,
                                              int(time.monotonic() - start))


if __name__ == "__main__":
    _compile_job(pickle.load(sys.stdin.buffer))
