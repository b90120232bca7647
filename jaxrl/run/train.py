"""`jaxrl train`: environments + bridge + learner, one step at a time, nothing lost on the way out.

    check config and endpoints -> start environment servers and the bridge -> evaluate the base
    model -> supervised warm start (if configured) -> loop: rollouts, update, publish weights,
    evaluate, checkpoint -> final evaluation, plots, summary.

Weight versions: the bridge starts serving version 0 (the model directory); the learner's
weights after k updates are published as version k + 1 (the warm start's as version 1). Ctrl-C /
SIGTERM finish the current step, write a checkpoint and stop every child process; a second Ctrl-C
stops at once (children are still stopped). `--resume` continues from the newest checkpoint.

Several processes (hosts) run one job together when jax.distributed is set up (`distributed.*`,
or the cluster's environment; see jaxrl.run.distributed): each collects its share of a step's
groups from bridges of its own and feeds the learner its rows; process 0 alone evaluates and
writes the run directory's metrics, logs, plots and samples; processes other than 0 put their
children's logs in RUN/logs/process-<i>/. A run resumes on any process count.
"""

from __future__ import annotations

import concurrent.futures
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

from jaxrl.checkpoints import TrainCheckpointer, abstract_like
from jaxrl.compilation import compiles, use_persistent_cache
from jaxrl.learner import Learner
from jaxrl.models import load_pretrained, load_tokenizer
from jaxrl.run import report
from jaxrl.run.batches import prompt_width, rl_batch
from jaxrl.run.collection import Collector, EnvironmentsDown, Share, StepRollouts, rollout_metrics
from jaxrl.run.config import DistributedConfig, TrainConfig
from jaxrl.run.distributed import Exchange, exchange_step, initialize, share_of
from jaxrl.run.evaluation import evaluate
from jaxrl.run.record import record_session
from jaxrl.run.rewards import RewardWeights, SignalWatch
from jaxrl.run.rollout_client import RolloutClient
from jaxrl.run.run_dir import RunDir, disk_full, snapshot_directory
from jaxrl.run.services import StartupError, bridge_token, check_services, start_services
from jaxrl.run.supervision import EnvServers
from jaxrl.run.tasks import TaskSource
from jaxrl.run.tracking import MetricsLogger, Progress, read_metrics
from jaxrl.run.typed_config import dump_yaml
from jaxrl.run.warm_start import demonstrations, warm_start
from jaxrl.sharding import make_mesh
from jaxrl.snapshots import SnapshotWriter, copy_snapshot, delete_snapshot, snapshot_versions

log = logging.getLogger("jaxrl.train")
SNAPSHOTS_KEPT = 3


class Interrupted(KeyboardInterrupt):
    """A second SIGINT/SIGTERM: stop now (children are still stopped on the way out)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signal = signal.Signals(signum)


class _Stop:
    """SIGINT/SIGTERM: the first asks the loop to stop after this step, the second stops now."""

    def __init__(self):
        self.signal: signal.Signals | None = None
        self._old = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise Interrupted(signum)
        self.signal = signal.Signals(signum)
        print(f"\njaxrl train: {signal.Signals(signum).name}: stopping after this step "
              "(checkpoint written); again to stop now", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


@dataclasses.dataclass
class _Run:
    """What the phases of one run share."""

    cfg: TrainConfig
    run: RunDir
    ckpt: TrainCheckpointer
    client: RolloutClient
    tasks: TaskSource
    tokenizer: Any
    out: Any
    summary: dict[str, Any]
    snapshots: Path | str  # where snapshots are published and the bridges read them (see snapshot_directory)
    env_servers: EnvServers  # the bundled environment servers, restarted when they die
    share: Share  # this process's groups of every step (all of them with one process)
    step: int = 0
    version: int = 0  # the weights the bridges serve
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # saved with every checkpoint
    writer: SnapshotWriter | None = None
    logger: MetricsLogger | None = None  # process 0's

    @property
    def primary(self) -> bool:
        """Process 0: the one that evaluates and writes the run directory's logs."""
        return jax.process_index() == 0

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.tokenizer.eos_token_id,)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id

    def evaluate(self, what: str | None = None):
        """The held-out evaluation on the served weights; printed when it has a name."""
        result = evaluate(self.client, self.tasks.held_out(), self.cfg, self.version, self.stop_ids)
        if what is not None:
            print(f"eval {what}: {result.line()}", file=self.out, flush=True)
        return result


