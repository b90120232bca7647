"""An OpenEnv server's session pool against real bundled servers: sessions reused across episodes,
capacity, a killed server, a frozen one (timeouts and the circuit breaker), start-up checks."""

import asyncio
import os
import signal
import socket
import time

import pytest

from bridge.envs.endpoint import Endpoint
from bridge.envs.session import EndpointUnavailable, SessionConfig, SessionLost
from env_servers import echo, freezable, frozen, guess, idle, solve_episode  # noqa: F401 (fixtures)
from jaxrl.run.processes import EnvServerProcess


def test_a_released_session_serves_the_next_episode_unless_reuse_is_off_or_it_was_lost(echo):
    async def episodes(config):
        endpoint = Endpoint(echo.url, config, name="echo")
        try:
            targets = []
            for target in ("first", "second"):
                env = await endpoint.open()
                first = await env.reset(seed=1, target=target)
                targets.append(first["observation"]["target"])
                reply = await env.step({"message": target})
                assert reply["done"] is True and reply["reward"] == 1.0
                assert (await env.state())["step_count"] == 1  # the reset started afresh
                await env.release()
            lost = await endpoint.open()
            lost._ws.transport.abort()  # the connection drops while the session sits released
            await lost.release()
            await asyncio.sleep(0.05)
            again = await endpoint.open()
            await again.reset(seed=2, target="third")
            await again.close()
            return targets, dict(endpoint.metrics)
        finally:
            await endpoint.aclose()

    targets, reused = asyncio.run(episodes(SessionConfig()))
    assert targets == ["first", "second"]
    assert reused["sessions_opened"] == 2 and reused["sessions_reused"] == 2 and reused["sessions_active"] == 0
    _, fresh = asyncio.run(episodes(SessionConfig(reuse=False)))
    assert fresh["sessions_opened"] == 4 and fresh["sessions_reused"] == 0 and fresh["sessions_active"] == 0


def test_a_session_compresses_its_messages_only_when_told_to(echo):
    async def extensions(config):
        endpoint = Endpoint(echo.url, config, name="echo")
        try:
            env = await endpoint.open()
            reply = await env.reset(seed=1, target="x" * 200)
            await env.close()
            return reply["observation"]["target"], [e.name for e in env._ws.protocol.extensions]
        finally:
            await endpoint.aclose()

    assert asyncio.run(extensions(SessionConfig())) == ("x" * 200, [])
    assert asyncio.run(extensions(SessionConfig(compress=True))) == ("x" * 200, ["permessage-deflate"])


# -- capacity ----------------------------------------------------------------------------------


def test_more_episodes_than_server_slots_all_finish(guess, caplog):
    """8 concurrent episodes through a pool of 8 on a server with 2 slots: they wait, not fail; the
    server's stated capacity is kept, and a pool 4x above it is warned of once."""
    async def run():
        endpoint = Endpoint(guess.url, SessionConfig(max_sessions=8), name="guess")
        results = await asyncio.gather(*(solve_episode(endpoint, seed) for seed in range(8)))
        return endpoint, results

    with caplog.at_level("WARNING", logger="bridge.envs.endpoint"):
        endpoint, results = asyncio.run(run())
    assert all(reward == 1.0 for _, reward in results)
    m = endpoint.metrics
    assert m["capacity_waits"] > 0 and m["sessions_opened"] == 8 and idle(endpoint)
    assert m["server_max_sessions"] == 2 and m["pool_wait_s"] > 0 and m["pool_waits"] == 0  # the pool never filled
    assert [r.getMessage() for r in caplog.records] == [
        f"environment server 'guess' ({guess.url}) allows 2 session(s) at once, but the session pool for it holds 8: "
        "episodes queue for its slots (see env/guess/pool_wait_s and capacity_refusals); set max_concurrent_envs: 2 "
        "for this environment, or serve it with more sessions (create_app(..., max_concurrent_envs=N) and "
        "SUPPORTS_CONCURRENT_SESSIONS = True)"]
    assert m["connect_failures"] == m["sessions_lost"] == m["timeouts"] == m["breaker_opens"] == 0
    assert endpoint.breaker_state == "closed"


def test_capacity_wait_gives_up_after_capacity_wait_s(guess):
    async def run():
        holder = Endpoint(guess.url, SessionConfig(max_sessions=2))
        [await holder.open() for _ in range(2)]  # every server slot taken
        try:
            waiter = Endpoint(guess.url, SessionConfig(capacity_wait_s=0.3, capacity_backoff_s=0.05,
                                                      capacity_backoff_max_s=0.1))
            start = time.monotonic()
            with pytest.raises(EndpointUnavailable, match="stayed at capacity .* max_concurrent_envs"):
                await waiter.open()
            assert time.monotonic() - start < 2.0
            assert waiter.metrics["capacity_waits"] >= 2 and idle(waiter)
            assert waiter.breaker_state == "closed"  # capacity is not a failure
        finally:
            await holder.aclose()
        assert idle(holder)

    asyncio.run(run())



