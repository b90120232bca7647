"""`jaxrl train`: environments + bridge + learner, one step at a time, nothing lost on the way out.

    check config and endpoints -> start environment servers and the bridge -> evaluate the base
    model -> supervised warm start (if configured) -> loop: rollouts, update, publish weights,
    evaluate, checkpoint -> final evaluation, plots, summary.

Weight versions: the bridge starts serving version 0 (the model directory); the learner's
weights after k updates are published as version k + 1 (the warm start's as version 1). Ctrl-C /
SIGTERM finish the current step, write a checkpoint and stop every child process; a second Ctrl-C
stops at once (children are still stopped). `--resume` continues from the newest checkpoint.

A LoRA run whose warm start trains every weight (`TrainConfig.full_warm_start`) trains its
adapters over the warm-started model: written to RUN/base-model, the run's bridges are restarted
on it (serving it as version 0, then the fresh adapters as version 1), its adapters' config names
it, and `--resume` starts the bridges and the learner on it. Restarting costs one bridge start;
handing bridges that serve adapters a new base instead would need every engine to replace its
base in place (vLLM's LoRA layers wrap theirs), and every bridge restarted after a crash to be
given that base before its adapters: a model directory serves both.

Several processes (hosts) run one job together when jax.distributed is set up (`distributed.*`,
or the cluster's environment; see jaxrl.run.distributed): each collects its share of a step's
groups from bridges of its own and feeds the learner its rows; process 0 alone evaluates and
writes the run directory's metrics, logs, plots and samples; processes other than 0 put their
children's logs in RUN/logs/process-<i>/. A run resumes on any process count.

`train` is the spine, read top to bottom as a run goes (check, start, train, finish), with the
order in which everything shuts down in one place; `_train_steps` is one step's phases (rollouts,
update, publish and evaluate, log and checkpoint). State lives in local variables and return
values: `_Job` holds what never changes during a run, its `jaxrl.run.api.Bridge` the version the
bridges serve. Starting the services, publishing and evaluating are the API's, as a script's are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from bridge.client import BridgeClient
from jaxrl.checkpoints import TrainCheckpointer, abstract_like
from jaxrl.compilation import compiles, programs
from jaxrl.learner import Learner
from jaxrl.models import ModelConfig, load_pretrained
from jaxrl.models.hf import load_model_config
from jaxrl.models.lora import LoraError, adapter_config, add_lora, check_targets
from jaxrl.run import report
from jaxrl.run.api import SNAPSHOTS_KEPT, Bridge, ensure_model, open_bridge
from jaxrl.run.batches import learner_widths, prompt_width, rl_batch
from jaxrl.run.collection import Collector, EnvironmentsDown, Share, StepRollouts, rollout_metrics
from jaxrl.run.config import DistributedConfig, TrainConfig
from jaxrl.run.distributed import Exchange, exchange_step, initialize, share_of
from jaxrl.run.record import record_session
from jaxrl.run.rewards import RewardWeights, SignalWatch
from jaxrl.run.rollout_client import RolloutClient
from jaxrl.run.run_dir import RunDir, disk_full, snapshot_directory
from jaxrl.run.services import StartupError, check_services
from jaxrl.run.stopping import GracefulStop
from jaxrl.run.tasks import TaskSource, checked_tasks
from jaxrl.run.tracking import MetricsLogger, Progress, log_file, sample_rows
from jaxrl.run.typed_config import dump_yaml
from jaxrl.run.warm_start import demonstrations, lora_base, warm_start, write_base_model
from jaxrl.sharding import make_mesh
from jaxrl.snapshots import copy_snapshot, delete_snapshot, snapshot_versions

log = logging.getLogger("jaxrl.train")


@dataclasses.dataclass(frozen=True)
class _Job:
    """What the phases of one run read; nothing in it changes while the run trains but the version
    its bridge serves."""

    cfg: TrainConfig
    run: RunDir
    ckpt: TrainCheckpointer
    bridge: Bridge  # the bridges, the bundled environment servers (restarted when they die), the tasks
    share: Share  # this process's groups of every step (all of them with one process)
    out: Any
    model: ModelConfig  # the policy's architecture (an MoE one's batches carry the rollouts' routes)

    @property
    def primary(self) -> bool:
        """Process 0: the one that evaluates and writes the run directory's logs."""
        return jax.process_index() == 0

    @property
    def pad_id(self) -> int:
        tokenizer = self.bridge.tokenizer
        return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def evaluate(self, what: str | None = None):
        """The held-out evaluation on the served weights; printed when it has a name."""
        result = self.bridge.evaluate()
        if what is not None:
            print(f"eval {what}: {result.line()}", file=self.out, flush=True)
        return result


