"""Runs a bridge as a child process: `python -m jaxrl.cli bridge ...`.

`BridgeProcess.start` waits for the child's `BRIDGE_LISTENING host:port` line and a Health
answer; a child that exits during start-up raises `BridgeStartError` with the tail of its
stderr. `stop` asks for Shutdown, then terminates and finally kills the child by its PID (its
own process group, which also holds any workers the engine started). The child watches its
parent and exits if the parent dies without stopping it.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

from bridge.client import BridgeClient, BridgeError

LISTENING_PREFIX = "BRIDGE_LISTENING "


class BridgeStartError(RuntimeError):
    """The bridge process exited or did not become healthy during start-up."""


class BridgeProcess:
    def __init__(self, proc: subprocess.Popen, log_path: Path | None = None, tail_lines: int = 200):
        self.proc = proc
        self.address: str | None = None
        self.client: BridgeClient | None = None
        self._listening = threading.Event()
        self._stderr: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._log = open(log_path, "a", buffering=1) if log_path else None
        self._threads = [
            threading.Thread(target=self._read_stdout, daemon=True, name=f"bridge-{proc.pid}-stdout"),
            threading.Thread(target=self._read_stderr, daemon=True, name=f"bridge-{proc.pid}-stderr"),
        ]
        for t in self._threads:
            t.start()

    @classmethod
    def start(
        cls,
        model: str | Path,
        engine: str = "jax",
        dtype: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_batch: int | None = None,
        seed: int | None = None,
        engine_kwargs: Mapping | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        timeout: float = 300.0,
        client_timeout_s: float = 60.0,
        log_path: str | Path | None = None,
        python: str | None = None,
    ) -> BridgeProcess:
        """Starts a bridge and returns once it answers Health (raises BridgeStartError otherwise).

        `engine_kwargs` go to the engine (for vllm: `vllm.LLM` arguments such as
        gpu_memory_utilization; for jax: JaxEngine arguments such as batch_window_s).
        `env` entries are added to this process's environment for the child. The child's stderr
        (its log) is kept (`stderr_tail`) and, with `log_path`, appended to that file.
        """
        args = [python or sys.executable, "-m", "jaxrl.cli", "bridge", "--engine", engine,
                "--model", str(model), "--host", host, "--port", str(port), "--parent-pid", str(os.getpid())]
        if dtype:
            args += ["--dtype", dtype]
        if max_batch:
            args += ["--max-batch", str(max_batch)]
        if seed is not None:
            args += ["--seed", str(seed)]
        if engine_kwargs:
            args += ["--engine-kwargs", json.dumps(dict(engine_kwargs))]
        args += list(extra_args)
        child_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=child_env, text=True, errors="replace", bufsize=1,
            # Its own process group: a terminal's Ctrl-C reaches the trainer, which stops it.
            start_new_session=True,
        )
        bridge = cls(proc, Path(log_path) if log_path else None)
        try:
            bridge._wait_ready(timeout, client_timeout_s)
        except BaseException:
            bridge.stop(grace_s=0.0)
            raise
        _live.add(bridge)
        return bridge

    # -- start-up -------------------------------------------------------------------------------

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            if self._log:
                self._log.write(line)
            if not self._listening.is_set() and line.startswith(LISTENING_PREFIX):
                self.address = line[len(LISTENING_PREFIX):].strip()
                self._listening.set()

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self._stderr.append(line.rstrip("\n"))
            if self._log:
                self._log.write(line)

    def stderr_tail(self, lines: int = 40) -> str:
        return "\n".join(list(self._stderr)[-lines:])

    def _exited_error(self, what: str) -> BridgeStartError:
        for t in self._threads:
            t.join(timeout=2.0)  # the rest of its stderr
        return BridgeStartError(
            f"bridge (pid {self.proc.pid}) {what}; its stderr ends with:\n{self.stderr_tail()}"
        )

    def _wait_ready(self, timeout: float, client_timeout_s: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._listening.wait(timeout=0.1):
            if self.proc.poll() is not None:
                raise self._exited_error(f"exited with code {self.proc.returncode} during start-up")
            if time.monotonic() > deadline:
                raise self._exited_error(f"did not listen within {timeout:.0f} s")
        self.client = BridgeClient(self.address, timeout_s=client_timeout_s)
        while True:
            try:
                self.client.health(timeout_s=max(min(deadline - time.monotonic(), 5.0), 0.1))
                return
            except BridgeError as e:
                if self.proc.poll() is not None:
                    raise self._exited_error(f"exited with code {self.proc.returncode} during start-up")
                if time.monotonic() > deadline:
                    raise self._exited_error(f"listens on {self.address} but is not healthy ({e})")
                time.sleep(0.1)

    # -- running --------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 10.0, term_s: float = 5.0) -> int:
        """Stops the bridge: Shutdown, then SIGTERM, then SIGKILL (by PID); returns its exit code."""
        _live.discard(self)
        if self.proc.poll() is None and self.client is not None and grace_s > 0:
            try:
                self.client.shutdown(timeout_s=min(grace_s, 5.0))
            except BridgeError:
                pass
            self._wait(grace_s)
        if self.proc.poll() is None:
            self.proc.terminate()
            self._wait(term_s)
        if self.proc.poll() is None:
            self._kill_group()
            self.proc.wait()
        if self.client is not None:
            self.client.close()
        for t in self._threads:
            t.join(timeout=2.0)
        if self._log:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def _wait(self, seconds: float) -> None:
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            pass

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this child leads (start_new_session)
        except (ProcessLookupError, PermissionError):
            self.proc.kill()

    def __enter__(self) -> BridgeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# Bridges still running when the interpreter exits are stopped (quickly) on the way out.
_live: weakref.WeakSet[BridgeProcess] = weakref.WeakSet()


@atexit.register
def _stop_live_bridges() -> None:
    for bridge in list(_live):
        try:
            bridge.stop(grace_s=2.0, term_s=2.0)
        except Exception:
            pass
