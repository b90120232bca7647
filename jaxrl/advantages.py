"""Group-relative advantages, as pure jittable functions.

Layout: a batch holds ``B = N * G`` sequences, ``G`` per prompt, with the sequences of a
group contiguous (batch index ``b`` belongs to group ``b // G``).

Missing rewards: a reward function returns None where it does not apply; in the float
arrays here that is NaN. A NaN reward is excluded, never read as zero:

* ``sum_then_normalize``: the sequence reward is the weighted sum of its non-NaN rewards
  (TRL's nansum). A sequence whose rewards are all NaN has no reward: it is left out of
  its group's statistics and gets advantage 0.
* ``normalize_then_sum``: each reward function is normalised on its own, with group
  statistics over its non-NaN entries only; a NaN entry contributes advantage 0.

Standard deviations are unbiased (ddof=1), as ``torch.std`` in TRL; a group with fewer than
two rewards has std 0 (and so advantage 0).

Configs are frozen and hashable: under ``jax.jit`` pass ``cfg`` and ``group_size`` as
static arguments. Shape and config errors raise ValueError in Python before tracing.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jaxrl.options import option

MODES = ("grpo", "dr_grpo", "rloo")
SCALE_REWARDS = ("group", "batch", "none")
COMBINES = ("sum_then_normalize", "normalize_then_sum")


def _check_choice(owner: str, key: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{key}={value!r} is not one of {allowed}")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """How rewards become advantages.

    mode: ``grpo`` ``(r - mean_g) / (std + eps)``, ``dr_grpo`` ``r - mean_g``, ``rloo``
      ``r_i - mean_{j != i} r_j``.
    scale_rewards: the std ``grpo`` divides by: ``group``, ``batch`` (whole batch, around the
      batch mean) or ``none``. Only ``grpo`` scales.
    combine: how several reward functions merge; see the module docstring.
    reward_weights: one weight per reward function; None weighs each 1.
    eps: added to the std so that near-constant groups stay finite (TRL's 1e-4).
    """

    mode: str = option(
        "grpo ((r - mean) / std), dr_grpo (r - mean) or rloo (leave-one-out baseline)", default="grpo")
    scale_rewards: str = option("grpo's std: group, batch or none", default="group")
    combine: str = option(
        "several reward functions: sum_then_normalize or normalize_then_sum", default="sum_then_normalize")
    reward_weights: tuple[float, ...] | None = option(
        "one weight per reward function; a run sets them from rewards[].weight", default=None)
    eps: float = option("added to the std so near-constant groups stay finite", default=1e-4)

    def __post_init__(self):
        _check_choice("AdvantageConfig", "mode", self.mode, MODES)
        _check_choice("AdvantageConfig", "scale_rewards", self.scale_rewards, SCALE_REWARDS)
        _check_choice("AdvantageConfig", "combine", self.combine, COMBINES)
        if self.reward_weights is not None:
            # A list from YAML would make the config unhashable, hence unusable as a static arg.
            weights = tuple(float(w) for w in self.reward_weights)
            if not weights or not all(math.isfinite(w) for w in weights):
                raise ValueError(
                    f"AdvantageConfig.reward_weights={self.reward_weights!r} must be a "
                    "non-empty sequence of finite numbers (or None for all ones)"
                )
            object.__setattr__(self, "reward_weights", weights)
        if not (math.isfinite(self.eps) and self.eps >= 0):
            raise ValueError(f"AdvantageConfig.eps={self.eps!r} must be a finite number >= 0")


def check_group_size(group_size: int, key: str = "group_size") -> None:
    """The one check of a group's size, wherever it is set (`key` names the setting)."""
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"{key}={group_size!r} must be >= 2: GRPO's advantages compare the samples of one "
                         "task with each other")


def _check_groups(batch: int, group_size: int) -> None:
    check_group_size(group_size)
    if batch % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide the batch size {batch}: the batch "
            "must hold whole groups, contiguous in the batch"
        )


def validate_rewards(rewards_BxR, group_size: int, cfg: AdvantageConfig) -> None:
    """Raise ValueError if ``rewards_BxR`` does not fit ``group_size`` and ``cfg``."""
    shape = tuple(jnp.shape(rewards_BxR))
    if len(shape) != 2:
        raise ValueError(
            f"rewards_BxR has shape {shape}; expected (batch, num_reward_fns), e.g. "
            "r[:, None] for a single reward function"
        )
    _check_groups(shape[0], group_size)
    if cfg.reward_weights is not None and len(cfg.reward_weights) != shape[1]:
        raise ValueError(
            f"AdvantageConfig.reward_weights has {len(cfg.reward_weights)} entries but "
            f"rewards_BxR has {shape[1]} reward functions (shape {shape})"
        )


