"""Tool-call parsers per model family, and the tool-result messages that answer them.

A parser reads the TEXT of one completion (decoded from the engine's tokens, which stay the
training tokens as they are: nothing here is tokenised back into the trajectory; decoded without
the tokenizer's special tokens but with the parser's `delimiters`, which some tokenizers mark
special: `hidden_special_ids`) and splits it
into what the model said and the calls it made. A malformed call is not an exception: it
becomes an error message in `ParsedTurn.errors`, to be fed back to the model as a tool
result, so that a broken call costs the model a turn rather than the episode.

Formats (`get_parser(name)`):

- `"qwen"` (default), alias `"hermes"`: Qwen2.5 / Qwen3 instruct models and the Hermes 2 Pro
  format they adopted (vLLM calls its parser for them `hermes`; Qwen3-Coder's XML-style
  `<function=...>` calls are a different format, not handled here)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

Then `format_tool_results` builds the `tool`-role messages for the results (and the parse
errors), and `render_tool_results` renders them with the tokenizer's chat template into the
text to append after the model's turn.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

__all__ = [
    "ParsedTurn",
    "QwenToolCallParser",
    "ToolCall",
    "ToolCallParser",
    "available_parsers",
    "format_tool_results",
    "get_parser",
    "hidden_special_ids",
    "register_parser",
    "render_tool_results",
]

_SNIPPET_CHARS = 120


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def to_message_call(self) -> dict:
        """The OpenAI `tool_calls` entry (for an assistant message)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class ParsedTurn:
    content: str  # the text outside the tool-call blocks, stripped
    calls: list[ToolCall] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)  # one message per malformed block

    def to_message(self) -> dict:
        """The turn as an OpenAI-style assistant message (for logs, evaluation, re-rendering)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            message["tool_calls"] = [c.to_message_call() for c in self.calls]
        return message


class ToolCallParser(Protocol):
    delimiters: tuple[str, ...]  # the strings that mark a call, kept in the text it reads

    def parse(self, text: str) -> ParsedTurn: ...


def hidden_special_ids(tokenizer: Any, delimiters: Collection[str]) -> frozenset[int]:
    """The ids to leave out of the text a parser reads: those `decode(skip_special_tokens=True)`
    drops (end of turn, padding...), except the parser's `delimiters`, which tokenizers that mark
    `<tool_call>` special would otherwise strip from every call."""
    special = {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    special.update((i, tokenizer.convert_ids_to_tokens(i)) for i in tokenizer.all_special_ids if i not in special)
    return frozenset(i for i, content in special.items() if content not in delimiters)


def _snippet(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _SNIPPET_CHARS else text[: _SNIPPET_CHARS - 3] + "..."


class QwenToolCallParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any number per turn.

    `arguments` may be a JSON object or a string holding one; absent or null means no
    arguments. Errors (each one message, the others still parsed): a block whose body is not
    JSON, not an object, has no string `name`, or has `arguments` that are not an object; a
    `<tool_call>` with no `</tool_call>` before the next `<tool_call>` or the end of the text
    (unless `allow_unterminated`, for engines that cut the text at a `</tool_call>` stop
    string: then a last unterminated block is parsed like a closed one); a `</tool_call>` with
    no opening tag. The blocks are removed from `content`; everything else is kept.
    """

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    delimiters = (open_tag, close_tag)

    def __init__(self, allow_unterminated: bool = False):
        self.allow_unterminated = allow_unterminated

    def parse(self, text: str) -> ParsedTurn:
        content: list[str] = []
        calls: list[ToolCall] = []
        errors: list[str] = []
        pos = 0
        block = 0
        while True:
            start = text.find(self.open_tag, pos)
            outside = text[pos:] if start < 0 else text[pos:start]
            self._stray_closes(outside, errors)
            content.append(outside.replace(self.close_tag, ""))
            if start < 0:
                break
            block += 1
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            next_open = text.find(self.open_tag, body_start)
            if end < 0 or 0 <= next_open < end:
                stop = next_open if next_open >= 0 else len(text)
                body = text[body_start:stop]
                if next_open < 0 and self.allow_unterminated:
                    self._parse_block(body, block, calls, errors)
                else:
                    errors.append(
                        f"Error: tool call {block} has no closing {self.close_tag}: "
                        f"{_snippet(body) or '(empty)'}. Write each call as {self.open_tag}"
                        '{"name": ..., "arguments": {...}}' + self.close_tag
                    )
                pos = stop
                continue
            self._parse_block(text[body_start:end], block, calls, errors)
            pos = end + len(self.close_tag)
        return ParsedTurn(_join(content), calls, errors)

    def _stray_closes(self, outside: str, errors: list[str]) -> None:
        for _ in range(outside.count(self.close_tag)):
            errors.append(f"Error: found {self.close_tag} with no {self.open_tag} before it")

    def _parse_block(self, body: str, index: int, calls: list[ToolCall], errors: list[str]) -> None:
        where = f"tool call {index}"
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            shown = _snippet(body) or "(empty)"
            errors.append(f"Error: {where} is not valid JSON ({e.msg}, column {e.colno}): {shown}")
            return
        if not isinstance(obj, dict):
            errors.append(
                f'Error: {where} must be a JSON object {{"name": ..., "arguments": {{...}}}}, '
                f"got: {_snippet(body)}"
            )
            return
        name = obj.get("name")
        if not isinstance(name, str) or not name.strip():
            errors.append(f'Error: {where} has no "name" (a non-empty string): {_snippet(body)}')
            return
        arguments = obj.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                errors.append(
                    f"Error: the arguments of {where} ('{name}') are not valid JSON ({e.msg}): "
                    f"{_snippet(arguments)}"
                )
                return
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            errors.append(
                f"Error: the \"arguments\" of {where} ('{name}') must be a JSON object, "
                f"got: {_snippet(json.dumps(arguments))}"
            )
            return
        calls.append(ToolCall(name.strip(), arguments))


