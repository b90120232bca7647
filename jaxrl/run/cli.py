"""The `jaxrl` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

import yaml

from jaxrl.host_memory import restart_tuned


# `jaxrl train` flag -> the config key it sets (per process, so flags rather than the shared config)
DISTRIBUTED_FLAGS = {"coordinator": "distributed.coordinator", "num_processes": "distributed.num_processes",
                     "process_id": "distributed.process_id"}


def _load_train_config(args, prog: str):
    from jaxrl.run.config import load_config
    from jaxrl.run.typed_config import ConfigError

    flags = [f"{key}={getattr(args, flag)}" for flag, key in DISTRIBUTED_FLAGS.items()
             if getattr(args, flag, None) is not None]
    try:
        return load_config(args.config, [*(args.set or []), *flags], args.gin or [])
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return None


def _train(args) -> int:
    """Trains against environments; the last stdout line is a JSON summary of the run.

    Exit codes: 0 the run finished its steps; 2 it could not start (nothing was started); 1 it
    failed while running (one line here, the traceback in RUN/logs/); 128 + the signal's number
    when a signal stopped it (after its checkpoint). `--replay RUN` reruns RUN and exits 1 when its
    metrics differ.
    """
    cfg = _replay_config(args) if args.replay is not None else _load_train_config(args, "jaxrl train")
    if cfg is None:
        return 2
    import logging

    # Our warnings one line each on stderr; libraries' (Orbax logs every failed write thread with
    # its traceback) only in RUN/logs/train.log. Libraries may have configured the root logger already.
    logging.basicConfig(level=logging.WARNING, format="jaxrl train: %(levelname)s: %(message)s", force=True)
    for handler in logging.getLogger().handlers:
        handler.addFilter(lambda record: record.name.split(".")[0] in ("jaxrl", "bridge"))
    logging.raiseExceptions = False  # a log file on a full disk must not print its own tracebacks
    from jaxrl.run.tracking import libraries_to_the_log

    libraries_to_the_log()
    from jaxrl.run.services import StartupError
    from jaxrl.run.stopping import Interrupted
    from jaxrl.run.train import train

    try:
        summary = train(cfg, resume=args.resume)
    except StartupError as e:
        print(f"jaxrl train: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"jaxrl train: stopped by {e.signal.name}", file=sys.stderr)
        return 128 + e.signal
    except KeyboardInterrupt:
        print("jaxrl train: stopped", file=sys.stderr)
        return 130
    except Exception as e:
        print(f"jaxrl train: error: {_failure_line(e, cfg.run_dir)} (traceback: {_save_traceback(e, cfg.run_dir)})",
              file=sys.stderr, flush=True)
        _leave_the_others()
        return 1
    stopped = summary.get("stopped")
    if args.replay is not None and not stopped:
        return _compare_replay(args.replay, cfg, summary)
    print(json.dumps(summary), flush=True)
    return 128 + signal.Signals[stopped] if stopped else 0


def _leave_the_others() -> None:
    """A process of a multi-host run that failed exits now, without jax.distributed's shutdown
    barrier (which would hold it for minutes, waiting for processes that wait for it): the
    coordinator sees its heartbeats stop and ends the others (docs/scaling.md, "Several hosts")."""
    import jax

    if jax.distributed.is_initialized() and jax.process_count() > 1:
        sys.stdout.flush()
        os._exit(1)


def _failure_line(e: BaseException, run_dir: str) -> str:
    """What went wrong, in one line: a full disk by name, the run layer's own errors as they are
    worded, anything else with its type."""
    from bridge.client import BridgeError
    from bridge.envs.spec import MixedGroupError, RewardError, RolloutFnError
    from jaxrl.checkpoints import CheckpointFailed
    from jaxrl.run.collection import EnvironmentsDown
    from jaxrl.run.evaluation import EvaluationFailed
    from jaxrl.run.processes import ChildStartError
    from jaxrl.run.rewards import NothingScored
    from jaxrl.run.run_dir import disk_full
    from jaxrl.run.supervision import BridgesDown, EnvServerDown
    from jaxrl.run.tasks import TaskError
    from jaxrl.run.warm_start import WarmStartError
    from jaxrl.snapshots import SnapshotError

    if disk_full(e):
        failed = f"{e}: " if isinstance(e, CheckpointFailed) else ""
        saved = [int(p.name) for p in (Path(run_dir) / "checkpoints").glob("*") if p.name.isdigit()]
        then = (f"then --resume from its last checkpoint (step {max(saved)})" if saved else
                "then start it again (it wrote no checkpoint yet)")
        return f"disk full: {failed}no space left on the file system of {run_dir}; free some (or move run_dir), {then}"
    if isinstance(e, SnapshotError):
        return f"snapshot {e}; once the snapshot store answers, --resume from the last checkpoint"
    ours = (BridgeError, BridgesDown, CheckpointFailed, ChildStartError, EnvServerDown, EnvironmentsDown,
            EvaluationFailed, MixedGroupError, NothingScored, RewardError, RolloutFnError, TaskError, WarmStartError)
    text = str(e) if isinstance(e, ours) else f"{type(e).__name__}: {e}"
    if isinstance(e, CheckpointFailed) and e.__cause__ is not None:
        text += f": {type(e.__cause__).__name__}: {e.__cause__}"
    lines = text.strip().splitlines() or [type(e).__name__]
    return lines[0] + (" ..." if len(lines) > 1 else "")


def _save_traceback(e: BaseException, run_dir: str) -> str:
    """Writes `e`'s traceback to RUN/logs/train_error.log (or a temporary file when the run directory
    cannot take it, e.g. a full disk); returns where."""
    import tempfile
    import time
    import traceback

    text = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {''.join(traceback.format_exception(e))}\n"
    try:
        path = Path(run_dir) / "logs" / "train_error.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(text)
        return str(path)
    except OSError:
        with tempfile.NamedTemporaryFile("w", prefix="jaxrl-train-error-", suffix=".log", delete=False) as f:
            f.write(text)
        return f.name


def _replay_config(args):
    """`--replay RUN`: RUN's config into a fresh run directory (`jaxrl.run.replay`); warns about
    versions the run did not record; None after an error."""
    from jaxrl.run.record import differences
    from jaxrl.run.replay import ReplayError, replay_config
    from jaxrl.run.run_dir import RunDir
    from jaxrl.run.typed_config import ConfigError

    if args.resume:
        print("jaxrl train: error: --replay starts a fresh run directory; --resume does not apply", file=sys.stderr)
        return None
    try:
        from jaxrl.run.config import TrainConfig
        from jaxrl.run.gin_config import gin_overrides

        cfg = replay_config(args.replay, [*gin_overrides([], args.gin or [], TrainConfig), *(args.set or [])])
    except (ConfigError, ReplayError) as e:
        print(f"jaxrl train: error: {e}", file=sys.stderr)
        return None
    changed = differences(RunDir(args.replay))
    if changed is None:
        print(f"jaxrl train: warning: {args.replay} has no run.json: the versions it ran on are unknown",
              file=sys.stderr)
    elif changed:
        print(f"jaxrl train: warning: the replay runs on other versions than {args.replay} recorded, which can "
              f"explain a difference: {'; '.join(changed)}", file=sys.stderr)
    return cfg


def _compare_replay(run_dir: str, cfg, summary: dict) -> int:
    """Prints whether the replay matched the run step by step, then the summary; 0 if it did."""
    from jaxrl.run.replay import compare
    from jaxrl.run.tracking import read_metrics

    result = compare(read_metrics(run_dir), read_metrics(cfg.run_dir))
    print(result.line(), flush=True)
    summary["replay"] = {"matched": result.matched, "steps": result.steps}
    print(json.dumps(summary), flush=True)
    return 0 if result.matched else 1


# `jaxrl eval` flag -> the config key it overrides
EVAL_FLAGS = {"episodes": "eval.episodes", "temperature": "eval.temperature", "pass_k": "eval.pass_k",
              "seed": "seed", "max_tokens": "rollout.max_tokens", "max_turns": "rollout.max_turns",
              "max_total_tokens": "rollout.max_total_tokens"}


def _eval_config(args, prog: str, scratch: Path):
    """The config `jaxrl eval` runs: the run's own (a run directory) or one around a model directory,
    with every flag given overriding its key; (config, snapshot or None), or None after an error."""
    from bridge.envs.spec import BUNDLED_NAMES
    from jaxrl.run.config import TrainConfig, load_config
    from jaxrl.run.typed_config import ConfigError, apply_overrides, from_dict
    from jaxrl.snapshots import SnapshotReader

    target = Path(args.target)
    pairs = [(key, getattr(args, flag)) for flag, key in EVAL_FLAGS.items() if getattr(args, flag) is not None]
    snapshot = None
    try:
        if (target / "config.yaml").is_file():  # a run directory: its settings, its newest weights
            cfg = load_config(target / "config.yaml", pairs)
            if args.env is not None and args.env not in {s.name for s in cfg.envs}:
                raise ConfigError(f"the run has no environment {args.env!r}; its envs: "
                                  f"{', '.join(s.name for s in cfg.envs)}")
            versions = SnapshotReader(target / "snapshots").versions() if (target / "snapshots").is_dir() else []
            if args.version is not None and args.version not in versions:
                raise ConfigError(f"--version {args.version}: the run has snapshots {versions}")
            if not versions:
                raise ConfigError(f"{target} has no snapshot (the run stopped before it published weights), so it has "
                                  f"nothing trained to evaluate; evaluate the model it started from with `jaxrl eval "
                                  f"{cfg.model.dir} --env ...`")
            return cfg, (target / "snapshots", args.version if args.version is not None else versions[-1])
        if not (target / "config.json").is_file():
            raise ConfigError(f"{target}: neither a run directory (config.yaml) nor a model directory (config.json)")
        if args.env is None:
            raise ConfigError("a model directory needs --env: a bundled environment "
                              f"({', '.join(BUNDLED_NAMES)}) or an OpenEnv server url")
        if args.env in BUNDLED_NAMES:
            env = {"name": args.env, "bundled": args.env}
        elif args.env.startswith(("http://", "https://")):
            env = {"name": "env", "url": args.env}
            args.env = "env"
        else:
            raise ConfigError(f"--env {args.env!r}: name a bundled environment ({', '.join(BUNDLED_NAMES)}) or an "
                              "OpenEnv server url")
        if args.version is not None:
            raise ConfigError("--version picks a run's snapshot; a model directory has none")
        base = {"run_dir": str(scratch), "model": {"dir": str(target)}, "envs": [env],
                "rollout": {"max_turns": 16, "max_total_tokens": 1024}}
        cfg = from_dict(TrainConfig, apply_overrides(base, pairs))
        # No run sizes this bridge: its engine holds the evaluation's samples at once (at most 64, as a
        # run's does), not a default training step's 64, whose batch sizes it would compile for nothing.
        from jaxrl.compilation import bucket

        max_batch = min(64, bucket(cfg.eval.episodes * cfg.eval.pass_k, 1))
        return dataclasses.replace(cfg, bridge=dataclasses.replace(cfg.bridge, max_batch=max_batch)), None
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return None


def _eval(args) -> int:
    """Held-out episodes of a run's newest snapshot (or a model directory): the evaluation `jaxrl train`
    runs, with the same tasks, sampling, reward weights and success rule."""
    import logging
    import tempfile

    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's read-only notices
    prog = "jaxrl eval"
    with tempfile.TemporaryDirectory(prefix="jaxrl-eval-") as scratch:
        found = _eval_config(args, prog, Path(scratch))
        if found is None:
            return 2
        cfg, snapshot = found
        from bridge.client import BridgeError
        from bridge.envs.spec import RewardError, RolloutFnError
        from jaxrl.run.api import evaluate_weights
        from jaxrl.run.evaluation import EvaluationFailed
        from jaxrl.run.processes import ChildStartError
        from jaxrl.run.run_dir import RunDir
        from jaxrl.run.services import StartupError
        from jaxrl.run.warm_start import lora_base

        logs = Path(args.target) / "logs" / "eval" if snapshot is not None else Path(scratch) / "logs"
        try:
            result = evaluate_weights(cfg, logs, snapshot, args.env, args.split, lora_base(cfg, RunDir(args.target)))
        except (StartupError, ChildStartError, EvaluationFailed, RewardError, RolloutFnError, BridgeError) as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 1
    weights = f"snapshot {snapshot[1]}" if snapshot else cfg.model.dir
    rows = [("environment", args.env or ", ".join(s.name for s in cfg.envs)), ("weights", weights),
            ("split", args.split), ("tasks", result.tasks),
            (f"success (pass@{cfg.eval.pass_k})", f"{result.success:.3f} +- {result.stderr:.3f}"),
            ("mean reward", f"{result.reward:.3f}"), ("mean turns", f"{result.turns:.2f}"),
            ("episode errors", result.errors)]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(json.dumps({"weights": weights, "split": args.split, **dataclasses.asdict(result)}))
    return 0


def _sweep(args) -> int:
    """`jaxrl sweep SWEEP.yaml` launches a sweep's runs (or, with --dry-run, writes their configs and
    prints the commands); `jaxrl sweep status|report OUT_DIR` shows a launched sweep's runs."""
    from jaxrl.run import sweep
    from jaxrl.run.config import TrainConfig, load_config
    from jaxrl.run.gin_config import gin_key
    from jaxrl.run.typed_config import ConfigError, to_dict

    target = args.target
    try:
        if target[0] in ("status", "report"):
            if len(target) != 2:
                print(f"jaxrl sweep: error: usage: jaxrl sweep {target[0]} SWEEP_OUT_DIR", file=sys.stderr)
                return 2
            if target[0] == "status":
                print(sweep.status_table(sweep.status(target[1])))
            else:
                print(sweep.report(target[1]))
            return 0
        if len(target) != 1:
            print("jaxrl sweep: error: give one sweep file (or: status DIR, report DIR)", file=sys.stderr)
            return 2
        return sweep.run_sweep(
            target[0],
            lambda base, overrides: to_dict(load_config(base, [(gin_key(k, TrainConfig), v) for k, v in overrides])),
            dry_run=args.dry_run, train_command=[sys.executable, "-m", "jaxrl.run.cli", "train"],
            launcher=args.launcher, parallel=args.parallel, wait=not args.no_wait,
            cancel_on_interrupt=args.cancel_on_interrupt)
    except ConfigError as e:
        print(f"jaxrl sweep: error: {e}", file=sys.stderr)
        return 2


