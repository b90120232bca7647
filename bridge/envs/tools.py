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

Tools are listed in name order, as TRL lists them (the same system prompt).

Which types a tool's parameters may have, the schema each tool shows the model and how its
arguments are checked are `function_tool`'s.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
from collections.abc import Callable, Iterable
from typing import Any

from bridge.envs.function_tool import Tool, ToolSchemaError, tool_schema

# Public here too: building a ToolEnvironment raises ToolSchemaError, and tool_schema shows what it lists.
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


class EventLoopError(RuntimeError):
    """The sync API was asked to run an async method from inside a running event loop."""


def not_a_tool(fn: Callable) -> Callable:
    """Marks a public, documented method as not a tool (helpers, reward getters)."""
    setattr(fn, _NOT_A_TOOL, True)
    return fn


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


_CLASS_TOOLS: dict[tuple[type, str], Tool] = {}


def _bound_tool(env: object, name: str) -> Tool:
    """The tool of `env`'s method `name`. Its schema and checks are worked out once per class (docstring
    parsing and signatures cost a millisecond, and an episode builds a wrapper of a fresh instance),
    then bound to this instance's method."""
    method = getattr(env, name)
    if name in getattr(env, "__dict__", {}):  # set on this instance: its own
        return Tool(name, method)
    tool = _CLASS_TOOLS.get((type(env), name))
    if tool is None:
        tool = _CLASS_TOOLS[(type(env), name)] = Tool(name, method)
    bound = copy.copy(tool)
    bound.fn = method
    return bound


def _discover(env: object, exclude: set[str]) -> tuple[dict[str, Tool], dict[str, str]]:
    cls = type(env)
    # In name order, as TRL lists an environment's tools (`inspect.getmembers`): the same prompt.
    names = sorted({n for klass in cls.__mro__ if klass is not object for n in vars(klass)})
    tools: dict[str, Tool] = {}
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
            tools[n] = _bound_tool(env, n)
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

    def _prepare(self, name: str, arguments: Any) -> tuple[Tool | None, dict | None, str | None]:
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
