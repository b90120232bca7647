"""Environment classes in the style of TRL's `environment_factory`, each episode its own instance:
the class's documented public methods are the tools (`tools.ToolEnvironment`), and its own
`get_reward()` / `reward()` is the environment's reward, read before the instance is closed."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from bridge.envs.episode import EpisodeRecord, Step
from bridge.envs.spec import EnvSpec, reward_value
from bridge.envs.tools import ToolEnvironment


class ToolClassEpisode:
    """One episode of a tool-environment class: its own instance, tools by its methods."""

    mode = "tool_class"

    def __init__(self, spec: EnvSpec, make: Callable[[], Any], task: dict[str, Any]):
        self.spec = spec
        self.env = ToolEnvironment(make())
        self.record = EpisodeRecord(spec.name, task)
        self.tools = self.env.tools
        self.first_text = ""
        self.metrics: dict[str, float] = {}

    async def start(self) -> None:
        self.first_text = await self.env.areset(**self.record.task)

    async def call_tool(self, name: str, arguments: Any) -> Step:
        errors = self.env.metrics["errors"]
        text = await self.env.acall(name, arguments, timeout_s=self.spec.session.step_timeout_s)
        self.record.done = bool(getattr(self.env.env, "done", False))
        return Step(text, self.record.done, self.env.metrics["errors"] > errors)

    async def close(self) -> None:
        name = "get_reward" if callable(getattr(self.env.env, "get_reward", None)) else "reward"  # TRL's, ours
        reward = getattr(self.env.env, name, None)
        if callable(reward):  # the class's own reward, read before it is closed
            value = reward()
            if inspect.isawaitable(value):
                value = await value
            value = reward_value(value, f"environment {self.spec.name!r} (its {name}())")
            if value is not None:
                self.record.rewards.append(value)
        await self.env.aclose()

    @property
    def handle(self) -> Any:
        return self.env.env


class ToolClassConnector:
    mode = "tool_class"

    def __init__(self, spec: EnvSpec, cls: type, make: Callable[[], Any]):
        self.spec = spec
        self.cls = cls
        self.make = make  # an instance of cls, built with the spec's env_kwargs

    async def start(self) -> None:
        ToolEnvironment(self.make())  # schema mistakes in the class surface at start-up

    async def open(self, task: dict[str, Any]) -> ToolClassEpisode:
        episode = ToolClassEpisode(self.spec, self.make, task)
        await episode.start()
        return episode

    metrics: dict[str, float] = {}

    async def aclose(self) -> None:
        pass
