"""The bridge's environments for a run: one connector per named environment, built from the
environments file the trainer writes, checked before any episode runs, and the shared pieces
(tokenizer, tool-call parser, reward functions) every episode hook of any kind uses."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
from typing import Any

from bridge.envs.endpoint import Endpoint
from bridge.envs.episode import EnvEpisodeHook
from bridge.envs.group_check import GroupCheck
from bridge.envs.harness import HarnessConnector
from bridge.envs.in_process import InProcessConnector
from bridge.envs.render import RenderCache
from bridge.envs.rollout_fn import RolloutFnConnector
from bridge.envs.scoring import RewardFunctions
from bridge.envs.served import ServedConnector
from bridge.envs.spec import EnvConfigError, EnvSpec, RewardSpec, env_factory, import_object
from bridge.envs.tool_class import ToolClassConnector
from bridge.envs.tools import ToolEnvironment
from bridge.tool_calls import ToolCallParser, get_parser, hidden_special_ids

log = logging.getLogger(__name__)

Connector = ServedConnector | InProcessConnector | ToolClassConnector | RolloutFnConnector | HarnessConnector


def build_connector(spec: EnvSpec, parser: ToolCallParser | None = None) -> Connector:
    """The connector for `spec` (a `bundled` spec must have been given its server's url); `parser` reads
    the tool calls a harness's model calls return (default: the default parser's)."""
    if spec.rollout_fn:
        return RolloutFnConnector(spec)
    if spec.harness:
        return HarnessConnector(spec, parser or get_parser())
    if spec.url:
        pool = dataclasses.replace(spec.session, max_sessions=spec.pool_size)
        return ServedConnector(spec, Endpoint(spec.url, pool, name=spec.name))
    if spec.bundled:
        raise EnvConfigError(f"environment {spec.name!r}: bundled {spec.bundled!r} has no server; the trainer "
                             "starts bundled servers and passes their url")
    from openenv.core.env_server import Environment

    cls = import_object(spec.env_class, f"environment {spec.name!r}: env_class")
    if not inspect.isclass(cls):
        raise EnvConfigError(f"environment {spec.name!r}: env_class {spec.env_class!r} is not a class")
    make = env_factory(spec, cls)
    if issubclass(cls, Environment):
        return InProcessConnector(spec, cls, make)
    return ToolClassConnector(spec, cls, make)


async def reset_once(spec: EnvSpec, task: dict[str, Any]) -> None:
    """One episode of `spec` started on `task` and closed again (a tool class's reward unread: no
    turn was played); raises what its start raised."""
    connector = build_connector(spec)
    try:
        await connector.start()
        if isinstance(connector, ToolClassConnector):
            env = ToolEnvironment(connector.make())
            try:
                await env.areset(**task)
            finally:
                await env.aclose()
        else:
            episode = await connector.open(dict(task))
            await episode.close()
    finally:
        await connector.aclose()


class EnvRuntime:
    """The bridge's environments: connectors by name, the tokenizer, the parser, reward functions."""

    def __init__(self, specs: list[EnvSpec], tokenizer: Any, parser: ToolCallParser,
                 rewards: list[RewardSpec] = (), template_kwargs: dict[str, Any] | None = None):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise EnvConfigError(f"environment names must be unique, got {names}")
        self.specs = {s.name: s for s in specs}
        self.tokenizer = tokenizer
        self.parser = parser
        self.hidden_ids = hidden_special_ids(tokenizer, parser.delimiters)  # left out of what the parser reads
        self.template_kwargs = dict(template_kwargs or {})
        self.render = RenderCache(tokenizer, self.template_kwargs)
        self.rewards = RewardFunctions(rewards, tokenizer)
        self.connectors = {s.name: build_connector(s, parser) for s in specs}
        self.started = False
        self.groups = GroupCheck()
        self._warned: set[tuple[str, str]] = set()
        self._notices: dict[str, list[str]] = {}  # by environment: warnings its next finished episode carries

    async def start(self) -> None:
        """Checks every environment answers (or can be built) before any episode runs; once."""
        if self.started:
            return
        self.started = True
        for name, connector in self.connectors.items():
            try:
                await connector.start()
            except EnvConfigError:
                raise
            except Exception as e:
                raise EnvConfigError(f"environment {name!r}: {type(e).__name__}: {e}") from e
            for message in getattr(connector, "notices", ()):  # what its schemas leave the model unable to do
                self.warn_once(name, message, message)

    def warn_once(self, env: str, kind: str, message: str) -> None:
        """Logs `message` about what the model sees of environment `env` the first time a warning of
        this `kind` comes, and hands it to the trainer with the environment's next finished episode
        (`take_notices`): a warning the user must act on belongs on the trainer's console, not only in
        the bridge's log."""
        if (env, kind) not in self._warned:
            self._warned.add((env, kind))
            log.warning("environment %r: %s", env, message)
            self._notices.setdefault(env, []).append(message)

    def take_notices(self, env: str) -> list[str]:
        """The warnings about `env` not yet handed on (see `warn_once`); each is handed on once."""
        return self._notices.pop(env, [])

    def hook(self, env: str, task: dict[str, Any], group_id: str | None = None) -> EnvEpisodeHook | None:
        """The episode hook of `env` for an episode of group `group_id` (its first prompt is checked against
        the group's: `group_check`); None for a rollout function's or a harness's (they run their own loop:
        `rollout_fn`)."""
        if env not in self.connectors:
            raise ValueError(f"unknown environment {env!r}; this bridge serves: {', '.join(self.connectors)}")
        if isinstance(self.connectors[env], (RolloutFnConnector, HarnessConnector)):
            return None
        return EnvEpisodeHook(self, self.connectors[env], task, group_id)

    def rollout_fn(self, env: str) -> RolloutFnConnector | HarnessConnector | None:
        """`env`'s episode function (`fn`, named by `label`), if it plays its own episodes: a rollout
        function, or a harness environment."""
        connector = self.connectors.get(env)
        return connector if isinstance(connector, (RolloutFnConnector, HarnessConnector)) else None

    def metrics(self) -> dict[str, float]:
        out = {}
        for name, connector in self.connectors.items():
            for k, v in connector.metrics.items():
                out[f"env.{name}.{k}"] = float(v)
        return out

    async def aclose(self) -> None:
        for connector in self.connectors.values():
            await connector.aclose()


