"""Trajectories to a learner batch: the one path for rollouts and demonstrations."""

import math

import numpy as np
import pytest

from bridge.envs.spec import RewardSpec
from bridge.wire import TrajectoryData
from jaxrl.compilation import bucket
from jaxrl.run.batches import learner_batch, learner_widths, prompt_width
from jaxrl.run.config import TrainConfig
from jaxrl.run.typed_config import from_dict
from jaxrl.run.rewards import RewardWeights


def traj(prompt, completion, mask, rewards=None, finish="stop"):
    mask = np.array(mask, np.uint8)
    return TrajectoryData("g", 0, np.array(prompt, np.int32), np.array(completion, np.int32),
                          np.where(mask, -0.5, 0.0).astype(np.float32), mask, np.where(mask, 0, -1).astype(np.int64),
                          rewards or {}, finish)


def test_prompts_left_completions_right_padding_rows_and_reward_columns():
    weights = RewardWeights([RewardSpec("env"), RewardSpec("m:f", weight=0.5, name="x")])
    trajs = [traj([5, 6, 7], [1, 2, 3], [1, 0, 1], {"env": 1.0}),
             traj([5], [4] * 20, [1] * 14 + [0] * 6, {"env": 0.0, "x": 2.0}, finish="length")]
    batch = learner_batch(trajs, 4, bucket(3), 16, 0, weights, sampler_logp=True, mask_truncated=True)
    assert {k: v.shape for k, v in batch.items()} == {
        "prompt_BxP": (4, 16), "prompt_mask_BxP": (4, 16), "completion_BxC": (4, 16), "completion_mask_BxC": (4, 16),
        "loss_mask_BxC": (4, 16), "rewards_BxR": (4, 2), "sampler_logp_BxC": (4, 16)}
    assert list(batch["prompt_BxP"][0, -3:]) == [5, 6, 7] and batch["prompt_mask_BxP"][0].sum() == 3
    assert list(batch["completion_BxC"][0, :4]) == [1, 2, 3, 0] and list(batch["loss_mask_BxC"][0, :3]) == [1, 0, 1]
    assert batch["completion_mask_BxC"][1].sum() == 16  # environment tokens past the budget are cut
    assert batch["loss_mask_BxC"][1].sum() == 0  # truncated: no loss (overlong filtering)
    assert batch["rewards_BxR"][0, 0] == 1.0 and math.isnan(batch["rewards_BxR"][0, 1])  # unweighted columns
    assert list(batch["rewards_BxR"][1]) == [0.0, 2.0]
    assert batch["sampler_logp_BxC"][0, 0] == -0.5 and batch["sampler_logp_BxC"][0, 1] == 0.0
    # padding rows: one prompt token to attend to, no loss, constant reward
    assert batch["loss_mask_BxC"][2:].sum() == 0 and (batch["prompt_mask_BxP"][2:].sum(1) == 1).all()
    assert (batch["rewards_BxR"][2:] == 0).all()


def test_an_moe_batch_lays_the_recorded_routes_out_with_their_tokens():
    from jaxrl.tiny import tiny_config

    model = tiny_config("qwen3_moe")  # 2 MoE layers x top 2: 4 expert ids a token
    routed = traj([5, 6, 7], [1, 2, 3, 4], [1, 1, 0, 1])
    routed.routes = np.arange(6 * 4, dtype=np.uint8).reshape(6, 4) % 8  # 7 tokens, the last never fed
    batch = learner_batch([routed, traj([5], [1], [1])], 4, 8, 6, 0, model=model)
    prompts, completions = batch["prompt_routes_BxPxU"], batch["completion_routes_BxCxU"]
    assert prompts.shape == (4, 8, 4) and completions.shape == (4, 6, 4) and prompts.dtype == np.uint8
    np.testing.assert_array_equal(prompts[0, -3:], routed.routes[:3])
    np.testing.assert_array_equal(completions[0, :3], routed.routes[3:])
    assert (prompts[0, :-3] == 255).all() and (completions[0, 3:] == 255).all()  # padding, the unfed last token
    assert (prompts[1:] == 255).all() and (completions[1:] == 255).all()  # no routes recorded, padding rows
    routed.routes = np.zeros((6, 3), np.uint8)
    with pytest.raises(ValueError, match="carries routes of 3 expert ids a token.*routes 4 a token over 8"):
        learner_batch([routed], 4, 8, 6, 0, model=model)


def test_a_supervised_batch_has_one_zero_reward_column():
    batch = learner_batch([traj([5, 6, 7], [8, 9, 10, 11], [1, 1, 0, 1]), traj([4], [3], [1])], 2, 4, 6, 0)
    np.testing.assert_array_equal(batch["prompt_BxP"], [[0, 5, 6, 7], [0, 0, 0, 4]])
    np.testing.assert_array_equal(batch["completion_BxC"], [[8, 9, 10, 11, 0, 0], [3, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["loss_mask_BxC"], [[1, 1, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0]])
    assert batch["rewards_BxR"].shape == (2, 1) and not batch["rewards_BxR"].any()


def test_what_does_not_fit_is_an_error_never_cut_model_tokens():
    with pytest.raises(ValueError, match="3 prompt and 4 completion tokens; the batch holds 2 and 6"):
        learner_batch([traj([5, 6, 7], [8, 9, 10, 11], [1, 1, 0, 1])], 1, 2, 6, 0)
    with pytest.raises(ValueError, match="the batch holds 4 and 2"):
        learner_batch([traj([5], [8, 9, 10], [1, 1, 1])], 1, 4, 2, 0)
    with pytest.raises(ValueError, match="2 trajectories do not fit a batch of 1 rows"):
        learner_batch([traj([5], [8], [1])] * 2, 1, 4, 2, 0)


def test_a_steps_prompt_width_is_the_narrowest_of_the_runs_that_holds_its_prompts():
    base = {"run_dir": "r", "model": {"dir": "m"}, "envs": [{"name": "echo", "bundled": "echo"}]}
    one = {**base, "rollout": {"max_prompt_tokens": 512}, "learner": {"prompt_widths": 1}}
    assert learner_widths(from_dict(TrainConfig, one)) == (512,)
    cfg = from_dict(TrainConfig, {**base, "rollout": {"max_prompt_tokens": 512}})  # by default: one per 128 tokens
    assert learner_widths(cfg) == (128, 256, 384, 512)
    assert learner_widths(from_dict(TrainConfig, {**base, "rollout": {"max_prompt_tokens": 64}})) == (64,)
    assert learner_widths(from_dict(TrainConfig, {**base, "rollout": {"max_prompt_tokens": 1792}})) == (512, 896,
                                                                                                         1408, 1792)
    with pytest.raises(ValueError, match="rollout.max_prompt_tokens is null: a run sizes it"):
        learner_widths(from_dict(TrainConfig, base))
    assert [prompt_width([traj([1] * n, [1], [1]) for n in (3, k)], cfg) for k in (100, 129, 384, 385, 512, 600)] == \
        [128, 256, 384, 512, 512, 600]  # longer than the widest: widened to it
    packed = from_dict(TrainConfig, {**base, "rollout": {"max_prompt_tokens": 512}, "learner": {"pack_tokens": 1024, "prompt_widths": 4}})
    assert learner_widths(packed) == (512,) and prompt_width([traj([1] * 100, [1], [1])], packed) == 512
