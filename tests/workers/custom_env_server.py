"""Environments written only for tests, each served by its own OpenEnv server (not jaxrl's).

Usage: custom_env_server.py {reverse|calculator} [--max-concurrent-envs N]
Prints `ENV_LISTENING http://127.0.0.1:PORT` once serving. `reverse` is a text environment
(answer the word reversed); `calculator` is an MCP environment (tools `add` and `multiply`,
listed with ListToolsAction, called with CallToolAction; done once the answer tool is called).
"""

import argparse
import random
import socket
import sys
from typing import Any

import uvicorn
from fastmcp import FastMCP
from openenv.core.env_server import Action, Environment, Observation, State, create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction
from pydantic import Field

WORDS = ["stone", "river", "maple", "cloud", "ember", "flint", "honey", "ocean"]


class ReverseAction(Action):
    answer: str = Field(description="the word, reversed")


class ReverseObservation(Observation):
    prompt: str = ""
    word: str = ""


class ReverseEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id="", step_count=0)
        self.word = ""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> ReverseObservation:
        self.word = random.Random(seed).choice(WORDS)
        self._state = State(episode_id=episode_id or "", step_count=0)
        return ReverseObservation(prompt=f"Write the word '{self.word}' backwards.", word=self.word,
                                  done=False, reward=None)

    def step(self, action: ReverseAction, timeout_s: float | None = None, **kwargs: Any) -> ReverseObservation:
        self._state.step_count += 1
        ok = action.answer.strip() == self.word[::-1]
        return ReverseObservation(prompt="correct" if ok else "wrong", word=self.word, done=True,
                                  reward=1.0 if ok else 0.0)

    @property
    def state(self) -> State:
        return self._state


class CalculatorObservation(Observation):
    text: str = ""


class CalculatorEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("calculator")
        self.target = 0
        self.done = False

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Adds two integers."""
            return a + b

        @mcp.tool
        def multiply(a: int, b: int) -> int:
            """Multiplies two integers."""
            return a * b

        @mcp.tool
        def answer(value: int) -> str:
            """Submits the final answer."""
            self.done = True
            self.correct = value == self.target
            return "correct" if self.correct else "wrong"

        super().__init__(mcp)
        self._state = State(episode_id="", step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        rng = random.Random(seed)
        self.x, self.y = rng.randint(2, 9), rng.randint(2, 9)
        self.target, self.done, self.correct = self.x * self.y + self.x, False, False
        self._state = State(episode_id=episode_id or "", step_count=0)
        return CalculatorObservation(done=False, reward=None,
                                     text=f"Compute {self.x} * {self.y} + {self.x} with the tools.")

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0, metadata={"error": "use the MCP tools"})

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        obs = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        obs.done = self.done
        obs.reward = (1.0 if self.correct else 0.0) if self.done else 0.0
        return obs

    @property
    def state(self) -> State:
        return self._state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("env", choices=["reverse", "calculator"])
    parser.add_argument("--max-concurrent-envs", type=int, default=64)
    args = parser.parse_args()
    if args.env == "reverse":
        app = create_app(ReverseEnv, ReverseAction, ReverseObservation, env_name="reverse",
                         max_concurrent_envs=args.max_concurrent_envs)
    else:
        app = create_app(CalculatorEnv, CallToolAction, Observation, env_name="calculator",
                         max_concurrent_envs=args.max_concurrent_envs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"ENV_LISTENING http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
