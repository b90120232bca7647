"""One Python function as a model tool: its JSON schema exactly as TRL renders it, and the check of
the arguments the model writes against its type hints. Kept apart from how an environment's
methods are found and run (`tools`): these rules are what a model prompted or tuned under TRL
relies on, and they change with TRL, not with our wrapper.

A tool's schema is exactly what TRL renders for the same method,
`transformers.utils.get_json_schema` (type hints, the Google-style docstring's `Args:`, and a
`return` entry from the return hint and `Returns:`), so a model prompted or tuned under TRL sees
the same system prompt. We check what `get_json_schema` lets through (it silently maps unknown
classes to `object`; we refuse them, and `*args`/`**kwargs`): every parameter needs both a type
hint and an `Args:` entry written `name: description`; a documented method that breaks this is
a mistake in the environment and raises `ToolSchemaError` when the tool is built, naming the
method and the parameter.

Supported parameter types: `str`, `int`, `float`, `bool`, `None`, `Any`, `list[T]`,
`tuple[A, B, ...]`, `dict[str, T]` (and bare `list`/`tuple`/`dict`), `Literal[...]` of
str/int/float/bool/None, and unions of these (`T | None`, `Optional[T]`).

Argument checking before a call (the model's JSON decoded, then checked against the hints):

- `int` takes JSON integers, and numbers with no fractional part (`3.0` -> `3`, as JSON Schema's
  "integer" does); never strings (`"3"`) nor booleans;
- `float` takes any JSON number (`3` -> `3.0`); never strings nor booleans;
- `str` takes strings only (`3` is refused, not turned into `"3"`); `bool` takes `true`/`false`
  only (not `0`/`1`/`"true"`);
- `tuple[...]` takes a JSON array of the right length; `dict[str, T]` a JSON object;
- unions try every member without coercion first, then with it.

Refusing rather than guessing keeps the error signal: the model sees what it got wrong.
"""

from __future__ import annotations

import inspect
import json
import sys
import types
import typing
import unittest.mock
from collections.abc import Callable
from typing import Any, Literal, Union

_MAX_VALUE_CHARS = 80


class ToolSchemaError(ValueError):
    """A documented public method cannot be turned into a tool (the environment's mistake)."""


def _is_union(origin: Any) -> bool:
    return origin is Union or origin is types.UnionType


def _unsupported(hint: Any) -> str | None:
    """Describes the first unsupported part of a type hint, or None when it is supported."""
    if hint in (str, int, float, bool, type(None), None, Any, list, tuple, dict):
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if _is_union(origin):
        return next((u for u in map(_unsupported, args) if u), None)
    if origin is Literal:
        bad = [a for a in args if type(a) not in (str, int, float, bool, type(None))]
        return f"Literal value {bad[0]!r}" if bad else None
    if origin is list:
        return _unsupported(args[0]) if args else None
    if origin is tuple:
        if not args:
            return None
        if len(args) == 1 or ... in args:
            return f"{_type_name(hint)} (use list[T] for a variable length, or a fixed tuple[A, B])"
        return next((u for u in map(_unsupported, args) if u), None)
    if origin is dict:
        if not args:
            return None
        if args[0] is not str:
            return f"{_type_name(hint)} (JSON object keys are strings: use dict[str, T])"
        return _unsupported(args[1])
    return _type_name(hint)


def _type_name(hint: Any) -> str:
    """A short, Python-like name for a type hint: `int`, `list[str]`, `"a" | "b"`, `int | None`."""
    if hint is type(None) or hint is None:
        return "None"
    if hint is Any:
        return "Any"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if _is_union(origin):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (list, tuple, dict):
        if not args:
            return origin.__name__
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _json_default(value: Any) -> tuple[bool, Any]:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False, None
    return True, list(value) if isinstance(value, tuple) else value


def _fn_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))


