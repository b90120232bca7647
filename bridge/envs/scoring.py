"""The one reward path of every environment episode: the environment's own reward, then the run's
reward functions called as TRL calls them, so a TRL reward function works unchanged whatever kind
of environment the episode ran on, then the reward models the bridge serves (`bridge.classifier`,
`bridge.judge`), whose time is the episode's `reward_s` (its own phase of a step's timings)."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from bridge.envs.spec import ENV_REWARD, EnvConfigError, RewardError, RewardSpec, import_object, reward_value

if TYPE_CHECKING:
    from bridge.classifier import RewardClassifier
    from bridge.engines.base import Engine
    from bridge.envs.episode import EnvEpisodeHook
    from bridge.judge import Judge

# What reward functions get from the episode, never from task fields of the same name (TRL: the
# row's `prompt` reaches them as `prompts`).
_CALL_ARGUMENTS = frozenset({"prompt", "prompts", "completion", "completions", "completion_ids", "environments",
                             "env"})


class RewardFunctions:
    """The run's reward functions by key, imported (and checked callable) once; its reward models,
    loaded once the bridge has its engine (`load_models`)."""

    def __init__(self, specs: Sequence[RewardSpec], tokenizer: Any):
        self.tokenizer = tokenizer
        self.specs = {r.key: r for r in specs}
        self.fns = {r.key: import_object(r.fn, "reward function") for r in specs if r.fn not in (None, ENV_REWARD)}
        for key, fn in self.fns.items():
            if not callable(fn):
                raise EnvConfigError(f"reward function {key!r} is not callable")
        self.models: dict[str, RewardClassifier | Judge] = {}

    @property
    def model_specs(self) -> list[RewardSpec]:
        return [r for r in self.specs.values() if r.kind is not None]

    def load_models(self, engine: Engine, max_seq_len: int, template_kwargs: dict[str, Any],
                    judge_engine: Callable[[str], Engine]) -> None:
        """Loads the reward models: classifiers over sequences of up to `max_seq_len` tokens, judges on
        `engine` (judge: policy) or on `judge_engine(model_dir)`; every program compiled here."""
        from bridge.classifier import RewardClassifier
        from bridge.judge import Judge

        from jaxrl.models import load_tokenizer

        for spec in self.model_specs:
            try:
                if spec.kind == "classifier":
                    self.models[spec.key] = RewardClassifier(spec.model, max_seq_len, template_kwargs=template_kwargs)
                elif spec.judge == "policy":
                    self.models[spec.key] = Judge(spec, engine, self.tokenizer, template_kwargs)
                else:
                    self.models[spec.key] = Judge(spec, judge_engine(spec.model), load_tokenizer(spec.model),
                                                  template_kwargs)
            except Exception as e:  # a directory that is not what its kind needs: say which reward
                raise EnvConfigError(f"reward model {spec.key!r} ({spec.kind}, {spec.model or 'the policy'}) cannot "
                                     f"load: {type(e).__name__}: {e}") from e

    async def score(self, hook: EnvEpisodeHook, trajectory) -> dict[str, float]:
        """The rewards of `hook`'s finished episode. Reward functions are called as TRL calls them:
        `fn(prompts=, completions=, completion_ids=, environments=, env=, **task_fields)`, one
        episode each; `completions` are chat messages (the model's turns with their `tool_calls`,
        and the answers) when the task's `prompt` is chat messages, as in TRL, else the text."""
        env, episode, task = hook.spec.name, hook.episode, hook.task
        rewards = {ENV_REWARD: episode.record.total_reward}  # no reward given: 0, not "does not apply"
        if not self.fns and not self.model_specs:
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
        await self._score_models(hook, trajectory, rewards)
        return rewards

    async def _score_models(self, hook: EnvEpisodeHook, trajectory, rewards: dict[str, float]) -> None:
        """The reward models' rewards of the episode into `rewards`; a judge's malformed answer is
        none (counted in the episode's `judge_malformed`)."""
        for spec in self.model_specs:
            model = self.models.get(spec.key)
            if model is None:
                raise EnvConfigError(f"reward model {spec.key!r} is not loaded: a bridge loads its reward models "
                                     "with its engine (RewardFunctions.load_models)")
            start = time.perf_counter()
            try:
                if spec.kind == "classifier":
                    value = await model.score(hook.prompt + hook.conversation)
                else:
                    value = await model.score(hook.prompt, hook.conversation, hook.task)
                    if value is None:
                        hook.metrics["judge_malformed"] = hook.metrics.get("judge_malformed", 0.0) + 1
            finally:
                trajectory.reward_s += time.perf_counter() - start
            value = reward_value(value, f"reward model {spec.key!r} ({spec.kind})")
            if value is not None:
                rewards[spec.key] = value
