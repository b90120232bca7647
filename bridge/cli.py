"""The bridge process's command line: `python -m bridge serve ...` and `python -m bridge env ...`.

`jaxrl bridge` and `jaxrl env` hand their arguments to this entry point unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from bridge import wire


def _token(token_file: str | None) -> str:
    """The bridge's token: from `token_file` (written with a fresh token when it does not exist, so
    that trainer and bridge can name the same file from the start), else from $JAXRL_BRIDGE_TOKEN.
    A bridge with neither does not start: an open bridge lets any local user load weights into it."""
    if token_file is not None:
        path = Path(token_file).expanduser()
        token, written = wire.token_file(path)
        if written:
            print(f"jaxrl bridge: wrote a new token to {path} (give trainers bridge.token_file={path})",
                  file=sys.stderr, flush=True)
        return token
    token = os.environ.get(wire.TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(f"the bridge needs a token: pass --token-file FILE (a new token is written there if FILE "
                         f"does not exist) or set {wire.TOKEN_ENV}")
    return token


def _tls(cert: str | None, key: str | None) -> tuple[bytes, bytes] | None:
    if (cert is None) != (key is None):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    if cert is None:
        return None
    try:
        return Path(key).read_bytes(), Path(cert).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {e.filename}: {e.strerror}") from None


def _serve(args) -> int:
    """Serves a generation engine over gRPC until Shutdown, SIGTERM or SIGINT."""
    from bridge.server import ENGINES, run_bridge

    try:
        launch = _launch(args)
    except ValueError as e:
        print(f"jaxrl bridge: error: {e}", file=sys.stderr)
        return 2
    if launch.engine not in ENGINES:  # checked here for a one-line error, not argparse's usage dump
        print(f"jaxrl bridge: error: unknown engine {launch.engine!r}; choose one of: {', '.join(ENGINES)}",
              file=sys.stderr)
        return 2
    try:
        tls = _tls(args.tls_cert, args.tls_key)
        token = _token(args.token_file)
    except ValueError as e:
        print(f"jaxrl bridge: error: {e}", file=sys.stderr)
        return 2
    return run_bridge(launch, token=token, tls=tls, parent_pid=args.parent_pid)


# The serve flags that make up a launch (`wire.BridgeLaunch`), by their argparse names; left out of
# `args` when not given, so that a launch's defaults are its dataclass's.
_ENGINE_FLAGS = ("engine", "model", "dtype", "max_batch", "seed", "engine_kwargs", "envs", "cpus", "lora", "teacher")
_SERVER_FLAGS = ("host", "port", "insecure", "snapshot_root")
_LIMIT_FLAGS = tuple(f.name for f in dataclasses.fields(wire.Limits))


def _launch(args) -> wire.BridgeLaunch:
    """The launch of `--launch FILE`, or of the serve flags; ValueError naming what is wrong."""
    given = {k: v for k, v in vars(args).items() if k in _ENGINE_FLAGS + _SERVER_FLAGS + _LIMIT_FLAGS}
    if args.launch is not None:
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise ValueError(f"--launch FILE holds the whole launch; give no other serve flags with it ({flags})")
        try:
            return wire.BridgeLaunch.from_json(Path(args.launch).read_text())
        except OSError as e:
            raise ValueError(f"cannot read {args.launch}: {e.strerror or e}") from None
    engine = {k: given[k] for k in _ENGINE_FLAGS if k in given}
    try:
        engine["engine_kwargs"] = json.loads(engine.get("engine_kwargs") or "{}")
    except json.JSONDecodeError:
        engine["engine_kwargs"] = None
    if not isinstance(engine["engine_kwargs"], dict):
        raise ValueError(f"--engine-kwargs must be a JSON object, got {given['engine_kwargs']!r}")
    if "lora" in engine:
        try:
            engine["lora"] = json.loads(Path(engine["lora"]).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--lora {engine['lora']}: cannot be read as an adapter_config.json ({e})") from None
    server = {k: given[k] for k in ("host", "port", "insecure") if k in given}
    server["snapshot_roots"] = given.get("snapshot_root", ())
    limits = wire.Limits(**{k: given[k] for k in _LIMIT_FLAGS if k in given})
    return wire.BridgeLaunch(**engine, server=wire.ServerSpec(**server, limits=limits))


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


def _env_tasks(args) -> int:
    """Prints the task splits of the OpenEnv server at args.url, one per line: name and number of tasks
    (what `data.splits` names)."""
    from bridge.envs.spec import EnvConfigError, EnvSpec, task_splits

    try:
        splits = task_splits(EnvSpec(args.url, url=args.url))  # named as the user named it
    except EnvConfigError as e:
        print(f"jaxrl env tasks: {e}", file=sys.stderr)
        return 2
    for name, count in splits.items():
        print(f"{name}\t{count}")
    return 0


def _env_probe(args) -> int:
    """Runs a trainer's environment checks as the bridge would (`bridge.envs.probe.probe`): reads the
    environments file and a JSON list of items, prints {"results": [...]} as one JSON line."""
    prog = "jaxrl env probe"
    try:
        envs = json.loads(Path(args.envs).read_text())
        items = json.loads(Path(args.items).read_text())
    except (OSError, ValueError) as e:
        print(f"{prog}: error: cannot read {getattr(e, 'filename', None) or 'the items'}: {e}", file=sys.stderr)
        return 2
    tokenizer = None
    if any(item.get("prompt") for item in items):
        if args.model is None:
            print(f"{prog}: error: rendering a first prompt needs --model (its tokenizer)", file=sys.stderr)
            return 2
        from jaxrl.models import load_tokenizer

        tokenizer = load_tokenizer(args.model)
    from bridge.envs.probe import probe

    print(json.dumps({"results": probe(envs, items, tokenizer)}), flush=True)
    return 0


def _add_serve_arguments(br: argparse.ArgumentParser) -> None:
    given = {"default": argparse.SUPPRESS}  # see _ENGINE_FLAGS
    source = br.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="Hugging Face model directory", **given)
    source.add_argument("--launch", metavar="FILE",
                      help="JSON file of the whole launch (bridge.wire.BridgeLaunch), instead of the other flags")
    br.add_argument("--engine", help="jax (CPU/TPU, default) or vllm (GPU)", **given)
    br.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the model's", **given)
    br.add_argument("--host", help="default 127.0.0.1; beyond loopback (e.g. 0.0.0.0) the bridge needs "
                                   "--tls-cert/--tls-key or --insecure", **given)
    br.add_argument("--port", type=int, help="0 (default): a free port (printed as BRIDGE_LISTENING host:port)",
                    **given)
    br.add_argument("--max-batch", type=int, help="most sequences generated together", **given)
    br.add_argument("--seed", type=int, help="sampling seed for requests without one (default 0)", **given)
    br.add_argument("--cpus", type=lambda v: tuple(int(c) for c in v.split(",")), metavar="0,1",
                    help="CPUs the bridge runs on, e.g. to keep it off a trainer's (default: all it may use)", **given)
    br.add_argument("--engine-kwargs", **given,
                    help='JSON object passed to the engine, e.g. \'{"gpu_memory_utilization": 0.4}\'')
    br.add_argument("--lora", metavar="ADAPTER_CONFIG", **given,
                    help="a PEFT adapter_config.json: serve LoRA adapters of that shape over --model (a LoRA run's "
                         "snapshots carry adapters only)")
    br.add_argument("--teacher", metavar="MODEL_DIR", **given,
                    help="an on-policy distillation teacher (same tokenizer as --model): its logprobs of every "
                         "episode's tokens go with the trajectory")
    br.add_argument("--envs", help="JSON file of the environments and reward functions to serve: "
                                   '{"envs": [EnvSpec...], "rewards": [RewardSpec...], "tool_parser": "qwen", '
                                   '"chat_template_kwargs": {}}', **given)
    br.add_argument("--token-file", help="file holding the token every call must carry (created with a new "
                                         f"token if it does not exist); default: ${wire.TOKEN_ENV}")
    br.add_argument("--tls-cert", help="PEM certificate (chain) to serve TLS with; clients verify it (bridge.tls_ca)")
    br.add_argument("--tls-key", help="PEM private key of --tls-cert")
    br.add_argument("--insecure", action="store_true",
                    help="listen beyond loopback without TLS (the token travels in clear text)", **given)
    br.add_argument("--snapshot-root", action="append", metavar="DIR",
                    help="LoadSnapshot reads only under these directories or gs:// / s3:// prefixes (repeatable); "
                         "none: the model only", **given)
    limits = wire.Limits()
    for f, what in (("max_group_size", "most samples per group of a request"),
                    ("max_groups", "most groups per request"),
                    ("max_episode_tokens", "most tokens of an episode of a request (max_total_tokens), and so of "
                                           "its model turns"),
                    ("max_episodes_in_flight", "most episodes under way over all requests"),
                    ("max_request_mb", "largest request message, in MiB (gRPC's receive limit)")):
        br.add_argument(wire.Limits.flag(f), dest=f, type=int, help=f"{what} (default {getattr(limits, f)})", **given)
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
    et = env_sub.add_parser("tasks", help="list an OpenEnv server's task splits and their sizes (for data.splits)")
    et.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    et.set_defaults(func=_env_tasks)
    ep = env_sub.add_parser("probe", help="reset environments on tasks, or render their first prompts, as the bridge "
                                          "would (what `jaxrl train` checks before it starts)")
    ep.add_argument("--envs", required=True, help="the environments file, as a trainer writes its bridges'")
    ep.add_argument("--items", required=True,
                    help='JSON file: [{"env": NAME, "task": {...}, "what": "first training task", "prompt": false}]')
    ep.add_argument("--model", help="Hugging Face model directory whose tokenizer renders prompts")
    ep.set_defaults(func=_env_probe)

    args = parser.parse_args(argv)
    return args.func(args)
