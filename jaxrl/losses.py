"""Policy-gradient losses (clipped, GSPO, CISPO, SAPO), sampler corrections, KL and aggregation.

Per token ``t`` of sequence ``i``, with ``r = exp(logp - logp_old)``, the sequence's advantage
``A`` and ``sg`` the stop-gradient, the ``loss_type`` picks the policy term ``L_t``:

    grpo, bnpo, dapo, dr_grpo   L_t = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
        (PPO's clipped ratio; DAPO's clip-higher is eps_high > eps_low.) With ``dual_clip`` c:
        L_t = min(L_t, -c A) where A < 0 (Ye et al. 2020, "Mastering Complex Control in MOBA
        Games with Deep RL").
    gspo        s_i = exp(mean_t (logp - logp_old)) over the sequence's active tokens;
                L_t = -min(s_i A, clip(s_i, 1 - seq_eps_low, 1 + seq_eps_high) A), the same for every
                token of the sequence (Zheng et al. 2025, "Group Sequence Policy Optimization",
                arXiv:2507.18071, section 4; eps 3e-4 / 4e-4 as there; TRL's
                importance_sampling_level="sequence").
    gspo_token  s_it = sg(s_i) * exp(logp_t - sg(logp_t)): the value of s_i, the gradient of token t
                alone, so a token's advantage may differ (the paper's GSPO-token).
    cispo       L_t = -sg(min(r, cispo_max)) A logp_t: the importance weight is clipped, never the
                gradient, so every token keeps one (MiniMax-M1, arXiv:2506.13585, section 3.1; cispo_max 5
                as ScaleRL, arXiv:2510.13786, and TRL's loss_type="cispo" recommend).
    sapo        L_t = -sigmoid(tau (r - 1)) 4 / tau A, tau = sapo_tau_pos where A > 0 else sapo_tau_neg:
                a soft gate in place of the hard clip, whose gradient weight 4 s(1 - s) r is 1 on-policy
                and decays smoothly off it (Gao et al. 2025, "Soft Adaptive Policy Optimization",
                arXiv:2511.20347; tau 1.0 / 1.05 as TRL's loss_type="sapo").

Corrections of the sampler/learner mismatch, each without gradient, on the policy term only (the KL
term is kept, as TRL does), with ``log k_t = logp_old - logp_sampler``:

    is_level    w_t = exp(log k_t) per token, or exp(mean_t log k_t) per sequence; truncated
                (min(w, is_max), Yao et al. 2025 "Your Efficient RL Framework Secretly Brings You
                Off-Policy RL Training") or masked (0 outside [is_min, is_max]); L_t <- w_t L_t.
    token_mask  [low, high]: L_t <- 0 where k_t leaves [low, high] (IcePop, Ling team 2025, "Every
                Step Evolves: Scaling RL for Trillion-Scale Thinking Model", arXiv:2510.18855;
                SkyRL's and AReaL's token masks); logged as ``token_mask_frac``.
    opsm_threshold  delta: a sequence with A < 0 and mean_t (logp_sampler - sg(logp)) > delta carries
                no policy gradient (DeepSeek-V3.2's off-policy sequence masking, arXiv:2512.02556,
                section 3.1; TRL's off_policy_mask_threshold); logged as ``opsm_frac`` (of tokens).

A masked token still counts in its normaliser (as in TRL): masking removes a gradient, it does
not re-weight the others.

Then ``L_t <- L_t + beta * k3_t`` with ``k3 = exp(ref - logp) - (ref - logp) - 1``.

On-policy distillation. With ``distill_weight`` lambda > 0 each token's advantage is

    A_t = task_weight * A + lambda * sg(log p_teacher(x_t) - logp_old_t)

where x_t is the token the student (the policy) sampled and p_teacher the teacher's probability of
it: minus the per-token reverse KL ``log p(x_t) - log p_teacher(x_t)`` (its single-sample estimate),
a dense reward that pulls the student's samples toward what the teacher would say, on the student's
own distribution of states (Agarwal et al. 2024, "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes", GKD with lambda = 1, the student's samples, reverse KL;
Lu and Thinking Machines 2025, "On-Policy Distillation": the negative reverse KL per token as the
advantage, discount 0, under the same importance-weighted loss). ``task_weight`` 0 is distillation
alone; the off-policy sequence mask then tests the sign of each sequence's mean advantage.

Aggregation and gradient accumulation. Every aggregation is a masked sum divided by a normaliser
that ``policy_loss`` takes explicitly; ``aggregation`` picks one (null: the loss type's own:
grpo, bnpo, dapo, dr_grpo name theirs; gspo, gspo_token and sapo use grpo's, cispo dapo's, as
their sources do)::

    grpo     sum_b (sum_t m*L / n_b)  /  number of sequences with >= 1 active token
    bnpo     sum_{b,t} m*L            /  number of active tokens
    dapo     sum_{b,t} m*L            /  number of active tokens
    dr_grpo  sum_{b,t} m*L            /  (number of active sequences * max_completion_length)
    sft      sum_{b,t} m*(-logp)      /  number of active tokens

``sft`` is supervised fine-tuning on demonstrations (the warm start): the token mean of the
negative log-likelihood, plus ``beta * k3`` when beta > 0. Advantages, clipping and sampler
corrections do not apply (demonstrations have no sampler).

The train step computes ``normalizer = loss_normalizer(cfg, mask_BxT)`` ONCE on the mask of
the whole accumulated global batch (all micro-batches, all devices), passes that same value
to ``policy_loss`` for every micro-batch, and SUMS (does not average) the micro-batch losses
and gradients: the sum then equals the loss of the whole batch, and under dapo every token
weighs the same. With a normaliser spanning the whole batch ``bnpo`` and ``dapo`` are the
same number; they differ in TRL only because TRL's bnpo normalises per device micro-batch,
which we do not reproduce. Sequences without active tokens (padding rows) count nowhere.

Configs are frozen and hashable: pass ``cfg`` as a static argument under ``jax.jit``.
Shape and config errors raise ValueError in Python before tracing.
"""


