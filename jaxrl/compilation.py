"""XLA compilations of this process: the bucketed shapes that keep them few, JAX's persistent
compilation cache, and a count of compiles.

A run compiles a small set of shapes fixed by its config. With the persistent cache on (jaxrl's
default) a second run of the same config loads every executable instead of compiling it, and the
count (backend compiles; cache hits are not compiles) shows a shape that compiles mid-run.
"""

from __future__ import annotations

import os

import jax

# JAX reports a backend compile also when the executable came from the persistent cache.
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"

_events = {BACKEND_COMPILE: 0, CACHE_HIT: 0}


def _count(event: str, *args, **kwargs) -> None:
    if event in _events:
        _events[event] += 1


jax.monitoring.register_event_duration_secs_listener(_count)
jax.monitoring.register_event_listener(_count)


def bucket(n: int, minimum: int = 16) -> int:
    """The power of two >= n (and >= minimum): shapes that compile once and get reused."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def compiles() -> int:
    """XLA compilations in this process so far (executables loaded from the persistent cache excluded)."""
    return _events[BACKEND_COMPILE] - _events[CACHE_HIT]


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