def _parameters(fn: Callable) -> tuple[list[inspect.Parameter], dict[str, Any]]:
    """The tool's parameters (receiver excluded) and their resolved type hints, checked."""
    name = _fn_name(fn)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ToolSchemaError(f"tool {name}: cannot read its signature ({e})") from e
    params = list(sig.parameters.values())
    # A plain function taken from a class still has its receiver; a bound method does not.
    if (
        params
        and params[0].name in ("self", "cls")
        and params[0].annotation is inspect.Parameter.empty
    ):
        params = params[1:]
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # NameError for a forward reference that does not resolve, ...
        raise ToolSchemaError(
            f"tool {name}: cannot resolve its type hints ({type(e).__name__}: {e})"
        ) from e
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            star = "*" if p.kind is p.VAR_POSITIONAL else "**"
            raise ToolSchemaError(
                f"tool {name}: parameter '{star}{p.name}' is not supported; "
                "a tool takes named parameters only"
            )
        if p.kind is p.POSITIONAL_ONLY:
            raise ToolSchemaError(
                f"tool {name}: parameter '{p.name}' is positional-only; "
                "the model passes arguments by name"
            )
        if p.name not in hints:
            raise ToolSchemaError(f"tool {name}: parameter '{p.name}' has no type hint")
        bad = _unsupported(hints[p.name])
        if bad is not None:
            raise ToolSchemaError(
                f"tool {name}: parameter '{p.name}' has an unsupported type {bad}; supported: "
                "str, int, float, bool, None, Any, list[T], tuple[A, B], dict[str, T], "
                "Literal[...] and unions of these"
            )
    return params, {p.name: hints[p.name] for p in params}


def tool_schema(fn: Callable) -> dict:
    """The function-tool schema of `fn`: `transformers.utils.get_json_schema(fn)` unchanged
    (`{"type": "function", "function": {"name", "description", "parameters"[, "return"]}}`), as
    TRL renders it. Raises `ToolSchemaError` naming the function and the parameter when a
    parameter lacks a type hint or an `Args:` entry, or has an unsupported type, and when `fn`
    has no docstring.
    """
    from transformers.utils import chat_template_utils as ctu

    name = _fn_name(fn)
    doc = inspect.getdoc(fn)
    if not doc or not doc.strip():
        raise ToolSchemaError(
            f"tool {name}: it has no docstring (a tool needs a description and an Args: section)"
        )
    params, _ = _parameters(fn)
    _, documented, _ = ctu.parse_google_format_docstring(doc.strip())
    for p in params:
        if p.name not in (documented or {}):
            raise ToolSchemaError(
                f"tool {name}: parameter '{p.name}' has no entry in the docstring's Args: section "
                f"(write '{p.name}: <what it is>' under 'Args:')"
            )
    try:
        # transformers imports PyTorch (1.5 s of start-up) only to know torch.Tensor hints; a
        # hint can name torch.Tensor only where torch is imported already.
        with unittest.mock.patch.object(ctu, "is_torch_available", lambda: "torch" in sys.modules):
            return ctu.get_json_schema(fn)
    except (ctu.TypeHintParsingException, ctu.DocstringParsingException) as e:
        raise ToolSchemaError(f"tool {name}: {e}") from e


