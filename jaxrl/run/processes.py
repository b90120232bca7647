"""Child processes of a run: the bridge (`python -m bridge serve`) and bundled environment
servers (`python -m bridge env serve NAME`), each started in its own process group, ready once
it prints its listening line and answers its health check, stopped by PID (never by name).

A child that exits (or never gets ready) during start-up raises a `ChildStartError` subclass
with the tail of its stderr. Every child watches its parent and exits if the parent dies
without stopping it; children still running when this interpreter exits are stopped on the way
out (normal return, exception or `sys.exit`).

    with EnvServerProcess.start("wordle", max_concurrent_envs=16) as server:
        ...  # sessions over server.ws_url

A run's bridges are held by `BridgeProcesses`, which starts them all at once, restarts one as
it was, and relaunches them all on another model (a LoRA run's warm-started base). Keeping
children serving (when to restart, when to give up) is `jaxrl.run.supervision`'s.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import dataclasses
import ipaddress
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

from bridge.client import BridgeClient, BridgeError, BridgeUnavailable
from bridge.wire import BRIDGE_LISTENING, ENV_LISTENING, TOKEN_ENV, BridgeLaunch

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local servers
log = logging.getLogger(__name__)


# `jaxrl bridge: error: ...`, `serve: error: ...` (argparse): not a log line that quotes one.
_CLI_ERROR = re.compile(r"^(?:jaxrl )?[\w.-]+: error: (.+)$")


def exit_words(code: int) -> str:
    """How a child with return code `code` ended, one wording for every child: "exited with code 1",
    "was killed by SIGKILL" (a negative code is the signal)."""
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


class ChildStartError(RuntimeError):
    """The child exited or did not become ready during start-up."""


class BridgeStartError(ChildStartError):
    """The bridge process exited or did not become healthy during start-up."""


class EnvServerStartError(ChildStartError):
    """The environment server exited or did not become ready during start-up."""


class ChildServer:
    def __init__(self, args: Sequence[str], label: str, listening_prefix: str,
                 error_cls: type[ChildStartError] = ChildStartError,
                 env: Mapping[str, str] | None = None, log_path: str | Path | None = None,
                 tail_lines: int = 200):
        self.label, self.error_cls, self.listening_prefix = label, error_cls, listening_prefix
        self.log_path = None if log_path is None else str(log_path)
        self.address: str | None = None
        self._listening = threading.Event()
        self._stderr: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._log = open(log_path, "a", buffering=1) if log_path else None
        self.proc = subprocess.Popen(
            list(args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})}, text=True, errors="replace", bufsize=1,
            # Its own process group: a terminal's Ctrl-C reaches the trainer, which stops it.
            start_new_session=True,
        )
        self._threads = [
            threading.Thread(target=self._read_stdout, daemon=True, name=f"{label}-{self.pid}-stdout"),
            threading.Thread(target=self._read_stderr, daemon=True, name=f"{label}-{self.pid}-stderr"),
        ]
        for t in self._threads:
            t.start()
        _live.add(self)

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            if self._log:
                self._log.write(line)
            if not self._listening.is_set() and line.startswith(self.listening_prefix):
                self.address = line[len(self.listening_prefix):].strip()
                self._listening.set()

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self._stderr.append(line.rstrip("\n"))
            if self._log:
                self._log.write(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr_tail(self, lines: int = 40) -> str:
        return "\n".join(list(self._stderr)[-lines:])

    def start_error(self, what: str) -> ChildStartError:
        for t in self._threads:
            t.join(timeout=2.0)  # the rest of its stderr
        refusal = self._refusal()
        if refusal:  # its own one-line error is the first line the console shows, not a log tail
            return self.error_cls(f"{self.label} (pid {self.pid}) refused its configuration: {refusal}")
        return self.error_cls(f"{self.label} (pid {self.pid}) {what}; its stderr ends with:\n{self.stderr_tail()}")

    def _refusal(self) -> str | None:
        """The error of a child that exited with code 2 (a usage or configuration error) after
        printing `PROG: error: WHAT`, as our CLIs and argparse do: WHAT."""
        if self.proc.poll() != 2:
            return None
        for line in reversed(self._stderr):
            if match := _CLI_ERROR.match(line):
                return match.group(1)
        return None

    def check_running(self, deadline: float, waiting_for: str) -> None:
        """Raises the start error if the child has exited or the deadline has passed."""
        if self.proc.poll() is not None:
            raise self.start_error(f"{exit_words(self.proc.returncode)} during start-up")
        if time.monotonic() > deadline:
            raise self.start_error(waiting_for)

    def wait_listening(self, deadline: float, timeout: float) -> str:
        while not self._listening.wait(timeout=0.05):
            self.check_running(deadline, f"did not listen within {timeout:.0f} s")
        return self.address

    def wait(self, seconds: float) -> None:
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self, term_s: float = 5.0) -> int:
        """SIGTERM, then SIGKILL to the child's process group; returns its exit code.

        The group is killed even when the child itself ended: workers it started must not outlive it.
        """
        _live.discard(self)
        if self.proc.poll() is None:
            self.proc.terminate()
            self.wait(term_s)
        try:
            os.killpg(self.pid, signal.SIGKILL)  # the group this child leads (start_new_session)
        except (ProcessLookupError, PermissionError):
            if self.proc.poll() is None:
                self.proc.kill()
        self.proc.wait()
        for t in self._threads:
            t.join(timeout=2.0)
        if self._log:
            self._log.close()
            self._log = None
        return self.proc.returncode


# Children still running when the interpreter exits are stopped (quickly) on the way out.
_live: weakref.WeakSet[ChildServer] = weakref.WeakSet()


@atexit.register
def _stop_live_children() -> None:
    for child in list(_live):
        try:
            child.terminate(term_s=2.0)
        except Exception:
            pass


class ChildHandle:
    """What the launchers share: the child's PID, liveness, exit and logs; a context manager."""

    child: ChildServer

    @property
    def pid(self) -> int:
        return self.child.pid

    @property
    def alive(self) -> bool:
        return self.child.alive

    @property
    def exit_code(self) -> int | None:
        """None while it runs."""
        return self.child.proc.poll()

    def exit_words(self) -> str | None:
        """How it ended (`exit_words`); None while it runs."""
        code = self.exit_code
        return None if code is None else exit_words(code)

    @property
    def log_path(self) -> str | None:
        """The file its output is appended to, if any."""
        return self.child.log_path

    def wait(self, seconds: float) -> None:
        """Until it exits, at most `seconds`."""
        self.child.wait(seconds)

    def stderr_tail(self, lines: int = 40) -> str:
        return self.child.stderr_tail(lines)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _bridge_module_args(python: str | None, *args: str) -> list[str]:
    return [python or sys.executable, "-m", "bridge", *args, "--parent-pid", str(os.getpid())]


