"""Clipped policy-gradient loss with KL, importance correction and loss aggregation.

Per token, with ``rho = exp(logp - logp_old)`` and the sequence's advantage ``A``::

    L_t = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)
    L_t = min(L_t, -c * A)                  where A < 0   (dual clip, c = dual_clip)
    L_t = w_t * L_t + beta * k3_t           k3 = exp(ref - logp) - (ref - logp) - 1

``w_t`` corrects the sampler/learner mismatch (see ``LossConfig.is_level``) and carries no
gradient.

Aggregation and gradient accumulation. Every ``loss_type`` is a masked sum divided by a
normaliser that ``policy_loss`` takes explicitly::

    grpo     sum_b (sum_t m*L / n_b)  /  number of sequences with >= 1 active token
    bnpo     sum_{b,t} m*L            /  number of active tokens
    dapo     sum_{b,t} m*L            /  number of active tokens
    dr_grpo  sum_{b,t} m*L            /  (number of active sequences * max_completion_length)
    sft      sum_{b,t} m*(-logp)      /  number of active tokens

``sft`` is supervised fine-tuning on demonstrations (the warm start): the token mean of the
negative log-likelihood, plus ``beta * k3`` when beta > 0. Advantages, clipping and
importance weights do not apply (demonstrations have no sampler), so ``is_level`` must be
``none``.

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

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "sft")
IS_LEVELS = ("none", "token", "sequence")
IS_MODES = ("truncate", "mask")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy-loss settings.

    eps_low / eps_high: clip range ``[1 - eps_low, 1 + eps_high]`` (DAPO clip-higher:
      eps_high > eps_low).
    dual_clip: c > 1 bounds the loss of negative-advantage tokens by ``-c * A``; None: off.
    beta: k3 KL weight; 0 needs no reference logprobs.
    is_level: sampler/learner importance weights ``exp(logp_old - logp_sampler)`` per
      ``token``, per ``sequence`` (exp of the MEAN log-ratio over its active tokens) or
      ``none``.
    is_mode: ``truncate`` (``min(w, is_max)``) or ``mask`` (``w = 0`` outside
      ``[is_min, is_max]``).
    max_completion_length: the dr_grpo constant (tokens); None: the padded width T.
    """

    loss_type: str = option(
        "aggregation: grpo (mean of sequence token-means), bnpo, dapo (token mean over the batch), dr_grpo "
        "(sum / (B * max_completion_length)), sft (demonstrations' negative log-likelihood)", default="grpo")
    eps_low: float = option("clip range low side: ratio >= 1 - eps_low", default=0.2)
    eps_high: float = option(
        "clip range high side: ratio <= 1 + eps_high (DAPO clip-higher: eps_high > eps_low)", default=0.2)
    dual_clip: float | None = option(
        "c > 1 bounds the loss of negative-advantage tokens by -c * A; null: off", default=None)
    beta: float = option("k3 KL weight to the reference model; 0 keeps no reference", default=0.0)
    is_level: str = option(
        "sampler/learner importance weights: token, sequence (exp of the mean log-ratio) or none", default="none")
    is_mode: str = option("truncate (min(w, is_max)) or mask (w = 0 outside [is_min, is_max])", default="truncate")
    is_min: float = option("mask mode: lower bound of kept importance weights", default=0.0)
    is_max: float = option("truncate / mask mode: upper bound of importance weights", default=2.0)
    max_completion_length: int | None = option(
        "dr_grpo's constant in tokens; null: the padded completion width", default=None)

    def __post_init__(self):
        for key, allowed in (("loss_type", LOSS_TYPES), ("is_level", IS_LEVELS), ("is_mode", IS_MODES)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"LossConfig.{key}={getattr(self, key)!r} is not one of {allowed}")
        if self.loss_type == "sft" and self.is_level != "none":
            raise ValueError(
                f"LossConfig.is_level={self.is_level!r} does not apply to loss_type='sft': "
                "demonstrations have no sampler logprobs; set is_level='none'"
            )
        if not (0 <= self.eps_low < 1):
            raise ValueError(f"LossConfig.eps_low={self.eps_low!r} must be in [0, 1)")
        if not (0 <= self.eps_high < math.inf):
            raise ValueError(f"LossConfig.eps_high={self.eps_high!r} must be a finite number >= 0")
        if self.dual_clip is not None and not (1 < self.dual_clip < math.inf):
            raise ValueError(f"LossConfig.dual_clip={self.dual_clip!r} must be None or a number > 1")
        if not (0 <= self.beta < math.inf):
            raise ValueError(f"LossConfig.beta={self.beta!r} must be a finite number >= 0")
        if not (0 <= self.is_min < self.is_max < math.inf):
            raise ValueError(
                f"LossConfig.is_min={self.is_min!r}, is_max={self.is_max!r}: need "
                "0 <= is_min < is_max < inf"
            )
        mcl = self.max_completion_length
        if mcl is not None and (not isinstance(mcl, int) or mcl < 1):
            raise ValueError(f"LossConfig.max_completion_length={mcl!r} must be None or an int >= 1")


