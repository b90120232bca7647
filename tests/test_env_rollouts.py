"""Episodes against real OpenEnv servers through the bridge: bundled environments with a tiny
model in a bridge process, an MCP and a test-only environment over the generic URL path, and
faults (a server killed mid-rollout, over capacity, frozen)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bridge.client import BridgeClient
from bridge.engines.base import SamplingParams
from bridge.envs.runtime import runtime_from_dict
from jaxrl.run.processes import EnvServerProcess
from jaxrl.run.processes import BridgeProcess
from bridge.server import serve
from bridge.wire import BridgeLaunch, PromptGroup
from jaxrl.tiny import build_tiny_model
from jaxrl.tiny_tokenizer import build_tokenizer
from env_servers import worker_server
from scripted_engine import TOKEN, ScriptedEngine, guess_number_policy, tool_call

WORKER = Path(__file__).parent / "workers" / "custom_env_server.py"


def check_trajectory(t, tok):
    """Loss mask 0 exactly on environment tokens (version -1, no logprob), 1 on the model's."""
    assert len(t.completion_ids) == len(t.loss_mask) == len(t.token_versions) == len(t.sampler_logprobs)
    model = t.loss_mask.astype(bool)
    assert np.all((t.token_versions == -1) == ~model)
    assert np.all(t.sampler_logprobs[~model] == 0.0)
    runs = np.flatnonzero(np.diff(np.r_[1, t.loss_mask]) == -1)  # starts of environment segments
    for start in runs:
        end = start + int(np.argmax(t.loss_mask[start:] == 1)) if t.loss_mask[start:].any() else len(t.loss_mask)
        text = tok.decode(t.completion_ids[start:end].tolist())
        assert "<|im_start|>" in text and text.endswith("<|im_start|>assistant\n"), text


def groups_for(env, n, split="train", **fields):
    return [PromptGroup(np.zeros(0, np.int32), f"{env}-{i}", env, {"seed": i, "split": split, **fields})
            for i in range(n)]


# -- bundled servers, a bridge process, a tiny model ---------------------------------------------


@pytest.fixture(scope="module")
def bundled_bridge(tmp_path_factory):
    root = tmp_path_factory.mktemp("bundled")
    model_dir = build_tiny_model(root / "model", "qwen3")
    servers = {name: EnvServerProcess.start(name, max_concurrent_envs=64) for name in ("echo", "wordle", "guess_number")}
    envs = {"envs": [{"name": n, "url": s.url} for n, s in servers.items()], "rewards": [{"fn": "env"}]}
    (root / "envs.json").write_text(json.dumps(envs))
    bridge = BridgeProcess.start(BridgeLaunch(model_dir, envs=root / "envs.json", max_batch=64))
    try:
        yield bridge, servers
    finally:
        bridge.stop()
        for s in servers.values():
            s.stop()


@pytest.mark.parametrize("env, max_turns", [("echo", 1), ("wordle", 3), ("guess_number", 4)])
def test_64_concurrent_episodes_per_bundled_environment(bundled_bridge, env, max_turns):
    bridge, _ = bundled_bridge
    tok = build_tokenizer()
    params = SamplingParams(temperature=1.0, max_tokens=24, stop_token_ids=(tok.eos_token_id,), seed=0,
                            max_turns=max_turns, max_total_tokens=512)
    start = time.perf_counter()
    trajs = list(bridge.client.rollout(groups_for(env, 16), 4, params))
    wall = time.perf_counter() - start
    assert len(trajs) == 64
    assert all(t.finish_reason != "error" for t in trajs), [t.error for t in trajs if t.error][:3]
    for t in trajs:
        check_trajectory(t, tok)
        assert t.env == env and "env" in t.rewards
        assert tok.decode(t.prompt_ids.tolist()).startswith("<|im_start|>")
    if env == "wordle":  # a random model's reply is an invalid guess: feedback, then another turn
        assert any((t.loss_mask == 0).any() for t in trajs)
        assert max(t.num_turns for t in trajs) == max_turns
    stats = bridge.client.stats()
    assert stats[f"env.{env}.sessions_active"] == 0  # every session closed, or released for reuse
    print(f"{env}: 64 episodes in {wall:.1f} s")


def test_bad_environment_config_fails_at_bridge_start_up(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model", "qwen3")
    for envs, message in [
        ([{"name": "x", "url": "http://127.0.0.1:9"}], "127.0.0.1:9"),
        ([{"name": "x", "env_class": "no_such_package.envs:Game"}], "cannot import module 'no_such_package.envs'"),
    ]:
        (tmp_path / "envs.json").write_text(json.dumps({"envs": envs}))
        proc = subprocess.run([sys.executable, "-m", "jaxrl.run.cli", "bridge", "--model", str(model_dir),
                               "--envs", str(tmp_path / "envs.json")], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "JAXRL_BRIDGE_TOKEN": "a-token"})
        assert proc.returncode == 2, proc.stderr
        assert "environment 'x'" in proc.stderr and message in proc.stderr
        assert "Traceback" not in proc.stderr and "JaxEngine" not in proc.stderr  # before any model loads