def _unbiased_std(dev_sq_sum, n):
    return jnp.where(n > 1, jnp.sqrt(dev_sq_sum / jnp.maximum(n - 1, 1)), 0.0)


def _column_advantages(r_BxK, valid_BxK, group_size: int, cfg: AdvantageConfig):
    """Advantages of each column independently; invalid entries get 0."""
    B, K = r_BxK.shape
    r_NxGxK = jnp.where(valid_BxK, r_BxK, 0.0).reshape(-1, group_size, K)
    v_NxGxK = valid_BxK.reshape(-1, group_size, K).astype(r_BxK.dtype)
    n_Nx1xK = v_NxGxK.sum(1, keepdims=True)
    mean_Nx1xK = r_NxGxK.sum(1, keepdims=True) / jnp.maximum(n_Nx1xK, 1)
    dev_NxGxK = (r_NxGxK - mean_Nx1xK) * v_NxGxK

    if cfg.mode == "rloo":
        # r_i - mean_{j != i} r_j == n/(n-1) (r_i - mean); no baseline exists when n == 1.
        adv_NxGxK = jnp.where(n_Nx1xK > 1, n_Nx1xK / jnp.maximum(n_Nx1xK - 1, 1), 0.0) * dev_NxGxK
    elif cfg.mode == "grpo" and cfg.scale_rewards == "group":
        std_Nx1xK = _unbiased_std((dev_NxGxK**2).sum(1, keepdims=True), n_Nx1xK)
        adv_NxGxK = dev_NxGxK / (std_Nx1xK + cfg.eps)
    elif cfg.mode == "grpo" and cfg.scale_rewards == "batch":
        v_BxK = v_NxGxK.reshape(B, K)
        n_K = v_BxK.sum(0)
        batch_mean_K = r_NxGxK.reshape(B, K).sum(0) / jnp.maximum(n_K, 1)
        batch_dev_sq_K = (((r_NxGxK.reshape(B, K) - batch_mean_K) * v_BxK) ** 2).sum(0)
        adv_NxGxK = dev_NxGxK / (_unbiased_std(batch_dev_sq_K, n_K) + cfg.eps)
    else:  # dr_grpo, or grpo with scale_rewards == "none"
        adv_NxGxK = dev_NxGxK
    return adv_NxGxK.reshape(B, K)


def _group_has_variance(r_B, group_size: int):
    valid_NxG = ~jnp.isnan(r_B).reshape(-1, group_size)
    r_NxG = r_B.reshape(-1, group_size)
    hi_N = jnp.max(jnp.where(valid_NxG, r_NxG, -jnp.inf), axis=1)
    lo_N = jnp.min(jnp.where(valid_NxG, r_NxG, jnp.inf), axis=1)
    # Exact comparison: an all-equal group gives identical floats; fewer than 2 valid -> False.
    return (valid_NxG.sum(1) >= 2) & (hi_N > lo_N)


def compute_advantages(rewards_BxR, group_size: int, cfg: AdvantageConfig):
    """Per-sequence advantages from per-function rewards (NaN = does not apply).

    Returns ``(adv_B, stats)``; stats are scalars over the combined (weighted-sum) reward:
    ``reward_mean``, ``reward_std`` (unbiased, over sequences with a reward) and
    ``frac_zero_std_groups`` (groups whose rewards are all equal or that hold < 2 rewards).
    """
    validate_rewards(rewards_BxR, group_size, cfg)
    rewards_BxR = jnp.asarray(rewards_BxR, jnp.float32)
    B, R = rewards_BxR.shape
    weights_R = jnp.asarray(cfg.reward_weights or (1.0,) * R, jnp.float32)
    valid_BxR = ~jnp.isnan(rewards_BxR)
    has_reward_B = valid_BxR.any(1)
    summed_B = jnp.where(valid_BxR, rewards_BxR * weights_R, 0.0).sum(1)

    if cfg.combine == "sum_then_normalize":
        adv_B = _column_advantages(summed_B[:, None], has_reward_B[:, None], group_size, cfg)[:, 0]
    else:
        adv_BxR = _column_advantages(rewards_BxR, valid_BxR, group_size, cfg)
        adv_B = (adv_BxR * weights_R).sum(1)

    combined_B = jnp.where(has_reward_B, summed_B, jnp.nan)
    n = has_reward_B.sum()
    mean = jnp.where(has_reward_B, summed_B, 0.0).sum() / jnp.maximum(n, 1)
    dev_sq = (jnp.where(has_reward_B, summed_B - mean, 0.0) ** 2).sum()
    stats = {
        "reward_mean": mean,
        "reward_std": _unbiased_std(dev_sq, n),
        "frac_zero_std_groups": 1.0 - _group_has_variance(combined_B, group_size).mean(),
    }
    return adv_B, stats