def _forget_after(job: _Job, step: int) -> None:
    """Drops the snapshots published after the checkpoint of `step` (a resumed run's future)."""
    writer, run = job.bridge.snapshot_writer(), job.run
    for stale in [v for v in writer.versions() if v > step]:
        writer.delete(stale)
    if job.bridge.snapshots != run.snapshots.absolute() and job.primary:
        for stale in [v for v in snapshot_versions(run.snapshots) if v > step + 1]:
            delete_snapshot(run.snapshots, stale)


def _keep_served(job: _Job) -> None:
    """Leaves the served snapshot in RUN/snapshots when the snapshots live elsewhere (for `jaxrl
    eval RUN`, `jaxrl export`), however the run ended."""
    bridge, run = job.bridge, job.run
    if bridge.snapshots == run.snapshots.absolute() or not job.primary:
        return
    try:
        if bridge.version in snapshot_versions(bridge.snapshots):
            copy_snapshot(bridge.snapshots, bridge.version, run.snapshots, keep=SNAPSHOTS_KEPT)
    except (OSError, ValueError) as e:  # TensorStore's errors (a bucket that stopped answering) are ValueErrors
        if not disk_full(e):  # when it is, the run's own error says so
            log.warning("copying snapshot %d to %s failed: %s", bridge.version, run.snapshots, e)