from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.options import option

CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo")  # PPO's clipped token ratio; the name is its aggregation
LOSS_TYPES = (*CLIPPED, "gspo", "gspo_token", "cispo", "sapo", "sft")
AGGREGATIONS = CLIPPED
# Each source's own aggregation: GSPO and SAPO average sequences' token means, CISPO all tokens.
OWN_AGGREGATION = {"gspo": "grpo", "gspo_token": "grpo", "sapo": "grpo", "cispo": "dapo", "sft": "sft"}
IS_LEVELS = ("none", "token", "sequence")
IS_MODES = ("truncate", "mask")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy-loss settings; the module docstring has each formula and its source."""

    loss_type: str = option(
        "the policy objective: grpo, bnpo, dapo, dr_grpo (PPO's clipped token ratio, aggregated as named), gspo "
        "(GSPO's clipped sequence ratio), gspo_token (GSPO-token), cispo (clipped stop-gradient weights on "
        "logp), sapo (a soft sigmoid gate instead of the clip), sft (demonstrations' negative log-likelihood)",
        default="grpo")
    aggregation: str | None = option(
        "how token losses are averaged: grpo (mean of sequence token-means), bnpo / dapo (token mean over the "
        "batch), dr_grpo (sum / (sequences * max_completion_length)); null: the loss type's own (gspo, "
        "gspo_token, sapo: grpo; cispo: dapo)", default=None)
    eps_low: float = option("clip range low side: ratio >= 1 - eps_low", default=0.2)
    eps_high: float = option(
        "clip range high side: ratio <= 1 + eps_high (DAPO clip-higher: eps_high > eps_low)", default=0.2)
    dual_clip: float | None = option(
        "c > 1 bounds the loss of negative-advantage tokens by -c * A (clipped loss types); null: off", default=None)
    seq_eps_low: float = option("gspo / gspo_token: sequence ratio >= 1 - seq_eps_low (GSPO: 3e-4)", default=3e-4)
    seq_eps_high: float = option("gspo / gspo_token: sequence ratio <= 1 + seq_eps_high (GSPO: 4e-4)", default=4e-4)
    cispo_max: float = option("cispo: the bound c of its stop-gradient weight min(ratio, c) (ScaleRL: 5)", default=5.0)
    sapo_tau_pos: float = option("sapo: gate temperature for tokens with a positive advantage", default=1.0)
    sapo_tau_neg: float = option("sapo: gate temperature for the other tokens (steeper: faster decay)", default=1.05)
    beta: float = option("k3 KL weight to the reference model; 0 keeps no reference", default=0.0)
    is_level: str = option(
        "sampler/learner importance weights: token, sequence (exp of the mean log-ratio) or none", default="none")
    is_mode: str = option("truncate (min(w, is_max)) or mask (w = 0 outside [is_min, is_max])", default="truncate")
    is_min: float = option("mask mode: lower bound of kept importance weights", default=0.0)
    is_max: float = option("truncate / mask mode: upper bound of importance weights", default=2.0)
    token_mask: tuple[float, float] | None = option(
        "[low, high]: tokens whose learner/sampler probability ratio leaves it carry no gradient (IcePop; "
        "e.g. [0.5, 5.0]); null: off", default=None)
    opsm_threshold: float | None = option(
        "DeepSeek-V3.2's off-policy sequence mask: a sequence with a negative advantage whose mean "
        "log(p_sampler / p) exceeds this carries no gradient (e.g. 0.5); null: off", default=None)
    distill_weight: float = option(
        "on-policy distillation: lambda > 0 adds lambda (log p_teacher - log p) of each sampled token to its "
        "advantage (the per-token reverse KL to the teacher; see the module docstring); 0: off", default=0.0)
    task_weight: float = option(
        "the weight of the task's (rewards') advantage; 0 with distill_weight > 0: distillation alone", default=1.0)
    max_completion_length: int | None = option(
        "dr_grpo's constant in tokens; null: the padded completion width", default=None)

    def __post_init__(self):
        for key, allowed in (("loss_type", LOSS_TYPES), ("is_level", IS_LEVELS), ("is_mode", IS_MODES)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"LossConfig.{key}={getattr(self, key)!r} is not one of {allowed}")
        if self.aggregation is not None and self.aggregation not in AGGREGATIONS:
            raise ValueError(f"LossConfig.aggregation={self.aggregation!r} is not one of {AGGREGATIONS} or None")
        self._check_bounds()
        self._check_combination()

    def _check_bounds(self):
        if not (0 <= self.eps_low < 1):
            raise ValueError(f"LossConfig.eps_low={self.eps_low!r} must be in [0, 1)")
        if not (0 <= self.seq_eps_low < 1):
            raise ValueError(f"LossConfig.seq_eps_low={self.seq_eps_low!r} must be in [0, 1)")
        for key in ("eps_high", "seq_eps_high"):
            if not (0 <= getattr(self, key) < math.inf):
                raise ValueError(f"LossConfig.{key}={getattr(self, key)!r} must be a finite number >= 0")
        for key in ("cispo_max", "sapo_tau_pos", "sapo_tau_neg"):
            if not (0 < getattr(self, key) < math.inf):
                raise ValueError(f"LossConfig.{key}={getattr(self, key)!r} must be a finite number > 0")
        if self.dual_clip is not None and not (1 < self.dual_clip < math.inf):
            raise ValueError(f"LossConfig.dual_clip={self.dual_clip!r} must be None or a number > 1")
        if not (0 <= self.beta < math.inf):
            raise ValueError(f"LossConfig.beta={self.beta!r} must be a finite number >= 0")
        if not (0 <= self.is_min < self.is_max < math.inf):
            raise ValueError(
                f"LossConfig.is_min={self.is_min!r}, is_max={self.is_max!r}: need "
                "0 <= is_min < is_max < inf"
            )
        if self.token_mask is not None and not (
                len(self.token_mask) == 2 and 0 <= self.token_mask[0] < 1 < self.token_mask[1] < math.inf):
            raise ValueError(f"LossConfig.token_mask={self.token_mask!r} must be None or [low, high] with "
                             "0 <= low < 1 < high < inf (IcePop uses [0.5, 5.0])")
        if self.opsm_threshold is not None and not (0 <= self.opsm_threshold < math.inf):
            raise ValueError(f"LossConfig.opsm_threshold={self.opsm_threshold!r} must be None or a finite number >= 0")
        for key in ("distill_weight", "task_weight"):
            if not (0 <= getattr(self, key) < math.inf):
                raise ValueError(f"LossConfig.{key}={getattr(self, key)!r} must be a finite number >= 0")
        if self.distill_weight == 0 and self.task_weight == 0:
            raise ValueError("LossConfig.task_weight=0 without distill_weight leaves no advantage: set "
                             "distill_weight > 0 (distillation alone) or task_weight > 0")
        mcl = self.max_completion_length
        if mcl is not None and (not isinstance(mcl, int) or mcl < 1):
            raise ValueError(f"LossConfig.max_completion_length={mcl!r} must be None or an int >= 1")

    def _check_combination(self):
        kind = self.loss_type
        if kind == "sft":
            corrections = [f"{k}={getattr(self, k)!r}" for k, off in
                           (("is_level", "none"), ("token_mask", None), ("opsm_threshold", None), ("aggregation", None),
                            ("distill_weight", 0.0))
                           if getattr(self, k) != off]
            if corrections:
                raise ValueError(
                    f"LossConfig.{corrections[0]} does not apply to loss_type='sft': demonstrations have no "
                    "sampler and are averaged per token; leave it unset")
        elif kind in CLIPPED and self.aggregation not in (None, kind):
            raise ValueError(
                f"LossConfig.aggregation={self.aggregation!r} contradicts loss_type={kind!r}, which names its "
                f"aggregation: set loss_type={self.aggregation!r} (the same clipped loss) or leave aggregation unset")
        if self.dual_clip is not None and kind not in CLIPPED + ("gspo", "gspo_token"):
            raise ValueError(
                f"LossConfig.dual_clip does not apply to loss_type={kind!r}: it bounds a clipped ratio's loss "
                "(grpo, bnpo, dapo, dr_grpo, gspo, gspo_token); leave it unset")

    @property
    def aggregate_as(self) -> str:
        """The aggregation in effect: ``aggregation`` or the loss type's own."""
        return self.aggregation or OWN_AGGREGATION.get(self.loss_type, self.loss_type)

    @property
    def needs_sampler_logp(self) -> bool:
        """Whether the loss reads the sampler's logprobs (any sampler/learner correction)."""
        return self.is_level != "none" or self.token_mask is not None or self.opsm_threshold is not None


