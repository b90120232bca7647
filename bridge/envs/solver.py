"""Solver episodes: an environment's own solver plays through the real episode hook.

The trajectory is what `bridge.rollout.run_episode` would record had the model written the
solver's replies (tokenized, plus EOS): the chat-template prompt, the replies (loss mask 1) and
what the environment answers (loss mask 0), token for token what the policy sees in RL. The
warm start trains on these (`RolloutRequest.policy = "solver"`).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from bridge.envs.bundled import BUNDLED
from bridge.wire import ENV_VERSION, TrajectoryData

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


async def solver_episode(runtime: Any, group_id: str, index: int, env: str, task: dict[str, Any],
                         retry_on: tuple[type[BaseException], ...] = ()) -> TrajectoryData:
    """One episode of `env` on `task` with its solver as the policy; failures end it as 'error'.

    Like `run_episode`, `retry_on` exceptions (a lost session) propagate for the caller to replay.
    """
    solve = BUNDLED[runtime.specs[env].solver].solve
    tok = runtime.tokenizer
    hook = runtime.hook(env, task)
    traj = TrajectoryData(group_id, index, np.zeros(0, np.int32), env=env)
    try:
        traj.prompt_ids = np.asarray(await hook.start(), np.int32)
        while True:
            if traj.num_turns >= MAX_SOLVER_TURNS:
                raise RuntimeError(f"the solver did not end the episode within {MAX_SOLVER_TURNS} turns")
            text = reply_text(solve(hook.episode.record.observations), hook.connector)
            reply = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            traj.append(reply, [0.0] * len(reply), True, 0)
            traj.num_turns += 1
            result = await hook.turn(reply)
            if result.done:
                break
            traj.append(result.append_ids, [], False, ENV_VERSION)
        traj.finish_reason = "env_done"
        traj.rewards.update(await hook.finish(traj))
    except retry_on:
        raise
    except Exception as e:
        traj.finish_reason, traj.error = "error", f"solver: {type(e).__name__}: {e}"
    finally:
        traj.metrics.update(hook.metrics)
        await hook.close()
    return traj
