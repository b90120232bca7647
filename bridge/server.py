"""The bridge's gRPC server (grpc.aio) over one generation engine.

`Rollout` runs every episode of a request concurrently (the engine batches their generate calls)
and streams each trajectory the moment its episode finishes; a client that goes away cancels its
episodes. Engine work runs in threads, so `Health` and `Stats` answer at once while rollouts and
snapshot loads run. A bad request gets a status code and a message; nothing a client sends stops
the server, except `Shutdown`.

Locked: every call must carry the bridge's token (`TokenCheck`, UNAUTHENTICATED otherwise), even
on loopback, where any local user could connect; snapshots load only from under the roots the
bridge was started with and never go back to an older version; requests are bounded by the
bridge's `wire.Limits`. Beyond loopback the bridge serves TLS (see `serve`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import inspect
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np

from bridge import wire
from bridge.engines.base import Engine, SnapshotRefused, derive_seed
from bridge.envs.rollout_fn import run_rollout_fn
from bridge.envs.session import EndpointUnavailable, SessionLost
from bridge.envs.solver import solver_episode
from bridge.proto import bridge_pb2 as pb
from bridge.proto import bridge_pb2_grpc as pb_grpc
from jaxrl.snapshot_store import check_location, is_url
from bridge.rollout import EpisodeHook, run_episode

if TYPE_CHECKING:
    from bridge.envs.runtime import EnvRuntime
    from bridge.teacher import Teacher

log = logging.getLogger(__name__)

SERVER_OPTIONS = [
    ("grpc.max_send_message_length", wire.MAX_MESSAGE_BYTES),
    # Two bridges must never share a port silently (gRPC sets SO_REUSEPORT by default).
    ("grpc.so_reuseport", 0),
    # Clients ping every few seconds to notice a dead bridge; don't answer that with GOAWAY.
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]

RETRYABLE = (SessionLost, EndpointUnavailable)  # the environment went away: replay the episode

# episode_hook_factory(group) -> EpisodeHook | None (or an awaitable of one), once per episode.
HookFactory = Callable[[wire.PromptGroup], "EpisodeHook | None | Awaitable[EpisodeHook | None]"]


class StartupError(Exception):
    """The bridge cannot start: unknown engine, no model, an engine that fails to load, no token."""


class _Invalid(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call that does not carry `token` (compared in constant time) with
    UNAUTHENTICATED, before its request is received (see `refuse`) or reaches the servicer."""

    def __init__(self, token: str, counters: dict[str, int]):
        self._expected = (wire.BEARER + token).encode()
        self._counters = counters

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        sent = dict(details.invocation_metadata or ()).get(wire.AUTH_METADATA)
        if isinstance(sent, str) and hmac.compare_digest(sent.encode(), self._expected):
            return handler
        if handler is None:  # no such method: gRPC answers UNIMPLEMENTED
            return None
        self._counters["unauthenticated"] += 1
        why = "no token" if sent is None else "a wrong token"
        log.warning("refused %s: the call carried %s", details.method, why)
        message = f"this bridge requires its token and the call carried {why}"

        async def refuse(requests, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # never reached: makes this a stream handler

        # A request-streaming handler is never handed a request it did not ask for: gRPC reads
        # nothing of the body (beyond its flow-control window), so a stranger's big message is
        # refused without being received. Every method is one at the HTTP/2 level.
        return grpc.stream_stream_rpc_method_handler(refuse, None, handler.response_serializer)


class BridgeServicer(pb_grpc.BridgeServicer):
    """`envs` (an EnvRuntime) serves named environments; `episode_hook_factory` is the bare hook
    interface (tests, custom loops). With `envs`, an episode whose session is lost is replayed
    from the start, with growing waits, until its environment's `retry_budget_s` has passed
    since the first loss; then it is dropped (finish_reason "error") and counted.
    `snapshot_roots`: the directories or gs:// / s3:// prefixes LoadSnapshot may read under (none:
    the model only). `vocab_size`: prompt token ids must be below it (None: not checked here).
    `teacher`: scores every finished episode (on-policy distillation)."""

    def __init__(self, engine: Engine, episode_hook_factory: HookFactory | None = None,
                 on_shutdown: Callable[[], None] | None = None, envs: EnvRuntime | None = None,
                 snapshot_roots: Sequence[str | Path] = (), limits: wire.Limits = wire.Limits(),
                 vocab_size: int | None = None, teacher: Teacher | None = None):
        self.engine = engine
        self.teacher = teacher
        self.vocab_size = vocab_size
        self.snapshot_roots = [str(r).rstrip("/") if is_url(r) else Path(r).resolve() for r in snapshot_roots]
        self.limits = limits
        self._admitted = 0  # episodes of the requests under way (their limit: limits.max_episodes_in_flight)
        self.envs = envs
        if envs is not None and episode_hook_factory is None:
            def episode_hook_factory(g):
                return envs.hook(g.env, g.task or {}, g.group_id) if g.env else None
        self.episode_hook_factory = episode_hook_factory
        self.on_shutdown = on_shutdown
        self.started = time.monotonic()
        self.status = "serving"  # "stopping" once a stop is under way
        self._load_lock = asyncio.Lock()
        self.counters = {
            "rollouts": 0,
            "rollouts_cancelled": 0,
            "trajectories": 0,
            "episodes_in_flight": 0,
            "episode_errors": 0,
            "request_errors": 0,
            "snapshot_loads": 0,
            "snapshot_refusals": 0,
            "episodes_retried": 0,
            "episodes_dropped": 0,
            "episodes_timed_out": 0,
            "unauthenticated": 0,
        }

    # -- helpers ------------------------------------------------------------------------------

    async def _fail(self, context, code: grpc.StatusCode, message: str):
        self.counters["request_errors"] += 1
        log.warning("request refused (%s): %s", code.name, message)
        await context.abort(code, message)

    def _check_version(self, request) -> None:
        try:
            wire.check_version(request, type(request).__name__)
        except wire.WireError as e:
            raise _Invalid(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None

    async def _check_unary(self, request, context) -> None:
        try:
            self._check_version(request)
        except _Invalid as e:
            await self._fail(context, e.code, str(e))

    def _parse_rollout(self, request: pb.RolloutRequest):
        self._check_version(request)
        if not request.groups:
            raise _Invalid(grpc.StatusCode.INVALID_ARGUMENT, "rollout request has no groups")
        if request.group_size < 1:
            raise _Invalid(grpc.StatusCode.INVALID_ARGUMENT, f"group_size={request.group_size} must be >= 1")
        self._check_limit("group_size", request.group_size, "max_group_size")
        self._check_limit("groups", len(request.groups), "max_groups")
        self._check_limit("max_total_tokens", request.max_total_tokens, "max_episode_tokens")
        self._check_limit("sampling.max_tokens", request.sampling.max_tokens, "max_episode_tokens")
        self._check_limit("groups x group_size", len(request.groups) * request.group_size, "max_episodes_in_flight")
        if not request.HasField("sampling"):
            raise _Invalid(grpc.StatusCode.INVALID_ARGUMENT, "rollout request has no sampling params")
        try:
            params = wire.sampling_from_proto(request.sampling, max_turns=request.max_turns,
                                              max_total_tokens=request.max_total_tokens)
            groups = [wire.group_from_proto(g) for g in request.groups]
        except ValueError as e:  # WireError included
            raise _Invalid(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        for g in groups:
            if len(g.prompt_ids) == 0 and not g.env:  # an environment writes its own prompt
                raise _Invalid(grpc.StatusCode.INVALID_ARGUMENT, f"group {g.group_id!r} has an empty prompt")
            self._check_ids(g)
            if g.env and self.envs is not None and g.env not in self.envs.connectors:
                raise _Invalid(grpc.StatusCode.INVALID_ARGUMENT,
                               f"group {g.group_id!r} names environment {g.env!r}; this bridge serves: "
                               f"{', '.join(self.envs.connectors)}")
            if g.env and self.episode_hook_factory is None:
                raise _Invalid(grpc.StatusCode.INVALID_ARGUMENT,
                               f"group {g.group_id!r} names environment {g.env!r}, but this bridge "
                               "serves no environments")
        if request.policy not in wire.POLICIES:
            raise _Invalid(grpc.StatusCode.INVALID_ARGUMENT,
                           f"policy={request.policy!r} is not one of {wire.POLICIES}")
        if request.policy == "solver":
            for g in groups:
                spec = self.envs.specs.get(g.env) if self.envs is not None else None
                if spec is None or spec.solver is None:
                    raise _Invalid(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"group {g.group_id!r}: environment {g.env!r} has no solver to play it; "
                                   "set the environment's solver (bundled environments have one)")
        if request.min_policy_version > self.engine.policy_version:
            raise _Invalid(grpc.StatusCode.FAILED_PRECONDITION,
                           f"min_policy_version={request.min_policy_version} but the engine serves "
                           f"version {self.engine.policy_version}; load that snapshot first")
        episodes, limit = len(groups) * request.group_size, self.limits.max_episodes_in_flight
        if self._admitted + episodes > limit:
            raise _Invalid(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{episodes} more episodes would make {self._admitted + episodes} in flight, over this "
                           f"bridge's limit of {limit} ({wire.Limits.flag('max_episodes_in_flight')}); retry "
                           "when fewer run")
        return params, groups

    def _check_ids(self, group: wire.PromptGroup) -> None:
        """An id outside the vocabulary would index past the embedding (JAX clamps: a silent misread)."""
        ids = group.prompt_ids
        if len(ids) and (ids.min() < 0 or self.vocab_size is not None and ids.max() >= self.vocab_size):
            raise _Invalid(grpc.StatusCode.INVALID_ARGUMENT,
                           f"group {group.group_id!r}: prompt token ids run from {ids.min()} to {ids.max()}; the "
                           f"model's vocabulary is [0, {self.vocab_size if self.vocab_size is not None else '...'})")

    def _outside_roots(self, directory: Path, version: int) -> Path | None:
        """The first symlink of snapshot `version` under `directory` that leads outside the roots:
        only someone with write access to a root can plant one, but the roots are the whole lock."""
        top = directory / str(version)
        entries = [top] + [Path(here) / name for here, dirs, files in os.walk(top) for name in dirs + files]
        for entry in entries:  # os.walk lists symlinked directories without entering them
            if entry.is_symlink() and not self._under_roots(entry.resolve()):
                return entry
        return None

    def _under_roots(self, path: Path) -> bool:
        return any(isinstance(root, Path) and (path == root or root in path.parents) for root in self.snapshot_roots)

    def _check_limit(self, what: str, value: int, limit_name: str) -> None:
        limit = getattr(self.limits, limit_name)
        if value > limit:
            raise _Invalid(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{what}={value} is over this bridge's limit of {limit} ({wire.Limits.flag(limit_name)})")

    async def _episode(self, group: wire.PromptGroup, index: int, params, policy: str = "") -> wire.TrajectoryData:
        self.counters["episodes_in_flight"] += 1
        prompt = [int(t) for t in group.prompt_ids]
        spec = self.envs.specs.get(group.env) if self.envs is not None else None
        custom = self.envs.rollout_fn(group.env) if self.envs is not None and policy != "solver" else None
        first_lost = None
        try:
            for attempt in itertools.count():
                hook = None
                if self.episode_hook_factory is not None and policy != "solver" and custom is None:
                    try:
                        hook = self.episode_hook_factory(group)
                        if inspect.isawaitable(hook):
                            hook = await hook
                    except Exception as e:  # an environment that cannot start costs this episode
                        traj = wire.TrajectoryData(group.group_id, index, group.prompt_ids, env=group.env)
                        traj.finish_reason, traj.error = "error", f"{type(e).__name__}: {e}"
                        return traj
                try:
                    async with asyncio.timeout(spec.episode_timeout_s if spec is not None else None):
                        if policy == "solver":
                            traj = await solver_episode(self.envs, group.group_id, index, group.env,
                                                        group.task or {}, retry_on=RETRYABLE)
                        elif custom is not None:
                            traj = await run_rollout_fn(
                                custom.fn, custom.label, self.engine, self.envs.tokenizer, group.group_id,
                                index, group.env, group.task or {}, params, self.envs.template_kwargs)
                        else:
                            traj = await run_episode(
                                self.engine, group.group_id, index, prompt, params, hook=hook, env=group.env,
                                retry_on=RETRYABLE)
                    traj.metrics["retries"] = float(attempt)
                    return traj
                except TimeoutError:  # raised by the timeout above only: run_episode catches the rest
                    self.counters["episodes_timed_out"] += 1
                    traj = wire.TrajectoryData(group.group_id, index, group.prompt_ids, env=group.env)
                    traj.finish_reason = "error"
                    traj.error = f"episode took longer than episode_timeout_s={spec.episode_timeout_s:g} s"
                    return traj
                except RETRYABLE as e:
                    lost = f"{type(e).__name__}: {e}"
                    if first_lost is None:
                        first_lost = time.monotonic()
                    wait = spec.retry_wait_s(attempt, time.monotonic() - first_lost) if spec is not None else None
                    if wait is None:
                        break
                    self.counters["episodes_retried"] += 1
                    log.warning("episode %s/%d lost its %s session (%s); replaying it from reset in %.1f s "
                                "(retry %d)", group.group_id, index, group.env, lost, wait, attempt + 1)
                    await asyncio.sleep(wait)
            self.counters["episodes_dropped"] += 1
            traj = wire.TrajectoryData(group.group_id, index, group.prompt_ids, env=group.env)
            traj.finish_reason = "error"
            budget = f"retry_budget_s={spec.retry_budget_s:g}" if spec is not None else "no environment spec"
            traj.error = (f"dropped after {attempt} retries over {time.monotonic() - first_lost:.0f} s "
                          f"({budget}): {lost}")
            traj.metrics["retries"] = float(attempt)
            return traj
        finally:
            self.counters["episodes_in_flight"] -= 1

    async def _scored(self, episode) -> wire.TrajectoryData:
        """The episode, with the teacher's logprobs of its model tokens when the bridge serves one."""
        traj = await episode
        if self.teacher is None or not len(traj.completion_ids) or traj.finish_reason == "error":
            return traj
        try:
            logp = await self.teacher.score(traj.prompt_ids, traj.completion_ids)
        except Exception as e:  # this episode cannot be distilled; the others go on
            traj.finish_reason, traj.error = "error", f"teacher: {type(e).__name__}: {e}"
            return traj
        traj.teacher_logprobs = logp * traj.loss_mask.astype(np.float32)
        return traj

    # -- RPCs ---------------------------------------------------------------------------------

    async def Rollout(self, request: pb.RolloutRequest, context):
        try:
            params, groups = self._parse_rollout(request)
        except _Invalid as e:
            await self._fail(context, e.code, str(e))
            return
        episodes = len(groups) * request.group_size
        self._admitted += episodes  # no await since the check in _parse_rollout: nothing came between
        self.counters["rollouts"] += 1
        tasks = []
        for group in groups:
            for j in range(request.group_size):
                # The episode's identity, not its place in this request: see PromptGroup.seed.
                seed = None if group.seed is None else derive_seed(group.seed, j)
                tasks.append(asyncio.create_task(self._scored(self._episode(
                    group, j, dataclasses.replace(params, seed=seed), request.policy))))
        finished = False
        try:
            for next_done in asyncio.as_completed(tasks):
                traj = await next_done
                if traj.finish_reason == "error":
                    self.counters["episode_errors"] += 1
                    log.warning("episode %s/%d failed: %s", traj.group_id, traj.index_in_group, traj.error)
                self.counters["trajectories"] += 1
                yield wire.trajectory_to_proto(traj)
            finished = True
        finally:
            self._admitted -= episodes
            if not finished:
                self.counters["rollouts_cancelled"] += 1
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def LoadSnapshot(self, request: pb.LoadSnapshotRequest, context):
        await self._check_unary(request, context)
        if not request.path:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, "LoadSnapshot needs a path")
        if is_url(request.path):
            try:
                check_location(request.path)
            except ValueError as e:
                await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            path = request.path.rstrip("/")
            allowed = any(isinstance(root, str) and (path == root or path.startswith(root + "/"))
                          for root in self.snapshot_roots)
        else:
            try:
                path = Path(request.path).resolve()  # symlinks and `..` resolved before the check
            except (OSError, RuntimeError) as e:  # a symlink loop
                await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, f"{request.path}: {e}")
            allowed = self._under_roots(path)
        if not allowed:
            roots = ", ".join(map(str, self.snapshot_roots)) or "none"
            await self._fail(context, grpc.StatusCode.PERMISSION_DENIED,
                             f"{request.path} is not under this bridge's snapshot roots ({roots}); start the "
                             "bridge with --snapshot-root DIR for the trainer's snapshot directory")
        if isinstance(path, Path) and not path.exists():
            await self._fail(context, grpc.StatusCode.NOT_FOUND, f"{request.path}: does not exist")
        escape = self._outside_roots(path, request.version) if isinstance(path, Path) else None
        if escape is not None:
            await self._fail(context, grpc.StatusCode.PERMISSION_DENIED,
                             f"{escape} is a symlink to {escape.resolve()}, outside this bridge's snapshot roots; "
                             "snapshots load only from under them")
        async with self._load_lock:  # one load at a time: versions land in request order
            served = self.engine.policy_version
            if request.version < served:
                self.counters["snapshot_refusals"] += 1
                await self._fail(context, grpc.StatusCode.FAILED_PRECONDITION,
                                 f"version {request.version} is older than the version {served} this bridge "
                                 "serves: versions only go forward (a new run needs a bridge of its own)")
            try:
                # The resolved path: a symlink swapped after the check cannot redirect the load.
                load_s = await self.engine.load_snapshot(str(path), request.version)
            except SnapshotRefused as e:
                self.counters["snapshot_refusals"] += 1
                await self._fail(context, grpc.StatusCode.FAILED_PRECONDITION,
                                 f"snapshot refused, still serving version {self.engine.policy_version}: {e}")
            except Exception as e:
                self.counters["snapshot_refusals"] += 1
                await self._fail(context, grpc.StatusCode.INTERNAL,
                                 f"snapshot load failed, still serving version "
                                 f"{self.engine.policy_version}: {type(e).__name__}: {e}")
        self.counters["snapshot_loads"] += 1
        log.info("serving snapshot %s version %d (loaded in %.2f s)", request.path, request.version, load_s)
        return pb.LoadSnapshotReply(protocol_version=wire.PROTOCOL_VERSION,
                                    version=self.engine.policy_version, load_s=load_s)

    async def Health(self, request: pb.HealthRequest, context):
        # Answers any protocol version: the reply carries ours, and the client checks it.
        return pb.HealthReply(protocol_version=wire.PROTOCOL_VERSION, status=self.status,
                              engine=self.engine.name, policy_version=self.engine.policy_version)

    async def Stats(self, request: pb.StatsRequest, context):
        await self._check_unary(request, context)
        counters = {k: float(v) for k, v in self.counters.items()}
        counters["policy_version"] = float(self.engine.policy_version)
        counters["uptime_s"] = time.monotonic() - self.started
        counters.update({f"limit.{k}": float(v) for k, v in dataclasses.asdict(self.limits).items()})
        if self.envs is not None:
            counters.update(self.envs.metrics())
        for k, v in (getattr(self.engine, "stats", None) or {}).items():
            if isinstance(v, (int, float)):
                counters[f"engine.{k}"] = float(v)
        # Every JAX program this process needed, compiled or loaded from the cache (see
        # jaxrl.compilation); the module is loaded by what runs JAX here, never by a vLLM bridge.
        compilation = sys.modules.get("jaxrl.compilation")
        if compilation is not None:
            counters["programs"] = float(compilation.programs())
        return pb.StatsReply(protocol_version=wire.PROTOCOL_VERSION, counters=counters)

    async def Shutdown(self, request: pb.ShutdownRequest, context):
        await self._check_unary(request, context)
        log.info("shutdown requested")
        if self.on_shutdown is not None:
            self.on_shutdown()
        return pb.ShutdownReply(protocol_version=wire.PROTOCOL_VERSION)


async def serve(
    engine: Engine,
    spec: wire.ServerSpec = wire.ServerSpec(),
    *,
    token: str,
    tls: tuple[bytes, bytes] | None = None,
    envs: EnvRuntime | None = None,
    episode_hook_factory: HookFactory | None = None,
    on_listening: Callable[[str], None] | None = None,
    parent_pid: int | None = None,
    handle_signals: bool = True,
    grace_s: float = 5.0,
    vocab_size: int | None = None,
    teacher: Teacher | None = None,
) -> None:
    """Serves `engine` as `spec` says until Shutdown, SIGTERM/SIGINT, or (with `parent_pid`) the
    parent's exit.

    `on_listening(host:port)` is called once the server accepts calls. `envs` is started (every
    environment checked) before that. The engine and the environments are closed on the way out.
    Every call must carry `token`. `tls` (private key PEM, certificate chain PEM) serves TLS; see
    `check_exposure` for listening beyond loopback without it. `vocab_size`, `teacher`: see BridgeServicer.
    """
    host, port = spec.host, spec.port
    check_exposure(host, tls is not None, spec.insecure)
    if not token:
        raise StartupError("the bridge needs a token")
    stop = asyncio.Event()
    if envs is not None:
        await envs.start()
    servicer = BridgeServicer(engine, episode_hook_factory, on_shutdown=stop.set, envs=envs,
                              snapshot_roots=spec.snapshot_roots, limits=spec.limits, vocab_size=vocab_size,
                              teacher=teacher)
    # No request is received beyond what the limits admit: gRPC refuses a longer one from its length prefix.
    options = [*SERVER_OPTIONS, ("grpc.max_receive_message_length", spec.limits.max_request_bytes)]
    server = grpc.aio.server(options=options, interceptors=[TokenCheck(token, servicer.counters)])
    pb_grpc.add_BridgeServicer_to_server(servicer, server)
    target_host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # IPv6 literal
    try:
        if tls is not None:
            bound = server.add_secure_port(f"{target_host}:{port}", grpc.ssl_server_credentials([tls]))
        else:
            bound = server.add_insecure_port(f"{target_host}:{port}")
    except RuntimeError as e:  # grpc's bind failure (address in use, bad host)
        raise OSError(f"cannot listen on {host}:{port}: {e}") from None
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    loop = asyncio.get_running_loop()
    if handle_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    watchdog = None
    if parent_pid is not None:
        watchdog = asyncio.create_task(_watch_parent(parent_pid, stop))
    await server.start()
    try:
        address = f"{target_host}:{bound}"
        log.info("bridge (%s engine) listening on %s", engine.name, address)
        if on_listening is not None:
            on_listening(address)
        await stop.wait()
        servicer.status = "stopping"
        log.info("stopping (grace %.1f s)", grace_s)
    finally:
        if watchdog is not None:
            watchdog.cancel()
        await server.stop(grace_s)
        await engine.close()
        if envs is not None:
            await envs.aclose()
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)


def check_exposure(host: str, tls: bool, insecure: bool) -> None:
    """Listening beyond loopback needs TLS, or `insecure` said out loud (`wire.exposed`): without TLS
    the token crosses the network in clear text, and whoever reads it there can drive the bridge
    (within its snapshot roots and limits). Raises StartupError."""
    if wire.exposed(host, tls, insecure):
        raise StartupError(f"--host {host} listens beyond loopback, where the token would travel in clear text: "
                           "give --tls-cert and --tls-key, or pass --insecure on a network you trust")
    if not tls and not wire.is_loopback(host):
        log.warning("listening on %s without TLS (--insecure): the token travels in clear text", host)


async def _watch_parent(parent_pid: int, stop: asyncio.Event, every_s: float = 1.0) -> None:
    """Stops the server once the process that started it is gone (re-parented: no orphan bridges)."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(every_s)
    log.warning("parent process %d is gone; shutting down", parent_pid)
    stop.set()


# ---------------------------------------------------------------------------------------------
# The `jaxrl bridge` process

ENGINES = ("jax", "vllm")


class _FastTokenizer:
    """Just the `decode` the JAX engine needs for stop strings, from tokenizer.json (no transformers)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def build_engine(name: str, model_dir: str | Path, dtype: str | None = None, max_batch: int | None = None,
                 seed: int = 0, engine_kwargs: dict | None = None, lora: dict | None = None) -> Engine:
    """The named engine over the Hugging Face model directory `model_dir`; raises StartupError.

    `engine_kwargs` go to the engine as they are: `vllm.LLM` arguments for vllm (e.g.
    gpu_memory_utilization), JaxEngine keyword arguments for jax (e.g. batch_window_s). `lora`:
    PEFT's adapter_config of the adapters that snapshots will carry.
    """
    model_dir = Path(model_dir)
    if name not in ENGINES:
        raise StartupError(f"unknown engine {name!r}; choose one of: {', '.join(ENGINES)}")
    if not (model_dir / "config.json").is_file():
        raise StartupError(f"{model_dir}: not a model directory (no config.json)")
    try:
        return _build_engine(name, model_dir, dtype, max_batch, seed, dict(engine_kwargs or {}), lora)
    except Exception as e:
        raise StartupError(f"the {name} engine cannot load {model_dir}: {type(e).__name__}: {e}") from e


def _build_engine(name: str, model_dir: Path, dtype: str | None, max_batch: int | None, seed: int,
                  engine_kwargs: dict, lora: dict | None) -> Engine:
    if name == "jax":
        from bridge.engines.jax_engine import JaxEngine

        tokenizer = None
        if (model_dir / "tokenizer.json").is_file():
            tokenizer = _FastTokenizer(model_dir / "tokenizer.json")
        kwargs = {"dtype": dtype, "seed": seed, "tokenizer": tokenizer, "lora": lora, **engine_kwargs}
        if max_batch:
            kwargs["max_batch"] = max_batch
        return JaxEngine(model_dir, **kwargs)
    from bridge.engines.vllm_engine import VLLMEngine  # only when chosen: vLLM is heavy and optional

    if dtype:
        engine_kwargs["dtype"] = dtype
    if max_batch:
        engine_kwargs["max_num_seqs"] = max_batch
    return VLLMEngine(str(model_dir), engine_kwargs, lora=lora)


def build_teacher(launch: wire.BridgeLaunch, vocab_size: int | None) -> Teacher:
    """The distillation teacher of `launch`, over sequences as long as the engine's (StartupError)."""
    from bridge.teacher import Teacher

    if not (Path(launch.teacher) / "config.json").is_file():
        raise StartupError(f"teacher {launch.teacher}: not a model directory (no config.json)")
    try:
        return Teacher(launch.teacher, launch.engine_kwargs.get("max_seq_len", 2048), vocab_size)
    except Exception as e:
        raise StartupError(f"the teacher cannot load {launch.teacher}: {type(e).__name__}: {e}") from e


def load_reward_models(envs: EnvRuntime, engine: Engine, launch: wire.BridgeLaunch) -> None:
    """The reward models of `envs` (classifiers and judges: `bridge.envs.scoring`), over sequences as
    long as the engine's; a judge with its own directory gets a JAX engine of its own. EnvConfigError
    naming the reward whose directory cannot load as its kind needs."""
    kwargs = launch.engine_kwargs
    max_seq_len = kwargs.get("max_seq_len") or kwargs.get("max_model_len") or 2048  # jax's, vLLM's

    def judge_engine(model_dir: str) -> Engine:
        # As many rows as the policy's engine: the episodes that finish together are judged in one batch.
        return build_engine("jax", model_dir, launch.dtype, launch.max_batch or 8, launch.seed,
                            {"max_seq_len": max_seq_len, "warm_up": True})

    envs.rewards.load_models(engine, max_seq_len, envs.template_kwargs, judge_engine)  # EnvConfigError naming it
    log.info("reward models: %s", ", ".join(f"{s.key} ({s.kind}, {s.model or 'the policy'})"
                                             for s in envs.rewards.model_specs))


class WarmingUp:
    """`engine` serving at once while its `warm_up` (the JAX engine's: every program compiled, tens
    of seconds on a cold cache) runs on a thread of its own: what needs no engine (health, stats,
    the solver episodes of a warm start) answers meanwhile, and generate and snapshot loads wait for
    it (and fail with its error). A daemon thread: a bridge stopped meanwhile does not wait for it."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.ready: concurrent.futures.Future = concurrent.futures.Future()
        self.ready.set_running_or_notify_cancel()  # a cancelled waiter must not cancel it for the others
        threading.Thread(target=self._warm_up, name="warm-up", daemon=True).start()

    def _warm_up(self) -> None:
        try:
            self.engine.warm_up()
        except BaseException as e:  # handed to every generate and load
            log.error("%s engine: warm-up failed: %s: %s", self.engine.name, type(e).__name__, e)
            self.ready.set_exception(e)
        else:
            self.ready.set_result(None)

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def stats(self) -> dict:
        return getattr(self.engine, "stats", None) or {}

    async def generate(self, prompts, params):
        await asyncio.wrap_future(self.ready)
        return await self.engine.generate(prompts, params)

    async def load_snapshot(self, path: str, version: int) -> float:
        await asyncio.wrap_future(self.ready)
        return await self.engine.load_snapshot(path, version)

    async def close(self) -> None:
        await self.engine.close()


def run_bridge(launch: wire.BridgeLaunch, *, token: str, tls: tuple[bytes, bytes] | None = None,
               parent_pid: int | None = None) -> int:
    """Builds the engine of `launch`, serves it, prints `BRIDGE_LISTENING host:port` once serving;
    exit code. The environments (and reward functions) of `launch.envs` are checked before the
    engine loads. The rest: see `serve`.
    """
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s bridge %(levelname)s %(name)s: %(message)s")

    def announce(address: str) -> None:
        print(f"{wire.BRIDGE_LISTENING}{address}", flush=True)

    async def main() -> None:
        envs = None
        check_exposure(launch.server.host, tls is not None, launch.server.insecure)  # before minutes of loading
        if launch.cpus:  # before the engine's thread pools are sized by the CPUs it may use
            try:
                os.sched_setaffinity(0, launch.cpus)
            except OSError as e:
                raise StartupError(f"cannot run on CPUs {list(launch.cpus)} ({e.strerror}); this machine lets it use "
                                   f"{sorted(os.sched_getaffinity(0))}") from None
        if not (Path(launch.model) / "config.json").is_file():
            raise StartupError(f"{launch.model}: not a model directory (no config.json)")
        if launch.envs is not None:
            from bridge.envs.runtime import runtime_from_file

            envs = runtime_from_file(launch.envs, launch.model)
            await envs.start()  # unreachable environments fail before the model loads
        # Built inside the loop: an engine may create loop-bound objects. The JAX engine's warm-up
        # runs while the bridge serves (see WarmingUp): a run's warm start needs no engine.
        kwargs = dict(launch.engine_kwargs)
        warm_up = launch.engine == "jax" and kwargs.pop("warm_up", False)
        engine = build_engine(launch.engine, launch.model, launch.dtype, launch.max_batch, launch.seed,
                              kwargs, launch.lora)
        if warm_up:
            engine = WarmingUp(engine)
        vocab_size = json.loads((Path(launch.model) / "config.json").read_text()).get("vocab_size")
        log.info("%s engine on model %s%s", launch.engine, launch.model, " (LoRA adapters over it)" * bool(launch.lora))
        teacher = None if launch.teacher is None else build_teacher(launch, vocab_size)
        if envs is not None and envs.rewards.model_specs:
            load_reward_models(envs, engine, launch)
        await serve(engine, launch.server, token=token, tls=tls, envs=envs, on_listening=announce,
                    parent_pid=parent_pid, vocab_size=vocab_size, teacher=teacher)

    from bridge.envs.spec import EnvConfigError

    try:
        asyncio.run(main())
    except EnvConfigError as e:
        print(f"jaxrl bridge: error: {e}", file=sys.stderr)
        return 2
    except (StartupError, OSError) as e:
        print(f"jaxrl bridge: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, StartupError) else 1
    except KeyboardInterrupt:  # Ctrl-C before the server took over the signal
        return 130
    return 0
