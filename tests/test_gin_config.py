"""gin files and --gin bindings: the same typed config as YAML, the same one-line errors."""

from __future__ import annotations

import pytest

from jaxrl.run.config import TrainConfig, load_config
from jaxrl.run.gin_config import gin_key, gin_overrides, section_paths
from jaxrl.run.typed_config import ConfigError, to_dict


def test_every_section_class_has_one_place():
    paths = section_paths(TrainConfig)
    assert paths["TrainConfig"] == "" and paths["OptimizerConfig"] == "learner.optimizer"
    assert paths["TinyModelConfig"] == "model.tiny" and None not in paths.values()


def test_the_tiny_config_in_gin_resolves_to_the_yaml_one():
    assert to_dict(load_config("configs/tiny_cpu.gin")) == to_dict(load_config("configs/tiny_cpu.yaml"))


def test_bindings_macros_and_overrides_in_order(tmp_path):
    path = tmp_path / "run.gin"
    path.write_text("LR = 3e-4\nOptimizerConfig.learning_rate = %LR\nTrainConfig.run_dir = 'r'\n"
                    "TrainConfig.envs = [{'name': 'echo', 'bundled': 'echo'}]\n"
                    "TrainConfig.model = {'dir': 'm', 'tiny': {'hidden_size': 32}}\nTinyModelConfig.num_layers = 1\n")
    cfg = load_config(path, ["steps=7"], ["TrainConfig.steps = 5", "LossConfig.eps_high = 0.3"])
    assert cfg.learner.optimizer.learning_rate == 3e-4 and cfg.steps == 7 and cfg.learner.loss.eps_high == 0.3
    # A section set whole and one of its keys bound alone: the key wins, whatever the order in the file.
    assert (cfg.model.tiny.hidden_size, cfg.model.tiny.num_layers) == (32, 1)
    # --gin on a YAML config, macros included.
    cfg = load_config("configs/tiny_cpu.yaml", gin_bindings=["LR = 2e-5", "OptimizerConfig.learning_rate = %LR"])
    assert cfg.learner.optimizer.learning_rate == 2e-5
    assert gin_overrides([], ["jaxrl.SFTConfig.steps = 0"], TrainConfig) == [("sft.steps", 0)]


def test_sweep_keys_in_gin_form():
    assert gin_key("OptimizerConfig.learning_rate", TrainConfig) == "learner.optimizer.learning_rate"
    assert gin_key("TrainConfig.steps", TrainConfig) == "steps"
    assert gin_key("learner.group_size", TrainConfig) == "learner.group_size"


@pytest.mark.parametrize("binding,message", [
    ("OptimizerConfig.learning_rat = 1e-5",
     r"^gin binding 'OptimizerConfig\.learning_rat': OptimizerConfig \(config section 'learner\.optimizer'\) has no "
     r"key 'learning_rat' \(did you mean 'OptimizerConfig\.learning_rate'\? its keys: learning_rate, .*\)$"),
    ("OptimizrConfig.learning_rate = 1e-5",
     r"^gin: unknown config class 'OptimizrConfig' \(did you mean 'OptimizerConfig'\? config classes: TrainConfig, "
     r".*\) \(--gin 'OptimizrConfig\.learning_rate = 1e-5'\)$"),
    ("OptimizerConfig.learning_rate = 'fast'",
     r"^configs/tiny_cpu\.gin: config key 'learner\.optimizer\.learning_rate': expected a float, got 'fast'$"),
    ("TrainConfig.steps = 0", r"^configs/tiny_cpu\.gin: config: steps=0 must be >= 1$"),
    ("OptimizerConfig.learning_rate = ", r"^gin: Unable to parse value\. \(--gin 'OptimizerConfig.learning_rate = '\)$"),
    ("OptimizerConfig.learning_rate = (", r"^gin: EOF in multi-line statement \(--gin .*\)$"),
    ("OptimizerConfig.learning_rate = @adam()", r"^gin: @adam\(\) refers to a function; a config value is a literal"),
    ("train/OptimizerConfig.learning_rate = 1e-5", r"^gin binding 'train/OptimizerConfig\.\.\.': scopes do not apply"),
    ("OptimizerConfig.total_steps = 10",
     r"'learner\.optimizer\.total_steps' is not a config key: the run derives it from steps x learner\.num_iterations"),
])
def test_a_bad_binding_gets_one_line_naming_it(binding, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_config("configs/tiny_cpu.gin", gin_bindings=[binding])
    assert "\n" not in str(error.value)


def test_errors_in_a_gin_file_name_its_line(tmp_path):
    path = tmp_path / "bad.gin"
    path.write_text("TrainConfig.steps = 3\nRolloutConfg.max_tokens = 8\n")
    with pytest.raises(ConfigError, match=rf"unknown config class 'RolloutConfg' \(did you mean 'RolloutConfig'\? .*\) "
                                          rf"\(file \"{path}\", line 2: RolloutConfg\.max_tokens = 8\)$"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"config file .*nope\.gin not found"):
        load_config(tmp_path / "nope.gin")


def test_the_gin_config_trains_like_the_yaml(tmp_path):
    """configs/tiny_cpu.gin and configs/tiny_cpu.yaml, one short step each (the same overrides):
    the same resolved config in the run directory and the same first step, timings aside."""
    import subprocess
    import sys

    import yaml

    from jaxrl.run.replay import compare
    from jaxrl.run.tracking import read_metrics
    from jaxrl.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", "qwen3", hidden_size=128, intermediate_size=256, num_layers=2)
    short = ["steps=1", "sft.steps=0", "eval.episodes=0", "eval.before=false", "rollout.groups_per_step=2",
             "log.progress=false", "log.tensorboard=false", f"model.dir={model}"]
    procs = {kind: subprocess.Popen([sys.executable, "-m", "jaxrl.run.cli", "train", f"configs/tiny_cpu.{kind}",
                                     *[a for o in short + [f"run_dir={tmp_path / kind}"] for a in ("--set", o)]],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for kind in ("yaml", "gin")}
    for kind, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{kind}: {err[-3000:]}"
    configs = [yaml.safe_load((tmp_path / kind / "config.yaml").read_text()) for kind in ("yaml", "gin")]
    assert [c.pop("run_dir") for c in configs] == [str(tmp_path / "yaml"), str(tmp_path / "gin")]
    assert configs[0] == configs[1]
    rows = [read_metrics(tmp_path / kind) for kind in ("yaml", "gin")]
    assert "loss" in rows[0][0] and compare(rows[0], rows[1]).matched
