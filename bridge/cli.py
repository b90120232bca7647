"""The bridge process's command line: `python -m bridge serve ...` and `python -m bridge env ...`.

`jaxrl bridge` and `jaxrl env` hand their arguments to this entry point unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys


def _serve(args) -> int:
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


def _add_serve_arguments(br: argparse.ArgumentParser) -> None:
    br.add_argument("--engine", default="jax", help="jax (CPU/TPU, default) or vllm (GPU)")
    br.add_argument("--model", required=True, help="Hugging Face model directory")
    br.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the model's")
    br.add_argument("--host", default="127.0.0.1")
    br.add_argument("--port", type=int, default=0, help="0: a free port (printed as BRIDGE_LISTENING host:port)")
    br.add_argument("--max-batch", type=int, help="most sequences generated together")
    br.add_argument("--seed", type=int, default=0, help="sampling seed for requests without one")
    br.add_argument("--engine-kwargs",
                    help='JSON object passed to the engine, e.g. \'{"gpu_memory_utilization": 0.4}\'')
    br.add_argument("--envs", help="JSON file of the environments and reward functions to serve: "
                                   '{"envs": [EnvSpec...], "rewards": [RewardSpec...], "tool_parser": "qwen", '
                                   '"chat_template_kwargs": {}}')
    br.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)  # exit when this parent is gone
    br.set_defaults(func=_serve)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bridge", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_arguments(sub.add_parser("serve", help="serve a generation engine to trainers over gRPC"))

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
