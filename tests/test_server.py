"""The gRPC server in-process over a fake engine: validation, streaming, cancellation, counters."""

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from bridge import wire
from bridge.client import BridgeClient, BridgeRequestError
from bridge.engines.base import Completion, SamplingParams, SnapshotRefused
from bridge.proto import bridge_pb2 as pb
from bridge.proto import bridge_pb2_grpc as pb_grpc
from bridge.rollout import TurnResult
from bridge.server import serve


class FakeEngine:
    """Completions count up from the prompt's last token; `delay_s` of blocking work in a thread."""

    name = "fake"

    def __init__(self, delay_s: float = 0.0):
        self.policy_version = 0
        self.delay_s = delay_s
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []
        self.cancelled = 0
        self.closed = False
        self.stats = {"generate_calls": 0}

    async def generate(self, prompts, params):
        self.calls.append((prompts, params))
        self.stats["generate_calls"] += 1
        try:
            if self.delay_s and prompts[0][0] != 1:
                await asyncio.to_thread(time.sleep, self.delay_s)  # like the real engines: off the loop
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if prompts[0][0] == 666:
            raise RuntimeError("engine exploded")
        out = []
        for prompt in prompts:
            group = []
            for _ in range(params.n):
                tokens, reason = [], "length"
                for k in range(params.max_tokens):
                    tokens.append(prompt[-1] + 1 + k)
                    if tokens[-1] in params.stop_token_ids:
                        reason = "stop"
                        break
                group.append(Completion(tokens, [-0.5] * len(tokens), reason, self.policy_version))
            out.append(group)
        return out

    async def load_snapshot(self, path, version):
        if Path(path).name == "wrong-shape":
            raise SnapshotRefused(f"{path}: a different model shape")
        self.policy_version = version
        return 0.125

    async def close(self):
        self.closed = True


@contextlib.contextmanager
def running(engine, **kwargs):
    """A server on 127.0.0.1 in a thread of its own, and a client; shut down on exit."""
    ready, box = threading.Event(), {}

    def on_listening(address):
        box["address"] = address
        ready.set()

    def run():
        asyncio.run(serve(engine, port=0, on_listening=on_listening, handle_signals=False, grace_s=1.0,
                          **kwargs))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30), "server did not start"
    client = BridgeClient(box["address"], timeout_s=10)
    try:
        yield client
    finally:
        client.shutdown()
        thread.join(10)
        client.close()
        assert not thread.is_alive(), "server did not stop after Shutdown"
        assert engine.closed


@pytest.fixture(scope="module")
def bridge():
    engine = FakeEngine()
    with running(engine) as client:
        yield client, engine


def _params(**kw):
    return SamplingParams(**{"max_tokens": 4, **kw})


def test_streams_every_episode_with_its_tokens(bridge):
    client, engine = bridge
    trajs = list(client.rollout([[1, 2], [10]], 3, _params(max_tokens=4, stop_token_ids=(12,))))
    assert sorted((t.group_id, t.index_in_group) for t in trajs) == [(g, i) for g in "01" for i in range(3)]
    for t in trajs:
        if t.group_id == "0":
            np.testing.assert_array_equal(t.completion_ids, [3, 4, 5, 6])
            assert t.finish_reason == "length"
        else:
            np.testing.assert_array_equal(t.completion_ids, [11, 12])
            assert t.finish_reason == "stop"
        assert t.loss_mask.tolist() == [1] * len(t.completion_ids)
        np.testing.assert_allclose(t.sampler_logprobs, -0.5)
        assert t.num_turns == 1 and t.total_s >= 0


def test_episode_seeds_count_up_from_the_request_seed(bridge):
    client, engine = bridge
    engine.calls.clear()
    list(client.rollout([[1], [2]], 3, _params(seed=100)))
    assert sorted(p.seed for _, p in engine.calls) == [100, 101, 102, 103, 104, 105]
    assert all(p.n == 1 for _, p in engine.calls)
    engine.calls.clear()
    list(client.rollout([[1]], 2, _params()))
    assert [p.seed for _, p in engine.calls] == [None, None]


@pytest.mark.parametrize("groups, group_size, params, message", [
    ([], 2, _params(), "no groups"),
    ([[1], []], 2, _params(), "empty prompt"),
    ([[1]], 0, _params(), "group_size=0"),
    ([wire.PromptGroup([1], env="wordle")], 1, _params(), "serves no environments"),
])
def test_bad_rollouts_are_invalid_argument_and_the_bridge_keeps_serving(
        bridge, groups, group_size, params, message):
    client, _ = bridge
    with pytest.raises(BridgeRequestError, match=message) as e:
        list(client.rollout(groups, group_size, params))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert client.health().status == "serving"
    assert len(list(client.rollout([[1]], 2, _params()))) == 2


