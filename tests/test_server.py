"""The gRPC server in-process over the real JAX engine and a tiny Qwen3: validation, streaming,
seeds, snapshots, failures, cancellation, counters and multi-turn episodes; the lock (token,
snapshot roots, versions that only go forward, request limits).

Each server runs in a thread of its own event loop; `Bridge.direct` runs `engine.generate` on
that same loop and engine, so a trajectory can be checked against the engine's own output for the
seed and tokens the episode should have used.
"""

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import os
import shutil
import socket
import threading
import time

import grpc
import jax
import numpy as np
import pytest
from flax import nnx

from bridge import wire
from bridge.client import BridgeClient, BridgeError, BridgeRequestError, BridgeUnauthenticated
from bridge.engines.base import Completion, SamplingParams, derive_seed
from bridge.engines.jax_engine import JaxEngine
from bridge.proto import bridge_pb2 as pb
from bridge.proto import bridge_pb2_grpc as pb_grpc
from bridge.rollout import ENV_VERSION, TurnResult
from bridge.server import StartupError, WarmingUp, serve
from jaxrl.models import Decoder, load_pretrained
from jaxrl.snapshots import SnapshotWriter
from jaxrl.tiny import build_tiny_model, tiny_config
from jaxrl.tiny_tokenizer import build_tokenizer
from object_store import s3_server
from scripted_engine import ScriptedEngine

SNAPSHOT_VERSION = 5
TOKEN = "the-bridge-token"


@dataclasses.dataclass
class Bridge:
    client: BridgeClient
    engine: JaxEngine
    loop: asyncio.AbstractEventLoop

    def direct(self, calls: list[tuple[list[int], SamplingParams]]) -> list[Completion]:
        """One engine.generate per (prompt, params), concurrently on the server's loop and engine."""
        async def gather():
            return await asyncio.gather(*(self.engine.generate([p], params) for p, params in calls))

        return [c for [[c]] in asyncio.run_coroutine_threadsafe(gather(), self.loop).result(120)]


@contextlib.contextmanager
def running(engine, spec=wire.ServerSpec(), **kwargs):
    """A server on 127.0.0.1 in a thread of its own requiring TOKEN, and a client; shut down on exit."""
    ready, box = threading.Event(), {}

    def on_listening(address):
        box["address"], box["loop"] = address, asyncio.get_running_loop()
        ready.set()

    def run():
        asyncio.run(serve(engine, spec, on_listening=on_listening, handle_signals=False, grace_s=1.0,
                          token=TOKEN, **kwargs))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30), "server did not start"
    client = BridgeClient(box["address"], timeout_s=30, token=TOKEN)
    try:
        yield Bridge(client, engine, box["loop"])
    finally:
        client.shutdown()
        thread.join(10)
        client.close()
        assert not thread.is_alive(), "server did not stop after Shutdown"
        assert getattr(engine, "_worker", None) is None, "the server did not close its engine"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"), "qwen3")


@pytest.fixture(scope="module")
def snapshots(model_dir, tmp_path_factory):
    """The bridges' snapshot root. `policy/`: the served model perturbed, as versions 3 and 5;
    `other-shape/`: another shape, version 6."""
    root = tmp_path_factory.mktemp("snapshots")
    model = load_pretrained(model_dir)
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(state))))
    state = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), state)
    writer = SnapshotWriter(root / "policy", model.cfg)
    writer.publish(state, SNAPSHOT_VERSION - 2)
    writer.publish(state, SNAPSHOT_VERSION)
    writer.close()
    other_cfg = tiny_config("qwen3", vocab_size=model.cfg.vocab_size, intermediate_size=96)
    other = SnapshotWriter(root / "other-shape", other_cfg)
    other.publish(nnx.state(Decoder(other_cfg, nnx.Rngs(1)), nnx.Param), SNAPSHOT_VERSION + 1)
    other.close()
    return root


@pytest.fixture(scope="module")
def bridge(model_dir, snapshots):
    engine = JaxEngine(model_dir)
    with running(engine, wire.ServerSpec(snapshot_roots=[snapshots]), vocab_size=engine.cfg.vocab_size) as b:
        yield b


