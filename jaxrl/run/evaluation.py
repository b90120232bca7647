"""The one evaluation: held-out episodes on a bridge's current weights, used by `jaxrl train`
(before and after training, after the warm start, every `eval.every` steps) and by `jaxrl eval`.

Same tasks for the same config (`TaskSource.held_out`), same sampling (`eval.*`, seeded by the run
seed), rewards weighed by `rewards[]`, and one success rule: a task succeeds when any of its
`eval.pass_k` samples reaches `eval.success_threshold`. Episodes that errored are counted and
reported, never scored as failures; an evaluation in which every episode errored is an error.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from jaxrl.run.collection import check_rewards, most_common_error
from jaxrl.run.config import TrainConfig
from jaxrl.run.rewards import RewardWeights
from jaxrl.run.rollout_client import RolloutClient
from jaxrl.run.tasks import Task


class EvaluationFailed(RuntimeError):
    """Every episode of an evaluation errored: there is nothing to report but the error."""


@dataclasses.dataclass
class EvalResult:
    success: float  # over tasks with at least one episode that did not error
    reward: float  # mean weighted reward of those episodes (0 where no function applies)
    stderr: float  # sqrt(p(1-p)/n) over the scored tasks
    tasks: int  # tasks scored
    errors: int  # episodes that errored
    first_error: str = ""
    turns: float = math.nan
    finish_reasons: dict[str, int] = dataclasses.field(default_factory=dict)

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        return {f"{prefix}/success": self.success, f"{prefix}/reward/mean": self.reward,
                f"{prefix}/stderr": self.stderr, f"{prefix}/episodes": float(self.tasks),
                f"{prefix}/errors": float(self.errors)}

    def line(self) -> str:
        errors = f", {self.errors} episodes errored" if self.errors else ""
        return (f"success {self.success:.3f} +- {self.stderr:.3f} (mean reward {self.reward:.3f}, "
                f"{self.tasks} held-out tasks{errors})")


def evaluate(client: RolloutClient, tasks: list[Task], cfg: TrainConfig, version: int,
             stop_ids: tuple[int, ...]) -> EvalResult:
    """Held-out episodes of `tasks` on the bridges' weights (at least `version`)."""
    e = cfg.eval
    params = cfg.sampling_params(stop_ids, evaluation=True)
    groups = client.request(tasks, [f"eval-{version}-{i}" for i in range(len(tasks))], e.pass_k, params, version)
    weights = RewardWeights(cfg.rewards)
    successes, rewards = [], []
    episodes = [t for g in groups for t in g]
    check_rewards(episodes)
    failed = [t for t in episodes if t.finish_reason == "error"]
    for group in groups:
        scored = [weights.total(t.rewards) for t in group if t.finish_reason != "error"]
        if not scored:
            continue
        scored = [x if x is not None else 0.0 for x in scored]
        successes.append(float(max(scored) >= e.success_threshold))
        rewards += scored
    if episodes and not successes:
        raise EvaluationFailed(f"evaluation: all {len(episodes)} episodes errored; most common error "
                               f"{most_common_error(failed)}")
    n = len(successes)
    p = float(np.mean(successes)) if n else math.nan
    return EvalResult(
        success=p, reward=float(np.mean(rewards)) if rewards else math.nan, stderr=math.sqrt(p * (1 - p) / max(n, 1)),
        tasks=n, errors=len(failed), first_error=failed[0].error if failed else "",
        turns=float(np.mean([t.num_turns for t in episodes])) if episodes else math.nan,
        finish_reasons=dict(collections.Counter(t.finish_reason for t in episodes)))

