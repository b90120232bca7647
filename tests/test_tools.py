"""Tool environments: schemas from hints and docstrings, discovery rules, call errors, async."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal, Optional

import pytest

from bridge.envs.tools import (
    ERROR_KINDS,
    EventLoopError,
    ToolEnvironment,
    ToolSchemaError,
    not_a_tool,
    tool_schema,
)

# ---------------------------------------------------------------------------------------------
# tool_schema


def move(direction: Literal["up", "down"], steps: int = 1, run: bool = False) -> str:
    """Move the player.

    Args:
        direction: Where to go.
        steps: How many squares,
            at most 3.
        run: Whether to run.

    Returns:
        What the player sees.
    """


def scale(values: list[float], factor: float, label: Optional[str] = None) -> list[float]:
    """Scale numbers.

    Args:
        values: The numbers.
        factor: The factor.
        label: A label, or nothing.
    """


def tag(words: list[str], counts: dict[str, list[int]] | None = None, pair: tuple[int, str] = (1, "a")):
    """Tag words.

    Args:
        words: The words.
        counts: Counts per word.
        pair: A pair.
    """


def test_schema_shape_literal_default_bool():
    schema = tool_schema(move)
    assert schema == {
        "type": "function",
        "function": {
            "name": "move",
            "description": "Move the player.",
            "parameters": {
                "type": "object",
                "properties": {
                    "direction": {"type": "string", "enum": ["up", "down"], "description": "Where to go."},
                    "steps": {"type": "integer", "description": "How many squares, at most 3."},
                    "run": {"type": "boolean", "description": "Whether to run."},
                },
                "required": ["direction"],
            },
            "return": {"type": "string", "description": "What the player sees."},
        },
    }


def test_schema_lists_floats_optional():
    props = tool_schema(scale)["function"]["parameters"]
    assert props["required"] == ["values", "factor"]
    p = props["properties"]
    assert p["values"] == {"type": "array", "items": {"type": "number"}, "description": "The numbers."}
    assert p["factor"] == {"type": "number", "description": "The factor."}
    assert p["label"] == {
        "type": "string",
        "nullable": True,
        "description": "A label, or nothing.",
    }


def test_schema_nested_dict_tuple():
    p = tool_schema(tag)["function"]["parameters"]["properties"]
    assert p["words"]["items"] == {"type": "string"}
    assert p["counts"]["additionalProperties"] == {"type": "array", "items": {"type": "integer"}}
    assert p["pair"]["prefixItems"] == [{"type": "integer"}, {"type": "string"}]
    assert "default" not in p["pair"]  # TRL's schema (get_json_schema) shows no defaults


def test_schema_no_parameters_and_method():
    class Env:
        def look(self) -> str:
            """Look around."""

    schema = tool_schema(Env().look)
    assert schema["function"]["name"] == "look"
    assert schema["function"]["parameters"] == {"type": "object", "properties": {}}


class Vault:
    """A TRL `environment_factory` class whose tools document what they return."""

    def reset(self, **row) -> str:
        return "Open the vault."

    def try_code(self, code: int, hint: Literal["digits", "sum"] | None = None) -> str:
        """Try a code on the lock.

        Args:
            code: A four-digit code.
            hint: Which hint to get back when the code is wrong.

        Returns:
            "open", or the hint asked for.
        """

    def inspect_lock(self) -> dict[str, int]:
        """Look at the lock.

        Returns:
            The lock's digits and how many tries are left.
        """


def test_tool_schemas_are_trls_byte_for_byte():
    from transformers.utils import get_json_schema

    vault = Vault()
    tools = ToolEnvironment(vault).tools
    # TRL renders `getattr(env, name)` for the class's public functions in `inspect.getmembers` order.
    trl = [get_json_schema(getattr(vault, n)) for n in ("inspect_lock", "try_code")]
    assert [json.dumps(t) for t in tools] == [json.dumps(t) for t in trl]
    assert tools[1]["function"]["return"] == {"type": "string", "description": '"open", or the hint asked for.'}


def _undocumented_param(a: int, b: int):
    """Adds.

    Args:
        a: First.
    """


def _unhinted(a, b: int):
    """Adds.

    Args:
        a: First.
        b: Second.
    """


class Board:
    pass


def _custom_type(board: Board):
    """Uses a board.

    Args:
        board: The board.
    """


def _int_keys(table: dict[int, str]):
    """Uses a table.

    Args:
        table: The table.
    """


def _var_kwargs(a: int, **rest: int):
    """Takes more.

    Args:
        a: First.
        rest: More.
    """


def _no_doc(a: int):
    pass


def _typed_in_doc(a: int):
    """Adds.

    Args:
        a (int): First.
    """


@pytest.mark.parametrize(
    "fn, needles",
    [
        (_undocumented_param, ["_undocumented_param", "'b'", "Args:"]),
        (_unhinted, ["_unhinted", "'a'", "no type hint"]),
        (_custom_type, ["_custom_type", "'board'", "unsupported type Board"]),
        (_int_keys, ["_int_keys", "'table'", "dict[str, T]"]),
        (_var_kwargs, ["_var_kwargs", "'**rest'"]),
        (_no_doc, ["_no_doc", "no docstring"]),
        (_typed_in_doc, ["_typed_in_doc", "'a'", "a: <what it is>"]),
    ],
)
def test_schema_errors_name_function_and_parameter(fn, needles):
    with pytest.raises(ToolSchemaError) as info:
        tool_schema(fn)
    for needle in needles:
        assert needle in str(info.value)


# ---------------------------------------------------------------------------------------------
# Discovery


class Base:
    def inherited(self, x: int) -> int:
        """An inherited tool.

        Args:
            x: A number.
        """
        return x


class Game(Base):
    label = "not a method"

    def __init__(self):
        self.secret = 0
        self.reward = 0.0  # state for reward functions, as in TRL examples
        self.calls = []

    def reset(self, secret: int = 42, **task) -> str:
        self.secret = secret
        return f"Guess a number. Task keys: {sorted(task)}"

    def guess(self, n: int) -> str:
        """Guess the secret number.

        Args:
            n: The guess.
        """
        self.calls.append(n)
        if n == 13:
            raise ValueError("unlucky number")
        if n == 14:
            raise KeyError("k")
        return "correct" if n == self.secret else ("higher" if n < self.secret else "lower")

    def weigh(self, x: float, items: list[int], mode: Literal["sum", "max"] = "sum", note: str | None = None):
        """Weigh things.

        Args:
            x: A weight.
            items: Items.
            mode: How.
            note: A note.
        """
        return {"x": x, "items": items, "mode": mode, "note": note}

    async def slow(self, seconds: float) -> str:
        """Wait.

        Args:
            seconds: How long.
        """
        await asyncio.sleep(seconds)
        return "done"

    def raises_timeout(self) -> str:
        """Raises TimeoutError itself."""
        raise TimeoutError("backend timed out")

    @staticmethod
    def help() -> str:
        """Show help."""
        return "help text"

    @property
    def state(self) -> str:
        """A property, never a tool."""
        raise AssertionError("properties must not be evaluated")

    def helper(self, x: int) -> int:
        return x

    def _private(self, x: int) -> int:
        """Private."""
        return x

    def close(self) -> None:
        """Close."""

    def reward_correct(self) -> float:
        """A reward by name."""
        return 1.0

    def get_reward(self) -> float:
        """TRL's environment reward method."""
        return 1.0

    @not_a_tool
    def score(self) -> float:
        """Marked."""
        return 0.0


