"""Tool environments: discovery rules, call errors, async."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

import pytest

from bridge.envs.tools import (
    ERROR_KINDS,
    EventLoopError,
    ToolEnvironment,
    ToolSchemaError,
    not_a_tool,
)


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


def test_each_instance_calls_its_own_methods_with_the_classs_schema():
    first, second = Game(), Game()
    a, b = ToolEnvironment(first), ToolEnvironment(second)
    assert a.tools == b.tools and a.tools[0] is not b.tools[0]  # worked out once, handed out as copies
    a.reset(secret=3)
    b.reset(secret=5)
    assert (a.call("guess", {"n": 3}), b.call("guess", {"n": 3})) == ("correct", "higher")
    assert first.calls == [3] and second.calls == [3]
