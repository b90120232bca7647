"""The one place reward weights are applied: `rewards[]` of the config over a trajectory's
rewards by name. Filters, metrics, evaluation and the learner's advantages all weigh through here.

A reward function that does not apply to an episode leaves its key out (None, NaN in the batch):
it is excluded from the sum, never read as zero; an episode no function applies to has no reward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from bridge.envs.spec import RewardSpec


class RewardWeights:
    def __init__(self, rewards: Sequence[RewardSpec]):
        self.keys = [r.key for r in rewards]
        self.weights = tuple(float(r.weight) for r in rewards)

    def total(self, rewards: Mapping[str, float]) -> float | None:
        """The weighted sum of the rewards that apply; None when none does."""
        present = [(rewards[k], w) for k, w in zip(self.keys, self.weights) if k in rewards]
        return sum(v * w for v, w in present) if present else None

    def columns(self, rewards: Mapping[str, float]) -> list[float]:
        """One unweighted column per reward function (NaN where it does not apply), for the learner,
        which weighs them with `weights` (`TrainConfig.learner_config`)."""
        return [rewards.get(k, math.nan) for k in self.keys]
