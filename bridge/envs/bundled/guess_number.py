"""`guess_number`: a tool-use task. Find a secret integer with the tool `guess(n)`.

Action `GuessNumberAction(tool: str, arguments: dict)`, e.g. `{"tool": "guess", "arguments":
{"n": 42}}`. `n` may be an int, an integral float (42.0) or a string of an integer ("42").
Observation `GuessNumberObservation`: `text` (what to show the model), `tools` (the tool specs,
JSON-schema style, in reset's observation only), `result` (`"higher"`: the secret is higher
than n, `"lower"`, `"correct"`, or `"error"`), `error` (what was wrong with the call), `low`,
`high`, `guesses` / `results` (the valid calls so far and their answers), `guesses_left`, plus
`done`, `reward`.

A bad call (unknown tool, missing / extra / non-integer argument, n outside [low, high]) gets
`result="error"` and a message saying what was wrong, and **uses one of the guesses**.

Task fields: `low`, `high` (integers, `high - low` at most 1,000,000), `secret` (in [low, high]),
`max_guesses` (1-64). Seeds draw a range of 10, 20, 50 or 100 numbers starting in [0, 100] and
`max_guesses = ceil(log2(size + 1)) + 1` (binary search plus one spare). A task is held out
("test") by a stable hash of (low, high, secret). Reward: 1.0 on the correct guess, 0.0
otherwise; done on the correct guess or when the guesses run out.
Solver: `solve(history)` bisects the interval still possible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from openenv.core.env_server import Action, Observation
from pydantic import Field

from bridge.envs.bundled import BundledEnv
from bridge.envs.bundled._base import (
    BundledEnvironment, Episode, as_dict, check_int, check_split, play, seeded_rng, split_of,
)

SIZES = (10, 20, 50, 100)
MAX_RANGE = 1_000_000
HIGHER, LOWER, CORRECT, ERROR = "higher", "lower", "correct", "error"

TOOLS: list[dict[str, Any]] = [{
    "name": "guess",
    "description": ("Guess the secret integer. Answers 'higher' if the secret is higher than n, "
                    "'lower' if it is lower, 'correct' if n is the secret."),
    "parameters": {
        "type": "object",
        "properties": {"n": {"type": "integer", "description": "your guess"}},
        "required": ["n"],
    },
}]
TOOL_NAMES = tuple(tool["name"] for tool in TOOLS)


class GuessNumberAction(Action):
    tool: str = Field(description="the tool to call: 'guess'")
    arguments: dict[str, Any] = Field(default_factory=dict, description="the tool's arguments")


class GuessNumberObservation(Observation):
    text: str = Field(default="", description="what to show the model next")
    tools: list[dict[str, Any]] = Field(default_factory=list, description="tool specs (reset only)")
    result: str = Field(default="", description="higher / lower / correct / error")
    error: str = Field(default="", description="what was wrong with the last call")
    low: int = Field(default=0, description="smallest possible secret")
    high: int = Field(default=0, description="largest possible secret")
    guesses: list[int] = Field(default_factory=list, description="valid guesses so far")
    results: list[str] = Field(default_factory=list, description="answer per valid guess")
    guesses_left: int = Field(default=0, description="guesses left")


def max_guesses_for(size: int) -> int:
    return math.ceil(math.log2(size + 1)) + 1


def task_for_seed(seed: int, split: str = "train") -> dict[str, Any]:
    """The task seed `seed` gives in `split`."""
    check_split(split)
    rng = seeded_rng("guess_number", split, seed)
    while True:
        size = rng.choice(SIZES)
        low = rng.randint(0, 100)
        high = low + size - 1
        secret = rng.randint(low, high)
        if split_of(f"guess_number:{low}:{high}:{secret}") == split:
            return {"low": low, "high": high, "secret": secret, "max_guesses": max_guesses_for(size)}


def tasks(split: str = "train", n: int | None = None) -> list[dict[str, Any]]:
    """Tasks of seeds 0..n-1 in `split` (n defaults to 100)."""
    return [task_for_seed(seed, split) for seed in range(100 if n is None else n)]


def parse_guess(tool: str, arguments: dict[str, Any], low: int, high: int) -> tuple[int | None, str]:
    """(n, "") for a valid call, else (None, what was wrong)."""
    if tool not in TOOL_NAMES:
        return None, f"unknown tool {tool!r}; the tools are: {', '.join(TOOL_NAMES)}"
    extra = sorted(set(arguments) - {"n"})
    if extra:
        return None, f"unexpected argument(s) {', '.join(map(repr, extra))}; guess takes one argument, n"
    if "n" not in arguments:
        return None, "missing argument n: call guess(n) with an integer n"
    value = arguments["n"]
    n: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        try:
            n = int(value.strip())
        except ValueError:
            pass
    if n is None:
        return None, f"n must be an integer, got {value!r}"
    if not low <= n <= high:
        return None, f"n must be between {low} and {high}, got {n}"
    return n, ""


class GuessNumberEnvironment(BundledEnvironment):
    NAME = "guess_number"
    DESCRIPTION = "Find a secret integer by calling the tool guess(n) (higher / lower / correct)."

    task_for_seed = staticmethod(task_for_seed)

    def __init__(self, seed: int = 0, instance: int = 0):
        super().__init__(seed, instance)
        self._guesses: list[int] = []
        self._results: list[str] = []

    @classmethod
    def validate_task(cls, task: dict[str, Any]) -> dict[str, Any]:
        low, high = check_int(task, "low"), check_int(task, "high")
        if not low <= high <= low + MAX_RANGE:
            raise ValueError(f"task fields 'low' and 'high' need low <= high <= low + {MAX_RANGE}, "
                             f"got low={low}, high={high}")
        return {"low": low, "high": high, "secret": check_int(task, "secret", low, high),
                "max_guesses": check_int(task, "max_guesses", 1, 64)}

    def _observation(self, text: str, **kw: Any) -> GuessNumberObservation:
        task = self._state.task
        return GuessNumberObservation(
            text=text, low=task["low"], high=task["high"], guesses=list(self._guesses),
            results=list(self._results), guesses_left=task["max_guesses"] - self._state.step_count,
            **kw,
        )

    def _begin(self, task: dict[str, Any]) -> GuessNumberObservation:
        self._guesses, self._results = [], []
        text = (f"I am thinking of an integer between {task['low']} and {task['high']} "
                f"(inclusive). Find it by calling the tool guess(n): it answers 'higher' if the "
                f"number is higher than n, 'lower' if it is lower, 'correct' if you found it. "
                f"You have {task['max_guesses']} guesses.")
        return self._observation(text, tools=TOOLS, done=False, reward=None)

    def _act(self, action: GuessNumberAction) -> GuessNumberObservation:
        task = self._state.task
        n, error = parse_guess(action.tool, action.arguments, task["low"], task["high"])
        if error:
            result = ERROR
        else:
            result = CORRECT if n == task["secret"] else HIGHER if task["secret"] > n else LOWER
            self._guesses.append(n)
            self._results.append(result)
        left = task["max_guesses"] - self._state.step_count
        done = result == CORRECT or left <= 0
        if result == CORRECT:
            text = f"guess({n}): correct!"
        else:
            text = f"error: {error}" if error else f"guess({n}): {result}"
            text += f" ({left} {'guess' if left == 1 else 'guesses'} left)"
            if done:
                text += f" Out of guesses: the number was {task['secret']}."
        return self._observation(text, result=result, error=error, done=done,
                                 reward=1.0 if result == CORRECT else 0.0)


def solve(history: Sequence[Any]) -> GuessNumberAction:
    """The next call: guess the middle of the interval the answers so far leave possible."""
    if not history:
        raise ValueError("guess_number.solve needs at least reset's observation")
    last = as_dict(history[-1])
    lo, hi = last["low"], last["high"]
    for n, result in zip(last.get("guesses", []), last.get("results", [])):
        if result == HIGHER:
            lo = max(lo, n + 1)
        elif result == LOWER:
            hi = min(hi, n - 1)
        elif result == CORRECT:
            lo = hi = n
    if lo > hi:
        raise ValueError("the answers so far are inconsistent")
    return GuessNumberAction(tool="guess", arguments={"n": (lo + hi) // 2})


def demonstration(seed: int | None = None, split: str = "train", **task: Any) -> Episode:
    """One solver episode, played in-process."""
    return play(GuessNumberEnvironment(), solve, seed=seed, split=split, **task)


SPEC = BundledEnv(
    name="guess_number", description=GuessNumberEnvironment.DESCRIPTION,
    env_cls=GuessNumberEnvironment, action_cls=GuessNumberAction,
    observation_cls=GuessNumberObservation, task_for_seed=task_for_seed, tasks=tasks, solve=solve,
    demonstration=demonstration,
)
