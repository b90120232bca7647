"""What the model is shown of an environment: observations as text, action and tool schemas in the
form chat templates take (references inlined: a template passes a schema on as it is, and a bare
`$ref` tells the model nothing), and the tokens of a first prompt and of the answers to a model
turn. Every kind of environment, and a rollout function's generation handle, renders through
here, so the same episode reads the same token for token whichever way it runs."""

from __future__ import annotations

import collections
import json
from collections.abc import Mapping, Sequence
from typing import Any

from bridge.envs.spec import EnvConfigError, EnvSpec, template_fields
from bridge.tool_calls import render_tool_results

OBSERVATION_TEXT_FIELDS = ("text", "prompt", "message", "content")
_NOT_SHOWN = {"reward", "done", "metadata", "tools"}


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
            raise RenderError(f"template {template!r} cannot render an observation of fields "
                              f"{sorted(observation)} ({type(e).__name__}: {e})") from None
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
    """An observation the environment's observation_template / reset_template cannot render (a field it lacks)."""


def check_templates(spec: EnvSpec, mcp: bool, step_schema: dict[str, Any], reset_schema: dict[str, Any] | None,
                    sends_metadata: bool) -> None:
    """EnvConfigError naming the first field a template of `spec` uses that its observations lack: the
    step template against the step observation schema (not in MCP mode: steps answer with tool results),
    reset's against the reset observation schema (None: the server states none, as openenv-core 0.2 / 0.3
    0.10; then the step schema checks the template both use). `metadata` only where it is sent."""
    if not sends_metadata:
        for key in ("observation_template", "reset_template"):
            template = getattr(spec, key)
            if template is not None and "metadata" in template_fields(template, key):
                raise EnvConfigError(f"environment {spec.name!r}: {key} uses metadata, which this server does not "
                                     "send (openenv-core 0.2 / 0.3): serve it with openenv >= 0.10, or use other "
                                     "fields")
        if spec.observation_field == "metadata":
            raise EnvConfigError(f"environment {spec.name!r}: observation_field metadata: this server does not send "
                                 "it (openenv-core 0.2 / 0.3): serve it with openenv >= 0.10")
    reset_key = "reset_template" if spec.reset_template is not None else "observation_template"
    checks = []
    if not mcp:
        checks.append(("observation_template", step_schema, "step"))
    # An MCP server states its reset schema only where it differs from its tool results'.
    if reset_schema is not None and not (mcp and reset_schema == step_schema):
        checks.append((reset_key, reset_schema, "reset"))
    for key, schema, kind in checks:
        template = getattr(spec, key)
        if template is None:
            continue
        what = f"environment {spec.name!r}: {key}"
        fields = template_fields(template, what)
        props = inline_refs(schema).get("properties") or {}
        if not set(props) - _NOT_SHOWN:  # e.g. an MCP server's base Observation: nothing to check against
            continue
        for name in fields:
            if name not in props:
                known = ", ".join(k for k in props if k not in _NOT_SHOWN)
                reset_props = (inline_refs(reset_schema or {}).get("properties") or {})
                fix = "; a template of reset's fields goes in reset_template" if (
                    kind == "step" and name in reset_props) else ""
                raise EnvConfigError(f"{what} names field {name!r}, which its {kind} observations do not have; "
                                     f"they have: {known}{fix}")


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


def prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
               template_kwargs: Mapping[str, Any], add_generation_prompt: bool = True) -> list[int]:
    """`messages` rendered with the model's chat template (and the run's chat_template_kwargs)."""
    return list(tokenizer.apply_chat_template(
        [dict(m) for m in messages], tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **template_kwargs))


def answer_ids(tokenizer: Any, turn_ids: Sequence[int], messages: Sequence[Mapping[str, Any]],
               template_kwargs: Mapping[str, Any]) -> list[int]:
    """What follows the model's turn `turn_ids` when `messages` answer it, as tokens: the turn's end
    where the model did not write it, the messages, the next generation prompt; never the turn itself."""
    ended = bool(turn_ids) and turn_ids[-1] == tokenizer.eos_token_id
    text = render_tool_results(tokenizer, [dict(m) for m in messages], turn_end=None if ended else "",
                               **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


class RenderCache:
    """`prompt_ids` and `answer_ids` of one tokenizer and template settings, each distinct input rendered
    once: the G episodes of a group start from one prompt, and environments repeat their answers (a
    game's "too low", a tool's error), so most turns' template rendering and tokenization were repeats.
    A bounded LRU keyed by the inputs' JSON; the ids are the functions' own, token for token."""

    def __init__(self, tokenizer: Any, template_kwargs: Mapping[str, Any], size: int = 4096):
        self.tokenizer, self.template_kwargs, self.size = tokenizer, dict(template_kwargs), size
        self._ids: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()
        self.stats = {"hits": 0, "misses": 0}

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                   add_generation_prompt: bool = True) -> list[int]:
        return self._get(("prompt", messages, tools, add_generation_prompt), lambda: prompt_ids(
            self.tokenizer, messages, tools, self.template_kwargs, add_generation_prompt))

    def answer_ids(self, turn_ids: Sequence[int], messages: Sequence[Mapping[str, Any]]) -> list[int]:
        ended = bool(turn_ids) and turn_ids[-1] == self.tokenizer.eos_token_id  # all answer_ids reads of the turn
        return self._get(("answer", ended, messages), lambda: answer_ids(
            self.tokenizer, turn_ids[-1:] if ended else [], messages, self.template_kwargs))

    def _get(self, key: Any, render) -> list[int]:
        text = json.dumps(key, sort_keys=True, default=str)
        ids = self._ids.get(text)
        if ids is None:
            self.stats["misses"] += 1
            ids = self._ids[text] = tuple(render())
            if len(self._ids) > self.size:
                self._ids.popitem(last=False)
        else:
            self.stats["hits"] += 1
            self._ids.move_to_end(text)
        return list(ids)
