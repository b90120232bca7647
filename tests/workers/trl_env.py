"""A TRL-style environment class whose reset needs a dataset column (`target`), as TRL's
`environment_factory` classes do: it cannot take a seed-drawn task."""


class Target:
    def reset(self, target: str, **kwargs) -> str:
        self.target = target
        return f"Say {target}."

    def say(self, word: str) -> str:
        """Say a word.

        Args:
            word: The word.
        """
        self.said = word
        return "said"

    def get_reward(self) -> float:
        return float(getattr(self, "said", None) == self.target)


class Reply:
    """A TRL-style environment without tools: the model's one reply is the episode (its reward comes from
    the run's reward functions and models); reset only reads the row's `target`."""

    def reset(self, target: str, **kwargs) -> str:
        return f"Say {target}."


class SizedTarget(Target):
    """Target with constructor settings, as catalogue classes take a size or a colour (`env_kwargs`)."""

    def __init__(self, size: int, colour: str = "white"):
        self.size, self.colour = size, colour

    def reset(self, target: str, **kwargs) -> str:
        return f"{super().reset(target)} ({self.colour}, size {self.size})"


class LongBrief:
    """A TRL-style environment class whose reset briefs the model at length (~300 tokens of the tiny
    tokenizer), as OpenEnv's catalogue environments' first observations run long."""

    def reset(self, seed: int = 0, **task) -> str:
        self.seed = seed
        return "Read the brief. " + " ".join(f"Clause {i} holds for task {seed}." for i in range(12))

    def answer(self) -> str:
        """Answers the brief."""
        return "noted"

    def reward(self) -> float:
        return float(self.seed % 2)
