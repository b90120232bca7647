"""The learner update: a pure `(state, batch) -> (state, metrics)`, jitted once with shardings.

Read top to bottom: advantages from rewards (none for the supervised `sft` loss), the frozen
`logp_old` (and reference) logprobs, then `num_iterations` optimiser updates, each
accumulating gradients over micro-batches with loss normalisers taken over the whole batch, so
accumulation equals one large batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl.advantages import AdvantageConfig, check_group_size, compute_advantages, validate_rewards
from jaxrl.logprobs import completion_logprobs, packed_logprobs
from jaxrl.losses import LossBatch, LossConfig, loss_normalizer, policy_loss
from jaxrl.models import moe
from jaxrl.models.decoder import QUERY_BLOCK
from jaxrl.models.lora import LoraConfig, training_mode
from jaxrl.optim import OptimizerConfig, learning_rate_schedule
from jaxrl.options import option
from jaxrl.packing import PACKED_KEYS
from jaxrl.sharding import BATCH_AXES

# Batch arrays: prompts left-padded, completions right-padded; rewards NaN where a reward
# function does not apply; sampler_logp only for the sampler corrections (LossConfig.needs_sampler_logp).
BATCH_KEYS = {
    "prompt_BxP": np.integer,
    "prompt_mask_BxP": None,
    "completion_BxC": np.integer,
    "completion_mask_BxC": None,
    "loss_mask_BxC": None,
    "rewards_BxR": np.floating,
}
# An MoE policy's batch: the routes its sampler recorded (`moe.no_route` where none was).
OPTIONAL_BATCH_KEYS = {"sampler_logp_BxC": np.floating, "teacher_logp_BxC": np.floating,
                       "prompt_routes_BxPxU": np.unsignedinteger, "completion_routes_BxCxU": np.unsignedinteger}


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    group_size: int = option("samples per task (G); advantages compare the samples of one task", default=8)
    grad_accum: int = option("micro-batches per update (gradients accumulated; equals one large batch)", default=1)
    num_iterations: int = option("optimiser updates per batch of rollouts (GRPO's mu)", default=1)
    temperature: float = option(
        "sampling temperature the logprobs are taken at (a run sets it from rollout.temperature)", default=1.0)
    logp_chunk: int = option("sequence positions per chunk of the vocabulary projection (memory vs speed)", default=128)
    shared_prompts: bool = option(
        "run a group's prompt through the model once for its group_size samples when they share it (a batch whose "
        "groups' prompts differ runs one per sample, compiled apart; packed, laid out once before its completions "
        "where that is the cheaper layout)", default=True)
    prompt_widths: int | None = option(
        "how many prompt widths padded batches take: 1, all rollout.max_prompt_tokens wide (one program); N, its "
        "N fractions rounded up to 128, each step the narrowest that holds its prompts, all compiled at the first "
        "step, beside the first rollout (a train step's compile each): pays over a run whose prompts fall short of "
        "the widest; null: one per 128 tokens of rollout.max_prompt_tokens, at most 4", default=None)
    loss: LossConfig = option("policy loss", default=LossConfig())
    advantages: AdvantageConfig = option("how rewards become advantages", default=AdvantageConfig())
    optimizer: OptimizerConfig = option("AdamW and its learning-rate schedule", default=OptimizerConfig())
    pack_tokens: int | None = option(
        "lay a step's episodes end to end in rows of this many tokens (a multiple of 64, at least 128), each "
        "attending within itself (and to its group's prompt, with shared_prompts), so that the model runs on real "
        "tokens rather than the padded prompt and completion widths; micro-batches of pack_rows rows, as many as "
        "the step fills (grad_accum must be 1); null: padded rows", default=None)
    pack_rows: int | None = option(
        "packed rows per micro-batch; null: one per batch shard of the mesh", default=None)
    lora: LoraConfig | None = option(
        "train low-rank adapters only: the base stays frozen in model.dtype (no gradient, no optimiser state) and "
        "snapshots carry the adapters alone (PEFT's layout); null: every weight trains", default=None)
    routing_replay: bool = option(
        "an MoE policy: route every token to the experts its sampler routed it to (rollout routing replay, R3), "
        "weighted by the learner's own router over them, so that the importance ratio compares one computation; "
        "false: the learner's routers choose (moe/route_mismatch says how often they differ)", default=False)
    router_aux_loss_coef: float = option(
        "an MoE policy: the weight of the load-balancing loss (transformers' Switch formula, logged as "
        "loss/router_aux) added to the policy loss; 0: logged only", default=0.0)

    def __post_init__(self):
        for key in ("group_size", "grad_accum", "num_iterations", "logp_chunk", "prompt_widths"):
            value = getattr(self, key)
            if key == "prompt_widths" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"learner.{key}={value!r} must be an integer >= 1")
        if self.loss.loss_type != "sft":  # demonstrations come one by one, not in groups
            check_group_size(self.group_size, "learner.group_size")
        if not self.temperature > 0:
            raise ValueError(f"learner.temperature={self.temperature!r} must be > 0")
        if self.pack_tokens is not None:
            if not isinstance(self.pack_tokens, int) or self.pack_tokens < 2 * QUERY_BLOCK or \
                    self.pack_tokens % QUERY_BLOCK:
                raise ValueError(f"learner.pack_tokens={self.pack_tokens!r} must be a multiple of {QUERY_BLOCK} "
                                 f"and at least {2 * QUERY_BLOCK}")
            if self.grad_accum != 1:
                raise ValueError(f"learner.grad_accum={self.grad_accum} with learner.pack_tokens: packed micro-batches "
                                 "are pack_rows rows of pack_tokens tokens, as many as a step fills; set grad_accum 1")
        if self.pack_rows is not None and (not isinstance(self.pack_rows, int) or self.pack_rows < 1):
            raise ValueError(f"learner.pack_rows={self.pack_rows!r} must be an integer >= 1")
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"learner.router_aux_loss_coef={self.router_aux_loss_coef!r} must be >= 0 (0.001 is "
                             "transformers' default for Qwen3-MoE)")


class TrainState(NamedTuple):
    step: jax.Array  # optimiser updates so far
    params: nnx.State
    opt_state: Any
    ref_params: nnx.State | None  # only with loss.beta > 0


def validate_train_batch(batch: dict, cfg: LearnerConfig, num_batch_shards: int = 1) -> None:
    """Shape and dtype checks with messages, before anything is compiled."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if cfg.loss.needs_sampler_logp and "sampler_logp_BxC" not in batch:
        missing.append("sampler_logp_BxC (needed by loss.is_level, loss.token_mask or loss.opsm_threshold)")
    if cfg.loss.distill_weight > 0 and "teacher_logp_BxC" not in batch:
        missing.append("teacher_logp_BxC (needed by loss.distill_weight: the teacher's logprobs of the sampled tokens)")
    if missing:
        raise ValueError(f"train batch is missing {missing}")
    unknown = sorted(set(batch) - set(BATCH_KEYS) - set(OPTIONAL_BATCH_KEYS))
    if unknown:
        raise ValueError(f"train batch has unknown keys {unknown}; allowed: {sorted({**BATCH_KEYS, **OPTIONAL_BATCH_KEYS})}")
    shapes = {k: np.shape(v) for k, v in batch.items()}
    B, P = shapes["prompt_BxP"]
    C = shapes["completion_BxC"][1]
    want = {"prompt_mask_BxP": (B, P), "completion_BxC": (B, C), "completion_mask_BxC": (B, C),
            "loss_mask_BxC": (B, C), "sampler_logp_BxC": (B, C), "teacher_logp_BxC": (B, C)}
    if ("prompt_routes_BxPxU" in batch) != ("completion_routes_BxCxU" in batch):
        raise ValueError("train batch has routes of prompts or of completions alone; give both or neither")
    if "completion_routes_BxCxU" in batch:
        U = shapes["completion_routes_BxCxU"][-1]
        want |= {"prompt_routes_BxPxU": (B, P, U), "completion_routes_BxCxU": (B, C, U)}
    elif cfg.routing_replay:
        raise ValueError("learner.routing_replay needs the rollouts' routes (prompt_routes_BxPxU, "
                         "completion_routes_BxCxU): a mixture-of-experts policy's batch carries them")
    for key, shape in want.items():
        if key in shapes and shapes[key] != shape:
            raise ValueError(f"train batch {key} has shape {shapes[key]}, expected {shape} "
                             f"(from prompt_BxP {(B, P)} and completion_BxC)")
    if len(shapes["rewards_BxR"]) != 2 or shapes["rewards_BxR"][0] != B:
        raise ValueError(f"train batch rewards_BxR has shape {shapes['rewards_BxR']}, expected ({B}, R)")
    for key, kind in {**BATCH_KEYS, **OPTIONAL_BATCH_KEYS}.items():
        if key in batch and kind is not None and not np.issubdtype(np.asarray(batch[key]).dtype, kind):
            raise ValueError(f"train batch {key} has dtype {np.asarray(batch[key]).dtype}, expected {kind.__name__}")
    loss_mask = np.asarray(batch["loss_mask_BxC"]).astype(bool)
    if (loss_mask & ~np.asarray(batch["completion_mask_BxC"]).astype(bool)).any():
        raise ValueError("train batch loss_mask_BxC is 1 on tokens that completion_mask_BxC marks as padding")
    if P < 1 or not np.asarray(batch["prompt_mask_BxP"])[:, -1].all():
        raise ValueError("train batch prompts must be left-padded: prompt_mask_BxP[:, -1] must be 1 on every row")
    rows_per_micro = B // cfg.grad_accum
    if B % cfg.grad_accum or rows_per_micro % num_batch_shards:
        raise ValueError(
            f"batch of {B} sequences does not split into grad_accum={cfg.grad_accum} micro-batches "
            f"of rows divisible by the {num_batch_shards} batch shards of the mesh"
        )
    rewards = np.asarray(batch["rewards_BxR"])
    if cfg.loss.loss_type != "sft":  # demonstrations have no groups: their rewards are unused
        validate_rewards(rewards, cfg.group_size, cfg.advantages)
    if np.isinf(rewards).any():
        rows = sorted(set(np.argwhere(np.isinf(rewards))[:, 0].tolist()))[:5]
        raise ValueError(f"train batch rewards_BxR is infinite at rows {rows}; a reward function "
                         f"must return a finite number, or None where it does not apply")


