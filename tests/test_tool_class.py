"""A TRL-style tool-environment class: its tools' errors counted and told to the model, its own reward."""

from __future__ import annotations

import pytest

from bridge.envs.runtime import EnvRuntime
from bridge.envs.spec import EnvConfigError, EnvSpec, RewardSpec
from bridge.tool_calls import get_parser
from episodes import Counter, check_masks, run
from jaxrl.tiny_tokenizer import build_tokenizer
from scripted_engine import ScriptedEngine, segments, tool_call


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def over_two(completions, environments, start, **kwargs):
    return [None if s == 0 else float(env.value > 2) for env, s in zip(environments, start)]


def length_penalty(completions, environments, **kwargs):
    return [-len(c) / 1000 for c in completions]


def test_tool_class_episode_counts_errors_and_scores(tok):
    runtime = EnvRuntime(
        [EnvSpec("counter", env_class="episodes:Counter")], tok, get_parser(),
        [RewardSpec("env"), RewardSpec("test_tool_class:over_two", 0.5), RewardSpec("test_tool_class:length_penalty")])
    replies = iter([
        tool_call("add", {"amount": 1}) + tool_call("mul", {"x": 2}),   # one good, one unknown tool
        tool_call("add", {"amount": "two"}),                            # wrong type
        tool_call("add", {"amount": -1}),                               # the tool raises
        tool_call("add", {"amount": 2}),                                # reaches 3: done
    ])
    traj = run(ScriptedEngine(tok, lambda prompt: next(replies)), runtime, "counter", {"start": 0})
    assert traj.finish_reason == "env_done", traj.error
    assert traj.metrics == {"tool_calls": 5, "tool_errors": 3, "env_steps": 5}
    assert traj.rewards["env"] == 1.0 and "over_two" not in traj.rewards  # None: does not apply
    assert traj.rewards["length_penalty"] < 0
    check_masks(traj, tok)
    env_text = "".join(tok.decode(ids) for m, ids in segments(traj) if m == 0)
    assert "unknown tool 'mul'" in env_text and "ValueError: amount must be positive" in env_text

    replies = iter([tool_call("add", {"amount": 3})])
    traj = run(ScriptedEngine(tok, lambda prompt: next(replies)), runtime, "counter", {"start": 1})
    assert traj.rewards["over_two"] == 1.0 and traj.rewards["env"] == 0.0  # 4 != 3


def test_an_environment_reward_that_is_not_a_number_is_a_reward_error(tok):
    runtime = EnvRuntime([EnvSpec("counter", env_class="test_tool_class:NanCounter")], tok, get_parser())
    traj = run(ScriptedEngine(tok, lambda prompt: "done"), runtime, "counter", {})
    assert traj.error == "RewardError: environment 'counter' (its reward()) returned nan; rewards must be finite " \
                         "(None: does not apply)"


class NanCounter(Counter):
    def reward(self) -> float:
        return float("nan")


class Board(Counter):
    """A class whose constructor takes settings, as catalogue environments do (a size, a difficulty)."""

    def __init__(self, size: int, colour: str = "white"):
        self.size, self.colour = size, colour

    def reset(self, **task) -> str:
        super().reset(**task)
        return f"A {self.colour} board of {self.size}."


def test_env_kwargs_build_each_episodes_instance_and_must_fit_its_constructor(tok):
    runtime = EnvRuntime([EnvSpec("board", env_class="test_tool_class:Board", env_kwargs={"size": 5, "colour": "red"})],
                         tok, get_parser())
    traj = run(ScriptedEngine(tok, lambda prompt: "done"), runtime, "board", {})
    assert traj.finish_reason != "error", traj.error
    assert "A red board of 5." in tok.decode(traj.prompt_ids)
    with pytest.raises(EnvConfigError, match=r"^environment 'board': env_kwargs \{'sise': 5\} do not fit Board's "
                                             r"constructor \(.*\); it takes: size, colour$"):
        EnvRuntime([EnvSpec("board", env_class="test_tool_class:Board", env_kwargs={"sise": 5})], tok, get_parser())