def train(cfg: TrainConfig, resume: bool = False, out=sys.stdout) -> dict[str, Any]:
    """Runs the training job `cfg` (this process's part of it); returns the summary printed as the last line."""
    wall_start = time.perf_counter()
    plan = _checked(cfg, resume)
    summary: dict[str, Any] = {"run_dir": str(plan.run.path)}
    with GracefulStop() as stop, contextlib.ExitStack() as stack:
        # Shutdown order: the stack closes last-in first-out, so a run ends with the progress bar,
        # the metrics logger, the collector (its prefetch), the served snapshot kept in
        # RUN/snapshots, the bridge (its snapshot writer, the rollout client, the children: bridges,
        # environment servers), the snapshot directory, the checkpointer and train.log.
        # `_train_steps` checkpoints the steps taken before any of it.
        job, learner, step, meta = _started(plan, stack, summary, wall_start, out)
        collector, logger, progress = _loop_parts(job, learner, step, stack)
        step, late_programs = _train_steps(job, learner, collector, logger, progress, stop, step, meta)
        _finished(job, learner, logger, stop, step, meta, late_programs, summary)
    summary["wall_s"] = round(time.perf_counter() - wall_start, 1)
    summary["final"] = report.finish_report(plan.run.path, out) if jax.process_index() == 0 else {}
    return summary


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a run found before any child process starts (`_checked`)."""

    cfg: TrainConfig
    tasks: TaskSource
    share: Share
    model_dir: Path
    policy: ModelConfig
    run: RunDir
    ckpt: TrainCheckpointer
    start_step: int | None  # the checkpoint resumed from; None: a new run
    served: Path  # what the bridges serve first
    base_to_come: bool  # the warm start trains every weight, the base of the run's adapters
    logs: Path


def _checked(cfg: TrainConfig, resume: bool) -> _Plan:
    """Everything that can fail before a child process starts; StartupError in one line."""
    initialize(cfg.distributed)
    check_services(cfg)
    tasks = checked_tasks(cfg)
    share = share_of(make_mesh(cfg.mesh), cfg)  # this process's groups of every step
    model_dir = _ensure_model_once(cfg)
    policy = load_model_config(model_dir)
    if cfg.learner.routing_replay and not policy.route_width:
        raise StartupError(f"learner.routing_replay: {model_dir} is a dense {policy.model_type} model, whose tokens "
                           "have no expert routes to replay; set it for a mixture-of-experts policy (qwen3_moe, "
                           "gpt_oss) only")
    if cfg.learner.lora is not None:
        try:
            check_targets(policy, cfg.learner.lora)
        except LoraError as e:
            raise StartupError(str(e)) from None
    try:
        run = RunDir.create(cfg.run_dir)
    except OSError as e:  # a file where a directory goes, no permission
        raise StartupError(f"run_dir {cfg.run_dir}: cannot make {e.filename}: {e.strerror}; point run_dir at a "
                           "directory you can write") from None
    ckpt = TrainCheckpointer(run.checkpoints, keep=cfg.keep_checkpoints, every=cfg.checkpoint_every)
    start_step = _start_step(run, ckpt, resume)
    # A warm start of every weight makes the adapters' base; until it has, the bridges serve model.dir.
    base_to_come = cfg.full_warm_start and start_step is None
    served = model_dir if base_to_come else lora_base(cfg, run)
    if not (served / "config.json").is_file():
        raise StartupError(f"--resume: {served}, the base of this config's LoRA adapters, is missing; resume with "
                           "the sft.train_all the run started with (true for a model.tiny model)")
    return _Plan(cfg, tasks, share, model_dir, policy, run, ckpt, start_step, served, base_to_come,
                 _record(run, cfg, start_step))


def _started(plan: _Plan, stack: contextlib.ExitStack, summary: dict, wall_start: float, out):
    """Environment servers and bridges, the base model's evaluation, the warm start and the learner, whose
    programs compile while the first rollout runs (the bridges' warm-up first): (job, learner, step, meta)."""
    stack.enter_context(log_file(plan.logs / "train.log"))
    stack.callback(plan.ckpt.close)
    snapshots, _ = stack.enter_context(_snapshot_room(plan.cfg, plan.run, plan.model_dir))
    bridge = open_bridge(plan.cfg, plan.served, plan.logs, snapshots, stack, plan.tasks)
    # bridge.cfg: rollout.max_prompt_tokens sized from the environments' first prompts if it was null
    job = _Job(bridge.cfg, plan.run, plan.ckpt, bridge, plan.share, out, plan.policy)
    cfg = job.cfg
    if job.primary:
        job.bridge.tokenizer.save_pretrained(plan.run.tokenizer)
    startup = summary["startup"] = {"services_s": round(time.perf_counter() - wall_start, 2)}
    model = load_pretrained(plan.served, param_dtype=cfg.model.dtype)
    if cfg.learner.lora is not None and not plan.base_to_come:  # fresh adapters: the base model, as served
        add_lora(model, cfg.learner.lora)
    job.bridge.snapshot_writer()  # a snapshot directory it cannot write stops the run before the warm start
    stack.callback(_keep_served, job)
    if plan.start_step is None and cfg.bridge.addresses:  # running bridges may serve anything: give them ours
        job.bridge.publish_weights(nnx.state(model, nnx.LoRAParam) if cfg.learner.lora else nnx.split(model)[1], 0)
    learner, step, meta = _make_learner(job, model, plan.start_step, summary)
    stack.callback(learner.close)
    if step < cfg.steps:
        learner.prepare(rl_batch([], cfg, job.pad_id, rows=plan.share.count * cfg.learner.group_size, model=job.model))
    startup["first_step_at_s"] = round(time.perf_counter() - wall_start, 2)
    _print_startup(startup, out)
    return job, learner, step, meta


def _loop_parts(job: _Job, learner: Learner, step: int, stack: contextlib.ExitStack):
    """What the train loop reads and writes besides the learner: (collector, metrics logger, progress bar);
    process 0 alone logs."""
    cfg = job.cfg
    collector = stack.enter_context(contextlib.closing(
        Collector(cfg, job.bridge.client, job.bridge.tasks, job.bridge.stop_ids, job.share)))
    logger = stack.enter_context(MetricsLogger(job.run.path, tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb,
                                               resume_step=step + 1)) if job.primary else None
    progress = (stack.enter_context(Progress(cfg.steps, initial=step))
                if cfg.log.progress and job.primary else None)
    return collector, logger, progress


def _finished(job: _Job, learner: Learner, logger: MetricsLogger | None, stop: GracefulStop, step: int, meta: dict,
              late_programs: int | None, summary: dict) -> None:
    """The last checkpoint (collective with several processes) and the final evaluation, into `summary`."""
    cfg, ckpt = job.cfg, job.ckpt
    if ckpt.latest_step() != step:
        ckpt.save(step, learner.state, {**meta, "step": step}, force=True)
    ckpt.wait()
    summary["steps"] = step
    if late_programs is not None:
        summary["programs_after_first_step"] = late_programs
    if step >= cfg.steps and cfg.eval.episodes and job.primary:
        summary.update(_final_evaluation(job, logger, step, summary))
    if step < cfg.steps:  # stopped: by a signal to this process or to another one
        summary["stopped"] = (stop.signal or signal.SIGTERM).name  # `jaxrl train` exits 128 + its number


def _ensure_model_once(cfg: TrainConfig) -> Path:
    """`ensure_model`, by process 0 first: the others find a tiny model it built on a shared file
    system, and build their own (the same: it is seeded) on one of their own."""
    if jax.process_count() == 1:
        return ensure_model(cfg)
    from orbax.checkpoint import multihost

    model_dir = ensure_model(cfg) if jax.process_index() == 0 else None
    multihost.sync_global_processes("jaxrl-train:model")
    return model_dir or ensure_model(cfg)


def _start_step(run: RunDir, ckpt: TrainCheckpointer, resume: bool) -> int | None:
    """The checkpoint step to resume from; None for a fresh run."""
    latest = ckpt.latest_step()
    if not resume and latest is not None:
        raise StartupError(f"{run.path} already holds checkpoints: pass --resume to continue that run, or "
                           "choose another run_dir")
    if resume and latest is None:
        print(f"jaxrl train: --resume: {run.checkpoints} has no checkpoint yet; starting from step 0",
              file=sys.stderr)
    return latest if resume else None


def _record(run: RunDir, cfg: TrainConfig, start_step: int | None) -> Path:
    """The run's config and session in its directory; returns this process's log directory."""
    primary = jax.process_index() == 0
    if primary:  # launch settings are not the run's: it resumes on any process count
        dump_yaml(dataclasses.replace(cfg, distributed=DistributedConfig()), run.config)
    record_session(run, cfg, start_step)
    logs = run.logs if primary else run.logs / f"process-{jax.process_index()}"
    logs.mkdir(exist_ok=True)
    return logs


def _snapshot_room(cfg: TrainConfig, run: RunDir, model_dir: Path):
    """Where snapshots go: entered before the bridges start, so that a memory directory goes after
    they stop. Room for the snapshots kept and the one being written, each about the model's weights."""
    weights_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    return snapshot_directory(run, cfg.snapshot_dir,
                              local_bridges=not cfg.bridge.addresses and jax.process_count() == 1,
                              needs_bytes=(SNAPSHOTS_KEPT + 1) * weights_bytes)


def _evaluate_base(job: _Job) -> dict[str, float]:
    """The base model's held-out success (process 0's; the others' is empty)."""
    if not (job.cfg.eval.before and job.cfg.eval.episodes and job.primary):
        return {}
    before = job.evaluate("before training")
    return {"eval_before": before.success, "eval_before_stderr": before.stderr}


def _make_learner(job: _Job, model, start_step: int | None,
                  summary: dict[str, Any]) -> tuple[Learner, int, dict[str, Any]]:
    """The learner on `model`, warm-started on demonstrations or restored from a checkpoint, its
    weights published when they differ from the base model's: (learner, its step, the metadata
    every checkpoint keeps). Adds its phases to `summary`, and for a fresh run the base model's
    evaluation: after the warm start, which needs no generation and so trains while the bridges
    compile their programs, and before the bridges serve other weights."""
    cfg, startup = job.cfg, summary["startup"]
    mesh = make_mesh(cfg.mesh)
    warm = bool(cfg.sft.steps) and start_step is None
    if warm:
        model, summary["sft"] = _timed(startup, "warm_start_s", lambda: warm_start(
            model, demonstrations(job.bridge.client, job.bridge.tasks, cfg), cfg, mesh, job.pad_id))
        print(f"warm start: {json.dumps(summary['sft'])}", file=job.out, flush=True)
    if start_step is None:
        summary.update(_timed(startup, "eval_before_s", _evaluate_base, job))
    if warm and cfg.full_warm_start:  # the adapters' base, on disk and served (see the module's docstring)
        base = lora_base(cfg, job.run)
        _timed(startup, "base_model_s", write_base_model, model, Path(cfg.model.dir), base)
        _timed(startup, "bridges_restart_s", job.bridge.relaunch, base)
    t0 = time.perf_counter()
    learner, step = Learner(model, cfg.learner_config(), mesh, learner_widths(cfg)), 0
    if start_step is not None:
        learner.state, meta = job.ckpt.restore(abstract_like(learner.state, learner.shardings))
        step = int(meta["step"])
        saved = meta.get("lora_over_warm_start", False)
        if cfg.learner.lora is not None and saved != cfg.full_warm_start:
            where = {True: "its warm-started model (RUN/base-model)", False: "model.dir"}
            raise StartupError(f"--resume: the run's adapters were trained over {where[saved]}, and this config "
                               f"puts them over {where[cfg.full_warm_start]}; resume with sft.train_all: "
                               f"{str(saved).lower()}")
        summary.update({k: meta[k] for k in ("eval_before", "eval_before_stderr") if k in meta})
        print(f"resumed from step {step}", file=job.out, flush=True)
    lora_meta = {"lora": adapter_config(cfg.learner.lora, str(lora_base(cfg, job.run))),
                 "lora_over_warm_start": cfg.full_warm_start} if cfg.learner.lora else {}
    meta = {"model_config": model.cfg.to_hf(), **lora_meta,
            **{k: summary[k] for k in ("eval_before", "eval_before_stderr") if k in summary}}
    _forget_after(job, step)
    if step > 0 or warm:
        job.bridge.publish_weights(learner.state.params, step + 1)
    startup["learner_s"] = round(time.perf_counter() - t0, 2)
    if warm and cfg.eval.episodes and job.primary:
        warmed = _timed(startup, "eval_after_warm_start_s", job.evaluate, "after the warm start")
        summary.update(eval_after_warm_start=warmed.success, eval_after_warm_start_stderr=warmed.stderr)
    return learner, step, meta


def _timed(startup: dict[str, float], key: str, fn, *args):
    """fn(*args), its seconds kept in the start-up phases under `key`."""
    t0 = time.perf_counter()
    try:
        return fn(*args)
    finally:
        startup[key] = round(time.perf_counter() - t0, 2)


def _print_startup(startup: dict[str, float], out) -> None:
    phases = ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in startup.items() if k != "first_step_at_s")
    print(f"process {jax.process_index()} of {jax.process_count()}: " * (jax.process_count() > 1) +
          f"start-up: first step at {startup['first_step_at_s']:.1f} s ({phases})", file=out, flush=True)