class _ArgError(Exception):
    def __init__(self, path: str, expected: str, value: Any):
        super().__init__(path)
        self.path, self.expected, self.value = path, expected, value


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check(value: Any, hint: Any, path: str, coerce: bool) -> Any:
    """Returns the value to pass (maybe converted), or raises _ArgError."""
    if hint is Any:
        return value
    if hint is type(None) or hint is None:
        if value is None:
            return None
        raise _ArgError(path, "None", value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _ArgError(path, "bool", value)
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if coerce and isinstance(value, float) and value.is_integer():
            return int(value)
        raise _ArgError(path, "int", value)
    if hint is float:
        if isinstance(value, float):
            return value
        if coerce and _is_number(value):
            return float(value)
        raise _ArgError(path, "float", value)
    if hint is str:
        if isinstance(value, str):
            return value
        raise _ArgError(path, "str", value)
    return _check_composite(value, hint, path, coerce)


def _check_composite(value: Any, hint: Any, path: str, coerce: bool) -> Any:
    """`_check` for unions, literals and containers (their members checked by `_check`)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if _is_union(origin):
        for attempt in (False, True) if coerce else (False,):
            for member in args:
                try:
                    return _check(value, member, path, attempt)
                except _ArgError:
                    pass
        raise _ArgError(path, _type_name(hint), value)
    if origin is Literal:
        for option in args:
            numbers = coerce and _is_number(value) and _is_number(option)
            if (type(value) is type(option) or numbers) and value == option:
                return option
        raise _ArgError(path, _type_name(hint), value)
    if hint is list or origin is list:
        if not isinstance(value, list):
            raise _ArgError(path, _type_name(hint), value)
        if not args:
            return value
        return [_check(v, args[0], f"{path}[{i}]", coerce) for i, v in enumerate(value)]
    if hint is tuple or origin is tuple:
        if not isinstance(value, (list, tuple)) or (args and len(value) != len(args)):
            raise _ArgError(path, _type_name(hint), value)
        if not args:
            return tuple(value)
        pairs = enumerate(zip(value, args))
        return tuple(_check(v, a, f"{path}[{i}]", coerce) for i, (v, a) in pairs)
    if hint is dict or origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _ArgError(path, _type_name(hint), value)
        if not args:
            return value
        return {k: _check(v, args[1], f"{path}[{json.dumps(k)}]", coerce) for k, v in value.items()}
    raise _ArgError(path, _type_name(hint), value)  # unreachable for checked schemas


def _describe(value: Any) -> str:
    kind = {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "object"}.get(
        type(value), "None" if value is None else type(value).__name__
    )
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > _MAX_VALUE_CHARS:
        text = text[: _MAX_VALUE_CHARS - 3] + "..."
    return f"{kind} {text}"


class Tool:
    """A function checked as a tool: its schema, the signature shown in errors, and its arguments' checks."""

    def __init__(self, name: str, fn: Callable):
        self.name, self.fn = name, fn
        self.schema = tool_schema(fn)
        self.params, self.hints = _parameters(fn)
        self.required = [p.name for p in self.params if p.default is inspect.Parameter.empty]
        parts = []
        for p in self.params:
            part = f"{p.name}: {_type_name(self.hints[p.name])}"
            if p.default is not inspect.Parameter.empty:
                ok, value = _json_default(p.default)
                part += f" = {json.dumps(value) if ok else repr(p.default)}"
            parts.append(part)
        self.signature = f"{name}({', '.join(parts)})"

    def bind(self, arguments: Any) -> tuple[dict | None, list[tuple[str, str]]]:
        """Checks the model's arguments: (kwargs to call with, [(error kind, message)])."""
        if isinstance(arguments, str):
            text = arguments.strip()
            try:
                arguments = json.loads(text) if text else {}
            except json.JSONDecodeError as e:
                return None, [("invalid_arguments", f"arguments are not valid JSON ({e.msg})")]
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            got = _describe(arguments)
            return None, [("invalid_arguments", f"arguments must be a JSON object, got {got}")]
        problems: list[tuple[str, str]] = []
        missing = [n for n in self.required if n not in arguments]
        if missing:
            names = ", ".join(f"'{n}'" for n in missing)
            plural = "s" * (len(missing) > 1)
            problems.append(("missing_arguments", f"missing required argument{plural} {names}"))
        extra = [n for n in arguments if n not in self.hints]
        if extra:
            names = ", ".join(f"'{n}'" for n in extra)
            plural = "s" * (len(extra) > 1)
            problems.append(("unexpected_arguments", f"unexpected argument{plural} {names}"))
        kwargs = {}
        for n, value in arguments.items():
            if n not in self.hints:
                continue
            try:
                kwargs[n] = _check(value, self.hints[n], n, coerce=True)
            except _ArgError as e:
                got = _describe(e.value)
                message = f"argument '{e.path}' must be {e.expected}, got {got}"
                problems.append(("wrong_type", message))
        return (None if problems else kwargs), problems
