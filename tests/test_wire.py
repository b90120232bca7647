"""Wire encoding: raw little-endian arrays round-trip, and bad bytes are an error, not a misread."""

import numpy as np
import pytest

from bridge import wire
from bridge.engines.base import SamplingParams, derive_seed
from bridge.proto import bridge_pb2 as pb


def _trajectory():
    traj = wire.TrajectoryData("g7", 2, np.array([11, 12, 13], np.int32), env="calc", num_turns=2, generate_s=0.5,
                               env_s=0.25, total_s=1.0)
    traj.append([5, 6, 7], [-0.5, -1.25, -2.0], True, 3)
    traj.append([40, 41], [], False, -1)
    traj.append([8], [-0.125], True, 4)
    traj.rewards = {"correct": 1.0, "format": 0.5}
    traj.finish_reason = "env_done"
    traj.notices = ["reset's observation shows the model nothing"]
    return traj


def test_trajectory_round_trips_as_numpy_arrays():
    data = wire.trajectory_from_proto(pb.Trajectory.FromString(
        wire.trajectory_to_proto(_trajectory()).SerializeToString()))
    assert (data.group_id, data.index_in_group, data.env, data.num_turns) == ("g7", 2, "calc", 2)
    np.testing.assert_array_equal(data.prompt_ids, [11, 12, 13])
    np.testing.assert_array_equal(data.completion_ids, [5, 6, 7, 40, 41, 8])
    np.testing.assert_array_equal(data.sampler_logprobs, [-0.5, -1.25, -2.0, 0, 0, -0.125])
    np.testing.assert_array_equal(data.loss_mask, [1, 1, 1, 0, 0, 1])
    np.testing.assert_array_equal(data.token_versions, [3, 3, 3, -1, -1, 4])
    assert data.completion_ids.dtype == np.int32 and data.sampler_logprobs.dtype == np.float32
    assert data.loss_mask.dtype == np.uint8 and data.token_versions.dtype == np.int64
    assert data.rewards == {"correct": 1.0, "format": 0.5}
    assert data.finish_reason == "env_done" and data.error == ""
    assert data.notices == ["reset's observation shows the model nothing"]
    assert (data.generate_s, data.env_s, data.total_s) == (0.5, 0.25, 1.0)
    assert data.policy_version == 3 and data.num_completion_tokens == 6
    data.completion_ids[0] = 1  # decoded arrays are the trainer's own, writable


def test_arrays_are_little_endian_bytes():
    msg = wire.trajectory_to_proto(_trajectory())
    assert msg.completion_ids == np.array([5, 6, 7, 40, 41, 8], "<i4").tobytes()
    assert msg.token_versions == np.array([3, 3, 3, -1, -1, 4], "<i8").tobytes()
    assert msg.loss_mask == bytes([1, 1, 1, 0, 0, 1])
    assert msg.protocol_version == wire.PROTOCOL_VERSION == 3


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_routes_round_trip_and_bad_ones_are_refused(dtype):
    traj = _trajectory()
    traj.routes = np.arange(8 * 4, dtype=dtype).reshape(8, 4)  # 9 tokens, the last never fed
    msg = wire.trajectory_to_proto(traj)
    data = wire.trajectory_from_proto(pb.Trajectory.FromString(msg.SerializeToString()))
    assert data.routes.dtype == dtype
    np.testing.assert_array_equal(data.routes, traj.routes)
    assert wire.trajectory_from_proto(wire.trajectory_to_proto(_trajectory())).routes.shape == (0, 0)
    for field, value, message in [("route_width", 3, "32 expert ids are not whole routes of 3"),
                                  ("route_itemsize", 4, "route_width 4 of 4-byte ids"),
                                  ("routes", np.zeros(40, dtype).tobytes(), "are not whole routes of 4 for at most its 9")]:
        bad = pb.Trajectory.FromString(msg.SerializeToString())
        setattr(bad, field, value)
        with pytest.raises(wire.WireError, match=message):
            wire.trajectory_from_proto(bad)


def test_an_episode_keeps_each_tokens_route_from_the_turn_that_first_fed_it():
    traj = _trajectory()
    traj.add_routes(None)
    assert traj.routes.shape == (0, 0)
    traj.add_routes(np.full((5, 2), 1, np.uint8))  # turn 1: prompt (3) and its completion's first 2
    traj.add_routes(np.full((8, 2), 2, np.uint8))  # turn 2 fed the whole context again (a prefill)
    np.testing.assert_array_equal(traj.routes[:, 0], [1] * 5 + [2] * 3)


@pytest.mark.parametrize("field, value, message", [
    ("completion_ids", b"\x01\x02\x03", "not a whole number of int32"),
    ("sampler_logprobs", np.zeros(5, "<f4").tobytes(), "5 items, expected 6"),
    ("loss_mask", bytes(7), "7 items, expected 6"),
    ("token_versions", np.zeros(6, "<i4").tobytes(), "3 items, expected 6"),
    ("prompt_ids", b"\x00" * 5, "prompt_ids: 5 bytes"),
])
def test_bad_byte_lengths_are_refused(field, value, message):
    msg = wire.trajectory_to_proto(_trajectory())
    setattr(msg, field, value)
    with pytest.raises(wire.WireError, match=message):
        wire.trajectory_from_proto(msg)


