"""The run's child processes: readiness from the listening line, start-up errors, stop by PID and
group; the bridge (clean stops, a killed or frozen bridge, an orphaned one) and bundled environment
servers; and no child left alive however the trainer's interpreter exits."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from bridge.client import BridgeClient, BridgeUnavailable
from bridge.engines.base import SamplingParams
from bridge.wire import BridgeLaunch, ServerSpec
from jaxrl.run.processes import (
    BridgeProcess,
    BridgeStartError,
    ChildServer,
    ChildStartError,
    EnvServerProcess,
    EnvServerStartError,
)
from jaxrl.tiny import build_tiny_model
from processes import gone
from xla_flags import xla_flags


SERVER = textwrap.dedent("""
    import subprocess, sys, time
    print("starting up", file=sys.stderr, flush=True)
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"LISTENING 127.0.0.1:{grandchild.pid}", flush=True)
    time.sleep(600)
""")


def _gone(pid, within_s=30.0):
    """Exited within `within_s` (a zombie counts: an orphan waits for init to reap it)."""
    return _eventually(lambda: gone(pid), within_s)


def _eventually(condition, within_s=30.0):
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


EXITS = {
    "return": "pass",
    "exception": "raise RuntimeError('boom')",
    "sys.exit": "sys.exit(3)",
}


@pytest.mark.parametrize("how", EXITS)
def test_no_child_outlives_the_trainer_however_its_interpreter_exits(how, tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from jaxrl.run.processes import ChildServer
        child = ChildServer([sys.executable, "-c", {SERVER!r}], "test server", "LISTENING ")
        address = child.wait_listening(time.monotonic() + 30, 30)
        print(child.pid, address.rsplit(":", 1)[1], flush=True)
        {EXITS[how]}
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    child, grandchild = map(int, proc.stdout.split())
    assert proc.returncode == {"return": 0, "exception": 1, "sys.exit": 3}[how], proc.stderr
    assert _gone(child) and _gone(grandchild)


def test_listening_line_gives_the_address_and_terminate_ends_the_whole_group():
    child = ChildServer([sys.executable, "-c", SERVER], "test server", "LISTENING ")
    address = child.wait_listening(time.monotonic() + 30, 30)
    grandchild = int(address.rsplit(":", 1)[1])
    # stderr has its own pipe and reader: its line may come in after stdout's LISTENING.
    assert child.alive and _eventually(lambda: "starting up" in child.stderr_tail())
    child.terminate(term_s=0.5)
    assert not child.alive and _gone(child.pid) and _gone(grandchild)


def test_a_child_that_exits_during_start_up_raises_with_its_stderr():
    class OwnError(ChildStartError):
        pass

    child = ChildServer([sys.executable, "-c", "import sys; sys.exit('bad flag --x')"], "test server",
                        "LISTENING ", OwnError)
    with pytest.raises(OwnError, match=r"(?s)test server \(pid \d+\) exited with code 1 during start-up.*bad flag --x"):
        child.wait_listening(time.monotonic() + 30, 30)
    child.terminate()


def test_a_child_that_never_listens_times_out(tmp_path):
    child = ChildServer([sys.executable, "-c", "import time; time.sleep(600)"], "test server",
                        "LISTENING ", log_path=tmp_path / "log")
    with pytest.raises(ChildStartError, match="did not listen within 1 s"):
        child.wait_listening(time.monotonic() + 1, 1)
    assert child.terminate(term_s=1.0) != 0 and _gone(child.pid)


CHILD_ENV = {"XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"), "qwen3", seed=0)


def _start(model_dir, log_path=None, **launch):
    return BridgeProcess.start(BridgeLaunch(model_dir, **launch), env=CHILD_ENV, timeout=120, client_timeout_s=5,
                               log_path=log_path)


def test_a_bridge_that_exits_during_start_up_raises_with_its_stderr(tmp_path):
    start = time.monotonic()
    with pytest.raises(BridgeStartError) as e:
        BridgeProcess.start(BridgeLaunch(tmp_path / "no-model"), env=CHILD_ENV, timeout=60)
    # A configuration it refuses (exit 2): its own error line, whole, is the message's one line.
    assert re.fullmatch(r"bridge \(pid \d+\) refused its configuration: .*not a model directory.*", str(e.value))
    assert time.monotonic() - start < 30


def test_a_taken_port_is_a_start_up_error(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BridgeStartError, match=f"cannot listen on 127.0.0.1:{port}"):
            _start(model_dir, server=ServerSpec(port=port))


def test_stop_asks_for_shutdown_and_the_bridge_exits_cleanly(model_dir, tmp_path):
    log = tmp_path / "bridge.log"
    with _start(model_dir, log_path=log, engine_kwargs={"batch_window_s": 0.01}, cpus=(0,)) as bridge:
        host, port = bridge.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        assert bridge.client.health().engine == "jax"
        pid = bridge.pid
        status = Path(f"/proc/{pid}/status").read_text()
        assert "Cpus_allowed_list:\t0\n" in status  # on the CPU its launch names
        # Its token travels in its environment, not its argv (which `ps` shows to everyone).
        assert bridge.token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert f"JAXRL_BRIDGE_TOKEN={bridge.token}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
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
        client = BridgeClient(bridge.address, timeout_s=5, token=bridge.token)
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
            from bridge.wire import BridgeLaunch
            from jaxrl.run.processes import BridgeProcess
            bridge = BridgeProcess.start(BridgeLaunch({str(model_dir)!r}), env={CHILD_ENV!r}, timeout=120)
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
        client = BridgeClient(bridge.address, timeout_s=3, token=bridge.token)
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


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return all(gone(int(p)) for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == pgid)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_start_on_a_free_port_serves_and_stop_leaves_nothing_running():
    start = time.monotonic()
    with EnvServerProcess.start("guess_number", port=0, max_concurrent_envs=2, seed=3) as server:
        started_s = time.monotonic() - start
        assert server.alive and server.port > 0
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert server.ws_url == f"ws://127.0.0.1:{server.port}/ws"
        assert server.health()
        meta = json.load(urllib.request.urlopen(f"{server.url}/metadata", timeout=10))
        assert meta["name"] == "guess_number"
        pid = server.pid
        assert os.getpgid(pid) == pid  # it leads its own process group
        if sys.platform == "linux":  # it runs no XLA, so it never loads JAX's library
            assert "jaxlib" not in Path(f"/proc/{pid}/maps").read_text()
    assert not server.alive and server.proc.returncode is not None
    assert gone(pid) and _group_gone(pid)
    assert server.stop() == server.proc.returncode  # stopping again is harmless
    with pytest.raises(OSError):
        server.health(timeout_s=2)
    print(f"start-up {started_s:.1f} s")


def test_an_unknown_name_is_a_start_up_error_listing_the_known_ones():
    with pytest.raises(EnvServerStartError, match="exited with code 2") as e:
        EnvServerProcess.start("chess", timeout=60)
    assert "unknown bundled environment 'chess'; known: echo, wordle, guess_number" in str(e.value)


def test_a_taken_port_is_a_start_up_error_with_the_stderr_tail():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(EnvServerStartError, match="exited with code") as e:
            EnvServerProcess.start("echo", port=port, timeout=60)
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in str(e.value)
    assert "Traceback" not in str(e.value)


def test_the_server_exits_when_its_parent_dies_without_stopping_it(tmp_path):
    script = textwrap.dedent("""
        import os
        from jaxrl.run.processes import EnvServerProcess
        server = EnvServerProcess.start("echo", timeout=60)
        print(server.pid, flush=True)
        os._exit(0)  # no atexit, no stop()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 15
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not gone(pid):
        os.kill(pid, 9)  # our own orphan: do not leave it behind
        pytest.fail("the orphaned server kept running")