def _params(**kw):
    return SamplingParams(**{"max_tokens": 4, **kw})


def test_streams_every_episode_with_its_tokens(bridge):
    client, version = bridge.client, bridge.engine.policy_version
    prompts, group_size = [[1, 2], [10]], 3
    params = _params(temperature=1.0, seed=20)
    # What each episode samples without a stop token (its seed: see the next test) ...
    free = bridge.direct([(prompts[g], first_turn(params, derive_seed(20, str(g)), j))
                          for g in range(2) for j in range(group_size)])
    # ... and a stop token that ends group 1's first episode after two tokens.
    stop = free[group_size].token_ids[1]
    assert stop != free[group_size].token_ids[0], free[group_size].token_ids

    trajs = list(client.rollout(prompts, group_size, dataclasses.replace(params, stop_token_ids=(stop,))))
    assert sorted((t.group_id, t.index_in_group) for t in trajs) == [
        (g, i) for g in "01" for i in range(group_size)]
    reasons = []
    for t in trajs:
        g = int(t.group_id)
        ref = free[g * group_size + t.index_in_group]
        end = ref.token_ids.index(stop) + 1 if stop in ref.token_ids else len(ref.token_ids)
        reasons.append(t.finish_reason)
        assert t.prompt_ids.tolist() == prompts[g]
        assert t.completion_ids.tolist() == ref.token_ids[:end]  # the stop token stays in
        assert t.finish_reason == ("stop" if stop in ref.token_ids else "length")
        np.testing.assert_allclose(t.sampler_logprobs, ref.logprobs[:end], atol=1e-5)
        assert np.all(t.sampler_logprobs < 0) and np.all(np.isfinite(t.sampler_logprobs))
        assert t.loss_mask.tolist() == [1] * end and t.token_versions.tolist() == [version] * end
        assert t.num_turns == 1 and t.error == "" and t.generate_s > 0 and t.total_s >= t.generate_s
    assert "stop" in reasons and "length" in reasons


def first_turn(params: SamplingParams, group_seed: int, j: int) -> SamplingParams:
    """The params of episode j's first turn in a group seeded `group_seed` (see PromptGroup.seed)."""
    return dataclasses.replace(params, seed=derive_seed(derive_seed(group_seed, j), 0))


def test_episodes_sample_by_their_group_seed_whatever_request_they_travel_in(bridge):
    client = bridge.client
    group_size = 3
    a, b = wire.PromptGroup([1], group_id="4-0"), wire.PromptGroup([2, 3], group_id="4-1", seed=2**63 + 1)
    params = _params(temperature=1.0, max_tokens=6, seed=100)  # seeds the groups without one: a
    seeds = {"4-0": derive_seed(100, "4-0"), "4-1": 2**63 + 1}

    def tokens(groups):
        return {(t.group_id, t.index_in_group): t.completion_ids.tolist()
                for t in client.rollout(groups, group_size, params)}

    both = tokens([a, b])
    # Alone, second, or first in the request (so batched with other episodes, or not): the same.
    assert tokens([b]) == {k: v for k, v in both.items() if k[0] == "4-1"}
    assert tokens([b, a]) == both
    # Episode j of a group samples with derive_seed(group seed, j) (its first turn: see test_rollout).
    expected = bridge.direct([(g.prompt_ids, first_turn(params, seeds[g.group_id], j))
                              for g in (a, b) for j in range(group_size)])
    assert [both[(g.group_id, j)] for g in (a, b) for j in range(group_size)] == [c.token_ids for c in expected]
    for g in ("4-0", "4-1"):
        assert len({tuple(v) for k, v in both.items() if k[0] == g}) == group_size
    # Without a seed every episode draws its own.
    unseeded = list(client.rollout([[1]], 4, dataclasses.replace(params, seed=None)))
    assert len({tuple(t.completion_ids.tolist()) for t in unseeded}) == 4


