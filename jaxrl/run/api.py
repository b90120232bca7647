"""jaxrl from Python: the documented entry points for experiment scripts (docs/api.md).

    from jaxrl.run import api

    cfg = api.config("configs/tiny_cpu.yaml", {"steps": 20, "learner.loss.loss_type": "dr_grpo"})
    summary = api.train(cfg)                       # what `jaxrl train` prints as its last line
    print(api.evaluate(cfg.run_dir).line())        # the run's held-out evaluation, again

The pieces a script composes on its own: a learner (`make_learner`, `Learner.update(batch)`,
`save_learner` / `load_learner`), a bridge (`start_bridge`, or `open_bridge` on a stack of the
script's own, as `jaxrl train` does: generate, run episodes, publish the learner's weights,
evaluate; or the processes alone: `BridgeProcess` (as a `BridgeLaunch` says),
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

import concurrent.futures
import contextlib
import dataclasses
import sys
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
from jaxrl.models.hf import load_model_config
from jaxrl.run.batches import learner_widths, rl_batch
from jaxrl.run.collection import StepRollouts, rollout_metrics
from jaxrl.run.config import ConfigError, TrainConfig, load_config
from jaxrl.run.distributed import Exchange, exchange_step
from jaxrl.run.env_probe import prompt_budget
from jaxrl.run.evaluation import EvalResult
from jaxrl.run.evaluation import evaluate as evaluate_on
from jaxrl.run.export import export
from jaxrl.run.processes import BridgeProcess, EnvServerProcess
from jaxrl.run.report import compare_runs, summary_table
from jaxrl.run.rollout_client import RolloutClient
from jaxrl.run.run_dir import RunDir
from jaxrl.run.services import StartupError, bridge_token, check_services, start_services
from jaxrl.run.supervision import EnvServers
from jaxrl.run.tasks import Task, TaskSource
from jaxrl.run.tracking import MetricsLogger, read_metrics
from jaxrl.run.trajectory_file import load_trajectories, save_trajectories
from jaxrl.run.typed_config import to_dict
from jaxrl.run.warm_start import lora_base
from jaxrl.sharding import make_mesh
from jaxrl.snapshots import SnapshotWriter, snapshot_versions

SNAPSHOTS_KEPT = 3  # the newest snapshots a run (and a script's bridge) keeps

__all__ = [
    "Bridge", "BridgeClient", "BridgeLaunch", "BridgeProcess", "ConfigError", "EnvServerProcess", "EvalResult",
    "Exchange", "Learner",
    "MetricsLogger", "PromptGroup", "SamplingParams", "StartupError", "StepRollouts", "Task", "TrainConfig",
    "TrajectoryData", "compare_runs", "config", "evaluate", "exchange_step", "export", "load_learner",
    "load_trajectories", "make_learner", "open_bridge", "prompt_budget", "read_metrics", "restart_tuned", "rl_batch",
    "rollout_metrics", "save_learner", "save_trajectories", "start_bridge", "summary_table", "train",
]


def config(source: str | Path | Mapping[str, Any] | TrainConfig,
           overrides: Mapping[str, Any] | Sequence[str] = ()) -> TrainConfig:
    """The validated training config from a YAML file, a mapping of its keys, or another config,
    with `overrides` applied ({"dotted.key": value}, or `--set` items "dotted.key=value");
    ConfigError (one line naming the key) when something is wrong. The same config `jaxrl train` reads."""
    if isinstance(source, TrainConfig):
        source = to_dict(source)
    return load_config(source, list(overrides.items()) if isinstance(overrides, Mapping) else list(overrides))


def train(cfg: TrainConfig, resume: bool = False, out=sys.stdout) -> dict[str, Any]:
    """Runs `jaxrl train` on `cfg` (`resume`: from the run directory's newest checkpoint); returns the
    summary it prints as its last line."""
    from jaxrl.run import train as run  # imported here: the train loop is a user of this module

    return run.train(cfg, resume, out)


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
    if not versions:
        raise ConfigError(f"evaluate: {run} has no snapshot (the run stopped before it published weights); evaluate "
                          f"its config's model.dir ({cfg.model.dir}) instead")
    snapshot = (run / "snapshots", versions[-1] if version is None else version)
    return evaluate_weights(cfg, run / "logs" / "eval", snapshot, env, split, lora_base(cfg, RunDir(run)))


def evaluate_weights(cfg: TrainConfig, logs: Path, snapshot: tuple[Path, int] | None = None,
                     env: str | None = None, split: str = "test", model_dir: Path | None = None) -> EvalResult:
    """`jaxrl eval`: the run's services started on `model_dir` (default `model.dir`; a LoRA run's
    adapters sit on `jaxrl.run.warm_start.lora_base`), logs in `logs`, the bridges given snapshot
    `(directory, version)` if any, then the held-out tasks of `env` (default: every environment, as
    `jaxrl train` evaluates) from `split`."""
    check_services(cfg)
    root = None if snapshot is None else Path(snapshot[0]).absolute()
    with contextlib.ExitStack() as stack:
        bridge = open_bridge(cfg, Path(model_dir or cfg.model.dir), logs, root, stack)
        if snapshot is not None:
            bridge.load_snapshot(root, snapshot[1])
        return bridge.evaluate(env, split)


def ensure_model(cfg: TrainConfig) -> Path:
    """The model directory, built from `model.tiny` when it does not exist yet."""
    model_dir = Path(cfg.model.dir)
    t = cfg.model.tiny
    if t is None:
        if not (model_dir / "config.json").is_file():
            raise StartupError(f"model.dir {model_dir}: not a model directory (no config.json); point it at a "
                               "Hugging Face model directory, or set model.tiny to build a tiny one")
        return model_dir
    if (model_dir / "config.json").is_file():
        built = load_model_config(model_dir)
        want = {"model_type": t.family, **t.model_fields()}
        differ = {k: (getattr(built, k), v) for k, v in want.items() if getattr(built, k) != v}
        if differ:
            raise StartupError(f"model.dir {model_dir} holds a tiny model that differs from model.tiny "
                               f"({', '.join(f'{k}: {a} != {b}' for k, (a, b) in differ.items())}); delete it "
                               "to rebuild, or point model.dir elsewhere")
        return model_dir
    from jaxrl.tiny import build_tiny_model

    print(f"jaxrl: building tiny {t.family} model in {model_dir}", file=sys.stderr)
    build_tiny_model(model_dir, t.family, seed=t.seed, **t.model_fields())
    return model_dir


def make_learner(cfg: TrainConfig) -> Learner:
    """A learner on `model.dir` (built first when `model.tiny` says so) with the config's loss,
    optimizer and mesh. `learner.update(batch)` takes one step and returns its metrics."""
    model = load_pretrained(ensure_model(cfg), param_dtype=cfg.model.dtype)
    return Learner(model, cfg.learner_config(), make_mesh(cfg.mesh), learner_widths(cfg))


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
    """The bridges serving a config's model and environments (see `start_bridge`), and the weights
    they serve: `publish` writes a snapshot they load. Sampling follows `rollout.*` unless a call
    overrides it (`temperature=`, `max_tokens=`, ...); every call is seeded by the config's seed and
    the group ids, as a run's episodes are."""

    def __init__(self, cfg: TrainConfig, client: RolloutClient, tokenizer: Any, model_dir: Path,
                 snapshots: Path | str | None, env_servers: EnvServers, tasks: TaskSource | None = None):
        self.cfg = cfg
        self.client = client
        self.tokenizer = tokenizer
        self.tasks = tasks or TaskSource(cfg)
        self.model_dir = model_dir  # served as version 0; a LoRA run's adapters sit on it
        self.snapshots = snapshots  # where published snapshots go: a path, or a gs:// or s3:// URL
        self.env_servers = env_servers  # the bundled ones, restarted when they die
        self.version = 0  # the weights the bridges serve
        self._writer: SnapshotWriter | None = None

    def _params(self, sampling: Mapping[str, Any]) -> SamplingParams:
        return dataclasses.replace(self.cfg.sampling_params(self.stop_ids), **sampling)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.tokenizer.eos_token_id,)

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

    def evaluate(self, env: str | None = None, split: str = "test") -> EvalResult:
        """The run's held-out evaluation (of `env` alone if given; tasks from `split`) on the weights
        the bridges serve now."""
        return evaluate_on(self.client, self.tasks.held_out(env, split=split), self.cfg, self.version, self.stop_ids)

    def snapshot_writer(self) -> SnapshotWriter:
        """The writer of snapshots of the served model's weights (opened on first use); a LoRA run's
        are its adapters alone, whose config names the model the bridges serve as their base."""
        if self._writer is None:
            model_cfg = load_model_config(self.model_dir, param_dtype=self.cfg.model.dtype)
            self._writer = SnapshotWriter(self.snapshots, model_cfg, keep=SNAPSHOTS_KEPT, lora=self.cfg.learner.lora,
                                          base_model=str(self.model_dir))
        return self._writer

    def publish(self, learner: Learner) -> int:
        """Writes the learner's weights as a snapshot and has the bridges serve them; returns their
        version (the learner's step + 1, as in a run)."""
        version = learner.step + 1
        self.publish_weights(learner.state.params, version)
        return version

    def publish_weights(self, params: Any, version: int) -> None:
        """Writes `params` (a LoRA run's: its adapters) as snapshot `version`, served by every bridge."""
        self.snapshot_writer().publish(params, version)
        self.client.load_snapshot(str(self.snapshots), version)
        self.version = version

    def load_snapshot(self, directory: str | Path, version: int) -> None:
        """Has the bridges serve snapshot `version` of `directory` (under their snapshot root)."""
        self.client.load_snapshot(str(Path(directory).absolute()), version)
        self.version = version

    def relaunch(self, model_dir: Path) -> None:
        """Restarts the bridges on `model_dir`: served as version 0, and the base that the adapters
        published from now on name."""
        self.client.bridges.relaunch(model_dir)
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.model_dir, self.version = model_dir, 0

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
    work = Path(workdir or cfg.run_dir).absolute()
    with contextlib.ExitStack() as stack:
        yield open_bridge(cfg, ensure_model(cfg), work / "logs", work / "snapshots", stack)