def test_discovery_rules():
    env = ToolEnvironment(Game())
    assert env.tool_names == ["guess", "help", "inherited", "raises_timeout", "slow", "weigh"]  # TRL's order
    assert env.skipped == {
        "reset": "lifecycle method",
        "close": "lifecycle method",
        "helper": "no docstring",
        "reward_correct": "reward method (name starts with 'reward')",
        "get_reward": "reward method (get_reward)",
        "score": "marked @not_a_tool",
    }
    assert [t["function"]["name"] for t in env.tools] == env.tool_names
    assert ToolEnvironment(Game(), exclude=["help"]).skipped["help"] == "excluded"
    with pytest.raises(ValueError, match="exclude=\\['hlp'\\] names no public method"):
        ToolEnvironment(Game(), exclude=["hlp"])


def test_discovery_refuses_a_broken_documented_method():
    class Broken:
        def act(self, thing):
            """Act.

            Args:
                thing: A thing.
            """

    with pytest.raises(ToolSchemaError, match="act.*'thing'.*no type hint"):
        ToolEnvironment(Broken())


def test_tools_property_is_a_copy():
    env = ToolEnvironment(Game())
    env.tools[0]["function"]["name"] = "changed"
    assert env.tools[0]["function"]["name"] == "guess"


# ---------------------------------------------------------------------------------------------
# reset and calls


