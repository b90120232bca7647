"""Child servers: readiness from the listening line, start-up errors, stop by PID and group."""

import os
import sys
import textwrap
import time

import pytest

from jaxrl.run.processes import ChildServer, ChildStartError

SERVER = textwrap.dedent("""
    import subprocess, sys, time
    print("starting up", file=sys.stderr, flush=True)
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"LISTENING 127.0.0.1:{grandchild.pid}", flush=True)
    time.sleep(600)
""")


def _gone(pid, within_s=5.0):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_listening_line_gives_the_address_and_terminate_ends_the_whole_group():
    child = ChildServer([sys.executable, "-c", SERVER], "test server", "LISTENING ")
    address = child.wait_listening(time.monotonic() + 30, 30)
    grandchild = int(address.rsplit(":", 1)[1])
    assert child.alive and "starting up" in child.stderr_tail()
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
