"""A server run as a child process: started in its own process group, ready once it prints its
listening line, stopped by PID (SIGTERM, then SIGKILL to its group), never by name.

The bridge and the environment servers both run this way; their wrappers add the readiness
check of their protocol (gRPC Health, HTTP /health).
"""

from __future__ import annotations

import atexit
import collections
import os
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path


class ChildStartError(RuntimeError):
    """The child exited or did not become ready during start-up."""


class ChildServer:
    def __init__(self, args: Sequence[str], label: str, listening_prefix: str,
                 error_cls: type[ChildStartError] = ChildStartError,
                 env: Mapping[str, str] | None = None, log_path: str | Path | None = None,
                 tail_lines: int = 200):
        self.label, self.error_cls, self.listening_prefix = label, error_cls, listening_prefix
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
        return self.error_cls(f"{self.label} (pid {self.pid}) {what}; its stderr ends with:\n{self.stderr_tail()}")

    def check_running(self, deadline: float, waiting_for: str) -> None:
        """Raises the start error if the child has exited or the deadline has passed."""
        if self.proc.poll() is not None:
            raise self.start_error(f"exited with code {self.proc.returncode} during start-up")
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

class ChildHandle:
    """What the launchers built on ChildServer share: the child's PID, liveness and log tail."""

    child: ChildServer

    @property
    def pid(self) -> int:
        return self.child.pid

    @property
    def alive(self) -> bool:
        return self.child.alive

    def stderr_tail(self, lines: int = 40) -> str:
        return self.child.stderr_tail(lines)


def _stop_live_children() -> None:
    for child in list(_live):
        try:
            child.terminate(term_s=2.0)
        except Exception:
            pass