def test_bad_sampling_params_are_invalid_argument_with_the_message(bridge):
    client, _ = bridge
    request = wire.rollout_request([[1]], 1, _params())
    request.sampling.max_tokens = 0
    request.sampling.temperature = -1
    stub = pb_grpc.BridgeStub(client._channel)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Rollout(request, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens=0" in e.value.details() and "temperature=-1" in e.value.details()


def test_protocol_mismatch_is_failed_precondition(bridge):
    client, _ = bridge
    stub = pb_grpc.BridgeStub(client._channel)
    request = wire.rollout_request([[1]], 1, _params())
    request.protocol_version = 2
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Rollout(request, timeout=10))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "protocol version 2" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.Stats(pb.StatsRequest(protocol_version=0), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Health answers anyone, with the bridge's own version.
    assert stub.Health(pb.HealthRequest(), timeout=10).protocol_version == wire.PROTOCOL_VERSION


def test_snapshots_load_refuse_and_gate_min_policy_version(bridge, tmp_path):
    client, engine = bridge
    with pytest.raises(BridgeRequestError) as e:
        list(client.rollout([[1]], 1, _params(), min_policy_version=engine.policy_version + 1))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "load that snapshot" in e.value.details
    with pytest.raises(BridgeRequestError) as e:
        client.load_snapshot(tmp_path / "missing", 1)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    (tmp_path / "wrong-shape").mkdir()
    before = engine.policy_version
    with pytest.raises(BridgeRequestError) as e:
        client.load_snapshot(tmp_path / "wrong-shape", before + 1)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "different model shape" in e.value.details
    assert client.health().policy_version == before
    loaded = client.load_snapshot(tmp_path, before + 5)
    assert loaded.version == before + 5 and loaded.load_s == 0.125
    [traj] = client.rollout([[1]], 1, _params(), min_policy_version=before + 5)
    assert traj.token_versions.tolist() == [before + 5] * 4 and traj.policy_version == before + 5


def test_engine_failures_cost_the_episode_not_the_bridge(bridge):
    client, _ = bridge
    errors_before = client.stats()["episode_errors"]
    trajs = list(client.rollout([[666], [1]], 2, _params()))
    failed = [t for t in trajs if t.group_id == "0"]
    assert all(t.finish_reason == "error" and "engine exploded" in t.error for t in failed)
    assert all(t.finish_reason == "length" for t in trajs if t.group_id == "1")
    assert client.stats()["episode_errors"] == errors_before + 2


def test_stats_count_trajectories_and_refusals(bridge):
    client, _ = bridge
    before = client.stats()
    list(client.rollout([[1], [2]], 2, _params()))
    with pytest.raises(BridgeRequestError):
        list(client.rollout([[1]], 0, _params()))
    after = client.stats()
    assert after["trajectories"] == before["trajectories"] + 4
    assert after["request_errors"] == before["request_errors"] + 1
    assert after["episodes_in_flight"] == 0
    assert after["engine.generate_calls"] >= 4 and "uptime_s" in after


def test_health_answers_during_a_long_rollout_and_closing_the_stream_cancels_it():
    engine = FakeEngine(delay_s=2.0)  # prompts starting with 1 are fast, the others take 2 s
    with running(engine) as client:
        stream = client.rollout([[1], [2]], 2, _params())
        first = next(stream)
        assert first.group_id == "0"
        assert client.stats()["episodes_in_flight"] >= 2  # the slow ones run
        t0 = time.monotonic()
        health = client.health()
        assert time.monotonic() - t0 < 0.5 and health.status == "serving"
        stream.close()  # the trainer stops listening: the bridge cancels the rest
        deadline = time.monotonic() + 2
        while client.stats()["episodes_in_flight"] and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = client.stats()
        assert stats["episodes_in_flight"] == 0 and stats["rollouts_cancelled"] == 1
        assert engine.cancelled == 2
        assert time.monotonic() - t0 < 1.5  # well before the slow episodes would have finished


class CountdownHook:
    """Two tool turns, then done with a reward."""

    def __init__(self, group):
        self.group, self.turns, self.closed = group, 0, False

    async def start(self):
        return [90]

    async def turn(self, completion_ids):
        self.turns += 1
        if self.turns == 2:
            return TurnResult([], True, {"reward": float(self.group.task["target"])})
        return TurnResult([70, 71], False)

    async def close(self):
        self.closed = True


def test_episode_hook_factory_runs_multi_turn_episodes():
    hooks = []

    def factory(group):
        if group.env == "broken":
            raise ConnectionError("environment server is down")
        if group.env != "count":
            return None
        hooks.append(CountdownHook(group))
        return hooks[-1]

    with running(FakeEngine(), episode_hook_factory=factory) as client:
        groups = [wire.PromptGroup([5], group_id="a", env="count", task={"target": 3}), wire.PromptGroup([7]),
                  wire.PromptGroup([9], group_id="b", env="broken")]
        stream = client.rollout(groups, 1, _params(max_tokens=2), max_turns=4, max_total_tokens=10)
        trajs = {t.group_id: t for t in stream}
        assert client.health().status == "serving"
    a, plain, broken = trajs["a"], trajs["1"], trajs["b"]
    assert broken.finish_reason == "error" and "environment server is down" in broken.error
    assert broken.env == "broken" and len(broken.completion_ids) == 0
    assert a.env == "count" and a.finish_reason == "env_done" and a.num_turns == 2
    assert a.rewards == {"reward": 3.0}
    np.testing.assert_array_equal(a.prompt_ids, [5, 90])
    np.testing.assert_array_equal(a.completion_ids, [91, 92, 70, 71, 72, 73])
    assert a.loss_mask.tolist() == [1, 1, 0, 0, 1, 1]
    assert a.token_versions.tolist() == [0, 0, -1, -1, 0, 0]
    assert plain.finish_reason == "length" and plain.num_turns == 1
    assert len(hooks) == 1 and hooks[0].closed
