"""Bundled environment servers for the session and endpoint tests, and what those tests do with them:
freeze one, play an episode on its own session, see that no session is left active."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request

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


@contextlib.contextmanager
def worker_server(*command: str, env: dict[str, str] | None = None):
    """A server started by `command` (with `env` added to its environment), which prints "ENV_LISTENING
    URL" once bound: its process and URL once /health answers (the socket is bound before uvicorn
    serves on it); terminated at the end."""
    proc = subprocess.Popen([sys.executable, *command], stdout=subprocess.PIPE, text=True,
                            env=None if env is None else {**os.environ, **env})
    try:
        line = proc.stdout.readline()
        assert line.startswith("ENV_LISTENING "), line
        url = line.split()[1]
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url + "/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, f"{command[0]} did not answer /health"
                time.sleep(0.2)
        yield proc, url
    finally:
        proc.terminate()
        proc.wait(10)
