"""What the bundled environments share: seeding, splits, episode bookkeeping, solver episodes."""

from __future__ import annotations

import hashlib
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from openenv.core.env_server import Action, Environment, Observation, State
from openenv.core.env_server.types import EnvironmentMetadata
from pydantic import Field

from bridge.envs.bundled import SPLITS

HELD_OUT_ONE_IN = 5  # about one task identity in five belongs to the "test" split


def split_of(key: str) -> str:
    """The split ("train" or "test") a task identity belongs to: a stable hash, not Python's."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return "test" if int.from_bytes(digest, "big") % HELD_OUT_ONE_IN == 0 else "train"


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(map(repr, SPLITS))}, got {split!r}")
    return split


def seeded_rng(*parts: object) -> random.Random:
    """A `random.Random` seeded from `parts` (str seeds go through SHA-512: stable across runs)."""
    return random.Random(":".join(map(str, parts)))


def as_dict(observation: Any) -> dict[str, Any]:
    """An observation as a plain dict, whether a pydantic model, a StepResult or already a dict."""
    if isinstance(observation, Mapping):
        return dict(observation)
    if hasattr(observation, "model_dump"):
        return observation.model_dump()
    inner = getattr(observation, "observation", None)  # openenv's client StepResult
    if inner is not None:
        return as_dict(inner)
    raise TypeError(f"not an observation: {type(observation).__name__}")


class BundledState(State):
    """Per-session state (the WebSocket `state` message returns it): the task included."""

    env: str = Field(default="", description="bundled environment name")
    seed: int | None = Field(default=None, description="seed the task was drawn from")
    split: str = Field(default="train", description="'train' or 'test' (held out)")
    task: dict[str, Any] = Field(default_factory=dict, description="the task being played")
    done: bool = Field(default=False, description="whether the episode has ended")
    total_reward: float = Field(default=0.0, description="sum of the rewards so far")


class EpisodeOver(RuntimeError):
    """`step` called before `reset` or after the episode ended."""


class BundledEnvironment(Environment):
    """Base of the bundled environments.

    `reset(seed=None, episode_id=None, split="train", **task)`: the task is
    `task_for_seed(seed, split)` with any given task field replacing the drawn one, then
    validated (an unknown field or a bad value is a `ValueError` naming it). Without a seed,
    the seed is drawn from this instance's own stream, itself seeded by the server's seed and
    the instance number (so a server run is reproducible, and sessions differ).

    `step` before `reset` or after the episode ended raises `EpisodeOver` (a driver bug, not an
    agent mistake; the server answers it as an EXECUTION_ERROR). An agent's malformed action
    is not an error: it gets an observation that says what was wrong.
    """

    SUPPORTS_CONCURRENT_SESSIONS: ClassVar[bool] = True
    NAME: ClassVar[str] = ""
    DESCRIPTION: ClassVar[str] = ""

    def __init__(self, seed: int = 0, instance: int = 0):
        super().__init__()
        self._seeds = seeded_rng(self.NAME, "instance", seed, instance)
        self._state = BundledState(env=self.NAME)
        self._started = False

    # -- to implement -------------------------------------------------------------------------

    @classmethod
    def task_for_seed(cls, seed: int, split: str = "train") -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def validate_task(cls, task: dict[str, Any]) -> dict[str, Any]:
        """Checks and normalizes a task; raises ValueError naming the bad field."""
        raise NotImplementedError

    def _begin(self, task: dict[str, Any]) -> Observation:
        raise NotImplementedError

    def _act(self, action: Action) -> Observation:
        """Plays one action; the returned observation carries done and reward."""
        raise NotImplementedError

    # -- the OpenEnv interface ----------------------------------------------------------------

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              split: str = "train", **task: Any) -> Observation:
        check_split(split)
        if seed is None:
            seed = self._seeds.randrange(2**31)
        elif isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        drawn = self.task_for_seed(seed, split)
        unknown = sorted(set(task) - set(drawn))
        if unknown:
            raise ValueError(f"{self.NAME}: unknown task field(s) {', '.join(map(repr, unknown))}; "
                             f"task fields: {', '.join(drawn)}")
        resolved = self.validate_task({**drawn, **task})
        self._state = BundledState(
            env=self.NAME, episode_id=episode_id or str(uuid.uuid4()), step_count=0,
            seed=seed, split=split, task=resolved,
        )
        self._started = True
        return self._begin(resolved)

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        if not self._started:
            raise EpisodeOver(f"{self.NAME}: step() before reset(): reset() starts an episode")
        if self._state.done:
            raise EpisodeOver(f"{self.NAME}: the episode is over; reset() starts a new one")
        self._state.step_count += 1
        obs = self._act(action)
        if obs.reward is None:
            obs.reward = 0.0
        self._state.total_reward += float(obs.reward)
        self._state.done = bool(obs.done)
        return obs

    @property
    def state(self) -> BundledState:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name=self.NAME, description=self.DESCRIPTION, version="1.0.0",
                                   author="jaxrl")


@dataclass
class Episode:
    """A played episode: the task, reset's observation, then (action, observation) per step."""

    env: str
    seed: int | None
    split: str
    task: dict[str, Any]
    first: Observation
    steps: list[tuple[Action, Observation]] = field(default_factory=list)

    @property
    def observations(self) -> list[Observation]:
        return [self.first] + [obs for _, obs in self.steps]

    @property
    def actions(self) -> list[Action]:
        return [action for action, _ in self.steps]

    @property
    def total_reward(self) -> float:
        return sum(float(obs.reward or 0.0) for _, obs in self.steps)

    @property
    def done(self) -> bool:
        return bool(self.steps) and bool(self.steps[-1][1].done)


def play(env: BundledEnvironment, policy: Callable[[Sequence[Observation]], Action],
         seed: int | None = None, split: str = "train", step_limit: int = 1000,
         **task: Any) -> Episode:
    """Plays one episode of `env` in-process with `policy(history) -> action`."""
    first = env.reset(seed=seed, split=split, **task)
    episode = Episode(env.NAME, env.state.seed, split, dict(env.state.task), first)
    history: list[Observation] = [first]
    while not (episode.steps and episode.steps[-1][1].done):
        if len(episode.steps) >= step_limit:
            raise RuntimeError(f"{env.NAME}: episode did not end within {step_limit} steps")
        action = policy(history)
        obs = env.step(action)
        episode.steps.append((action, obs))
        history.append(obs)
    return episode


def check_int(task: dict[str, Any], key: str, lo: int | None = None, hi: int | None = None) -> int:
    value = task[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"task field {key!r} must be an integer, got {value!r}")
    if lo is not None and value < lo or hi is not None and value > hi:
        bounds = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ValueError(f"task field {key!r} must be in {bounds}, got {value}")
    return value


def check_bool(task: dict[str, Any], key: str) -> bool:
    value = task[key]
    if not isinstance(value, bool):
        raise ValueError(f"task field {key!r} must be true or false, got {value!r}")
    return value