def runtime_from_dict(data: dict[str, Any], tokenizer: Any) -> EnvRuntime:
    """An EnvRuntime from `{"envs": [...], "rewards": [...], "tool_parser": "qwen",
    "chat_template_kwargs": {...}}` (what the trainer writes for its bridges)."""
    from bridge.tool_calls import get_parser

    unknown = sorted(set(data) - {"envs", "rewards", "tool_parser", "chat_template_kwargs"})
    if unknown:
        raise EnvConfigError(f"environments file: unknown key(s) {', '.join(unknown)}")
    specs = [EnvSpec.from_dict(d) for d in data.get("envs") or []]
    if not specs:
        raise EnvConfigError("environments file lists no environments")
    rewards = [RewardSpec.from_dict(d) for d in data.get("rewards") or []]
    try:
        parser = get_parser(data.get("tool_parser"))
    except ValueError as e:
        raise EnvConfigError(str(e)) from None
    return EnvRuntime(specs, tokenizer, parser, rewards, data.get("chat_template_kwargs"))


def runtime_from_file(path: str, model_dir: str) -> EnvRuntime:
    """The runtime a `jaxrl bridge --envs FILE` serves, with the model directory's tokenizer."""
    from jaxrl.models import load_tokenizer

    try:
        data = json.loads(open(path).read())
    except (OSError, json.JSONDecodeError) as e:
        raise EnvConfigError(f"environments file {path}: {e}") from None
    tokenizer = load_tokenizer(model_dir)
    return runtime_from_dict(data, tokenizer)