def init_state(params: nnx.State, cfg: LearnerConfig, tx: optax.GradientTransformation) -> TrainState:
    opt_state = tx.init(params)
    ref = jax.tree.map(jnp.copy, params) if cfg.loss.beta > 0 else None
    return TrainState(jnp.zeros((), jnp.int32), params, opt_state, ref)


def _micro_batches(x, grad_accum: int, block: int = 1):
    # Interleaved split (block i of `block` rows goes to micro-batch i % A): each device's
    # contiguous rows stay on that device in every micro-batch, so splitting moves no data;
    # blocks keep a group that shares its prompt in one micro-batch.
    B = x.shape[0]
    x = x.reshape(B // (grad_accum * block), grad_accum, block, *x.shape[1:]).swapaxes(0, 1)
    x = x.reshape(grad_accum, B // grad_accum, *x.shape[3:])
    spec = jax.sharding.PartitionSpec(None, BATCH_AXES, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, spec)


def _combine_metrics(metrics_A: dict, tokens_A) -> dict:
    """Micro-batch metrics -> batch metrics: sums, extremes, or token-weighted means."""
    weights_A = tokens_A / jnp.maximum(tokens_A.sum(), 1)
    out = {}
    for k, v in metrics_A.items():
        if k in ("loss", "policy_loss"):
            out[k] = v.sum()
        elif k.endswith("_min"):
            out[k] = v.min()
        elif k.endswith("_max"):
            out[k] = v.max()
        else:
            out[k] = (v * weights_A).sum()
    return out


def _packed_micro_batch(packed: dict, m) -> dict:
    return {k: jax.lax.dynamic_index_in_dim(packed[k], m, keepdims=False)
            for k in (*PACKED_KEYS, "routes_MxRxLxU") if k in packed}


def _moe_terms(own_xU, recorded_xU, routed_x, gap_y, trained_y, stats, weight, cfg: LearnerConfig):
    """An MoE micro-batch's load-balancing term of the loss (its share `weight` of the step's trained
    tokens) and metrics: how many of the tokens where `routed_x` holds (trained ones, any layout) the
    learner's routers route otherwise than the sampler recorded (as sets of experts), and the mean
    learner-sampler logprob gap `gap_y` over the trained tokens `trained_y` in the mode it trains in."""
    aux = moe.load_balancing_loss(stats)
    counted = routed_x * (recorded_xU[..., 0] != np.iinfo(recorded_xU.dtype).max)
    differ = jnp.any(jnp.sort(own_xU, -1) != jnp.sort(recorded_xU.astype(jnp.int32), -1), -1)
    metrics = {"loss/router_aux": aux,
               "moe/route_mismatch": jnp.sum(differ * counted) / jnp.maximum(counted.sum(), 1),
               _gap_name(cfg.routing_replay): jnp.sum(gap_y * trained_y) / jnp.maximum(trained_y.sum(), 1)}
    return cfg.router_aux_loss_coef * aux * weight, metrics


def _gap_name(replay: bool) -> str:
    """The metric of the mean |learner - sampler| logprob of trained tokens, the learner routing as named."""
    return f"moe/logp_gap_{'replay' if replay else 'own_routes'}"


def _to_rows(x_RxL, target_RxL, B: int, C: int):
    """Packed per-token values -> the (B, C) layout (0 where this micro-batch holds no token)."""
    flat = jnp.zeros(B * C + 1, x_RxL.dtype).at[target_RxL.ravel()].add(x_RxL.ravel())
    return flat[:B * C].reshape(B, C)


class _Accumulated(NamedTuple):
    """Micro-batch metrics combined as `_combine_metrics` does, one micro-batch at a time."""

    sums: dict
    tokens: jax.Array

    @classmethod
    def zeros(cls, metrics: dict) -> _Accumulated:
        def start(k, v):
            return jnp.full(v.shape, jnp.inf if k.endswith("_min") else -jnp.inf if k.endswith("_max") else 0.0,
                            v.dtype)
        return cls({k: start(k, v) for k, v in metrics.items()}, jnp.zeros((), jnp.float32))

    def add(self, metrics: dict, tokens) -> _Accumulated:
        def one(k, acc, v):
            if k.endswith("_min"):
                return jnp.minimum(acc, jnp.where(tokens > 0, v, jnp.inf))
            if k.endswith("_max"):
                return jnp.maximum(acc, jnp.where(tokens > 0, v, -jnp.inf))
            return acc + (v if k in ("loss", "policy_loss") else v * tokens)
        return _Accumulated({k: one(k, self.sums[k], v) for k, v in metrics.items()}, self.tokens + tokens)

    def metrics(self) -> dict:
        def one(k, v):
            if k.endswith(("_min", "_max")):
                return jnp.where(jnp.isfinite(v), v, 0.0)
            return v if k in ("loss", "policy_loss") else v / jnp.maximum(self.tokens, 1)
        return {k: one(k, v) for k, v in self.sums.items()}


def train_step(state: TrainState, batch: dict, graphdef: nnx.GraphDef, cfg: LearnerConfig,
               tx: optax.GradientTransformation, prompt_group: int = 1, frozen: nnx.State | None = None):
    """One batch: `cfg.num_iterations` optimiser updates with `tx` (`make_optimizer(cfg.optimizer)`).
    Pure; jit it with `jit_train_step`.

    `prompt_group`: rows come in blocks of this many sharing one prompt (`shared_prompt_rows`),
    computed once per block. `frozen`: the model's state that does not train (with LoRA: the base
    weights), merged with the params of every pass and never changed. A batch with the packed
    layout (`jaxrl.packing.pack`'s arrays) runs the model on that, a loop over the micro-batches
    the step needs; its losses stay per row of the padded layout."""
    schedule = learning_rate_schedule(cfg.optimizer)

    if cfg.loss.loss_type == "sft":
        adv_B, adv_stats = jnp.zeros(batch["rewards_BxR"].shape[:1], jnp.float32), {}
    else:
        adv_B, adv_stats = compute_advantages(batch["rewards_BxR"], cfg.group_size, cfg.advantages)
    loss_mask = batch["loss_mask_BxC"].astype(jnp.float32)
    normalizer = loss_normalizer(cfg.loss, loss_mask)

    def model_of(params, dropout_key=None):
        model = nnx.merge(graphdef, params, *(() if frozen is None else (frozen,)))
        if dropout_key is not None:
            training_mode(model, dropout_key)
        return model

    def loss_of(logp, entropy, mb, mask):
        loss_batch = LossBatch(
            mask_BxT=mask, adv_B=mb["adv_B"], logp_old_BxT=mb["logp_old"],
            sampler_logp_BxT=mb.get("sampler_logp_BxC"), ref_logp_BxT=mb["ref_logp"],
            teacher_logp_BxT=mb.get("teacher_logp_BxC"),
        )
        return policy_loss(logp, loss_batch, cfg.loss, normalizer, jax.lax.stop_gradient(entropy))

    def dropout_keys(step, n: int):
        # Adapter dropout draws from the update's step and micro-batch: a resumed run draws the same.
        return (jax.random.split(jax.random.fold_in(jax.random.key(0), step), n)
                if cfg.lora is not None and cfg.lora.dropout else None)

    if "tokens_MxRxL" in batch:
        grads_of, frozen_logprobs, other_gap = _packed_passes(batch, cfg, adv_B, loss_mask, model_of, loss_of,
                                                              dropout_keys)
    else:
        grads_of, frozen_logprobs, other_gap = _padded_passes(batch, cfg, adv_B, loss_mask, prompt_group, model_of,
                                                              loss_of, dropout_keys)

    # logp_old is fixed before the first update; with a single pass the loss uses
    # stop_gradient(logp) instead, which is the same number without a forward pass.
    fixed = {"logp_old": frozen_logprobs(state.params) if cfg.num_iterations > 1 else None,
             "ref_logp": frozen_logprobs(state.ref_params) if cfg.loss.beta > 0 else None}

    def iteration(carry, _):
        params, opt_state, step = carry
        grads, metrics = grads_of(params, step, fixed)
        metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["learning_rate"] = schedule(step)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, step + 1), metrics

    (params, opt_state, step), metrics_I = jax.lax.scan(
        iteration, (state.params, state.opt_state, state.step), None, length=cfg.num_iterations
    )
    # The first pass is the on-policy one; later passes show how far the policy moved.
    metrics = {k: v[0] for k, v in metrics_I.items()}
    if cfg.num_iterations > 1:
        last = ("loss", "kl", "clip_frac_low", "clip_frac_high")
        metrics.update({f"last_{k}": v[-1] for k, v in metrics_I.items() if k in last})
    metrics.update(adv_stats)
    metrics["completion_tokens"] = loss_mask.sum()
    if other_gap is not None:  # an MoE batch: the gap also as the other routing would give it
        metrics[_gap_name(not cfg.routing_replay)] = other_gap(state.params)
    return TrainState(step, params, opt_state, state.ref_params), metrics


def _padded_passes(batch, cfg: LearnerConfig, adv_B, loss_mask, prompt_group: int, model_of, loss_of,
                   dropout_keys):
    """(grads_of, frozen_logprobs, other_gap) over `grad_accum` micro-batches of the padded rows; other_gap
    (None but for an MoE batch): the mean learner-sampler logprob gap of trained tokens when the learner
    routes the other way than `cfg.routing_replay` says."""
    A = cfg.grad_accum
    micro = {k: _micro_batches(v, A, prompt_group) for k, v in batch.items() if k != "rewards_BxR"}
    micro["adv_B"] = _micro_batches(adv_B, A, prompt_group)
    routed = "completion_routes_BxCxU" in batch
    trained = jnp.maximum(loss_mask.sum(), 1)

    def logprobs(params, mb, with_entropy=False, dropout_key=None, replay=cfg.routing_replay):
        return completion_logprobs(
            model_of(params, dropout_key), mb["prompt_BxP"], mb["prompt_mask_BxP"], mb["completion_BxC"],
            mb["completion_mask_BxC"], cfg.temperature, cfg.logp_chunk, with_entropy, prompt_group,
            (mb["prompt_routes_BxPxU"], mb["completion_routes_BxCxU"]) if routed and replay else None, routed,
        )

    def frozen_logprobs(params, replay=cfg.routing_replay):
        return jax.lax.map(lambda mb: jax.lax.stop_gradient(logprobs(params, mb, replay=replay)[0]), micro)

    def micro_loss(params, mb, dropout_key):
        logp, entropy, *routing = logprobs(params, mb, with_entropy=True, dropout_key=dropout_key)
        mask = mb["loss_mask_BxC"]
        loss, metrics = loss_of(logp, entropy, mb, mask)
        if routed:
            own, stats = routing
            gap = jnp.abs(jax.lax.stop_gradient(logp) - mb["sampler_logp_BxC"])
            aux, moe_metrics = _moe_terms(own, mb["completion_routes_BxCxU"], mask, gap, mask, stats,
                                          mask.sum() / trained, cfg)
            loss, metrics = loss + aux, {**metrics, **moe_metrics, "loss": metrics["loss"] + aux}
        return loss, metrics

    def grads_of(params, step, fixed):
        def accumulate(grads, mb_and_key):
            (_, metrics), g = jax.value_and_grad(micro_loss, has_aux=True)(params, *mb_and_key)
            return jax.tree.map(jnp.add, grads, g), metrics

        grads, metrics_A = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params),
                                        ({**micro, **fixed}, dropout_keys(step, A)))
        tokens_A = micro["loss_mask_BxC"].sum(axis=(1, 2)).astype(jnp.float32)
        return grads, _combine_metrics(metrics_A, tokens_A)

    def other_gap(params):
        gap = jnp.abs(frozen_logprobs(params, not cfg.routing_replay) - micro["sampler_logp_BxC"])
        return jnp.sum(gap * micro["loss_mask_BxC"]) / trained

    return grads_of, frozen_logprobs, other_gap if routed else None


