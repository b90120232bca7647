"""Custom rollout functions: an environment entry `rollout_fn: module:function` runs the user's own
episode loop in the bridge instead of one of the environment connectors.

    async def my_rollout(task: dict, handle: GenerationHandle) -> Episode: ...

The function receives the task (its fields, as `reset(**task)` would) and a generation handle,
runs whatever loop it likes (several model turns, calls to any environment or tool of its own),
and returns the episode as turns plus named rewards. The handle generates with the engine the
bridge serves, from token ids or chat messages, and returns the token ids and logprobs the engine
produced (never re-tokenised). What the function returns is checked (`check_episode`): lengths of
ids, logprobs and loss masks, finite rewards, and that every trained token (loss mask 1) is one
the handle generated, with its logprob; a wrong episode ends as an error naming the function. The
episode then takes the path of every other episode (a `bridge.wire.TrajectoryData`): group
sampling, sync and async mode, several environments, filters and metrics apply unchanged.

The bridge imports the function's module: it must be importable in the bridge process (the
working directory `jaxrl train` runs in, or PYTHONPATH).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bridge.engines.base import Engine, SamplingParams, derive_seed
from bridge.envs.render import answer_ids, prompt_ids
from bridge.envs.spec import EnvConfigError, EnvSpec, RolloutFnError, import_object, reward_value
from bridge.wire import ENV_VERSION, TrajectoryData

LOGPROB_TOLERANCE = 1e-4  # float32 on the wire, float64 in Python: the same number, rounded


@dataclasses.dataclass(frozen=True)
class Generation:
    """What one `GenerationHandle.generate` call produced: the prompt as sent, the tokens the
    engine sampled and their logprobs, why it stopped ('stop' or 'length'), the weights' version,
    and the tokens decoded without special tokens (for reading, never for training). `version` is the
    weights' that sampled the first token; new weights may arrive while a generation runs, and
    `token_versions` has each token's."""

    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int
    text: str
    token_versions: list[int]


@dataclasses.dataclass(frozen=True)
class Turn:
    """A stretch of the episode's completion: token ids, one logprob and one loss mask entry per
    token (1: trained, and then the token must be one the handle generated)."""

    ids: Sequence[int]
    logprobs: Sequence[float]
    loss_mask: Sequence[int]

    @classmethod
    def model(cls, generation: Generation) -> Turn:
        """The model's turn as generated, trained on."""
        return cls(list(generation.ids), list(generation.logprobs), [1] * len(generation.ids))

    @classmethod
    def context(cls, ids: Sequence[int]) -> Turn:
        """Tokens the model reads but is not trained on (an observation, a tool result, a critique
        request)."""
        return cls(list(ids), [0.0] * len(ids), [0] * len(ids))


@dataclasses.dataclass(frozen=True)
class Episode:
    """What a rollout function returns: the prompt (the tokens before the first turn), the turns,
    rewards by name (None: does not apply; the run's `rewards:` entries weigh them by name), and
    optional per-episode metrics (numbers, logged as env/NAME/KEY when they are tool_calls and
    the like)."""

    prompt_ids: Sequence[int]
    turns: Sequence[Turn]
    rewards: Mapping[str, float | None]
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)


class GenerationHandle:
    """The rollout function's access to the model the bridge serves.

    `generate` samples with the run's settings (temperature, top_p, tokens per turn, EOS stop,
    the episode's seed: call k of an episode samples with its own derived seed, the same when the
    episode is replayed), any of which a call may override. `tokenizer` is the model's.
    """

    def __init__(self, engine: Engine, tokenizer: Any, params: SamplingParams,
                 template_kwargs: Mapping[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.max_tokens = params.max_tokens
        self.max_total_tokens = params.max_total_tokens
        self._engine = engine
        self._params = params
        self._template_kwargs = dict(template_kwargs or {})
        self.generations: list[Generation] = []  # every call's output, in order: what check_episode accepts
        self.generate_s = 0.0

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                 add_generation_prompt: bool = True) -> list[int]:
        """`messages` rendered with the model's chat template (and the run's chat_template_kwargs)."""
        return prompt_ids(self.tokenizer, messages, tools, self._template_kwargs, add_generation_prompt)

    def reply_ids(self, after: Generation, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The tokens that follow the model's turn `after` when `messages` (user or tool messages) answer
        it: the chat template's end of that turn where the model did not write it (a length cut), the
        messages, and the next generation prompt. The model's own tokens are never re-rendered."""
        return answer_ids(self.tokenizer, after.ids, messages, self._template_kwargs)

    async def generate(self, prompt: Sequence[int] | Sequence[Mapping[str, Any]], *, max_tokens: int | None = None,
                       temperature: float | None = None, top_p: float | None = None,
                       stop: Sequence[str] | None = None) -> Generation:
        """One completion of `prompt` (token ids, or chat messages rendered by `chat_ids`)."""
        ids = [int(t) for t in prompt] if not prompt or not isinstance(prompt[0], Mapping) else self.chat_ids(prompt)
        p = self._params
        changes: dict[str, Any] = {"n": 1, "seed": None if p.seed is None else derive_seed(p.seed, len(self.generations))}
        for key, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p)):
            if value is not None:
                changes[key] = value
        if stop is not None:
            changes["stop"] = tuple(stop)
        t0 = time.perf_counter()
        [[completion]] = await self._engine.generate([ids], dataclasses.replace(p, **changes))
        self.generate_s += time.perf_counter() - t0
        out = Generation(ids, list(completion.token_ids), [float(x) for x in completion.logprobs],
                         completion.finish_reason, completion.policy_version,
                         self.tokenizer.decode(completion.token_ids, skip_special_tokens=True),
                         list(completion.token_versions))
        self.generations.append(out)
        return out