class LossBatch(NamedTuple):
    """The rollout-side inputs of the loss (a pytree; None fields are absent).

    adv_B is ignored by loss_type ``sft`` (pass zeros).

    logp_old_BxT None means on-policy: ``logp_old = stop_gradient(logp)``, so ratios are 1.
    sampler_logp_BxT is needed by the sampler corrections (``LossConfig.needs_sampler_logp``);
    ref_logp_BxT when beta > 0 (given with beta == 0 it only feeds the ``kl`` metric).
    teacher_logp_BxT (the teacher's logprobs of the sampled tokens) when distill_weight > 0.
    """

    mask_BxT: jax.Array
    adv_B: jax.Array
    logp_old_BxT: jax.Array | None = None
    sampler_logp_BxT: jax.Array | None = None
    ref_logp_BxT: jax.Array | None = None
    teacher_logp_BxT: jax.Array | None = None


def validate_batch(logp_BxT, batch: LossBatch, cfg: LossConfig, entropy_BxT=None) -> None:
    """Raise ValueError naming the field if shapes or required inputs do not fit ``cfg``."""
    if not isinstance(batch, LossBatch):
        raise TypeError(f"batch must be a LossBatch, got {type(batch).__name__}")
    shape = tuple(jnp.shape(logp_BxT))
    if len(shape) != 2:
        raise ValueError(f"logp_BxT has shape {shape}; expected (batch, time)")
    expected = {
        "mask_BxT": shape,
        "adv_B": shape[:1],
        "logp_old_BxT": shape,
        "sampler_logp_BxT": shape,
        "ref_logp_BxT": shape,
        "teacher_logp_BxT": shape,
    }
    for key, want in expected.items():
        value = getattr(batch, key)
        if value is not None and tuple(jnp.shape(value)) != want:
            raise ValueError(
                f"batch.{key} has shape {tuple(jnp.shape(value))}; expected {want} "
                f"to match logp_BxT {shape}"
            )
    if entropy_BxT is not None and tuple(jnp.shape(entropy_BxT)) != shape:
        raise ValueError(f"entropy_BxT has shape {tuple(jnp.shape(entropy_BxT))}; expected {shape}")
    if cfg.beta > 0 and batch.ref_logp_BxT is None:
        raise ValueError(f"LossConfig.beta={cfg.beta} needs batch.ref_logp_BxT (or set beta=0)")
    if cfg.distill_weight > 0 and batch.teacher_logp_BxT is None:
        raise ValueError(f"LossConfig.distill_weight={cfg.distill_weight} needs batch.teacher_logp_BxT, the "
                         "teacher's logprobs of the sampled tokens (or set distill_weight=0)")
    if cfg.needs_sampler_logp and batch.sampler_logp_BxT is None:
        setting = next(f"{k}={getattr(cfg, k)!r}" for k, off in
                       (("is_level", "none"), ("token_mask", None), ("opsm_threshold", None)) if getattr(cfg, k) != off)
        raise ValueError(f"LossConfig.{setting} needs batch.sampler_logp_BxT (or leave it unset)")


