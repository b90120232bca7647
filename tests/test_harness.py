"""The `harness` environment kind against a real OpenEnv server serving a scripted harness on its
`WS /harness` route (tests/workers/harness_server.py, started here): episodes assembled from the
harness's model calls, token for token, with the environment's reward; a reply the harness cannot
use is an error turn for the model; and one `jaxrl train` step through it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import websockets

from bridge.engines.base import PromptTooLong, SamplingParams
from bridge.envs import harness
from bridge.envs.harness import HarnessConnector, HarnessError, env_reward
from bridge.envs.rollout_fn import run_rollout_fn
from bridge.envs.spec import EnvConfigError, EnvSpec
from bridge.tool_calls import get_parser
from bridge.wire import token_file
from jaxrl.tiny_tokenizer import build_tokenizer
from env_servers import worker_server
from scripted_engine import ScriptedEngine, segments

TOK = build_tokenizer()
PARAMS = SamplingParams(max_tokens=16, stop_token_ids=(TOK.eos_token_id,), seed=5, max_total_tokens=200)
WORKER = Path(__file__).parent / "workers" / "harness_server.py"
ROOT = Path(__file__).parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def harness_server(llm_port: int, key_file: Path | None):
    """The harness server, its agent given the key in `key_file` as a user gives one: $OPENAI_API_KEY."""
    env = {"OPENAI_API_KEY": token_file(key_file)[0]} if key_file is not None else {"OPENAI_API_KEY": ""}
    with worker_server(str(WORKER), "--llm-port", str(llm_port), env=env) as (_, url):
        yield url


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port, key_file = free_port(), tmp_path_factory.mktemp("harness") / "agent.key"
    with harness_server(port, key_file) as url:
        yield url, port, key_file


async def episode(server, policy, message="Pick a digit.", seed=0, engine=ScriptedEngine):
    url, port, key_file = server
    spec = EnvSpec(name="agent", harness=url, harness_port=port, harness_message="{text}",
                   harness_api_key_file=str(key_file))
    connector = HarnessConnector(spec, get_parser())
    await connector.start()
    try:
        return await run_rollout_fn(connector.fn, connector.label, engine(TOK, policy), TOK, "g", 0,
                                    "agent", {"text": message, "seed": seed}, PARAMS)
    finally:
        await connector.aclose()


def play(server, policy, **kwargs):
    return asyncio.run(episode(server, policy, **kwargs))


def test_an_episode_is_the_harnesss_calls_token_for_token_with_the_environments_reward(server):
    # The first reply is one the harness cannot use: it says so to the model (an error turn) and asks again.
    t = play(server, lambda p: "ANSWER: 7" if "answer again" in p else "no idea")
    assert not t.error and t.finish_reason == "stop" and t.num_turns == 2
    assert t.rewards == {"env": 1.0} and t.metrics["action_errors"] == 1.0
    (m1, first), (m0, feedback), (m2, second) = segments(t)
    assert (m1, m0, m2) == (1, 0, 1)
    eos = TOK.eos_token_id
    assert first == TOK.encode("no idea", add_special_tokens=False) + [eos]  # as the engine sampled them
    assert second == TOK.encode("ANSWER: 7", add_special_tokens=False) + [eos]
    assert "no 'ANSWER: <digit>'; answer again" in TOK.decode(feedback)
    assert "Pick a digit." in TOK.decode(t.prompt_ids.tolist())
    assert list(t.sampler_logprobs[t.loss_mask == 1]) == [-0.5] * (len(first) + len(second))
    assert (t.sampler_logprobs[t.loss_mask == 0] == 0).all()


def test_a_session_the_server_has_not_freed_yet_is_waited_for(server, monkeypatch):
    # The server frees a session after its socket has closed: the next episode can find it still taken
    # (under load, most of a group's episodes did). Here another client holds it until the first refusal.
    refusals = []

    def noted(attempt, first_s, max_s):
        refusals.append(attempt)
        return 0.01

    monkeypatch.setattr(harness, "backoff_s", noted)

    async def held_then_freed():
        async with websockets.connect(server[0].replace("http", "ws", 1) + "/harness") as held:
            assert json.loads(await held.recv())["type"] == "session_started"
            playing = asyncio.create_task(episode(server, lambda p: "ANSWER: 7"))
            while not refusals and not playing.done():
                await asyncio.sleep(0.01)
        return await playing

    t = asyncio.run(held_then_freed())
    assert refusals and not t.error and t.rewards == {"env": 1.0}


def test_a_harness_that_never_gets_an_answer_still_ends_with_its_reward(server):
    t = play(server, lambda p: "12 apples")
    assert not t.error and t.num_turns == 3 and t.metrics["action_errors"] == 3.0
    assert t.rewards["env"] == pytest.approx(2 / len("12 apples"))


def test_a_harness_that_rewrites_its_history_ends_the_episode_saying_so(server):
    t = play(server, lambda p: "nothing", message="Pick a digit, rewrite history.")
    assert t.finish_reason == "error"
    assert "model call 2 does not continue the conversation of the call before it" in t.error


def test_a_call_the_endpoint_refused_is_named_in_the_episodes_error(server):
    class Small(ScriptedEngine):
        async def generate(self, prompts, params):
            raise PromptTooLong(0, len(prompts[0]), 16)

    t = play(server, str, engine=Small)
    assert t.finish_reason == "error" and "failed the turn: harness turn failed; the chat endpoint had refused " \
        "its call: prompt 0 has" in t.error and "but the engine holds 16 tokens per sequence" in t.error


def test_a_task_without_the_messages_field_names_it():
    spec = EnvSpec(name="agent", harness="http://127.0.0.1:1", harness_port=1, harness_message="{question}")
    with pytest.raises(HarnessError, match=r"names 'question', which the task lacks \(its fields: seed\)"):
        HarnessConnector(spec, get_parser()).message({"seed": 3})


def test_a_server_without_a_harness_route_ends_the_episode_as_an_error(tmp_path):
    from jaxrl.run.processes import EnvServerProcess

    with EnvServerProcess.start("echo", max_concurrent_envs=2) as echo:
        t = play((echo.url, free_port(), tmp_path / "agent.key"), lambda p: "hi")
    assert t.finish_reason == "error" and "InvalidStatus" in t.error


def test_a_harness_without_the_key_gets_nothing_generated_and_the_bridges_log_says_why(tmp_path, caplog):
    port = free_port()
    with harness_server(port, None) as url:
        t = play((url, port, tmp_path / "agent.key"), lambda p: "ANSWER: 7")
    assert t.finish_reason == "error" and "the harness at" in t.error and "failed the turn" in t.error
    assert "refused its call" not in t.error  # a call without the key is no episode's
    assert any("refused POST /v1/chat/completions: the call carried no key" in r.message for r in caplog.records)


def test_a_key_file_others_can_read_is_refused_in_one_line(tmp_path):
    (tmp_path / "agent.key").write_text("a-key")
    (tmp_path / "agent.key").chmod(0o644)
    spec = EnvSpec(name="agent", harness="http://127.0.0.1:1", harness_port=free_port(),
                   harness_api_key_file=str(tmp_path / "agent.key"))
    with pytest.raises(EnvConfigError, match=r"^environment 'agent': harness_api_key_file .*agent.key is readable by "
                                             r"every user; make it its owner's only \(chmod 600"):
        asyncio.run(HarnessConnector(spec, get_parser()).start())


def test_a_missing_key_file_is_written_with_a_fresh_key_for_its_owner_only(tmp_path, caplog):
    key_file = tmp_path / "agent.key"
    spec = EnvSpec(name="agent", harness="http://127.0.0.1:1", harness_port=free_port(),
                   harness_api_key_file=str(key_file))

    async def started():
        connector = HarnessConnector(spec, get_parser())
        await connector.start()
        await connector.aclose()

    asyncio.run(started())
    assert key_file.stat().st_mode & 0o777 == 0o600 and len(key_file.read_text().strip()) >= 32
    assert f"wrote a new key to {key_file}; give it to the harness as its API key" in caplog.text
    key = key_file.read_text()
    asyncio.run(started())  # the second start keeps the key the harness was given
    assert key_file.read_text() == key


def test_a_harness_environment_without_a_key_file_is_refused_at_start():
    spec = EnvSpec(name="agent", harness="http://127.0.0.1:1", harness_port=free_port())
    with pytest.raises(EnvConfigError, match="^environment 'agent': harness_api_key_file is not set: the endpoint its "
                                             "harness calls needs a key"):
        asyncio.run(HarnessConnector(spec, get_parser()).start())


@pytest.mark.parametrize("events, reward", [
    ([{"type": "turn_complete", "data": {"reward": 0.5}}], 0.5),
    ([{"type": "tool_result", "data": {"result": {"reward": 2}}}, {"type": "turn_complete", "data": {}}], 2.0),
    ([{"type": "turn_complete", "data": {"response": "done"}}], None),
])
def test_the_reward_is_read_where_openenv_puts_it(events, reward):
    assert env_reward(events) == reward


def test_a_reward_that_is_not_a_number_names_it():
    with pytest.raises(HarnessError, match="reported reward 'high', not a number"):
        env_reward([{"type": "turn_complete", "data": {"reward": "high"}}])


def test_one_training_step_through_a_real_harness_route(tmp_path):
    import yaml
    from jaxrl.run.tracking import read_metrics
    from jaxrl.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny", "qwen3")
    port, key_file = free_port(), tmp_path / "agent.key"
    with harness_server(port, key_file) as url:
        config = tmp_path / "c.yaml"
        config.write_text(yaml.safe_dump({
            "run_dir": str(tmp_path / "run"), "model": {"dir": str(model_dir)},
            "envs": [{"name": "agent", "harness": url, "harness_port": port, "harness_api_key_file": str(key_file),
                      "harness_message": "Pick a digit ({seed})."}],
            "steps": 1,
            "rollout": {"groups_per_step": 2, "max_tokens": 8, "max_total_tokens": 96, "max_prompt_tokens": 96},
            "learner": {"group_size": 4, "optimizer": {"learning_rate": 1e-3}},
            "eval": {"episodes": 0}, "log": {"progress": False},
        }))
        proc = subprocess.run([sys.executable, "-m", "jaxrl.run.cli", "train", str(config)], capture_output=True,
                              text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 1
    [row] = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    # the untrained model never writes "ANSWER: <digit>": the harness tells it so, and the episode goes on
    assert row["step"] == 1 and row["completion/turns"] > 1 and row["env/agent/action_errors"] >= 1