@pytest.mark.parametrize("groups, group_size, params, message", [
    ([], 2, _params(), "no groups"),
    ([[1], []], 2, _params(), "empty prompt"),
    ([[1]], 0, _params(), "group_size=0"),
    ([wire.PromptGroup([1], env="wordle")], 1, _params(), "serves no environments"),
])
def test_bad_rollouts_are_invalid_argument_and_the_bridge_keeps_serving(
        bridge, groups, group_size, params, message):
    client = bridge.client
    with pytest.raises(BridgeRequestError, match=message) as e:
        list(client.rollout(groups, group_size, params))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert client.health().status == "serving"
    assert len(list(client.rollout([[1]], 2, _params()))) == 2


def test_bad_sampling_params_are_invalid_argument_with_the_message(bridge):
    request = wire.rollout_request([[1]], 1, _params())
    request.sampling.max_tokens = 0
    request.sampling.temperature = -1
    stub = pb_grpc.BridgeStub(bridge.client._channel)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Rollout(request, timeout=10, metadata=bridge.client._metadata))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens=0" in e.value.details() and "temperature=-1" in e.value.details()
    for temperature in (float("nan"), float("inf")):
        request.sampling.temperature, request.sampling.max_tokens = temperature, 4
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Rollout(request, timeout=10, metadata=bridge.client._metadata))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"temperature={temperature} must be a finite number" in e.value.details()


def test_token_ids_outside_the_vocabulary_are_invalid_argument(bridge):
    vocab = bridge.engine.cfg.vocab_size
    for ids in ([1, -1], [1, vocab]):
        with pytest.raises(BridgeRequestError) as e:
            list(bridge.client.rollout([ids], 1, _params()))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"prompt token ids run from {min(ids)} to {max(ids)}; the model's vocabulary is [0, {vocab})" \
            in e.value.details
    assert len(list(bridge.client.rollout([[1, vocab - 1]], 1, _params()))) == 1


def test_protocol_mismatch_is_failed_precondition(bridge):
    stub = pb_grpc.BridgeStub(bridge.client._channel)
    request = wire.rollout_request([[1]], 1, _params())
    request.protocol_version = 1  # the version before seeds per group
    metadata = bridge.client._metadata
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Rollout(request, timeout=10, metadata=metadata))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "protocol version 1" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.Stats(pb.StatsRequest(protocol_version=0), timeout=10, metadata=metadata)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Health answers any protocol version (with the token), with the bridge's own.
    assert stub.Health(pb.HealthRequest(), timeout=10, metadata=metadata).protocol_version == wire.PROTOCOL_VERSION


def test_snapshots_load_refuse_and_gate_min_policy_version(bridge, snapshots):
    client = bridge.client
    before = client.health().policy_version
    assert before < SNAPSHOT_VERSION
    stats_before = client.stats()
    with pytest.raises(BridgeRequestError) as e:
        list(client.rollout([[1]], 1, _params(), min_policy_version=SNAPSHOT_VERSION))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "load that snapshot" in e.value.details
    with pytest.raises(BridgeRequestError) as e:
        client.load_snapshot(snapshots / "missing", SNAPSHOT_VERSION)
    assert e.value.code == grpc.StatusCode.NOT_FOUND

    params = _params(temperature=1.0, max_tokens=6, seed=7)
    [old] = client.rollout([[4, 5, 6]], 1, params)
    with pytest.raises(BridgeRequestError) as e:
        client.load_snapshot(snapshots / "other-shape", SNAPSHOT_VERSION + 1)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "intermediate_size 96 (serving 128)" in e.value.details
    assert f"still serving version {before}" in e.value.details
    with pytest.raises(BridgeRequestError) as e:
        client.load_snapshot(snapshots / "policy", SNAPSHOT_VERSION + 3)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "no finished snapshot" in e.value.details
    assert client.health().policy_version == before
    [same] = client.rollout([[4, 5, 6]], 1, params)  # refused snapshots left the weights alone
    assert same.completion_ids.tolist() == old.completion_ids.tolist()
    np.testing.assert_allclose(same.sampler_logprobs, old.sampler_logprobs, atol=1e-5)

    loaded = client.load_snapshot(snapshots / "policy", SNAPSHOT_VERSION)
    assert loaded.version == SNAPSHOT_VERSION and loaded.load_s > 0
    assert client.health().policy_version == SNAPSHOT_VERSION
    [new] = client.rollout([[4, 5, 6]], 1, params, min_policy_version=SNAPSHOT_VERSION)
    assert new.token_versions.tolist() == [SNAPSHOT_VERSION] * 6 and new.policy_version == SNAPSHOT_VERSION
    same_tokens = new.completion_ids.tolist() == old.completion_ids.tolist()
    assert not (same_tokens and np.allclose(new.sampler_logprobs, old.sampler_logprobs, atol=1e-3)), \
        "the loaded snapshot's weights are not the ones sampling"
    stats = client.stats()
    assert stats["snapshot_loads"] == stats_before["snapshot_loads"] + 1
    assert stats["snapshot_refusals"] == stats_before["snapshot_refusals"] + 2
    assert stats["programs"] >= stats_before["programs"] > 0  # the JAX programs of the bridge's process


