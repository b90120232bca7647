"""Reward functions as TRL calls them, and the errors of ones that return something other than one
number (or None) per completion."""

from __future__ import annotations

import asyncio
import inspect
import json
import math

import pytest

from bridge.envs.runtime import EnvRuntime
from bridge.envs.spec import EnvSpec, RewardSpec
from bridge.tool_calls import get_parser
from episodes import run
from jaxrl.tiny_tokenizer import build_tokenizer
from scripted_engine import ScriptedEngine, tool_call


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("fn, message", [
    ("not_a_list", "returned 1.0; it must return a list with one value per completion"),
    ("two_values", "returned [1.0, 2.0]; it must return a list with one value per completion"),
    ("nan", "returned nan; rewards must be finite"),
    ("inf", "returned inf; rewards must be finite"),
    ("text", "returned '1.5' (str); rewards must be numbers or None"),
    ("huge", "returned 1e+308; rewards must be within +-1e+09 (scale it down)"),
    ("predicate", "returned True; rewards must be numbers or None (float(True) if that is meant)"),
])
def test_a_reward_that_is_not_a_number_or_none_is_a_reward_error_naming_the_function(tok, fn, message):
    runtime = EnvRuntime([EnvSpec("counter", env_class="episodes:Counter")], tok, get_parser(),
                         [RewardSpec(f"test_scoring:{fn}")])
    traj = run(ScriptedEngine(tok, lambda prompt: "done"), runtime, "counter", {})
    assert traj.finish_reason == "error"
    assert traj.error.startswith(f"RewardError: reward function {fn!r} (test_scoring:{fn}) for episode g/0 of "
                                 "'counter' "), traj.error
    assert message in traj.error


def not_a_list(completions, environments, **kwargs):
    return 1.0


def huge(completions, **kwargs):
    return [1e308] * len(completions)


def predicate(completions, **kwargs):
    return [True] * len(completions)


def two_values(completions, environments, **kwargs):
    return [1.0, 2.0]


def nan(completions, environments, **kwargs):
    return [float("nan")]


def inf(completions, environments, **kwargs):
    return [math.inf]


def text(completions, environments, **kwargs):
    return ["1.5"]


# -- TRL's environment_factory, reward functions and dataset rows, unchanged ---------------------


class Vault:
    """TRL's `environment_factory` shape: reset(**row) returns what TRL appends to the row's prompt."""

    def reset(self, **row) -> str:
        self.code, self.tries, self.opened = row["code"], 0, False
        return f"The lock has {len(str(row['code']))} digits."

    def try_code(self, code: int) -> str:
        """Try a code on the lock.

        Args:
            code: The code to try.

        Returns:
            "open", or "wrong".
        """
        self.tries += 1
        self.opened = self.opened or code == self.code
        return "open" if code == self.code else "wrong"

    def get_reward(self) -> float:
        return float(self.opened)


SEEN_BY_REWARD: list[dict] = []


def opened_quickly(prompts, completions, environments, level, **kwargs):
    """A TRL reward function: its environments' state and the row's columns."""
    SEEN_BY_REWARD.append({"prompts": prompts, "completions": completions, "level": level, **kwargs})
    return [1.0 / env.tries if env.opened else 0.0 for env in environments]


def trl_first_prompt_ids(tok, env_factory, row) -> list[int]:
    """The first prompt TRL 1.16's GRPOTrainer renders for a dataset row, following its code
    (`_generate_and_score_completions`: reset and the append; `_tokenize_prompts`: the template)."""
    env = env_factory()
    prompt = row["prompt"]
    observation = env.reset(**row)
    prompt = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
    tools = [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
             if name not in ("reset", "get_reward") and not name.startswith("_")]
    return tok.apply_chat_template(conversation=[prompt], tools=tools or None, add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"][0]


def test_a_trl_dataset_environment_factory_and_reward_function_work_unchanged(tok, tmp_path):
    from jaxrl.run.tasks import read_task_file

    row = {"prompt": [{"role": "system", "content": "You open locks."},
                      {"role": "user", "content": "Open the vault. "}],
           "code": 4321, "level": "easy"}
    dataset = tmp_path / "vault.jsonl"
    dataset.write_text(json.dumps(row) + "\n")
    [(env, task)] = read_task_file(dataset, ["vault"])
    runtime = EnvRuntime([EnvSpec(env, env_class="test_scoring:Vault")], tok, get_parser(),
                         [RewardSpec("env"), RewardSpec("test_scoring:opened_quickly")])
    replies = iter([tool_call("try_code", {"code": 1234}), tool_call("try_code", {"code": 4321}), "Opened."])
    SEEN_BY_REWARD.clear()
    traj = run(ScriptedEngine(tok, lambda prompt: next(replies)), runtime, env, task)
    assert traj.finish_reason == "stop", traj.error
    assert traj.prompt_ids.tolist() == trl_first_prompt_ids(tok, Vault, row)
    assert "Open the vault. The lock has 4 digits.<|im_end|>" in tok.decode(traj.prompt_ids)
    assert traj.rewards == {"env": 1.0, "opened_quickly": 0.5}  # get_reward() is the environment's own
    [seen] = SEEN_BY_REWARD
    assert seen["prompts"] == [row["prompt"][:1] + [{"role": "user",
                                                     "content": "Open the vault. The lock has 4 digits."}]]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "try_code", "arguments": {"code": 1234}}}]}
    assert seen["completions"][0][:2] == [call, {"role": "tool", "name": "try_code", "content": "wrong"}]
    assert seen["completions"][0][3:] == [{"role": "tool", "name": "try_code", "content": "open"},
                                          {"role": "assistant", "content": "Opened."}]
    assert seen["level"] == ["easy"] and seen["code"] == [4321] and "prompt" not in seen
    assert seen["completion_ids"] == [traj.completion_ids.tolist()]


