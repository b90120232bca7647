"""Bundled environment servers for the session and endpoint tests, and what those tests do with them:
freeze one, play an episode on its own session, see that no session is left active."""

import contextlib
import os
import signal

import pytest

from bridge.envs.bundled import get
from jaxrl.run.processes import EnvServerProcess


SOLVE = get("guess_number").solve  # imports OpenEnv now, not inside a timed event loop


@pytest.fixture(scope="module")
def echo():
    with EnvServerProcess.start("echo", max_concurrent_envs=8) as server:
        yield server


@pytest.fixture(scope="module")
def guess():
    """Two sessions at most: the capacity test runs more episodes than that."""
    with EnvServerProcess.start("guess_number", max_concurrent_envs=2) as server:
        yield server


@pytest.fixture(scope="module")
def freezable():
    """A server the tests SIGSTOP (and always SIGCONT): a frozen server, not a dead one."""
    with EnvServerProcess.start("echo", max_concurrent_envs=8) as server:
        yield server


@contextlib.contextmanager
def frozen(server):
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


async def solve_episode(endpoint, seed):
    """One guess_number episode played by the solver on its own session: (steps, reward)."""
    async with endpoint.session() as env:
        reply = await env.reset(seed=seed)
        history = [reply["observation"]]
        while not reply["done"]:
            reply = await env.step(SOLVE(history).model_dump(exclude={"metadata"}))
            history.append(reply["observation"])
        return len(history) - 1, reply["reward"]


def idle(endpoint):
    return endpoint.metrics["sessions_active"] == 0