def test_every_call_without_the_token_is_refused(bridge, snapshots):
    client = bridge.client
    before = client.stats()
    for token, problem in ((None, "was not given"), (TOKEN + "x", "is not the bridge's")):
        with BridgeClient(client.address, timeout_s=10, token=token) as intruder:
            calls = {"rollout": lambda: list(intruder.rollout([[1]], 1, _params())),
                     "LoadSnapshot": lambda: intruder.load_snapshot(snapshots / "policy", SNAPSHOT_VERSION),
                     "Health": intruder.health, "Stats": intruder.stats, "Shutdown": intruder.shutdown}
            for name, call in calls.items():
                with pytest.raises(BridgeUnauthenticated, match=f"refused {name}.*the token {problem}") as e:
                    call()
                assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
                assert "--token-file" in str(e.value) and "JAXRL_BRIDGE_TOKEN" in str(e.value)
    stub = pb_grpc.BridgeStub(client._channel)  # the token itself, but not as a bearer token
    with pytest.raises(grpc.RpcError) as e:
        stub.Health(pb.HealthRequest(protocol_version=wire.PROTOCOL_VERSION), timeout=10,
                    metadata=(("authorization", TOKEN),))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "a wrong token" in e.value.details()
    after = client.stats()  # nothing reached the servicer, and the bridge still serves its token's holder
    assert after["unauthenticated"] == before["unauthenticated"] + 11
    for key in ("rollouts", "request_errors", "snapshot_loads", "snapshot_refusals"):
        assert after[key] == before[key], key
    assert client.health().status == "serving"


def test_snapshots_load_only_from_under_the_roots_and_never_go_back(bridge, snapshots, tmp_path):
    client = bridge.client
    assert client.load_snapshot(snapshots / "policy", SNAPSHOT_VERSION).version == SNAPSHOT_VERSION  # again: fine
    foreign = tmp_path / "foreign"
    shutil.copytree(snapshots / "policy", foreign)  # real snapshots of the right shape, outside the roots
    sibling = snapshots.parent / f"{snapshots.name}-sibling"  # the root's path is a prefix of its path
    shutil.copytree(snapshots / "policy", sibling)
    link = snapshots / "link"
    link.symlink_to(foreign, target_is_directory=True)
    planted = snapshots / "planted"  # a root's own directory, whose version directory leads outside
    planted.mkdir()
    (planted / str(SNAPSHOT_VERSION)).symlink_to(foreign / str(SNAPSHOT_VERSION), target_is_directory=True)
    try:
        with pytest.raises(BridgeRequestError) as e:
            client.load_snapshot(planted, SNAPSHOT_VERSION)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert f"{planted / str(SNAPSHOT_VERSION)} is a symlink to {foreign.resolve() / str(SNAPSHOT_VERSION)}" \
            in e.value.details
        before = client.stats()
        for path in (foreign, link, snapshots / "policy" / ".." / os.path.relpath(foreign, snapshots), sibling):
            with pytest.raises(BridgeRequestError) as e:
                client.load_snapshot(path, SNAPSHOT_VERSION)
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED, path
            assert "not under this bridge's snapshot roots" in e.value.details
            assert str(snapshots.resolve()) in e.value.details and "--snapshot-root" in e.value.details
        # `..` that stays under the root is resolved, not refused.
        inside = snapshots / "other-shape" / ".." / "policy"
        assert client.load_snapshot(inside, SNAPSHOT_VERSION).version == SNAPSHOT_VERSION
        with pytest.raises(BridgeRequestError) as e:
            client.load_snapshot(snapshots / "policy", SNAPSHOT_VERSION - 2)  # a real, older snapshot
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert (f"version {SNAPSHOT_VERSION - 2} is older than the version {SNAPSHOT_VERSION} this bridge serves"
                in e.value.details)
        after = client.stats()
        assert client.health().policy_version == SNAPSHOT_VERSION
        assert after["snapshot_loads"] == before["snapshot_loads"] + 1
        assert after["snapshot_refusals"] == before["snapshot_refusals"] + 1
    finally:
        link.unlink()
        shutil.rmtree(planted)