# -- reward models: a classifier and a judge on the same path, their time a phase of its own --------


def test_reward_models_score_the_conversation_the_reward_functions_see(tok, tmp_path):
    from bridge.classifier import RewardClassifier
    from jaxrl.tiny import build_tiny_classifier

    classifier_dir = build_tiny_classifier(tmp_path / "rm", seed=5)
    row = {"prompt": [{"role": "user", "content": "Open the vault. "}], "code": 12, "level": "easy"}
    judged = []

    def policy(prompt):  # the model's turns, then the judges' answers (their rubrics are the whole prompt)
        if prompt.count("Rate") == 1:
            judged.append(prompt)
            return "Fair: 0.25" if "verdict" not in prompt else "nothing to say"
        return tool_call("try_code", {"code": 12}) if "<tool_response>" not in prompt else "Opened."

    runtime = EnvRuntime([EnvSpec("vault", env_class="test_scoring:Vault")], tok, get_parser(), [
        RewardSpec("test_scoring:opened_quickly"),
        RewardSpec(model=str(classifier_dir), kind="classifier", name="rm"),
        RewardSpec(kind="judge", judge="policy", template="Rate this ({level}): {completion}", name="judge"),
        RewardSpec(kind="judge", judge="policy", template="Rate this verdict: {conversation}", name="strict",
                   verdicts={"yes": 1, "no": 0})])
    engine = ScriptedEngine(tok, policy)
    runtime.rewards.load_models(engine, 256, {}, judge_engine=None)
    SEEN_BY_REWARD.clear()
    traj = run(engine, runtime, "vault", dict(row))
    assert traj.finish_reason == "stop", traj.error
    [seen] = SEEN_BY_REWARD
    outside = RewardClassifier(classifier_dir, 256)
    expected = asyncio.run(outside.score(seen["prompts"][0] + seen["completions"][0]))
    assert traj.rewards == {"env": 1.0, "opened_quickly": 1.0, "rm": pytest.approx(expected, abs=1e-5),
                            "judge": 0.25}  # "strict" answered no verdict: it does not apply
    assert traj.metrics["judge_malformed"] == 1.0
    assert len(judged) == 2 and "Rate this (easy): assistant: \n" in judged[0]
    assert traj.reward_s > 0 and traj.total_s >= traj.generate_s + traj.env_s + traj.reward_s


def test_a_reward_model_the_bridge_did_not_load_is_an_error_that_says_so(tok):
    runtime = EnvRuntime([EnvSpec("counter", env_class="episodes:Counter")], tok, get_parser(),
                         [RewardSpec(kind="judge", judge="policy", template="{completion}")])
    traj = run(ScriptedEngine(tok, lambda prompt: "done"), runtime, "counter", {})
    assert traj.finish_reason == "error"
    assert "reward model 'judge' is not loaded: a bridge loads its reward models with its engine" in traj.error


def test_a_reward_model_directory_of_the_wrong_kind_is_refused_naming_the_reward(tok, tmp_path):
    from bridge.envs.spec import EnvConfigError
    from jaxrl.tiny import build_tiny_model

    policy_dir = build_tiny_model(tmp_path / "policy", tokenizer=tok)
    runtime = EnvRuntime([EnvSpec("counter", env_class="episodes:Counter")], tok, get_parser(),
                         [RewardSpec(model=str(policy_dir), kind="classifier", name="rm")])
    with pytest.raises(EnvConfigError, match=rf"^reward model 'rm' \(classifier, {policy_dir}\) cannot load: "
                                             r"ModelConfigError: .*architectures \['Qwen3ForCausalLM'\] is not "
                                             r"'Qwen3ForSequenceClassification'$"):
        runtime.rewards.load_models(ScriptedEngine(tok, str), 64, {}, judge_engine=None)
