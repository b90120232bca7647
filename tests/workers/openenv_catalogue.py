"""OpenEnv environments written the way OpenEnv's own catalogue writes them, for tests.

Like grid_world, connect4 or echo_env there: an `Environment` subclass with pydantic Action and
Observation models, served by OpenEnv's `create_app` as shipped (one session per server unless
the environment says otherwise), state kept in observation fields, enum actions, `reset()`
without a seed. The tests run each both served over `/ws` and in-process (`env_class:`).

- `grid`: `GridWorldEnvironment`, a 3x3 grid, start (0, 0), goal (2, 2); the action is an enum
  (`{"action": "DOWN"}`); -0.1 per move, 1.0 at the goal; x / y / message in the observation.
- `arithmetic`: `ArithmeticEnvironment`, an MCP environment (FastMCP tools `compute(op, a, b)` with
  an enum `op`, and `answer(value)`); done once answered, 1.0 when right.
- `nim`: `NimEnvironment`, a one-session game: 7 stones, take 1-3, the opponent takes 1; taking
  the last stone wins (1.0), leaving it to the opponent loses (-1.0).
- `board`: `BoardEnvironment`, chess's way: the move's meaning only in the action class's docstring
  (`move: str` has no description), a `promotion` field text mode leaves at its default; one move, a
  legal one wins. `BareBoardEnvironment` (in-process only): the same without the docstring.
- `quiz` (openenv >= 0.10 only): `QuizEnvironment`, reasoning_gym's way: task splits (train, test),
  `reset(split=, index=)`, a reset that ignores the seed and hands out the next question otherwise,
  reset's own observation class, metadata.
- `echo_mcp`: `EchoMCPEnvironment`, echo_env's way: an MCP tool, a reset that says all in metadata.

Served by the installed openenv, or by openenv-core 0.3.0 with PYTHONPATH naming its code
(`scripts/setup.sh test` puts it in .venv/openenv-core-0.3.0). `quiz_production` is `quiz` in
openenv's production mode: only /health, /schema, /metadata, /ws, /mcp and the task routes.

`python openenv_catalogue.py grid arithmetic nim` serves each on its own 127.0.0.1 port in one
process and prints `ENV_LISTENING NAME URL` per environment once all of them serve.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import uuid
from enum import Enum
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server import Action, Environment, Observation, State, create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from pydantic import Field


class MoveAction(str, Enum):
    UP = "UP"
    DOWN = "DOWN"
    LEFT = "LEFT"
    RIGHT = "RIGHT"


class GridWorldAction(Action):
    action: MoveAction = Field(description="where to move")


class GridWorldObservation(Observation):
    x: int = 0
    y: int = 0
    message: str = ""


class GridWorldEnvironment(Environment):
    """A 3x3 grid: the agent starts at [0, 0] and must reach [2, 2]."""

    def __init__(self):
        super().__init__()
        self.size, self.goal = 3, [2, 2]
        self.agent_x = self.agent_y = 0
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

    def reset(self) -> GridWorldObservation:
        self.agent_x = self.agent_y = 0
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        return GridWorldObservation(x=0, y=0, message="Welcome to Grid World! Goal is at [2, 2].", reward=0.0,
                                    done=False)

    def step(self, action: GridWorldAction) -> GridWorldObservation:
        self._state.step_count += 1
        dx, dy = {MoveAction.UP: (-1, 0), MoveAction.DOWN: (1, 0), MoveAction.LEFT: (0, -1),
                  MoveAction.RIGHT: (0, 1)}[action.action]
        self.agent_x = max(0, min(self.agent_x + dx, self.size - 1))
        self.agent_y = max(0, min(self.agent_y + dy, self.size - 1))
        if [self.agent_x, self.agent_y] == self.goal:
            return GridWorldObservation(x=self.agent_x, y=self.agent_y, message="You found the goal!", reward=1.0,
                                        done=True)
        return GridWorldObservation(x=self.agent_x, y=self.agent_y, message="Keep going...", reward=-0.1,
                                    done=False)

    @property
    def state(self) -> State:
        return self._state


class Op(str, Enum):
    ADD = "add"
    MUL = "mul"


class ArithmeticObservation(Observation):
    question: str = ""


class ArithmeticEnvironment(MCPEnvironment):
    """Compute x * y + x with the tools, then answer."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("arithmetic")
        self.target, self.answered, self.correct = 0, False, False

        @mcp.tool
        def compute(op: Op, a: int, b: int) -> int:
            """Adds or multiplies two integers."""
            return a + b if op == Op.ADD else a * b

        @mcp.tool
        def answer(value: int) -> str:
            """Submits the final answer."""
            self.answered, self.correct = True, value == self.target
            return "correct" if self.correct else "wrong"

        super().__init__(mcp)
        self._state = State(episode_id="", step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> ArithmeticObservation:
        x, y = 2 + (seed or 0) % 7, 3 + (seed or 0) % 5
        self.target, self.answered, self.correct = x * y + x, False, False
        self._state = State(episode_id=episode_id or "", step_count=0)
        return ArithmeticObservation(question=f"Compute {x} * {y} + {x} with the tools.", done=False, reward=None)

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0, metadata={"error": "use the MCP tools"})

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        obs = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        obs.done = self.answered
        obs.reward = float(self.correct) if self.answered else 0.0
        return obs

    @property
    def state(self) -> State:
        return self._state


