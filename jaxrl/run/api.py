"""jaxrl from Python: the documented entry points for experiment scripts (docs/api.md).

    from jaxrl.run import api

    cfg = api.config("configs/tiny_cpu.yaml", {"steps": 20, "learner.loss.loss_type": "dr_grpo"})
    summary = api.train(cfg)                       # what `jaxrl train` prints as its last line
    print(api.evaluate(cfg.run_dir).line())        # the run's held-out evaluation, again

The pieces a script composes on its own: a learner (`make_learner`, `Learner.update(batch)`,
`save_learner` / `load_learner`), a bridge (`start_bridge`: generate, run episodes, publish the
learner's weights, evaluate; or the processes alone: `BridgeProcess` (as a `BridgeLaunch` says),
`EnvServerProcess`, `BridgeClient`), learner batches from trajectories (`rl_batch`), trajectories on
disk (`save_trajectories` / `load_trajectories`), metrics and reports (`MetricsLogger`,
`read_metrics`, `compare_runs`, `summary_table`), a run's weights as a model directory
(`export`), what the processes of a multi-host run exchange each step (`Exchange`,
`exchange_step`: episode summaries of a `StepRollouts`, counts; `rollout_metrics` of them); `restart_tuned()` first thing in a script runs it under the malloc settings
`jaxrl train` uses (XLA reuses its scratch memory). Custom rollout functions (an environment's `rollout_fn`) run in the bridge and use
`bridge.envs.rollout_fn`. Everything else in `jaxrl.run`
is private to the project and may change.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bridge.client import BridgeClient
from bridge.wire import BridgeLaunch, PromptGroup, SamplingParams, TrajectoryData
from jaxrl.checkpoints import TrainCheckpointer, abstract_like
from jaxrl.compilation import use_persistent_cache
from jaxrl.host_memory import restart_tuned
from jaxrl.learner import Learner
from jaxrl.models import load_pretrained, load_tokenizer
from jaxrl.run.batches import rl_batch
from jaxrl.run.collection import StepRollouts, rollout_metrics
from jaxrl.run.config import ConfigError, TrainConfig, load_config
from jaxrl.run.distributed import Exchange, exchange_step
from jaxrl.run.evaluation import EvalResult, evaluate_weights
from jaxrl.run.evaluation import evaluate as evaluate_on
from jaxrl.run.export import export
from jaxrl.run.processes import BridgeProcess, EnvServerProcess
from jaxrl.run.report import compare_runs, summary_table
from jaxrl.run.rollout_client import RolloutClient
from jaxrl.run.run_dir import RunDir
from jaxrl.run.services import StartupError, bridge_token, check_services, start_services
from jaxrl.run.tasks import Task, TaskSource
from jaxrl.run.tracking import MetricsLogger, read_metrics
from jaxrl.run.train import ensure_model, train
from jaxrl.run.trajectory_file import load_trajectories, save_trajectories
from jaxrl.run.typed_config import to_dict
from jaxrl.run.warm_start import lora_base
from jaxrl.sharding import make_mesh
from jaxrl.snapshots import SnapshotWriter, snapshot_versions

__all__ = [
    "Bridge", "BridgeClient", "BridgeLaunch", "BridgeProcess", "ConfigError", "EnvServerProcess", "EvalResult",
    "Exchange", "Learner",
    "MetricsLogger", "PromptGroup", "SamplingParams", "StartupError", "StepRollouts", "Task", "TrainConfig",
    "TrajectoryData", "compare_runs", "config", "evaluate", "exchange_step", "export", "load_learner",
    "load_trajectories", "make_learner", "read_metrics", "restart_tuned", "rl_batch", "rollout_metrics", "save_learner", "save_trajectories", "start_bridge", "summary_table", "train",
]


def config(source: str | Path | Mapping[str, Any] | TrainConfig,
           overrides: Mapping[str, Any] | Sequence[str] = ()) -> TrainConfig:
    """The validated training config from a YAML file, a mapping of its keys, or another config,
    with `overrides` applied ({"dotted.key": value}, or `--set` items "dotted.key=value");
    ConfigError (one line naming the key) when something is wrong. The same config `jaxrl train` reads."""
    if isinstance(source, TrainConfig):
        source = to_dict(source)
    return load_config(source, list(overrides.items()) if isinstance(overrides, Mapping) else list(overrides))


def evaluate(target: str | Path | TrainConfig, version: int | None = None, env: str | None = None,
             split: str = "test") -> EvalResult:
    """The held-out evaluation `jaxrl eval` runs: of a run directory's newest snapshot (or snapshot
    `version`) with the run's own config, or of a config's `model.dir`; `env` one environment only.
    Starts and stops the services it needs. Returns success, mean reward, stderr, task and error counts."""
    if isinstance(target, TrainConfig):
        if version is not None:
            raise ConfigError("evaluate: version picks a run directory's snapshot; a config has none")
        return evaluate_weights(target, Path(target.run_dir) / "logs" / "eval", None, env, split)
    run = Path(target)
    cfg = load_config(run / "config.yaml")
    versions = snapshot_versions(run / "snapshots")
    if version is not None and version not in versions:
        raise ConfigError(f"evaluate: {run} has snapshots {versions}, not version {version}")
    snapshot = (run / "snapshots", versions[-1] if version is None else version) if versions else None
    return evaluate_weights(cfg, run / "logs" / "eval", snapshot, env, split, lora_base(cfg, RunDir(run)))


def make_learner(cfg: TrainConfig) -> Learner:
    """A learner on `model.dir` (built first when `model.tiny` says so) with the config's loss,
    optimizer and mesh. `learner.update(batch)` takes one step and returns its metrics."""
    model = load_pretrained(ensure_model(cfg), param_dtype=cfg.model.dtype)
    return Learner(model, cfg.learner_config(), make_mesh(cfg.mesh))


def save_learner(learner: Learner, directory: str | Path) -> Path:
    """Saves the learner's whole train state (params, optimizer, step) under `directory`, as a run's
    checkpoints are; returns the checkpoint's directory."""
    ckpt = TrainCheckpointer(directory, async_save=False)
    try:
        ckpt.save(learner.step, learner.state, {"step": learner.step}, force=True)
    finally:
        ckpt.close()
    return ckpt.directory / str(learner.step)


