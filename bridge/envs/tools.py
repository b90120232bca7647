"""Environment classes in the style of TRL's `environment_factory`: methods become tools.

A user writes a plain class::

    class Wordle:
        def reset(self, **task) -> str:          # starts an episode, returns the first observation
            ...
        def guess(self, word: str) -> str:       # a tool: public, typed, documented
            '''Guess the secret word.

            Args:
                word: A five-letter word.
            '''

`ToolEnvironment(Wordle())` finds its tools, gives their JSON schemas (`tools`, for the chat
template's `tools=`), and runs the calls the model makes (`call` / `acall`), turning every
failure into an error message for the model instead of an exception.

Which methods are tools (the rule, checked once when the wrapper is built):

- public: the name does not start with `_`;
- documented: it has a docstring (public methods without one are skipped and listed in
  `ToolEnvironment.skipped`; TRL raises instead, we let helpers stay undocumented);
- not a lifecycle method: `reset`, `close`;
- not a reward: the name starts with `reward` (`reward`, `reward_correct`, ...) or is
  `get_reward` (TRL's optional environment reward method), or the method is marked with
  `@not_a_tool`;
- not named in `ToolEnvironment(..., exclude=[...])`;
- a function defined on the class (or a base): properties, class attributes and attributes
  set on the instance are never tools.

A tool's schema is exactly what TRL renders for the same method,
`transformers.utils.get_json_schema` (type hints, the Google-style docstring's `Args:`, and a
`return` entry from the return hint and `Returns:`), so a model prompted or tuned under TRL sees
the same system prompt; tools are listed in name order, as TRL lists them. We check what
`get_json_schema` lets through (it silently maps unknown classes to `object`; we refuse them,
and `*args`/`**kwargs`): every parameter needs both a type hint and an `Args:` entry written
`name: description`; a documented method that breaks this is a mistake in the environment and
raises `ToolSchemaError` when the wrapper is built, naming the method and the parameter.

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

import asyncio
import inspect
import json
import sys
import types
import typing
import unittest.mock
from collections.abc import Callable, Iterable
from typing import Any, Literal, Union

__all__ = [
    "ERROR_KINDS",
    "EventLoopError",
    "RESERVED_NAMES",
    "ToolEnvironment",
    "ToolSchemaError",
    "not_a_tool",
    "tool_schema",
]

RESERVED_NAMES = frozenset({"reset", "close", "get_reward"})
REWARD_PREFIX = "reward"
_NOT_A_TOOL = "__jaxrl_not_a_tool__"

# Keys of `ToolEnvironment.metrics`; "calls" and "errors" are totals, the rest kinds of errors.
ERROR_KINDS = (
    "unknown_tool",  # no tool of that name
    "invalid_arguments",  # arguments not a JSON object (or a string that does not decode to one)
    "missing_arguments",  # a required parameter absent
    "unexpected_arguments",  # a name that is not a parameter
    "wrong_type",  # a value of the wrong type
    "tool_exception",  # the tool raised
    "timeout",  # the tool ran past `timeout_s` (acall only)
)

_MAX_VALUE_CHARS = 80


class ToolSchemaError(ValueError):
    """A documented public method cannot be turned into a tool (the environment's mistake)."""


class EventLoopError(RuntimeError):
    """The sync API was asked to run an async method from inside a running event loop."""


def not_a_tool(fn: Callable) -> Callable:
    """Marks a public, documented method as not a tool (helpers, reward getters)."""
    setattr(fn, _NOT_A_TOOL, True)
    return fn


# ---------------------------------------------------------------------------------------------
# Schemas


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


# ---------------------------------------------------------------------------------------------
# Argument checking


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


# ---------------------------------------------------------------------------------------------
# The environment wrapper


class _Tool:
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


def _to_text(result: Any) -> str:
    """A tool's return value as the text the model reads: strings as they are, else JSON."""
    if result is None:
        return ""
    if isinstance(result, str):
        return result
    if isinstance(result, bytes):
        return result.decode("utf-8", errors="replace")
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


def _discover(env: object, exclude: set[str]) -> tuple[dict[str, _Tool], dict[str, str]]:
    cls = type(env)
    # In name order, as TRL lists an environment's tools (`inspect.getmembers`): the same prompt.
    names = sorted({n for klass in cls.__mro__ if klass is not object for n in vars(klass)})
    tools: dict[str, _Tool] = {}
    skipped: dict[str, str] = {}
    for n in names:
        if n.startswith("_"):
            continue
        static = inspect.getattr_static(env, n)
        if isinstance(static, (staticmethod, classmethod)):
            static = static.__func__
        if not inspect.isfunction(static):  # properties, class attributes, instance attributes
            continue
        if n in RESERVED_NAMES:
            skipped[n] = "lifecycle method" if n != "get_reward" else "reward method (get_reward)"
        elif n.startswith(REWARD_PREFIX):
            skipped[n] = f"reward method (name starts with '{REWARD_PREFIX}')"
        elif getattr(static, _NOT_A_TOOL, False):
            skipped[n] = "marked @not_a_tool"
        elif n in exclude:
            skipped[n] = "excluded"
        elif not (inspect.getdoc(static) or "").strip():
            skipped[n] = "no docstring"
        else:
            tools[n] = _Tool(n, getattr(env, n))
    unknown = sorted(exclude - set(tools) - set(skipped))
    if unknown:
        raise ValueError(
            f"ToolEnvironment({cls.__name__}): exclude={unknown} names no public method of it"
        )
    return tools, skipped


class ToolEnvironment:
    """Wraps an environment object in the `environment_factory` style; see the module doc.

    `reset(**task)` starts an episode and returns the first observation text (the object's
    `reset` gets the task keys it accepts: all of them when it takes `**kwargs`; `None` becomes
    ""). `call(name, arguments)` runs one tool and returns its result as text; it never raises
    for anything the model did: an unknown tool, bad arguments and an exception inside the
    tool all come back as a message starting with "Error:", and are counted in `metrics`
    (per episode: `reset` zeroes it). Errors of the environment itself (its `reset` raising,
    a method that cannot become a tool) do raise.

    Tools may be `async def`: `acall`/`areset` await them (and run plain methods in a worker
    thread, so a slow tool does not hold up other episodes); `call`/`reset` run them on a
    private event loop kept for this wrapper, so loop-bound clients keep working across calls.
    """

    def __init__(
        self,
        env: object,
        *,
        exclude: Iterable[str] = (),
        max_result_chars: int | None = None,
    ):
        self.env = env
        self.max_result_chars = max_result_chars
        self._tools, self.skipped = _discover(env, set(exclude))
        self.metrics: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.reset_metrics()

    # -- introspection -----------------------------------------------------------------------

    @property
    def tools(self) -> list[dict]:
        """The tool schemas, for the chat template's `tools=` (fresh copies)."""
        return [json.loads(json.dumps(t.schema)) for t in self._tools.values()]

    @property
    def tool_names(self) -> list[str]:
        return list(self._tools)

    def signature(self, name: str) -> str:
        """`name(param: type, ...)` as shown to the model in error messages."""
        return self._tools[name].signature

    def reset_metrics(self) -> None:
        self.metrics = {"calls": 0, "errors": 0, **{k: 0 for k in ERROR_KINDS}}

    # -- episode -----------------------------------------------------------------------------

    def _reset_call(self, task: dict):
        fn = getattr(self.env, "reset", None)
        self.reset_metrics()
        if fn is None:
            return None
        sig = inspect.signature(fn)
        if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            task = {k: v for k, v in task.items() if k in sig.parameters}
        return fn(**task)

    def reset(self, **task: Any) -> str:
        """Starts an episode; returns the first observation ("" when the environment gives none)."""
        result = self._reset_call(task)
        if inspect.isawaitable(result):
            result = self._run(result)
        return _to_text(result)

    async def areset(self, **task: Any) -> str:
        fn = getattr(self.env, "reset", None)
        if fn is not None and not inspect.iscoroutinefunction(fn):
            result = await asyncio.to_thread(self._reset_call, task)
        else:
            result = self._reset_call(task)
        if inspect.isawaitable(result):
            result = await result
        return _to_text(result)

    def close(self) -> None:
        """Closes the environment (its `close`, if any) and the private event loop."""
        fn = getattr(self.env, "close", None)
        try:
            if fn is not None:
                result = fn()
                if inspect.isawaitable(result):
                    self._run(result)
        finally:
            if self._loop is not None:
                self._loop.close()
                self._loop = None

    async def aclose(self) -> None:
        fn = getattr(self.env, "close", None)
        try:
            if fn is not None:
                result = fn() if inspect.iscoroutinefunction(fn) else await asyncio.to_thread(fn)
                if inspect.isawaitable(result):
                    await result
        finally:
            if self._loop is not None:
                self._loop.close()
                self._loop = None

    # -- calls -------------------------------------------------------------------------------

    def _prepare(self, name: str, arguments: Any) -> tuple[_Tool | None, dict | None, str | None]:
        """(tool, kwargs, None) to run it, or (None, None, error message) counted in metrics."""
        self.metrics["calls"] += 1
        tool = self._tools.get(name) if isinstance(name, str) else None
        if tool is None:
            known = ", ".join(self._tools) or "(none)"
            message = f"unknown tool '{name}'. Available tools: {known}."
            return None, None, self._error(["unknown_tool"], message)
        kwargs, problems = tool.bind(arguments)
        if problems:
            text = "; ".join(m for _, m in problems)
            message = f"invalid call to '{name}': {text}. Expected: {tool.signature}"
            return None, None, self._error(sorted({k for k, _ in problems}), message)
        return tool, kwargs, None

    def _error(self, kinds: Iterable[str], message: str) -> str:
        self.metrics["errors"] += 1
        for k in kinds:
            self.metrics[k] += 1
        return f"Error: {message}"

    def _exception(self, e: BaseException) -> str:
        text = str(e)
        message = f"{type(e).__name__}: {text}" if text else type(e).__name__
        return self._error(["tool_exception"], message)

    def _finish(self, result: Any) -> str:
        text = _to_text(result)
        if self.max_result_chars is not None and len(text) > self.max_result_chars:
            cut = len(text) - self.max_result_chars
            text = text[: self.max_result_chars] + f"... [{cut} characters cut]"
        return text

    def call(self, name: str, arguments: Any = None) -> str:
        """Runs tool `name` with the model's `arguments` (a dict or a JSON string); returns text."""
        tool, kwargs, error = self._prepare(name, arguments)
        if error is not None:
            return error
        try:
            result = tool.fn(**kwargs)
            if inspect.isawaitable(result):
                result = self._run(result)
        except EventLoopError:
            raise
        except Exception as e:
            return self._exception(e)
        return self._finish(result)

    async def acall(
        self, name: str, arguments: Any = None, *, timeout_s: float | None = None
    ) -> str:
        """`call` for event loops: awaits async tools, runs plain ones in a worker thread."""
        tool, kwargs, error = self._prepare(name, arguments)
        if error is not None:
            return error

        async def run():
            if inspect.iscoroutinefunction(tool.fn):
                result = tool.fn(**kwargs)
            else:
                result = await asyncio.to_thread(tool.fn, **kwargs)
            return (await result) if inspect.isawaitable(result) else result

        task = asyncio.ensure_future(run())
        # Not wait_for: a TimeoutError raised by the tool itself is the tool's exception.
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            task.cancel()  # a plain tool's worker thread cannot be stopped; its result is dropped
            return self._error(["timeout"], f"tool '{name}' did not answer within {timeout_s:g} s")
        try:
            result = task.result()
        except Exception as e:
            return self._exception(e)
        return self._finish(result)

    def _run(self, awaitable):
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            if inspect.iscoroutine(awaitable):
                awaitable.close()
            raise EventLoopError(
                "ToolEnvironment.call/reset/close cannot run an async method inside a running "
                "event loop; use `await acall(...)` / `await areset(...)` / `await aclose()`"
            )
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(awaitable)

    def __repr__(self) -> str:
        return f"ToolEnvironment({type(self.env).__name__}, tools={self.tool_names})"
