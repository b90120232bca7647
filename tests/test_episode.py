"""The environment episode layer: action modes, tool loop, rewards, token masks; in-process, and
against OpenEnv environments written as OpenEnv's catalogue writes them, served over /ws and
in-process alike."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import AddedToken

from bridge.engines.base import SamplingParams
from bridge.envs.episode import (
    EnvRuntime, RenderError, as_function_tool, inline_refs, observation_text, resolve_action_mode,
    runtime_from_dict,
)
from bridge.envs.session import SessionConfig
from bridge.envs.spec import EnvConfigError, EnvSpec, RewardSpec
from bridge.rollout import ENV_VERSION, run_episode
from bridge.tool_calls import get_parser
from jaxrl.tiny_tokenizer import build_tokenizer
from scripted_engine import ScriptedEngine, guess_number_policy, segments, tool_call

PARAMS = SamplingParams(temperature=1.0, max_tokens=64, seed=0)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def run(engine, runtime, env, task, max_turns=8, budget=2048):
    async def go():
        await runtime.start()
        hook = runtime.hook(env, task)
        return await run_episode(engine, "g", 0, [], PARAMS, hook, env=env, max_turns=max_turns,
                                 max_total_tokens=budget)

    return asyncio.run(go())


def check_masks(traj, tok):
    assert len(traj.loss_mask) == len(traj.completion_ids) == len(traj.token_versions)
    for t, m, v, lp in zip(traj.completion_ids, traj.loss_mask, traj.token_versions, traj.sampler_logprobs):
        assert (v == ENV_VERSION) == (m == 0)
        if m == 0:
            assert lp == 0.0
    for m, ids in segments(traj):
        if m == 0:  # what the environment wrote ends by opening the model's next turn
            assert tok.decode(ids).endswith("<|im_start|>assistant\n")


# -- schemas and modes --------------------------------------------------------------------------


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


def test_observation_text_and_tool_specs():
    assert observation_text({"text": "hi", "reward": 1}) == "hi"
    assert observation_text({"board": [1, 2], "done": False}) == "board: [1, 2]"
    # Every field that says something, the text-like one first; empty ones and bookkeeping left out.
    assert observation_text({"x": 0, "y": 3, "message": "Keep going...", "hint": None, "log": [], "note": "",
                             "won": False, "metadata": {"a": 1}}) == "Keep going...\nx: 0\ny: 3\nwon: false"
    assert observation_text({"a": "x", "b": 3}, "b") == "3"
    assert observation_text({"x": 1, "y": 2, "message": "hi"}, template="({x}, {y}) {message}") == "(1, 2) hi"
    with pytest.raises(RenderError, match="'{z}'.*KeyError: 'z'"):
        observation_text({"x": 1}, template="{z}")
    tool = as_function_tool({"name": "add", "input_schema": schema({"a": {"type": "integer"}}, ["a"])})
    assert tool["function"]["parameters"]["required"] == ["a"] and tool["type"] == "function"


def test_references_are_inlined_with_their_siblings_and_recursion_stops():
    schema = {"$defs": {"Move": {"enum": ["UP", "DOWN"], "type": "string"},
                        "Tree": {"description": "a tree", "type": "object",
                                 "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/Tree"}}}}},
              "properties": {"move": {"$ref": "#/$defs/Move", "description": "where"}, "tree": {"$ref": "#/$defs/Tree"},
                             "definitions": {"type": "string"}}}
    assert inline_refs(schema) == {"properties": {
        "move": {"enum": ["UP", "DOWN"], "type": "string", "description": "where"},
        "tree": {"description": "a tree", "type": "object", "properties": {
            "kids": {"type": "array", "items": {"type": "object", "description": "a tree"}}}},
        "definitions": {"type": "string"}}}  # a field may be called "definitions"
    assert resolve_action_mode(EnvSpec("e", url="http://127.0.0.1:1"),
                               {"$defs": schema["$defs"], "properties": {"move": {"$ref": "#/$defs/Move"}},
                                "required": ["move"]}) == ("tool", None)  # an enum is not free text


@pytest.mark.parametrize("data, message", [
    ({"name": "x"}, "exactly one of bundled, url, env_class"),
    ({"name": "x", "url": "http://a", "bundled": "echo"}, "exactly one"),
    ({"name": "x", "url": "ftp://a"}, "must start with http"),
    ({"name": "x", "env_class": "nocolon"}, "module:Class"),
    ({"name": "x", "url": "http://a", "colour": 1}, "unknown key.*colour"),
    ({"name": "x", "url": "http://a", "session": {"step_timeout_s": -1}}, "session.*step_timeout_s"),
    ({"name": "x", "url": "http://a", "max_retries": 2}, "'x': max_retries is gone; set retry_budget_s instead"),
    ({"name": "x", "url": "http://a", "retry_backoff_s": 0}, "retry_backoff_s > 0"),
    ({"name": "x", "url": "http://a", "observation_template": "at {x"}, "'x': observation_template 'at {x'.*"
                                                                        "expected '}'"),
    ({"name": "x", "url": "http://a", "observation_template": "at {}"}, "{} names no field"),
    ({"name": "x", "url": "http://a", "observation_template": "{x}", "observation_field": "x"}, "not both"),
])
def test_env_spec_errors_name_the_problem(data, message):
    with pytest.raises(EnvConfigError, match=message):
        EnvSpec.from_dict(data)


def test_replays_are_bounded_by_time_since_the_first_loss_and_outlast_the_breaker_cooldown():
    spec = EnvSpec("x", url="http://a", retry_budget_s=60.0, retry_backoff_s=0.5,
                   session=SessionConfig(breaker_cooldown_s=5.0))
    for _ in range(50):  # jittered schedules: replay until the next wait would pass the budget
        lost_for, waits = 0.0, []
        while (wait := spec.retry_wait_s(len(waits), lost_for)) is not None:
            waits.append(wait)
            lost_for += wait
        assert 60.0 - 10.0 < lost_for <= 60.0  # the budget is spent, never overrun
        assert 0.25 <= waits[0] <= 0.5 and max(waits) <= 10.0  # doubling from 0.5 s, capped at 2 cooldowns
        assert min(waits[5:]) >= 5.0  # late replays land after the breaker half-opened
    assert 5.0 <= spec.retry_wait_s(10_000, 0.0) <= 10.0  # time, not a count, ends the replays
    assert spec.retry_wait_s(0, 59.8) is None
    assert EnvSpec("x", url="http://a", retry_budget_s=0).retry_wait_s(0, 0.0) is None


def test_runtime_errors_at_start_up(tok):
    with pytest.raises(EnvConfigError, match="cannot tell the Action class.*action_class"):
        runtime_from_dict({"envs": [{"name": "x", "env_class": "bridge.envs.bundled.echo:EchoEnvironment"}]}, tok)
    with pytest.raises(EnvConfigError, match="cannot import module 'no_such_module'"):
        runtime_from_dict({"envs": [{"name": "x", "env_class": "no_such_module:Env"}]}, tok)
    with pytest.raises(EnvConfigError, match="has no 'Nope'"):
        runtime_from_dict({"envs": [{"name": "x", "env_class": "test_episode:Nope"}]}, tok)
    with pytest.raises(EnvConfigError, match="unknown tool-call parser"):
        runtime_from_dict({"envs": [{"name": "x", "url": "http://127.0.0.1:1"}], "tool_parser": "gpt9"}, tok)
    with pytest.raises(EnvConfigError, match="lists no environments"):
        runtime_from_dict({"envs": []}, tok)
    with pytest.raises(EnvConfigError, match="reward function 'test_episode:missing'"):
        runtime_from_dict({"envs": [{"name": "x", "url": "http://127.0.0.1:1"}],
                           "rewards": [{"fn": "test_episode:missing"}]}, tok)


# -- an in-process openenv Environment ----------------------------------------------------------


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


# -- a tool-environment class -------------------------------------------------------------------


class Counter:
    """A TRL-style environment: tools are its documented public methods."""

    def reset(self, start: int = 0, **task) -> str:
        self.value, self.done = start, False
        return f"The counter is at {start}. Reach 3."

    def add(self, amount: int) -> str:
        """Adds to the counter.

        Args:
            amount: How much to add.
        """
        if amount < 0:
            raise ValueError("amount must be positive")
        self.value += amount
        self.done = self.value >= 3
        return f"counter = {self.value}"

    def reward(self) -> float:
        return 1.0 if self.value == 3 else 0.0


def over_two(completions, environments, start, **kwargs):
    return [None if s == 0 else float(env.value > 2) for env, s in zip(environments, start)]


def length_penalty(completions, environments, **kwargs):
    return [-len(c) / 1000 for c in completions]


def test_tool_class_episode_counts_errors_and_scores(tok):
    runtime = EnvRuntime(
        [EnvSpec("counter", env_class="test_episode:Counter")], tok, get_parser(),
        [RewardSpec("env"), RewardSpec("test_episode:over_two", 0.5), RewardSpec("test_episode:length_penalty")])
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


def test_tool_calls_are_parsed_when_the_tokenizer_marks_their_tags_special():
    tok = build_tokenizer()  # then marked special, as TRL's tiny test tokenizers have them
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("<tool_call>", "</tool_call>")],
                   special_tokens=True)
    ids = tok.encode(tool_call("add", {"amount": 1}), add_special_tokens=False)
    assert "<tool_call>" not in tok.decode(ids, skip_special_tokens=True)  # gone from such a decode
    runtime = EnvRuntime([EnvSpec("counter", env_class="test_episode:Counter")], tok, get_parser())
    replies = iter([tool_call("add", {"amount": 1}), tool_call("add", {"amount": 2})])
    traj = run(ScriptedEngine(tok, lambda prompt: next(replies)), runtime, "counter", {})
    assert traj.finish_reason == "env_done", traj.error
    assert traj.metrics == {"tool_calls": 2, "tool_errors": 0, "env_steps": 2} and traj.rewards == {"env": 1.0}
    check_masks(traj, tok)


def test_answer_without_tool_call_ends_the_episode(tok):
    runtime = EnvRuntime([EnvSpec("counter", env_class="test_episode:Counter")], tok, get_parser())
    traj = run(ScriptedEngine(tok, lambda prompt: "The answer is 3."), runtime, "counter", {})
    assert traj.finish_reason == "stop" and traj.num_turns == 1 and traj.rewards == {"env": 0.0}


def test_max_turns_and_budget_end_episodes(tok):
    runtime = EnvRuntime([EnvSpec("counter", env_class="test_episode:Counter")], tok, get_parser())
    traj = run(ScriptedEngine(tok, lambda prompt: tool_call("add", {"amount": 0})), runtime, "counter", {},
               max_turns=3)
    assert traj.finish_reason == "max_turns" and traj.num_turns == 3
    traj = run(ScriptedEngine(tok, lambda prompt: tool_call("add", {"amount": 0})), runtime, "counter", {},
               max_turns=50, budget=120)
    assert traj.finish_reason == "length" and len(traj.completion_ids) >= 120


@pytest.mark.parametrize("fn, message", [
    ("not_a_list", "returned 1.0; it must return a list with one value per completion"),
    ("two_values", "returned [1.0, 2.0]; it must return a list with one value per completion"),
    ("nan", "returned nan; rewards must be finite"),
    ("inf", "returned inf; rewards must be finite"),
    ("text", "returned '1.5' (str); rewards must be numbers or None"),
])
def test_a_reward_that_is_not_a_number_or_none_is_a_reward_error_naming_the_function(tok, fn, message):
    runtime = EnvRuntime([EnvSpec("counter", env_class="test_episode:Counter")], tok, get_parser(),
                         [RewardSpec(f"test_episode:{fn}")])
    traj = run(ScriptedEngine(tok, lambda prompt: "done"), runtime, "counter", {})
    assert traj.finish_reason == "error"
    assert traj.error.startswith(f"RewardError: reward function {fn!r} (test_episode:{fn}) for episode g/0 of "
                                 "'counter' "), traj.error
    assert message in traj.error


def test_an_environment_reward_that_is_not_a_number_is_a_reward_error(tok):
    runtime = EnvRuntime([EnvSpec("counter", env_class="test_episode:NanCounter")], tok, get_parser())
    traj = run(ScriptedEngine(tok, lambda prompt: "done"), runtime, "counter", {})
    assert traj.error == "RewardError: environment 'counter' (its reward()) returned nan; rewards must be finite " \
                         "(None: does not apply)"


class NanCounter(Counter):
    def reward(self) -> float:
        return float("nan")


def not_a_list(completions, environments, **kwargs):
    return 1.0


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
    runtime = EnvRuntime([EnvSpec(env, env_class="test_episode:Vault")], tok, get_parser(),
                         [RewardSpec("env"), RewardSpec("test_episode:opened_quickly")])
    replies = iter([tool_call("try_code", {"code": 1234}), tool_call("try_code", {"code": 4321}), "Opened."])
    SEEN_BY_REWARD.clear()
    traj = run(ScriptedEngine(tok, lambda prompt: next(replies)), runtime, env, task)
    assert traj.finish_reason == "stop", traj.error
    assert traj.prompt_ids == trl_first_prompt_ids(tok, Vault, row)
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
    assert seen["completion_ids"] == [traj.completion_ids]


# -- OpenEnv's catalogue as shipped: served over /ws, and in-process ------------------------------

CATALOGUE = Path(__file__).parent / "workers" / "openenv_catalogue.py"
CLASSES = {"grid": "tests.workers.openenv_catalogue:GridWorldEnvironment",
           "arithmetic": "tests.workers.openenv_catalogue:ArithmeticEnvironment",
           "nim": "tests.workers.openenv_catalogue:NimEnvironment"}
WHERE = ("served", "in_process")


@pytest.fixture(scope="module")
def catalogue():
    """One process serving each catalogue environment on its own port, as OpenEnv ships it: name -> url."""
    proc = subprocess.Popen([sys.executable, str(CATALOGUE), *CLASSES], stdout=subprocess.PIPE, text=True)
    try:
        urls = {}
        for _ in CLASSES:
            line = proc.stdout.readline()
            assert line.startswith("ENV_LISTENING "), line
            _, name, url = line.split()
            urls[name] = url
        yield urls
    finally:
        proc.terminate()
        proc.wait(10)


def catalogue_spec(urls, name, where, **keys):
    return EnvSpec(name, **({"url": urls[name]} if where == "served" else {"env_class": CLASSES[name]}), **keys)


def scripted(tok, replies):
    replies = iter(replies)
    return ScriptedEngine(tok, lambda prompt: next(replies))


def env_turns(traj, tok):
    return [tok.decode(ids) for m, ids in segments(traj) if m == 0]


@pytest.mark.parametrize("where", WHERE)
def test_a_rejected_text_action_reaches_the_model_as_an_error_and_observations_show_the_state(tok, catalogue, where):
    runtime = EnvRuntime([catalogue_spec(catalogue, "grid", where, action="text", text_field="action")], tok,
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
    for where in WHERE:
        runtime = EnvRuntime([catalogue_spec(catalogue, name, where)], tok, get_parser())
        trajs[where] = run(scripted(tok, SCRIPTS[name]), runtime, name, {"seed": 3})
    served, local = trajs["served"], trajs["in_process"]
    assert served.finish_reason == local.finish_reason == "env_done", (served.error, local.error)
    assert served.rewards == local.rewards == {"env": pytest.approx(reward)}
    assert tok.decode(served.prompt_ids) == tok.decode(local.prompt_ids)
    assert tok.decode(served.completion_ids) == tok.decode(local.completion_ids)
    assert served.metrics["tool_errors"] == local.metrics["tool_errors"] == 1
    prompt = tok.decode(served.prompt_ids)
    assert enum in prompt and "$ref" not in prompt and "$defs" not in prompt
    assert "Error:" in env_turns(served, tok)[0]


@pytest.mark.parametrize("where", WHERE)
def test_an_observation_template_is_checked_at_start_and_renders_the_fields(tok, catalogue, where):
    runtime = EnvRuntime([catalogue_spec(catalogue, "grid", where, action="text", text_field="action",
                                         observation_template="You are at ({x}, {y}). {message}")], tok, get_parser())
    traj = run(scripted(tok, ["DOWN"]), runtime, "grid", {}, max_turns=1)
    assert "You are at (0, 0). Welcome to Grid World! Goal is at [2, 2].<|im_end|>" in tok.decode(traj.prompt_ids)
    # An MCP server's observation schema is its tool results': the reset observation's fields are not checked.
    runtime = EnvRuntime([catalogue_spec(catalogue, "arithmetic", where, observation_template="Q: {question}")], tok,
                         get_parser())
    traj = run(scripted(tok, ["I give up."]), runtime, "arithmetic", {"seed": 3})
    assert "Q: Compute 5 * 6 + 5 with the tools.<|im_end|>" in tok.decode(traj.prompt_ids)
    runtime = EnvRuntime([catalogue_spec(catalogue, "grid", where, observation_template="At {x},{z}")], tok,
                         get_parser())
    with pytest.raises(EnvConfigError, match="'grid': observation_template names field 'z', which its observations "
                                             "do not have; they have: x, y, message$"):
        asyncio.run(runtime.start())


def test_a_one_session_server_queues_episodes_and_says_so_in_metrics(tok, catalogue, caplog):
    def play(spec, n=3):
        runtime = EnvRuntime([spec], tok, get_parser())
        engine = ScriptedEngine(tok, lambda prompt: tool_call("nim", {"take": 3}), delay_s=0.05)

        async def go():
            await runtime.start()
            try:
                return await asyncio.gather(*(run_episode(engine, f"g{i}", 0, [], PARAMS, runtime.hook("nim", {}),
                                                          env="nim", max_turns=4, max_total_tokens=2048)
                                              for i in range(n)))
            finally:
                await runtime.aclose()  # its sessions stay open for reuse until then, holding the server's slot

        trajs = asyncio.run(go())
        assert all(t.finish_reason == "env_done" and t.rewards == {"env": 1.0} for t in trajs), [t.error for t in trajs]
        return trajs, runtime.connectors["nim"].metrics

    with caplog.at_level(logging.WARNING, logger="bridge.envs.session"):
        trajs, stats = play(catalogue_spec(catalogue, "nim", "served"))  # the default pool: 64 sessions
    assert sum(t.metrics["capacity_refusals"] for t in trajs) > 0 and max(t.metrics["pool_wait_s"] for t in trajs) > 0
    assert stats["server_max_sessions"] == 1 and stats["capacity_waits"] > 0
    assert max(t.metrics.get("server_max_sessions", 0) for t in trajs) == 1  # for the trainer's warning
    warnings = [r.getMessage() for r in caplog.records if "allows 1 session(s) at once" in r.getMessage()]
    assert len(warnings) == 1 and "the session pool for it holds 64" in warnings[0]
    assert "set max_concurrent_envs: 1 for this environment" in warnings[0]
    trajs, stats = play(catalogue_spec(catalogue, "nim", "served", max_concurrent_envs=1))
    assert sum(t.metrics["pool_waits"] for t in trajs) == 2 and stats["capacity_waits"] == 0
