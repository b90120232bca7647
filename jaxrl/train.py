"""`jaxrl train`: environments + bridge + learner, one step at a time, nothing lost on the way out.

    check config and endpoints -> start environment servers and the bridge -> evaluate the base
    model -> supervised warm start (if configured) -> loop: rollouts, update, publish weights,
    evaluate, checkpoint -> final evaluation, plots, summary.

Weight versions: the bridge starts serving version 0 (the model directory); the learner's
weights after k updates are published as version k + 1. Ctrl-C / SIGTERM finish the current
step, write a checkpoint and stop every child process; a second Ctrl-C stops at once (children
are still stopped). `--resume` continues from the newest checkpoint of the run directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bridge.envs.spec import EnvConfigError
from jaxrl.config import TrainConfig
from jaxrl.typed_config import dump_yaml

log = logging.getLogger("jaxrl.train")


class StartupError(Exception):
    """The run cannot start (bad model directory, unreachable bridge or environment)."""


# -- checks before any heavy work -----------------------------------------------------------------


def check_startup(cfg: TrainConfig) -> None:
    """Fails fast, with one line, on what would otherwise fail after minutes of loading."""
    from bridge.client import BridgeClient, BridgeError
    from bridge.envs.episode import build_connector
    from bridge.envs.session import EnvError

    model_dir = Path(cfg.model.dir)
    if not (model_dir / "config.json").is_file() and cfg.model.tiny is None:
        raise StartupError(f"model.dir {model_dir}: not a model directory (no config.json); point it at a "
                           "Hugging Face model directory, or set model.tiny to build a tiny one")
    for spec in cfg.envs:
        if spec.bundled:
            continue
        try:
            connector = build_connector(spec)
            if spec.url:
                asyncio.run(connector.endpoint.check())
        except (EnvConfigError, EnvError) as e:
            raise StartupError(f"environment {spec.name!r}: {e}") from None
    for address in cfg.bridge.addresses:
        try:
            with BridgeClient(address, timeout_s=10.0) as client:
                client.health()
        except BridgeError as e:
            raise StartupError(f"bridge.addresses: {address} does not answer ({e}); start it with "
                               "`jaxrl bridge --model DIR --envs FILE`, or leave bridge.addresses empty") from None


# -- the run ----------------------------------------------------------------------------------------


class _Stop:
    """SIGINT/SIGTERM: the first asks the loop to stop after this step, the second stops now."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\njaxrl train: {signal.Signals(signum).name}: stopping after this step "
              "(checkpoint written); again to stop now", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


@dataclasses.dataclass
class EvalResult:
    success: float
    reward: float
    stderr: float
    episodes: int

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        return {f"{prefix}/success": self.success, f"{prefix}/reward/mean": self.reward,
                f"{prefix}/stderr": self.stderr, f"{prefix}/episodes": float(self.episodes)}


def evaluate(client, tasks, cfg: TrainConfig, version: int, stop_ids: tuple[int, ...]) -> EvalResult:
    """Held-out episodes on the bridge's current weights; pass@k success over each task's samples."""
    from bridge.engines.base import SamplingParams
    from jaxrl.rollouts import weighted_reward

    e, r = cfg.eval, cfg.rollout
    params = SamplingParams(temperature=e.temperature, max_tokens=r.max_tokens, stop_token_ids=stop_ids,
                            seed=cfg.seed)
    groups = client.request(tasks, [f"eval-{version}-{i}" for i in range(len(tasks))], e.pass_k, params, version)
    keys, weights = cfg.reward_keys, [w.weight for w in cfg.rewards]
    successes, rewards = [], []
    for group in groups:
        rs = [weighted_reward(t, keys, weights) for t in group]
        rs = [x if x is not None else 0.0 for x in rs]
        successes.append(float(max(rs) >= e.success_threshold))
        rewards.append(float(np.mean(rs)))
    n = len(successes)
    p = float(np.mean(successes)) if n else math.nan
    return EvalResult(p, float(np.mean(rewards)) if n else math.nan, math.sqrt(p * (1 - p) / max(n, 1)), n)