class LossBatch(NamedTuple):
    """The rollout-side inputs of the loss (a pytree; None fields are absent).

    adv_B is ignored by loss_type ``sft`` (pass zeros).

    logp_old_BxT None means on-policy: ``logp_old = stop_gradient(logp)``, so rho == 1.
    sampler_logp_BxT is needed when ``is_level != 'none'``; ref_logp_BxT when beta > 0
    (given with beta == 0 it only feeds the ``kl`` metric).
    """

    mask_BxT: jax.Array
    adv_B: jax.Array
    logp_old_BxT: jax.Array | None = None
    sampler_logp_BxT: jax.Array | None = None
    ref_logp_BxT: jax.Array | None = None


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
    if cfg.is_level != "none" and batch.sampler_logp_BxT is None:
        raise ValueError(
            f"LossConfig.is_level={cfg.is_level!r} needs batch.sampler_logp_BxT "
            "(or set is_level='none')"
        )


def loss_normalizer(cfg: LossConfig, mask_BxT):
    """The divisor of ``cfg.loss_type``, from the mask of the WHOLE accumulated batch."""
    shape = tuple(jnp.shape(mask_BxT))
    if len(shape) != 2:
        raise ValueError(f"mask_BxT has shape {shape}; expected (batch, time)")
    mask_BxT = jnp.asarray(mask_BxT, jnp.float32)
    if cfg.loss_type in ("bnpo", "dapo", "sft"):
        return mask_BxT.sum()
    num_seqs = (mask_BxT.sum(1) > 0).sum().astype(jnp.float32)
    if cfg.loss_type == "grpo":
        return num_seqs
    return num_seqs * (cfg.max_completion_length or shape[1])


def _masked_mean(x, mask, count):
    return (x * mask).sum() / jnp.maximum(count, 1)


def _masked_extremes(x, mask, count):
    active = mask > 0
    lo = jnp.min(jnp.where(active, x, jnp.inf))
    hi = jnp.max(jnp.where(active, x, -jnp.inf))
    return jnp.where(count > 0, lo, 0.0), jnp.where(count > 0, hi, 0.0)