def test_another_protocol_version_is_refused():
    msg = wire.trajectory_to_proto(_trajectory())
    msg.protocol_version = 1
    with pytest.raises(wire.WireError, match="protocol version 1"):
        wire.trajectory_from_proto(msg)


def test_sampling_params_round_trip_without_their_seed():
    params = SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=20, max_tokens=33,
                            stop_token_ids=(2, 9), stop=("</answer>",), seed=123)
    back = wire.sampling_from_proto(pb.SamplingParams.FromString(
        wire.sampling_to_proto(params).SerializeToString()), n=4)
    assert back.temperature == pytest.approx(0.7) and back.top_p == pytest.approx(0.9)
    assert (back.n, back.top_k, back.max_tokens, back.stop_token_ids, back.stop, back.seed) == (
        4, 20, 33, (2, 9), ("</answer>",), None)  # seeds travel per group
    assert wire.sampling_from_proto(wire.sampling_to_proto(SamplingParams(max_tokens=5))).top_p == 1.0


def test_a_groups_seed_is_its_identity_not_its_position():
    params = SamplingParams(max_tokens=4, seed=7)

    def seeds(groups):
        request = wire.rollout_request(groups, group_size=2, sampling=params)
        return {g.group_id: wire.group_from_proto(g).seed for g in request.groups}

    a, b = wire.PromptGroup([1], group_id="3-0"), wire.PromptGroup([1], group_id="3-1")
    both = seeds([a, b])
    assert seeds([b, a]) == both and seeds([b]) == {"3-1": both["3-1"]}
    assert both["3-0"] == derive_seed(7, "3-0") and both["3-0"] != both["3-1"]
    assert seeds([wire.PromptGroup([1], group_id="own", seed=2**64 - 1)]) == {"own": 2**64 - 1}  # kept
    unseeded = wire.rollout_request([a], 2, SamplingParams(max_tokens=4))
    assert wire.group_from_proto(unseeded.groups[0]).seed is None


def test_derived_seeds_are_hashes_not_offsets():
    seeds = {derive_seed(s, i) for s in range(100) for i in range(100)}
    assert len(seeds) == 100 * 100 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(1, 0) != derive_seed(0, 1) and derive_seed(5, "0-1") != derive_seed(5, "0-1", 0)


def test_unset_top_p_reads_as_no_top_p_and_bad_values_raise():
    assert wire.sampling_from_proto(pb.SamplingParams(max_tokens=5)).top_p == 1.0
    with pytest.raises(ValueError, match="max_tokens=0"):
        wire.sampling_from_proto(pb.SamplingParams())
    with pytest.raises(wire.WireError, match="stop_token_ids"):
        wire.sampling_from_proto(pb.SamplingParams(max_tokens=5, stop_token_ids=b"\x01"))


def test_rollout_request_names_plain_prompts_and_keeps_tasks():
    request = wire.rollout_request(
        [[1, 2], np.array([3, 4, 5]), wire.PromptGroup([6], group_id="q", env="calc", task={"x": 1})],
        group_size=3, sampling=SamplingParams(max_tokens=4, max_turns=5), min_policy_version=2,
    )
    assert request.protocol_version == wire.PROTOCOL_VERSION
    groups = [wire.group_from_proto(g) for g in request.groups]
    assert [g.group_id for g in groups] == ["0", "1", "q"]
    np.testing.assert_array_equal(groups[1].prompt_ids, [3, 4, 5])
    assert groups[2].env == "calc" and groups[2].task == {"x": 1} and groups[0].task is None
    assert (request.group_size, request.min_policy_version, request.max_turns) == (3, 2, 5)


def test_bad_task_json_is_a_wire_error():
    with pytest.raises(wire.WireError, match="task_json"):
        wire.group_from_proto(pb.PromptGroup(group_id="a", prompt_ids=wire.encode_ids([1]), task_json="{"))


def test_a_bridge_launch_round_trips_as_json_and_a_bad_one_says_why():
    launch = wire.BridgeLaunch("m", engine="vllm", max_batch=8, engine_kwargs={"gpu_memory_utilization": 0.4},
                               envs="envs.json", server=wire.ServerSpec(port=7, snapshot_roots=["/run/snapshots"],
                                                                        limits=wire.Limits(max_groups=5)),
                               cpus=[1, 0])
    assert wire.BridgeLaunch.from_json(launch.to_json()) == launch and launch.cpus == (1, 0)
    assert wire.BridgeLaunch.from_json('{"model": "m"}') == wire.BridgeLaunch("m")
    for text, message in [("[1]", "not a bridge launch"), ('{"model": "m", "gpus": 2}', "gpus"),
                          ('{"model": "m", "server": {"limits": {"max_groups": 0}}}',
                           "--max-groups must be at least 1")]:
        with pytest.raises(ValueError, match=message):
            wire.BridgeLaunch.from_json(text)
