"""The `jaxrl` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml


def _load_train_config(args, prog: str):
    from jaxrl.config import load_config
    from jaxrl.typed_config import ConfigError

    try:
        return load_config(args.config, args.set or [])
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return None


def _train(args) -> int:
    """Trains against environments; the last stdout line is a JSON summary of the run."""
    cfg = _load_train_config(args, "jaxrl train")
    if cfg is None:
        return 2
    from jaxrl.rollouts import EnvironmentsDown
    from jaxrl.tasks import TaskError
    from jaxrl.train import StartupError, train

    try:
        summary = train(cfg, resume=args.resume)
    except (StartupError, EnvironmentsDown, TaskError) as e:
        print(f"jaxrl train: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("jaxrl train: stopped", file=sys.stderr)
        return 130
    print(json.dumps(summary), flush=True)
    return 0


def _eval(args) -> int:
    """Held-out episodes of a run's newest snapshot (or a model directory) against an environment."""
    import asyncio

    from bridge.envs.bundled import NAMES
    from bridge.envs.spec import EnvConfigError, EnvSpec, RewardSpec
    from jaxrl.typed_config import ConfigError

    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's read-only notices
    prog = "jaxrl eval"
    target = Path(args.target)
    snapshot = None
    settings = dict(max_tokens=args.max_tokens, max_turns=args.max_turns, max_total_tokens=args.max_total_tokens)
    rewards = [RewardSpec("env")]
    tool_parser, template_kwargs = "qwen", None
    if (target / "config.yaml").is_file():  # a run directory: its environments, settings, newest weights
        from jaxrl.config import load_config
        from jaxrl.snapshots import SnapshotReader

        try:
            cfg = load_config(target / "config.yaml")
        except ConfigError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        model_dir, specs, rewards = Path(cfg.model.dir), list(cfg.envs), list(cfg.rewards)
        tool_parser, template_kwargs = cfg.bridge.tool_parser, cfg.bridge.chat_template_kwargs
        settings = dict(max_tokens=cfg.rollout.max_tokens, max_turns=cfg.rollout.max_turns,
                        max_total_tokens=cfg.rollout.max_total_tokens, success_threshold=cfg.eval.success_threshold)
        versions = SnapshotReader(target / "snapshots").versions() if (target / "snapshots").is_dir() else []
        snapshot = (target / "snapshots", versions[-1]) if versions else None
        if args.env not in {s.name for s in specs}:
            print(f"{prog}: error: the run has no environment {args.env!r}; its envs: "
                  f"{', '.join(s.name for s in specs)}", file=sys.stderr)
            return 2
    elif (target / "config.json").is_file():
        model_dir = target
        if args.env in NAMES:
            specs = [EnvSpec(args.env, bundled=args.env)]
        elif args.env.startswith(("http://", "https://")):
            specs = [EnvSpec("env", url=args.env)]
            args.env = "env"
        else:
            print(f"{prog}: error: --env {args.env!r}: name a bundled environment ({', '.join(NAMES)}) "
                  "or an OpenEnv server url", file=sys.stderr)
            return 2
    else:
        print(f"{prog}: error: {target}: neither a run directory (config.yaml) nor a model directory "
              "(config.json)", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from bridge.engines.jax_engine import JaxEngine
    from jaxrl.sft import bundled_name, evaluate_async

    spec = next(s for s in specs if s.name == args.env)
    tasks = None
    if bundled_name(spec) is None:  # a server with no seeded split: fresh seeds past the training ones
        from jaxrl.tasks import EVAL_SEED_OFFSET

        tasks = [{"seed": EVAL_SEED_OFFSET + i} for i in range(args.episodes)]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    async def run():
        engine = JaxEngine(model_dir, seed=args.seed, tokenizer=tokenizer)
        try:
            if snapshot is not None:
                await engine.load_snapshot(str(snapshot[0]), snapshot[1])
            return await evaluate_async(engine, tokenizer, specs, args.env, args.episodes, args.split,
                                        args.temperature, args.pass_k, args.seed, tasks=tasks, rewards=rewards,
                                        tool_parser=tool_parser, template_kwargs=template_kwargs, **settings)
        finally:
            await engine.close()

    try:
        result = asyncio.run(run())
    except (EnvConfigError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    weights = f"snapshot {snapshot[1]}" if snapshot else str(model_dir)
    rows = [("environment", args.env), ("weights", weights), ("split", args.split),
            ("episodes", result["episodes"]), (f"success (pass@{args.pass_k})", f"{result['success_rate']:.3f} "
                                               f"+- {result['success_stderr']:.3f}"),
            ("mean reward", f"{result['mean_reward']:.3f}"), ("mean turns", f"{result['mean_turns']:.2f}"),
            ("episode errors", result["errors"])]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(json.dumps({k: v for k, v in result.items() if k != "examples"}))
    return 0


def _sweep(args) -> int:
    """Runs a sweep's configs one after another (or, with --dry-run, writes them and prints commands)."""
    from jaxrl.config import TrainConfig
    from jaxrl.sweep import run_sweep
    from jaxrl.typed_config import ConfigError, load, to_dict

    try:
        return run_sweep(args.sweep, lambda base, overrides: to_dict(load(TrainConfig, base, overrides)),
                         dry_run=args.dry_run, train_command=[sys.executable, "-m", "jaxrl.cli", "train"])
    except ConfigError as e:
        print(f"jaxrl sweep: error: {e}", file=sys.stderr)
        return 2


def _config(args) -> int:
    """Prints every training config key with its default and help, or checks a config file."""
    from jaxrl.config import TrainConfig
    from jaxrl.typed_config import describe, to_dict

    if args.config is None:
        print(describe(TrainConfig), end="")
        return 0
    cfg = _load_train_config(args, "jaxrl config")
    if cfg is None:
        return 2
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False, width=100), end="")
    return 0


