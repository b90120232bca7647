"""Episodes, token-in/token-out: the engine's completion tokens are kept exactly as produced.

An episode generates a turn, hands it to its environment hook (if any), appends what the hook
returns (tool results, observations: loss mask 0, no logprobs) and generates again, until the
model stops without the hook asking for more, the hook says done, `params.max_turns`, or the
token budget (`params.max_total_tokens`). An answer that does not fit the budget ends the episode
unappended ("length"), as TRL's GRPOTrainer drops it: no model turn could follow it, and the
learner would cut it at the budget.
Without a hook an episode is one turn, rewarded by the reward functions alone.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

import numpy as np

from bridge.engines.base import Engine, PromptTooLong, SamplingParams, derive_seed
from bridge.wire import ENV_VERSION, TrajectoryData


@dataclasses.dataclass
class TurnResult:
    """What the environment answers to one model turn."""

    append_ids: list[int]  # tokens to append before the next turn (tool results); loss mask 0
    done: bool
    rewards: dict[str, float] = dataclasses.field(default_factory=dict)


class EpisodeHook(Protocol):
    """The per-episode environment side of the loop (the environments layer implements it)."""

    async def start(self) -> list[int]:
        """Resets the environment; returns extra prompt tokens (may be empty)."""

    async def turn(self, completion_ids: list[int]) -> TurnResult:
        """Runs the model's turn (e.g. its tool calls) against the environment."""

    async def finish(self, trajectory: TrajectoryData) -> dict[str, float]:
        """After an episode that did not fail: its rewards by name."""

    async def close(self) -> None:
        """Releases the session (called however the episode ended; may be called twice)."""


async def run_episode(
    engine: Engine,
    group_id: str,
    index: int,
    prompt_ids: list[int],
    params: SamplingParams,
    hook: EpisodeHook | None = None,
    env: str = "",
    retry_on: tuple[type[BaseException], ...] = (),
) -> TrajectoryData:
    """One episode; failures of the environment end it with finish_reason 'error', never raise.

    Except `retry_on` exceptions (a lost environment session): those propagate, the hook closed,
    for the caller to replay the episode from the start. A seeded episode's turn k samples with
    derive_seed(params.seed, k): every turn its own stream, the same ones when replayed.
    """
    start = time.perf_counter()
    traj = TrajectoryData(group_id, index, np.asarray(prompt_ids, np.int32), env=env)
    budget = params.max_total_tokens or params.max_tokens
    try:
        if hook is not None:
            t0 = time.perf_counter()
            traj.prompt_ids = np.concatenate([traj.prompt_ids, np.asarray(await hook.start(), np.int32)])
            traj.env_s += time.perf_counter() - t0
        while True:
            remaining = budget - len(traj.completion_ids)
            turn_params = dataclasses.replace(
                params, n=1, max_tokens=min(params.max_tokens, remaining),
                seed=None if params.seed is None else derive_seed(params.seed, traj.num_turns))
            t0 = time.perf_counter()
            context = np.concatenate([traj.prompt_ids, traj.completion_ids]).tolist()
            [[completion]] = await engine.generate([context], turn_params)
            traj.generate_s += time.perf_counter() - t0
            traj.append(completion.token_ids, completion.logprobs, True, completion.token_versions)
            traj.add_routes(completion.routes)
            traj.num_turns += 1
            if hook is None:
                traj.finish_reason = completion.finish_reason
                break
            t0 = time.perf_counter()
            result = await hook.turn(completion.token_ids)
            traj.env_s += time.perf_counter() - t0
            traj.rewards.update(result.rewards)
            if result.done:
                traj.finish_reason = "env_done"
                break
            if not result.append_ids and completion.finish_reason == "stop":
                traj.finish_reason = "stop"  # the model answered without asking for anything
                break
            if len(traj.completion_ids) + len(result.append_ids) > budget:
                traj.finish_reason = "length"
                break
            traj.append(result.append_ids, [], False, ENV_VERSION)
            if traj.num_turns >= params.max_turns:
                # Unanswered, the turn was cut by max_tokens (a "stop" ended the episode above): the
                # episode ends by its length, and no one is told to raise rollout.max_turns.
                traj.finish_reason = "max_turns" if result.append_ids else "length"
                break
            if len(traj.completion_ids) >= budget:
                traj.finish_reason = "length"
                break
        if hook is not None:
            t0, rewarded = time.perf_counter(), traj.reward_s
            traj.rewards.update(await hook.finish(traj))
            traj.env_s += time.perf_counter() - t0 - (traj.reward_s - rewarded)  # reward models: their own phase
    except retry_on:
        raise
    except PromptTooLong as e:
        traj.finish_reason, traj.error = "error", _too_long(env, traj.num_turns, e)
    except Exception as e:  # a broken environment costs this episode, not the rollout
        traj.finish_reason, traj.error = "error", f"{type(e).__name__}: {e}"
    finally:
        if hook is not None:
            traj.metrics.update(getattr(hook, "metrics", None) or {})
            await hook.close()
    traj.total_s = time.perf_counter() - start
    return traj


def _too_long(env: str, turns: int, e: PromptTooLong) -> str:
    """A prompt the engine cannot take, in the keys of a run that set its size."""
    what = "the first prompt" if turns == 0 else f"the conversation after turn {turns}"
    where = f" of environment {env!r}" if env else ""
    return (f"{what}{where} has {e.tokens} tokens, but the bridge holds {e.limit} tokens per sequence "
            "(rollout.max_prompt_tokens + rollout.max_total_tokens): raise rollout.max_prompt_tokens, or show the "
            "model less of each observation (the environment's observation_field or observation_template)")
