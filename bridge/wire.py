"""Encoding between the bridge's Python types and the wire messages of `bridge/proto/bridge.proto`.

Arrays travel as raw little-endian numpy bytes: token ids int32, logprobs float32, loss mask
uint8, token versions int64. Decoding checks every byte length (a buffer that is not a whole
number of items, or per-token arrays of different lengths, is a `WireError`, never a misread) and
the protocol version of the message.

One trajectory type, `TrajectoryData` (numpy arrays), from the bridge's episode to the trainer.

SamplingParams on the wire has no `n` (the request's `group_size` is the number of samples per
prompt) and proto3 scalars have no "unset": `top_p = 0` (never valid) reads as 1.0, no top-p.
Every other field is taken as sent, so a request must set `max_tokens`; `temperature = 0` is greedy.
Its episode limits travel in the request (`max_turns`, `max_total_tokens`: 0 reads as one turn,
and as `max_tokens` in all).

Seeds travel per group: a request built with a seeded SamplingParams seeds each group that has
no seed of its own with derive_seed(sampling seed, group id). A group's episodes then sample the
same tokens whichever request, position or bridge it is sent in (see PromptGroup.seed in the proto).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from bridge.engines.base import SamplingParams, derive_seed
from bridge.proto import bridge_pb2 as pb

PROTOCOL_VERSION = 3  # 2: seeds per group (PromptGroup.seed), none per request; 3: MoE routes

# The process contract: a bridge (`python -m bridge serve`) prints BRIDGE_LISTENING host:port and an
# environment server (`python -m bridge env serve`) ENV_LISTENING http://host:port once they serve.
BRIDGE_LISTENING = "BRIDGE_LISTENING "
ENV_LISTENING = "ENV_LISTENING "

# Both peers raise gRPC's 4 MiB message limit: many groups of long prompts make one big request.
MAX_MESSAGE_BYTES = 512 << 20

# Every call carries the bridge's token as `authorization: Bearer TOKEN` metadata. A bridge takes
# its token from `--token-file` or this environment variable (never argv: `ps` shows argv).
TOKEN_ENV = "JAXRL_BRIDGE_TOKEN"
AUTH_METADATA = "authorization"
BEARER = "Bearer "


def is_loopback(host: str) -> bool:
    """Whether `host` (a name, an address, an IPv6 literal in brackets) is this machine's loopback only:
    a wildcard (0.0.0.0, ::) and any host name but localhost are beyond it."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposed(host: str, tls: bool, insecure: bool) -> bool:
    """Whether listening on `host` would take a door's secret (the bridge's token, a harness endpoint's
    key) in clear text from beyond loopback, where whoever reads it on the network can use the door,
    without `insecure` said out loud: refused by every door of the bridge."""
    return not (tls or insecure or is_loopback(host))


def read_token_file(path, what: str = "the bridge token file") -> str:
    """The token in the file at `path` (surrounding whitespace dropped); ValueError naming `what` and
    the file when it is missing, unreadable, empty, or readable by other users (refused, not warned
    about: a token others can read is no lock)."""
    try:
        if Path(path).stat().st_mode & 0o004:
            raise ValueError(f"{what} {path} is readable by every user; make it its owner's only "
                             f"(chmod 600 {path}) and, if others may have read it, write a new token")
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if not token:
        raise ValueError(f"{what} {path} is empty")
    return token