def test_reset_passes_task_and_zeroes_metrics():
    env = ToolEnvironment(Game())
    assert env.reset(secret=7, prompt="p") == "Guess a number. Task keys: ['prompt']"
    env.call("guess", {"n": "x"})
    assert env.metrics["errors"] == 1
    env.reset()
    assert env.metrics == {"calls": 0, "errors": 0, **{k: 0 for k in ERROR_KINDS}}


def test_reset_drops_keys_a_fixed_signature_does_not_take():
    class Fixed:
        def reset(self, level: int = 0):
            return None  # no first observation

    assert ToolEnvironment(Fixed()).reset(level=2, prompt="ignored") == ""


def test_successful_calls_and_coercion():
    env = ToolEnvironment(Game())
    env.reset(secret=7)
    assert env.call("guess", {"n": 3}) == "higher"
    assert env.call("guess", {"n": 7.0}) == "correct"  # integral number for int
    assert env.call("guess", '{"n": 9}') == "lower"  # arguments as a JSON string
    out = env.call("weigh", {"x": 2, "items": [1, 2.0], "mode": "max"})
    assert out == '{"x": 2.0, "items": [1, 2], "mode": "max", "note": null}'  # JSON numbers for float
    assert env.call("help", None) == "help text"
    assert env.call("inherited", {"x": 5}) == "5"
    assert env.metrics["calls"] == 6 and env.metrics["errors"] == 0


@pytest.mark.parametrize(
    "name, arguments, kind, needles",
    [
        ("nope", {}, "unknown_tool", ["unknown tool 'nope'", "Available tools: guess, help, inherited"]),
        ("reset", {}, "unknown_tool", ["unknown tool 'reset'"]),
        ("guess", {}, "missing_arguments", ["missing required argument 'n'", "Expected: guess(n: int)"]),
        ("guess", {"n": 1, "m": 2}, "unexpected_arguments", ["unexpected argument 'm'", "guess(n: int)"]),
        ("guess", {"n": "3"}, "wrong_type", ["argument 'n' must be int, got str \"3\""]),
        ("guess", {"n": 3.5}, "wrong_type", ["must be int, got float 3.5"]),
        ("guess", {"n": True}, "wrong_type", ["must be int, got bool true"]),
        ("weigh", {"x": "1", "items": [1]}, "wrong_type", ["'x' must be float"]),
        ("weigh", {"x": 1, "items": [1, "a"]}, "wrong_type", ["'items[1]' must be int, got str \"a\""]),
        ("weigh", {"x": 1, "items": [], "mode": "avg"}, "wrong_type", ["'mode' must be \"sum\" | \"max\""]),
        ("weigh", {"x": 1, "items": [], "note": 5}, "wrong_type", ["'note' must be str | None"]),
        ("guess", [3], "invalid_arguments", ["must be a JSON object, got list [3]"]),
        ("guess", "{n: 3", "invalid_arguments", ["not valid JSON"]),
        ("guess", {"n": 13}, "tool_exception", ["Error: ValueError: unlucky number"]),
        ("guess", {"n": 14}, "tool_exception", ["Error: KeyError: 'k'"]),
        ("raises_timeout", {}, "tool_exception", ["Error: TimeoutError: backend timed out"]),
    ],
)
def test_call_errors_become_messages_and_metrics(name, arguments, kind, needles):
    env = ToolEnvironment(Game())
    env.reset()
    out = env.call(name, arguments)
    assert out.startswith("Error: ")
    for needle in needles:
        assert needle in out
    assert env.metrics["calls"] == 1 and env.metrics["errors"] == 1
    assert env.metrics[kind] == 1
    assert sum(env.metrics[k] for k in ERROR_KINDS) == 1


