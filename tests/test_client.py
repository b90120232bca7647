"""A real bridge process (the JAX engine over a tiny Qwen3) driven through BridgeClient.

The sampler's logprobs must be the learner's (`completion_logprobs` on the same tokens, same
temperature), before and after a snapshot swaps the weights in place.
"""

import dataclasses
import threading
import time

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bridge.client import BridgeClient, BridgeRequestError
from bridge.engines.base import SamplingParams
from bridge.wire import BridgeLaunch, ServerSpec
from jaxrl.run.processes import BridgeProcess
from jaxrl.logprobs import completion_logprobs
from jaxrl.models import Decoder, load_pretrained
from jaxrl.snapshots import SnapshotWriter
from jaxrl.tiny import build_tiny_model, tiny_config

from xla_flags import xla_flags

CHILD_ENV = {"XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu"}
PROMPTS = [[5, 17, 33, 101], [7, 8], [250, 3, 9, 44, 12, 60, 2]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"), "qwen3", seed=0)


@pytest.fixture(scope="module")
def snapshot_root(tmp_path_factory):
    return tmp_path_factory.mktemp("snapshots")


@pytest.fixture(scope="module")
def bridge(model_dir, snapshot_root):
    launch = BridgeLaunch(model_dir, dtype="float32", server=ServerSpec(snapshot_roots=[snapshot_root]))
    with BridgeProcess.start(launch, env=CHILD_ENV, timeout=120, client_timeout_s=30) as process:
        yield process


@pytest.fixture(scope="module")
def client(bridge):
    return bridge.client


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_pretrained(model_dir, param_dtype="float32", dtype="float32")


def learner_logprobs(model, trajs, temperature):
    """The learner's logprobs of each trajectory's completion (left-padded prompts, right-padded completions)."""
    B = len(trajs)
    P = max(len(t.prompt_ids) for t in trajs)
    C = max(len(t.completion_ids) for t in trajs)
    prompt, pmask = np.zeros((B, P), np.int32), np.zeros((B, P), np.int32)
    comp, cmask = np.zeros((B, C), np.int32), np.zeros((B, C), np.int32)
    for b, t in enumerate(trajs):
        prompt[b, P - len(t.prompt_ids):], pmask[b, P - len(t.prompt_ids):] = t.prompt_ids, 1
        comp[b, :len(t.completion_ids)], cmask[b, :len(t.completion_ids)] = t.completion_ids, 1
    logp, _ = completion_logprobs(model, jnp.asarray(prompt), jnp.asarray(pmask), jnp.asarray(comp),
                                  jnp.asarray(cmask), temperature=temperature)
    logp = np.asarray(logp)
    return [logp[b, :len(t.completion_ids)] for b, t in enumerate(trajs)]


def assert_learner_agrees(model, trajs, temperature, atol=1e-5):
    for t, ref in zip(trajs, learner_logprobs(model, trajs, temperature)):
        np.testing.assert_allclose(t.sampler_logprobs, ref, atol=atol,
                                   err_msg=f"trajectory {t.group_id}/{t.index_in_group}")


def test_streams_every_group_with_shapes_masks_and_versions(client):
    trajs = list(client.rollout(PROMPTS, 4, SamplingParams(temperature=1.0, max_tokens=6, seed=11)))
    assert sorted((t.group_id, t.index_in_group) for t in trajs) == [
        (str(g), i) for g in range(len(PROMPTS)) for i in range(4)]
    for t in trajs:
        assert t.prompt_ids.tolist() == PROMPTS[int(t.group_id)]
        for array in (t.completion_ids, t.sampler_logprobs, t.loss_mask, t.token_versions):
            assert array.shape == (6,)
        assert t.finish_reason == "length" and t.error == ""
        assert t.loss_mask.tolist() == [1] * 6 and t.token_versions.tolist() == [0] * 6
        assert np.all(t.sampler_logprobs <= 0) and np.all(np.isfinite(t.sampler_logprobs))
        assert t.num_turns == 1 and t.generate_s > 0
    # Seeded episodes are reproducible; each episode has its own seed (from the group's and its
    # index), so a group's samples differ from each other.
    again = list(client.rollout(PROMPTS, 4, SamplingParams(temperature=1.0, max_tokens=6, seed=11)))
    key = lambda t: (t.group_id, t.index_in_group)  # noqa: E731
    for a, b in zip(sorted(trajs, key=key), sorted(again, key=key)):
        np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    group0 = {tuple(t.completion_ids.tolist()) for t in trajs if t.group_id == "0"}
    assert len(group0) > 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_are_the_learners(client, reference, temperature):
    trajs = list(client.rollout(PROMPTS, 2, SamplingParams(temperature=temperature, max_tokens=12, seed=3)))
    assert_learner_agrees(reference, trajs, temperature)


def test_finish_reasons_stop_on_a_stop_token_and_length_on_max_tokens(client, reference):
    # Greedy, so both rollouts follow the same tokens until the stop token ends one.
    free = {t.group_id: t for t in client.rollout(PROMPTS, 2, SamplingParams(temperature=0.0, max_tokens=8))}
    assert all(t.finish_reason == "length" and len(t.completion_ids) == 8 for t in free.values())
    stop_id = int(free["0"].completion_ids[3])
    stopped = {t.group_id: t for t in client.rollout(
        PROMPTS, 2, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(stop_id,)))}
    for g, t in stopped.items():
        ids = free[g].completion_ids.tolist()
        if stop_id in ids:
            end = ids.index(stop_id) + 1
            assert t.finish_reason == "stop" and t.completion_ids.tolist() == ids[:end]  # stop token kept
        else:
            assert t.finish_reason == "length" and t.completion_ids.tolist() == ids
    assert stopped["0"].finish_reason == "stop" and len(stopped["0"].completion_ids) <= 4
    # Greedy reports log_softmax(logits): the learner's at temperature 1.
    assert_learner_agrees(reference, list(free.values()) + list(stopped.values()), 1.0)