def _packed_passes(batch, cfg: LearnerConfig, adv_B, loss_mask, model_of, loss_of, dropout_keys):
    """(grads_of, frozen_logprobs, other_gap) over the packed micro-batches the step needs (a loop of
    `micro_batches` iterations: the arrays hold the most any step can need); other_gap as
    `_padded_passes`'."""
    B, C = loss_mask.shape
    M = batch["tokens_MxRxL"].shape[0]
    rows = {k: v for k, v in batch.items() if k.endswith(("_BxC", "_BxP"))}
    rows["adv_B"] = adv_B
    routed = "routes_MxRxLxU" in batch
    trained = jnp.maximum(loss_mask.sum(), 1)

    def logprobs(params, mb, with_entropy=False, dropout_key=None, replay=cfg.routing_replay):
        logp, entropy, *routing = packed_logprobs(
            model_of(params, dropout_key), mb["tokens_MxRxL"], mb["positions_MxRxL"], mb["segments_MxRxL"],
            mb["prefix_MxRxL"], mb["window_M"], cfg.temperature, cfg.logp_chunk, with_entropy,
            mb["routes_MxRxLxU"] if routed and replay else None, routed)
        target = mb["target_MxRxL"][:, 1:]
        present = _to_rows(jnp.ones_like(logp), target, B, C)
        return (_to_rows(logp, target, B, C), entropy if entropy is None else _to_rows(entropy, target, B, C), present,
                *routing)

    def frozen_logprobs(params, replay=cfg.routing_replay):
        def one(m, logp_BxC):
            return logp_BxC + jax.lax.stop_gradient(logprobs(params, _packed_micro_batch(batch, m), replay=replay)[0])
        return jax.lax.fori_loop(0, batch["micro_batches"], one, jnp.zeros((B, C), jnp.float32))

    def micro_loss(params, mb, dropout_key, fixed):
        logp, entropy, present, *routing = logprobs(params, mb, with_entropy=True, dropout_key=dropout_key)
        mask = loss_mask * present
        loss, metrics = loss_of(logp, entropy, {**rows, **fixed}, mask)
        if routed:
            own_RxLxU, stats = routing
            # A packed token's loss mask, through where its logprob goes (nothing past the last row).
            trained_RxL = jnp.take(loss_mask.ravel(), mb["target_MxRxL"], mode="fill", fill_value=0)
            gap = jnp.abs(jax.lax.stop_gradient(logp) - rows["sampler_logp_BxC"])
            aux, moe_metrics = _moe_terms(own_RxLxU, mb["routes_MxRxLxU"], trained_RxL, gap, mask, stats,
                                          mask.sum() / trained, cfg)
            loss, metrics = loss + aux, {**metrics, **moe_metrics, "loss": metrics["loss"] + aux}
        return loss, (metrics, mask.sum())

    def grads_of(params, step, fixed):
        keys = dropout_keys(step, M)
        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

        def one(m, carry):
            grads, acc = carry
            key = None if keys is None else keys[m]
            (_, (metrics, tokens)), g = grad_fn(params, _packed_micro_batch(batch, m), key, fixed)
            return jax.tree.map(jnp.add, grads, g), acc.add(metrics, tokens)

        shapes = jax.eval_shape(micro_loss, params, _packed_micro_batch(batch, 0), None if keys is None else keys[0],
                                fixed)[1][0]
        start = (jax.tree.map(jnp.zeros_like, params), _Accumulated.zeros(shapes))
        grads, acc = jax.lax.fori_loop(0, batch["micro_batches"], one, start)
        return grads, acc.metrics()

    def other_gap(params):
        gap = jnp.abs(frozen_logprobs(params, not cfg.routing_replay) - batch["sampler_logp_BxC"])
        return jnp.sum(gap * loss_mask) / trained

    return grads_of, frozen_logprobs, other_gap if routed else None


