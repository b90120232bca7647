"""Advantages against a plain float64 NumPy reference written here."""

import itertools

import jax
import numpy as np
import pytest

from jaxrl.advantages import AdvantageConfig, compute_advantages

G = 4


def ref_column(r, group_size, mode, scale, eps):
    """One reward column; NaN entries are missing and get advantage 0."""
    adv = np.zeros(len(r))
    present = [x for x in r if not np.isnan(x)]
    batch_std = np.std(present, ddof=1) if len(present) > 1 else 0.0
    for start in range(0, len(r), group_size):
        idx = [i for i in range(start, start + group_size) if not np.isnan(r[i])]
        vals = np.array([r[i] for i in idx])
        for i in idx:
            if mode == "rloo":
                others = [r[j] for j in idx if j != i]
                adv[i] = r[i] - np.mean(others) if others else 0.0
            elif mode == "dr_grpo" or scale == "none":
                adv[i] = r[i] - vals.mean()
            else:
                std = (np.std(vals, ddof=1) if len(vals) > 1 else 0.0) if scale == "group" else batch_std
                adv[i] = (r[i] - vals.mean()) / (std + eps)
    return adv


def ref_combined(rewards, weights):
    return np.array([np.nan if np.isnan(row).all() else np.nansum(row * weights) for row in rewards])


def ref_advantages(rewards, weights, group_size, mode, scale, combine, eps=1e-4):
    if combine == "sum_then_normalize":
        return ref_column(ref_combined(rewards, weights), group_size, mode, scale, eps)
    return sum(w * ref_column(rewards[:, k], group_size, mode, scale, eps) for k, w in enumerate(weights))


def ref_stats(rewards, weights, group_size):
    combined = ref_combined(rewards, weights)
    present = combined[~np.isnan(combined)]
    zero_std = []
    for start in range(0, len(combined), group_size):
        vals = combined[start : start + group_size]
        vals = vals[~np.isnan(vals)]
        zero_std.append(len(vals) < 2 or np.all(vals == vals[0]))
    return {
        "reward_mean": present.mean(),
        "reward_std": np.std(present, ddof=1),
        "frac_zero_std_groups": np.mean(zero_std),
    }


def make_rewards(seed=0, groups=6):
    """Three reward functions with missing entries of every kind."""
    rng = np.random.default_rng(seed)
    B = groups * G
    rewards = np.stack(
        [rng.normal(size=B), rng.integers(0, 2, size=B).astype(float), rng.normal(size=B) * 2], 1
    )
    rewards[: 3 * G, 2] = np.nan  # function 2 only applies to the second half (another env)
    rewards[1 * G : 1 * G + 3, 0] = np.nan  # group 1: function 0 has a single reward
    rewards[2 * G : 3 * G, 1] = 1.0  # group 2: function 1 has zero variance
    rewards[4 * G + 1] = np.nan  # a sequence no function applies to
    return rewards.astype(np.float32)


CASES = [
    ("grpo", "group"),
    ("grpo", "batch"),
    ("grpo", "none"),
    ("dr_grpo", "group"),
    ("rloo", "group"),
]


@pytest.mark.parametrize(
    "mode_scale,combine",
    list(itertools.product(CASES, ["sum_then_normalize", "normalize_then_sum"])),
)
def test_matches_numpy_reference(mode_scale, combine):
    mode, scale = mode_scale
    rewards = make_rewards()
    weights = (1.0, 0.5, 2.0)
    cfg = AdvantageConfig(mode=mode, scale_rewards=scale, combine=combine, reward_weights=weights)
    adv_B, stats = compute_advantages(rewards, G, cfg)
    want = ref_advantages(rewards.astype(np.float64), np.array(weights), G, mode, scale, combine)
    np.testing.assert_allclose(np.asarray(adv_B), want, atol=1e-5, rtol=0)
    assert adv_B[4 * G + 1] == 0.0  # the sequence without any reward
    for key, value in ref_stats(rewards.astype(np.float64), np.array(weights), G).items():
        np.testing.assert_allclose(float(stats[key]), value, atol=1e-5, rtol=0, err_msg=key)


