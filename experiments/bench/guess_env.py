"""Guess-the-number in TRL's `environment_factory` style, shared unchanged by both sides of
`experiments.bench.vs_trl` (TRL's GRPOTrainer and `jaxrl train`).

Plain Python on purpose: the TRL side imports it from its own venv, where jaxrl is not installed.

- TRL: `GRPOTrainer(environment_factory=GuessNumber, reward_funcs=[reward])`; one instance per
  generation (pooled, reset between batches); `reset(**row)` gets the dataset row and its text is
  appended to the row's last user message (the bench gives an empty one).
- jaxrl: `envs: [{name: guess, env_class: "experiments.bench.guess_env:GuessNumber"}]` and
  `rewards: [{fn: "experiments.bench.guess_env:reward"}]`; one instance per episode; `reset(**task)`
  gets the task fields and its text is the first user message.

The only tool is `guess(n)` (the one public documented method besides `reset`). The class has no
`done` attribute and no `reward`/`get_reward` method on purpose: jaxrl ends an episode when `done`
turns true and TRL does not, and both frameworks would pick such a method up as an extra reward.
The episode therefore always goes on after "correct" (the primed model then answers in words),
on both sides alike.
"""

from __future__ import annotations

import random

LOW, HIGH = 1, 7  # binary search needs at most 3 guesses: 3 x 34 tokens + the answer fit in 128
PROMPT = f"Guess my number from {LOW} to {HIGH}."
WRONG_GUESS_PENALTY = 0.1


def secret_for(seed: int) -> int:
    return random.Random(int(seed)).randint(LOW, HIGH)


class GuessNumber:
    """A secret integer from 1 to 7; each guess is answered higher, lower or correct."""

    def __init__(self):
        self.secret = LOW
        self.guesses = 0
        self.solved = False

    def reset(self, **row) -> str:
        """Starts an episode for a dataset row / task (`seed` picks the secret)."""
        self.secret = secret_for(row.get("seed", 0))
        self.guesses = 0
        self.solved = False
        return PROMPT

    def guess(self, n: int) -> str:
        """Guess the secret number.

        Args:
            n: The number to guess.

        Returns:
            higher, lower or correct.
        """
        self.guesses += 1
        if n < self.secret:
            return "higher"
        if n > self.secret:
            return "lower"
        self.solved = True
        return "correct"


def reward(completions, environments, **kwargs) -> list[float]:
    """1 for finding the number, less 0.1 per extra guess; 0 when it was never found."""
    return [max(0.0, 1.0 - WRONG_GUESS_PENALTY * (env.guesses - 1)) if env.solved else 0.0
            for env in environments]


def binary_search(secret: int) -> list[tuple[int, str]]:
    """The (guess, answer) pairs of a binary search for `secret` (the priming demonstrations)."""
    lo, hi, out = LOW, HIGH, []
    while True:
        mid = (lo + hi) // 2
        answer = "higher" if mid < secret else "lower" if mid > secret else "correct"
        out.append((mid, answer))
        if answer == "correct":
            return out
        lo, hi = (mid + 1, hi) if answer == "higher" else (lo, mid - 1)
