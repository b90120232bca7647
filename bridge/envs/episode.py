"""Episodes against environments: the `EpisodeHook` the bridge's rollout loop drives.

Three kinds of environment sit behind one interface (`Connector.open(task) -> EnvEpisode`):

- a running OpenEnv server (`url`), reached through the session layer (`bridge.envs.session`)
  over its WebSocket `/ws`; what a model turn means comes from the server's `/schema`;
- an openenv `Environment` subclass run in-process (`env_class`), one instance per episode,
  answering as OpenEnv's server would for the same class (`_LocalSession`);
- a tool-environment class (`env_class`, TRL `environment_factory` style): public documented
  methods are the tools (`bridge.envs.tools.ToolEnvironment`).

How a model turn becomes actions (`EnvSpec.action`, `auto` picks from the action schema):

- `text`: the reply (special tokens dropped, stripped) fills one string field; the
  observation comes back as the next user turn;
- `tool_call`: the action is `{tool, arguments}`; the tools are listed in reset's observation
  (`tools`); each parsed tool call is one step;
- `mcp`: OpenEnv MCP environments: tools from `ListToolsAction`, calls as `CallToolAction`;
- `tool`: the whole action is one tool whose parameters are the action's fields.

The first prompt is reset's observation as the user message, or, for a task in TRL's dataset
format (a `prompt` field), that prompt with the observation appended to its last message
(`first_prompt`). In the tool modes the parser reads the reply decoded without special tokens
but with its tool-call delimiters, which some tokenizers mark special (`hidden_special_ids`); a
turn without a tool call is the model's final answer. Malformed calls,
unknown tools, bad arguments and tools that raise come back to the model as `Error: ...` tool
results (counted in the episode's `tool_errors`), never as a crash; in text mode an action the
environment refuses (VALIDATION_ERROR, or its step raised) comes back as an `Error: ...` user
turn (counted in `action_errors`) and the episode goes on. Observations show every field that
says something, or what the environment's `observation_field` / `observation_template` says. Everything the environment
says is rendered with the model's chat template and appended with loss mask 0.

A lost session (`SessionLost`) or an unreachable endpoint (`EndpointUnavailable`) is raised out
of the hook: the bridge replays the whole episode from `reset()` on a fresh session.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import inspect
import json
import logging
from typing import Any

from bridge.envs.rollout_fn import RolloutFnConnector
from bridge.envs.session import Endpoint, EnvServerError
from bridge.envs.spec import (ENV_REWARD, EnvConfigError, EnvSpec, RewardError, RewardSpec, import_object,
                              reward_value, task_prompt, template_fields)
from bridge.envs.tools import ToolEnvironment
from bridge.rollout import TurnResult
from bridge.tool_calls import ToolCallParser, format_tool_results, hidden_special_ids, render_tool_results

log = logging.getLogger(__name__)

OBSERVATION_TEXT_FIELDS = ("text", "prompt", "message", "content")
# What reward functions get from the episode, never from task fields of the same name (TRL: the
# row's `prompt` reaches them as `prompts`).
_CALL_ARGUMENTS = frozenset({"prompt", "prompts", "completion", "completions", "completion_ids", "environments",
                             "env"})
_NOT_SHOWN = {"reward", "done", "metadata", "tools"}


@dataclasses.dataclass
class EpisodeRecord:
    """What reward functions see of an episode's environment (`environments[i]` for remote ones)."""

    env: str
    task: dict[str, Any]
    observations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)
    done: bool = False

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))

    @property
    def last_observation(self) -> dict[str, Any]:
        return self.observations[-1] if self.observations else {}


@dataclasses.dataclass
class Step:
    text: str
    done: bool = False
    error: bool = False