# -- the generic URL path: environments this project does not know -------------------------------


def custom_server(name: str, *args: str):
    return worker_server(str(WORKER), name, *args)


@contextlib.contextmanager
def bridge_thread(engine, runtime):
    ready, box = threading.Event(), {}

    def on_listening(address):
        box["address"] = address
        ready.set()

    thread = threading.Thread(target=lambda: asyncio.run(serve(
        engine, on_listening=on_listening, handle_signals=False, grace_s=1.0, envs=runtime, token=TOKEN)),
        daemon=True)
    thread.start()
    assert ready.wait(60), "bridge did not start"
    client = BridgeClient(box["address"], timeout_s=60, token=TOKEN)
    try:
        yield client
    finally:
        client.shutdown()
        thread.join(15)
        client.close()


def calculator_policy(prompt: str) -> str:
    import re

    x, y = map(int, re.search(r"Compute (\d+) \* (\d+)", prompt).groups())
    results = re.findall(r"<tool_response>\n(-?\d+)\n</tool_response>", prompt)
    if not results:
        return tool_call("multiply", {"a": x, "b": y})
    if len(results) == 1:
        return tool_call("add", {"a": int(results[0]), "b": x})
    return tool_call("answer", {"value": int(results[-1])})


def test_mcp_environment_tools_are_listed_and_called():
    tok = build_tokenizer()
    with custom_server("calculator") as (_, url):
        runtime = runtime_from_dict({"envs": [{"name": "calc", "url": url}]}, tok)
        with bridge_thread(ScriptedEngine(tok, calculator_policy), runtime) as client:
            params = SamplingParams(max_tokens=64, max_turns=5, max_total_tokens=1024)
            trajs = list(client.rollout([PromptGroup(np.zeros(0, np.int32), "g", "calc", {"seed": 3})], 4, params))
    assert runtime.connectors["calc"].mode == "mcp"
    for t in trajs:
        assert t.finish_reason == "env_done" and t.rewards == {"env": 1.0}, (t.error, t.rewards)
        assert t.metrics["tool_calls"] == 3 and t.metrics["tool_errors"] == 0
        prompt = tok.decode(t.prompt_ids.tolist())
        assert '"name": "multiply"' in prompt  # listed from the server, shown in the system turn
        check_trajectory(t, tok)


def test_test_only_text_environment_through_the_url_path():
    tok = build_tokenizer()

    def reverse_policy(prompt: str) -> str:
        import re

        return re.search(r"Write the word '(\w+)' backwards", prompt).group(1)[::-1]

    with custom_server("reverse") as (_, url):
        runtime = runtime_from_dict({"envs": [{"name": "rev", "url": url}]}, tok)
        with bridge_thread(ScriptedEngine(tok, reverse_policy), runtime) as client:
            trajs = list(client.rollout([PromptGroup(np.zeros(0, np.int32), "g", "rev", {"seed": 1})], 8,
                                        SamplingParams(max_tokens=16, max_turns=2, max_total_tokens=64)))
    assert runtime.connectors["rev"].mode == "text" and runtime.connectors["rev"].text_field == "answer"
    assert all(t.rewards == {"env": 1.0} for t in trajs)


# -- faults ------------------------------------------------------------------------------------------


def fault_runtime(tok, url, retry_budget_s=4.0, **session):
    spec = {"name": "guess", "url": url, "retry_budget_s": retry_budget_s, "retry_backoff_s": 0.5,
            "session": {"connect_timeout_s": 2.0, "step_timeout_s": 2.0, "breaker_failures": 3,
                        "breaker_window_s": 30.0, "breaker_cooldown_s": 1.0, **session}}
    return runtime_from_dict({"envs": [spec]}, tok)


