"""`echo`: the smoke-test environment. Repeat the target text back.

Action `EchoAction(message: str)`.
Observation `EchoObservation`: `text` (what to show the model: the instruction at reset, the
echo after a step), `target`, `echoed_message`, `message_length`, `steps_left`, plus `done`,
`reward`.
Task fields: `target` (non-empty text, at most 200 characters), `max_steps` (1-100, default 1:
done after one step), `reward_mode` (`"exact"`, default: 1.0 when the message, stripped of
surrounding whitespace, equals the target, else 0.0; `"similarity"`: difflib's ratio in
[0, 1]). Every step is rewarded on its own.
Seeds draw 2-4 words from a fixed vocabulary; a target is held out ("test") by a stable hash.
Solver: `solve(history)` answers the target.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from openenv.core.env_server import Action, Observation
from pydantic import Field

from bridge.envs.bundled import BundledEnv
from bridge.envs.bundled._base import (
    BundledEnvironment, Episode, as_dict, check_int, check_split, play, seeded_rng, split_of,
)

VOCABULARY = (
    "amber", "apple", "arrow", "basil", "beach", "berry", "blue", "bread", "brick", "cedar",
    "cloud", "coral", "delta", "eagle", "ember", "field", "flint", "frost", "garden", "glass",
    "green", "harbor", "honey", "island", "jade", "lemon", "light", "maple", "meadow", "moon",
    "north", "ocean", "olive", "pebble", "pine", "quartz", "river", "robin", "seven", "silver",
    "stone", "storm", "sun", "tiger", "velvet", "violet", "willow", "winter",
)
REWARD_MODES = ("exact", "similarity")
MAX_TARGET_CHARS = 200


class EchoAction(Action):
    message: str = Field(description="the text to echo")


class EchoObservation(Observation):
    text: str = Field(default="", description="what to show the model next")
    target: str = Field(default="", description="the text to repeat")
    echoed_message: str = Field(default="", description="the last message, echoed")
    message_length: int = Field(default=0, description="length of the last message")
    steps_left: int = Field(default=0, description="steps left in the episode")


def _target_key(target: str) -> str:
    return f"echo:{target}"


def task_for_seed(seed: int, split: str = "train") -> dict[str, Any]:
    """The task seed `seed` gives in `split`."""
    check_split(split)
    rng = seeded_rng("echo", split, seed)
    while True:
        target = " ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(2, 4)))
        if split_of(_target_key(target)) == split:
            return {"target": target, "max_steps": 1, "reward_mode": "exact"}


def tasks(split: str = "train", n: int | None = None) -> list[dict[str, Any]]:
    """Tasks of seeds 0..n-1 in `split` (n defaults to 100)."""
    return [task_for_seed(seed, split) for seed in range(100 if n is None else n)]


def reward(message: str, target: str, mode: str = "exact") -> float:
    said = message.strip()
    if mode == "exact":
        return 1.0 if said == target else 0.0
    return difflib.SequenceMatcher(None, said, target).ratio()


class EchoEnvironment(BundledEnvironment):
    NAME = "echo"
    DESCRIPTION = "Repeat the target text exactly (smoke test)."

    task_for_seed = staticmethod(task_for_seed)

    @classmethod
    def validate_task(cls, task: dict[str, Any]) -> dict[str, Any]:
        target = task["target"]
        if not isinstance(target, str) or not target.strip():
            raise ValueError(f"task field 'target' must be non-empty text, got {target!r}")
        if len(target) > MAX_TARGET_CHARS:
            raise ValueError(f"task field 'target' is longer than {MAX_TARGET_CHARS} characters")
        if task["reward_mode"] not in REWARD_MODES:
            raise ValueError(f"task field 'reward_mode' must be one of {', '.join(REWARD_MODES)}, "
                             f"got {task['reward_mode']!r}")
        return {"target": target.strip(), "max_steps": check_int(task, "max_steps", 1, 100),
                "reward_mode": task["reward_mode"]}

    def _begin(self, task: dict[str, Any]) -> EchoObservation:
        return EchoObservation(text=f"Repeat exactly: {task['target']}", target=task["target"],
                               steps_left=task["max_steps"], done=False, reward=None)

    def _act(self, action: EchoAction) -> EchoObservation:
        task = self._state.task
        left = task["max_steps"] - self._state.step_count
        return EchoObservation(
            text=f"Echo: {action.message}", target=task["target"], echoed_message=action.message,
            message_length=len(action.message), steps_left=left, done=left <= 0,
            reward=reward(action.message, task["target"], task["reward_mode"]),
        )


def solve(history: Sequence[Any]) -> EchoAction:
    """The next action: echo the target (from the latest observation)."""
    if not history:
        raise ValueError("echo.solve needs at least reset's observation")
    return EchoAction(message=as_dict(history[-1])["target"])


def demonstration(seed: int | None = None, split: str = "train", **task: Any) -> Episode:
    """One solver episode, played in-process."""
    return play(EchoEnvironment(), solve, seed=seed, split=split, **task)


SPEC = BundledEnv(
    name="echo", description=EchoEnvironment.DESCRIPTION, env_cls=EchoEnvironment,
    action_cls=EchoAction, observation_cls=EchoObservation, task_for_seed=task_for_seed,
    tasks=tasks, solve=solve, demonstration=demonstration,
)