def train(cfg: TrainConfig, resume: bool = False, out=sys.stdout) -> dict[str, Any]:
    """Runs the training job `cfg` (this process's part of it); returns the summary printed as the last line."""
    wall_start = time.perf_counter()
    initialize(cfg.distributed)
    primary = jax.process_index() == 0
    check_services(cfg)
    share = share_of(make_mesh(cfg.mesh), cfg)  # this process's groups of every step
    model_dir = _ensure_model_once(cfg)
    run = RunDir.create(cfg.run_dir)
    ckpt = TrainCheckpointer(run.checkpoints, keep=cfg.keep_checkpoints, every=cfg.checkpoint_every)
    start_step = _start_step(run, ckpt, resume)
    if primary:  # launch settings are not the run's: it resumes on any process count
        dump_yaml(dataclasses.replace(cfg, distributed=DistributedConfig()), run.config)
    record_session(run, cfg, start_step)
    logs = run.logs if primary else run.logs / f"process-{jax.process_index()}"
    logs.mkdir(exist_ok=True)
    summary: dict[str, Any] = {"run_dir": str(run.path)}
    bridge_env = use_persistent_cache(cfg.compilation_cache)
    token = bridge_token(cfg)
    with _Stop() as stop, contextlib.ExitStack() as stack:
        stack.enter_context(_log_file(logs / "train.log"))
        stack.callback(ckpt.close)
        # Entered before the bridges start, so that a memory directory goes after they stop. Room
        # for the snapshots kept and the one being written, each about the model's own weights.
        weights_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        snapshots, _ = stack.enter_context(snapshot_directory(
            run, cfg.snapshot_dir, local_bridges=not cfg.bridge.addresses and jax.process_count() == 1,
            needs_bytes=(SNAPSHOTS_KEPT + 1) * weights_bytes))
        # The children start (seconds: imports, model load, compiles) while this process loads the tokenizer.
        services = stack.enter_context(contextlib.ExitStack())
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="start") as pool:
            started = pool.submit(start_services, cfg, model_dir, logs, services, token, snapshots, bridge_env)
            tokenizer = load_tokenizer(model_dir)
            if primary:
                tokenizer.save_pretrained(run.tokenizer)
            client = RolloutClient(started.result().addresses, cfg, token, started.result().bridges)
        summary["startup"] = {"services_s": round(time.perf_counter() - wall_start, 2)}
        stack.callback(client.close)
        r = _Run(cfg, run, ckpt, client, TaskSource(cfg), tokenizer, out, summary, snapshots,
                 started.result().env_servers, share)
        if start_step is None:
            _timed(r, "eval_before_s", _evaluate_base, r, model_dir)
        learner = _make_learner(r, model_dir, start_step, stack)
        r.summary["startup"]["first_step_at_s"] = round(time.perf_counter() - wall_start, 2)
        print(f"process {jax.process_index()} of {jax.process_count()}: " * (jax.process_count() > 1) +
              "start-up: first step at {first_step_at_s:.1f} s ({phases})".format(
            **r.summary["startup"], phases=", ".join(f"{k[:-2]} {v:.1f} s" for k, v in r.summary["startup"].items()
                                                     if k != "first_step_at_s")), file=out, flush=True)
        stack.callback(_keep_steps, r, learner)
        _loop(r, learner, stop, stack)
        if ckpt.latest_step() != r.step:
            ckpt.save(r.step, learner.state, {**r.meta, "step": r.step}, force=True)
        ckpt.wait()
        summary["steps"] = r.step
        if r.step >= cfg.steps and cfg.eval.episodes and primary:
            _final_evaluation(r)
        if r.step < cfg.steps:  # stopped: by a signal to this process or to another one
            summary["stopped"] = (stop.signal or signal.SIGTERM).name  # `jaxrl train` exits 128 + its number
    summary["wall_s"] = round(time.perf_counter() - wall_start, 1)
    summary["final"] = _finish_report(run.path, out) if primary else {}
    return summary


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


