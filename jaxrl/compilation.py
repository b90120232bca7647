"""XLA compilations of this process: the bucketed shapes that keep them few, JAX's persistent
compilation cache, and counts of programs.

A run needs a small set of programs, one per shape fixed by its config. With the persistent cache on
(jaxrl's default) a second run of the same config loads every executable instead of compiling it.
Two counts: `programs()`, every executable this process needed (compiled or loaded), which shows a
shape that turns up mid-run whatever the cache holds; and `compiles()`, those the cache did not
have.
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


def programs() -> int:
    """Executables this process needed so far: compiled, or loaded from the persistent cache. A new
    one mid-run is a shape the config missed, even when a warm cache spares its compile."""
    return _events[BACKEND_COMPILE]


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