def loss_normalizer(cfg: LossConfig, mask_BxT):
    """The divisor of ``cfg.aggregate_as``, from the mask of the WHOLE accumulated batch."""
    shape = tuple(jnp.shape(mask_BxT))
    if len(shape) != 2:
        raise ValueError(f"mask_BxT has shape {shape}; expected (batch, time)")
    mask_BxT = jnp.asarray(mask_BxT, jnp.float32)
    if cfg.aggregate_as in ("bnpo", "dapo", "sft"):
        return mask_BxT.sum()
    num_seqs = (mask_BxT.sum(1) > 0).sum().astype(jnp.float32)
    if cfg.aggregate_as == "grpo":
        return num_seqs
    return num_seqs * (cfg.max_completion_length or shape[1])


def _masked_mean(x, mask, count):
    return (x * mask).sum() / jnp.maximum(count, 1)


def _masked_extremes(x, mask, count):
    active = mask > 0
    lo = jnp.min(jnp.where(active, x, jnp.inf))
    hi = jnp.max(jnp.where(active, x, -jnp.inf))
    return jnp.where(count > 0, lo, 0.0), jnp.where(count > 0, hi, 0.0)


def _sequence_mean(x_BxT, mask_BxT, n_B):
    return (x_BxT * mask_BxT).sum(1) / jnp.maximum(n_B, 1)