def _train_steps(job: _Job, learner: Learner, collector: Collector,
                 logger: MetricsLogger | None, progress: Progress | None, stop: GracefulStop, step: int,
                 meta: dict[str, Any]) -> tuple[int, int | None]:
    """Rollouts, update, publish, evaluate, log, checkpoint: one step at a time until done or
    stopped. Returns the step reached and the programs needed after this process's first step (None
    before it). However it ends, the steps taken are checkpointed.

    With several processes, each collects its share of the step's groups and trains on its rows;
    what they exchange after collecting (`exchange_step`) makes the metrics the run's and the
    decisions (prompt width, stopping) the same on every process.
    """
    cfg = job.cfg
    exchange = Exchange(cfg.distributed.timeout_s)
    counters = _Counters(job.bridge.client)
    signal_watch = SignalWatch(RewardWeights(cfg.rewards), cfg.rollout.max_unscored_steps)
    agreed_stop = False
    # One process stops when it is asked to; several at the step they agreed on in the exchange.
    stopping = (lambda: stop.requested) if jax.process_count() == 1 else (lambda: agreed_stop)
    try:
        while step < cfg.steps and not stopping():
            t0 = time.perf_counter()
            # Rollouts: this process's groups (the next step's start meanwhile), then the step as
            # every process sees it.
            result = _collect(job, collector, step, job.bridge.version)
            view, batch, share_s = _exchange(job, exchange, result, stop.requested)
            agreed_stop = view.stop
            signal_metrics = signal_watch.observe(step + 1, view.groups, view.counts["episodes_unscored"],
                                                  view.counts["episodes_scored"])
            # Update.
            t1 = time.perf_counter()
            metrics = learner.update(batch)
            learn_s = time.perf_counter() - t1
            step += 1
            metrics.update(rollout_metrics([e for g in view.groups for e in g], view.counts, cfg) | signal_metrics
                           | view.sums)
            # After the update: publish, count programs, evaluate. A bridge failing here must not
            # lose the step's metrics and samples, which are written before the run stops.
            failure = None
            try:
                metrics["time/sync_s"] = 0.0
                if step % cfg.sync_every == 0 or step == cfg.steps or stopping():
                    t_sync = time.perf_counter()
                    job.bridge.publish_weights(learner.state.params, step + 1)
                    metrics["time/sync_s"] = time.perf_counter() - t_sync
                metrics.update(counters.since_last())
                if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.steps and job.primary:
                    metrics.update(job.evaluate().metrics())
            except Exception as e:
                failure = e
            # Log, then checkpoint.
            metrics.update({**view.maxima, "time/learn_s": learn_s, "time/step_s": time.perf_counter() - t0,
                            "version": float(job.bridge.version), "learner/prompt_width": float(view.prompt_len)})
            if jax.process_count() > 1:
                metrics["time/share_s"] = share_s  # the exchange and this process's rows of the batch
            _log_step(job, logger, step, metrics, result)
            if failure is not None:
                raise failure
            job.ckpt.save(step, learner.state, {**meta, "step": step})
            if progress is not None:
                progress.update(step, metrics)
    except BaseException:
        _keep_steps(job.ckpt, learner, step, meta)
        raise
    return step, counters.after_first_step