def shared_prompt_rows(batch: dict, cfg: LearnerConfig) -> int:
    """How many consecutive rows of `batch` share each prompt: `group_size` when every group's
    rows have the same prompt (as a GRPO group's samples do, unless an environment starts them
    differently) and groups fit the micro-batches whole, else 1. Off with `shared_prompts: false`."""
    n = cfg.group_size
    prompts, masks = batch["prompt_BxP"], batch["prompt_mask_BxP"]
    B = prompts.shape[0]
    if not cfg.shared_prompts or n < 2 or cfg.loss.loss_type == "sft" or B % (n * cfg.grad_accum):
        return 1
    grouped = [np.asarray(x).reshape(B // n, n, -1) for x in (prompts, masks)]
    return n if all((x == x[:, :1]).all() for x in grouped) else 1


def jit_train_step(graphdef, cfg: LearnerConfig, tx: optax.GradientTransformation, shardings: TrainState,
                   batch_shardings: dict, prompt_group: int = 1, frozen_shardings: nnx.State | None = None):
    """`train_step` compiled once for these shardings, called `(state, batch, frozen)`; the state's
    buffers are donated, the frozen ones never."""
    def step(state, batch, frozen):
        return train_step(state, batch, graphdef, cfg, tx, prompt_group, frozen)

    return jax.jit(
        step,
        in_shardings=(shardings, batch_shardings, frozen_shardings),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
