"""Guess-the-number in TRL's `environment_factory` style, shared unchanged by both sides of
`experiments.bench.vs_trl` (TRL's GRPOTrainer and `jaxrl train`).

Plain Python on purpose: the TRL side imports it from its own venv, where jaxrl is not installed.

- TRL: `GRPOTrainer(environment_factory=GuessNumber, reward_funcs=[reward])` over dataset rows in
  TRL's format (`{"prompt": [{"role": "user", "content": INSTRUCTIONS}], "seed": k}`); one instance
  per generation; `reset(**row)` gets the row and its text is appended to the row's last user message.
- jaxrl: `envs: [{name: guess, env_class: "experiments.bench.guess_env:GuessNumber"}]`,
  `rewards: [{fn: "experiments.bench.guess_env:reward"}]` and the same rows (plus `env: guess`):
  a task with a `prompt` gets reset's text appended to its last message, as TRL does.

The only tool is `guess(n)` (the one public documented method besides `reset`). The class has no
`done` attribute and no `reward`/`get_reward` method on purpose: jaxrl ends an episode when `done`
turns true and TRL does not, and both frameworks would pick such a method up as an extra reward.
The episode therefore always goes on after a correct guess (the primed model then answers in words).

The secret lies in 1..50: a binary search needs up to 6 guesses, more than a 128-token episode holds
(a call and its answer take ~40 tokens of `experiments.bench.chat_tokenizer`), so most episodes end
at the token budget, as long tool episodes do.
"""

from __future__ import annotations

import random

LOW, HIGH = 1, 50
INSTRUCTIONS = "Find the secret number with as few guesses as you can. "
WRONG_GUESS_PENALTY = 0.1


def secret_for(seed: int) -> int:
    return random.Random(int(seed)).randint(LOW, HIGH)


def reset_text() -> str:
    return f"I picked a whole number from {LOW} to {HIGH}: call guess(n) and I will say if it is higher or lower."


def answer(n: int, secret: int) -> str:
    if n < secret:
        return f"{n} is too low: the number is higher."
    if n > secret:
        return f"{n} is too high: the number is lower."
    return f"{n} is correct!"


class GuessNumber:
    """A secret integer from 1 to 50; each guess is answered too low, too high or correct."""

    def __init__(self):
        self.secret = LOW
        self.guesses: list[int] = []

    def reset(self, **row) -> str:
        """Starts an episode for a dataset row / task (`seed` picks the secret)."""
        self.secret = secret_for(row.get("seed", 0))
        self.guesses = []
        return reset_text()

    def guess(self, n: int) -> str:
        """Guess the secret number.

        Args:
            n: The number to guess.

        Returns:
            Whether the guess is too low, too high or correct.
        """
        self.guesses.append(n)
        return answer(n, self.secret)


def reward(completions, environments, **kwargs) -> list[float]:
    """1 for finding the number, less 0.1 per extra guess; else up to 0.5 for the closest guess."""
    out = []
    for env in environments:
        if env.secret in env.guesses:
            out.append(max(0.0, 1.0 - WRONG_GUESS_PENALTY * env.guesses.index(env.secret)))
        elif env.guesses:
            out.append(0.5 * (1 - min(abs(g - env.secret) for g in env.guesses) / (HIGH - LOW)))
        else:
            out.append(0.0)
    return out


def binary_search(secret: int) -> list[tuple[int, str]]:
    """The (guess, answer) pairs of a binary search for `secret` (the priming demonstrations)."""
    lo, hi, out = LOW, HIGH, []
    while True:
        mid = (lo + hi) // 2
        out.append((mid, answer(mid, secret)))
        if mid == secret:
            return out
        lo, hi = (mid + 1, hi) if mid < secret else (lo, mid - 1)