def _is_weights(logp_old_BxT, batch: LossBatch, mask_BxT, n_B, cfg: LossConfig):
    log_w_BxT = logp_old_BxT - batch.sampler_logp_BxT
    if cfg.is_level == "sequence":
        # The MEAN log-ratio: a sum would make long sequences' weights explode or vanish.
        log_w_B = (log_w_BxT * mask_BxT).sum(1) / jnp.maximum(n_B, 1)
        log_w_BxT = jnp.broadcast_to(log_w_B[:, None], mask_BxT.shape)
    raw_BxT = jax.lax.stop_gradient(jnp.exp(log_w_BxT))
    if cfg.is_mode == "truncate":
        return raw_BxT, jnp.minimum(raw_BxT, cfg.is_max)
    keep_BxT = (raw_BxT >= cfg.is_min) & (raw_BxT <= cfg.is_max)
    return raw_BxT, jnp.where(keep_BxT, raw_BxT, 0.0)


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
        pg_BxT, metrics = _clipped_pg(logp_BxT, batch, cfg, mask_BxT, n_B, n_tokens)

    token_loss_BxT = pg_BxT
    if batch.ref_logp_BxT is not None:
        delta_BxT = batch.ref_logp_BxT - logp_BxT
        # expm1(d) - d == exp(d) - d - 1 without float32 cancellation for small d.
        k3_BxT = jnp.expm1(delta_BxT) - delta_BxT
        metrics["kl"] = _masked_mean(k3_BxT, mask_BxT, n_tokens)
        if cfg.beta > 0:
            token_loss_BxT = pg_BxT + cfg.beta * k3_BxT

    def aggregate(x_BxT):
        if cfg.loss_type == "grpo":
            return ((x_BxT * mask_BxT).sum(1) / jnp.maximum(n_B, 1)).sum() / jnp.maximum(normalizer, 1)
        return (x_BxT * mask_BxT).sum() / jnp.maximum(normalizer, 1)

    loss = aggregate(token_loss_BxT)
    metrics["loss"] = loss
    metrics["policy_loss"] = aggregate(pg_BxT)
    if entropy_BxT is not None:
        metrics["entropy"] = _masked_mean(entropy_BxT, mask_BxT, n_tokens)
    return loss, metrics


def _clipped_pg(logp_BxT, batch: LossBatch, cfg: LossConfig, mask_BxT, n_B, n_tokens):
    """The per-token clipped policy-gradient loss (dual clip, importance weights) and its metrics."""
    logp_old_BxT = (
        jax.lax.stop_gradient(logp_BxT) if batch.logp_old_BxT is None else batch.logp_old_BxT
    )
    adv_Bx1 = jnp.asarray(batch.adv_B, jnp.float32)[:, None]

    rho_BxT = jnp.exp(logp_BxT - logp_old_BxT)
    clipped_rho_BxT = jnp.clip(rho_BxT, 1 - cfg.eps_low, 1 + cfg.eps_high)
    pg_BxT = -jnp.minimum(rho_BxT * adv_Bx1, clipped_rho_BxT * adv_Bx1)
    metrics = {
        "clip_frac_low": _masked_mean((rho_BxT < 1 - cfg.eps_low) & (adv_Bx1 < 0), mask_BxT, n_tokens),
        "clip_frac_high": _masked_mean((rho_BxT > 1 + cfg.eps_high) & (adv_Bx1 > 0), mask_BxT, n_tokens),
    }
    if cfg.dual_clip is not None:
        bound_BxT = -cfg.dual_clip * adv_Bx1
        dual_BxT = (adv_Bx1 < 0) & (pg_BxT > bound_BxT)
        pg_BxT = jnp.where(dual_BxT, bound_BxT, pg_BxT)
        metrics["dual_clip_frac"] = _masked_mean(dual_BxT, mask_BxT, n_tokens)

    if cfg.is_level != "none":
        raw_w_BxT, w_BxT = _is_weights(logp_old_BxT, batch, mask_BxT, n_B, cfg)
        pg_BxT = w_BxT * pg_BxT
        for name, x in (("is_weight_raw", raw_w_BxT), ("is_weight", w_BxT)):
            metrics[f"{name}_mean"] = _masked_mean(x, mask_BxT, n_tokens)
            metrics[f"{name}_min"], metrics[f"{name}_max"] = _masked_extremes(x, mask_BxT, n_tokens)
        metrics["is_corrected_frac"] = _masked_mean(w_BxT != raw_w_BxT, mask_BxT, n_tokens)
    return pg_BxT, metrics
