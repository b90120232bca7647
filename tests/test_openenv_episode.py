"""Episodes over OpenEnv sessions: action modes from the action schema, refused actions told to the
model, and OpenEnv's catalogue environments as shipped, served over /ws and in-process alike."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from bridge.envs.openenv_episode import resolve_action_mode
from bridge.envs.runtime import EnvRuntime
from bridge.envs.spec import EnvConfigError, EnvSpec, task_splits
from bridge.tool_calls import get_parser
from episodes import CLASSES, WHERE, catalogue_spec, check_masks, env_turns, run, scripted, serve_catalogue
from jaxrl.tiny_tokenizer import build_tokenizer
from scripted_engine import ScriptedEngine, segments, tool_call


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def schema(props, required):
    return {"type": "object", "properties": props, "required": required}


@pytest.mark.parametrize("props, required, mode, field", [
    ({"message": {"type": "string"}, "metadata": {"type": "object"}}, ["message"], "text", "message"),
    ({"tool": {"type": "string"}, "arguments": {"type": "object"}}, ["tool"], "tool_call", None),
    ({"type": {"type": "string"}, "tool_name": {"type": "string"}, "arguments": {"type": "object"}},
     ["tool_name"], "mcp", None),
    ({"x": {"type": "integer"}, "y": {"type": "integer"}}, ["x", "y"], "tool", None),
])
def test_auto_mode_follows_the_action_schema(props, required, mode, field):
    assert resolve_action_mode(EnvSpec("e", url="http://127.0.0.1:1"), schema(props, required)) == (mode, field)


def test_text_mode_without_a_string_field_is_a_config_error():
    spec = EnvSpec("grid", url="http://127.0.0.1:1", action="text")
    with pytest.raises(EnvConfigError, match="grid.*text_field"):
        resolve_action_mode(spec, schema({"x": {"type": "integer"}}, ["x"]))


def test_invalid_action_is_told_to_the_model(tok):
    """The action schema's validation (what a server answers VALIDATION_ERROR) is the model's error."""
    runtime = EnvRuntime([EnvSpec("guess", env_class="bridge.envs.bundled.guess_number:GuessNumberEnvironment",
                                  action_class="bridge.envs.bundled.guess_number:GuessNumberAction",
                                  action="tool", tool_name="act")], tok, get_parser())
    replies = iter([tool_call("act", {"tool": 5}), "I give up."])
    traj = run(ScriptedEngine(tok, lambda prompt: next(replies)), runtime, "guess",
               {"seed": 1, "low": 0, "high": 9, "secret": 3, "max_guesses": 4})
    assert traj.finish_reason == "stop" and traj.metrics["tool_errors"] == 1
    env_text = [tok.decode(ids) for m, ids in segments(traj) if m == 0][0]
    assert "VALIDATION_ERROR" in env_text and "tool" in env_text


# -- OpenEnv's catalogue as shipped: served over /ws, and in-process ------------------------------


@pytest.fixture(scope="module")
def catalogue():
    """where -> name -> url: served by the installed openenv, and by openenv-core 0.3.0 (what the catalogue's
    servers pin), which states no reset schema, sends no metadata and has no task routes."""
    with serve_catalogue([*CLASSES, "quiz_production"], ["grid", "arithmetic", "nim", "echo_mcp"]) as (urls, old):
        yield {"served": urls, "served_0.3": old, "in_process": {}}


def spec(catalogue, name, where, **keys):
    return catalogue_spec(catalogue[where], name, "in_process" if where == "in_process" else "served", **keys)


@pytest.mark.parametrize("where", WHERE)
def test_text_mode_says_what_a_reply_is_from_the_action_s_docstring_and_names_the_fields_it_leaves(
        tok, catalogue, where, caplog):
    """The catalogue's chess: `move: str` without a description, its meaning in the action class's docstring
    (tool mode's tool description); text mode's system line says it, and warns of `promotion`, which it cannot
    fill, described or not (the catalogue's wildfire: `x`, `y`)."""
    with caplog.at_level(logging.WARNING, logger="bridge.envs.runtime"):
        runtime = EnvRuntime([spec(catalogue, "board", where)], tok, get_parser())
        traj = run(scripted(tok, ["e2e4"]), runtime, "board", {})
    assert traj.finish_reason == "env_done" and traj.rewards == {"env": 1.0}, traj.error
    assert ("<|im_start|>system\nYour reply is sent to the environment as its action's 'move'. The action: A move "
            "in UCI notation: the square a piece leaves, then the square it lands on (e2e4).<|im_end|>"
            in tok.decode(traj.prompt_ids))
    [warning] = [r.getMessage() for r in caplog.records if "text mode fills only" in r.getMessage()]
    assert "'board'" in warning and "field(s) promotion," in warning and "action: tool" in warning


def test_text_mode_with_nothing_to_say_of_a_reply_says_so(tok, caplog):
    with caplog.at_level(logging.WARNING, logger="bridge.envs.runtime"):
        runtime = EnvRuntime([EnvSpec("bare", env_class="tests.workers.openenv_catalogue:BareBoardEnvironment")],
                             tok, get_parser())
        traj = run(scripted(tok, ["e2e4"]), runtime, "bare", {})
    assert traj.rewards == {"env": 1.0} and "<|im_start|>system" not in tok.decode(traj.prompt_ids)
    [warning] = [r.getMessage() for r in caplog.records if "not told what its reply is" in r.getMessage()]
    assert "'bare'" in warning and "'move'" in warning and "system_prompt" in warning
    # Found at start, handed to the trainer with the first episode to end (its console shows it).
    assert any(f"environment 'bare': {n}" == warning for n in traj.notices)


ALL = ("served", "served_0.3", "in_process")


@pytest.mark.parametrize("where", ALL)
def test_a_rejected_text_action_reaches_the_model_as_an_error_and_observations_show_the_state(tok, catalogue, where):
    runtime = EnvRuntime([spec(catalogue, "grid", where, action="text", text_field="action")], tok,
                         get_parser())
    traj = run(scripted(tok, ["NORTH", "DOWN", "DOWN", "RIGHT", "RIGHT"]), runtime, "grid", {"seed": 3})
    assert traj.finish_reason == "env_done", traj.error
    assert traj.num_turns == 5 and traj.metrics["action_errors"] == 1 and traj.metrics["env_steps"] == 5
    assert traj.rewards == {"env": pytest.approx(0.7)}  # the refused action: no reward, the episode goes on
    assert "Welcome to Grid World! Goal is at [2, 2].\nx: 0\ny: 0<|im_end|>" in tok.decode(traj.prompt_ids)
    turns = env_turns(traj, tok)
    assert "Error: VALIDATION_ERROR: Invalid message (action: Input should be 'UP', 'DOWN', 'LEFT' or " \
           "'RIGHT')" in turns[0]
    assert "Keep going...\nx: 1\ny: 0<|im_end|>" in turns[1]
    check_masks(traj, tok)


SCRIPTS = {
    # The enum action is a tool whose schema lists the moves; a move outside them is refused.
    "grid": [tool_call("grid", {"action": a}) for a in ("NORTH", "DOWN", "RIGHT", "DOWN", "RIGHT")],
    # An MCP environment: tools listed by ListToolsAction, an enum argument, an answer that ends it.
    "arithmetic": [tool_call("compute", {"op": "pow", "a": 5, "b": 6}), tool_call("compute", {"op": "mul", "a": 5, "b": 6}),
                   tool_call("compute", {"op": "add", "a": 30, "b": 5}), tool_call("answer", {"value": 35})],
    # One session, reset() takes no seed (the task's seed is dropped), a bounded int refused out of range.
    "nim": [tool_call("nim", {"take": 5}), tool_call("nim", {"take": 3}), tool_call("nim", {"take": 3})],
}


@pytest.mark.parametrize("name, enum, reward", [("grid", '"enum": ["UP", "DOWN", "LEFT", "RIGHT"]', 1.0 - 0.3),
                                                ("arithmetic", '"enum": ["add", "mul"]', 1.0),
                                                ("nim", '"maximum": 3', 1.0)])
def test_in_process_equals_served_and_schemas_carry_their_definitions(tok, catalogue, name, enum, reward):
    trajs = {}
    for where in ALL:
        runtime = EnvRuntime([spec(catalogue, name, where)], tok, get_parser())
        trajs[where] = run(scripted(tok, SCRIPTS[name]), runtime, name, {"seed": 3})
    served, old, local = trajs["served"], trajs["served_0.3"], trajs["in_process"]
    assert served.finish_reason == old.finish_reason == local.finish_reason == "env_done", (served.error, local.error)
    assert served.rewards == old.rewards == local.rewards == {"env": pytest.approx(reward)}
    assert tok.decode(served.prompt_ids) == tok.decode(old.prompt_ids) == tok.decode(local.prompt_ids)
    assert tok.decode(served.completion_ids) == tok.decode(old.completion_ids) == tok.decode(local.completion_ids)
    assert served.metrics["tool_errors"] == old.metrics["tool_errors"] == local.metrics["tool_errors"] == 1
    prompt = tok.decode(served.prompt_ids)
    assert enum in prompt and "$ref" not in prompt and "$defs" not in prompt
    assert "Error:" in env_turns(served, tok)[0]


@pytest.mark.parametrize("where", ALL)
def test_an_observation_template_is_checked_at_start_and_renders_the_fields(tok, catalogue, where):
    runtime = EnvRuntime([spec(catalogue, "grid", where, action="text", text_field="action",
                               observation_template="You are at ({x}, {y}). {message}")], tok, get_parser())
    traj = run(scripted(tok, ["DOWN"]), runtime, "grid", {}, max_turns=1)
    assert "You are at (0, 0). Welcome to Grid World! Goal is at [2, 2].<|im_end|>" in tok.decode(traj.prompt_ids)
    # An MCP server's observation schema is its tool results': the reset observation's fields are not checked.
    runtime = EnvRuntime([spec(catalogue, "arithmetic", where, observation_template="Q: {question}")], tok,
                         get_parser())
    traj = run(scripted(tok, ["I give up."]), runtime, "arithmetic", {"seed": 3})
    assert "Q: Compute 5 * 6 + 5 with the tools.<|im_end|>" in tok.decode(traj.prompt_ids)
    runtime = EnvRuntime([spec(catalogue, "grid", where, observation_template="At {x},{z}")], tok,
                         get_parser())
    with pytest.raises(EnvConfigError, match="'grid': observation_template names field 'z', which its step "
                                             "observations do not have; they have: x, y, message$"):
        asyncio.run(runtime.start())


@pytest.mark.parametrize("where", WHERE)
def test_an_empty_reset_template_leaves_the_task_prompt_alone(tok, catalogue, where):
    """reset_template: '' shows nothing of reset's observation (coding_env's is only "exit_code: 0"), the steps
    are shown as observation_template (or by default) says."""
    runtime = EnvRuntime([spec(catalogue, "grid", where, reset_template="")], tok, get_parser())
    traj = run(scripted(tok, [tool_call("grid", {"action": "DOWN"}), "done"]), runtime, "grid",
               {"prompt": "Reach the goal."})
    assert "<|im_start|>user\nReach the goal.<|im_end|>" in tok.decode(traj.prompt_ids)
    assert "Keep going...\nx: 1\ny: 0" in env_turns(traj, tok)[0]


# -- what openenv >= 0.10 adds: reset's own schema, metadata, task routes, production mode -----------------


NEW = ("served", "in_process")


@pytest.mark.parametrize("where", NEW)
def test_reset_and_step_observations_are_each_checked_and_rendered_with_their_own_schema(tok, catalogue, where):
    quiz = dict(action="text", reset_template="{question} ({metadata[split]} #{metadata[index]})",
                observation_template="{verdict}, it is {metadata[answer]}")
    runtime = EnvRuntime([spec(catalogue, "quiz", where, **quiz)], tok, get_parser())
    traj = run(scripted(tok, ["4"]), runtime, "quiz", {"split": "test", "index": 1})
    assert "What is 3 * 5? (test #1)<|im_end|>" in tok.decode(traj.prompt_ids)
    assert traj.finish_reason == "env_done" and traj.rewards == {"env": 0.0}
    for keys, match in [({"observation_template": "Q: {question}"},
                         "observation_template names field 'question', which its step observations do not have; "
                         "they have: verdict; a template of reset's fields goes in reset_template$"),
                        ({"reset_template": "{verdict}"},
                         "reset_template names field 'verdict', which its reset observations do not have; they "
                         "have: question$")]:
        runtime = EnvRuntime([spec(catalogue, "quiz", where, action="text", **keys)], tok, get_parser())
        with pytest.raises(EnvConfigError, match=match):
            asyncio.run(runtime.start())


@pytest.mark.parametrize("where", ALL)
def test_metadata_renders_where_the_server_sends_it_and_is_refused_at_start_where_it_cannot(tok, catalogue, where,
                                                                                               caplog):
    """echo_env's reset says everything in metadata: without a template the model's first turn is empty."""
    with caplog.at_level(logging.WARNING, logger="bridge.envs.runtime"):
        runtime = EnvRuntime([spec(catalogue, "echo_mcp", where)], tok, get_parser())
        traj = run(scripted(tok, ["Nothing to say."]), runtime, "echo_mcp", {})
    assert "<|im_start|>user\n<|im_end|>" in tok.decode(traj.prompt_ids)
    [warning] = [r.getMessage() for r in caplog.records if "first user turn is empty" in r.getMessage()]
    sent = "nothing" if where == "served_0.3" else "metadata['status', 'message']"
    assert f"environment 'echo_mcp': reset's observation shows the model nothing (it sent: {sent})" in warning
    assert [f"environment 'echo_mcp': {n}" for n in traj.notices] == [warning]  # for the trainer's console
    assert run(scripted(tok, ["Nothing to say."]), runtime, "echo_mcp", {}).notices == []  # handed on once
    runtime = EnvRuntime([spec(catalogue, "echo_mcp", where, observation_template="{metadata[message]}")], tok,
                         get_parser())
    if where == "served_0.3":
        with pytest.raises(EnvConfigError, match="observation_template uses metadata, which this server does not"):
            asyncio.run(runtime.start())
        return
    traj = run(scripted(tok, ["Nothing to say."]), runtime, "echo_mcp", {})
    assert "<|im_start|>user\nEcho environment ready!<|im_end|>" in tok.decode(traj.prompt_ids)


@pytest.mark.parametrize("where", ALL)
def test_task_splits_come_from_the_environment_and_reset_plays_the_one_named(tok, catalogue, where):
    if where == "served_0.3":
        with pytest.raises(EnvConfigError, match="'grid': the server at .* has no task routes"):
            task_splits(spec(catalogue, "grid", where))
        return
    assert task_splits(spec(catalogue, "quiz", where)) == {"train": 3, "test": 2}
    with pytest.raises(EnvConfigError, match="'grid'.* (no task splits|serves no task splits)"):
        task_splits(spec(catalogue, "grid", where))
    runtime = EnvRuntime([spec(catalogue, "quiz", where)], tok, get_parser())
    traj = run(scripted(tok, ["8"]), runtime, "quiz", {"split": "train", "index": 2})
    assert "What is 9 - 7?" in tok.decode(traj.prompt_ids) and traj.rewards == {"env": 0.0}


def test_text_mode_tells_the_model_what_its_reply_is_and_warns_of_the_fields_it_leaves_out(tok, catalogue, caplog):
    with caplog.at_level(logging.WARNING, logger="bridge.envs.runtime"):
        runtime = EnvRuntime([spec(catalogue, "quiz", "served")], tok, get_parser())
        traj = run(scripted(tok, ["16"]), runtime, "quiz", {"split": "train", "index": 1})
    assert traj.rewards == {"env": 1.0}
    assert ("<|im_start|>system\nYour reply is sent to the environment as its action's 'answer': the answer, a whole "
            "number<|im_end|>") in tok.decode(traj.prompt_ids)
    [warning] = [r.getMessage() for r in caplog.records if "text mode fills only" in r.getMessage()]
    assert "'quiz'" in warning and "show_work (whether to explain the verdict)" in warning and "action: tool" in warning
    runtime = EnvRuntime([spec(catalogue, "quiz", "served", describe_action=False, system_prompt="Be brief.")], tok,
                         get_parser())
    traj = run(scripted(tok, ["16"]), runtime, "quiz", {"split": "train", "index": 1})
    assert "<|im_start|>system\nBe brief.<|im_end|>" in tok.decode(traj.prompt_ids)


def test_a_production_mode_server_serves_episodes_and_its_task_splits(tok, catalogue):
    url = catalogue["served"]["quiz_production"]
    assert httpx.post(url + "/reset", json={}).status_code in (404, 405)  # production: no HTTP control routes
    quiz = EnvSpec("quiz", url=url)
    assert task_splits(quiz) == {"train": 3, "test": 2}
    traj = run(scripted(tok, ["12"]), EnvRuntime([quiz], tok, get_parser()), "quiz", {"split": "test", "index": 0})
    assert traj.finish_reason == "env_done" and traj.rewards == {"env": 1.0}