def test_a_session_released_while_others_connect_serves_them_at_capacity(guess):
    """The server's last slot is held by a session that goes back to the pool while two more
    episodes are still connecting: they find it there instead of asking the full server until
    capacity_wait_s (the 600 s stall of a capacity-1 server)."""
    async def run():
        other_client = Endpoint(guess.url, SessionConfig(max_sessions=1))
        await other_client.open()  # the server has one slot left
        endpoint = Endpoint(guess.url, SessionConfig(max_sessions=8, capacity_wait_s=5, capacity_backoff_s=0.05,
                                                     capacity_backoff_max_s=0.1))
        try:
            first = await endpoint.open()
            await first.reset(seed=0)
            connecting = [asyncio.create_task(solve_episode(endpoint, seed)) for seed in (1, 2)]
            await asyncio.sleep(0)  # both now wait on their WebSocket handshakes, not on the pool
            await first.release()
            start = time.monotonic()
            results = await asyncio.gather(*connecting)
            return results, time.monotonic() - start, dict(endpoint.metrics)
        finally:
            await endpoint.aclose()
            await other_client.aclose()

    results, wall_s, m = asyncio.run(run())
    assert [reward for _, reward in results] == [1.0, 1.0]
    # One took the released session; the other the server slot its close freed.
    assert wall_s < 3.0 and m["sessions_reused"] == 1 and m["sessions_opened"] == 2 and m["sessions_active"] == 0

# -- a killed server ---------------------------------------------------------------------------


def test_a_killed_server_loses_its_sessions_and_no_other(echo):
    with EnvServerProcess.start("echo", max_concurrent_envs=4) as doomed:
        async def run():
            victim, other = Endpoint(doomed.url), Endpoint(echo.url)
            sessions = [await victim.open() for _ in range(3)]
            for s in sessions:
                await s.reset(seed=1)
            async with other.session() as survivor:
                await survivor.reset(seed=2)
                os.kill(doomed.pid, signal.SIGKILL)
                start = time.monotonic()
                lost = await asyncio.gather(*(s.step({"message": "x"}) for s in sessions),
                                            return_exceptions=True)
                lost_s = time.monotonic() - start
                assert all(isinstance(e, SessionLost) for e in lost), lost
                assert "restart it from reset()" in str(lost[0])
                assert (await survivor.step({"message": "x"}))["done"] is True
            # Its sessions can drop before its listening socket closes: connect once it has exited.
            await asyncio.to_thread(doomed.wait, 10.0)
            with pytest.raises(EndpointUnavailable, match="cannot connect .*ConnectionRefused"):
                await victim.open()
            assert all(s.closed for s in sessions) and idle(victim)
            assert victim.metrics["sessions_lost"] == 3 and victim.metrics["connect_failures"] == 1
            assert other.metrics["sessions_lost"] == 0
            return lost_s

        assert asyncio.run(run()) < 1.0


# -- a frozen server ---------------------------------------------------------------------------


def test_a_frozen_server_times_out_opens_the_breaker_and_recovers(freezable):
    config = SessionConfig(max_sessions=4, connect_timeout_s=0.5, step_timeout_s=0.5,
                           breaker_failures=3, breaker_cooldown_s=1.0)

    async def run():
        endpoint = Endpoint(freezable.url, config)
        sessions = [await endpoint.open() for _ in range(3)]
        for s in sessions:
            await s.reset(seed=1)
        with frozen(freezable):
            start = time.monotonic()
            lost = await asyncio.gather(*(s.step({"message": "x"}) for s in sessions),
                                        return_exceptions=True)
            assert all(isinstance(e, SessionLost) for e in lost), lost
            assert "no reply to step within 0.5 s" in str(lost[0])
            assert time.monotonic() - start < 1.5
            assert endpoint.breaker_state == "open" and endpoint.metrics["breaker_opens"] == 1
            # Open: nothing is attempted until the cooldown has passed; then one trial session goes
            # (and fails: still frozen), and a caller waiting for it shares its outcome.
            start = time.monotonic()
            failed = await asyncio.gather(endpoint.open(), endpoint.open(), return_exceptions=True)
            waited = time.monotonic() - start
            assert all(isinstance(e, EndpointUnavailable) for e in failed), failed
            trial, waiter = sorted(map(str, failed), key=lambda m: "trial session failed" in m)
            assert "cannot connect" in trial and "no answer within 0.5 s" in trial
            assert "circuit breaker open" in waiter and "the trial session failed too" in waiter
            assert config.breaker_cooldown_s - 0.1 < waited < config.breaker_cooldown_s + 1.0
            assert endpoint.breaker_state == "open" and endpoint.metrics["timeouts"] == 4
        # Thawed: the next trial succeeds after the cooldown and the caller waiting for it goes ahead.
        sessions = await asyncio.gather(endpoint.open(), endpoint.open())
        assert endpoint.breaker_state == "closed" and endpoint.metrics["breaker_opens"] == 1
        for env in sessions:
            await env.reset(seed=2)
            assert (await env.step({"message": "x"}))["done"] is True
            await env.close()
        assert idle(endpoint) and endpoint.metrics["sessions_lost"] == 3
        assert endpoint.metrics["timeouts"] == 4

    asyncio.run(run())


# -- start-up checks ---------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_check_fails_fast_on_an_unreachable_server(echo):
    url = f"http://127.0.0.1:{free_port()}"

    async def run():
        await Endpoint(echo.url).check()
        endpoint = Endpoint(url)
        start = time.monotonic()
        with pytest.raises(EndpointUnavailable, match=f"{url}.*GET /health failed.*ConnectError"):
            await endpoint.check()
        with pytest.raises(EndpointUnavailable, match=f"cannot connect .*{url}"):
            await endpoint.open()
        assert time.monotonic() - start < 2.0 and idle(endpoint)

    asyncio.run(run())
