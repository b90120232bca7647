"""Compile counting and the persistent compilation cache, across two processes."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxrl.host_memory import tuned_environ

SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jaxrl.compilation import compiles, programs, use_persistent_cache
    env = use_persistent_cache(sys.argv[1] if sys.argv[1] != "none" else None)
    f = jax.jit(lambda x: jnp.sin(x) * 2)
    before, needed = compiles(), programs()
    f(np.ones(3, np.float32)); f(np.ones(3, np.float32))
    one_shape = compiles() - before, programs() - needed
    f(np.ones(4, np.float32))
    print(*one_shape, compiles() - before, programs() - needed, sorted(env))
""")


def run(cache: str) -> list[str]:
    # Without the cache conftest gives every child: "none" is no cache at all.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    out = subprocess.run([sys.executable, "-c", SCRIPT, cache], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(maxsplit=4)


def test_a_second_process_compiles_nothing_with_the_cache_and_children_get_it_by_environment(tmp_path):
    # (compiles, programs) after one shape called twice, then after a second shape
    first = run(str(tmp_path / "cache"))
    assert first[:4] == ["1", "1", "2", "2"]  # one program per new shape, none on a call with a seen shape
    assert "JAX_COMPILATION_CACHE_DIR" in first[4]
    # Loaded from the cache: no compiles, but the programs are still counted (a new shape mid-run is
    # one whether it compiles or loads).
    assert run(str(tmp_path / "cache"))[:4] == ["0", "1", "0", "2"]
    assert run("none") == ["1", "1", "2", "2", "[]"]


APART = textwrap.dedent("""
    import sys
    from jaxrl.host_memory import restart_tuned
    restart_tuned()
    import jax, jax.numpy as jnp, numpy as np
    import jaxrl.compilation as jc
    jc.APART_MIN_BYTES = 0  # this program is small; a train step's is far above the threshold
    if sys.argv[2] == "broken":
        jc.CHILD = [sys.executable, "-c", "raise SystemExit('no compiler here')"]
    jc.use_persistent_cache(sys.argv[1])
    hits = []
    jax.monitoring.register_event_listener(lambda event, **_: hits.append(event) if event == jc.CACHE_HIT else None)
    y = np.asarray(jax.jit(lambda x: jnp.sin(x) * 2)(np.ones(3, np.float32)))
    print(jc.compiles(), len(hits), y[0])
""")


@pytest.mark.skipif(tuned_environ({}) is None, reason="glibc only: elsewhere a process is not tuned")
def test_a_tuned_process_compiles_in_a_child_and_loads_the_program_and_a_failing_child_costs_nothing(tmp_path):
    def run_apart(mode: str) -> tuple[list[str], str]:
        env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JAXRL_SYSTEM_MALLOC")}
        out = subprocess.run([sys.executable, "-c", APART, str(tmp_path / mode), mode], capture_output=True,
                             text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout.split(), out.stderr

    expected = f"{2 * np.sin(1.0):.6f}"
    # The child compiled it (a compile for this process's count), this process loaded it from the cache.
    (compiled, hits, y), _ = run_apart("child")
    assert (compiled, hits, f"{float(y):.6f}") == ("1", "1", expected)
    (compiled, hits, y), _ = run_apart("child")  # the next process finds it in the cache
    assert (compiled, hits) == ("0", "1")
    (compiled, hits, y), err = run_apart("broken")  # compiled here instead, and said so once
    assert (compiled, hits, f"{float(y):.6f}") == ("1", "0", expected)
    assert "compiling in this process from now on: the compile child exited 1 (no compiler here)" in err