class NimAction(Action):
    take: int = Field(ge=1, le=3, description="stones to take")


class NimObservation(Observation):
    pile: int = 0
    opponent_took: int | None = None
    message: str = ""


class NimEnvironment(Environment):
    """Nim against an opponent that always takes one stone; whoever takes the last stone wins."""

    def __init__(self):
        super().__init__()
        self.pile = 7
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

    def reset(self) -> NimObservation:
        self.pile = 7
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        return NimObservation(pile=7, message="Take 1 to 3 stones; whoever takes the last one wins.", reward=0.0)

    def step(self, action: NimAction) -> NimObservation:
        self._state.step_count += 1
        if action.take > self.pile:
            raise ValueError(f"only {self.pile} stones are left")
        self.pile -= action.take
        if self.pile == 0:
            return NimObservation(pile=0, message="You took the last stone: you win.", reward=1.0, done=True)
        self.pile -= 1
        if self.pile == 0:
            return NimObservation(pile=0, opponent_took=1, message="The opponent took the last stone.", reward=-1.0,
                                  done=True)
        return NimObservation(pile=self.pile, opponent_took=1, message="Your move.", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


class BoardAction(Action):
    """A move in UCI notation: the square a piece leaves, then the square it lands on (e2e4)."""

    move: str
    promotion: str | None = None


class BareBoardAction(BoardAction):  # no docstring: nothing says what a move is
    pass


class BoardObservation(Observation):
    fen: str = ""
    legal_moves: list[str] = Field(default_factory=list)


class BoardEnvironment(Environment):
    """chess's way: what a move is, only the action class's docstring says (its field has no description), and
    a field (`promotion`) that text mode cannot fill. One move: a legal one wins."""

    START = "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1"
    LEGAL = ["e2e4", "d2d4", "g1f3"]

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

    def reset(self) -> BoardObservation:
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        return BoardObservation(fen=self.START, legal_moves=self.LEGAL, reward=0.0)

    def step(self, action: BoardAction) -> BoardObservation:
        self._state.step_count += 1
        if action.move not in self.LEGAL:
            raise ValueError(f"illegal move {action.move!r}")
        return BoardObservation(fen=self.START, legal_moves=[], reward=1.0, done=True)

    @property
    def state(self) -> State:
        return self._state


class BareBoardEnvironment(BoardEnvironment):
    def step(self, action: BareBoardAction) -> BoardObservation:
        return super().step(action)


class QuizAction(Action):
    answer: str = Field(description="the answer, a whole number")
    show_work: bool = Field(default=False, description="whether to explain the verdict")


class QuizResetObservation(Observation):
    question: str = ""


class QuizObservation(Observation):
    verdict: str = ""


QUIZ = {"train": [("2 + 3", 5), ("4 * 4", 16), ("9 - 7", 2)], "test": [("6 + 6", 12), ("3 * 5", 15)]}


class QuizEnvironment(Environment):
    """Like reasoning_gym's server: task splits, and a reset that ignores the seed and hands out the next
    training question unless split and index name one; the question in reset's own observation class
    (openenv >= 0.10: reset_observation_cls), where it came from in metadata."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    handed_out = 0  # over all sessions: the server's dataset iterator

    def __init__(self):
        super().__init__()
        self.answer = 0
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, split: str | None = None,
              index: int | None = None) -> QuizResetObservation:
        if split is None:
            split, index = "train", QuizEnvironment.handed_out % len(QUIZ["train"])
            QuizEnvironment.handed_out += 1
        question, self.answer = QUIZ[split][index]
        return QuizResetObservation(question=f"What is {question}?", metadata={"split": split, "index": index})

    def step(self, action: QuizAction) -> QuizObservation:
        right = action.answer.strip() == str(self.answer)
        return QuizObservation(verdict="right" if right else "wrong", reward=float(right), done=True,
                               metadata={"answer": self.answer})

    def list_splits(self) -> list[str]:
        return list(QUIZ)

    def num_tasks(self, split: str) -> int:
        return len(QUIZ[split])

    def get_task(self, split: str, index: int) -> dict[str, Any]:
        return {"question": QUIZ[split][index][0]}

    @property
    def state(self) -> State:
        return self._state


class EchoMCPEnvironment(MCPEnvironment):
    """As OpenEnv's echo_env: one tool, and a reset that says everything in metadata."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("echo_env")

        @mcp.tool
        def echo_message(message: str) -> str:
            """Echoes the message back."""
            return message

        super().__init__(mcp)
        self._state = State(episode_id="", step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0, metadata={"status": "ready", "message": "Echo environment ready!"})

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0, metadata={"error": "use the MCP tools"})

    @property
    def state(self) -> State:
        return self._state