def token_file(path, what: str = "the bridge token file") -> tuple[str, bool]:
    """The token in the file at `path` (see `read_token_file`), and whether it was written now: a file
    that does not exist is created with a fresh random token, its owner's only, so that the two ends
    of a door (trainer and bridge, a harness and its endpoint) can name the same file from the start."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token_file(path, what), False
    except OSError as e:
        raise ValueError(f"cannot write a new token to {what} {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return read_token_file(path, what), True


@dataclasses.dataclass(frozen=True)
class Limits:
    """The most one bridge accepts: per request (group size, groups, tokens of an episode, which
    bounds a model turn's too, and the request's size in MiB: gRPC's receive limit) and episodes in
    flight over all requests. Each is a `python -m bridge serve` flag (`flag`); a bridge's Stats
    report them as `limit.NAME`."""

    max_group_size: int = 256
    max_groups: int = 4096
    max_episode_tokens: int = 65536
    max_episodes_in_flight: int = 16384
    max_request_mb: int = 128

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{self.flag(f.name)} must be at least 1, got {getattr(self, f.name)}")

    @staticmethod
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    @property
    def max_request_bytes(self) -> int:
        return min(self.max_request_mb << 20, MAX_MESSAGE_BYTES)


@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """Where a bridge listens and what a caller with its token may do there: load snapshots only
    from under `snapshot_roots` (directories or gs:// / s3:// prefixes; none: the model only), and
    send requests within `limits`. Beyond loopback it serves TLS, or plain text if `insecure`."""

    host: str = "127.0.0.1"
    port: int = 0
    insecure: bool = False
    snapshot_roots: tuple[str, ...] = ()
    limits: Limits = Limits()

    def __post_init__(self):
        object.__setattr__(self, "snapshot_roots", tuple(str(r) for r in self.snapshot_roots))


@dataclasses.dataclass(frozen=True)
class BridgeLaunch:
    """All a bridge is started with but its credentials (the token, a TLS key: read from files or
    its environment, never from here or argv): the engine over `model` (`engine_kwargs` go to it as
    they are: `vllm.LLM` arguments for vllm, JaxEngine ones for jax), the environments and reward
    functions to serve (`envs`: a JSON file, `python -m bridge serve --help`), and `server`.
    `python -m bridge serve --launch FILE` reads one as JSON (`to_json`); its flags build the same."""

    model: str
    engine: str = "jax"
    dtype: str | None = None
    max_batch: int | None = None
    seed: int = 0
    engine_kwargs: dict = dataclasses.field(default_factory=dict)
    envs: str | None = None
    server: ServerSpec = ServerSpec()
    cpus: tuple[int, ...] = ()  # the CPUs the bridge process runs on; empty: those it was started with
    # PEFT's adapter_config of the LoRA adapters its snapshots carry (the engine applies them over
    # `model`); None: snapshots carry whole weights.
    lora: dict | None = None
    # The model directory of an on-policy distillation teacher (its logprobs of every episode's
    # tokens travel with the trajectory); None: no teacher.
    teacher: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "model", str(self.model))
        object.__setattr__(self, "cpus", tuple(int(c) for c in self.cpus))
        if self.envs is not None:
            object.__setattr__(self, "envs", str(self.envs))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> BridgeLaunch:
        """The launch `text` holds; ValueError saying what is wrong with it."""
        try:
            fields = json.loads(text)
            server = dict(fields.pop("server", {}))
            limits = Limits(**server.pop("limits", {}))
            return cls(**fields, server=ServerSpec(**server, limits=limits))
        except (ValueError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
            raise ValueError(f"not a bridge launch ({e})") from None

IDS = np.dtype("<i4")
LOGPROBS = np.dtype("<f4")
MASK = np.dtype("u1")
VERSIONS = np.dtype("<i8")


class WireError(ValueError):
    """A message that cannot be decoded: wrong protocol version, bad byte lengths, bad JSON."""


def check_version(message, what: str) -> None:
    """Raises WireError unless `message.protocol_version` is ours."""
    if message.protocol_version != PROTOCOL_VERSION:
        raise WireError(
            f"{what}: protocol version {message.protocol_version}, this side speaks "
            f"{PROTOCOL_VERSION}; run trainer and bridge from the same jaxrl version"
        )


def encode_array(x, dtype: np.dtype) -> bytes:
    return np.ascontiguousarray(np.asarray(x), dtype).tobytes()


def decode_array(buf: bytes, dtype: np.dtype, field: str, length: int | None = None) -> np.ndarray:
    """The array in `buf`; raises WireError if `buf` is not a whole number of items (or not `length`)."""
    dtype = np.dtype(dtype)
    if len(buf) % dtype.itemsize:
        raise WireError(
            f"{field}: {len(buf)} bytes is not a whole number of {dtype.name} items "
            f"({dtype.itemsize} bytes each)"
        )
    x = np.frombuffer(buf, dtype)
    if length is not None and len(x) != length:
        raise WireError(f"{field}: {len(x)} items, expected {length} (one per completion token)")
    return x.astype(dtype.newbyteorder("="), copy=True)  # native order, writable


def encode_ids(ids) -> bytes:
    return encode_array(ids, IDS)


def decode_ids(buf: bytes, field: str) -> np.ndarray:
    return decode_array(buf, IDS, field)


# ---------------------------------------------------------------------------------------------
# Sampling params


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """Everything but `n` and `seed` (seeds go per group: see `rollout_request`)."""
    return pb.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop_token_ids=encode_ids(list(params.stop_token_ids)),
        stop=list(params.stop),
    )


def sampling_from_proto(msg: pb.SamplingParams, n: int = 1, max_turns: int = 0,
                        max_total_tokens: int = 0) -> SamplingParams:
    """Engine SamplingParams, unseeded, with a request's episode limits; raises WireError (bad bytes)
    or ValueError (bad values)."""
    return SamplingParams(
        n=n,
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p != 0 else 1.0,
        top_k=int(msg.top_k),
        max_tokens=int(msg.max_tokens),
        stop_token_ids=tuple(int(t) for t in decode_ids(msg.stop_token_ids, "sampling.stop_token_ids")),
        stop=tuple(msg.stop),
        max_turns=max_turns or 1,
        max_total_tokens=max_total_tokens or None,
    )


# ---------------------------------------------------------------------------------------------
# Prompt groups and requests

POLICIES = ("", "solver")  # who plays a rollout's episodes: the engine's model, or the environment's solver


@dataclasses.dataclass
class PromptGroup:
    """One prompt (or environment task) to sample `group_size` times."""

    prompt_ids: Sequence[int] | np.ndarray
    group_id: str = ""
    env: str = ""  # environment name; empty: plain single-turn generation
    task: dict | None = None  # task fields for the environment / reward functions
    seed: int | None = None  # episode j samples with derive_seed(seed, j); None: unseeded


def group_to_proto(group: PromptGroup) -> pb.PromptGroup:
    return pb.PromptGroup(
        group_id=group.group_id,
        prompt_ids=encode_ids(group.prompt_ids),
        env=group.env,
        task_json=json.dumps(group.task) if group.task is not None else "",
        seed=group.seed,
    )


def group_from_proto(msg: pb.PromptGroup) -> PromptGroup:
    task = None
    if msg.task_json:
        try:
            task = json.loads(msg.task_json)
        except json.JSONDecodeError as e:
            raise WireError(f"group {msg.group_id!r}: task_json is not JSON ({e})") from None
    return PromptGroup(
        prompt_ids=decode_ids(msg.prompt_ids, f"group {msg.group_id!r} prompt_ids"),
        group_id=msg.group_id,
        env=msg.env,
        task=task,
        seed=msg.seed if msg.HasField("seed") else None,
    )


def as_groups(groups: Iterable[PromptGroup | Sequence[int] | np.ndarray]) -> list[PromptGroup]:
    """PromptGroups from PromptGroups or plain token id sequences (group ids default to "0", "1", ...)."""
    out = []
    for i, g in enumerate(groups):
        if not isinstance(g, PromptGroup):
            g = PromptGroup(prompt_ids=g)
        if not g.group_id:
            g = dataclasses.replace(g, group_id=str(i))
        out.append(g)
    return out


def rollout_request(
    groups: Iterable[PromptGroup | Sequence[int] | np.ndarray],
    group_size: int,
    sampling: SamplingParams,
    min_policy_version: int = 0,
    policy: str = "",
) -> pb.RolloutRequest:
    """The request; with `sampling.seed`, each group without a seed gets derive_seed(sampling.seed,
    group id): its identity, not its position in this request."""
    groups = as_groups(groups)
    if sampling.seed is not None:
        groups = [g if g.seed is not None else dataclasses.replace(g, seed=derive_seed(sampling.seed, g.group_id))
                  for g in groups]
    return pb.RolloutRequest(
        protocol_version=PROTOCOL_VERSION,
        groups=[group_to_proto(g) for g in groups],
        group_size=group_size,
        sampling=sampling_to_proto(sampling),
        min_policy_version=min_policy_version,
        max_turns=sampling.max_turns,
        max_total_tokens=sampling.max_total_tokens or 0,
        policy=policy,
    )


# ---------------------------------------------------------------------------------------------
# Trajectories

ENV_VERSION = -1  # token_versions entry of tokens the environment wrote


def _empty(dtype):
    return dataclasses.field(default_factory=lambda: np.zeros(0, dtype))


@dataclasses.dataclass
class TrajectoryData:
    """An episode as the bridge builds it and the trainer receives it: numpy arrays, one entry per
    completion token."""

    group_id: str
    index_in_group: int
    prompt_ids: np.ndarray  # int32
    completion_ids: np.ndarray = _empty(np.int32)  # model tokens and environment/tool tokens, in order
    sampler_logprobs: np.ndarray = _empty(np.float32)  # 0 where loss_mask is 0
    loss_mask: np.ndarray = _empty(np.uint8)  # 1 on tokens the model generated
    token_versions: np.ndarray = _empty(np.int64)  # policy version of each token, ENV_VERSION for the environment's
    rewards: dict[str, float] = dataclasses.field(default_factory=dict)
    finish_reason: str = ""  # stop | length | env_done | max_turns | error
    env: str = ""
    error: str = ""
    num_turns: int = 0
    generate_s: float = 0.0
    env_s: float = 0.0
    reward_s: float = 0.0  # the reward models' share (classifiers, judges): neither generate_s nor env_s
    total_s: float = 0.0
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    # The distillation teacher's logprob of each completion token (0 where loss_mask is 0); empty
    # from a bridge without a teacher.
    teacher_logprobs: np.ndarray = _empty(np.float32)
    # The bridge's warnings about what the model sees of the environment, new since its last episode
    # (the trainer's console shows each once; the bridge's log has them all).
    notices: list[str] = dataclasses.field(default_factory=list)
    # An MoE policy's expert ids of each token of prompt + completion the sampler fed to the model (a
    # prefix of them), (tokens, MoE layers x top-k), uint8 or uint16; empty otherwise.
    routes: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0), np.uint8))

    def append(self, ids, logprobs, trained: bool, version: int | list[int]) -> None:
        """`version`: the weights' version of every token, or of each (new weights may arrive while a
        completion is sampled); environment tokens get ENV_VERSION."""
        n = len(ids)
        versions = version if isinstance(version, list) else [version] * n
        self.completion_ids = np.concatenate([self.completion_ids, np.asarray(ids, np.int32)])
        self.sampler_logprobs = np.concatenate(
            [self.sampler_logprobs, np.asarray(logprobs, np.float32) if trained else np.zeros(n, np.float32)])
        self.loss_mask = np.concatenate([self.loss_mask, np.full(n, int(trained), np.uint8)])
        self.token_versions = np.concatenate(
            [self.token_versions, np.asarray(versions, np.int64) if trained else np.full(n, ENV_VERSION, np.int64)])

    def add_routes(self, routes: np.ndarray | None) -> None:
        """A turn's routes (its context's tokens and its completion's): those past what the episode
        holds, so that each token keeps the route of the turn that first fed it to the model."""
        if routes is None:
            return
        self.routes = routes if not len(self.routes) else np.concatenate([self.routes, routes[len(self.routes):]])

    @property
    def num_completion_tokens(self) -> int:
        return len(self.completion_ids)

    @property
    def policy_version(self) -> int:
        """The oldest policy version among the model's tokens (-1 if it generated none)."""
        trained = self.token_versions[self.loss_mask.astype(bool)]
        return int(trained.min()) if len(trained) else -1


def trajectory_to_proto(traj: TrajectoryData) -> pb.Trajectory:
    return pb.Trajectory(
        protocol_version=PROTOCOL_VERSION,
        group_id=traj.group_id,
        index_in_group=traj.index_in_group,
        prompt_ids=encode_ids(traj.prompt_ids),
        completion_ids=encode_ids(traj.completion_ids),
        sampler_logprobs=encode_array(traj.sampler_logprobs, LOGPROBS),
        loss_mask=encode_array(traj.loss_mask, MASK),
        token_versions=encode_array(traj.token_versions, VERSIONS),
        rewards=dict(traj.rewards),
        finish_reason=traj.finish_reason,
        env=traj.env,
        timings=pb.Timings(generate_s=traj.generate_s, env_s=traj.env_s, reward_s=traj.reward_s, total_s=traj.total_s),
        error=traj.error,
        num_turns=traj.num_turns,
        metrics=dict(traj.metrics),
        teacher_logprobs=encode_array(traj.teacher_logprobs, LOGPROBS),
        notices=list(traj.notices),
        routes=encode_array(traj.routes, traj.routes.dtype.newbyteorder("<")),
        route_width=traj.routes.shape[1] if traj.routes.ndim == 2 else 0,
        route_itemsize=traj.routes.dtype.itemsize,
    )


def trajectory_from_proto(msg: pb.Trajectory) -> TrajectoryData:
    """Decodes and validates a streamed trajectory; raises WireError."""
    what = f"trajectory {msg.group_id!r}/{msg.index_in_group}"
    check_version(msg, what)
    completion = decode_ids(msg.completion_ids, f"{what} completion_ids")
    n = len(completion)
    return TrajectoryData(
        group_id=msg.group_id,
        index_in_group=msg.index_in_group,
        prompt_ids=decode_ids(msg.prompt_ids, f"{what} prompt_ids"),
        completion_ids=completion,
        sampler_logprobs=decode_array(msg.sampler_logprobs, LOGPROBS, f"{what} sampler_logprobs", n),
        loss_mask=decode_array(msg.loss_mask, MASK, f"{what} loss_mask", n),
        token_versions=decode_array(msg.token_versions, VERSIONS, f"{what} token_versions", n),
        rewards=dict(msg.rewards),
        finish_reason=msg.finish_reason,
        env=msg.env,
        error=msg.error,
        num_turns=msg.num_turns,
        generate_s=msg.timings.generate_s,
        env_s=msg.timings.env_s,
        reward_s=msg.timings.reward_s,
        total_s=msg.timings.total_s,
        metrics=dict(msg.metrics),
        teacher_logprobs=decode_array(msg.teacher_logprobs, LOGPROBS, f"{what} teacher_logprobs",
                                      n if msg.teacher_logprobs else 0),
        notices=list(msg.notices),
        routes=_decode_routes(msg, what),
    )


def _decode_routes(msg: pb.Trajectory, what: str) -> np.ndarray:
    if not msg.routes:
        return np.zeros((0, 0), np.uint8)
    if msg.route_itemsize not in (1, 2) or msg.route_width < 1:
        raise WireError(f"{what} routes: route_width {msg.route_width} of {msg.route_itemsize}-byte ids; expected "
                        "a width >= 1 of 1- or 2-byte ids")
    ids = decode_array(msg.routes, np.dtype(f"<u{msg.route_itemsize}"), f"{what} routes")
    tokens = len(msg.prompt_ids) // IDS.itemsize + len(msg.completion_ids) // IDS.itemsize
    if len(ids) % msg.route_width or len(ids) // msg.route_width > tokens:
        raise WireError(f"{what} routes: {len(ids)} expert ids are not whole routes of {msg.route_width} for at "
                        f"most its {tokens} tokens")
    return ids.reshape(-1, msg.route_width)
