"""Rollout requests over two bridges: spread by load, returned in task order, the groups of a bridge
that dies requested again and delivered once, and a clear error when no bridge is left."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import pytest

from bridge.wire import SamplingParams
from jaxrl.run.supervision import BridgesDown
from test_collection import bridges, config, rollout_client  # noqa: F401 (bridges: two in-process bridges, a fixture)


def test_requests_are_spread_over_bridges_and_returned_in_task_order(bridges):
    cfg = config(rollout={"groups_per_step": 6})
    client = rollout_client([a for a, _ in bridges], cfg)
    try:
        calls = [e.calls for _, e in bridges]
        tasks = [("coin", {"seed": s}) for s in range(6)]
        groups = client.request(tasks, [f"g{i}" for i in range(6)], 2, SamplingParams(max_tokens=8), 0)
        assert [g[0].group_id for g in groups] == [f"g{i}" for i in range(6)]
        assert all(len(g) == 2 and [t.index_in_group for t in g] == [0, 1] for g in groups)
        assert [g[0].rewards["env"] for g in groups] == [1.0, 0.0] * 3
        assert all(e.calls > c for (_, e), c in zip(bridges, calls))  # both bridges worked
    finally:
        client.close()


def test_groups_go_to_the_least_loaded_bridge(bridges):
    cfg = config()
    client = rollout_client([a for a, _ in bridges], cfg)
    slow = bridges[0][1]
    params, tasks = SamplingParams(max_tokens=8), [("coin", {"seed": s}) for s in range(4)]
    slow.delay_s = 1.0
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.request, tasks[:2], ["a0", "a1"], 2, params, 0)  # one group each
            deadline = time.monotonic() + 30
            while client.outstanding[1] or not client.outstanding[0]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            t0 = time.monotonic()
            second = client.request(tasks[2:3], ["b0"], 2, params, 0)
            # Round robin would have given it to the first bridge, the slow one: a second at least.
            assert time.monotonic() - t0 < slow.delay_s
            assert [t.group_id for t in second[0]] == ["b0", "b0"]
            assert [g[0].group_id for g in first.result()] == ["a0", "a1"]
    finally:
        slow.delay_s = 0.0
        client.close()


@pytest.mark.parametrize("kind", ["killed", "stopped"])
def test_the_groups_of_a_dead_bridge_are_requested_again_and_delivered_once(bridges, kind, caplog):
    # A killed bridge: a port nothing listens on (found dead by its stream). A stopped one (SIGSTOP):
    # a port that accepts, the kernel completing the handshake, and never answers (found dead by a
    # missed health check, within bridge.health_timeout_s).
    cfg = config(bridge={"health_timeout_s": 1.0})
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        if kind == "stopped":
            other.listen()
        dead = f"127.0.0.1:{other.getsockname()[1]}"
        client = rollout_client([bridges[0][0], dead], cfg)
        try:
            t0 = time.monotonic()
            # Two requests at once (as stream mode makes one a group): the dead bridge cuts a stream of each.
            with caplog.at_level("WARNING", logger="jaxrl.run.rollout_client"), \
                    concurrent.futures.ThreadPoolExecutor(2) as pool:
                requests = [pool.submit(client.request, [("coin", {"seed": s}) for s in seeds],
                                        [f"g{s}" for s in seeds], 2, SamplingParams(max_tokens=8), 0)
                            for seeds in (range(0, 3), range(3, 6))]
                groups = [g for r in requests for g in r.result()]
            took = time.monotonic() - t0
            metrics = client.metrics()
        finally:
            client.close()
    assert took < 3 * cfg.bridge.health_timeout_s
    assert [[(t.group_id, t.index_in_group) for t in g] for g in groups] == [[(f"g{i}", 0), (f"g{i}", 1)]
                                                                           for i in range(6)]
    assert [g[0].rewards["env"] for g in groups] == [1.0, 0.0] * 3
    re_requested = metrics.pop("groups/re_requested")
    assert metrics == {"bridges/alive": 1.0, "bridges/deaths": 1.0, "bridges/restarts": 0.0, "bridges/returned": 0.0}
    assert 2 <= re_requested <= 4  # the groups the dead bridge was given: one at least of each request's three
    assert [r.getMessage() for r in caplog.records if "unfinished" in r.getMessage()] == [
        f"bridge 1 at {dead}: its unfinished groups will be requested again from the other bridges "
        "(groups/re_requested counts them)"]


def test_with_no_bridge_left_past_the_grace_a_request_fails_naming_them(caplog):
    cfg = config(bridge={"health_timeout_s": 1.0, "grace_s": 1.0})
    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{dead.getsockname()[1]}"
        client = rollout_client([address], cfg)
        try:
            t0 = time.monotonic()
            with pytest.raises(BridgesDown) as e, caplog.at_level("WARNING", logger="jaxrl.run.rollout_client"):
                client.request([("coin", {"seed": 0})], ["g0"], 2, SamplingParams(max_tokens=8), 0)
        finally:
            client.close()
    assert 1.0 < time.monotonic() - t0 < 5.0
    assert str(e.value).startswith(f"no bridge left: none has served for 1 s (bridge.grace_s=1); bridge 0 at "
                                   f"{address}: stopped answering (bridge at {address} unavailable during rollout")
    # The run's only bridge: there are no others to ask.
    assert [r.getMessage() for r in caplog.records if "unfinished" in r.getMessage()] == [
        f"bridge 0 at {address}: its unfinished groups will be requested again once it serves again "
        "(groups/re_requested counts them)"]


def test_a_request_stops_as_soon_as_the_run_cannot_go_on(bridges):
    """An environment server left down: the request stops within CHECK_EVERY_S, not when the
    bridge's replays of its episodes run out (retry_budget_s, minutes)."""
    from jaxrl.run.rollout_client import CHECK_EVERY_S
    from jaxrl.run.supervision import EnvServerDown

    given_up = threading.Event()

    def check():
        if given_up.is_set():
            raise EnvServerDown("environment server 'coin' exited 4 times")

    client = rollout_client([bridges[0][0]], config(), check=check)
    slow = bridges[0][1]
    slow.delay_s = 60.0
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            request = pool.submit(client.request, [("coin", {"seed": 0})], ["g"], 2, SamplingParams(max_tokens=8), 0)
            deadline = time.monotonic() + 30
            while not client.outstanding[0]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            given_up.set()
            t0 = time.monotonic()
            with pytest.raises(EnvServerDown, match="exited 4 times"):
                request.result(timeout=30)
            assert time.monotonic() - t0 <= CHECK_EVERY_S + 2
    finally:
        slow.delay_s = 0.0
        client.close()


def test_a_request_under_way_when_the_client_closes_ends_instead_of_waiting_forever(bridges):
    """close() cancels the streams its pool has not started; a request waiting on one must end (a
    thread left waiting keeps the process from exiting: stream mode's suppliers at a run's end)."""
    client = rollout_client([bridges[0][0]], config())
    release = threading.Event()
    busy = [client.pool.submit(release.wait) for _ in range(client.pool._max_workers)]  # every thread taken
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            request = pool.submit(client.request, [("coin", {"seed": 0})], ["g"], 2, SamplingParams(max_tokens=8), 0)
            deadline = time.monotonic() + 30
            while not client.outstanding[0]:  # its stream is submitted, queued behind the busy threads
                assert time.monotonic() < deadline
                time.sleep(0.01)
            client.close()
            with pytest.raises(BridgesDown, match="closed while a request was under way"):
                request.result(timeout=10)
    finally:
        release.set()
        client.close()
