"""OpenEnv WebSocket sessions against real bundled servers: round trips, errors, capacity,
a killed server, a frozen one (timeouts and the circuit breaker), pings, start-up checks."""

import asyncio
import contextlib
import os
import signal
import socket
import time

import pytest

from bridge.envs.bundled import get
from jaxrl.run.processes import EnvServerProcess
from bridge.envs.session import (
    Endpoint, EndpointUnavailable, EnvServerError, SessionConfig, SessionLost, backoff_s,
)

SOLVE = get("guess_number").solve  # imports OpenEnv now, not inside a timed event loop


@pytest.fixture(scope="module")
def echo():
    with EnvServerProcess.start("echo", max_concurrent_envs=8) as server:
        yield server


@pytest.fixture(scope="module")
def guess():
    """Two sessions at most: the capacity test runs more episodes than that."""
    with EnvServerProcess.start("guess_number", max_concurrent_envs=2) as server:
        yield server


@pytest.fixture(scope="module")
def freezable():
    """A server the tests SIGSTOP (and always SIGCONT): a frozen server, not a dead one."""
    with EnvServerProcess.start("echo", max_concurrent_envs=8) as server:
        yield server


@contextlib.contextmanager
def frozen(server):
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


async def solve_episode(endpoint, seed):
    """One guess_number episode played by the solver on its own session: (steps, reward)."""
    async with endpoint.session() as env:
        reply = await env.reset(seed=seed)
        history = [reply["observation"]]
        while not reply["done"]:
            reply = await env.step(SOLVE(history).model_dump(exclude={"metadata"}))
            history.append(reply["observation"])
        return len(history) - 1, reply["reward"]


def idle(endpoint):
    return endpoint.metrics["sessions_active"] == 0


# -- round trips and errors --------------------------------------------------------------------


def test_echo_round_trip_and_a_validation_error_leaves_the_session_usable(echo):
    async def run():
        endpoint = Endpoint(echo.url, name="echo")
        async with endpoint.session() as env:
            first = await env.reset(seed=5, target="hello there")
            assert first["observation"]["target"] == "hello there" and first["done"] is False
            with pytest.raises(EnvServerError, match="message: Field required") as e:
                await env.step({"text": "hello there"})
            assert e.value.code == "VALIDATION_ERROR" and e.value.details["errors"]
            reply = await env.step({"message": "hello there"})
            assert reply["reward"] == 1.0 and reply["done"] is True
            state = await env.state()
            assert state["seed"] == 5 and state["step_count"] == 1
        assert env.closed and idle(endpoint)
        await env.close()  # idempotent
        with pytest.raises(SessionLost, match="closed session"):
            await env.step({"message": "again"})
        schema = await endpoint.schema()
        assert "message" in schema["action"]["properties"]
        assert endpoint.metrics["server_errors"] == 1 and endpoint.metrics["sessions_opened"] == 1

    asyncio.run(run())


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


def test_guess_number_episode_and_an_execution_error(guess):
    async def run():
        endpoint = Endpoint(guess.url)
        steps, reward = await solve_episode(endpoint, seed=7)
        assert reward == 1.0 and steps == len(get("guess_number").demonstration(seed=7).steps)
        async with endpoint.session() as env:
            with pytest.raises(EnvServerError, match="before reset") as e:
                await env.step({"tool": "guess", "arguments": {"n": 1}})
            assert e.value.code == "EXECUTION_ERROR"
            assert (await env.reset(seed=1))["observation"]["guesses_left"] > 0
        assert idle(endpoint)

    asyncio.run(run())


# -- capacity ----------------------------------------------------------------------------------


def test_more_episodes_than_server_slots_all_finish(guess, caplog):
    """8 concurrent episodes through a pool of 8 on a server with 2 slots: they wait, not fail; the
    server's stated capacity is kept, and a pool 4x above it is warned of once."""
    async def run():
        endpoint = Endpoint(guess.url, SessionConfig(max_sessions=8), name="guess")
        results = await asyncio.gather(*(solve_episode(endpoint, seed) for seed in range(8)))
        return endpoint, results

    with caplog.at_level("WARNING", logger="bridge.envs.session"):
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


def test_pings_keep_an_idle_session_and_detect_a_frozen_one(freezable):
    config = SessionConfig(ping_interval_s=0.2, ping_timeout_s=0.5, step_timeout_s=30.0)

    async def run():
        endpoint = Endpoint(freezable.url, config)
        async with endpoint.session() as env:
            await env.reset(seed=3)
            await asyncio.sleep(2.0)  # a long generation: ten pings answered meanwhile
            assert (await env.step({"message": "x"}))["done"] is True
        async with endpoint.session() as env:
            await env.reset(seed=3)
            with frozen(freezable):
                await asyncio.sleep(1.5)  # idle while frozen: a ping goes unanswered
                start = time.monotonic()
                with pytest.raises(SessionLost, match="keepalive ping timeout"):
                    await env.step({"message": "x"})
                assert time.monotonic() - start < 0.5  # known lost, not a 30 s step timeout
        assert idle(endpoint)

    asyncio.run(run())


def test_cancelling_a_call_ends_the_session_and_frees_its_slot(freezable):
    async def run():
        endpoint = Endpoint(freezable.url, SessionConfig(max_sessions=1))
        env = await endpoint.open()
        await env.reset(seed=1)
        with frozen(freezable):
            call = asyncio.create_task(env.step({"message": "x"}))
            await asyncio.sleep(0.1)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert env.closed and idle(endpoint)  # a late reply cannot answer a later call
        async with endpoint.session() as again:  # the one pool slot is free again
            await again.reset(seed=2)

    asyncio.run(run())


# -- start-up checks and configuration ---------------------------------------------------------


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


@pytest.mark.parametrize("attempt, full", [(0, 0.5), (1, 1.0), (3, 4.0), (4, 5.0), (10_000, 5.0)])
def test_backoff_doubles_up_to_its_cap_with_jitter_of_half_to_all_of_it(attempt, full):
    waits = [backoff_s(attempt, 0.5, 5.0) for _ in range(200)]
    assert all(full / 2 <= w <= full for w in waits)
    assert max(waits) - min(waits) > full / 4  # spread: callers failing together retry apart


@pytest.mark.parametrize("field, value, allowed", [
    ("max_sessions", 0, "an integer >= 1"),
    ("breaker_failures", True, "an integer >= 1"),
    ("step_timeout_s", -1.0, "a finite number of seconds > 0"),
    ("connect_timeout_s", float("nan"), "a finite number of seconds > 0"),
    ("ping_interval_s", 0, "or None for no pings"),
    ("capacity_backoff_max_s", 0.01, "at least capacity_backoff_s"),
])
def test_config_errors_name_the_field_the_value_and_what_is_allowed(field, value, allowed):
    with pytest.raises(ValueError, match=rf"SessionConfig\.{field} must be .*{allowed}.*got {value!r}"):
        SessionConfig(**{field: value})


def test_config_accepts_no_pings_and_a_bad_url_is_refused():
    assert SessionConfig(ping_interval_s=None).ping_interval_s is None
    with pytest.raises(ValueError, match="http\\(s\\)://host:port"):
        Endpoint("ws://127.0.0.1:1/ws")
