"""The `envs:` config entries: errors that name the problem, and the replay schedule."""

from __future__ import annotations

import pytest

from bridge.envs.session import SessionConfig
from bridge.envs.spec import EnvConfigError, EnvSpec


@pytest.mark.parametrize("data, message", [
    ({"name": "x"}, "exactly one of bundled, url, env_class"),
    ({"name": "x", "url": "http://a", "bundled": "echo"}, "exactly one"),
    ({"name": "x", "url": "ftp://a"}, "must start with http"),
    ({"name": "x", "env_class": "nocolon"}, "module:Class"),
    ({"name": "x", "url": "http://a", "colour": 1}, "unknown key.*colour"),
    ({"name": "x", "url": "http://a", "session": {"step_timeout_s": -1}}, "session.*step_timeout_s"),
    ({"name": "x", "url": "http://a", "max_retries": 2}, "'x': max_retries is gone; set retry_budget_s instead"),
    ({"name": "x", "url": "http://a", "retry_backoff_s": 0}, "retry_backoff_s > 0"),
    ({"name": "x", "url": "http://a", "observation_template": "at {x"}, "'x': observation_template 'at {x'.*"
                                                                        "expected '}'"),
    ({"name": "x", "url": "http://a", "observation_template": "at {}"}, "{} names no field"),
    ({"name": "x", "url": "http://a", "observation_template": "{x}", "observation_field": "x"}, "not both"),
    ({"name": "x", "url": "http://a", "env_kwargs": {"size": 5}}, "^environment 'x': env_kwargs are passed to "
                                                                   "env_class's constructor, and it has no env_class"),
    ({"name": "x", "env_class": "m:C", "env_kwargs": [5]}, "'x': env_kwargs must map argument names to values"),
    ({"name": "x", "harness": "http://a"}, "a harness environment needs harness_port"),
    ({"name": "x", "harness": "ws://a", "harness_port": 9000}, "harness 'ws://a' must start with http"),
    ({"name": "x", "url": "http://a", "harness_port": 9000},
     "'x' sets harness_port, which only harness environments take"),
    ({"name": "x", "url": "http://a", "harness_api_key_file": "k", "harness_insecure": True},
     "'x' sets harness_api_key_file, harness_insecure, which only harness environments take; set harness too, "
     "or drop those keys"),
    ({"name": "x", "harness": "http://a", "harness_port": 9000, "harness_host": "0.0.0.0"},
     r"^environment 'x': harness_host 0.0.0.0 listens beyond loopback, where the harness's key would travel in "
     r"clear text: set harness_tls_cert and harness_tls_key, or harness_insecure: true on a network you trust$"),
    ({"name": "x", "harness": "http://a", "harness_port": 9000, "harness_host": "agent.example.org"},
     "harness_host agent.example.org listens beyond loopback"),
    ({"name": "x", "harness": "http://a", "harness_port": 9000, "harness_tls_cert": "c.pem"},
     "harness_tls_cert and harness_tls_key go together"),
    ({"name": "x", "harness": "http://a", "harness_port": 9000, "harness_host": ""},
     "harness_host must be an address"),
    ({"name": "x", "harness": "http://a", "harness_port": 9000, "harness_message": "{}"}, "harness_message.*names no"),
    ({"name": "x", "harness": "http://a", "harness_port": 9000, "url": "http://b"}, "exactly one of.*harness"),
    ({"name": "x", "harness": "http://a", "harness_port": 9000, "solver": "echo"}, "a harness environment has no "
                                                                                 "solver"),
])
def test_env_spec_errors_name_the_problem(data, message):
    with pytest.raises(EnvConfigError, match=message):
        EnvSpec.from_dict(data)


@pytest.mark.parametrize("door", [
    {},
    {"harness_host": "localhost"},
    {"harness_host": "::1"},
    {"harness_host": "0.0.0.0", "harness_tls_cert": "c.pem", "harness_tls_key": "k.pem"},
    {"harness_host": "10.0.0.5", "harness_insecure": True},
])
def test_a_harness_endpoint_listens_beyond_loopback_with_tls_or_insecure_said(door):
    spec = EnvSpec.from_dict({"name": "x", "harness": "http://a", "harness_port": 9000, **door})
    assert spec.harness_host == door.get("harness_host", "127.0.0.1")


def test_replays_are_bounded_by_time_since_the_first_loss_and_outlast_the_breaker_cooldown():
    spec = EnvSpec("x", url="http://a", retry_budget_s=60.0, retry_backoff_s=0.5,
                   session=SessionConfig(breaker_cooldown_s=5.0))
    for _ in range(50):  # jittered schedules: replay until the next wait would pass the budget
        lost_for, waits = 0.0, []
        while (wait := spec.retry_wait_s(len(waits), lost_for)) is not None:
            waits.append(wait)
            lost_for += wait
        assert 60.0 - 10.0 < lost_for <= 60.0  # the budget is spent, never overrun
        assert 0.25 <= waits[0] <= 0.5 and max(waits) <= 10.0  # doubling from 0.5 s, capped at 2 cooldowns
        assert min(waits[5:]) >= 5.0  # late replays land after the breaker half-opened
    assert 5.0 <= spec.retry_wait_s(10_000, 0.0) <= 10.0  # time, not a count, ends the replays
    assert spec.retry_wait_s(0, 59.8) is None
    assert EnvSpec("x", url="http://a", retry_budget_s=0).retry_wait_s(0, 0.0) is None


@pytest.mark.parametrize("data, pool", [
    ({"max_concurrent_envs": 256}, 256),  # the server's capacity is the pool: no hidden bound of 64
    ({}, 64),
    ({"max_concurrent_envs": 256, "session": {"max_sessions": 32}}, 32),  # a session bound lowers it
    ({"max_concurrent_envs": 8, "session": {"max_sessions": 32}}, 8),
])
def test_the_session_pool_is_the_environments_capacity_unless_the_session_bounds_it_lower(data, pool):
    assert EnvSpec.from_dict({"name": "x", "bundled": "echo", **data}).pool_size == pool


@pytest.mark.parametrize("spec, fields", [
    (EnvSpec("t", env_class="tests.workers.trl_env:Target"), None),  # reset(target, **kwargs): any field
    (EnvSpec("g", env_class="tests.workers.openenv_catalogue:GridWorldEnvironment"), frozenset()),  # reset(self)
    (EnvSpec("q", env_class="tests.workers.openenv_catalogue:QuizEnvironment"),
     frozenset({"seed", "episode_id", "split", "index"})),
    (EnvSpec("e", env_class="experiments.bench.guess_env:GuessNumber"), None),  # reset(**row): any field
    (EnvSpec("s", url="http://127.0.0.1:1"), None),  # a server's reset is not seen from here
])
def test_reset_fields_are_what_the_resets_signature_takes(spec, fields):
    from bridge.envs.spec import reset_fields

    assert reset_fields(spec) == fields


def test_the_contract_imports_no_environment_runtime():
    """The trainer's view of the bridge: importing it runs no environment code (bridge.envs.probe does that,
    in a process of the bridge's own)."""
    import subprocess
    import sys

    loaded = subprocess.run([sys.executable, "-c", "import sys, bridge.envs.spec; print(sorted(sys.modules))"],
                            capture_output=True, text=True, check=True).stdout
    assert "bridge.envs.runtime" not in loaded and "bridge.envs.probe" not in loaded
