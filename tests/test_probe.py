"""The run's environment checks as the bridge runs them: a reset of an in-process environment on a task,
the first prompt an episode hands the engine, and `python -m bridge env probe`, which the trainer runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.envs.probe import first_prompt_ids, probe
from bridge.envs.spec import EnvConfigError
from jaxrl.tiny import build_tiny_model
from jaxrl.tiny_tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
VAULT = {"name": "vault", "env_class": "test_scoring:Vault"}  # reset(**row) reads the row's code


@pytest.mark.parametrize("entry, message", [
    ({"harness": "http://127.0.0.1:9", "harness_port": 9}, "'agent' is a harness environment: its harness builds"),
    ({"rollout_fn": "test_rollout_fn:answer_then_revise"}, "'agent' is a rollout_fn environment: its function"),
])
def test_an_environment_that_renders_its_own_prompts_has_no_first_prompt_to_show(entry, message):
    with pytest.raises(EnvConfigError, match=message):
        first_prompt_ids({"envs": [{"name": "agent", **entry}]}, build_tokenizer(), "agent", {"seed": 0})


def test_a_probe_resets_renders_and_says_which_task_an_environment_refuses():
    envs = {"envs": [VAULT, {"name": "agent", "rollout_fn": "test_rollout_fn:answer_then_revise"}]}
    good, refused, prompt, own = probe(envs, [
        {"env": "vault", "task": {"code": 7}, "what": "first training task"},
        {"env": "vault", "task": {"seed": 3}, "what": "held-out task"},
        {"env": "vault", "task": {"code": 7}, "what": "first training task", "prompt": True},
        {"env": "agent", "task": {"seed": 0}, "what": "first training task", "prompt": True}], build_tokenizer())
    assert good == {}
    assert refused["refused"].startswith("environment 'vault' cannot take its held-out task {'seed': 3}: KeyError")
    assert len(prompt["prompt_ids"]) > 10
    assert own == {"error": "environment 'agent' is a rollout_fn environment: its function builds its own prompts"}


def test_the_bridges_probe_command_prints_its_results_as_one_json_line(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    (tmp_path / "envs.json").write_text(json.dumps({"envs": [VAULT]}))
    (tmp_path / "items.json").write_text(json.dumps([{"env": "vault", "task": {"code": 7}, "what": "t",
                                                      "prompt": True}]))
    proc = subprocess.run([sys.executable, "-m", "bridge", "env", "probe", "--envs", str(tmp_path / "envs.json"),
                           "--items", str(tmp_path / "items.json"), "--model", str(model)],
                          capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}",
                                                                           "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    [result] = json.loads(proc.stdout.strip().splitlines()[-1])["results"]
    assert len(result["prompt_ids"]) > 10
    bad = subprocess.run([sys.executable, "-m", "bridge", "env", "probe", "--envs", str(tmp_path / "none.json"),
                          "--items", str(tmp_path / "items.json")], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("jaxrl env probe: error: cannot read")
