"""The one episode loop: text turns and tool turns, final answers, turn and token budgets, tool-call
tags a tokenizer marks special."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken

from bridge.envs.runtime import EnvRuntime
from bridge.envs.spec import EnvSpec
from bridge.tool_calls import get_parser
from episodes import check_masks, run
from jaxrl.tiny_tokenizer import build_tokenizer
from scripted_engine import ScriptedEngine, segments, tool_call


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_multi_step_text_mode_appends_observations_as_user_turns(tok):
    runtime = EnvRuntime([EnvSpec("echo", env_class="bridge.envs.bundled.echo:EchoEnvironment",
                                  action_class="bridge.envs.bundled.echo:EchoAction")], tok, get_parser())
    engine = ScriptedEngine(tok, lambda prompt: "red")
    traj = run(engine, runtime, "echo", {"target": "blue sky", "max_steps": 3})
    assert traj.finish_reason == "env_done" and traj.num_turns == 3
    assert traj.rewards == {"env": 0.0}
    check_masks(traj, tok)
    env_turns = [tok.decode(ids) for m, ids in segments(traj) if m == 0]
    assert len(env_turns) == 2 and all("<|im_start|>user\n" in t for t in env_turns)


def test_tool_calls_are_parsed_when_the_tokenizer_marks_their_tags_special():
    tok = build_tokenizer()  # then marked special, as TRL's tiny test tokenizers have them
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("<tool_call>", "</tool_call>")],
                   special_tokens=True)
    ids = tok.encode(tool_call("add", {"amount": 1}), add_special_tokens=False)
    assert "<tool_call>" not in tok.decode(ids, skip_special_tokens=True)  # gone from such a decode
    runtime = EnvRuntime([EnvSpec("counter", env_class="episodes:Counter")], tok, get_parser())
    replies = iter([tool_call("add", {"amount": 1}), tool_call("add", {"amount": 2})])
    traj = run(ScriptedEngine(tok, lambda prompt: next(replies)), runtime, "counter", {})
    assert traj.finish_reason == "env_done", traj.error
    assert traj.metrics == {"tool_calls": 2, "tool_errors": 0, "env_steps": 2} and traj.rewards == {"env": 1.0}
    check_masks(traj, tok)


def test_answer_without_tool_call_ends_the_episode(tok):
    runtime = EnvRuntime([EnvSpec("counter", env_class="episodes:Counter")], tok, get_parser())
    traj = run(ScriptedEngine(tok, lambda prompt: "The answer is 3."), runtime, "counter", {})
    assert traj.finish_reason == "stop" and traj.num_turns == 1 and traj.rewards == {"env": 0.0}


def test_max_turns_and_budget_end_episodes(tok):
    runtime = EnvRuntime([EnvSpec("counter", env_class="episodes:Counter")], tok, get_parser())
    traj = run(ScriptedEngine(tok, lambda prompt: tool_call("add", {"amount": 0})), runtime, "counter", {},
               max_turns=3)
    assert traj.finish_reason == "max_turns" and traj.num_turns == 3
    traj = run(ScriptedEngine(tok, lambda prompt: tool_call("add", {"amount": 0})), runtime, "counter", {},
               max_turns=50, budget=120)
    # The answer that would pass the budget is not appended: the episode ends on the model's turn.
    assert traj.finish_reason == "length" and len(traj.completion_ids) <= 120 and traj.loss_mask[-1] == 1