def _collect(job: _Job, collector: Collector, step: int, version: int) -> StepRollouts:
    """This process's groups of `step`."""
    job.bridge.env_servers.check()  # a bundled environment server that keeps dying stops the run
    try:
        return collector.collect(step, version)
    except EnvironmentsDown:
        job.bridge.env_servers.check()  # ... and is why the step's episodes failed
        raise


def _exchange(job: _Job, exchange: Exchange, result: StepRollouts, stop_requested: bool):
    """The step as every process sees it, and this process's rows of the batch: (view, batch,
    seconds spent)."""
    t0 = time.perf_counter()
    trajs = [t for g in result.groups for t in g]
    view = exchange_step(exchange, result, prompt_width(trajs, job.cfg), stop_requested,
                         job.bridge.env_servers.metrics() | job.bridge.client.metrics(),
                         {"time/rollout_s": result.wall_s, "time/generate_s": result.generate_s,
                          "time/env_s": result.env_s, "time/reward_model_s": result.reward_s,
                          "rollout/staleness_max": float(result.staleness_max)})
    batch = rl_batch(trajs, job.cfg, job.pad_id, rows=job.share.count * job.cfg.learner.group_size,
                     prompt_len=view.prompt_len, model=job.model)
    return view, batch, time.perf_counter() - t0


