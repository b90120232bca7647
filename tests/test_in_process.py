"""An openenv Environment run in-process: tool calls and text actions with their masks and rewards."""

from __future__ import annotations

import pytest

from bridge.envs.runtime import EnvRuntime
from bridge.envs.spec import EnvSpec
from bridge.tool_calls import get_parser
from episodes import check_masks, run
from jaxrl.tiny_tokenizer import build_tokenizer
from scripted_engine import ScriptedEngine, guess_number_policy, segments


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_in_process_guess_number_plays_tool_calls_with_masks(tok):
    runtime = EnvRuntime([EnvSpec("guess", env_class="bridge.envs.bundled.guess_number:GuessNumberEnvironment",
                                  action_class="bridge.envs.bundled.guess_number:GuessNumberAction")],
                         tok, get_parser("qwen"))
    engine = ScriptedEngine(tok, guess_number_policy)
    task = {"seed": 0, "low": 11, "high": 30, "secret": 23, "max_guesses": 6}
    traj = run(engine, runtime, "guess", task)
    assert traj.finish_reason == "env_done", traj.error
    assert traj.rewards == {"env": 1.0}
    # low is odd: the first turn is a malformed call, answered as an error, then bisection.
    assert traj.metrics["tool_errors"] == 1 and traj.metrics["tool_calls"] >= 2
    text = tok.decode(traj.prompt_ids)
    assert '"name": "guess"' in text and "between 11 and 30" in text  # tools in the system turn
    check_masks(traj, tok)
    model_turns = [tok.decode(ids) for m, ids in segments(traj) if m == 1]
    assert model_turns[0].startswith("<tool_call>\n{not json") and len(model_turns) == traj.num_turns
    env_turns = [tok.decode(ids) for m, ids in segments(traj) if m == 0]
    assert "<tool_response>" in env_turns[0] and "Error" in env_turns[0]
    assert "correct" not in "".join(env_turns)  # the winning guess ends the episode: nothing appended


def test_in_process_text_mode_echo(tok):
    runtime = EnvRuntime([EnvSpec("echo", env_class="bridge.envs.bundled.echo:EchoEnvironment",
                                  action_class="bridge.envs.bundled.echo:EchoAction",
                                  system_prompt="Repeat exactly.")], tok, get_parser())
    engine = ScriptedEngine(tok, lambda prompt: prompt.split("Repeat this text exactly: ")[-1].split("<|im_end|>")[0]
                            if "Repeat this text exactly: " in prompt else "amber moon")
    traj = run(engine, runtime, "echo", {"target": "amber moon"})
    assert traj.finish_reason == "env_done" and traj.rewards == {"env": 1.0}
    assert tok.decode(traj.prompt_ids).startswith("<|im_start|>system\nRepeat exactly.")
    assert traj.metrics["env_steps"] == 1 and traj.metrics["tool_calls"] == 0


def test_env_kwargs_reach_an_in_process_environments_constructor(tok):
    """The bundled guess_number takes a seed for resets without one: two seeds, two first tasks."""
    def first_prompt(seed):
        runtime = EnvRuntime([EnvSpec("guess", env_class="bridge.envs.bundled.guess_number:GuessNumberEnvironment",
                                      action_class="bridge.envs.bundled.guess_number:GuessNumberAction",
                                      env_kwargs={"seed": seed})], tok, get_parser("qwen"))
        return tok.decode(run(ScriptedEngine(tok, lambda prompt: "no idea"), runtime, "guess", {}).prompt_ids)

    assert first_prompt(1) == first_prompt(1) != first_prompt(2)
