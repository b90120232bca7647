"""What `jaxrl train` starts its bridge with: its launch (engine arguments, limits), token, and the
keys of its harness environments."""

from pathlib import Path

import pytest

from bridge.wire import TOKEN_ENV, BridgeLaunch, Limits, ServerSpec
from jaxrl.run.config import TrainConfig
from jaxrl.run.services import (StartupError, bridge_launch, bridge_limits, bridge_token, check_services,
                                engine_kwargs, harness_key)
from jaxrl.run.typed_config import from_dict
from env_servers import echo  # noqa: F401 (fixture)

BASE = {"run_dir": "r", "model": {"dir": "m"}, "envs": [{"name": "echo", "bundled": "echo"}]}


def test_a_started_jax_engine_holds_the_rollouts_sequences_and_compiles_before_serving():
    cfg = from_dict(TrainConfig, {**BASE, "rollout": {"max_prompt_tokens": 300, "max_total_tokens": 200,
                                                      "max_tokens": 50}})
    assert engine_kwargs(cfg) == {"max_seq_len": 500, "warm_up": True}
    own = from_dict(TrainConfig, {**BASE, "bridge": {"engine_kwargs": {"max_seq_len": 4096, "prefill_chunk": 128}}})
    assert engine_kwargs(own) == {"max_seq_len": 4096, "prefill_chunk": 128, "warm_up": True}
    vllm = from_dict(TrainConfig, {**BASE, "bridge": {"engine": "vllm", "engine_kwargs": {"gpu_memory_utilization": 0.5}}})
    assert engine_kwargs(vllm) == {"gpu_memory_utilization": 0.5}


def test_the_run_asks_its_bridges_for_what_its_requests_need():
    cfg = from_dict(TrainConfig, {**BASE, "rollout": {"groups_per_step": 8, "max_tokens": 50, "max_total_tokens": 200},
                                  "learner": {"group_size": 4}, "eval": {"episodes": 20, "pass_k": 3, "temperature": 1.0}})
    assert bridge_limits(cfg) == {"max_group_size": 4, "max_groups": 20, "max_episode_tokens": 200,
                                  "max_episodes_in_flight": 8 * 4 + 20 * 3}
    warm = from_dict(TrainConfig, {**BASE, "eval": {"episodes": 0}, "sft": {"steps": 1, "demonstrations": 100}})
    assert bridge_limits(warm) == {"max_group_size": 8, "max_groups": 100, "max_episode_tokens": 256,
                                   "max_episodes_in_flight": 8 * 8 + 100}
    Limits(**bridge_limits(warm))  # what the started bridge's flags accept


def test_the_runs_bridges_are_launched_with_its_model_environments_engine_snapshots_and_limits():
    cfg = from_dict(TrainConfig, {**BASE, "seed": 7, "rollout": {"groups_per_step": 3, "max_prompt_tokens": 256},
                                  "learner": {"group_size": 4},
                                  "bridge": {"engine_kwargs": {"prefill_chunk": 128}}})
    launch = bridge_launch(cfg, Path("model"), Path("logs/bridge_envs.json"), Path("run/snapshots"))
    server = ServerSpec(snapshot_roots=["run/snapshots"], limits=Limits(**bridge_limits(cfg)))
    assert launch == BridgeLaunch("model", max_batch=16, seed=7, engine_kwargs=engine_kwargs(cfg),
                                  envs="logs/bridge_envs.json", server=server)
    assert bridge_launch(cfg, Path("model"), Path("envs.json"), None).server.snapshot_roots == ()
    pinned = from_dict(TrainConfig, {**BASE, "rollout": {"max_prompt_tokens": 256}, "bridge": {"cpus": [0]}})
    assert bridge_launch(pinned, Path("model"), Path("envs.json"), None).cpus == (0,)


