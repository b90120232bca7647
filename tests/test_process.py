"""The bridge as a child process: start-up failures, clean stops, and a killed bridge."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from processes import gone
from bridge.client import BridgeClient, BridgeUnavailable
from bridge.engines.base import SamplingParams
from jaxrl.run.processes import BridgeProcess, BridgeStartError
from jaxrl.tiny import build_tiny_model

CHILD_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"), "qwen3", seed=0)


def _start(model_dir, **kw):
    return BridgeProcess.start(model_dir, env=CHILD_ENV, timeout=120, client_timeout_s=5, **kw)


def test_unknown_engine_is_a_one_line_error(model_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl.run.cli", "bridge", "--engine", "tensorrt", "--model", str(model_dir)],
        capture_output=True, text=True, timeout=60, env={**os.environ, **CHILD_ENV},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "jaxrl bridge: error: unknown engine 'tensorrt'; choose one of: jax, vllm"]
    assert "BRIDGE_LISTENING" not in proc.stdout


def test_a_bridge_that_exits_during_start_up_raises_with_its_stderr(tmp_path):
    start = time.monotonic()
    with pytest.raises(BridgeStartError, match="not a model directory") as e:
        BridgeProcess.start(tmp_path / "no-model", env=CHILD_ENV, timeout=60)
    assert "exited with code 2" in str(e.value)
    assert time.monotonic() - start < 30


def test_a_taken_port_is_a_start_up_error(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BridgeStartError, match=f"cannot listen on 127.0.0.1:{port}"):
            _start(model_dir, port=port)


def test_stop_asks_for_shutdown_and_the_bridge_exits_cleanly(model_dir, tmp_path):
    log = tmp_path / "bridge.log"
    with _start(model_dir, log_path=log, engine_kwargs={"batch_window_s": 0.01}) as bridge:
        host, port = bridge.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        assert bridge.client.health().engine == "jax"
        pid = bridge.pid
    assert bridge.proc.returncode == 0
    assert gone(pid)
    text = log.read_text()
    assert "BRIDGE_LISTENING" in text and "shutdown requested" in text


def test_sigterm_stops_the_bridge_cleanly(model_dir):
    bridge = _start(model_dir)
    try:
        os.kill(bridge.pid, signal.SIGTERM)
        assert bridge.proc.wait(timeout=20) == 0
        assert "stopping" in bridge.stderr_tail()
    finally:
        bridge.stop()


def test_a_killed_bridge_is_unavailable_within_the_timeout(model_dir):
    bridge = _start(model_dir)
    try:
        client = BridgeClient(bridge.address, timeout_s=5)
        box = {}

        def stream():
            try:
                for _ in client.rollout([[1, 2, 3]] * 2, 4, SamplingParams(max_tokens=1000)):
                    pass
                box["finished"] = True
            except Exception as e:
                box["error"], box["at"] = e, time.monotonic()

        thread = threading.Thread(target=stream, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while client.stats()["episodes_in_flight"] < 8:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        killed = time.monotonic()
        os.kill(bridge.pid, signal.SIGKILL)
        thread.join(10)
        assert not thread.is_alive(), "the streaming client hangs on a dead bridge"
        assert isinstance(box.get("error"), BridgeUnavailable), box
        assert box["at"] - killed < 5
        t0 = time.monotonic()
        with pytest.raises(BridgeUnavailable, match="unavailable during Health"):
            client.health()
        with pytest.raises(BridgeUnavailable):
            list(client.rollout([[1]], 1, SamplingParams(max_tokens=2)))
        assert time.monotonic() - t0 < 5
        client.close()
    finally:
        assert bridge.stop() == -signal.SIGKILL


def test_the_bridge_exits_when_its_parent_dies(model_dir, tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import time
            from jaxrl.run.processes import BridgeProcess
            bridge = BridgeProcess.start({str(model_dir)!r}, env={CHILD_ENV!r}, timeout=120)
            print(bridge.pid, flush=True)
            time.sleep(600)
        """)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, **CHILD_ENV},
    )
    try:
        bridge_pid = int(parent.stdout.readline())
        assert not gone(bridge_pid)
        parent.kill()  # no chance to stop its bridge
        parent.wait()
        deadline = time.monotonic() + 15
        while not gone(bridge_pid):
            assert time.monotonic() < deadline, "orphaned bridge still running"
            time.sleep(0.1)
    finally:
        parent.kill()
        parent.wait()


def test_a_frozen_bridge_is_unavailable_within_the_timeout(model_dir):
    """A bridge that stops answering (here SIGSTOP) is noticed by keepalive pings, not waited on."""
    bridge = _start(model_dir)
    try:
        client = BridgeClient(bridge.address, timeout_s=3)
        assert client.health().status == "serving"  # a live connection first
        os.kill(bridge.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(BridgeUnavailable):
            list(client.rollout([[1, 2, 3]], 2, SamplingParams(max_tokens=4)))
        with pytest.raises(BridgeUnavailable):
            client.health()
        assert time.monotonic() - t0 < 3 * 3
        client.close()
    finally:
        os.kill(bridge.pid, signal.SIGCONT)
        bridge.stop()
