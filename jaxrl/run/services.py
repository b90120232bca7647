"""The processes a run talks to: its bundled environment servers (restarted when they die) and
`bridge.per_host` bridges serving them (or the running bridges at `bridge.addresses`), checked
before anything heavy and stopped with the run.

Bridges are locked (see `bridge.server`): the run gives the bridges it starts a fresh token of its
own (through their environment), its snapshot directory as their only snapshot root, and limits
that fit its own requests (`bridge_limits`); running bridges need their token from
`bridge.token_file` (or $JAXRL_BRIDGE_TOKEN) and limits at least as large. So are the chat endpoints
of harness environments: one without harness_api_key_file gets a fresh key each run (`harness_key`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import secrets
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import TextIO

import jax

from bridge.client import BridgeClient, BridgeError, BridgeUnavailable
from bridge.envs.spec import ENV_REWARD, EnvConfigError, EnvSpec, env_factory, import_object
from bridge.wire import TOKEN_ENV, BridgeLaunch, Limits, ServerSpec, read_token_file, token_file
from jaxrl.compilation import bucket
from jaxrl.models.lora import adapter_config
from jaxrl.run.config import TrainConfig
from jaxrl.run.env_probe import prompt_budget, sized
from jaxrl.run.processes import BridgeProcesses
from jaxrl.run.supervision import EnvServers
from jaxrl.run.tasks import TaskSource

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class StartupError(Exception):
    """The run cannot start (bad model directory, unreachable bridge or environment); raised before
    any child process starts."""


def check_services(cfg: TrainConfig) -> None:
    """Fails fast, with one line, on what would otherwise fail after minutes of loading: a mesh the
    devices cannot hold, optional packages the config needs, environment servers that do not answer,
    classes and reward functions that do not import, silent bridges."""
    try:
        cfg.mesh.shape(jax.device_count())
    except ValueError as e:
        raise StartupError(f"mesh: {e} ({jax.default_backend()} backend); fix mesh.* for this machine") from None
    for package, why in _needed_packages(cfg):
        if importlib.util.find_spec(package) is None:
            raise StartupError(f"{why} needs the {package!r} package, which is not installed: pip install {package}, "
                               "or change that setting")
    for spec in cfg.envs:
        try:
            if spec.env_class:  # and its env_kwargs fit its constructor
                env_factory(spec, import_object(spec.env_class, f"environment {spec.name!r}: env_class"))
            elif spec.rollout_fn:
                import_object(spec.rollout_fn, f"environment {spec.name!r}: rollout_fn")
            elif spec.url or spec.harness:
                _check_health(spec.url or spec.harness, spec.session.connect_timeout_s)
        except EnvConfigError as e:  # names the environment already
            raise StartupError(str(e)) from None
        except OSError as e:
            raise StartupError(f"environment {spec.name!r}: {e}") from None
    for reward in cfg.rewards:
        if reward.fn not in (None, ENV_REWARD):
            try:
                fn = import_object(reward.fn, f"reward function {reward.key!r}")
            except EnvConfigError as e:
                raise StartupError(str(e)) from None
            if not callable(fn):
                raise StartupError(f"reward function {reward.key!r}: {reward.fn!r} is a {type(fn).__name__}, not a "
                                   "function; point fn at fn(prompts, completions, completion_ids, environments, "
                                   "**task_fields)")
    if not cfg.bridge.addresses:
        return
    token, needs = bridge_token(cfg), bridge_limits(cfg)
    for address in cfg.bridge.addresses:
        try:
            with BridgeClient(address, timeout_s=10.0, token=token, tls_ca=cfg.bridge.tls_ca) as client:
                limits = client.stats()
        except BridgeUnavailable as e:
            raise StartupError(f"bridge.addresses: {address} does not answer ({e}); start it with "
                               "`jaxrl bridge --model DIR --envs FILE --token-file FILE --snapshot-root DIR`, or "
                               "leave bridge.addresses empty") from None
        except BridgeError as e:  # a refused token, an unreadable bridge.tls_ca
            raise StartupError(f"bridge.addresses: {e}") from None
        for name, need in needs.items():
            limit = limits.get(f"limit.{name}", need)
            if limit < need:
                raise StartupError(f"bridge.addresses: {address} accepts at most {name}={limit:.0f} and this run "
                                   f"asks for {need}; start it with {Limits.flag(name)} {need}")


def bridge_token(cfg: TrainConfig) -> str:
    """The token of the run's bridges: running ones' (`bridge.addresses`) from `bridge.token_file`,
    else $JAXRL_BRIDGE_TOKEN; for the bridges the run starts, a fresh one."""
    if not cfg.bridge.addresses:
        return secrets.token_urlsafe(32)
    if cfg.bridge.token_file:
        try:
            return read_token_file(Path(cfg.bridge.token_file).expanduser())
        except ValueError as e:
            raise StartupError(f"bridge.token_file: {e}") from None
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise StartupError(f"bridge.addresses: the bridges' token is needed; set bridge.token_file to the file given "
                           f"to `jaxrl bridge --token-file`, or {TOKEN_ENV}")
    return token


def bridge_limits(cfg: TrainConfig) -> dict[str, int]:
    """The most the run asks of one bridge (`bridge.wire.Limits` fields): a step's groups (stream
    mode: the groups under way), an evaluation, the warm start's demonstrations, and all three under
    way at once."""
    r, e = cfg.rollout, cfg.eval
    requests = [(max(r.groups_per_step, cfg.streamed_groups), cfg.learner.group_size), (e.episodes, e.pass_k)]
    if cfg.sft.steps:
        requests.append((cfg.sft.demonstrations, 1))
    return {"max_group_size": max(size for _, size in requests),
            "max_groups": max(groups for groups, _ in requests),
            "max_episode_tokens": r.max_total_tokens,  # at least max_tokens (RolloutConfig checks it)
            "max_episodes_in_flight": sum(groups * size for groups, size in requests)}


def _needed_packages(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(package, the setting that needs it) for the optional packages of `cfg`."""
    needed = []
    if cfg.log.wandb is not None:
        needed.append(("wandb", "log.wandb"))
    if cfg.log.tensorboard:
        needed.append(("tensorboardX", "log.tensorboard"))
    if cfg.bridge.engine == "vllm" and not cfg.bridge.addresses:
        needed.append(("vllm", "bridge.engine=vllm"))
    return needed


