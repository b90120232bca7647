"""The Python API: configs built in code with the CLI's validation, and a script's own loop over a
real bridge process (generate, episodes, batch, update, publish, evaluate, save and load), LoRA's
included."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jaxrl.run import api
from jaxrl.tiny import build_tiny_model

ECHO = {"name": "echo", "env_class": "bridge.envs.bundled.echo:EchoEnvironment", "observation_field": "text",
        "action_class": "bridge.envs.bundled.echo:EchoAction"}


def base(tmp_path, model_dir=None) -> dict:
    return {"run_dir": str(tmp_path / "run"), "model": {"dir": str(model_dir or tmp_path / "m")}, "envs": [ECHO],
            "rollout": {"groups_per_step": 4, "max_tokens": 8, "max_total_tokens": 8, "max_prompt_tokens": 128},
            "learner": {"group_size": 2, "loss": {"is_level": "sequence"}}, "eval": {"episodes": 4},
            "log": {"progress": False}}


def test_a_config_in_code_is_validated_as_a_yaml_one(tmp_path):
    cfg = api.config(base(tmp_path), {"learner.loss.loss_type": "dr_grpo", "steps": 7})
    assert (cfg.learner.loss.loss_type, cfg.steps) == ("dr_grpo", 7)
    again = api.config(cfg, {"seed": 3})
    assert (again.seed, again.learner.loss.loss_type) == (3, "dr_grpo")
    with pytest.raises(api.ConfigError, match=r"^config key 'learner.loss': LossConfig.loss_type='ppo' is not one of"):
        api.config(base(tmp_path), {"learner.loss.loss_type": "ppo"})
    with pytest.raises(api.ConfigError, match="did you mean 'steps'"):
        api.config(base(tmp_path), {"stepz": 3})
    with pytest.raises(api.ConfigError, match="derives it from rollout.temperature"):
        api.config(base(tmp_path), {"learner.temperature": 0.5})


def test_a_scripts_own_loop_over_a_bridge(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", "qwen3")
    cfg = api.config(base(tmp_path, model_dir), {"compilation_cache": None})
    learner = api.make_learner(cfg)
    with api.start_bridge(cfg) as bridge:
        learner.prepare(api.rl_batch([], cfg, bridge.tokenizer.pad_token_id))  # the first update waits for it
        [[a, b]] = bridge.generate(["hello"], n=2, max_tokens=4)
        assert len(a.completion_ids) <= 4 and a.loss_mask.all() and a.sampler_logprobs.shape == a.completion_ids.shape
        groups = bridge.episodes(step=0)
        assert [len(g) for g in groups] == [2] * 4 and all(t.env == "echo" and "env" in t.rewards for g in groups
                                                          for t in g)
        api.save_trajectories(tmp_path / "t.jsonl", groups)
        batch = api.rl_batch([t for g in api.load_trajectories(tmp_path / "t.jsonl") for t in g], cfg,
                             bridge.tokenizer.pad_token_id)
        assert batch["completion_BxC"].shape == (8, 8) and "sampler_logp_BxC" in batch
        metrics = learner.update(batch)
        assert np.isfinite(metrics["loss"]) and learner.step == 1
        assert bridge.publish(learner) == 2 and bridge.version == 2
        assert bridge.episodes(step=1)[0][0].policy_version == 2
        result = bridge.evaluate()
        assert result.tasks + result.errors == 4
    saved = api.save_learner(learner, tmp_path / "ckpt")
    assert saved.name == "1"
    fresh = api.make_learner(cfg)
    assert api.load_learner(fresh, tmp_path / "ckpt") == 1
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(fresh.state.params),
                                                    jax.tree.leaves(learner.state.params)))


def test_a_scripts_lora_adapters_name_the_model_its_bridge_serves(tmp_path):
    """Published adapters name the model the bridge serves as their base: model.dir, also for a config
    whose `jaxrl train` would put them over its warm-started model (a script warm-starts nothing)."""
    from jaxrl.snapshots import SnapshotReader

    model_dir = build_tiny_model(tmp_path / "tiny", "qwen3")
    cfg = api.config({**base(tmp_path, model_dir), "envs": [{**ECHO, "solver": "echo"}]},
                     {"compilation_cache": None, "learner.lora": {"rank": 4, "alpha": 8}, "sft.steps": 2,
                      "sft.train_all": True})
    assert cfg.full_warm_start
    learner = api.make_learner(cfg)
    with api.start_bridge(cfg) as bridge:
        groups = bridge.episodes(step=0)
        learner.update(api.rl_batch([t for g in groups for t in g], cfg, bridge.tokenizer.pad_token_id))
        version = bridge.publish(learner)
        assert bridge.episodes(step=1)[0][0].policy_version == version == 2
    served = re.search(r"engine on model (\S+) \(LoRA adapters over it\)",
                       (tmp_path / "run" / "logs" / "bridge.log").read_text())
    adapters = SnapshotReader(tmp_path / "run" / "snapshots").load(version)
    assert adapters.adapter_config["r"] == 4 and all(".lora_A." in n or ".lora_B." in n for n in adapters.tensors)
    assert served is not None and adapters.adapter_config["base_model_name_or_path"] == served[1] == str(model_dir)