def observation_text(observation: dict[str, Any], field: str | None = None, template: str | None = None) -> str:
    """What the model is shown of an observation.

    `template`: a format string over its fields (RenderError naming a field it lacks); `field`: that
    field alone. Else every field that says something: the first text-like field (text, prompt,
    message, content) as it is, then the others as `name: value` lines (strings as they are, the
    rest as JSON); bookkeeping (reward, done, metadata, tools) and empty values (None, "", [], {})
    are left out, zeros and False are not.
    """
    if template is not None:
        try:
            return template.format_map(observation)
        except (KeyError, IndexError, AttributeError, TypeError, ValueError) as e:
            raise RenderError(f"observation_template {template!r} cannot render {sorted(observation)} "
                              f"({type(e).__name__}: {e})") from None
    if field is not None:
        value = observation.get(field, "")
        return value if isinstance(value, str) else json.dumps(value, default=str)
    shown = {k: v for k, v in observation.items()
             if k not in _NOT_SHOWN and not (v is None or (isinstance(v, (str, list, dict)) and not v))}
    main = next((k for k in OBSERVATION_TEXT_FIELDS if isinstance(shown.get(k), str)), None)
    lines = [shown.pop(main)] if main is not None else []
    lines += [f"{k}: {v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)}"
              for k, v in shown.items()]
    return "\n".join(lines)


class RenderError(ValueError):
    """An observation the environment's observation_template cannot render (a field it lacks)."""


def check_template(spec: EnvSpec, observation_schema: dict[str, Any]) -> None:
    """EnvConfigError naming the first field `spec.observation_template` uses that the observation
    schema lacks; no check when the schema lists no fields (e.g. an MCP server's base Observation)."""
    props = (inline_refs(observation_schema).get("properties") or {})
    if spec.observation_template is None or not set(props) - _NOT_SHOWN:
        return
    what = f"environment {spec.name!r}: observation_template"
    for name in template_fields(spec.observation_template, what):
        if name not in props:
            known = ", ".join(k for k in props if k not in _NOT_SHOWN)
            raise EnvConfigError(f"{what} names field {name!r}, which its observations do not have; they have: "
                                 f"{known}")


def inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with each local reference (`{"$ref": "#/$defs/Move"}`, pydantic's way to write enums
    and nested models) replaced by what it names, and the definitions dropped: chat templates pass
    schemas to the model as they are, and a bare reference tells it nothing. A model that contains
    itself keeps only its description below its first level."""
    defs = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}

    def walk(node: Any, seen: frozenset[str]) -> Any:
        if isinstance(node, list):
            return [walk(n, seen) for n in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
            name = ref.rsplit("/", 1)[1]
            target = defs.get(name)
            if target is not None:
                siblings = {k: v for k, v in node.items() if k != "$ref"}
                if name in seen:  # recursive: no finite inlining
                    return {"type": "object", **{k: v for k, v in target.items() if k == "description"}, **siblings}
                return walk({**target, **siblings}, seen | {name})
        return {k: walk(v, seen) for k, v in node.items()}

    return walk({k: v for k, v in schema.items() if k not in ("$defs", "definitions")}, frozenset())


def as_function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool spec in the chat templates' `{"type": "function", "function": {...}}` form, its
    parameters' references inlined."""
    if tool.get("type") == "function" and "function" in tool:
        function = tool["function"]
        return {**tool, "function": {**function, "parameters": inline_refs(function.get("parameters") or {})}}
    parameters = tool.get("parameters") or tool.get("input_schema") or tool.get("inputSchema") or {
        "type": "object", "properties": {}}
    return {"type": "function", "function": {
        "name": tool["name"], "description": tool.get("description") or "", "parameters": inline_refs(parameters)}}


def resolve_action_mode(spec: EnvSpec, action_schema: dict[str, Any]) -> tuple[str, str | None]:
    """(mode, text field) for an action JSON schema; EnvConfigError if `text` has no string field."""
    action_schema = inline_refs(action_schema)
    props = {k: v for k, v in (action_schema.get("properties") or {}).items() if k != "metadata"}
    mode = spec.action
    if mode == "auto":
        if {"tool_name", "arguments"} <= set(props):
            mode = "mcp"
        elif {"tool", "arguments"} <= set(props):
            mode = "tool_call"
        elif _string_field(action_schema) is not None or spec.text_field:
            mode = "text"
        else:
            mode = "tool"
    field = None
    if mode == "text":
        field = spec.text_field or _string_field(action_schema)
        if field is None or field not in props:
            raise EnvConfigError(
                f"environment {spec.name!r}: text mode needs a string action field; the action has "
                f"{', '.join(props) or 'no fields'}: set text_field, or action: tool")
    return mode, field


