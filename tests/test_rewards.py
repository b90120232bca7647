"""Reward weights (the weighted sum of the functions that apply, the learner's columns) and the
watch over steps without a learning signal or without any score."""

import logging
import math

import numpy as np
import pytest

from bridge.envs.spec import RewardSpec
from bridge.wire import TrajectoryData
from jaxrl.run.rewards import NothingScored, RewardWeights, SignalWatch


def test_weighted_reward_leaves_out_functions_that_do_not_apply():
    weights = RewardWeights([RewardSpec("env"), RewardSpec("m:f", weight=0.5, name="x")])
    assert weights.total({"env": 1.0, "x": 2.0}) == 2.0
    assert weights.total({"x": 2.0}) == 1.0
    assert weights.total({}) is None
    assert weights.columns({"x": 2.0})[1] == 2.0 and math.isnan(weights.columns({"x": 2.0})[0])


def _group(*totals):
    return [TrajectoryData("g", i, np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.float32),
                           np.ones(1, np.uint8), np.zeros(1, np.int64), {} if r is None else {"env": r}, "stop")
            for i, r in enumerate(totals)]


def test_steps_without_a_learning_signal_are_counted_with_one_warning_while_they_last(caplog):
    watch = SignalWatch(RewardWeights([RewardSpec("env")]), max_unscored_steps=3)
    with caplog.at_level(logging.INFO, logger="jaxrl.run.rewards"):
        assert watch.observe(1, [_group(0.0, 0.0), _group(1.0, 1.0)], unscored=0, scored=4) == {
            "rollout/no_learning_signal": 1.0, "rollout/groups_learning": 0.0}
        assert watch.observe(2, [_group(0.0, 0.0)], unscored=0, scored=2)["rollout/no_learning_signal"] == 1.0
        assert watch.observe(3, [], unscored=0, scored=8)["rollout/no_learning_signal"] == 1.0  # all filtered out
        assert watch.observe(4, [_group(0.0, 1.0), _group(1.0, 1.0)], unscored=0, scored=4) == {
            "rollout/no_learning_signal": 0.0, "rollout/groups_learning": 1.0}
        watch.observe(5, [_group(None, 1.0)], unscored=1, scored=1)  # one reward: no comparison
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and warnings[0].startswith("step 1: no learning signal") and "step 5" in warnings[1]
    assert any("learning signal is back after 3 steps" in r.getMessage() for r in caplog.records)


def test_a_run_that_no_reward_function_scores_stops_after_max_unscored_steps():
    watch = SignalWatch(RewardWeights([RewardSpec("env")]), max_unscored_steps=2)
    watch.observe(1, [_group(None, None)], unscored=2, scored=0)
    watch.observe(2, [_group(None, 1.0)], unscored=1, scored=1)  # something scored: the count starts over
    watch.observe(3, [_group(None, None)], unscored=2, scored=0)
    with pytest.raises(NothingScored, match=r"step 4: no reward function scored any episode for 2 steps in a row"):
        watch.observe(4, [], unscored=2, scored=0)
