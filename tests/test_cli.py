"""The `jaxrl` console script, run as a user would."""

import json
import subprocess
import sys
from pathlib import Path

import yaml

from processes import error_line

ROOT = Path(__file__).resolve().parents[1]


def jaxrl(*args):
    return subprocess.run([sys.executable, "-m", "jaxrl.run.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_tiny_model_writes_a_model_directory(tmp_path):
    proc = jaxrl("tiny-model", tmp_path / "model", "--family", "llama")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "model" / "config.json").exists() and (tmp_path / "model" / "tokenizer.json").exists()


def test_config_prints_documented_defaults_and_resolves_files():
    defaults = jaxrl("config")
    assert defaults.returncode == 0, defaults.stderr
    assert "# training steps (one batch each)\nsteps: 100" in defaults.stdout
    lines = defaults.stdout.splitlines()
    undocumented = [line for before, line in zip(lines, lines[1:])  # "- " lines continue a list value
                    if not line.lstrip().startswith(("#", "- ")) and not before.lstrip().startswith("#")]
    assert undocumented == []  # every key has its help above it
    for derived in ("total_steps", "reward_weights"):  # set by the run, not user keys
        assert derived not in defaults.stdout
    resolved = jaxrl("config", "configs/tiny_cpu.yaml", "--set", "steps=7")
    assert resolved.returncode == 0, resolved.stderr
    cfg = yaml.safe_load(resolved.stdout)
    assert cfg["steps"] == 7 and cfg["envs"][0]["bundled"] and cfg["learner"]["group_size"] >= 2
    bad = jaxrl("config", "configs/tiny_cpu.yaml", "--set", "rollout.mode=fast")
    assert bad.returncode == 2 and "'sync', 'async'" in error_line(bad.stderr, "jaxrl config")


def test_eval_a_model_directory_against_a_bundled_environment(tmp_path):
    assert jaxrl("tiny-model", tmp_path / "model").returncode == 0
    proc = jaxrl("eval", tmp_path / "model", "--env", "guess_number", "--episodes", 4, "--max-turns", 2)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tasks"] == 4 and result["errors"] == 0 and "success (pass@1)" in proc.stdout
    bad = jaxrl("eval", tmp_path / "model", "--env", "chess")
    assert bad.returncode == 2 and "bundled environment" in error_line(bad.stderr, "jaxrl eval")
    missing = jaxrl("eval", tmp_path / "nothing", "--env", "echo")
    assert missing.returncode == 2 and "neither a run directory" in missing.stderr
    no_env = jaxrl("eval", tmp_path / "model")
    assert no_env.returncode == 2 and "a model directory needs --env" in no_env.stderr


def test_eval_of_a_run_that_published_no_weights_says_so_instead_of_evaluating_its_base_model(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"run_dir": str(run), "model": {"dir": "/models/base"},
                                                     "envs": [{"name": "echo", "bundled": "echo"}]}))
    proc = jaxrl("eval", run)
    assert proc.returncode == 2
    assert error_line(proc.stderr, "jaxrl eval") == (
        f"jaxrl eval: error: {run} has no snapshot (the run stopped before it published weights), so it has nothing trained to "
        "evaluate; evaluate the model it started from with `jaxrl eval /models/base --env ...`")


def test_env_prompt_prints_a_tasks_first_prompt_as_the_engine_gets_it(tmp_path):
    """A TRL-style class built with env_kwargs, on the rows of a dataset: the row's prompt with reset's text
    appended, its tool listed by the chat template; then the default config's bundled echo, over a limit."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "Play.", "target": "blue"}\n{"prompt": "Play.", "target": "red"}\n')
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"), "model": {"dir": str(tmp_path / "model"), "tiny": {}},
        "envs": [{"name": "target", "env_class": "tests.workers.trl_env:SizedTarget",
                  "env_kwargs": {"size": 5, "colour": "red"}}],
        "data": {"train_file": str(rows)}, "rollout": {"groups_per_step": 2}}))
    proc = jaxrl("env", "prompt", config, "--task", 1)
    assert proc.returncode == 0, proc.stderr
    *prompt, last = proc.stdout.rstrip("\n").split("\n")
    text = "\n".join(prompt)
    assert "<tools>" in text and '"name": "say"' in text  # the class's tool, as the template lists it
    head, fits = last.removeprefix("--- environment 'target', task 1 ").split("}: ", 1)
    task, tokens = json.loads(head + "}"), int(fits.split(" tokens")[0])
    assert task["prompt"] == "Play." and last.endswith(
        f"{tokens} tokens, rollout.max_prompt_tokens is null: a run sized by this prompt sets it to "
        f"{-(-(tokens * 5 // 4) // 64) * 64}")
    # The row the run's second group plays (rows are shuffled per epoch), its reset built with the env_kwargs.
    assert text.endswith(f"<|im_start|>user\nPlay.Say {task['target']}. (red, size 5)<|im_end|>\n"
                         "<|im_start|>assistant\n")

    echo = jaxrl("env", "prompt", "configs/tiny_cpu.yaml", "--set", f"model.dir={tmp_path / 'echo-model'}", "--set",
                 "rollout.max_prompt_tokens=8")
    assert echo.returncode == 0, echo.stderr
    assert echo.stdout.startswith("<|im_start|>user\nRepeat exactly: ")
    assert "tokens, over rollout.max_prompt_tokens (8): a step with such a prompt widens the learner's batch" in (
        echo.stdout.splitlines()[-1])  # the engine holds 8 + max_total_tokens 32 = 40: the prompt still fits
    held = jaxrl("env", "prompt", "configs/tiny_cpu.yaml", "--set", f"model.dir={tmp_path / 'echo-model'}", "--set",
                 "rollout.max_prompt_tokens=1", "--set", "rollout.max_tokens=2", "--set", "rollout.max_total_tokens=2")
    assert ("over rollout.max_prompt_tokens (1): the bridge a run starts holds 3 tokens per sequence (max_prompt_tokens "
            "+ max_total_tokens), so such an episode fails; raise rollout.max_prompt_tokens to at least") in (
        held.stdout.splitlines()[-1])
    bad = jaxrl("env", "prompt", config, "--task", -1)
    assert bad.returncode == 2 and "--task -1" in error_line(bad.stderr, "jaxrl env prompt")