def _string_field(schema: dict[str, Any]) -> str | None:
    """The action's one required free-text field (an enum or constant is not free text: the tool
    mode's schema shows the model its values)."""
    props = schema.get("properties") or {}
    required = [k for k in schema.get("required", []) if k != "metadata"]
    strings = [k for k in required if props.get(k, {}).get("type") == "string"
               and not {"enum", "const"} & set(props[k])]
    return strings[0] if len(required) == 1 and len(strings) == 1 else None


def _action_tool(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    schema = inline_refs(schema)
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    required = [k for k in schema.get("required", []) if k in props]
    return as_function_tool({
        "name": name, "description": schema.get("description") or f"Act in the {name} environment.",
        "parameters": {"type": "object", "properties": props, "required": required}})


def _check_arguments(tool: dict[str, Any], arguments: Any) -> str | None:
    """What is wrong with a call's arguments against its JSON schema's fields, or None."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    params = tool["function"].get("parameters") or {}
    props = params.get("properties")
    missing = [k for k in params.get("required", []) if k not in arguments]
    unknown = sorted(set(arguments) - set(props)) if props is not None else []
    problems = []
    if missing:
        problems.append(f"missing argument(s) {', '.join(missing)}")
    if unknown:
        problems.append(f"unknown argument(s) {', '.join(unknown)}; expected: {', '.join(props) or 'none'}")
    return "; ".join(problems) or None


# -- sessions: remote or in-process, the same three calls ----------------------------------------


class _LocalSession:
    """An in-process openenv Environment that answers as OpenEnv's server does over `/ws` (the
    handler of `openenv.core.env_server.http_server`): the environment is built, reset, stepped and
    closed on one worker thread of its own, or awaited where it overrides `reset_async` /
    `step_async`; an MCP environment's MCP session stays open for the session; `reset` gets the
    task fields its signature accepts (the server's own filter); actions are parsed by the
    server's `deserialize_action` (MCP list/call actions included); failures are the server's
    VALIDATION_ERROR / EXECUTION_ERROR answers (EnvServerError)."""

    def __init__(self, name: str, env_cls: type, action_cls: type):
        self.where = f"environment {name!r} (in-process)"
        self.env_cls = env_cls
        self.action_cls = action_cls
        self.env: Any = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"env-{name}")
        self._stack = contextlib.AsyncExitStack()

    async def start(self) -> None:
        """Builds the environment (its constructor's errors raised as they are)."""
        self.env = await self._in_thread(self.env_cls)
        mcp_session = getattr(self.env, "mcp_session", None)
        if callable(mcp_session):
            await self._stack.enter_async_context(mcp_session())

    async def _in_thread(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._thread, lambda: fn(*args, **kwargs))

    async def _answer(self, what: str, call) -> dict:
        from openenv.core.env_server.serialization import serialize_observation
        from openenv.core.env_server.types import WSObservationResponse
        from pydantic import ValidationError

        try:
            # Through JSON as the server sends it: enums as values, tool results as plain objects.
            return json.loads(WSObservationResponse(data=serialize_observation(await call())).model_dump_json())["data"]
        except ValidationError as e:
            raise EnvServerError(f"{self.where} {what}", "VALIDATION_ERROR", "Invalid message",
                                 {"errors": e.errors(include_url=False)}) from None
        except Exception as e:
            raise EnvServerError(f"{self.where} {what}", "EXECUTION_ERROR", str(e), {}) from None

    async def reset(self, **task) -> dict:
        from openenv.core.env_server import Environment
        from openenv.core.env_server.http_server import HTTPEnvServer

        env = self.env
        overridden = env.reset_async.__func__ is not Environment.reset_async
        fn = env.reset_async if overridden else env.reset
        kwargs = HTTPEnvServer._get_valid_kwargs(None, inspect.signature(fn), task)
        return await self._answer("reset", lambda: fn(**kwargs) if overridden else self._in_thread(fn, **kwargs))

    async def step(self, action: dict) -> dict:
        from openenv.core.env_server import Environment
        from openenv.core.env_server.serialization import deserialize_action

        env = self.env

        async def call():
            parsed = deserialize_action(action, self.action_cls)
            if env.step_async.__func__ is not Environment.step_async:
                return await env.step_async(parsed)
            return await self._in_thread(env.step, parsed)

        return await self._answer("step", call)

    async def release(self) -> None:
        """As Session.release; an in-process environment is built again for the next episode."""
        await self.close()

    async def close(self) -> None:
        """Ends the MCP session and closes the environment; like the server, never raises."""
        try:
            await self._stack.aclose()
            if self.env is not None:
                await self._in_thread(self.env.close)
        except Exception as e:
            log.warning("%s: closing it failed: %s: %s", self.where, type(e).__name__, e)
        finally:
            self._thread.shutdown(wait=False)


def _action_class(spec: EnvSpec, env_cls: type) -> type:
    """The Action class: `action_class` in the spec, else `step`'s annotation, else for an MCP
    environment CallToolAction (what OpenEnv's MCP environments are served with)."""
    from openenv.core.env_server import Action
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.mcp_types import CallToolAction

    if spec.action_class:
        action_cls = import_object(spec.action_class, f"environment {spec.name!r}: action_class")
    else:
        action_cls = inspect.get_annotations(env_cls.step, eval_str=True).get("action")
        if issubclass(env_cls, MCPEnvironment) and action_cls in (None, Action):
            action_cls = CallToolAction
    if not (inspect.isclass(action_cls) and issubclass(action_cls, Action)) or action_cls is Action:
        raise EnvConfigError(
            f"environment {spec.name!r}: cannot tell the Action class of {env_cls.__name__}: annotate "
            f"`def step(self, action: MyAction)` or set action_class: 'module:MyAction'")
    return action_cls


def _observation_schema(env_cls: type) -> dict[str, Any]:
    """The JSON schema of what an in-process Environment's reset (else step) says it returns."""
    from openenv.core.env_server import Observation

    for method in (env_cls.reset, env_cls.step):
        try:
            returned = inspect.get_annotations(method, eval_str=True).get("return")
        except NameError:  # an annotation only a type checker resolves
            continue
        if inspect.isclass(returned) and issubclass(returned, Observation):
            return returned.model_json_schema()
    return {}


class SessionEpisode:
    """One episode over a session (remote or in-process): actions by the resolved mode."""

    def __init__(self, connector: SessionConnector, session: Any, task: dict[str, Any]):
        self.connector = connector
        self.spec = connector.spec
        self.session = session
        self.record = EpisodeRecord(self.spec.name, task)
        self.tools: list[dict[str, Any]] = []
        self.first_text = ""
        # How long the episode waited for its session (the pool's bound, the server's capacity), and
        # that capacity once a refusal stated it.
        self.metrics = {}
        if connector.endpoint is not None:
            self.metrics = {"pool_waits": float(session.pool_waited), "pool_wait_s": session.wait_s,
                            "capacity_refusals": float(session.capacity_refusals)}
            if connector.endpoint.metrics["server_max_sessions"]:
                self.metrics["server_max_sessions"] = float(connector.endpoint.metrics["server_max_sessions"])

    def _observe(self, payload: dict[str, Any]) -> dict[str, Any]:
        obs = payload.get("observation") or {}
        self.record.observations.append(obs)
        reward = reward_value(payload.get("reward"), f"environment {self.spec.name!r} (its step reply's reward)")
        if reward is not None:
            self.record.rewards.append(reward)
        self.record.done = bool(payload.get("done"))
        return obs

    async def start(self) -> None:
        obs = self._observe(await self.session.reset(**self.record.task))
        self.first_text = self.render(obs)
        mode = self.connector.mode
        if mode == "tool":
            self.tools = [self.connector.action_tool]
        elif mode == "tool_call":
            self.tools = [as_function_tool(t) for t in obs.get("tools") or []]
        elif mode == "mcp":
            listed = await self.session.step({"type": "list_tools"})
            self.tools = [as_function_tool(t) for t in (listed.get("observation") or {}).get("tools") or []]

    def render(self, obs: dict[str, Any]) -> str:
        return observation_text(obs, self.spec.observation_field, self.spec.observation_template)

    async def act_text(self, text: str) -> Step:
        try:
            obs = self._observe(await self.session.step({self.connector.text_field: text}))
        except EnvServerError as e:
            return _refused(e)
        return Step(self.render(obs), self.record.done)

    async def call_tool(self, name: str, arguments: Any) -> Step:
        tool = next((t for t in self.tools if t["function"]["name"] == name), None)
        if tool is None:
            known = ", ".join(t["function"]["name"] for t in self.tools) or "(none)"
            return Step(f"Error: unknown tool '{name}'. Available tools: {known}.", error=True)
        problem = _check_arguments(tool, arguments)
        if problem is not None:
            return Step(f"Error: invalid call to '{name}': {problem}.", error=True)
        mode = self.connector.mode
        if mode == "tool":
            action = dict(arguments)
        elif mode == "tool_call":
            action = {"tool": name, "arguments": arguments}
        else:
            action = {"type": "call_tool", "tool_name": name, "arguments": arguments}
        try:
            obs = self._observe(await self.session.step(action))
        except EnvServerError as e:
            return _refused(e)
        if mode == "mcp":
            return _mcp_step(obs, self.record.done)
        error = bool(obs.get("error"))
        return Step(self.render(obs), self.record.done, error)

    async def close(self) -> None:
        await self.session.release()

    @property
    def handle(self) -> Any:
        return getattr(self.session, "env", self.record)


def _refused(e: EnvServerError) -> Step:
    """The server refused an action (invalid, or the environment raised on it): the model's mistake,
    told to the model as it would be told of a bad tool call; the episode goes on, no reward."""
    return Step(f"Error: {str(e).split(' answered ', 1)[-1]}", error=True)


def _mcp_step(obs: dict[str, Any], done: bool) -> Step:
    error = obs.get("error")
    if error:
        message = error.get("message") if isinstance(error, dict) else str(error)
        return Step(f"Error: {message}", done, True)
    result = obs.get("result")
    if isinstance(result, dict):
        content = result.get("content")
        if isinstance(content, list):
            texts = [c.get("text", "") for c in content if isinstance(c, dict) and c.get("type") == "text"]
            is_error = bool(result.get("is_error") or result.get("isError"))
            return Step("\n".join(texts), done, is_error)
        if "data" in result:
            result = result["data"]
    return Step(result if isinstance(result, str) else json.dumps(result, default=str), done)


class SessionConnector:
    """Opens episodes on an OpenEnv server (`endpoint`) or an in-process Environment class."""

    def __init__(self, spec: EnvSpec, endpoint: Endpoint | None = None, env_cls: type | None = None):
        self.spec = spec
        self.endpoint = endpoint
        self.env_cls = env_cls
        self.action_cls = _action_class(spec, env_cls) if env_cls is not None else None
        self.mode = spec.action
        self.text_field: str | None = None
        self.action_tool: dict[str, Any] | None = None

    async def start(self) -> None:
        """Reads the action schema (checking the server answers) and resolves the action mode."""
        if self.endpoint is not None:
            await self.endpoint.check()
            schemas = await self.endpoint.schema()
            schema, observation = schemas.get("action") or {}, schemas.get("observation") or {}
        else:
            schema, observation = self.action_cls.model_json_schema(), _observation_schema(self.env_cls)
        self.mode, self.text_field = resolve_action_mode(self.spec, schema)
        if self.mode != "mcp":  # an MCP server's observation schema is its tool results', not reset's
            check_template(self.spec, observation)
        self.action_tool = _action_tool(self.spec.tool_name or self.spec.name, schema)

    async def open(self, task: dict[str, Any]) -> SessionEpisode:
        if self.endpoint is not None:
            session = await self.endpoint.open()
        else:
            session = _LocalSession(self.spec.name, self.env_cls, self.action_cls)
        try:
            if self.endpoint is None:
                await session.start()
            episode = SessionEpisode(self, session, task)
            await episode.start()
        except BaseException:
            await session.close()
            raise
        return episode

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self.endpoint.metrics) if self.endpoint is not None else {}

    async def aclose(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.aclose()


class ToolClassEpisode:
    """One episode of a tool-environment class: its own instance, tools by its methods."""

    mode = "tool_class"

    def __init__(self, spec: EnvSpec, cls: type, task: dict[str, Any]):
        self.spec = spec
        self.env = ToolEnvironment(cls())
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

    def __init__(self, spec: EnvSpec, cls: type):
        self.spec = spec
        self.cls = cls

    async def start(self) -> None:
        ToolEnvironment(self.cls())  # schema mistakes in the class surface at start-up

    async def open(self, task: dict[str, Any]) -> ToolClassEpisode:
        episode = ToolClassEpisode(self.spec, self.cls, task)
        await episode.start()
        return episode

    metrics: dict[str, float] = {}

    async def aclose(self) -> None:
        pass


def build_connector(spec: EnvSpec) -> SessionConnector | ToolClassConnector | RolloutFnConnector:
    """The connector for `spec` (a `bundled` spec must have been given its server's url)."""
    if spec.rollout_fn:
        return RolloutFnConnector(spec)
    if spec.url:
        pool = dataclasses.replace(spec.session, max_sessions=spec.pool_size)
        return SessionConnector(spec, endpoint=Endpoint(spec.url, pool, name=spec.name))
    if spec.bundled:
        raise EnvConfigError(f"environment {spec.name!r}: bundled {spec.bundled!r} has no server; the trainer "
                             "starts bundled servers and passes their url")
    from openenv.core.env_server import Environment

    cls = import_object(spec.env_class, f"environment {spec.name!r}: env_class")
    if not inspect.isclass(cls):
        raise EnvConfigError(f"environment {spec.name!r}: env_class {spec.env_class!r} is not a class")
    if issubclass(cls, Environment):
        return SessionConnector(spec, env_cls=cls)
    return ToolClassConnector(spec, cls)


# -- the hook -----------------------------------------------------------------------------------


def first_prompt(prompt: Any, observation: str, system_prompt: str = "") -> list[dict[str, Any]]:
    """An episode's first prompt as chat messages. A task with a `prompt` (TRL's dataset format: a
    string or chat messages) gets reset's text appended to its last message, with no separator,
    as TRL's GRPOTrainer does; a task without one has reset's text as its user message. The
    spec's system prompt goes first unless the prompt has its own."""
    if prompt is None:
        messages = [{"role": "user", "content": observation}]
    else:
        messages = task_prompt(prompt)
        if observation:
            last = messages[-1]
            content = last.get("content")
            if isinstance(content, list):  # content parts (multimodal prompts)
                content = content + [{"type": "text", "text": observation}]
            else:
                content = (content or "") + observation
            messages[-1] = {**last, "content": content}
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


class EnvEpisodeHook:
    """Drives one episode: reset -> prompt, model turns -> actions, observations -> tokens."""

    def __init__(self, runtime: Any, connector: SessionConnector | ToolClassConnector, task: dict[str, Any]):
        self.runtime = runtime
        self.connector = connector
        self.spec = connector.spec
        self.task = task
        self.episode: SessionEpisode | ToolClassEpisode | None = None
        self.closed = False
        self.metrics = {"tool_calls": 0.0, "tool_errors": 0.0, "env_steps": 0.0}
        self.prompt: list[dict[str, Any]] = []  # the first prompt's messages
        self.conversation: list[dict[str, Any]] = []  # the model's turns and the answers, as messages

    async def start(self) -> list[int]:
        self.episode = await self.connector.open(self.task)
        self.metrics.update(self.episode.metrics)
        self.prompt = first_prompt(self.task.get("prompt"), self.episode.first_text, self.spec.system_prompt)
        return list(self.runtime.tokenizer.apply_chat_template(
            self.prompt, tools=self.episode.tools or None, add_generation_prompt=True, tokenize=True,
            return_dict=False, **self.runtime.template_kwargs))

    async def turn(self, completion_ids: list[int]) -> TurnResult:
        tok = self.runtime.tokenizer
        if getattr(self.episode, "mode", None) == "tool_class" or self.connector.mode != "text":
            hidden = self.runtime.hidden_ids
            parsed = self.runtime.parser.parse(tok.decode([i for i in completion_ids if i not in hidden]))
            self.conversation.append(parsed.to_message())
            if not parsed.calls and not parsed.errors:
                return TurnResult([], done=False)  # the final answer
            self.metrics["tool_errors"] += len(parsed.errors)
            results, done = [], False
            for call in parsed.calls:
                if done:
                    results.append("Error: the episode ended before this call.")
                    self.metrics["tool_errors"] += 1
                    continue
                step = await self.episode.call_tool(call.name, call.arguments)
                self.metrics["tool_calls"] += 1
                self.metrics["env_steps"] += 1
                self.metrics["tool_errors"] += step.error
                results.append(step.text)
                done = step.done
            messages = format_tool_results(parsed.calls, results, parsed.errors)
        else:
            reply = tok.decode(completion_ids, skip_special_tokens=True).strip()
            self.conversation.append({"role": "assistant", "content": reply})
            step = await self.episode.act_text(reply)
            self.metrics["env_steps"] += 1
            self.metrics["action_errors"] = self.metrics.get("action_errors", 0.0) + step.error
            done = step.done
            messages = [{"role": "user", "content": step.text}]
        self.conversation += messages
        if done:
            return TurnResult([], done=True)
        ended = bool(completion_ids) and completion_ids[-1] == tok.eos_token_id
        text = render_tool_results(tok, messages, turn_end=None if ended else "", **self.runtime.template_kwargs)
        return TurnResult(tok.encode(text, add_special_tokens=False), done=False)

    async def finish(self, trajectory) -> dict[str, float]:
        """The episode's rewards by name (functions answering None leave theirs out)."""
        if self.episode is None:
            return {}
        await self.close()
        return await self.runtime.score(self, trajectory)

    async def close(self) -> None:
        if self.episode is not None and not self.closed:
            self.closed = True
            await self.episode.close()


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
        self.reward_specs = list(rewards)
        self.reward_specs_by_key = {r.key: r for r in self.reward_specs}
        self.reward_fns = {r.key: (None if r.fn == ENV_REWARD else import_object(r.fn, "reward function"))
                           for r in self.reward_specs}
        for key, fn in self.reward_fns.items():
            if fn is not None and not callable(fn):
                raise EnvConfigError(f"reward function {key!r} is not callable")
        self.connectors = {s.name: build_connector(s) for s in specs}
        self.started = False

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

    def hook(self, env: str, task: dict[str, Any]) -> EnvEpisodeHook | None:
        """The episode hook of `env`; None for a rollout function's (it runs its own loop: `rollout_fn`)."""
        if env not in self.connectors:
            raise ValueError(f"unknown environment {env!r}; this bridge serves: {', '.join(self.connectors)}")
        if isinstance(self.connectors[env], RolloutFnConnector):
            return None
        return EnvEpisodeHook(self, self.connectors[env], task)

    def rollout_fn(self, env: str) -> RolloutFnConnector | None:
        """`env`'s rollout function, if it has one."""
        connector = self.connectors.get(env)
        return connector if isinstance(connector, RolloutFnConnector) else None

    async def score(self, hook: EnvEpisodeHook, trajectory) -> dict[str, float]:
        """The rewards of `hook`'s finished episode. Reward functions are called as TRL calls them:
        `fn(prompts=, completions=, completion_ids=, environments=, env=, **task_fields)`, one
        episode each; `completions` are chat messages (the model's turns with their `tool_calls`,
        and the answers) when the task's `prompt` is chat messages, as in TRL, else the text."""
        env, episode, task = hook.spec.name, hook.episode, hook.task
        rewards = {ENV_REWARD: episode.record.total_reward}  # no reward given: 0, not "does not apply"
        fns = {key: fn for key, fn in self.reward_fns.items() if fn is not None}
        if not fns:
            return rewards
        prompt = hook.prompt
        if isinstance(task.get("prompt"), list):
            completion = hook.conversation
        else:
            completion = self.tokenizer.decode(trajectory.completion_ids, skip_special_tokens=True)
            if isinstance(task.get("prompt"), str):
                prompt = prompt[-1]["content"]
        fields = {k: [v] for k, v in task.items() if k not in _CALL_ARGUMENTS}
        for key, fn in fns.items():
            what = (f"reward function {key!r} ({self.reward_specs_by_key[key].fn}) for episode "
                    f"{trajectory.group_id}/{trajectory.index_in_group} of {env!r}")
            value = fn(prompts=[prompt], completions=[completion], completion_ids=[list(trajectory.completion_ids)],
                       environments=[episode.handle], env=[env], **fields)
            if inspect.isawaitable(value):
                value = await value
            if not isinstance(value, (list, tuple)) or len(value) != 1:
                raise RewardError(f"{what} returned {value!r}; it must return a list with one value per "
                                  "completion (here 1)")
            value = reward_value(value[0], what)
            if value is not None:
                rewards[key] = value
        return rewards

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
