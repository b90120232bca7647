"""Environments shipped with jaxrl: small, deterministic by seed, nothing to download.

| name           | what                                                        | reward                     |
| -------------- | ----------------------------------------------------------- | -------------------------- |
| `echo`         | repeat the target text (smoke test)                          | 1.0 exact (or similarity)  |
| `wordle`       | guess a 5-letter word in 6 tries, green/yellow/gray feedback | 1.0 on solve (opt. partial)|
| `guess_number` | tool use: call `guess(n)`, hear higher / lower / correct     | 1.0 on correct             |

Each is a real OpenEnv `Environment` (`SUPPORTS_CONCURRENT_SESSIONS = True`) with its own
Action / Observation types, served by `jaxrl env serve NAME` (`bridge.envs.serve`). Every
environment module exposes the same public surface:

- `reset(seed=None, split="train", **task)`: the task is a pure function of `(seed, split)`,
  any task field given overrides the drawn one; `task_for_seed(seed, split)` gives it.
- `tasks(split, n=None)`: enumerates tasks. `split` is `"train"` or `"test"` (held out); the two
  are disjoint by a stable hash of the task's identity (about 1 in 5 is held out).
- `solve(history) -> Action`: a deterministic solver; `history` is the list of observations
  so far (models or the plain dicts a generic client returns), reset's first.
- `demonstration(seed, split, **task) -> Episode`: one solver episode played in-process (the
  supervised warm start's data).

This package's `__init__` is light (no OpenEnv import): `BUNDLED` lists the names at once and
imports an environment's module only when its entry is read.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from bridge.envs.bundled._base import BundledEnvironment, Episode

NAMES: tuple[str, ...] = ("echo", "wordle", "guess_number")
SPLITS: tuple[str, ...] = ("train", "test")


class UnknownEnvironmentError(KeyError):
    """A bundled environment name that does not exist; the message lists the known ones."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(name)

    def __str__(self) -> str:
        return f"unknown bundled environment {self.name!r}; known: {', '.join(NAMES)}"


@dataclass(frozen=True)
class BundledEnv:
    """One bundled environment: its types and its task / solver functions."""

    name: str
    description: str
    env_cls: type[BundledEnvironment]
    action_cls: type
    observation_cls: type
    task_for_seed: Callable[..., dict[str, Any]]
    tasks: Callable[..., list[dict[str, Any]]]
    solve: Callable[..., Any]
    demonstration: Callable[..., Episode]

    def factory(self, seed: int = 0) -> Callable[[], BundledEnvironment]:
        """A factory for `create_app`: instance k draws its unseeded resets from (seed, k).

        k counts every instance the server creates, in order: one per WebSocket session, and
        also those `create_app`'s concurrency check and the stateless HTTP routes make. Resets
        that pass a seed do not depend on it.
        """
        import itertools
        import threading

        counter = itertools.count()
        lock = threading.Lock()

        def make() -> BundledEnvironment:
            with lock:
                instance = next(counter)
            return self.env_cls(seed=seed, instance=instance)

        make.__name__ = f"{self.env_cls.__name__}_factory"
        return make


class _Registry(Mapping):
    """name -> BundledEnv, importing each environment's module on first access."""

    def __getitem__(self, name: str) -> BundledEnv:
        if name not in NAMES:
            raise UnknownEnvironmentError(name)
        return importlib.import_module(f"{__name__}.{name}").SPEC

    def __iter__(self) -> Iterator[str]:
        return iter(NAMES)

    def __len__(self) -> int:
        return len(NAMES)

    def __contains__(self, name: object) -> bool:
        return name in NAMES


BUNDLED: Mapping[str, BundledEnv] = _Registry()


def get(name: str) -> BundledEnv:
    """The bundled environment `name`; `UnknownEnvironmentError` lists the known names."""
    return BUNDLED[name]