def policy_loss(logp_BxT, batch: LossBatch, cfg: LossConfig, normalizer, entropy_BxT=None):
    """Loss of one (micro-)batch and its metrics.

    Args:
      logp_BxT: current policy's logprobs of the taken tokens (the differentiated input).
      batch: rollout-side arrays, see ``LossBatch``.
      cfg: static ``LossConfig``.
      normalizer: ``loss_normalizer(cfg, mask)`` over the whole accumulated batch.
      entropy_BxT: optional per-token entropy, only for the ``entropy`` metric.

    Returns ``(loss, metrics)``. ``loss`` and ``policy_loss`` add up over micro-batches;
    the other metrics are scalars averaged over this call's active tokens.
    """
    validate_batch(logp_BxT, batch, cfg, entropy_BxT)
    mask_BxT = jnp.asarray(batch.mask_BxT, jnp.float32)
    n_B = mask_BxT.sum(1)
    n_tokens = n_B.sum()
    if cfg.loss_type == "sft":
        pg_BxT = -logp_BxT
        metrics = {"token_prob": _masked_mean(jnp.exp(jax.lax.stop_gradient(logp_BxT)), mask_BxT, n_tokens)}
    else:
        logp_old_BxT = (
            jax.lax.stop_gradient(logp_BxT) if batch.logp_old_BxT is None else batch.logp_old_BxT
        )
        adv_Bx1 = jnp.asarray(batch.adv_B, jnp.float32)[:, None]
        adv_BxT, distill = _advantages(adv_Bx1, logp_old_BxT, batch.teacher_logp_BxT, cfg, mask_BxT, n_B, n_tokens)
        objective = _OBJECTIVES.get(cfg.loss_type, _clipped_pg)
        pg_BxT, metrics = objective(logp_BxT, logp_old_BxT, adv_BxT, cfg, mask_BxT, n_B, n_tokens)
        metrics.update(distill)
        if cfg.needs_sampler_logp:
            adv_seq_Bx1 = adv_Bx1 if cfg.distill_weight == 0 else _sequence_mean(adv_BxT, mask_BxT, n_B)[:, None]
            keep_BxT, corrections = _sampler_corrections(
                logp_BxT, logp_old_BxT, batch.sampler_logp_BxT, adv_seq_Bx1, cfg, mask_BxT, n_B, n_tokens)
            pg_BxT = keep_BxT * pg_BxT
            metrics.update(corrections)

    token_loss_BxT = pg_BxT
    if batch.ref_logp_BxT is not None:
        delta_BxT = batch.ref_logp_BxT - logp_BxT
        # expm1(d) - d == exp(d) - d - 1 without float32 cancellation for small d.
        k3_BxT = jnp.expm1(delta_BxT) - delta_BxT
        metrics["kl"] = _masked_mean(k3_BxT, mask_BxT, n_tokens)
        if cfg.beta > 0:
            token_loss_BxT = pg_BxT + cfg.beta * k3_BxT

    def aggregate(x_BxT):
        if cfg.aggregate_as == "grpo":
            return _sequence_mean(x_BxT, mask_BxT, n_B).sum() / jnp.maximum(normalizer, 1)
        return (x_BxT * mask_BxT).sum() / jnp.maximum(normalizer, 1)

    loss = aggregate(token_loss_BxT)
    metrics["loss"] = loss
    metrics["policy_loss"] = aggregate(pg_BxT)
    if entropy_BxT is not None:
        metrics["entropy"] = _masked_mean(entropy_BxT, mask_BxT, n_tokens)
    return loss, metrics


