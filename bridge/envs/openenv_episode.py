"""One episode over an OpenEnv session, wherever the environment runs (`served` over `/ws`, or
`in_process`): both kinds share this class and its action modes, so an environment behaves the
same served and in-process, and only where sessions come from differs.

How a model turn becomes actions (`EnvSpec.action`, `auto` picks from the action schema):

- `text`: the reply (special tokens dropped, stripped) fills one string field; the
  observation comes back as the next user turn;
- `tool_call`: the action is `{tool, arguments}`; the tools are listed in reset's observation
  (`tools`); each parsed tool call is one step;
- `mcp`: OpenEnv MCP environments: tools from `ListToolsAction`, calls as `CallToolAction`;
- `tool`: the whole action is one tool whose parameters are the action's fields.

An action the environment refuses (VALIDATION_ERROR, or its step raised) is the model's mistake
and is told to it as an `Error: ...` answer. Observations show every field that says something,
or what the environment's `observation_field` / `observation_template` says (`render`).
"""

from __future__ import annotations

import abc
import dataclasses
import json
from typing import Any

from bridge.envs.episode import EpisodeRecord, Step
from bridge.envs.render import as_function_tool, check_templates, inline_refs, observation_text
from bridge.envs.session import EnvServerError
from bridge.envs.spec import EnvConfigError, EnvSpec, reward_value


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


class SessionEpisode:
    """One episode over a session (remote or in-process): actions by the resolved mode."""

    def __init__(self, connector: SessionConnector, session: Any, task: dict[str, Any]):
        self.connector = connector
        self.spec = connector.spec
        self.session = session
        self.record = EpisodeRecord(self.spec.name, task)
        self.tools: list[dict[str, Any]] = []
        self.first_text = ""
        self.metrics = connector.session_metrics(session)

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
        # An empty reset_template ('') shows nothing of reset: a task's prompt alone (coding_env's reset says only
        # "exit_code: 0"); only None falls back to observation_template, as check_templates reads it.
        template = self.spec.reset_template if self.spec.reset_template is not None else self.spec.observation_template
        self.first_text = observation_text(obs, self.spec.observation_field, template)
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


@dataclasses.dataclass(frozen=True)
class Schemas:
    """What an environment states of itself: JSON schemas of its action and observations."""

    action: dict[str, Any]
    step: dict[str, Any]  # step observations
    reset: dict[str, Any] | None  # reset's; None: not stated (openenv-core before 0.10 states one for both)
    sends_metadata: bool  # observations carry `metadata` (openenv >= 0.10 and in-process)


class SessionConnector(abc.ABC):
    """Opens episodes over OpenEnv sessions; subclasses say where the sessions and schemas come from."""

    def __init__(self, spec: EnvSpec):
        self.spec = spec
        self.mode = spec.action
        self.text_field: str | None = None
        self.action_tool: dict[str, Any] | None = None
        self.action_hint: str | None = None  # text mode: what a reply is, for the system prompt
        self.notices: list[str] = []  # warnings about what the model sees, found at start (EnvRuntime logs them)

    @abc.abstractmethod
    async def schemas(self) -> Schemas:
        """The action and observation JSON schemas (checking the environment answers)."""

    @abc.abstractmethod
    async def new_session(self) -> Any:
        """A session ready for reset (closed again by the caller if the episode cannot start)."""

    def session_metrics(self, session: Any) -> dict[str, float]:
        """What getting `session` cost, for the episode's metrics."""
        return {}

    metrics: dict[str, float] = {}  # the connector's own, over all its episodes

    async def aclose(self) -> None:
        pass

    async def start(self) -> None:
        """Reads the schemas (checking the environment answers), resolves the action mode and checks
        the observation templates."""
        schemas = await self.schemas()
        self.mode, self.text_field = resolve_action_mode(self.spec, schemas.action)
        check_templates(self.spec, self.mode == "mcp", schemas.step, schemas.reset, schemas.sends_metadata)
        self.action_tool = _action_tool(self.spec.tool_name or self.spec.name, schemas.action)
        if self.mode == "text":
            self.action_hint = self._text_mode_hint(schemas.action)

    def _text_mode_hint(self, action_schema: dict[str, Any]) -> str | None:
        """What a text-mode reply is, from the text field's description (as tool mode's schema tells it),
        when describe_action; warns once of the descriptions of the fields text mode leaves at their defaults."""
        props = self.action_tool["function"]["parameters"]["properties"]
        # Every other field, described or not (the catalogue's wildfire: `x`, `y` without descriptions, which its
        # "water" and "break" actions need): text mode leaves them all at their defaults.
        others = [f"{k} ({v['description']})" if v.get("description") else k for k, v in props.items()
                  if k != self.text_field]
        if others:
            self.notices.append(f"text mode fills only the action's {self.text_field!r}; the model is not told of "
                                f"its other field(s) {'; '.join(others)}, which keep their defaults: set action: tool "
                                "for a model to fill them")
        if not self.spec.describe_action:
            return None
        description = (props.get(self.text_field) or {}).get("description")
        if description:
            return f"Your reply is sent to the environment as its action's {self.text_field!r}: {description}"
        # A field without a description of its own (the catalogue's chess: `move: str`, its meaning in the
        # action class's docstring): the action's description, which tool mode shows as the tool's.
        action_doc = (inline_refs(action_schema).get("description") or "").strip()
        if action_doc:
            return f"Your reply is sent to the environment as its action's {self.text_field!r}. The action: {action_doc}"
        self.notices.append(f"text mode: neither the action's {self.text_field!r} field nor the action itself has a "
                            "description, so the model is not told what its reply is: say it in system_prompt")
        return None

    async def open(self, task: dict[str, Any]) -> SessionEpisode:
        session = await self.new_session()
        try:
            episode = SessionEpisode(self, session, task)
            await episode.start()
        except BaseException:
            await session.close()
            raise
        return episode
