"""The one evaluation, through a real (in-process) bridge with scripted policies: success and its
standard error, reward weights, pass@k, and episodes that error."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bridge.engines.base import Completion, derive_seed
from jaxrl.run.collection import RolloutClient
from jaxrl.run.config import TrainConfig
from jaxrl.run.evaluation import EvaluationFailed, evaluate
from jaxrl.run.tasks import TaskSource
from jaxrl.run.typed_config import from_dict
from jaxrl.tiny_tokenizer import build_tokenizer
from scripted_engine import TOKEN, ScriptedEngine, in_process_bridge

ECHO = {"name": "echo", "env_class": "bridge.envs.bundled.echo:EchoEnvironment", "observation_field": "text",
        "action_class": "bridge.envs.bundled.echo:EchoAction"}
FLAKY = {"name": "flaky", "env_class": "test_evaluation:Flaky"}


def always_one(completions, **kwargs):
    return [1.0] * len(completions)


class Flaky:
    """A tool environment that cannot start odd tasks, and pays 1 for the even ones."""

    def reset(self, seed: int = 0, **task) -> str:
        if seed % 2:
            raise RuntimeError(f"task {seed} is broken")
        return "Say anything."

    def reward(self) -> float:
        return 1.0


def right(prompt):
    return prompt.split("Repeat exactly: ")[-1].split("<|im_end|>")[0]


def half(prompt):
    target = right(prompt)
    return target if len(target) % 2 == 0 else "no"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def config(envs=(ECHO,), **extra) -> TrainConfig:
    base = {"run_dir": "r", "model": {"dir": "m"}, "envs": list(envs), "rollout": {"max_tokens": 32}, **extra}
    return from_dict(TrainConfig, base)


def run(tok, policy, cfg, engine_cls=ScriptedEngine):
    envs = {"envs": [e.to_dict() for e in cfg.envs], "rewards": [r.__dict__ for r in cfg.rewards]}
    with in_process_bridge(engine_cls(tok, policy), envs, tok) as address:
        client = RolloutClient([address], cfg.bridge, TOKEN, timeout_s=cfg.rollout_timeout_s)
        try:
            return evaluate(client, TaskSource(cfg).held_out(), cfg, 0, (tok.eos_token_id,))
        finally:
            client.close()


def test_success_and_its_standard_error(tok):
    cfg = config(eval={"episodes": 40})
    assert run(tok, right, cfg).success == 1.0
    result = run(tok, half, cfg)
    from bridge.envs.bundled.echo import task_for_seed

    tasks = TaskSource(cfg).held_out()
    even = np.mean([len(task_for_seed(f["seed"], "train")["target"]) % 2 == 0 for _, f in tasks])
    assert result.success == pytest.approx(even) and result.tasks == 40 and result.errors == 0
    assert result.stderr == pytest.approx(math.sqrt(even * (1 - even) / 40))


def test_rewards_are_weighted_by_the_config(tok):
    rewards = [{"fn": "env"}, {"fn": "test_evaluation:always_one", "weight": 0.5}]
    wrong = run(tok, lambda p: "no", config(rewards=rewards, eval={"episodes": 8}))
    assert wrong.reward == 0.5 and wrong.success == 0.0  # 0 * 1 + 1 * 0.5 < the threshold 1
    ok = run(tok, right, config(rewards=rewards, eval={"episodes": 8}))
    assert ok.reward == 1.5 and ok.success == 1.0


def first_turn_seed(run_seed: int, group_id: str, j: int) -> int:
    """The seed episode j of a group samples its first turn with (see PromptGroup.seed)."""
    return derive_seed(derive_seed(derive_seed(run_seed, group_id), j), 0)


class SeedEngine(ScriptedEngine):
    """Right only in the second episode of each of eight evaluation groups (seed 0, version 0)."""

    RIGHT = {first_turn_seed(0, f"eval-0-{i}", 1) for i in range(8)}

    async def generate(self, prompts, params):
        [[completion]] = await super().generate(prompts, params)
        if params.seed not in self.RIGHT:
            ids = self.tokenizer.encode("no", add_special_tokens=False) + [self.tokenizer.eos_token_id]
            completion = Completion(ids, [0.0] * len(ids), "stop", 0)
        return [[completion]]


def test_pass_at_k(tok):
    one = run(tok, right, config(eval={"episodes": 8}), SeedEngine)
    two = run(tok, right, config(eval={"episodes": 8, "pass_k": 2, "temperature": 1.0}), SeedEngine)
    assert one.success == 0.0 and two.success == 1.0 and two.reward == 0.5


def test_errored_episodes_are_counted_not_scored_and_all_errored_is_an_error(tok):
    result = run(tok, lambda p: "hi", config([FLAKY], eval={"episodes": 6}))
    assert result.errors == 3 and result.tasks == 3 and result.success == 1.0
    assert "task 1000001 is broken" in result.first_error and "3 episodes errored" in result.line()
    cfg = config([FLAKY], eval={"episodes": 2}, data={"task_fields": {"flaky": {"seed": 1}}})
    with pytest.raises(EvaluationFailed, match=r"all 2 episodes errored; most common error \(2x\).*task 1 is broken"):
        run(tok, lambda p: "hi", cfg)
