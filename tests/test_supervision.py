"""Keeping children serving: the restart window, and bundled environment servers restarted on
their port until they keep dying. (Bridges: tests/test_rollout_client.py, and the bridge faults
of tests/test_train.py.)"""

import os
import signal
import time
import types

import pytest

from jaxrl.run import supervision
from jaxrl.run.supervision import EnvServerDown, EnvServers, RestartWindow
from processes import gone


def test_the_window_allows_max_restarts_then_none_until_the_oldest_leaves_it(monkeypatch):
    now = [1000.0]  # the window's own clock: a stalled test process must not age its restarts out
    monkeypatch.setattr(supervision, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    window = RestartWindow(max_restarts=2, window_s=0.5)
    assert window.allow() and window.allow() and not window.allow()
    now[0] += 0.6
    assert window.allow()
    assert not RestartWindow(max_restarts=0).allow()


def test_a_server_that_dies_is_restarted_on_its_port_until_it_keeps_dying(tmp_path):
    log = tmp_path / "env-e.log"
    with EnvServers(max_restarts=1, window_s=600.0) as servers:
        first = servers.start("e", "echo", max_concurrent_envs=2, log_path=log)
        assert servers.metrics() == {"env/e/restarts": 0.0}
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while servers.restarts["e"] < 1:
            assert time.monotonic() < deadline, "not restarted"
            time.sleep(0.1)
        second = servers.servers["e"]
        assert second.pid != first.pid and second.url == first.url and second.health()  # the bridge's url
        servers.check()  # within the cap
        assert servers.metrics() == {"env/e/restarts": 1.0}
        os.kill(second.pid, signal.SIGKILL)  # a second exit within the window: it keeps dying
        while servers.error is None:
            assert time.monotonic() < deadline, "not given up"
            time.sleep(0.1)
        with pytest.raises(EnvServerDown, match=f"environment server 'e' .*exited 2 times within 600 s.*not "
                                                f"restarted again: see its log {log}"):
            servers.check()
        time.sleep(0.5)
        assert servers.servers["e"] is second and not second.alive and servers.restarts["e"] == 1
    assert log.read_text().count("ENV_LISTENING") == 2  # the restarted server appends to the same log
    assert gone(first.pid) and gone(second.pid)