def _sample_rows(result, tokenizer, k: int) -> list[dict[str, Any]]:
    rows = []
    for group in result.groups[:k]:
        t = group[0]
        rows.append({"env": t.env, "rewards": t.rewards, "finish_reason": t.finish_reason,
                     "prompt": tokenizer.decode(t.prompt_ids), "completion": tokenizer.decode(t.completion_ids)})
    return rows


def train(cfg: TrainConfig, resume: bool = False, out=sys.stdout) -> dict[str, Any]:
    """Runs the training job `cfg`; returns the summary printed as the last line."""
    from flax import nnx
    from transformers import AutoTokenizer

    from bridge.envs.launcher import EnvServerProcess
    from bridge.process import BridgeProcess
    from jaxrl.checkpoints import TrainCheckpointer, abstract_like
    from jaxrl.learner import Learner
    from jaxrl.models import load_pretrained
    from jaxrl.rollouts import Collector, RolloutClient, build_batch, rollout_metrics
    from jaxrl.run_dir import RunDir
    from jaxrl.sharding import make_mesh
    from jaxrl.snapshots import SnapshotWriter
    from jaxrl.tasks import TaskSource
    from jaxrl.tracking import MetricsLogger, Progress

    wall_start = time.perf_counter()
    check_startup(cfg)
    model_dir = _ensure_model(cfg)
    run = RunDir.create(cfg.run_dir)
    ckpt = TrainCheckpointer(run.checkpoints, keep=cfg.keep_checkpoints, every=cfg.checkpoint_every)
    start_step = ckpt.latest_step() if resume else None
    if resume and start_step is None:
        print(f"jaxrl train: --resume: {run.checkpoints} has no checkpoint yet; starting from step 0",
              file=sys.stderr)
    if not resume and ckpt.latest_step() is not None:
        raise StartupError(f"{run.path} already holds checkpoints: pass --resume to continue that run, or "
                           "choose another run_dir")
    dump_yaml(cfg, run.config)
    (run.path / "logs").mkdir(exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tokenizer.save_pretrained(run.tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop_ids = (tokenizer.eos_token_id,)
    tasks = TaskSource(cfg)

    children: list[Any] = []
    summary: dict[str, Any] = {"run_dir": str(run.path)}
    client = collector = logger = progress = writer = learner = None
    step = 0
    meta_base: dict[str, Any] = {}
    with _Stop() as stop:
        try:
            specs = []
            for spec in cfg.envs:
                if spec.bundled:
                    server = EnvServerProcess.start(spec.bundled, max_concurrent_envs=spec.max_concurrent_envs,
                                                    seed=spec.seed, log_path=run.path / "logs" / f"env-{spec.name}.log")
                    children.append(server)
                    spec = dataclasses.replace(spec, bundled=None, url=server.url)
                specs.append(spec.to_dict())
            envs_file = run.path / "bridge_envs.json"
            envs_file.write_text(json.dumps({
                "envs": specs, "rewards": [dataclasses.asdict(r) for r in cfg.rewards],
                "tool_parser": cfg.bridge.tool_parser, "chat_template_kwargs": cfg.bridge.chat_template_kwargs,
            }, indent=1))
            addresses = list(cfg.bridge.addresses)
            if not addresses:
                bridge = BridgeProcess.start(model_dir, engine=cfg.bridge.engine, max_batch=cfg.bridge.max_batch,
                                             seed=cfg.seed, engine_kwargs=cfg.bridge.engine_kwargs,
                                             envs_file=envs_file, timeout=cfg.bridge.start_timeout_s,
                                             log_path=run.path / "logs" / "bridge.log")
                children.append(bridge)
                addresses = [bridge.address]
            client = RolloutClient(addresses, cfg)
            collector = Collector(cfg, client, tasks, stop_ids)
            held_out = tasks.held_out()
            if cfg.bridge.addresses and start_step is None:
                # Bridges of our own start on the model; others may serve anything: give them ours.
                base = load_pretrained(model_dir, param_dtype=cfg.model.dtype)
                base_writer = SnapshotWriter(run.snapshots, base.cfg, keep=3)
                base_writer.publish(nnx.split(base)[1], 0)
                base_writer.close()
                client.load_snapshot(str(run.snapshots), 0)
                del base

            if start_step is None and cfg.eval.before and cfg.eval.episodes:
                before = evaluate(client, held_out, cfg, 0, stop_ids)
                summary["eval_before"], summary["eval_before_stderr"] = before.success, before.stderr
                print(f"eval before training: success {before.success:.3f} +- {before.stderr:.3f} "
                      f"(mean reward {before.reward:.3f}, {before.episodes} held-out episodes)", file=out, flush=True)

            init_dir = model_dir
            if cfg.sft.steps and start_step is None:
                from jaxrl.sft import run_sft

                sft_metrics = run_sft(model_dir, run.path / "sft", cfg.envs, cfg.sft, cfg.mesh, cfg.seed,
                                      task_fields=cfg.data.task_fields, tool_parser=cfg.bridge.tool_parser)
                summary["sft"] = sft_metrics
                init_dir = run.path / "sft"
                print(f"warm start: {json.dumps(sft_metrics)}", file=out, flush=True)

            model = load_pretrained(init_dir, param_dtype=cfg.model.dtype)
            learner_cfg = _learner_config(cfg)
            mesh = make_mesh(cfg.mesh)
            learner = Learner(model, learner_cfg, mesh)
            model_cfg = model.cfg
            del model
            step = 0
            if start_step is not None:
                learner.state, meta = ckpt.restore(abstract_like(learner.state, learner.shardings))
                step = int(meta["step"])
                summary.update({k: meta[k] for k in ("eval_before", "eval_before_stderr") if k in meta})
                print(f"resumed from step {step}", file=out, flush=True)
            writer = SnapshotWriter(run.snapshots, model_cfg, keep=3)
            for stale in [v for v in writer.manager.all_steps() if v > step]:
                writer.manager.delete(stale)  # published after the checkpoint we resume from

            def publish(version: int) -> float:
                t0 = time.perf_counter()
                writer.publish(learner.state.params, version)
                client.load_snapshot(str(run.snapshots), version)
                return time.perf_counter() - t0

            if step > 0 or init_dir != model_dir:
                publish(step + 1)
            if init_dir != model_dir and cfg.eval.episodes:
                warm = evaluate(client, held_out, cfg, step + 1, stop_ids)
                summary["eval_after_warm_start"] = warm.success
                print(f"eval after the warm start: success {warm.success:.3f} +- {warm.stderr:.3f} "
                      f"(mean reward {warm.reward:.3f})", file=out, flush=True)
            logger = MetricsLogger(run.path, tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb,
                                   resume_step=step + 1 if start_step is not None else None)
            progress = Progress(cfg.steps, initial=step) if cfg.log.progress else None
            version = step + 1 if (step > 0 or init_dir != model_dir) else 0
            meta_base = {"model_config": model_cfg.to_hf(), **{k: summary[k] for k in
                                                                ("eval_before", "eval_before_stderr") if k in summary}}
            while step < cfg.steps and not stop.requested:
                t0 = time.perf_counter()
                result = collector.collect(step, version)
                if step + 1 < cfg.steps:
                    collector.prefetch_next(step + 1, version)
                batch = build_batch(result.groups, cfg, pad_id, learner_cfg.loss.is_level != "none")
                t1 = time.perf_counter()
                metrics = learner.update(batch)
                learn_s = time.perf_counter() - t1
                step += 1
                sync_s = 0.0
                if step % cfg.sync_every == 0 or step == cfg.steps or stop.requested:
                    version = step + 1
                    sync_s = publish(version)
                metrics.update(rollout_metrics(result, cfg))
                metrics.update({"time/rollout_s": result.wall_s, "time/generate_s": result.generate_s,
                                "time/env_s": result.env_s, "time/learn_s": learn_s, "time/sync_s": sync_s,
                                "time/step_s": time.perf_counter() - t0, "version": float(version)})
                if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.steps:
                    metrics.update(evaluate(client, held_out, cfg, version, stop_ids).metrics())
                ckpt.save(step, learner.state, {**meta_base, "step": step})
                logger.log(step, metrics)
                if cfg.log.samples_per_step:
                    logger.samples(step, _sample_rows(result, tokenizer, cfg.log.samples_per_step))
                if progress is not None:
                    progress.update(step, metrics)
            if ckpt.latest_step() != step:
                ckpt.save(step, learner.state, {**meta_base, "step": step}, force=True)
            ckpt.wait()
            summary["steps"] = step
            if step >= cfg.steps and cfg.eval.episodes:
                after = evaluate(client, held_out, cfg, version, stop_ids)
                logger.log(step, after.metrics())
                summary["eval_after"], summary["eval_stderr"] = after.success, after.stderr
                if "eval_before_stderr" in summary:
                    summary["eval_stderr"] = math.sqrt(after.stderr ** 2 + summary["eval_before_stderr"] ** 2)
                print(f"eval after training: success {after.success:.3f} +- {after.stderr:.3f} "
                      f"(mean reward {after.reward:.3f}, {after.episodes} held-out episodes)", file=out, flush=True)
            if stop.requested and step < cfg.steps:
                summary["stopped"] = "signal"
        finally:
            if learner is not None and step > 0 and ckpt.latest_step() != step:
                try:  # however the run ends, the steps it took are kept
                    ckpt.save(step, learner.state, {**meta_base, "step": step}, force=True)
                    ckpt.wait()
                except Exception as e:
                    log.warning("final checkpoint at step %d failed: %s", step, e)
            for closer in (progress, logger, collector, client, writer):
                if closer is not None:
                    try:
                        closer.close()
                    except Exception as e:  # the children must still be stopped
                        log.warning("closing %s failed: %s", type(closer).__name__, e)
            for child in reversed(children):
                child.stop()
            ckpt.close()
    logger_rows = _finish_report(run.path, out)
    summary["wall_s"] = round(time.perf_counter() - wall_start, 1)
    summary["final"] = logger_rows
    return summary


def _finish_report(run_dir: Path, out) -> dict[str, float]:
    from jaxrl import report
    from jaxrl.tracking import read_metrics

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


def _learner_config(cfg: TrainConfig):
    """The learner settings the run implies: reward weights from `rewards`, the sampling temperature."""
    adv = dataclasses.replace(cfg.learner.advantages, reward_weights=tuple(r.weight for r in cfg.rewards))
    opt = cfg.learner.optimizer
    if opt.total_steps < cfg.steps * cfg.learner.num_iterations:
        opt = dataclasses.replace(opt, total_steps=cfg.steps * cfg.learner.num_iterations)
    return dataclasses.replace(cfg.learner, advantages=adv, optimizer=opt, temperature=cfg.rollout.temperature)


def _ensure_model(cfg: TrainConfig) -> Path:
    model_dir = Path(cfg.model.dir)
    t = cfg.model.tiny
    if t is not None and (model_dir / "config.json").is_file():
        built = json.loads((model_dir / "config.json").read_text())
        want = {"hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
                "num_hidden_layers": t.num_layers}
        differ = {k: (built.get(k), v) for k, v in want.items() if built.get(k) != v}
        if differ:
            raise StartupError(f"model.dir {model_dir} holds a tiny model that differs from model.tiny "
                               f"({', '.join(f'{k}: {a} != {b}' for k, (a, b) in differ.items())}); delete it "
                               "to rebuild, or point model.dir elsewhere")
    if not (model_dir / "config.json").is_file():
        from jaxrl.tiny import build_tiny_model

        print(f"building tiny {t.family} model in {model_dir}", file=sys.stderr)
        build_tiny_model(model_dir, t.family, seed=t.seed, hidden_size=t.hidden_size,
                         intermediate_size=t.intermediate_size, num_layers=t.num_layers)
    return model_dir
