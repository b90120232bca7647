"""Trajectories on disk: groups written and read back exactly, and a bad line named."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl.run.trajectory_file import TrajectoryFileError, load_trajectories, save_trajectories
from test_collection import traj


def test_groups_come_back_exactly(tmp_path):
    groups = [[traj("a", 0, [1, 2], [3, 4, 5], [1, 0, 1], {"env": 1.0}),
               traj("a", 1, [1, 2], [6], [1], {"env": 0.0, "fmt": 0.5}, finish="length", version=3)],
              [traj("b", 0, [7], [8, 9], [1, 1], {}, env="dice")]]
    groups[1][0].routes = np.asarray([[1, 2], [3, 4]], np.uint8)  # an MoE policy's
    save_trajectories(tmp_path / "t.jsonl", groups[:1])
    save_trajectories(tmp_path / "t.jsonl", groups[1:], append=True)
    back = load_trajectories(tmp_path / "t.jsonl")
    assert [[t.group_id for t in g] for g in back] == [["a", "a"], ["b"]]
    for want, got in zip([t for g in groups for t in g], [t for g in back for t in g]):
        for key in ("prompt_ids", "completion_ids", "sampler_logprobs", "loss_mask", "token_versions"):
            assert np.array_equal(getattr(want, key), getattr(got, key)) and getattr(want, key).dtype == getattr(
                got, key).dtype
        assert np.array_equal(want.routes, got.routes) and got.routes.shape == want.routes.shape
        assert (got.rewards, got.finish_reason, got.env, got.metrics) == (want.rewards, want.finish_reason, want.env,
                                                                          want.metrics)


def test_a_line_that_is_not_a_trajectory_is_named(tmp_path):
    path = tmp_path / "t.jsonl"
    save_trajectories(path, [[traj("a", 0, [1], [2], [1], {"env": 1.0})]])
    path.write_text(path.read_text() + '{"group_id": "b"}\n')
    with pytest.raises(TrajectoryFileError, match=r"t.jsonl line 2: not a trajectory \(KeyError"):
        load_trajectories(path)
