"""The one reward path of every environment episode: the environment's own reward, then the run's
reward functions called as TRL calls them, so a TRL reward function works unchanged whatever kind
of environment the episode ran on."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bridge.envs.spec import ENV_REWARD, EnvConfigError, RewardError, RewardSpec, import_object, reward_value

if TYPE_CHECKING:
    from bridge.envs.episode import EnvEpisodeHook

# What reward functions get from the episode, never from task fields of the same name (TRL: the
# row's `prompt` reaches them as `prompts`).
_CALL_ARGUMENTS = frozenset({"prompt", "prompts", "completion", "completions", "completion_ids", "environments",
                             "env"})


class RewardFunctions:
    """The run's reward functions by key, imported (and checked callable) once."""

    def __init__(self, specs: Sequence[RewardSpec], tokenizer: Any):
        self.tokenizer = tokenizer
        self.specs = {r.key: r for r in specs}
        self.fns = {r.key: import_object(r.fn, "reward function") for r in specs if r.fn != ENV_REWARD}
        for key, fn in self.fns.items():
            if not callable(fn):
                raise EnvConfigError(f"reward function {key!r} is not callable")

    async def score(self, hook: EnvEpisodeHook, trajectory) -> dict[str, float]:
        """The rewards of `hook`'s finished episode. Reward functions are called as TRL calls them:
        `fn(prompts=, completions=, completion_ids=, environments=, env=, **task_fields)`, one
        episode each; `completions` are chat messages (the model's turns with their `tool_calls`,
        and the answers) when the task's `prompt` is chat messages, as in TRL, else the text."""
        env, episode, task = hook.spec.name, hook.episode, hook.task
        rewards = {ENV_REWARD: episode.record.total_reward}  # no reward given: 0, not "does not apply"
        if not self.fns:
            return rewards
        prompt = hook.prompt
        if isinstance(task.get("prompt"), list):
            completion = hook.conversation
        else:
            completion = self.tokenizer.decode(trajectory.completion_ids.tolist(), skip_special_tokens=True)
            if isinstance(task.get("prompt"), str):
                prompt = prompt[-1]["content"]
        fields = {k: [v] for k, v in task.items() if k not in _CALL_ARGUMENTS}
        for key, fn in self.fns.items():
            what = (f"reward function {key!r} ({self.specs[key].fn}) for episode "
                    f"{trajectory.group_id}/{trajectory.index_in_group} of {env!r}")
            value = fn(prompts=[prompt], completions=[completion], completion_ids=[trajectory.completion_ids.tolist()],
                       environments=[episode.handle], env=[env], **fields)
            if inspect.isawaitable(value):
                value = await value
            if not isinstance(value, (list, tuple)) or len(value) != 1:
                raise RewardError(f"{what} returned {value!r}; it must return a list with one value per "
                                  "completion (here 1)")
            value = reward_value(value[0], what)
            if value is not None:
                rewards[key] = value
        return rewards