def test_several_problems_in_one_call_are_all_named():
    env = ToolEnvironment(Game())
    out = env.call("weigh", {"items": "no", "extra": 1})
    assert "missing required argument 'x'" in out and "unexpected argument 'extra'" in out
    assert "'items' must be list[int]" in out
    m = env.metrics
    assert (m["errors"], m["missing_arguments"], m["unexpected_arguments"], m["wrong_type"]) == (1, 1, 1, 1)


def test_invalid_arguments_never_reach_the_tool():
    game = Game()
    env = ToolEnvironment(game)
    env.call("guess", {"n": "1"})
    env.call("guess", {})
    assert game.calls == []


def test_result_truncation():
    class Big:
        def dump(self) -> str:
            """Dump."""
            return "x" * 100

    out = ToolEnvironment(Big(), max_result_chars=10).call("dump")
    assert out == "x" * 10 + "... [90 characters cut]"


# ---------------------------------------------------------------------------------------------
# async


class AsyncGame:
    def __init__(self):
        self.loops = set()

    async def reset(self, **task) -> str:
        self.loops.add(id(asyncio.get_running_loop()))
        return "start"

    async def ping(self, text: str) -> str:
        """Ping.

        Args:
            text: What to send.
        """
        self.loops.add(id(asyncio.get_running_loop()))
        if text == "boom":
            raise RuntimeError("exploded")
        return text.upper()

    async def close(self) -> None:
        self.closed = True


def test_sync_api_runs_async_methods_on_one_private_loop():
    game = AsyncGame()
    env = ToolEnvironment(game)
    assert env.reset() == "start"
    assert env.call("ping", {"text": "hi"}) == "HI"
    assert env.call("ping", {"text": "boom"}) == "Error: RuntimeError: exploded"
    assert len(game.loops) == 1  # loop-bound clients keep working across calls
    env.close()
    assert game.closed


def test_async_api():
    async def main():
        env = ToolEnvironment(AsyncGame())
        assert await env.areset() == "start"
        assert await env.acall("ping", {"text": "hi"}) == "HI"
        assert (await env.acall("ping", {"text": 1})).startswith("Error: invalid call to 'ping'")
        sync_env = ToolEnvironment(Game())
        await sync_env.areset(secret=2)
        assert await sync_env.acall("guess", {"n": 2}) == "correct"  # a plain tool, in a thread
        assert await sync_env.acall("guess", {"n": 13}) == "Error: ValueError: unlucky number"
        await env.aclose()
        return env

    env = asyncio.run(main())
    assert env.metrics["wrong_type"] == 1


def test_acall_timeout_is_counted_apart_from_tool_timeouts():
    async def main():
        env = ToolEnvironment(Game())
        t = time.perf_counter()
        out = await env.acall("slow", {"seconds": 5}, timeout_s=0.05)
        assert time.perf_counter() - t < 2
        assert out == "Error: tool 'slow' did not answer within 0.05 s"
        assert await env.acall("raises_timeout", {}, timeout_s=5) == "Error: TimeoutError: backend timed out"
        assert await env.acall("slow", {"seconds": 0}, timeout_s=5) == "done"
        return env.metrics

    m = asyncio.run(main())
    assert (m["timeout"], m["tool_exception"], m["errors"], m["calls"]) == (1, 1, 2, 3)


def test_sync_call_of_async_tool_inside_a_loop_is_a_clear_error():
    async def main():
        env = ToolEnvironment(AsyncGame())
        with pytest.raises(EventLoopError, match="acall"):
            env.call("ping", {"text": "x"})

    asyncio.run(main())


def test_any_typed_parameter_takes_anything():
    class Free:
        def store(self, value: Any) -> Any:
            """Store.

            Args:
                value: Anything.
            """
            return value

    env = ToolEnvironment(Free())
    assert env.call("store", {"value": {"a": [1, None]}}) == '{"a": [1, null]}'