def _advantages(adv_Bx1, logp_old_BxT, teacher_logp_BxT, cfg: LossConfig, mask_BxT, n_B, n_tokens):
    """Each token's advantage: the task's, weighted, plus distillation's minus reverse KL (none
    without distill_weight: the sequence's advantage as it is); and distillation's metrics."""
    if cfg.distill_weight == 0:
        return adv_Bx1 if cfg.task_weight == 1 else cfg.task_weight * adv_Bx1, {}
    reverse_kl_BxT = jax.lax.stop_gradient(logp_old_BxT - teacher_logp_BxT)
    adv_BxT = cfg.task_weight * adv_Bx1 - cfg.distill_weight * reverse_kl_BxT
    return adv_BxT, {"distill_reverse_kl": _masked_mean(reverse_kl_BxT, mask_BxT, n_tokens),
                     "advantage_mean": _masked_mean(adv_BxT, mask_BxT, n_tokens)}


def _clip_loss(ratio_BxT, adv_Bx1, low, high, mask_BxT, n_tokens):
    """PPO's ``-min(r A, clip(r, low, high) A)`` and how often each side of the clip binds."""
    pg_BxT = -jnp.minimum(ratio_BxT * adv_Bx1, jnp.clip(ratio_BxT, low, high) * adv_Bx1)
    return pg_BxT, {
        "clip_frac_low": _masked_mean((ratio_BxT < low) & (adv_Bx1 < 0), mask_BxT, n_tokens),
        "clip_frac_high": _masked_mean((ratio_BxT > high) & (adv_Bx1 > 0), mask_BxT, n_tokens),
    }


