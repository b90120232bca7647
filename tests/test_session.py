"""OpenEnv WebSocket sessions against real bundled servers: round trips, error replies, pings, a
cancelled call, and the limits' checks."""

import asyncio
import json
import time

import pytest

from bridge.envs.bundled import get
from bridge.envs.endpoint import Endpoint
from bridge.envs.session import EnvServerError, SessionConfig, SessionLost, backoff_s
from env_servers import echo, freezable, frozen, guess, idle, solve_episode  # noqa: F401 (fixtures)


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


def test_a_reward_that_is_no_number_loses_the_session_as_any_unreadable_reply_does():
    """A server is untrusted: {"reward": "lots"} is a bad reply (the episode is replayed on a new session),
    not the RewardError that stops a run over a reward function's bug."""
    from websockets.asyncio.server import serve

    async def answer(ws):
        async for raw in ws:
            kind = json.loads(raw)["type"]
            if kind == "close":
                return
            reward = "lots" if kind == "step" else None
            await ws.send(json.dumps({"type": "observation",
                                      "data": {"observation": {"text": "hi"}, "reward": reward, "done": False}}))

    async def run():
        async with serve(answer, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            endpoint = Endpoint(f"http://127.0.0.1:{port}", name="liar")
            async with endpoint.session() as env:
                assert (await env.reset())["observation"] == {"text": "hi"}
                with pytest.raises(SessionLost, match=r"unreadable reply to step: its reward 'lots' is not a finite "
                                                      r"number; the episode is lost: restart it"):
                    await env.step({"message": "x"})
            assert env.closed and endpoint.metrics["sessions_lost"] == 1

    asyncio.run(run())


# -- a frozen server ---------------------------------------------------------------------------


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
                deadline = time.monotonic() + 20
                while env.connected:  # idle while frozen: a ping goes unanswered
                    assert time.monotonic() < deadline, "a frozen server's session still looks connected"
                    await asyncio.sleep(0.05)
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


# -- configuration -----------------------------------------------------------------------------


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
    assert Endpoint("http://127.0.0.1:1").pool == 64  # no environment config to size it: DEFAULT_POOL
    assert Endpoint("http://127.0.0.1:1", SessionConfig(max_sessions=3)).pool == 3
    with pytest.raises(ValueError, match="http\\(s\\)://host:port"):
        Endpoint("ws://127.0.0.1:1/ws")