def load_learner(learner: Learner, directory: str | Path, step: int | None = None) -> int:
    """Restores the newest checkpoint under `directory` (or `step`), a run's `checkpoints/` included,
    into `learner` (same model and optimizer); returns the learner's step."""
    ckpt = TrainCheckpointer(directory)
    try:
        learner.state, _ = ckpt.restore(abstract_like(learner.state, learner.shardings), step)
    finally:
        ckpt.close()
    return learner.step


class Bridge:
    """A bridge serving the config's model and environments (see `start_bridge`). Sampling follows
    `rollout.*` unless a call overrides it (`temperature=`, `max_tokens=`, ...); every call is seeded
    by the config's seed and the group ids, as a run's episodes are."""

    def __init__(self, cfg: TrainConfig, client: RolloutClient, tokenizer: Any, snapshots: Path):
        self.cfg = cfg
        self.client = client
        self.tokenizer = tokenizer
        self.tasks = TaskSource(cfg)
        self.snapshots = snapshots
        self.version = 0  # the weights the bridge serves
        self._writer: SnapshotWriter | None = None

    def _params(self, sampling: Mapping[str, Any]) -> SamplingParams:
        return dataclasses.replace(self.cfg.sampling_params((self.tokenizer.eos_token_id,)), **sampling)

    def generate(self, prompts: Sequence[Sequence[int] | str], n: int = 1, **sampling) -> list[list[TrajectoryData]]:
        """`n` completions of each prompt (token ids, or a text sent as one user chat message), with no
        environment: one list per prompt, each completion a TrajectoryData (ids, logprobs, ...)."""
        groups = []
        for i, p in enumerate(prompts):
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False,
                                                     **self.cfg.bridge.chat_template_kwargs) if isinstance(p, str) else p
            groups.append(PromptGroup(np.asarray(ids, np.int32), f"generate-{i}"))
        return self.client.rollout(groups, n, self._params(sampling), self.version)

    def episodes(self, tasks: Sequence[Task] | None = None, step: int = 0, group_size: int | None = None,
                 **sampling) -> list[list[TrajectoryData]]:
        """Groups of `group_size` (default learner.group_size) episodes, one group per task
        ((environment name, task fields)); default: the run's training tasks of `step`."""
        if tasks is None:
            tasks = [self.tasks.train(step, slot) for slot in range(self.cfg.rollout.groups_per_step)]
        ids = [f"{step}-{slot}" for slot in range(len(tasks))]
        return self.client.request(list(tasks), ids, group_size or self.cfg.learner.group_size,
                                   self._params(sampling), self.version)

    def held_out(self, env: str | None = None) -> list[Task]:
        """The evaluation tasks of the config (`eval.episodes` of them), those of `env` only if given."""
        return self.tasks.held_out(env)

    def evaluate(self) -> EvalResult:
        """The run's held-out evaluation on the weights the bridge serves now."""
        return evaluate_on(self.client, self.tasks.held_out(), self.cfg, self.version, (self.tokenizer.eos_token_id,))

    def publish(self, learner: Learner) -> int:
        """Writes the learner's weights as a snapshot and has the bridge serve them; returns their
        version (the learner's step + 1, as in a run)."""
        if self._writer is None:
            self._writer = SnapshotWriter(self.snapshots, learner.model().cfg, keep=3, lora=learner.cfg.lora,
                                          base_model=str(self.cfg.model.dir))
        version = learner.step + 1
        self._writer.publish(learner.state.params, version)
        self.load_snapshot(self.snapshots, version)
        return version

    def load_snapshot(self, directory: str | Path, version: int) -> None:
        """Has the bridge serve snapshot `version` of `directory` (under its snapshot root)."""
        self.client.load_snapshot(str(Path(directory).absolute()), version)
        self.version = version

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self.client.close()


@contextlib.contextmanager
def start_bridge(cfg: TrainConfig, workdir: str | Path | None = None) -> Iterator[Bridge]:
    """Starts the config's bundled environment servers and a bridge serving its model and
    environments (or connects to the running bridges of `bridge.addresses`), stopped on the way
    out. Snapshots go to WORKDIR/snapshots and logs to WORKDIR/logs (default: `run_dir`).
    StartupError (one line) when something cannot start."""
    check_services(cfg)
    model_dir = ensure_model(cfg)
    work = Path(workdir or cfg.run_dir).absolute()
    token = bridge_token(cfg)
    with contextlib.ExitStack() as stack:
        started = start_services(cfg, model_dir, work / "logs", stack, token, work / "snapshots",
                                 use_persistent_cache(cfg.compilation_cache))
        tokenizer = load_tokenizer(model_dir)
        client = RolloutClient(started.addresses, cfg.bridge, token, started.bridges, timeout_s=cfg.rollout_timeout_s,
                               streamed_groups=cfg.streamed_groups)
        bridge = Bridge(cfg, client, tokenizer, work / "snapshots")
        stack.callback(bridge.close)
        yield bridge