class BridgeProcess(ChildHandle):
    def __init__(self, child: ChildServer, token: str):
        self.child = child
        self.proc = child.proc
        self.token = token
        self.client: BridgeClient | None = None

    @classmethod
    def start(cls, launch: BridgeLaunch, env: Mapping[str, str] | None = None, timeout: float = 300.0,
              client_timeout_s: float = 60.0, log_path: str | Path | None = None, python: str | None = None,
              token: str | None = None) -> BridgeProcess:
        """Starts a bridge as `launch` says and returns once it answers Health (raises
        BridgeStartError otherwise).

        The launch travels as a JSON file only its owner reads, removed once the bridge has started;
        the bridge requires `token` (default: a fresh one, `.token`), handed over in its environment,
        never its argv (which `ps` shows). `env` entries are added to this process's environment for
        the child. The child's stderr (its log) is kept (`stderr_tail`) and, with `log_path`,
        appended to that file.
        """
        token = token or secrets.token_urlsafe(32)
        fd, launch_file = tempfile.mkstemp(prefix="bridge-launch-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(launch.to_json())
            args = _bridge_module_args(python, "serve", "--launch", launch_file)
            child = ChildServer(args, "bridge", BRIDGE_LISTENING, BridgeStartError, {**(env or {}), TOKEN_ENV: token},
                                log_path)
            bridge = cls(child, token)
            try:
                bridge._wait_ready(timeout, client_timeout_s)
            except BaseException:
                bridge.stop(grace_s=0.0)
                raise
        finally:
            os.unlink(launch_file)
        return bridge

    def _wait_ready(self, timeout: float, client_timeout_s: float) -> None:
        deadline = time.monotonic() + timeout
        self.client = BridgeClient(self.child.wait_listening(deadline, timeout), timeout_s=client_timeout_s,
                                   token=self.token)
        while True:
            try:
                self.client.health(timeout_s=max(min(deadline - time.monotonic(), 5.0), 0.1))
                return
            except BridgeUnavailable as e:
                self.child.check_running(deadline, f"listens on {self.address} but is not healthy ({e})")
                time.sleep(0.1)
            except BridgeError as e:  # it answers, but refuses: waiting will not change that
                raise self.child.start_error(f"refuses its health check ({e})") from None

    @property
    def address(self) -> str | None:
        return self.child.address

    def stop(self, grace_s: float = 10.0, term_s: float = 5.0) -> int:
        """Stops the bridge: Shutdown, then SIGTERM, then SIGKILL (by PID); returns its exit code."""
        if self.alive and self.client is not None and grace_s > 0:
            try:
                self.client.shutdown(timeout_s=min(grace_s, 5.0))
            except BridgeError:
                pass
            self.child.wait(grace_s)
        code = self.child.terminate(term_s)
        if self.client is not None:
            self.client.close()
        return code


class BridgeProcesses:
    """The bridges a run started, each kept with the arguments it was started with, so that
    `restart(i)` starts bridge i again as it was. A context manager: leaving it stops every bridge
    (a restart under way included)."""

    def __init__(self):
        self.bridges: list[BridgeProcess] = []
        self._kwargs: list[dict] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._launching: list[threading.Lock] = []  # by bridge: its restart and a relaunch do not overlap

    def start(self, kwargs: Sequence[Mapping]) -> list[BridgeProcess]:
        """Starts one bridge per `BridgeProcess.start` arguments in `kwargs`, all at once; if one
        fails, the others are stopped and its BridgeStartError raised."""
        started = self._start_all(kwargs)
        with self._lock:
            self.bridges += started
            self._kwargs += [dict(kw) for kw in kwargs]
            self._launching += [threading.Lock() for _ in kwargs]
        return started

    @staticmethod
    def _start_all(kwargs: Sequence[Mapping]) -> list[BridgeProcess]:
        with concurrent.futures.ThreadPoolExecutor(len(kwargs), thread_name_prefix="bridge-start") as pool:
            futures = [pool.submit(BridgeProcess.start, **kw) for kw in kwargs]
            concurrent.futures.wait(futures)
        started = [f.result() for f in futures if f.exception() is None]
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            for bridge in started:
                bridge.stop(grace_s=0.0)
            raise failed[0]
        return started

    def restart(self, i: int) -> BridgeProcess | None:
        """Bridge i stopped (by PID: it may be hung rather than gone) and started again on a fresh
        port (raises BridgeStartError like `start`); None when the bridges are stopping."""
        with self._launching[i]:
            self.bridges[i].stop(grace_s=0.0, term_s=1.0)
            if self._stopping.is_set():
                return None
            fresh = BridgeProcess.start(**self._kwargs[i])
            with self._lock:
                if self._stopping.is_set():
                    fresh.stop(grace_s=0.0)
                    return None
                self.bridges[i] = fresh
            return fresh

    def relaunch(self, model: Path) -> list[BridgeProcess]:
        """Every bridge stopped and started again, all at once, on the model directory `model`, their
        launch otherwise as it was (a LoRA launch's adapter config names `model` as its base);
        `restart` starts them on it from now on. Raises BridgeStartError like `start`."""
        with contextlib.ExitStack() as held:
            for lock in self._launching:  # a restart under way finishes first
                held.enter_context(lock)
            for kw in self._kwargs:
                launch = kw["launch"]
                lora = None if launch.lora is None else {**launch.lora, "base_model_name_or_path": str(model)}
                kw["launch"] = dataclasses.replace(launch, model=str(model), lora=lora)
            for bridge in self.bridges:
                bridge.stop()
            started = self._start_all(self._kwargs)
            with self._lock:
                if self._stopping.is_set():
                    for bridge in started:
                        bridge.stop(grace_s=0.0)
                else:
                    self.bridges = started
            return started

    def __enter__(self) -> BridgeProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            bridges = list(self.bridges)
        for bridge in bridges:
            bridge.stop()


class EnvServerProcess(ChildHandle):
    def __init__(self, child: ChildServer, name: str, start_kwargs: dict):
        self.child = child
        self.proc = child.proc
        self.name = name
        self.start_kwargs = start_kwargs  # what `restart` starts it again with

    @classmethod
    def start(
        cls,
        name: str,
        port: int = 0,
        host: str = "127.0.0.1",
        max_concurrent_envs: int = 64,
        seed: int = 0,
        timeout: float = 120.0,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | Path | None = None,
        python: str | None = None,
    ) -> EnvServerProcess:
        """Starts `python -m bridge env serve name` and returns once it answers /health.

        Raises EnvServerStartError (with the child's stderr tail) if the child exits or is not
        ready within `timeout` seconds. `env` entries are added to this process's environment
        for the child; with `log_path` the child's output is appended to that file.
        """
        args = _bridge_module_args(python, "env", "serve", name, "--host", host, "--port", str(port),
                                   "--max-concurrent-envs", str(max_concurrent_envs), "--seed", str(seed),
                                   *extra_args)
        child = ChildServer(args, f"environment server {name!r}", ENV_LISTENING, EnvServerStartError, env, log_path)
        server = cls(child, name, dict(host=host, max_concurrent_envs=max_concurrent_envs, seed=seed, timeout=timeout,
                                       env=env, extra_args=extra_args, log_path=log_path, python=python))
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
        return f"http://[{host}]:{parts.port}" if ":" in host else f"http://{host}:{parts.port}"

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

    def restart(self) -> EnvServerProcess:
        """This (exited) server started again as it was, on the port it listened on; the old one's
        process group is stopped first. Raises EnvServerStartError like `start`."""
        port = self.port
        self.stop(term_s=1.0)
        return EnvServerProcess.start(self.name, port=port, **self.start_kwargs)

    def __repr__(self) -> str:
        state = "running" if self.alive else f"exited {self.proc.returncode}"
        return f"EnvServerProcess({self.name!r}, url={self.listening_url!r}, pid={self.pid}, {state})"