def _evaluate_base(r: _Run, model_dir: Path) -> None:
    """Bridges of our own start on the model; running ones may serve anything: give them ours. Then
    the base model's held-out success."""
    if r.cfg.bridge.addresses:
        base = load_pretrained(model_dir, param_dtype=r.cfg.model.dtype)
        with contextlib.closing(SnapshotWriter(r.snapshots, base.cfg, keep=SNAPSHOTS_KEPT)) as writer:
            writer.publish(nnx.split(base)[1], 0)
        r.client.load_snapshot(str(r.snapshots), 0)
    if r.cfg.eval.before and r.cfg.eval.episodes and r.primary:
        before = r.evaluate("before training")
        r.summary["eval_before"], r.summary["eval_before_stderr"] = before.success, before.stderr


def _make_learner(r: _Run, model_dir: Path, start_step: int | None, stack: contextlib.ExitStack) -> Learner:
    """The learner on the base model, warm-started on demonstrations or restored from a checkpoint;
    its weights published to the bridges when they differ from the base model's."""
    cfg = r.cfg
    mesh = make_mesh(cfg.mesh)
    model = load_pretrained(model_dir, param_dtype=cfg.model.dtype)
    warm = bool(cfg.sft.steps) and start_step is None
    if warm:
        model, metrics = _timed(r, "warm_start_s",
                                lambda: warm_start(model, demonstrations(r.client, r.tasks, cfg), cfg, mesh, r.pad_id))
        r.summary["sft"] = metrics
        print(f"warm start: {json.dumps(metrics)}", file=r.out, flush=True)
    t0 = time.perf_counter()
    learner = Learner(model, cfg.learner_config(), mesh)
    model_cfg = model.cfg
    del model
    if start_step is not None:
        learner.state, meta = r.ckpt.restore(abstract_like(learner.state, learner.shardings))
        r.step = int(meta["step"])
        r.summary.update({k: meta[k] for k in ("eval_before", "eval_before_stderr") if k in meta})
        print(f"resumed from step {r.step}", file=r.out, flush=True)
    r.meta = {"model_config": model_cfg.to_hf(),
              **{k: r.summary[k] for k in ("eval_before", "eval_before_stderr") if k in r.summary}}
    r.writer = SnapshotWriter(r.snapshots, model_cfg, keep=SNAPSHOTS_KEPT)
    stack.callback(_close_writer, r)
    for stale in [v for v in r.writer.versions() if v > r.step]:
        r.writer.delete(stale)  # published after the checkpoint we resume from
    if r.snapshots != r.run.snapshots.absolute() and r.primary:
        # What the run directory keeps of an earlier run: up to the version of the checkpoint resumed from.
        for stale in [v for v in snapshot_versions(r.run.snapshots) if v > r.step + 1]:
            delete_snapshot(r.run.snapshots, stale)
    if r.step > 0 or warm:
        _publish(r, learner, r.step + 1)
    r.summary["startup"]["learner_s"] = round(time.perf_counter() - t0, 2)
    if warm and cfg.eval.episodes and r.primary:
        r.summary["eval_after_warm_start"] = _timed(r, "eval_after_warm_start_s", r.evaluate,
                                                    "after the warm start").success
    return learner


def _timed(r: _Run, key: str, fn, *args):
    """fn(*args), its seconds kept in the summary's start-up phases under `key`."""
    t0 = time.perf_counter()
    try:
        return fn(*args)
    finally:
        r.summary["startup"][key] = round(time.perf_counter() - t0, 2)


def _publish(r: _Run, learner: Learner, version: int) -> float:
    """Writes the learner's weights as snapshot `version` and has every bridge serve them."""
    t0 = time.perf_counter()
    r.writer.publish(learner.state.params, version)
    r.client.load_snapshot(str(r.snapshots), version)
    r.version = version
    return time.perf_counter() - t0