def _assets(args) -> int:
    from jaxrl.tiny import build_tiny_model

    print(build_tiny_model(args.out_dir, args.family, seed=args.seed))
    return 0


def _export(args) -> int:
    """Writes a run's snapshot or train checkpoint as a Hugging Face model directory."""
    import logging
    import os
    import warnings

    # Export is host work: never take an accelerator a trainer may be using.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's read-only notices
    from jaxrl.export import ExportError, ExportWarning, export

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        try:
            out = export(args.run_dir, args.out, version=args.version,
                         checkpoint_step=args.checkpoint_step, dtype=args.dtype)
        except ExportError as e:
            print(f"jaxrl export: error: {e}", file=sys.stderr)
            return 1
    for w in caught:
        if issubclass(w.category, ExportWarning):
            print(f"jaxrl export: note: {w.message}", file=sys.stderr)
    print(out)
    return 0


def _bridge(args) -> int:
    """Serves a generation engine over gRPC until Shutdown, SIGTERM or SIGINT."""
    from bridge.server import ENGINES, run_bridge

    if args.engine not in ENGINES:  # checked here for a one-line error, not argparse's usage dump
        print(f"jaxrl bridge: error: unknown engine {args.engine!r}; choose one of: {', '.join(ENGINES)}",
              file=sys.stderr)
        return 2
    try:
        engine_kwargs = json.loads(args.engine_kwargs or "{}")
    except json.JSONDecodeError:
        engine_kwargs = None
    if not isinstance(engine_kwargs, dict):
        print(f"jaxrl bridge: error: --engine-kwargs must be a JSON object, got {args.engine_kwargs!r}",
              file=sys.stderr)
        return 2
    return run_bridge(args.engine, args.model, dtype=args.dtype, host=args.host, port=args.port,
                      max_batch=args.max_batch, seed=args.seed, parent_pid=args.parent_pid,
                      engine_kwargs=engine_kwargs, envs_file=args.envs)


def _env_serve(args) -> int:
    """Serves a bundled OpenEnv environment until SIGTERM / SIGINT (or the parent's exit)."""
    from bridge.envs.bundled import NAMES

    prog = "jaxrl env serve"
    if args.name not in NAMES:  # checked before the (slow) OpenEnv import
        print(f"{prog}: error: unknown bundled environment {args.name!r}; known: {', '.join(NAMES)}",
              file=sys.stderr)
        return 2
    if args.max_concurrent_envs < 1:
        print(f"{prog}: error: --max-concurrent-envs must be at least 1, got {args.max_concurrent_envs}",
              file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"{prog}: error: --port must be in 0..65535, got {args.port}", file=sys.stderr)
        return 2
    from bridge.envs.serve import serve

    return serve(args.name, host=args.host, port=args.port, max_concurrent_envs=args.max_concurrent_envs,
                 seed=args.seed, parent_pid=args.parent_pid, log_level=args.log_level)


