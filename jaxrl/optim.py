"""The optax optimiser and learning-rate schedule of a run."""

from __future__ import annotations

import dataclasses

import optax

from jaxrl.options import option

SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm gradient clipping and a warmup + decay schedule.

    Steps count optimiser updates (one per `num_iterations` pass of a train step).
    """

    learning_rate: float = option("peak learning rate", default=1e-6)
    schedule: str = option("constant, cosine or linear decay after the warmup", default="constant")
    warmup_steps: int = option("linear warmup from 0, in optimiser updates", default=0)
    total_steps: int = option(
        "updates the schedule spans (a run sets it to steps x learner.num_iterations)", default=1000)
    final_lr_fraction: float = option(
        "cosine / linear: the learning rate decays to this fraction of the peak", default=0.0)
    weight_decay: float = option("AdamW decoupled weight decay", default=0.0)
    b1: float = option("Adam beta1", default=0.9)
    b2: float = option("Adam beta2", default=0.999)
    eps: float = option("Adam epsilon", default=1e-8)
    max_grad_norm: float | None = option("clip gradients to this global norm; null: no clipping", default=1.0)

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optimizer.schedule={self.schedule!r} is not one of {SCHEDULES}")
        if not self.learning_rate > 0:
            raise ValueError(f"optimizer.learning_rate={self.learning_rate!r} must be > 0")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(
                f"optimizer.warmup_steps={self.warmup_steps!r} must be in [0, total_steps={self.total_steps}]"
            )
        if not 0 <= self.final_lr_fraction <= 1:
            raise ValueError(f"optimizer.final_lr_fraction={self.final_lr_fraction!r} must be in [0, 1]")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"optimizer.max_grad_norm={self.max_grad_norm!r} must be > 0 or None")


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.final_lr_fraction
    decay_steps = max(cfg.total_steps - cfg.warmup_steps, 1)
    if cfg.schedule == "constant":
        decay = optax.constant_schedule(peak)
    elif cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.final_lr_fraction)
    else:
        decay = optax.linear_schedule(peak, end, decay_steps)
    if cfg.warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
    return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(
        learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    if cfg.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
