"""Supervised warm start on solver demonstrations, before reinforcement learning.

The bridge plays each environment's own solver through the real episode hook (a rollout request
with `policy="solver"`), so a demonstration's tokens are exactly those the policy sees and writes
in RL: the chat-template prompt, the solver's actions as model replies (loss mask 1) and what the
environment answers (loss mask 0). The learner trains on them with the `sft` loss (token-mean
negative log-likelihood) through the same batch path as rollouts, with `learner.optimizer`'s
AdamW settings and the model in `model.dtype`; only the learning rate and its schedule are the
warm start's own (`sft.*`).

A LoRA run's warm start trains its adapters alone, or with `sft.train_all` (by default for a random
`model.tiny` model, whose frozen head leaves adapters nothing to adapt) every weight: the
warm-started model is then the base that RL trains adapters over (`lora_base`), written to
RUN/base-model as a Hugging Face model directory (`write_base_model`), which the run's bridges
serve, `--resume` loads, and the adapters' config names for `jaxrl export` and PEFT.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import jax
import numpy as np

from bridge.envs.spec import ENV_REWARD
from bridge.wire import SamplingParams, TrajectoryData
from jaxrl.compilation import bucket
from jaxrl.learner import Learner
from jaxrl.losses import LossConfig
from jaxrl.models import Decoder, save_pretrained
from jaxrl.models.hf import INDEX_FILE, read_config
from jaxrl.run.batches import learner_batch
from jaxrl.run.config import TrainConfig
from jaxrl.run.rollout_client import RolloutClient
from jaxrl.run.run_dir import RunDir
from jaxrl.run.tasks import TaskSource
from jaxrl.train_step import LearnerConfig


class WarmStartError(RuntimeError):
    """Demonstrations that cannot be trained on: a solver that failed its task."""


def warm_start_envs(cfg: TrainConfig) -> list[str]:
    """The environments to demonstrate: `sft.envs`, else every environment with a solver."""
    return list(cfg.sft.envs) or [e.name for e in cfg.envs if e.solver]


def demonstrations(client: RolloutClient, tasks: TaskSource, cfg: TrainConfig) -> list[TrajectoryData]:
    """`sft.demonstrations` solver episodes of training tasks; each must earn its environment's full
    reward (a solver that fails one is an error, never silent bad data)."""
    jobs = tasks.demonstrations(cfg.sft.demonstrations, warm_start_envs(cfg))
    params = SamplingParams(max_tokens=1)  # the solver writes the replies; nothing is sampled
    groups = client.request(jobs, [f"demo-{i}" for i in range(len(jobs))], 1, params, 0, policy="solver")
    trajs = [g[0] for g in groups]
    for traj, (env, task) in zip(trajs, jobs):
        if traj.finish_reason == "error" or traj.rewards.get(ENV_REWARD, 0.0) < 1.0:
            why = traj.error or f"earned reward {traj.rewards}, not 1"
            raise WarmStartError(f"environment {env!r}: the solver's demonstration of task {task} failed: {why}")
    return trajs


def warm_start_learner_config(cfg: TrainConfig) -> LearnerConfig:
    """learner.optimizer's AdamW with the warm start's peak rate: linear warmup over a tenth of the
    steps, then cosine decay to 10%; one update per batch, no groups, no routes to replay (demonstrations
    were not sampled: an MoE learner's routers route them)."""
    steps = cfg.sft.steps
    optimizer = dataclasses.replace(
        cfg.learner.optimizer, learning_rate=cfg.sft.learning_rate, schedule="cosine",
        warmup_steps=min(max(steps // 10, 1), steps), total_steps=steps, final_lr_fraction=0.1)
    return dataclasses.replace(cfg.learner, group_size=1, grad_accum=1, num_iterations=1,
                               loss=LossConfig(loss_type="sft"), optimizer=optimizer, routing_replay=False,
                               lora=None if cfg.full_warm_start else cfg.learner.lora)


def lora_base(cfg: TrainConfig, run: RunDir) -> Path:
    """The model a run's adapters sit on, and its bridges serve once it trains them: RUN/base-model
    when its warm start trains every weight (absolute: adapter configs name it), else model.dir."""
    return run.base_model.absolute() if cfg.full_warm_start else Path(cfg.model.dir)


def write_base_model(model: Decoder, source: Path, out: Path) -> None:
    """Writes `model` to `out` as a Hugging Face model directory: its weights (`model.dtype`, bitwise
    as the learner holds them) and config, beside the other files of the model directory `source`
    it started from (tokenizer, chat template, generation config). Written beside `out` and renamed
    in, so that `out` is whole or absent. Every process calls it; process 0 writes."""
    tmp = out.parent / f".{out.name}.tmp"
    primary = jax.process_index() == 0
    if primary:
        shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, tmp, hf_config=read_config(source))
    if primary:
        for file in source.iterdir():
            if file.is_file() and file.suffix != ".safetensors" and file.name not in ("config.json", INDEX_FILE):
                shutil.copy2(file, tmp / file.name)
        shutil.rmtree(out, ignore_errors=True)  # an earlier attempt's, resumed before its first checkpoint
        tmp.rename(out)
    if jax.process_count() > 1:  # the others go on once it is there
        from orbax.checkpoint import multihost

        multihost.sync_global_processes("jaxrl-warm-start:base-model")


def warm_start(model: Decoder, demos: list[TrajectoryData], cfg: TrainConfig, mesh, pad_id: int,
               ) -> tuple[Decoder, dict[str, float]]:
    """`model` trained `sft.steps` steps on shuffled epochs of `demos`; returns it and the metrics.

    Every process holds the same demonstrations and feeds the learner its share of each batch.
    """
    start = time.perf_counter()
    n_proc, proc = jax.process_count(), jax.process_index()
    if cfg.sft.batch_size % n_proc:
        raise ValueError(f"sft.batch_size={cfg.sft.batch_size} does not split over {n_proc} processes")
    share = cfg.sft.batch_size // n_proc
    learner = Learner(model, warm_start_learner_config(cfg), mesh)
    prompt_len = bucket(max(len(t.prompt_ids) for t in demos))
    completion_len = bucket(max(len(t.completion_ids) for t in demos))
    rng = np.random.default_rng(cfg.seed)
    order: list[int] = []
    losses = []
    for _ in range(cfg.sft.steps):
        rows = []
        while len(rows) < cfg.sft.batch_size:  # epochs of shuffled demonstrations, batches across them
            if not order:
                order = rng.permutation(len(demos)).tolist()
            rows.append(demos[order.pop()])
        batch = learner_batch(rows[proc * share:(proc + 1) * share], share, prompt_len, completion_len, pad_id)
        losses.append(learner.update(batch)["loss"])
    return learner.model(), {
        "loss_first": losses[0], "loss": losses[-1], "demonstrations": len(demos), "steps": cfg.sft.steps,
        "model_tokens": int(sum(int(t.loss_mask.sum()) for t in demos)), "train_s": time.perf_counter() - start,
    }