def test_the_bridges_token_is_the_runs_own_or_the_running_bridges(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    own = from_dict(TrainConfig, BASE)
    assert len(bridge_token(own)) >= 32 and bridge_token(own) != bridge_token(own)
    running = {**BASE, "bridge": {"addresses": ["127.0.0.1:9"]}}
    with pytest.raises(StartupError, match="the bridges' token is needed; set bridge.token_file"):
        bridge_token(from_dict(TrainConfig, running))
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment")
    assert bridge_token(from_dict(TrainConfig, running)) == "from-the-environment"
    (tmp_path / "token").write_text("from-the-file\n")
    with_file = {**running, "bridge": {**running["bridge"], "token_file": str(tmp_path / "token")}}
    with pytest.raises(StartupError, match=f"the bridge token file {tmp_path / 'token'} is readable by every user; "
                                           f"make it its owner's only \\(chmod 600"):
        bridge_token(from_dict(TrainConfig, with_file))
    (tmp_path / "token").chmod(0o600)
    assert bridge_token(from_dict(TrainConfig, with_file)) == "from-the-file"
    (tmp_path / "token").write_text("  \n")
    with pytest.raises(StartupError, match=f"bridge.token_file: the bridge token file {tmp_path / 'token'} is empty"):
        bridge_token(from_dict(TrainConfig, with_file))


def test_a_harness_environment_without_a_key_file_gets_a_fresh_key_each_run_and_a_line_saying_where(tmp_path):
    import io

    cfg = from_dict(TrainConfig, {**BASE, "envs": [{"name": "agent", "harness": "http://127.0.0.1:9",
                                                    "harness_port": 9100}]})
    keys, out = tmp_path / "run" / "logs" / "harness", io.StringIO()
    spec = harness_key(cfg.envs[0], keys, out)
    key_file = keys / "agent.key"
    assert spec.harness_api_key_file == str(key_file) and key_file.stat().st_mode & 0o777 == 0o600
    assert out.getvalue() == (f"jaxrl: environment 'agent': give its harness the key in {key_file} as its API key "
                              f"(e.g. OPENAI_API_KEY=$(cat {key_file})); a new one each run (set harness_api_key_file "
                              "to keep one)\n")
    first = key_file.read_text()
    harness_key(cfg.envs[0], keys, io.StringIO())  # the next run
    assert key_file.read_text() != first and len(key_file.read_text().strip()) >= 32
    (tmp_path / "taken").write_text("")
    with pytest.raises(StartupError, match=r"^environment 'agent': harness_api_key_file: cannot write this run's key "
                                           r"to .*agent.key \(.*\); make .* writable, or set harness_api_key_file$"):
        harness_key(cfg.envs[0], tmp_path / "taken" / "harness", io.StringIO())


def test_the_bridges_a_run_starts_are_handed_its_harness_keys(tmp_path, monkeypatch, capfd):
    import contextlib
    import json

    from jaxrl.run import services

    class NoBridges(contextlib.AbstractContextManager):  # what the bridges would be started with is all this needs
        def __exit__(self, *exc):
            return None

        def start(self, kwargs):
            return []

    monkeypatch.setattr(services, "BridgeProcesses", NoBridges)
    cfg = from_dict(TrainConfig, {**BASE, "envs": [{"name": "agent", "harness": "http://127.0.0.1:9",
                                                    "harness_port": 9100}],
                                  "rollout": {"max_prompt_tokens": 64}})
    with contextlib.ExitStack() as stack:
        services.start_services(cfg, tmp_path / "model", tmp_path / "logs", stack, "token")
    [env] = json.loads((tmp_path / "logs" / "bridge_envs.json").read_text())["envs"]
    assert env["harness_api_key_file"] == str(tmp_path / "logs" / "harness" / "agent.key")
    assert f"give its harness the key in {env['harness_api_key_file']}" in capfd.readouterr().err


def test_an_environment_that_cannot_start_is_named_once():
    cfg = from_dict(TrainConfig, {**BASE, "envs": [{"name": "echo_env", "env_class": "no_such_module:Env"}]})
    with pytest.raises(StartupError) as e:
        check_services(cfg)
    assert str(e.value).startswith("environment 'echo_env': env_class 'no_such_module:Env': cannot import module")
    assert str(e.value).count("echo_env") == 1
    cfg = from_dict(TrainConfig, {**BASE, "envs": [{"name": "echo_env", "url": "http://127.0.0.1:9"}]})
    with pytest.raises(StartupError, match=r"^environment 'echo_env': GET http://127.0.0.1:9/health failed"):
        check_services(cfg)
    cfg = from_dict(TrainConfig, {**BASE, "envs": [{"name": "agent", "harness": "http://127.0.0.1:9",
                                                    "harness_port": 9100}]})
    with pytest.raises(StartupError, match=r"^environment 'agent': GET http://127.0.0.1:9/health failed"):
        check_services(cfg)


def test_a_server_url_with_a_trailing_slash_is_the_same_server(echo):
    cfg = from_dict(TrainConfig, {**BASE, "envs": [{"name": "echo", "url": echo.url + "/"}]})
    assert cfg.envs[0].url == echo.url
    check_services(cfg)  # GET {url}/health, not {url}//health