def load_rollout_fn(spec_name: str, path: str) -> Any:
    """The function `path` ('module:function') names; EnvConfigError unless it is an async function."""
    fn = import_object(path, f"environment {spec_name!r}: rollout_fn")
    if not inspect.iscoroutinefunction(fn):
        raise EnvConfigError(f"environment {spec_name!r}: rollout_fn {path!r} must be an `async def` function "
                             "(task, handle) -> Episode; it awaits handle.generate(...)")
    return fn


class RolloutFnConnector:
    """An environment entry with `rollout_fn`: the function, imported (and checked) when the bridge
    builds its environments. Its episodes run through `run_rollout_fn`, not an episode hook."""

    mode = "rollout_fn"
    metrics: dict[str, float] = {}

    def __init__(self, spec: EnvSpec):
        self.spec = spec
        self.label = f"rollout_fn {spec.rollout_fn!r}"
        self.fn = load_rollout_fn(spec.name, spec.rollout_fn)

    async def start(self) -> None:
        pass  # nothing to reach: the function calls what it needs itself

    async def aclose(self) -> None:
        pass


def check_episode(episode: Any, handle: GenerationHandle, what: str) -> list[int]:
    """The weights' version of each trained token; RolloutFnError (RewardError for a reward) naming
    `what` (the function) for an episode that cannot be trained on."""
    if not isinstance(episode, Episode):
        raise RolloutFnError(f"{what} returned {type(episode).__name__}, not a bridge.envs.rollout_fn.Episode")
    if not episode.prompt_ids:
        raise RolloutFnError(f"{what} returned an episode without prompt_ids (the tokens before its first turn)")
    trained = []  # (token, logprob, turn index, position) of every loss-mask-1 token, in order
    for k, turn in enumerate(episode.turns):
        n = len(turn.ids)
        if len(turn.loss_mask) != n or len(turn.logprobs) != n:
            raise RolloutFnError(f"{what}: turn {k} has {n} ids, {len(turn.logprobs)} logprobs and "
                                 f"{len(turn.loss_mask)} loss mask entries; they must be equal")
        if any(m not in (0, 1) for m in turn.loss_mask):
            raise RolloutFnError(f"{what}: turn {k}'s loss mask holds values other than 0 and 1")
        trained += [(int(t), float(lp), k, i) for i, (t, lp, m) in enumerate(zip(turn.ids, turn.logprobs,
                                                                               turn.loss_mask)) if m]
    versions = _check_generated(trained, handle.generations, what)
    total = sum(len(t.ids) for t in episode.turns)
    if handle.max_total_tokens and total > handle.max_total_tokens:
        raise RolloutFnError(f"{what}: the episode's turns hold {total} tokens, over rollout.max_total_tokens="
                             f"{handle.max_total_tokens}; pass smaller max_tokens to handle.generate")
    for name, value in episode.rewards.items():
        reward_value(value, f"{what} (reward {name!r})")  # RewardError: stops the run, naming the function
    for name, value in episode.metrics.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RolloutFnError(f"{what}: metric {name!r} is {value!r}; metrics must be finite numbers")
    return versions