def open_bridge(cfg: TrainConfig, model_dir: Path, logs: Path, snapshots: Path | str | None,
                stack: contextlib.ExitStack, tasks: TaskSource | None = None) -> Bridge:
    """The config's services (`check_services` passed): its bundled environment servers and bridges
    serving `model_dir` (or the running bridges of `bridge.addresses`), logs in `logs`, snapshots
    loaded from under `snapshots` only (None: the model only). Their stop and the client's close go
    on `stack`. The tokenizer loads while they start (seconds: imports, model load, compiles)."""
    services = stack.enter_context(contextlib.ExitStack())
    token = bridge_token(cfg)  # a fresh one for bridges of our own
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="start") as pool:
        starting = pool.submit(start_services, cfg, model_dir, logs, services, token, snapshots,
                               use_persistent_cache(cfg.compilation_cache), tasks)
        tokenizer = load_tokenizer(model_dir)
        started = starting.result()
    client = RolloutClient(started.addresses, cfg.bridge, token, started.bridges, check=started.env_servers.check,
                           timeout_s=cfg.rollout_timeout_s, streamed_groups=cfg.streamed_groups)
    bridge = Bridge(started.cfg, client, tokenizer, model_dir, snapshots, started.env_servers, tasks)
    stack.callback(bridge.close)
    return bridge