def test_snapshots_load_from_a_bucket_prefix_and_only_from_under_it(model_dir, snapshots, monkeypatch):
    with s3_server("bucket") as variables:
        for k, v in variables.items():
            monkeypatch.setenv(k, v)
        model = load_pretrained(model_dir)
        for prefix in ("run", "run-sibling"):
            with contextlib.closing(SnapshotWriter(f"s3://bucket/{prefix}", model.cfg)) as writer:
                writer.publish(nnx.state(model, nnx.Param), SNAPSHOT_VERSION)
        with running(JaxEngine(model_dir), wire.ServerSpec(snapshot_roots=["s3://bucket/run/", snapshots])) as b:
            outside = (grpc.StatusCode.PERMISSION_DENIED, "not under this bridge's snapshot roots")
            for path, code, message in [
                ("s3://bucket/run-sibling", *outside),
                ("s3://other/run", *outside),
                ("s3://bucket/run/../run-sibling", grpc.StatusCode.INVALID_ARGUMENT, "without '..'"),
                ("ftp://bucket/run", grpc.StatusCode.INVALID_ARGUMENT, "not to a ftp:// URL"),
                ("s3://bucket/run/empty", grpc.StatusCode.FAILED_PRECONDITION, "no finished snapshot with version 5"),
            ]:
                with pytest.raises(BridgeRequestError) as e:
                    b.client.load_snapshot(path, SNAPSHOT_VERSION)
                assert e.value.code == code and message in e.value.details, (path, e.value.details)
            loaded = b.client.load_snapshot("s3://bucket/run", SNAPSHOT_VERSION)
            assert loaded.version == b.client.health().policy_version == SNAPSHOT_VERSION
            assert b.client.stats()["snapshot_refusals"] == 1


def test_a_snapshot_read_stuck_on_storage_does_not_keep_the_bridge_from_stopping(model_dir, monkeypatch):
    with socket.socket() as silent:  # an S3 endpoint that takes connections and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        for k, v in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{silent.getsockname()[1]}", "AWS_REGION": "us-east-1",
                     "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}.items():
            monkeypatch.setenv(k, v)
        # `running` fails unless the server stops within 10 s of Shutdown: a stuck read in the
        # loop's default executor kept asyncio from finishing (and an orphaned bridge alive) for good.
        with running(JaxEngine(model_dir), wire.ServerSpec(snapshot_roots=["s3://bucket/run"])) as b:
            with pytest.raises(BridgeError, match="DEADLINE_EXCEEDED"):
                b.client.load_snapshot("s3://bucket/run", SNAPSHOT_VERSION, timeout_s=2)