def _log_step(job: _Job, logger: MetricsLogger | None, step: int, metrics: dict[str, float],
              result: StepRollouts) -> None:
    if logger is None:
        return
    logger.log(step, metrics)
    if job.cfg.log.samples_per_step:
        logger.samples(step, sample_rows(result.groups, job.bridge.tokenizer, job.cfg.log.samples_per_step))


class _Counters:
    """XLA programs the learner (this process) and the bridges needed, step by step: after this
    process's first step (a resumed run's included), a program is a shape the config missed, whether
    it compiled or came from the persistent cache. The compiles among them are logged too (few on a
    warm cache). A bridge counts from the first time it is seen: one restarted mid-run has warmed up
    anew, which is no shape missed. Also the bridges' engine work since the last step (JAX engine):
    its ticks' seconds (`engine/busy_s`), the part in device calls (`engine/device_s`: the rest is
    host bookkeeping) and the inserts' part of that (`engine/insert_s`: the rest is decoding), its
    decode calls (those that read each group's shared prompt once: `engine/shared_decode_calls`) and
    insert calls, and the tokens they sampled."""

    ENGINE = {f"engine.{k}": f"engine/{k}" for k in ("busy_s", "device_s", "insert_s", "decode_calls",
                                                     "shared_decode_calls", "insert_calls", "tokens")}

    def __init__(self, client: RolloutClient):
        self.client = client
        self.learner = (programs(), compiles())
        self.bridges = self._bridges()
        self.after_first_step: int | None = None  # None until the first step

    def _bridges(self) -> dict[BridgeClient, dict[str, float]]:
        keys = ("programs", "engine.compiles", *self.ENGINE)
        return {c: {k: s[k] for k in keys if k in s} for c, s in self.client.stats().items()}

    def since_last(self) -> dict[str, float]:
        learner, bridges = (programs(), compiles()), self._bridges()

        def grown(key: str) -> float:
            return sum(now.get(key, 0.0) - self.bridges.get(c, now).get(key, 0.0) for c, now in bridges.items())

        new = {"programs/learner": float(learner[0] - self.learner[0]), "programs/bridge": grown("programs"),
               "compiles/learner": float(learner[1] - self.learner[1]), "compiles/bridge": grown("engine.compiles")}
        new.update({name: grown(key) for key, name in self.ENGINE.items()
                    if any(key in now for now in bridges.values())})
        # The first step needs the programs; after it, none should be new.
        late = int(new["programs/learner"] + new["programs/bridge"])
        self.after_first_step = 0 if self.after_first_step is None else self.after_first_step + late
        self.learner, self.bridges = learner, bridges
        return new