def _check_generated(trained: list[tuple[int, float, int, int]], generations: list[Generation],
                     what: str) -> list[int]:
    """Each run of trained tokens must be made of stretches of the handle's generations, ids and
    logprobs: ids decoded and encoded again, or written by hand, are not what the policy sampled.
    Returns the version of the generation each trained token came from."""

    def longest(i: int, logprobs: bool) -> tuple[int, Generation | None, int]:
        best: tuple[int, Generation | None, int] = (0, None, 0)
        for g in generations:
            for start in range(len(g.ids)):
                n = 0
                while (i + n < len(trained) and start + n < len(g.ids) and trained[i + n][0] == g.ids[start + n]
                       and (not logprobs or abs(trained[i + n][1] - g.logprobs[start + n]) <= LOGPROB_TOLERANCE)
                       and (n == 0 or trained[i + n][2:] == (trained[i + n - 1][2], trained[i + n - 1][3] + 1))):
                    n += 1
                if n > best[0]:
                    best = (n, g, start)
        return best

    versions, i = [], 0
    while i < len(trained):
        n, g, start = longest(i, logprobs=True)
        if g is None:
            token, logprob, turn, pos = trained[i]
            _, g, start = longest(i, logprobs=False)
            if g is not None:
                raise RolloutFnError(f"{what}: turn {turn} position {pos} has logprob {logprob:.6g}, but the handle "
                                     f"generated that token with {g.logprobs[start]:.6g}; pass Generation.logprobs "
                                     "as returned")
            raise RolloutFnError(f"{what}: turn {turn} trains on token {token} at position {pos}, which the handle "
                                 "did not generate there (re-tokenised text?); train only on Generation.ids, loss "
                                 "mask 0 elsewhere")
        versions += g.token_versions[start:start + n]
        i += n
    return versions


async def run_rollout_fn(fn: Any, label: str, engine: Engine, tokenizer: Any, group_id: str, index: int, env: str,
                         task: dict[str, Any], params: SamplingParams,
                         template_kwargs: Mapping[str, Any] | None = None) -> TrajectoryData:
    """One episode of rollout function `fn` (`label` names it in errors: "rollout_fn 'module:function'",
    "harness URL"), as a trajectory. What it raises ends the episode with
    finish_reason 'error' (as an environment failure would); what it returns wrong too, its error
    starting with "RolloutFnError: " or "RewardError: ", which stops the run (a bug in the function)."""
    start = time.perf_counter()
    handle = GenerationHandle(engine, tokenizer, params, template_kwargs)
    what = f"{label} (environment {env!r}, episode {group_id}/{index})"
    traj = TrajectoryData(group_id, index, np.zeros(0, np.int32), env=env)
    try:
        episode = await fn(dict(task), handle)
        versions = iter(check_episode(episode, handle, what))
    except Exception as e:
        traj.finish_reason, traj.error = "error", f"{type(e).__name__}: {e}"
    else:
        traj.prompt_ids = np.asarray([int(t) for t in episode.prompt_ids], np.int32)
        trained = [bool(m) for turn in episode.turns for m in turn.loss_mask]
        logprobs = [float(lp) for turn in episode.turns for lp in turn.logprobs]
        traj.completion_ids = np.asarray([int(t) for turn in episode.turns for t in turn.ids], np.int32)
        traj.sampler_logprobs = np.where(trained, logprobs, 0.0).astype(np.float32)
        traj.loss_mask = np.asarray(trained, np.uint8)
        traj.token_versions = np.asarray([next(versions) if m else ENV_VERSION for m in trained], np.int64)
        traj.num_turns = sum(any(t.loss_mask) for t in episode.turns)
        traj.rewards = {k: float(v) for k, v in episode.rewards.items() if v is not None}
        traj.metrics.update({k: float(v) for k, v in episode.metrics.items()})
        last = handle.generations[-1].finish_reason if handle.generations else "stop"
        traj.finish_reason = "length" if last == "length" else "stop"
    traj.generate_s = handle.generate_s
    traj.total_s = time.perf_counter() - start
    traj.env_s = traj.total_s - traj.generate_s
    return traj


def from_trl(output: Mapping[str, Any]) -> Episode:
    """An Episode from what a TRL `rollout_func` returns, for one prompt: `prompt_ids`,
    `completion_ids`, `logprobs`, an optional `env_mask` (1 where the model wrote the token), and
    any other fields, each a reward by its name; every field a list of one entry, as TRL's are per prompt."""
    def one(key: str) -> Any:
        value = output[key]
        if not isinstance(value, (list, tuple)) or len(value) != 1:
            raise RolloutFnError(f"TRL rollout output field {key!r} must hold one entry (one prompt per call), got "
                                 f"{str(value)[:80]}")
        return value[0]

    missing = [k for k in ("prompt_ids", "completion_ids", "logprobs") if k not in output]
    if missing:
        raise RolloutFnError(f"TRL rollout output lacks {', '.join(missing)}")
    ids, logprobs = list(one("completion_ids")), list(one("logprobs"))
    mask = list(one("env_mask")) if "env_mask" in output else [1] * len(ids)
    rewards = {k: one(k) for k in output if k not in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
    return Episode(list(one("prompt_ids")), [Turn(ids, logprobs, mask)], rewards)