def test_requests_over_the_limits_are_refused_naming_the_flag(snapshots):
    engine = ScriptedEngine(build_tokenizer(), lambda prompt: "ok", delay_s=1.0)
    limits = wire.Limits(max_group_size=4, max_groups=3, max_episode_tokens=16, max_episodes_in_flight=6,
                         max_request_mb=1)
    with running(engine, wire.ServerSpec(limits=limits)) as b:
        client = b.client
        for call, message in [
            (lambda: client.rollout([[1]], 5, _params()), "group_size=5 is over this bridge's limit of 4 "
                                                          "(--max-group-size)"),
            (lambda: client.rollout([[1]] * 4, 1, _params()), "groups=4 is over this bridge's limit of 3 (--max-groups)"),
            (lambda: client.rollout([[1]], 1, _params(max_tokens=17)), "sampling.max_tokens=17 is over this "
                                                                       "bridge's limit of 16 (--max-episode-tokens)"),
            (lambda: client.rollout([[1]], 1, _params(max_total_tokens=17)), "max_total_tokens=17 is over"),
            (lambda: client.rollout([[1]] * 2, 4, _params()), "groups x group_size=8 is over this bridge's limit "
                                                              "of 6 (--max-episodes-in-flight)"),
        ]:
            with pytest.raises(BridgeRequestError) as e:
                list(call())
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details
        with pytest.raises(BridgeRequestError) as e:  # a prompt of 4 MiB: over --max-request-mb
            list(client.rollout([[1] * (1 << 20)], 1, _params()))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED

        box = {}
        thread = threading.Thread(target=lambda: box.update(trajs=list(client.rollout([[1], [2]], 2, _params()))))
        thread.start()
        deadline = time.monotonic() + 10
        while client.stats()["episodes_in_flight"] < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(BridgeRequestError) as e:
            list(client.rollout([[1]], 3, _params()))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "3 more episodes would make 7 in flight, over this bridge's limit of 6" in e.value.details
        assert len(list(client.rollout([[1]], 2, _params()))) == 2  # what fits runs alongside
        thread.join(10)
        assert len(box["trajs"]) == 4
        assert len(list(client.rollout([[1]], 3, _params()))) == 3  # and more once they are done
        stats = client.stats()
        assert {k: stats[f"limit.{k}"] for k in dataclasses.asdict(limits)} == dataclasses.asdict(limits)
        # Started without snapshot roots, it serves its model only (this engine would load anything).
        with pytest.raises(BridgeRequestError) as e:
            client.load_snapshot(snapshots / "policy", SNAPSHOT_VERSION)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and "snapshot roots (none)" in e.value.details
        assert client.health().policy_version == 0


def test_listening_beyond_loopback_needs_tls_or_insecure_and_every_bridge_a_token():
    engine = ScriptedEngine(None, str)  # never asked to generate
    for host in ("0.0.0.0", "10.1.2.3", "bridge.example.org"):
        with pytest.raises(StartupError, match=f"--host {host} listens beyond loopback.*--tls-cert and --tls-key, "
                                               "or pass --insecure"):
            asyncio.run(serve(engine, wire.ServerSpec(host=host), handle_signals=False, token=TOKEN))
    with pytest.raises(StartupError, match="needs a token"):
        asyncio.run(serve(engine, handle_signals=False, token=""))


def test_engine_failures_cost_the_episode_not_the_bridge(bridge):
    """An engine ValueError for an episode (here: a prompt that fills the engine's whole sequence)
    becomes that episode's error trajectory, not INVALID_ARGUMENT for the request: the servicer
    does not know each engine's limits up front, a multi-turn episode may only outgrow the context
    after some turns while others already streamed, and the request's other trajectories must
    not be lost."""
    client = bridge.client
    context = bridge.engine.cfg.max_position_embeddings
    before = client.stats()
    trajs = list(client.rollout([[5] * context, [5] * (context - 2)], 2, _params(max_tokens=4)))
    failed = [t for t in trajs if t.group_id == "0"]
    assert len(failed) == 2
    for t in failed:
        assert t.finish_reason == "error" and "raise rollout.max_prompt_tokens" in t.error
        assert f"{context} tokens" in t.error and len(t.completion_ids) == 0 and t.num_turns == 0
    for t in (t for t in trajs if t.group_id == "1"):  # generation stops at the end of the context
        assert t.finish_reason == "length" and len(t.completion_ids) == 2 and t.error == ""
    after = client.stats()
    assert after["episode_errors"] == before["episode_errors"] + 2
    assert after["trajectories"] == before["trajectories"] + 4
    assert client.health().status == "serving"
    assert all(t.finish_reason == "length" for t in client.rollout([[1]], 2, _params()))