def _close_writer(r: _Run) -> None:
    """However the run ends: the snapshot the bridges serve also lands in RUN/snapshots when the
    snapshots live elsewhere (for `jaxrl eval RUN`, `jaxrl export`)."""
    r.writer.close()
    if r.snapshots == r.run.snapshots.absolute() or not r.primary:
        return
    try:
        if r.version in r.writer.versions():
            copy_snapshot(r.snapshots, r.version, r.run.snapshots, keep=r.writer.keep)
    except (OSError, ValueError) as e:  # TensorStore's errors (a bucket that stopped answering) are ValueErrors
        if not disk_full(e):  # when it is, the run's own error says so
            log.warning("copying snapshot %d to %s failed: %s", r.version, r.run.snapshots, e)


def _loop(r: _Run, learner: Learner, stop: _Stop, stack: contextlib.ExitStack) -> None:
    """Rollouts, update, publish, evaluate, checkpoint, log: one step at a time until done or stopped.

    With several processes, each collects its share of the step's groups and trains on its rows;
    what they exchange after collecting (`exchange_step`) makes the metrics the run's and the
    decisions (prompt width, stopping) the same on every process.
    """
    cfg = r.cfg
    collector = stack.enter_context(contextlib.closing(Collector(cfg, r.client, r.tasks, r.stop_ids, r.share)))
    rows = r.share.count * cfg.learner.group_size
    exchange = Exchange(cfg.distributed.timeout_s)
    if r.primary:
        r.logger = stack.enter_context(MetricsLogger(r.run.path, tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb,
                                                     resume_step=r.step + 1 if r.step > 0 else None))
    progress = stack.enter_context(Progress(cfg.steps, initial=r.step)) if cfg.log.progress and r.primary else None
    seen = (compiles(), _bridge_compiles(r.client))
    signal_watch = SignalWatch(RewardWeights(cfg.rewards), cfg.rollout.max_unscored_steps)
    agreed_stop = False
    # One process stops when it is asked to; several at the step they agreed on in the exchange.
    stopping = (lambda: stop.requested) if jax.process_count() == 1 else (lambda: agreed_stop)
    while r.step < cfg.steps and not stopping():
        t0 = time.perf_counter()
        r.env_servers.check()  # a bundled environment server that keeps dying stops the run
        try:
            result = collector.collect(r.step, r.version)
        except EnvironmentsDown:
            r.env_servers.check()  # ... and is why the step's episodes failed
            raise
        if r.step + 1 < cfg.steps:
            collector.prefetch_next(r.step + 1, r.version)
        trajs = [t for g in result.groups for t in g]
        t1 = time.perf_counter()
        step = exchange_step(exchange, result, prompt_width(trajs, cfg), stop.requested,
                             r.env_servers.metrics() | r.client.metrics(),
                             {"time/rollout_s": result.wall_s, "time/generate_s": result.generate_s,
                              "time/env_s": result.env_s})
        agreed_stop = step.stop
        signal_metrics = signal_watch.observe(r.step + 1, step.groups, step.counts["episodes_unscored"],
                                              step.counts["episodes_scored"])
        batch = rl_batch(trajs, cfg, r.pad_id, rows=rows, prompt_len=step.prompt_len)
        share_s = time.perf_counter() - t1
        t1 = time.perf_counter()
        metrics = learner.update(batch)
        learn_s = time.perf_counter() - t1
        r.step += 1
        metrics.update(rollout_metrics([e for g in step.groups for e in g], step.counts, cfg) | signal_metrics | step.sums)
        # The update is done: a bridge failing from here on (publish, stats, evaluation) must not lose
        # the step's metrics and samples, which are written before the run stops, and before its checkpoint.
        failure = None
        try:
            sync_s = 0.0
            if r.step % cfg.sync_every == 0 or r.step == cfg.steps or stopping():
                sync_s = _publish(r, learner, r.step + 1)
            metrics.update({"time/sync_s": sync_s})
            now = (compiles(), _bridge_compiles(r.client))  # after step 1, a compile is a shape the config missed
            metrics.update({"compiles/learner": float(now[0] - seen[0]), "compiles/bridge": float(now[1] - seen[1])})
            if r.step > 1:
                r.summary["compiles_after_step_1"] = r.summary.get("compiles_after_step_1", 0) + sum(now) - sum(seen)
            seen = now
            if cfg.eval.every and r.step % cfg.eval.every == 0 and r.step < cfg.steps and r.primary:
                metrics.update(r.evaluate().metrics())
        except Exception as e:
            failure = e
        metrics.update({**step.maxima, "time/learn_s": learn_s, "time/step_s": time.perf_counter() - t0,
                        "version": float(r.version)})
        if jax.process_count() > 1:
            metrics["time/share_s"] = share_s  # the exchange and this process's rows of the batch
        if r.logger is not None:
            r.logger.log(r.step, metrics)
            if cfg.log.samples_per_step:
                r.logger.samples(r.step, _sample_rows(result, r.tokenizer, cfg.log.samples_per_step))
        if failure is not None:
            raise failure  # the step's checkpoint is written on the way out (_keep_steps)
        r.ckpt.save(r.step, learner.state, {**r.meta, "step": r.step})
        if progress is not None:
            progress.update(r.step, metrics)


