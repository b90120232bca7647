"""Solver episodes: an environment's own solver plays through the real episode loop and hook.

The solver is an engine (`SolverEngine`) that `bridge.rollout.run_episode` plays as it plays the
model, so the trajectory is what an episode records had the model written the solver's replies
(tokenized, plus EOS): the chat-template prompt, the replies (loss mask 1) and what the environment
answers (loss mask 0), token for token what the policy sees in RL. The warm start trains on these
(`RolloutRequest.policy = "solver"`).
"""

from __future__ import annotations

import json
from typing import Any

from bridge.engines.base import Completion, EngineError, SamplingParams
from bridge.envs.bundled import BUNDLED
from bridge.rollout import run_episode
from bridge.wire import TrajectoryData

MAX_SOLVER_TURNS = 64  # a solver that has not finished by then is broken, not slow


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One call in the Qwen / Hermes format that `bridge.tool_calls` parses."""
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def reply_text(action: Any, connector: Any) -> str:
    """The model reply that makes the hook play `action` in the connector's action mode."""
    fields = action.model_dump(exclude={"metadata"}) if hasattr(action, "model_dump") else dict(action)
    mode = connector.mode
    if mode == "text":
        return fields[connector.text_field]
    if mode == "tool_call":
        return tool_call_text(fields["tool"], fields.get("arguments") or {})
    if mode == "mcp":
        return tool_call_text(fields["tool_name"], fields.get("arguments") or {})
    if mode == "tool":
        return tool_call_text(connector.action_tool["function"]["name"], fields)
    raise ValueError(f"environment {connector.spec.name!r}: cannot demonstrate action mode {mode!r}")


class SolverEngine:
    """An engine whose every turn is the environment's solver's reply to what the episode has observed:
    `run_episode` plays it as it plays the model (version 0, logprobs 0, ended by EOS)."""

    name, policy_version = "solver", 0

    def __init__(self, solve: Any, hook: Any, tokenizer: Any):
        self.solve, self.hook, self.tokenizer = solve, hook, tokenizer

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        text = reply_text(self.solve(self.hook.episode.record.observations), self.hook.connector)
        reply = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return [[Completion(reply, [0.0] * len(reply), "stop", self.policy_version)] for _ in prompts]

    async def load_snapshot(self, path: str, version: int) -> float:
        raise EngineError("a solver has no weights to load")

    async def close(self) -> None:
        pass


async def solver_episode(runtime: Any, group_id: str, index: int, env: str, task: dict[str, Any],
                         retry_on: tuple[type[BaseException], ...] = ()) -> TrajectoryData:
    """One episode of `env` on `task` with its solver as the policy; failures, and an episode the
    environment did not end within MAX_SOLVER_TURNS, end it as 'error'.

    Like `run_episode`, `retry_on` exceptions (a lost session) propagate for the caller to replay.
    """
    hook = runtime.hook(env, task)
    engine = SolverEngine(BUNDLED[runtime.specs[env].solver].solve, hook, runtime.tokenizer)
    unbounded = SamplingParams(max_tokens=1 << 30, max_turns=MAX_SOLVER_TURNS, max_total_tokens=1 << 30)
    traj = await run_episode(engine, group_id, index, [], unbounded, hook, env, retry_on)
    if traj.finish_reason == "error":
        traj.error = f"solver: {traj.error}"
    elif traj.finish_reason != "env_done":
        traj.finish_reason, traj.error = "error", (f"solver: the environment did not end the episode within "
                                                   f"{MAX_SOLVER_TURNS} turns (it ended by {traj.finish_reason!r})")
    return traj