def _join(pieces: list[str]) -> str:
    # Drop the newline padding around removed blocks; keep the text's own inner layout.
    return "\n".join(p.strip() for p in pieces if p.strip())


_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "qwen": QwenToolCallParser,
    "hermes": QwenToolCallParser,
}
DEFAULT_PARSER = "qwen"


def register_parser(name: str, factory: Callable[[], ToolCallParser]) -> None:
    """Adds a parser family (a class or a function taking no arguments)."""
    _PARSERS[name] = factory


def available_parsers() -> list[str]:
    return sorted(_PARSERS)


def get_parser(name: str | None = None, **options: Any) -> ToolCallParser:
    """The parser for a model family (`None`: "qwen"); `options` go to its constructor."""
    key = DEFAULT_PARSER if name is None else name.lower()
    if key not in _PARSERS:
        known = ", ".join(available_parsers())
        raise ValueError(f"unknown tool-call parser {name!r}; available: {known}")
    return _PARSERS[key](**options)


def format_tool_results(
    calls: Sequence[ToolCall], results: Sequence[str], errors: Sequence[str] = ()
) -> list[dict]:
    """The `tool`-role messages answering one turn: one per call, in order, then one per error.

    `results[i]` answers `calls[i]` (a string, e.g. from `ToolEnvironment.call`); `errors` are
    the turn's parse errors (`ParsedTurn.errors`), so the model also hears about the calls
    that could not be read. Messages carry `name` for the calls (templates that show it can).
    """
    if len(calls) != len(results):
        raise ValueError(f"format_tool_results: {len(calls)} calls but {len(results)} results")
    messages = [{"role": "tool", "name": c.name, "content": r} for c, r in zip(calls, results)]
    messages += [{"role": "tool", "content": e} for e in errors]
    return messages


_SENTINEL = "\u2063JAXRL-END-OF-TURN\u2063"


def render_tool_results(
    tokenizer: Any,
    messages: Sequence[dict],
    *,
    turn_end: str | None = None,
    **template_kwargs: Any,
) -> str:
    """The text to append after the model's turn: the tool messages and the next turn's prompt.

    Renders `[user, assistant, *messages]` with the tokenizer's chat template and
    `add_generation_prompt=True`, and returns what follows the assistant's content, less
    `turn_end`: the text the model's turn already ended with (default: the tokenizer's EOS
    token, e.g. Qwen's `<|im_end|>`, which the engine produced and the trajectory keeps). Pass
    `turn_end=""` when the turn stopped without it (length cut, stop string) so the returned
    text also closes the assistant turn. `template_kwargs` go to `apply_chat_template`
    (e.g. `enable_thinking=False`). Encode the result with `add_special_tokens=False`.
    """
    conversation = [
        {"role": "user", "content": "-"},
        {"role": "assistant", "content": _SENTINEL},
        *messages,
    ]
    text = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    at = text.rfind(_SENTINEL)
    if at < 0:
        raise ValueError(
            "render_tool_results: the chat template dropped the assistant message's content"
        )
    after = text[at + len(_SENTINEL) :]
    if turn_end is None:
        turn_end = getattr(tokenizer, "eos_token", None) or ""
    if not after.startswith(turn_end):
        raise ValueError(
            f"render_tool_results: the template ends an assistant turn with {after[:40]!r}, "
            f"not with turn_end={turn_end!r}; pass the text the model's turn actually ended with"
        )
    return after[len(turn_end) :]