def _dual_clip(pg_BxT, adv_Bx1, cfg: LossConfig, metrics, mask_BxT, n_tokens):
    if cfg.dual_clip is None:
        return pg_BxT
    bound_BxT = -cfg.dual_clip * adv_Bx1
    dual_BxT = (adv_Bx1 < 0) & (pg_BxT > bound_BxT)
    metrics["dual_clip_frac"] = _masked_mean(dual_BxT, mask_BxT, n_tokens)
    return jnp.where(dual_BxT, bound_BxT, pg_BxT)


def _clipped_pg(logp_BxT, logp_old_BxT, adv_Bx1, cfg: LossConfig, mask_BxT, n_B, n_tokens):
    """grpo, bnpo, dapo, dr_grpo: the clipped token ratio (clip-higher, dual clip)."""
    ratio_BxT = jnp.exp(logp_BxT - logp_old_BxT)
    pg_BxT, metrics = _clip_loss(ratio_BxT, adv_Bx1, 1 - cfg.eps_low, 1 + cfg.eps_high, mask_BxT, n_tokens)
    return _dual_clip(pg_BxT, adv_Bx1, cfg, metrics, mask_BxT, n_tokens), metrics


def _gspo(logp_BxT, logp_old_BxT, adv_Bx1, cfg: LossConfig, mask_BxT, n_B, n_tokens):
    """gspo / gspo_token: the clipped sequence ratio exp(mean_t log-ratio)."""
    log_s_Bx1 = _sequence_mean(logp_BxT - logp_old_BxT, mask_BxT, n_B)[:, None]
    if cfg.loss_type == "gspo_token":
        # sg(s_i) * p_t / sg(p_t): the value of s_i; the gradient of token t's own logprob.
        log_s_BxT = jax.lax.stop_gradient(log_s_Bx1) + logp_BxT - jax.lax.stop_gradient(logp_BxT)
    else:
        log_s_BxT = jnp.broadcast_to(log_s_Bx1, mask_BxT.shape)
    pg_BxT, metrics = _clip_loss(
        jnp.exp(log_s_BxT), adv_Bx1, 1 - cfg.seq_eps_low, 1 + cfg.seq_eps_high, mask_BxT, n_tokens)
    return _dual_clip(pg_BxT, adv_Bx1, cfg, metrics, mask_BxT, n_tokens), metrics


def _cispo(logp_BxT, logp_old_BxT, adv_Bx1, cfg: LossConfig, mask_BxT, n_B, n_tokens):
    """cispo: -sg(min(r, c)) A logp, a REINFORCE term whose weight, not gradient, is clipped."""
    ratio_BxT = jnp.exp(logp_BxT - logp_old_BxT)
    weight_BxT = jax.lax.stop_gradient(jnp.minimum(ratio_BxT, cfg.cispo_max))
    return -weight_BxT * adv_Bx1 * logp_BxT, {
        "clip_frac_high": _masked_mean(ratio_BxT > cfg.cispo_max, mask_BxT, n_tokens)}