def _check_health(url: str, timeout_s: float) -> None:
    try:
        with _NO_PROXY.open(f"{url}/health", timeout=timeout_s) as response:
            body = json.loads(response.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise OSError(f"GET {url}/health failed ({e}); check that an OpenEnv server runs at this url") from None
    if not isinstance(body, dict) or body.get("status") != "healthy":
        raise OSError(f"{url}/health answers {body!r}, not healthy")


@dataclasses.dataclass
class Services:
    """What `start_services` started: the bridges to request from (those it started, restartable,
    in `bridges`), and the bundled environment servers it keeps running (their `check()` and
    `metrics()` for the train loop)."""

    addresses: list[str]
    env_servers: EnvServers
    cfg: TrainConfig  # rollout.max_prompt_tokens sized (`jaxrl.run.env_probe.sized`)
    bridges: BridgeProcesses | None = None


def start_services(cfg: TrainConfig, model_dir: Path, logs: Path, stack: contextlib.ExitStack, token: str,
                   snapshot_root: Path | str | None = None, bridge_env: dict[str, str] | None = None,
                   tasks=None) -> Services:
    """Starts the run's bundled environment servers and `bridge.per_host` bridges serving every
    environment (with `bridge_env` added to their environment, and each its `bridge.devices`),
    unless `bridge.addresses` names running bridges (which serve their own `--envs`). The bridges
    require `token` and load snapshots from under `snapshot_root` only (none: they serve the model).
    A null `rollout.max_prompt_tokens` is sized from the environments' first prompts (of `tasks`, the
    run's TaskSource) before the bridges start. Each child is stopped when `stack` closes."""
    env_servers = stack.enter_context(EnvServers())
    if cfg.bridge.addresses:
        if cfg.rollout.max_prompt_tokens is None:
            raise StartupError("rollout.max_prompt_tokens: set it for the running bridges of bridge.addresses (their "
                               "engines hold sequences of their own size; a run sizes only bridges it starts)")
        return Services(list(cfg.bridge.addresses), env_servers, cfg)
    logs.mkdir(parents=True, exist_ok=True)
    specs = []
    for spec in cfg.envs:
        if spec.bundled:
            server = env_servers.start(spec.name, spec.bundled, max_concurrent_envs=spec.max_concurrent_envs,
                                       seed=spec.seed, log_path=logs / f"env-{spec.name}.log")
            spec = spec.served_at(server.url)
        elif spec.harness and spec.harness_api_key_file is None:
            spec = harness_key(spec, logs / "harness")
        specs.append(spec.to_dict())
    envs = {"envs": specs, "rewards": [dataclasses.asdict(r) for r in cfg.rewards],
            "tool_parser": cfg.bridge.tool_parser, "chat_template_kwargs": cfg.bridge.chat_template_kwargs}
    try:
        cfg = sized(cfg, envs, TaskSource(cfg) if tasks is None else tasks, model_dir)
    except (EnvConfigError, ValueError) as e:  # ValueError: a config the sized prompts make inconsistent
        raise StartupError(str(e)) from None
    envs_file = logs / "bridge_envs.json"
    envs_file.write_text(json.dumps(envs, indent=1))
    b = cfg.bridge
    bridges = stack.enter_context(BridgeProcesses())
    launch = bridge_launch(cfg, model_dir, envs_file, snapshot_root)
    started = bridges.start([
        {"launch": launch, "timeout": b.start_timeout_s, "token": token,
         "log_path": logs / ("bridge.log" if i == 0 else f"bridge-{i}.log"),
         "env": {**(bridge_env or {}), **({"CUDA_VISIBLE_DEVICES": b.devices[i]} if b.devices else {})}}
        for i in range(b.per_host)])
    return Services([bridge.address for bridge in started], env_servers, cfg, bridges)


def harness_key(spec: EnvSpec, keys: Path, out: TextIO | None = None) -> EnvSpec:
    """`spec`, a harness environment without harness_api_key_file, given a fresh key of this run's in
    KEYS/NAME.key (its owner's only), and the line on `out` (default: stderr) that tells the user to
    give it to the harness: a key kept from an earlier run would let whoever held it into this one."""
    path = (keys / f"{spec.name}.key").absolute()
    what = f"environment {spec.name!r}: harness_api_key_file"
    try:
        keys.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        token_file(path, what)
    except OSError as e:
        raise StartupError(f"{what}: cannot write this run's key to {path} ({e.strerror or e}); make {keys} "
                           "writable, or set harness_api_key_file") from None
    except ValueError as e:  # token_file's, naming the file
        raise StartupError(str(e)) from None
    print(f"jaxrl: environment {spec.name!r}: give its harness the key in {path} as its API key (e.g. "
          f"OPENAI_API_KEY=$(cat {path})); a new one each run (set harness_api_key_file to keep one)",
          file=out or sys.stderr, flush=True)
    return dataclasses.replace(spec, harness_api_key_file=str(path))


def bridge_launch(cfg: TrainConfig, model_dir: Path, envs_file: Path, snapshot_root: Path | str | None) -> BridgeLaunch:
    """What the run's bridges are started with: its model and environments, its engine settings,
    snapshots only from under `snapshot_root` (none: the model only), and limits that fit its requests."""
    b = cfg.bridge
    server = ServerSpec(snapshot_roots=() if snapshot_root is None else (snapshot_root,),
                        limits=Limits(**bridge_limits(cfg)))
    return BridgeLaunch(model_dir, engine=b.engine, max_batch=b.max_batch or _episodes_at_once(cfg), seed=cfg.seed,
                        engine_kwargs=engine_kwargs(cfg), envs=envs_file, server=server, cpus=tuple(b.cpus),
                        lora=None if cfg.learner.lora is None else adapter_config(cfg.learner.lora, str(model_dir)),
                        teacher=None if cfg.teacher is None else cfg.teacher.model)


def _episodes_at_once(cfg: TrainConfig) -> int:
    """A step's episodes (stream mode: those under way), at most 64: the most a started engine
    generates together by default."""
    groups = max(cfg.rollout.groups_per_step, cfg.streamed_groups)
    return min(64, bucket(groups * cfg.learner.group_size, 1))


def prompt_fit(cfg: TrainConfig, tokens: int) -> str:
    """What a run of `cfg` does with a first prompt of `tokens` tokens, in its keys (`jaxrl env prompt`)."""
    limit = cfg.rollout.max_prompt_tokens
    fix = f"raise rollout.max_prompt_tokens to at least {tokens}, or show the model less (observation_field, " \
          "observation_template)"
    if limit is None:
        return f"rollout.max_prompt_tokens is null: a run sized by this prompt sets it to {prompt_budget(tokens)}"
    if tokens <= limit:
        return f"within rollout.max_prompt_tokens ({limit})"
    held = None if cfg.bridge.addresses else engine_kwargs(cfg).get("max_seq_len")
    if held is not None and tokens >= held:
        return (f"over rollout.max_prompt_tokens ({limit}): the bridge a run starts holds {held} tokens per sequence "
                f"(max_prompt_tokens + max_total_tokens), so such an episode fails; {fix}")
    return (f"over rollout.max_prompt_tokens ({limit}): a step with such a prompt widens the learner's batch to it "
            f"(a compile mid-run) and leaves its episode fewer tokens to generate; {fix}")


def engine_kwargs(cfg: TrainConfig) -> dict:
    """The started engine's arguments: for jax, sequences as long as the rollout's and every
    program compiled before the first request (it records an MoE model's routes anyway); for vllm with
    learner.routing_replay, the routes it returns; `bridge.engine_kwargs` override."""
    r = cfg.rollout
    if cfg.bridge.engine == "jax":
        defaults = {"warm_up": True}
        if "max_seq_len" not in cfg.bridge.engine_kwargs:
            if r.max_prompt_tokens is None:
                raise ValueError("rollout.max_prompt_tokens is null: size it (start_services does) before the engine")
            defaults["max_seq_len"] = r.max_prompt_tokens + r.max_total_tokens
    else:
        defaults = {"enable_return_routed_experts": True} if cfg.learner.routing_replay else {}
    return {**defaults, **cfg.bridge.engine_kwargs}