def build_app(name: str):
    """The app OpenEnv's catalogue would ship for `name` (its defaults: one session unless said)."""
    if name == "grid":
        return create_app(GridWorldEnvironment, GridWorldAction, GridWorldObservation, env_name="grid_world")
    if name == "arithmetic":
        return create_app(ArithmeticEnvironment, CallToolAction, CallToolObservation, env_name="arithmetic",
                          max_concurrent_envs=8)
    if name == "nim":
        return create_app(NimEnvironment, NimAction, NimObservation, env_name="nim")
    if name == "board":
        return create_app(BoardEnvironment, BoardAction, BoardObservation, env_name="chess")
    if name in ("quiz", "quiz_production"):  # openenv >= 0.10 only
        return create_app(QuizEnvironment, QuizAction, QuizObservation, env_name="quiz", max_concurrent_envs=8,
                          reset_observation_cls=QuizResetObservation,
                          mode="production" if name == "quiz_production" else "simulation")
    if name == "echo_mcp":
        return create_app(EchoMCPEnvironment, CallToolAction, CallToolObservation, env_name="echo_env",
                          max_concurrent_envs=8)
    raise SystemExit(f"unknown environment {name!r}; known: grid, arithmetic, nim, board, quiz, quiz_production, "
                     "echo_mcp")


async def serve(names: list[str]) -> None:
    import uvicorn

    servers, lines = [], []
    for name in names:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(build_app(name), log_level="warning"))
        servers.append(asyncio.create_task(server.serve(sockets=[sock])))
        lines.append((server, f"ENV_LISTENING {name} http://127.0.0.1:{sock.getsockname()[1]}"))
    while not all(server.started for server, _ in lines):
        await asyncio.sleep(0.02)
    for _, line in lines:
        print(line, flush=True)
    await asyncio.wait(servers, return_when=asyncio.FIRST_COMPLETED)  # a signal stops one: stop them all
    for server, _ in lines:
        server.should_exit = True
    await asyncio.gather(*servers)


if __name__ == "__main__":
    sys.exit(asyncio.run(serve(sys.argv[1:])))
