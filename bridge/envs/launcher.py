"""Runs a bundled environment server as a child process: `python -m jaxrl.cli env serve ...`.

`EnvServerProcess.start` waits for the child's `ENV_LISTENING http://host:port` line and then
for `GET /health` to answer; a child that exits (or never gets ready) during start-up raises
`EnvServerStartError` with the tail of its stderr. `stop` sends SIGTERM to the child's PID,
then SIGKILL to its process group (the child leads its own group) if it is still there. The
child watches its parent and exits if the parent dies without stopping it; servers still
running when this interpreter exits are stopped on the way out.

    with EnvServerProcess.start("wordle", max_concurrent_envs=16) as server:
        client = GenericEnvClient(base_url=server.url)   # sessions over server.ws_url
"""

from __future__ import annotations

import ipaddress
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from bridge.child import ChildHandle, ChildServer, ChildStartError
from bridge.envs.serve import DEFAULT_MAX_CONCURRENT_ENVS, LISTENING_PREFIX, url_for

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local server


class EnvServerStartError(ChildStartError):
    """The environment server exited or did not become ready during start-up."""


class EnvServerProcess(ChildHandle):
    def __init__(self, child: ChildServer, name: str):
        self.child = child
        self.proc = child.proc
        self.name = name

    @classmethod
    def start(
        cls,
        name: str,
        port: int = 0,
        host: str = "127.0.0.1",
        max_concurrent_envs: int = DEFAULT_MAX_CONCURRENT_ENVS,
        seed: int = 0,
        timeout: float = 120.0,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | Path | None = None,
        python: str | None = None,
    ) -> EnvServerProcess:
        """Starts `jaxrl env serve name` and returns once it answers /health.

        Raises EnvServerStartError (with the child's stderr tail) if the child exits or is not
        ready within `timeout` seconds. `env` entries are added to this process's environment
        for the child; with `log_path` the child's output is appended to that file.
        """
        args = [python or sys.executable, "-m", "jaxrl.cli", "env", "serve", name,
                "--host", host, "--port", str(port), "--max-concurrent-envs", str(max_concurrent_envs),
                "--seed", str(seed), "--parent-pid", str(os.getpid()), *extra_args]
        child = ChildServer(args, f"environment server {name!r}", LISTENING_PREFIX,
                            EnvServerStartError, env, log_path)
        server = cls(child, name)
        try:
            server._wait_ready(timeout)
        except BaseException:
            server.stop(term_s=2.0)
            raise
        return server

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self.child.wait_listening(deadline, timeout)
        while True:
            try:
                if self.health(timeout_s=max(min(deadline - time.monotonic(), 5.0), 0.1)):
                    return
                problem = "answers /health as not healthy"
            except OSError as e:
                problem = f"does not answer /health ({e})"
            self.child.check_running(deadline, f"listens on {self.listening_url} but {problem}")
            time.sleep(0.05)

    @property
    def listening_url(self) -> str | None:
        return self.child.address

    @property
    def url(self) -> str:
        """Base URL to connect to (http://host:port; a wildcard bind is reached by loopback)."""
        if self.listening_url is None:
            raise RuntimeError("the server has not announced its address")
        parts = urllib.parse.urlsplit(self.listening_url)
        host = parts.hostname or "127.0.0.1"
        if ipaddress.ip_address(host).is_unspecified:
            host = "::1" if ":" in host else "127.0.0.1"
        return url_for(host, parts.port)

    @property
    def ws_url(self) -> str:
        """The WebSocket session endpoint: ws://host:port/ws."""
        return "ws" + self.url[len("http"):] + "/ws"

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def health(self, timeout_s: float = 5.0) -> bool:
        """Whether GET /health answers healthy (OSError when it does not answer at all)."""
        try:
            with _NO_PROXY.open(f"{self.url}/health", timeout=timeout_s) as response:
                return response.status == 200 and b"healthy" in response.read()
        except urllib.error.HTTPError:
            return False

    def stop(self, term_s: float = 5.0) -> int:
        """Stops the server: SIGTERM, then SIGKILL to its process group; returns its exit code."""
        return self.child.terminate(term_s)

    def __enter__(self) -> EnvServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.alive else f"exited {self.proc.returncode}"
        return f"EnvServerProcess({self.name!r}, url={self.listening_url!r}, pid={self.pid}, {state})"
