"""What a run checks of its environments before it trains, run as the bridge runs them: one reset of an
environment on a task, or the first prompt an episode hands the engine (`python -m bridge env probe`).

The trainer runs it as a process of its own (jaxrl.run.env_probe), so that it never imports an
environment's code or the bridge's runtime itself.
"""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

from bridge.envs.runtime import reset_once, runtime_from_dict
from bridge.envs.spec import EnvConfigError, EnvSpec, TaskRefused


def check_reset(spec: EnvSpec, task: dict[str, Any], what: str) -> None:
    """Starts one episode of `spec` on `task` and closes it; TaskRefused naming `what` task when the
    environment cannot take it, EnvConfigError when it cannot start at all."""
    try:
        with warnings.catch_warnings():  # libraries' deprecations: the bridge's log has them, the caller's stderr not
            warnings.simplefilter("ignore")
            asyncio.run(reset_once(spec, task))
    except EnvConfigError:
        raise
    except Exception as e:
        raise TaskRefused(f"environment {spec.name!r} cannot take its {what} {task!r}: "
                          f"{type(e).__name__}: {e}") from None


def first_prompt_ids(envs: dict[str, Any], tokenizer: Any, env: str, task: dict[str, Any]) -> list[int]:
    """The tokens an episode of `env` on `task` hands the engine first, as the bridge renders them
    (reset's observation, the task's prompt, the system prompt, the tools, the chat template); `envs`
    as the trainer writes its bridges' environments file. EnvConfigError for a rollout_fn or harness
    environment (it renders its own) and for what stops a bridge's start."""

    async def render() -> list[int]:
        runtime = runtime_from_dict(envs, tokenizer)
        own = runtime.rollout_fn(env)
        if own is not None:  # before start: a harness's endpoint port may be a running bridge's
            raise EnvConfigError(f"environment {env!r} is a {own.mode} environment: its "
                                 f"{'harness' if own.mode == 'harness' else 'function'} builds its own prompts")
        try:
            await runtime.start()
            hook = runtime.hook(env, task)
            try:
                return await hook.start()
            finally:
                await hook.close()
        finally:
            await runtime.aclose()

    return asyncio.run(render())


def probe(envs: dict[str, Any], items: list[dict[str, Any]], tokenizer: Any | None) -> list[dict[str, Any]]:
    """Each item ({"env", "task", "what", "prompt": bool}) run: with "prompt", its first prompt's tokens
    ({"prompt_ids": [...]}), else one reset ({}); {"refused": message} when the environment cannot take
    the task, {"error": message} when it cannot start at all."""
    specs = {d["name"]: EnvSpec.from_dict(d) for d in envs["envs"]}
    out = []
    for item in items:
        env, task, what = item["env"], item["task"], item["what"]
        try:
            if item.get("prompt"):
                out.append({"prompt_ids": first_prompt_ids(envs, tokenizer, env, task)})
            else:
                check_reset(specs[env], task, what)
                out.append({})
        except TaskRefused as e:
            out.append({"refused": str(e)})
        except EnvConfigError as e:
            out.append({"error": str(e)})
        except Exception as e:  # the environment's own failure to start an episode on the task
            out.append({"refused": f"environment {env!r} cannot start an episode on its {what} {task!r}: "
                                   f"{type(e).__name__}: {e}"})
    return out