def _sapo(logp_BxT, logp_old_BxT, adv_Bx1, cfg: LossConfig, mask_BxT, n_B, n_tokens):
    """sapo: -sigmoid(tau (r - 1)) 4 / tau A, tau by the advantage's sign."""
    ratio_BxT = jnp.exp(logp_BxT - logp_old_BxT)
    tau_Bx1 = jnp.where(adv_Bx1 > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    gate_BxT = jax.nn.sigmoid(tau_Bx1 * (ratio_BxT - 1)) * 4 / tau_Bx1
    # d gate / d logp = 4 s (1 - s) r: the weight the gate leaves on each token's gradient.
    s_BxT = jax.lax.stop_gradient(jax.nn.sigmoid(tau_Bx1 * (ratio_BxT - 1)))
    weight_BxT = 4 * s_BxT * (1 - s_BxT) * jax.lax.stop_gradient(ratio_BxT)
    return -gate_BxT * adv_Bx1, {"sapo_weight_mean": _masked_mean(weight_BxT, mask_BxT, n_tokens)}


_OBJECTIVES = {"gspo": _gspo, "gspo_token": _gspo, "cispo": _cispo, "sapo": _sapo}


def _sampler_corrections(logp_BxT, logp_old_BxT, sampler_logp_BxT, adv_Bx1, cfg: LossConfig, mask_BxT, n_B,
                         n_tokens):
    """The factor (no gradient) each token's policy term is multiplied by: importance weights, the
    IcePop token mask and the off-policy sequence mask; and their metrics."""
    metrics = {}
    log_k_BxT = jax.lax.stop_gradient(logp_old_BxT - sampler_logp_BxT)
    keep_BxT = jnp.ones_like(mask_BxT)
    if cfg.is_level != "none":
        log_w_BxT = log_k_BxT
        if cfg.is_level == "sequence":
            # The MEAN log-ratio: a sum would make long sequences' weights explode or vanish.
            log_w_BxT = jnp.broadcast_to(_sequence_mean(log_k_BxT, mask_BxT, n_B)[:, None], mask_BxT.shape)
        raw_BxT = jnp.exp(log_w_BxT)
        if cfg.is_mode == "truncate":
            w_BxT = jnp.minimum(raw_BxT, cfg.is_max)
        else:
            w_BxT = jnp.where((raw_BxT >= cfg.is_min) & (raw_BxT <= cfg.is_max), raw_BxT, 0.0)
        keep_BxT = w_BxT
        for name, x in (("is_weight_raw", raw_BxT), ("is_weight", w_BxT)):
            metrics[f"{name}_mean"] = _masked_mean(x, mask_BxT, n_tokens)
            metrics[f"{name}_min"], metrics[f"{name}_max"] = _masked_extremes(x, mask_BxT, n_tokens)
        metrics["is_corrected_frac"] = _masked_mean(w_BxT != raw_BxT, mask_BxT, n_tokens)
    if cfg.token_mask is not None:
        k_BxT = jnp.exp(log_k_BxT)
        outside_BxT = (k_BxT < cfg.token_mask[0]) | (k_BxT > cfg.token_mask[1])
        keep_BxT = jnp.where(outside_BxT, 0.0, keep_BxT)
        metrics["token_mask_frac"] = _masked_mean(outside_BxT, mask_BxT, n_tokens)
    if cfg.opsm_threshold is not None:
        drift_Bx1 = _sequence_mean(sampler_logp_BxT - jax.lax.stop_gradient(logp_BxT), mask_BxT, n_B)[:, None]
        dropped_Bx1 = (adv_Bx1 < 0) & (drift_Bx1 > cfg.opsm_threshold)
        keep_BxT = jnp.where(dropped_Bx1, 0.0, keep_BxT)
        metrics["opsm_frac"] = _masked_mean(jnp.broadcast_to(dropped_Bx1, mask_BxT.shape), mask_BxT, n_tokens)
    return keep_BxT, metrics
