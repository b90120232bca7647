"""The one place reward weights are applied: `rewards[]` of the config over a trajectory's
rewards by name. Filters, metrics, evaluation and the learner's advantages all weigh through here.

A reward function that does not apply to an episode leaves its key out (None, NaN in the batch):
it is excluded from the sum, never read as zero; an episode no function applies to has no reward.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

from bridge.envs.spec import RewardSpec
from bridge.wire import TrajectoryData

log = logging.getLogger(__name__)


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


class NothingScored(RuntimeError):
    """No reward function scored any episode for `rollout.max_unscored_steps` steps in a row."""


class SignalWatch:
    """Whether a step can teach anything: a group learns only when its rewards differ. A step
    without any such group is counted (`rollout/no_learning_signal`), with one warning while it
    lasts (normal at the start of sparse-reward tasks); steps in which every reward function
    answered None for every episode stop the run after `max_unscored_steps` in a row, since
    nothing scores it."""

    def __init__(self, weights: RewardWeights, max_unscored_steps: int):
        self.weights = weights
        self.max_unscored_steps = max_unscored_steps
        self.unscored_steps = 0
        self.quiet_since: int | None = None

    def observe(self, step: int, groups: Sequence[Sequence[TrajectoryData]], unscored: int, scored: int) -> dict[str, float]:
        """`groups` kept for training; `unscored`/`scored`: the step's episodes (dropped ones too)
        that no reward function / at least one scored. Returns the step's signal metrics."""
        self.unscored_steps = self.unscored_steps + 1 if unscored and not scored else 0
        if self.unscored_steps >= self.max_unscored_steps:
            raise NothingScored(
                f"step {step}: no reward function scored any episode for {self.unscored_steps} steps in a row (all "
                "returned None): check rewards[] and the task fields they read against the environments")
        totals = [[self.weights.total(t.rewards) for t in g] for g in groups]
        learning = sum(len({x for x in g if x is not None}) > 1 for g in totals)
        if not learning and self.quiet_since is None:
            self.quiet_since = step
            log.warning("step %d: no learning signal (every group's rewards are equal); normal while rewards are "
                        "sparse at the start; rollout/no_learning_signal counts such steps", step)
        elif learning and self.quiet_since is not None:
            log.info("step %d: learning signal is back after %d steps without", step, step - self.quiet_since)
            self.quiet_since = None
        return {"rollout/no_learning_signal": float(not learning), "rollout/groups_learning": float(learning)}