def _final_evaluation(job: _Job, logger: MetricsLogger, step: int,
                      summary: dict[str, Any]) -> dict[str, float]:  # process 0's
    after = job.evaluate("after training")
    logger.log(step, after.metrics())
    stderr = after.stderr
    if "eval_before_stderr" in summary:
        stderr = math.sqrt(after.stderr ** 2 + summary["eval_before_stderr"] ** 2)
    final = {"eval_after": after.success, "eval_after_stderr": after.stderr, "eval_stderr": stderr}
    if "eval_after_warm_start" in summary:  # what RL added to the warm start: the figure RL is judged by
        final["rl_gain"] = after.success - summary["eval_after_warm_start"]
        final["rl_gain_stderr"] = math.sqrt(after.stderr ** 2 + summary["eval_after_warm_start_stderr"] ** 2)
        print(f"RL added {final['rl_gain']:+.3f} +- {final['rl_gain_stderr']:.3f} held-out success to the warm start",
              file=job.out, flush=True)
    return final


def _keep_steps(ckpt: TrainCheckpointer, learner: Learner, step: int, meta: dict[str, Any]) -> None:
    """However the run ends, the steps it took are kept (by one process: with several, the save is
    collective, and a process that failed would wait for the others forever)."""
    if step > 0 and ckpt.latest_step() != step and jax.process_count() == 1:
        try:
            ckpt.save(step, learner.state, {**meta, "step": step}, force=True)
            ckpt.wait()
        except Exception as e:
            if not disk_full(e):  # a full disk is what stopped the run, and its error says so
                log.warning("final checkpoint at step %d failed: %s", step, e)
