"""The warm start: demonstrations played by the bridge's solvers, split over environments and
checked, then a short supervised run on them with the run's optimizer settings."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from bridge.client import BridgeRequestError
from bridge.wire import SamplingParams
from jaxrl.models import load_pretrained
from jaxrl.run.collection import RolloutClient
from jaxrl.run.config import TrainConfig
from jaxrl.run.tasks import TaskSource
from jaxrl.run.typed_config import from_dict
from jaxrl.run.run_dir import RunDir
from jaxrl.run.warm_start import (WarmStartError, demonstrations, lora_base, warm_start, warm_start_learner_config,
                                  write_base_model)
from jaxrl.sharding import MeshConfig, make_mesh
from jaxrl.tiny import build_tiny_model
from jaxrl.tiny_tokenizer import build_tokenizer
from scripted_engine import TOKEN, ScriptedEngine, in_process_bridge

ECHO = {"name": "echo", "env_class": "bridge.envs.bundled.echo:EchoEnvironment",
        "action_class": "bridge.envs.bundled.echo:EchoAction", "solver": "echo"}
GUESS = {"name": "guess", "env_class": "bridge.envs.bundled.guess_number:GuessNumberEnvironment",
         "action_class": "bridge.envs.bundled.guess_number:GuessNumberAction", "solver": "guess_number"}
COIN = {"name": "coin", "env_class": "test_collection:Coin"}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def config(envs, **sft) -> TrainConfig:
    return from_dict(TrainConfig, {"run_dir": "r", "model": {"dir": "m"}, "envs": list(envs),
                                   "sft": {"steps": 12, "batch_size": 8, "learning_rate": 1e-2, **sft},
                                   "learner": {"optimizer": {"weight_decay": 0.01, "b2": 0.95, "max_grad_norm": 0.5}}})


def play(tok, cfg, envs=None):
    envs = envs or {"envs": [e.to_dict() for e in cfg.envs]}
    with in_process_bridge(ScriptedEngine(tok, lambda p: "unused"), envs, tok) as address:
        client = RolloutClient([address], cfg.bridge, TOKEN, timeout_s=cfg.rollout_timeout_s)
        try:
            return demonstrations(client, TaskSource(cfg), cfg)
        finally:
            client.close()


def test_demonstrations_split_over_environments_win_and_stay_in_the_training_split(tok):
    cfg = config([ECHO, GUESS, COIN], demonstrations=5)  # coin has no solver: not demonstrated
    demos = play(tok, cfg)
    assert [d.env for d in demos] == ["echo"] * 3 + ["guess"] * 2
    assert all(d.rewards["env"] == 1.0 and d.finish_reason == "env_done" for d in demos)
    from bridge.envs.bundled.echo import task_for_seed

    targets = [tok.decode(d.completion_ids, skip_special_tokens=True) for d in demos[:3]]
    assert targets == [task_for_seed(s, "train")["target"] for s in range(3)]


def test_a_solver_that_fails_its_task_is_an_error_not_data(tok):
    cfg = config([{**ECHO, "solver": "guess_number"}], demonstrations=2)
    with pytest.raises(WarmStartError, match="environment 'echo': the solver's demonstration of task .* failed"):
        play(tok, cfg)


def test_the_bridge_refuses_solver_episodes_of_an_environment_without_a_solver(tok):
    cfg = config([ECHO], demonstrations=2)
    served = {"envs": [{k: v for k, v in ECHO.items() if k != "solver"}]}
    with pytest.raises(BridgeRequestError, match="environment 'echo' has no solver"):
        play(tok, cfg, served)


def test_config_needs_a_solver_to_warm_start():
    with pytest.raises(Exception, match="no environment has a solver"):
        config([COIN])


def test_warm_start_uses_the_run_optimizer_and_lowers_the_loss(tok, tmp_path):
    cfg = config([ECHO], demonstrations=16)
    lc = warm_start_learner_config(cfg)
    assert (lc.optimizer.weight_decay, lc.optimizer.b2, lc.optimizer.max_grad_norm) == (0.01, 0.95, 0.5)
    assert (lc.optimizer.learning_rate, lc.optimizer.total_steps, lc.loss.loss_type) == (1e-2, 12, "sft")
    demos = play(tok, cfg)
    model = load_pretrained(build_tiny_model(tmp_path / "tiny", tokenizer=tok))
    before = dataclasses.replace(model.cfg)
    trained, metrics = warm_start(model, demos, cfg, make_mesh(MeshConfig(fsdp=-1)), tok.pad_token_id)
    assert metrics["loss"] < metrics["loss_first"] - 1.0
    assert metrics["demonstrations"] == 16 and metrics["steps"] == 12 and metrics["model_tokens"] > 0
    assert trained.cfg == before


def test_a_lora_warm_start_of_every_weight_is_written_as_the_adapters_base(tok, tmp_path):
    """sft.train_all: the warm start trains the whole model (no adapters yet), which becomes the
    base the run's adapters sit on: RUN/base-model, bitwise, beside the source model's other files."""
    tiny = build_tiny_model(tmp_path / "tiny", tokenizer=tok)
    cfg = from_dict(TrainConfig, {"run_dir": str(tmp_path / "run"), "model": {"dir": str(tiny), "tiny": {}},
                                  "envs": [ECHO], "sft": {"steps": 3, "batch_size": 8, "demonstrations": 8},
                                  "learner": {"lora": {"rank": 4}}})
    assert warm_start_learner_config(cfg).lora is None and cfg.learner_config().lora is not None
    run = RunDir(cfg.run_dir)
    assert lora_base(cfg, run) == run.base_model.absolute()
    pretrained = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tiny=None))
    assert warm_start_learner_config(pretrained).lora == cfg.learner.lora and lora_base(pretrained, run) == tiny

    model = load_pretrained(tiny)
    start = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    trained, _ = warm_start(model, play(tok, cfg), cfg, make_mesh(MeshConfig(fsdp=-1)), tok.pad_token_id)
    params = jax.tree.map(np.asarray, nnx.state(trained, nnx.Param))
    assert not jax.tree.leaves(nnx.state(trained, nnx.LoRAParam))  # no adapters yet: the learner adds them
    assert all((a != b).any() for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(params)))  # every weight

    (tmp_path / "run").mkdir()
    run.base_model.mkdir()  # an earlier attempt's, resumed before its first checkpoint: replaced
    (run.base_model / "stale.txt").write_text("x")
    write_base_model(trained, tiny, run.base_model)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["base-model"]
    assert sorted(p.name for p in run.base_model.iterdir()) == sorted(p.name for p in tiny.iterdir())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (run.base_model / name).read_bytes() == (tiny / name).read_bytes()
    assert json.loads((run.base_model / "config.json").read_text()) == json.loads((tiny / "config.json").read_text())
    loaded = jax.tree.map(np.asarray, nnx.state(load_pretrained(run.base_model), nnx.Param))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)))