def test_stats_count_trajectories_and_refusals(bridge):
    client = bridge.client
    before = client.stats()
    list(client.rollout([[1], [2]], 2, _params()))
    with pytest.raises(BridgeRequestError):
        list(client.rollout([[1]], 0, _params()))
    after = client.stats()
    assert after["rollouts"] == before["rollouts"] + 1
    assert after["trajectories"] == before["trajectories"] + 4
    assert after["request_errors"] == before["request_errors"] + 1
    assert after["episodes_in_flight"] == 0 and after["episode_errors"] == before["episode_errors"]
    assert after["engine.rows"] == before["engine.rows"] + 4
    assert after["engine.tokens"] == before["engine.tokens"] + 16  # 4 episodes x max_tokens, no stop
    assert after["engine.decode_calls"] > before["engine.decode_calls"]
    assert after["policy_version"] == bridge.engine.policy_version
    assert after["uptime_s"] > before["uptime_s"]


def test_health_answers_during_a_long_rollout_and_closing_the_stream_cancels_it(model_dir):
    # max_batch=1: one episode per device call, so a rollout's episodes finish one after another.
    engine = JaxEngine(model_dir, max_batch=1)
    params = _params(temperature=1.0, max_tokens=2000, seed=0)
    with running(engine) as b:
        b.direct([([1, 2, 3], params)])  # compiles outside the timed part
        rows_before = engine.stats["rows"]
        stream = b.client.rollout([[1, 2, 3]], 4, params)
        first = next(stream)
        episode_s = first.generate_s  # one device call; the second episode's has just started
        assert len(first.completion_ids) == 2000
        assert b.client.stats()["episodes_in_flight"] == 3
        t0 = time.monotonic()
        health = b.client.health()
        latency = time.monotonic() - t0
        assert health.status == "serving" and latency < episode_s / 4, (latency, episode_s)

        stream.close()  # the trainer stops listening: the bridge cancels the rest
        closed = time.monotonic()
        while b.client.stats()["episodes_in_flight"] and time.monotonic() < closed + 5:
            time.sleep(0.01)
        cancel_s = time.monotonic() - closed
        stats = b.client.stats()
        assert stats["episodes_in_flight"] == 0 and stats["rollouts_cancelled"] == 1
        assert stats["trajectories"] == 1
        assert cancel_s < episode_s / 2, (cancel_s, episode_s)  # not waiting for the device call
        print(f"episode {episode_s * 1e3:.0f} ms: Health in {latency * 1e3:.1f} ms, "
              f"episodes cancelled in {cancel_s * 1e3:.1f} ms")

        # The device call under way finishes; the cancelled episodes still queued never run.
        deadline = time.monotonic() + 5 * episode_s + 5
        while engine.stats["rows"] < rows_before + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.5 * episode_s)
        assert engine.stats["rows"] == rows_before + 2
        assert b.client.health().status == "serving"


class ScriptedToolHook:
    """A deterministic environment: `start` appends [90] to the prompt, the first turn answers
    with tool tokens [70, 71], the second ends the episode with reward task["target"]."""

    def __init__(self, group):
        self.group, self.seen, self.closed = group, [], False

    async def start(self):
        return [90]

    async def turn(self, completion_ids):
        self.seen.append(list(completion_ids))
        if len(self.seen) == 2:
            return TurnResult([], True, {"reward": float(self.group.task["target"])})
        return TurnResult([70, 71], False)

    async def finish(self, trajectory):
        return {}

    async def close(self):
        self.closed = True


