"""Runs a bridge as a child process: `python -m jaxrl.cli bridge ...`.

`BridgeProcess.start` waits for the child's `BRIDGE_LISTENING host:port` line and a Health
answer; a child that exits during start-up raises `BridgeStartError` with the tail of its
stderr. `stop` asks for Shutdown, then terminates and finally kills the child by its PID (its
own process group, which also holds any workers the engine started). The child watches its
parent and exits if the parent dies without stopping it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from bridge.child import ChildHandle, ChildServer, ChildStartError
from bridge.client import BridgeClient, BridgeError

LISTENING_PREFIX = "BRIDGE_LISTENING "


class BridgeStartError(ChildStartError):
    """The bridge process exited or did not become healthy during start-up."""


class BridgeProcess(ChildHandle):
    def __init__(self, child: ChildServer):
        self.child = child
        self.proc = child.proc
        self.client: BridgeClient | None = None

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
        envs_file: str | Path | None = None,
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
        `envs_file`: the environments to serve (`bridge.envs.episode.runtime_from_dict`'s JSON).
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
        if envs_file:
            args += ["--envs", str(envs_file)]
        args += list(extra_args)
        bridge = cls(ChildServer(args, "bridge", LISTENING_PREFIX, BridgeStartError, env, log_path))
        try:
            bridge._wait_ready(timeout, client_timeout_s)
        except BaseException:
            bridge.stop(grace_s=0.0)
            raise
        return bridge

    def _wait_ready(self, timeout: float, client_timeout_s: float) -> None:
        deadline = time.monotonic() + timeout
        self.client = BridgeClient(self.child.wait_listening(deadline, timeout), timeout_s=client_timeout_s)
        while True:
            try:
                self.client.health(timeout_s=max(min(deadline - time.monotonic(), 5.0), 0.1))
                return
            except BridgeError as e:
                self.child.check_running(deadline, f"listens on {self.address} but is not healthy ({e})")
                time.sleep(0.1)

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

    def __enter__(self) -> BridgeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