def _bridge_compiles(client: RolloutClient) -> int:
    return int(sum(stats.get("engine.compiles", 0) for stats in client.stats()))


def _final_evaluation(r: _Run) -> None:  # process 0's
    after = r.evaluate("after training")
    r.logger.log(r.step, after.metrics())
    r.summary["eval_after"], r.summary["eval_stderr"] = after.success, after.stderr
    if "eval_before_stderr" in r.summary:
        r.summary["eval_stderr"] = math.sqrt(after.stderr ** 2 + r.summary["eval_before_stderr"] ** 2)


def _keep_steps(r: _Run, learner: Learner) -> None:
    """However the run ends, the steps it took are kept (by one process: with several, the save is
    collective, and a process that failed would wait for the others forever)."""
    if r.step > 0 and r.ckpt.latest_step() != r.step and jax.process_count() == 1:
        try:
            r.ckpt.save(r.step, learner.state, {**r.meta, "step": r.step}, force=True)
            r.ckpt.wait()
        except Exception as e:
            if not disk_full(e):  # a full disk is what stopped the run, and its error says so
                log.warning("final checkpoint at step %d failed: %s", r.step, e)


@contextlib.contextmanager
def _log_file(path: Path):
    """Every warning and error logged while the run trains, libraries' too, with tracebacks, in `path`."""
    handler = logging.FileHandler(path)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()


def _sample_rows(result: StepRollouts, tokenizer, k: int) -> list[dict[str, Any]]:
    rows = []
    for group in result.groups[:k]:
        t = group[0]
        rows.append({"group_id": t.group_id, "env": t.env, "rewards": t.rewards, "finish_reason": t.finish_reason,
                     "prompt": tokenizer.decode(t.prompt_ids), "completion": tokenizer.decode(t.completion_ids)})
    return rows


def _finish_report(run_dir: Path, out) -> dict[str, float]:
    rows = read_metrics(run_dir)
    if not rows:
        return {}
    report.plot_run(run_dir)
    keys = [k for k in ("reward/mean", "eval/success", "eval/reward/mean", "loss", "kl", "entropy", "grad_norm",
                        "completion/model_tokens", "time/step_s") if any(k in r for r in rows)]
    print(report.summary_table(rows, keys), file=out, flush=True)
    last = {}
    for r in rows:
        last.update({k: r[k] for k in keys if r.get(k) is not None})
    return {k: round(float(v), 4) for k, v in last.items()}


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
        built = json.loads((model_dir / "config.json").read_text())
        want = {"hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
                "num_hidden_layers": t.num_layers}
        differ = {k: (built.get(k), v) for k, v in want.items() if built.get(k) != v}
        if differ:
            raise StartupError(f"model.dir {model_dir} holds a tiny model that differs from model.tiny "
                               f"({', '.join(f'{k}: {a} != {b}' for k, (a, b) in differ.items())}); delete it "
                               "to rebuild, or point model.dir elsewhere")
        return model_dir
    from jaxrl.tiny import build_tiny_model

    print(f"building tiny {t.family} model in {model_dir}", file=sys.stderr)
    build_tiny_model(model_dir, t.family, seed=t.seed, hidden_size=t.hidden_size,
                     intermediate_size=t.intermediate_size, num_layers=t.num_layers)
    return model_dir
