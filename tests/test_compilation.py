"""Compile counting and the persistent compilation cache, across two processes."""

import os
import subprocess
import sys
import textwrap

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
