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

import atexit
import collections
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

from bridge.envs.serve import DEFAULT_MAX_CONCURRENT_ENVS, LISTENING_PREFIX, url_for

_WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local server


class EnvServerStartError(RuntimeError):
    """The environment server exited or did not become ready during start-up."""


class EnvServerProcess:
    def __init__(self, proc: subprocess.Popen, name: str, log_path: Path | None = None,
                 tail_lines: int = 200):
        self.proc = proc
        self.name = name
        self.listening_url: str | None = None
        self._listening = threading.Event()
        self._stderr: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._log = open(log_path, "a", buffering=1) if log_path else None
        self._threads = [
            threading.Thread(target=self._read_stdout, daemon=True, name=f"env-{proc.pid}-stdout"),
            threading.Thread(target=self._read_stderr, daemon=True, name=f"env-{proc.pid}-stderr"),
        ]
        for t in self._threads:
            t.start()

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
        proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})}, text=True, errors="replace", bufsize=1,
            # Its own process group: a terminal's Ctrl-C reaches the trainer, which stops it.
            start_new_session=True,
        )
        server = cls(proc, name, Path(log_path) if log_path else None)
        try:
            server._wait_ready(timeout)
        except BaseException:
            server.stop(term_s=2.0)
            raise
        _live.add(server)
        return server

    # -- start-up -------------------------------------------------------------------------------

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            if self._log:
                self._log.write(line)
            if not self._listening.is_set() and line.startswith(LISTENING_PREFIX):
                self.listening_url = line[len(LISTENING_PREFIX):].strip()
                self._listening.set()

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self._stderr.append(line.rstrip("\n"))
            if self._log:
                self._log.write(line)

    def stderr_tail(self, lines: int = 40) -> str:
        return "\n".join(list(self._stderr)[-lines:])

    def _error(self, what: str) -> EnvServerStartError:
        for t in self._threads:
            t.join(timeout=2.0)  # the rest of its stderr
        return EnvServerStartError(
            f"environment server {self.name!r} (pid {self.proc.pid}) {what}; "
            f"its stderr ends with:\n{self.stderr_tail()}"
        )

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._listening.wait(timeout=0.05):
            if self.proc.poll() is not None:
                raise self._error(f"exited with code {self.proc.returncode} during start-up")
            if time.monotonic() > deadline:
                raise self._error(f"did not listen within {timeout:.0f} s")
        while True:
            try:
                if self.health(timeout_s=max(min(deadline - time.monotonic(), 5.0), 0.1)):
                    return
                problem = "answers /health as not healthy"
            except OSError as e:
                problem = f"does not answer /health ({e})"
            if self.proc.poll() is not None:
                raise self._error(f"exited with code {self.proc.returncode} during start-up")
            if time.monotonic() > deadline:
                raise self._error(f"listens on {self.listening_url} but {problem}")
            time.sleep(0.05)

    # -- running --------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL to connect to (http://host:port; a wildcard bind is reached by loopback)."""
        if self.listening_url is None:
            raise RuntimeError("the server has not announced its address")
        parts = urllib.parse.urlsplit(self.listening_url)
        host = _WILDCARD_HOSTS.get(parts.hostname or "", parts.hostname)
        return url_for(host, parts.port)

    @property
    def ws_url(self) -> str:
        """The WebSocket session endpoint: ws://host:port/ws."""
        return "ws" + self.url[len("http"):] + "/ws"

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def health(self, timeout_s: float = 5.0) -> bool:
        """Whether GET /health answers healthy (OSError when it does not answer at all)."""
        try:
            with _NO_PROXY.open(f"{self.url}/health", timeout=timeout_s) as response:
                return response.status == 200 and b"healthy" in response.read()
        except urllib.error.HTTPError:
            return False

    def stop(self, term_s: float = 5.0) -> int:
        """Stops the server: SIGTERM, then SIGKILL to its process group; returns its exit code."""
        _live.discard(self)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=term_s)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group this child leads
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            self.proc.wait()
        for t in self._threads:
            t.join(timeout=2.0)
        if self._log:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def __enter__(self) -> EnvServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.alive else f"exited {self.proc.returncode}"
        return f"EnvServerProcess({self.name!r}, url={self.listening_url!r}, pid={self.pid}, {state})"


# Servers still running when the interpreter exits are stopped (quickly) on the way out.
_live: weakref.WeakSet[EnvServerProcess] = weakref.WeakSet()


@atexit.register
def _stop_live_servers() -> None:
    for server in list(_live):
        try:
            server.stop(term_s=2.0)
        except Exception:
            pass