def _env_list(args) -> int:
    """Prints the bundled environments, one per line: name and description."""
    from bridge.envs.bundled import BUNDLED

    for name, spec in BUNDLED.items():
        print(f"{name}\t{spec.description}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    tr = sub.add_parser("train", help="train a model against environments (the main job)")
    tr.add_argument("config", help="YAML training config (see `jaxrl config`)")
    tr.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (dotted), repeatable")
    tr.add_argument("--resume", action="store_true", help="continue the run directory's newest checkpoint")
    tr.set_defaults(func=_train)

    ev = sub.add_parser("eval", help="held-out episodes of a run or a model against an environment")
    ev.add_argument("target", help="a run directory (its newest snapshot) or a Hugging Face model directory")
    ev.add_argument("--env", required=True, help="an environment of the run, a bundled name, or a server url")
    ev.add_argument("--episodes", type=int, default=100)
    ev.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ev.add_argument("--pass-k", type=int, default=1, help="samples per task; success if any succeeds")
    ev.add_argument("--split", default="test", help="bundled task split (test: held out)")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--max-tokens", type=int, default=64, help="per turn (a run directory uses its own)")
    ev.add_argument("--max-turns", type=int, default=16)
    ev.add_argument("--max-total-tokens", type=int, default=1024)
    ev.set_defaults(func=_eval)

    sw = sub.add_parser("sweep", help="run a grid or list of config overrides, then compare the runs")
    sw.add_argument("sweep", help="sweep YAML: base config + grid or runs")
    sw.add_argument("--dry-run", action="store_true", help="write one resolved config per run and print the commands")
    sw.set_defaults(func=_sweep)

    co = sub.add_parser("config", help="print the training config defaults, or a config file resolved")
    co.add_argument("config", nargs="?", help="a config file to check and print resolved")
    co.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (dotted)")
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
    exp.set_defaults(func=_export)

    br = sub.add_parser("bridge", help="serve a generation engine to trainers over gRPC")
    br.add_argument("--engine", default="jax", help="jax (CPU/TPU, default) or vllm (GPU)")
    br.add_argument("--model", required=True, help="Hugging Face model directory")
    br.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the model's")
    br.add_argument("--host", default="127.0.0.1")
    br.add_argument("--port", type=int, default=0, help="0: a free port (printed as BRIDGE_LISTENING host:port)")
    br.add_argument("--max-batch", type=int, help="most sequences generated together")
    br.add_argument("--seed", type=int, default=0, help="sampling seed for requests without one")
    br.add_argument("--engine-kwargs", help='JSON object passed to the engine, e.g. \'{"gpu_memory_utilization": 0.4}\'')
    br.add_argument("--envs", help="JSON file of the environments and reward functions to serve")
    br.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # exit when this parent is gone
    br.set_defaults(func=_bridge)

    env = sub.add_parser("env", help="bundled OpenEnv environments")
    env_sub = env.add_subparsers(dest="env_command", required=True)
    es = env_sub.add_parser("serve", help="serve a bundled environment (HTTP + WebSocket /ws)")
    es.add_argument("name", help="echo, wordle or guess_number")
    es.add_argument("--host", default="127.0.0.1")
    es.add_argument("--port", type=int, default=0, help="0: a free port (printed as ENV_LISTENING http://host:port)")
    es.add_argument("--max-concurrent-envs", type=int, default=64, help="most WebSocket sessions at once")
    es.add_argument("--seed", type=int, default=0, help="seeds the tasks of resets that give no seed")
    es.add_argument("--log-level", default="warning", help="uvicorn's log level")
    es.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # exit when this parent is gone
    es.set_defaults(func=_env_serve)
    el = env_sub.add_parser("list", help="list the bundled environments")
    el.set_defaults(func=_env_list)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
