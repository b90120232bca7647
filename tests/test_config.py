"""The training config: shipped configs load, cross-field checks name the keys."""

from pathlib import Path

import pytest

from jaxrl.run.config import ConfigError, TrainConfig, load_config
from jaxrl.run.typed_config import from_dict

ROOT = Path(__file__).resolve().parents[1]
BASE = {"run_dir": "r", "model": {"dir": "m"}, "envs": [{"name": "echo", "bundled": "echo"}]}


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.envs and cfg.steps >= 1


@pytest.mark.parametrize("extra, message", [
    ({"envs": []}, "list at least one environment"),
    ({"envs": [{"name": "a", "bundled": "echo"}, {"name": "a", "bundled": "wordle"}]}, "names must be unique"),
    ({"data": {"mix": {"chess": 1.0}}}, "data.mix names unknown environment"),
    ({"rewards": []}, "rewards: need at least one"),
    ({"rewards": [{"fn": "env"}, {"fn": "env"}]}, "distinct names"),
    ({"rollout": {"max_tokens": 64, "max_total_tokens": 32}}, "max_total_tokens >= max_tokens"),
    ({"rollout": {"mode": "async"}}, "learner.loss.is_level"),
    ({"eval": {"pass_k": 4}}, "eval.temperature > 0"),
    ({"rollout": {"groups_per_step": 3}, "learner": {"group_size": 2, "grad_accum": 4}}, "divisible"),
    ({"sft": {"envs": ["wordle"]}}, "sft.envs names unknown"),
    ({"envs": [{"name": "x", "url": "http://a", "env_class": "m:C"}]}, "exactly one of bundled, url, env_class"),
])
def test_cross_field_errors(extra, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(TrainConfig, {**BASE, **extra})