def test_stop_strings_end_a_completion_with_its_tokens_untouched(client, model_dir):
    from tokenizers import Tokenizer

    decode = Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=4)  # seeded: the same tokens twice
    first = lambda trajs: next(t for t in trajs if (t.group_id, t.index_in_group) == ("0", 0))  # noqa: E731
    ids = first(list(client.rollout(PROMPTS, 2, params))).completion_ids.tolist()
    stop = next(s for k in range(1, 8) if (s := decode([ids[k]]).strip()) and s not in decode(ids[:k]))
    stopped = first(list(client.rollout(PROMPTS, 2, dataclasses.replace(params, stop=(stop,)))))
    got = stopped.completion_ids.tolist()
    assert stopped.finish_reason == "stop" and got == ids[:len(got)]
    assert stop in decode(got) and stop not in decode(got[:-1])


def test_bad_requests_are_refused_and_the_bridge_keeps_serving(client, snapshot_root):
    params = SamplingParams(temperature=1.0, max_tokens=4)
    with pytest.raises(BridgeRequestError) as e:
        list(client.rollout([[1, 2], []], 2, params))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "empty prompt" in e.value.details
    with pytest.raises(BridgeRequestError) as e:
        list(client.rollout([[1, 2]], 0, params))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "group_size=0" in e.value.details
    with pytest.raises(BridgeRequestError) as e:
        client.load_snapshot(snapshot_root / "no-such-snapshots", 1)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(BridgeRequestError) as e:
        list(client.rollout([[1, 2]], 1, params, min_policy_version=99))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert client.health().status == "serving"
    assert len(list(client.rollout(PROMPTS, 2, params))) == 6
    assert client.stats()["request_errors"] >= 4


def test_health_answers_at_once_while_a_long_rollout_runs(client):
    box = {}

    def long_rollout():
        try:
            params = SamplingParams(temperature=1.0, max_tokens=400, seed=0)
            box["trajs"] = list(client.rollout(PROMPTS, 4, params))
        except Exception as e:  # surfaced below
            box["error"] = e

    thread = threading.Thread(target=long_rollout, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while client.stats()["episodes_in_flight"] < len(PROMPTS) * 4:
        assert time.monotonic() < deadline and thread.is_alive(), box
        time.sleep(0.01)
    latencies = []
    while thread.is_alive():  # through the engine's compile and its decoding
        t0 = time.monotonic()
        health = client.health(timeout_s=5)
        latencies.append(time.monotonic() - t0)
        assert health.status == "serving"
        time.sleep(0.02)
    thread.join()
    assert "error" not in box, box.get("error")
    assert len(latencies) >= 3, "the rollout ended before Health was checked; make it longer"
    assert max(latencies) < 1.0, latencies
    assert all(len(t.completion_ids) == 400 for t in box["trajs"])
    print(f"health during a {len(latencies) * 0.02:.1f} s rollout: max {max(latencies) * 1e3:.1f} ms, "
          f"median {sorted(latencies)[len(latencies) // 2] * 1e3:.1f} ms")


def test_snapshots_swap_weights_and_a_different_shape_is_refused(client, model_dir, snapshot_root):
    # Version 1: the served model's params, perturbed, published as a trainer would.
    perturbed = load_pretrained(model_dir, param_dtype="float32", dtype="float32")
    state = nnx.state(perturbed, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(state))))
    state = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), state)
    nnx.update(perturbed, state)
    writer = SnapshotWriter(snapshot_root / "snapshots", perturbed.cfg)
    writer.publish(state, 1)
    writer.close()

    loaded = client.load_snapshot(snapshot_root / "snapshots", 1)
    assert loaded.version == 1 and loaded.load_s > 0
    assert client.health().policy_version == 1
    params = SamplingParams(temperature=0.9, max_tokens=10, seed=5)
    trajs = list(client.rollout(PROMPTS, 2, params, min_policy_version=1))
    assert all(t.token_versions.tolist() == [1] * len(t.completion_ids) for t in trajs)
    assert all(t.policy_version == 1 for t in trajs)
    assert_learner_agrees(perturbed, trajs, 0.9)
    old = load_pretrained(model_dir, param_dtype="float32", dtype="float32")
    assert max(np.abs(t.sampler_logprobs - ref).max()
               for t, ref in zip(trajs, learner_logprobs(old, trajs, 0.9))) > 1e-2

    # Version 2 of another model shape is refused; version 1 keeps serving.
    other_cfg = tiny_config("qwen3", vocab_size=perturbed.cfg.vocab_size, num_layers=3)
    other = SnapshotWriter(snapshot_root / "other", other_cfg)
    other.publish(nnx.state(Decoder(other_cfg, nnx.Rngs(1)), nnx.Param), 2)
    other.close()
    with pytest.raises(BridgeRequestError) as e:
        client.load_snapshot(snapshot_root / "other", 2)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "num_layers" in e.value.details
    assert client.health().policy_version == 1
    trajs = list(client.rollout(PROMPTS, 2, params, min_policy_version=1))
    assert all(t.policy_version == 1 for t in trajs)
    assert_learner_agrees(perturbed, trajs, 0.9)
    stats = client.stats()
    assert stats["snapshot_loads"] == 1 and stats["snapshot_refusals"] == 1


def test_a_second_client_sees_the_same_bridge(bridge):
    with BridgeClient(bridge.address, timeout_s=5, token=bridge.token) as other:
        health = other.health()
    assert health.engine == "jax" and health.status == "serving"