def test_server_killed_mid_rollout_episodes_are_replayed_on_fresh_sessions():
    tok = build_tokenizer()
    server = EnvServerProcess.start("guess_number", max_concurrent_envs=64)
    port = server.port
    runtime = fault_runtime(tok, server.url, retry_budget_s=60.0)  # spans a restart
    engine = ScriptedEngine(tok, guess_number_policy, delay_s=0.3)  # episodes span several seconds
    replacement = None
    try:
        with bridge_thread(engine, runtime) as client:
            result = {}

            def rollout():
                result["trajs"] = list(client.rollout(groups_for("guess", 8), 4, SamplingParams(
                    max_tokens=64, max_turns=10, max_total_tokens=2048)))

            thread = threading.Thread(target=rollout)
            thread.start()
            deadline = time.monotonic() + 120
            while engine.calls < 32:  # turns under way: sessions open mid-episode, however slow the machine
                assert thread.is_alive() and time.monotonic() < deadline, "the episodes never started"
                time.sleep(0.01)
            os.kill(server.pid, signal.SIGKILL)  # fault: every open session drops mid-episode
            server.stop()
            replacement = EnvServerProcess.start("guess_number", port=port, max_concurrent_envs=64)
            thread.join(120)
            stats = client.stats()
    finally:
        if replacement is not None:
            replacement.stop()
        server.stop()
    trajs = result["trajs"]
    assert len(trajs) == 32
    retried = [t for t in trajs if t.metrics.get("retries", 0) > 0]
    print(f"killed 1 server with 32 episodes in flight: {len(retried)} retried, "
          f"{stats['episodes_dropped']:.0f} dropped")
    assert retried and stats["episodes_retried"] >= len(retried)
    assert stats["episodes_dropped"] == 0
    for t in trajs:  # replayed from reset: each trajectory is one clean episode
        assert t.finish_reason == "env_done" and t.rewards == {"env": 1.0}, t.error
        check_trajectory(t, tok)


def test_over_capacity_backs_off_instead_of_failing():
    tok = build_tokenizer()
    with EnvServerProcess.start("guess_number", max_concurrent_envs=2) as server:
        runtime = fault_runtime(tok, server.url)
        with bridge_thread(ScriptedEngine(tok, guess_number_policy), runtime) as client:
            trajs = list(client.rollout(groups_for("guess", 4), 4,
                                        SamplingParams(max_tokens=64, max_turns=10, max_total_tokens=2048)))
            stats = client.stats()
    assert len(trajs) == 16 and all(t.rewards == {"env": 1.0} for t in trajs)
    assert stats["env.guess.capacity_waits"] > 0 and stats["episodes_retried"] == 0


def test_frozen_server_times_out_opens_the_breaker_and_recovers():
    tok = build_tokenizer()
    with EnvServerProcess.start("guess_number", max_concurrent_envs=64) as server:
        runtime = fault_runtime(tok, server.url, step_timeout_s=1.0, connect_timeout_s=1.0)
        endpoint = runtime.connectors["guess"].endpoint
        with bridge_thread(ScriptedEngine(tok, guess_number_policy), runtime) as client:
            params = SamplingParams(max_tokens=64, max_turns=10, max_total_tokens=2048)
            os.kill(server.pid, signal.SIGSTOP)  # fault: the server hangs
            try:
                start = time.perf_counter()
                frozen = list(client.rollout(groups_for("guess", 2), 2, params))
                waited = time.perf_counter() - start
                assert endpoint.metrics["breaker_opens"] >= 1
            finally:
                os.kill(server.pid, signal.SIGCONT)
            time.sleep(1.5)  # the cooldown: the breaker half-opens and the next session closes it
            after = list(client.rollout(groups_for("guess", 2), 2, params))
            stats = client.stats()
    print(f"frozen server: {len(frozen)} episodes dropped after {waited:.1f} s; breaker opened "
          f"{endpoint.metrics['breaker_opens']:.0f}x, then {len(after)} episodes succeeded")
    assert all(t.finish_reason == "error" and "retry_budget_s=4)" in t.error for t in frozen)
    assert all(t.metrics["retries"] >= 2 for t in frozen)  # replayed while the breaker decided
    assert waited < 60  # timeouts and the breaker end it; nothing hangs
    assert stats["episodes_dropped"] == 4
    assert all(t.rewards == {"env": 1.0} for t in after) and endpoint.breaker_state == "closed"


def test_episode_timeout_ends_a_slow_episode_as_an_error():
    tok = build_tokenizer()
    runtime = runtime_from_dict({"envs": [{
        "name": "guess", "env_class": "bridge.envs.bundled.guess_number:GuessNumberEnvironment",
        "action_class": "bridge.envs.bundled.guess_number:GuessNumberAction", "episode_timeout_s": 1.0}]}, tok)
    with bridge_thread(ScriptedEngine(tok, guess_number_policy, delay_s=0.4), runtime) as client:
        start = time.perf_counter()
        trajs = list(client.rollout(groups_for("guess", 2), 2,
                                    SamplingParams(max_tokens=64, max_turns=10, max_total_tokens=2048)))
        stats = client.stats()
    assert time.perf_counter() - start < 10
    assert all(t.finish_reason == "error" and "episode_timeout_s=1" in t.error for t in trajs)
    assert stats["episodes_timed_out"] == 4
