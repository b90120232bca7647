"""Reward weights: the weighted sum of the functions that apply, and the learner's columns."""

import math

from bridge.envs.spec import RewardSpec
from jaxrl.run.rewards import RewardWeights


def test_weighted_reward_leaves_out_functions_that_do_not_apply():
    weights = RewardWeights([RewardSpec("env"), RewardSpec("m:f", weight=0.5, name="x")])
    assert weights.total({"env": 1.0, "x": 2.0}) == 2.0
    assert weights.total({"x": 2.0}) == 1.0
    assert weights.total({}) is None
    assert weights.columns({"x": 2.0})[1] == 2.0 and math.isnan(weights.columns({"x": 2.0})[0])