def test_grpo_std_is_unbiased_like_torch_std():
    rewards = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)
    adv_B, _ = compute_advantages(rewards, 4, AdvantageConfig(eps=0.0))
    std = np.sqrt(((np.arange(1, 5) - 2.5) ** 2).sum() / 3)  # ddof=1
    np.testing.assert_allclose(np.asarray(adv_B), (np.arange(1, 5) - 2.5) / std, rtol=1e-6)


def test_rloo_is_leave_one_out_baseline():
    rewards = np.array([[1.0], [2.0], [3.0], [7.0]], np.float32)
    adv_B, _ = compute_advantages(rewards, 4, AdvantageConfig(mode="rloo"))
    want = [r - (rewards.sum() - r) / 3 for r in rewards[:, 0]]
    np.testing.assert_allclose(np.asarray(adv_B), want, rtol=1e-6)


def test_missing_reward_is_excluded_not_zero():
    # With NaN read as 0 the group mean would be 1.5 instead of 2.
    rewards = np.array([[1.0], [3.0], [np.nan], [2.0]], np.float32)
    adv_B, _ = compute_advantages(rewards, 4, AdvantageConfig(mode="dr_grpo"))
    np.testing.assert_allclose(np.asarray(adv_B), [-1.0, 1.0, 0.0, 0.0], atol=1e-6)


def test_jit_with_static_config_matches_eager():
    rewards = make_rewards(seed=1)
    cfg = AdvantageConfig(combine="normalize_then_sum", reward_weights=(1.0, 1.0, 1.0))
    eager, _ = compute_advantages(rewards, G, cfg)
    jitted, _ = jax.jit(compute_advantages, static_argnums=(1, 2))(rewards, G, cfg)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), atol=1e-6)


def test_config_from_list_is_hashable():
    cfg = AdvantageConfig(reward_weights=[1, 2])
    assert cfg.reward_weights == (1.0, 2.0) and hash(cfg) == hash(AdvantageConfig(reward_weights=(1.0, 2.0)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mode": "ppo"}, r"AdvantageConfig.mode='ppo' is not one of \('grpo', 'dr_grpo', 'rloo'\)"),
        ({"scale_rewards": "std"}, r"scale_rewards='std' is not one of \('group', 'batch', 'none'\)"),
        ({"combine": "sum"}, r"combine='sum' is not one of"),
        ({"reward_weights": ()}, r"reward_weights"),
        ({"reward_weights": (1.0, float("nan"))}, r"reward_weights"),
        ({"eps": -1.0}, r"eps"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdvantageConfig(**kwargs)


@pytest.mark.parametrize(
    "shape,group_size,cfg,match",
    [
        ((10, 1), 4, AdvantageConfig(), r"group_size=4 does not divide the batch size 10"),
        ((8, 1), 1, AdvantageConfig(), r"group_size=1 must be >= 2"),
        ((8,), 4, AdvantageConfig(), r"rewards_BxR has shape \(8,\); expected \(batch, num_reward_fns\)"),
        (
            (8, 3),
            4,
            AdvantageConfig(reward_weights=(1.0, 2.0)),
            r"reward_weights has 2 entries .* 3 reward functions",
        ),
    ],
)
def test_bad_rewards_raise_before_tracing(shape, group_size, cfg, match):
    rewards = np.zeros(shape, np.float32)
    with pytest.raises(ValueError, match=match):
        compute_advantages(rewards, group_size, cfg)
    # Under jit the same check fires while tracing, before anything is compiled.
    with pytest.raises(ValueError, match=match):
        jax.jit(compute_advantages, static_argnums=(1, 2))(rewards, group_size, cfg)