def _config(args) -> int:
    """Prints every training config key with its default and help, or checks a config file."""
    from jaxrl.run.config import TrainConfig
    from jaxrl.run.typed_config import describe, describe_markdown, to_dict

    if args.config is None:
        print((describe_markdown if args.markdown else describe)(TrainConfig), end="")
        return 0
    cfg = _load_train_config(args, "jaxrl config")
    if cfg is None:
        return 2
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False, width=100), end="")
    return 0


def _env_prompt(args) -> int:
    """Prints the first prompt of a training task exactly as the engine gets it (the chat template
    applied, tools listed, special tokens kept), then its token count against rollout.max_prompt_tokens.
    Starts the bundled server it needs; a url environment's server must be running."""
    import logging
    import tempfile

    cfg = _load_train_config(args, "jaxrl env prompt")
    if cfg is None:
        return 2
    logging.basicConfig(level=logging.WARNING, format="jaxrl env prompt: %(levelname)s: %(message)s", force=True)
    for handler in logging.getLogger().handlers:  # what the bridge says of the prompt; no library notices
        handler.addFilter(lambda record: record.name.split(".")[0] in ("jaxrl", "bridge"))
    from bridge.envs.spec import EnvConfigError
    from jaxrl.models import load_tokenizer
    from jaxrl.run.api import ensure_model
    from jaxrl.run.env_probe import probe
    from jaxrl.run.services import StartupError, prompt_fit
    from jaxrl.run.supervision import EnvServers
    from jaxrl.run.tasks import TaskError, TaskSource

    if args.task < 0:
        print(f"jaxrl env prompt: error: --task {args.task}: a task is numbered from 0 (the run's first group)",
              file=sys.stderr)
        return 2
    try:
        g = cfg.rollout.groups_per_step
        env, task = TaskSource(cfg).train(args.task // g, args.task % g)  # the run's N-th group's task
        model_dir = ensure_model(cfg)
        tokenizer = load_tokenizer(model_dir)
        spec = next(s for s in cfg.envs if s.name == env)
        with EnvServers() as servers, tempfile.TemporaryDirectory() as scratch:
            if spec.bundled:
                spec = spec.served_at(servers.start(spec.name, spec.bundled, max_concurrent_envs=1, seed=spec.seed,
                                                    log_path=Path(scratch) / "env.log").url)
            envs = {"envs": [spec.to_dict()], "tool_parser": cfg.bridge.tool_parser,
                    "chat_template_kwargs": cfg.bridge.chat_template_kwargs}
            [result] = probe(envs, [{"env": env, "task": task, "what": f"task {args.task}", "prompt": True}], model_dir)
        if "prompt_ids" not in result:
            raise EnvConfigError(result.get("refused") or result["error"])
        ids = result["prompt_ids"]
    except (TaskError, StartupError, EnvConfigError) as e:
        print(f"jaxrl env prompt: error: {e}", file=sys.stderr)
        return 2
    fits = prompt_fit(cfg, len(ids))
    print(tokenizer.decode(ids))
    print(f"--- environment {env!r}, task {args.task} {json.dumps(task, default=str)}: {len(ids)} tokens, {fits}")
    return 0


def _assets(args) -> int:
    from jaxrl.tiny import build_tiny_model

    print(build_tiny_model(args.out_dir, args.family, seed=args.seed))
    return 0


def _export(args) -> int:
    """Writes a run's snapshot or train checkpoint as a Hugging Face model directory."""
    import logging
    import warnings

    # Export is host work: never take an accelerator a trainer may be using.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's read-only notices
    from jaxrl.run.export import ExportError, ExportWarning, export

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        try:
            out = export(args.run_dir, args.out, version=args.version,
                         checkpoint_step=args.checkpoint_step, dtype=args.dtype, merged=args.merged, base=args.base)
        except ExportError as e:
            print(f"jaxrl export: error: {e}", file=sys.stderr)
            return 1
    for w in caught:
        if issubclass(w.category, ExportWarning):
            print(f"jaxrl export: note: {w.message}", file=sys.stderr)
    print(out)
    return 0


def _add_train(sub) -> None:
    tr = sub.add_parser("train", help="train a model against environments (the main job)")
    what = tr.add_mutually_exclusive_group(required=True)
    what.add_argument("config", nargs="?", help="training config: YAML, or gin (.gin) (see `jaxrl config`)")
    what.add_argument("--replay", metavar="RUN_DIR",
                      help="rerun a run from its config.yaml into RUN_DIR/replay (--set run_dir=... elsewhere) and "
                           "compare its metrics step by step with the run's (timings excepted); exit 1 if they differ")
    tr.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (dotted), repeatable")
    tr.add_argument("--gin", action="append", metavar="BINDING",
                    help="override in gin syntax, e.g. 'OptimizerConfig.learning_rate = 1e-5' (before --set), repeatable")
    tr.add_argument("--resume", action="store_true", help="continue the run directory's newest checkpoint")
    tr.add_argument("--coordinator", metavar="HOST:PORT",
                    help="several processes: process 0's address and a free port, the same for every process")
    tr.add_argument("--num-processes", type=int, metavar="N", help="several processes: how many")
    tr.add_argument("--process-id", type=int, metavar="I", help="several processes: this one's index, 0 to N - 1")
    tr.set_defaults(func=_train)


def _add_eval(sub) -> None:
    ev = sub.add_parser("eval", help="held-out episodes of a run or a model against its environments")
    ev.add_argument("target", help="a run directory (its newest snapshot) or a Hugging Face model directory")
    ev.add_argument("--env", help="one environment of the run (default: all of them, as training evaluates), "
                                  "or for a model directory a bundled name or an OpenEnv server url")
    ev.add_argument("--version", type=int, help="the run's snapshot to evaluate (default: the newest)")
    ev.add_argument("--split", default="test", choices=["test", "train"], help="test: held-out tasks")
    for flag, key in EVAL_FLAGS.items():
        ev.add_argument(f"--{flag.replace('_', '-')}", type=float if flag == "temperature" else int,
                        help=f"overrides {key}")
    ev.set_defaults(func=_eval)


def _add_sweep(sub) -> None:
    sw = sub.add_parser("sweep", help="run a grid or list of config overrides, then compare the runs")
    sw.add_argument("target", nargs="+", metavar="SWEEP.yaml | status OUT_DIR | report OUT_DIR",
                    help="a sweep file (base config + grid or runs) to launch; or `status OUT_DIR` (each run's state) "
                         "or `report OUT_DIR` (the comparison of what has finished) of a launched sweep")
    sw.add_argument("--dry-run", action="store_true", help="write one resolved config per run and print the commands")
    sw.add_argument("--launcher", choices=["local", "slurm"], help="overrides the sweep file's launcher")
    sw.add_argument("--parallel", type=int, help="local: runs at once (overrides the sweep file's parallel)")
    sw.add_argument("--no-wait", action="store_true", help="slurm: return once the jobs are submitted")
    sw.add_argument("--cancel-on-interrupt", action="store_true",
                    help="slurm: Ctrl-C cancels the submitted jobs (default: they keep running)")
    sw.set_defaults(func=_sweep)


def _add_tools(sub) -> None:
    """The smaller commands: config, tiny-model, export, and the bridge's own two for --help."""
    co = sub.add_parser("config", help="print the training config defaults, or a config file resolved")
    co.add_argument("config", nargs="?", help="a config file to check and print resolved")
    co.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (dotted)")
    co.add_argument("--gin", action="append", metavar="BINDING", help="override in gin syntax (before --set)")
    co.add_argument("--markdown", action="store_true",
                    help="the defaults as the documentation's tables (the site's config page; scripts/docs.sh)")
    co.set_defaults(func=_config)

    assets = sub.add_parser("tiny-model", help="write a tiny random model + tokenizer as an HF directory")
    assets.add_argument("out_dir")
    assets.add_argument("--family", choices=["llama", "qwen2", "qwen3"], default="qwen3")
    assets.add_argument("--seed", type=int, default=0)
    assets.set_defaults(func=_assets)

    exp = sub.add_parser("export", help="write a run's snapshot or checkpoint as a Hugging Face model directory")
    exp.add_argument("run_dir", help="run directory, or its snapshots/ or checkpoints/ directory")
    which = exp.add_mutually_exclusive_group()
    which.add_argument("--version", type=int, help="snapshot version (default: the newest)")
    which.add_argument("--checkpoint-step", type=int, help="export this train checkpoint instead of a snapshot")
    exp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the source's")
    exp.add_argument("--out", required=True, help="output directory (new or empty)")
    exp.add_argument("--merged", action="store_true",
                     help="a LoRA run: the whole model with the adapters merged in (default: the PEFT adapter directory)")
    exp.add_argument("--base", help="a LoRA run: the base model directory (default: the one the run trained on)")
    exp.set_defaults(func=_export)

    # Served by the bridge's own entry point (`python -m bridge`); listed here for --help.
    sub.add_parser("bridge", help="serve a generation engine to trainers over gRPC (python -m bridge serve)",
                   add_help=False)
    sub.add_parser("env", help="bundled OpenEnv environments: serve NAME, list, tasks URL (python -m bridge env); "
                               "prompt CONFIG [--task N]: a task's first prompt as the engine gets it", add_help=False)


def _env_prompt_parser() -> argparse.ArgumentParser:
    pr = argparse.ArgumentParser(prog="jaxrl env prompt", description=_env_prompt.__doc__)
    pr.add_argument("config", help="training config (YAML, or gin)")
    pr.add_argument("--task", type=int, default=0, metavar="N",
                    help="the run's N-th training task (its N-th group, counted across steps; default 0: the first)")
    pr.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (dotted), repeatable")
    pr.add_argument("--gin", action="append", metavar="BINDING", help="override in gin syntax (before --set)")
    return pr


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # as a program (not called from Python): XLA's scratch memory reused between steps
        restart_tuned()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["env", "prompt"]:  # needs the run's config and tasks: the run layer's, not the bridge's
        return _env_prompt(_env_prompt_parser().parse_args(argv[2:]))
    if argv and argv[0] in ("bridge", "env"):  # the bridge process is its own program
        forwarded = ["serve", *argv[1:]] if argv[0] == "bridge" else argv
        os.execv(sys.executable, [sys.executable, "-m", "bridge", *forwarded])
    parser = argparse.ArgumentParser(prog="jaxrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_eval, _add_sweep, _add_tools):
        add(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