def test_episode_hook_factory_runs_multi_turn_episodes(model_dir, snapshots):
    hooks = []

    def factory(group):
        if group.env == "broken":
            raise ConnectionError("environment server is down")
        if group.env != "tools":
            return None
        hooks.append(ScriptedToolHook(group))
        return hooks[-1]

    params = _params(temperature=1.0, max_tokens=2, seed=40, max_turns=4, max_total_tokens=10)
    with running(JaxEngine(model_dir), wire.ServerSpec(snapshot_roots=[snapshots]), episode_hook_factory=factory) as b:
        assert b.client.load_snapshot(snapshots / "policy", SNAPSHOT_VERSION).version == SNAPSHOT_VERSION
        groups = [wire.PromptGroup([5], group_id="a", env="tools", task={"target": 3}), wire.PromptGroup([7]),
                  wire.PromptGroup([9], group_id="b", env="broken")]
        stream = b.client.rollout(groups, 1, params)
        trajs = {t.group_id: t for t in stream}
        # Replay episode "a" turn by turn, token in / token out (turn k with derive_seed(episode seed,
        # k)), and group "1".
        episode = derive_seed(derive_seed(40, "a"), 0)
        [turn1, plain_ref] = b.direct([([5, 90], dataclasses.replace(params, seed=derive_seed(episode, 0))),
                                       ([7], first_turn(params, derive_seed(40, "1"), 0))])
        [turn2] = b.direct([([5, 90, *turn1.token_ids, 70, 71], dataclasses.replace(params, seed=derive_seed(episode, 1)))])
        assert b.client.health().status == "serving"
    a, plain, broken = trajs["a"], trajs["1"], trajs["b"]
    assert broken.finish_reason == "error" and "environment server is down" in broken.error
    assert broken.env == "broken" and len(broken.completion_ids) == 0
    assert a.env == "tools" and a.finish_reason == "env_done" and a.num_turns == 2
    assert a.rewards == {"reward": 3.0}
    assert a.prompt_ids.tolist() == [5, 90]
    assert len(turn1.token_ids) == len(turn2.token_ids) == 2
    assert a.completion_ids.tolist() == turn1.token_ids + [70, 71] + turn2.token_ids
    assert hooks[0].seen == [turn1.token_ids, turn2.token_ids]
    assert a.loss_mask.tolist() == [1, 1, 0, 0, 1, 1]
    v = SNAPSHOT_VERSION
    assert a.token_versions.tolist() == [v, v, ENV_VERSION, ENV_VERSION, v, v] and ENV_VERSION == -1
    np.testing.assert_allclose(a.sampler_logprobs, turn1.logprobs + [0.0, 0.0] + turn2.logprobs, atol=1e-5)
    assert np.all(a.sampler_logprobs[a.loss_mask == 1] < 0)
    assert plain.finish_reason == "length" and plain.num_turns == 1 and plain.env == ""
    assert plain.completion_ids.tolist() == plain_ref.token_ids
    assert len(hooks) == 1 and hooks[0].closed


class _ColdEngine:
    """An engine whose warm-up waits for `go`, then fails with `error` if one is given."""

    name = "cold"

    def __init__(self, error: Exception | None = None):
        self.go, self.error, self.warm, self.policy_version = threading.Event(), error, False, 0

    def warm_up(self):
        assert self.go.wait(60)
        if self.error is not None:
            raise self.error
        self.warm = True

    async def generate(self, prompts, params):
        assert self.warm
        return [[Completion([7], [-0.5], "length", self.policy_version)] * params.n for _ in prompts]

    async def load_snapshot(self, path, version):
        assert self.warm
        self.policy_version = version
        return 0.0

    async def close(self):
        pass


@pytest.mark.parametrize("error", [None, RuntimeError("no memory for the programs")])
def test_a_bridge_serves_while_its_engine_warms_up_and_generates_once_warm(error):
    engine = _ColdEngine(error)
    with running(WarmingUp(engine)) as b, concurrent.futures.ThreadPoolExecutor(1) as pool:
        rollout = pool.submit(lambda: list(b.client.rollout([[1, 2]], 2, _params(max_tokens=1))))
        deadline = time.monotonic() + 60
        while b.client.stats()["episodes_in_flight"] < 2:  # Health and Stats answer meanwhile
            assert time.monotonic() < deadline, "the rollout never started"
            time.sleep(0.01)
        assert b.client.health().status == "serving" and not rollout.done()
        engine.go.set()
        trajs = rollout.result(60)
    if error is None:
        assert [t.completion_ids.tolist() for t in trajs] == [[7], [7]] and all(t.error == "" for t in trajs)
    else:  # each episode fails with the warm-up's error; the bridge serves on
        assert all(t.finish_reason == "error" and "no memory for the programs" in t.error for t in trajs), trajs
