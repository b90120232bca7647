"""Bundled environment servers as child processes: start, stop, and start-up failures."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from processes import gone
from jaxrl.run.processes import EnvServerProcess, EnvServerStartError
from jaxrl.run.cli import main as cli_main


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


def test_the_cli_rejects_bad_arguments_in_one_line(capsys):
    assert cli_main(["env", "serve", "chess"]) == 2
    assert capsys.readouterr().err.strip() == (
        "jaxrl env serve: error: unknown bundled environment 'chess'; known: echo, wordle, guess_number")
    assert cli_main(["env", "serve", "echo", "--max-concurrent-envs", "0"]) == 2
    assert "--max-concurrent-envs must be at least 1" in capsys.readouterr().err


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
