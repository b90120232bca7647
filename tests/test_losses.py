"""Policy loss against a plain float64 NumPy reference, accumulation, gradients, validation."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.losses import LossBatch, LossConfig, loss_normalizer, policy_loss

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]  # the policy-gradient ones; sft below
CLIPS = {"symmetric": (0.2, 0.2, None), "clip_higher": (0.2, 0.28, None), "dual_clip": (0.2, 0.28, 1.5)}
IS_SETTINGS = [("none", "truncate")] + [
    (level, mode) for level in ("token", "sequence") for mode in ("truncate", "mask")
]
MAX_LEN = 16
SEEDS = {"grpo": 1, "bnpo": 2, "dr_grpo": 3, "dapo": 4}  # checked to hit every branch below


def make_batch(seed=0, B=8, T=12):
    """Ragged masks: full rows, rows with 1-2 active tokens, holes (tool tokens), a padding row."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    lengths[1], lengths[2], lengths[0] = 1, 2, T
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    mask[0, 3:5] = 0
    mask[3] = 0  # padding row: no active token
    logp = -np.abs(rng.normal(size=(B, T))) * 2
    arrays = dict(
        logp=logp,
        mask=mask,
        adv=rng.normal(size=B),
        logp_old=logp + rng.normal(size=(B, T)) * 0.4,
        sampler=logp + rng.normal(size=(B, T)) * 0.5,
        ref=logp + rng.normal(size=(B, T)) * 0.3,
        teacher=logp + rng.normal(size=(B, T)) * 0.6,
        entropy=np.abs(rng.normal(size=(B, T))),
    )
    # The reference sees exactly the float32 values JAX sees.
    return {k: v.astype(np.float32) for k, v in arrays.items()}


def to_jax(a, with_ref=True, with_sampler=True, on_policy=False):
    batch = LossBatch(
        mask_BxT=jnp.asarray(a["mask"]),
        adv_B=jnp.asarray(a["adv"]),
        logp_old_BxT=None if on_policy else jnp.asarray(a["logp_old"]),
        sampler_logp_BxT=jnp.asarray(a["sampler"]) if with_sampler else None,
        ref_logp_BxT=jnp.asarray(a["ref"]) if with_ref else None,
        teacher_logp_BxT=jnp.asarray(a["teacher"]),
    )
    return jnp.asarray(a["logp"]), batch


def ref_policy_loss(a, loss_type, eps_low, eps_high, dual_clip, beta, is_level, is_mode, is_min, is_max):
    """The formulas, written out in float64 with loops over sequences."""
    a = {k: v.astype(np.float64) for k, v in a.items()}
    logp, mask, logp_old = a["logp"], a["mask"], a["logp_old"]
    B, T = logp.shape
    active = mask > 0
    n_tok = mask.sum()
    A = a["adv"][:, None] * np.ones((1, T))
    rho = np.exp(logp - logp_old)
    unclipped, clipped = rho * A, np.clip(rho, 1 - eps_low, 1 + eps_high) * A
    pg = -np.minimum(unclipped, clipped)
    m = {
        "clip_frac_low": np.sum(active & (rho < 1 - eps_low) & (A < 0)) / n_tok,
        "clip_frac_high": np.sum(active & (rho > 1 + eps_high) & (A > 0)) / n_tok,
    }
    if dual_clip is not None:
        dual = (A < 0) & (pg > -dual_clip * A)
        pg = np.where(dual, -dual_clip * A, pg)
        m["dual_clip_frac"] = np.sum(active & dual) / n_tok
    if is_level != "none":
        raw = np.zeros((B, T))
        for b in range(B):
            diff = logp_old[b] - a["sampler"][b]
            if is_level == "token":
                raw[b] = np.exp(diff)
            else:
                raw[b] = np.exp(diff[active[b]].mean()) if active[b].any() else 1.0
        if is_mode == "truncate":
            w = np.minimum(raw, is_max)
        else:
            w = np.where((raw >= is_min) & (raw <= is_max), raw, 0.0)
        pg = w * pg
        for name, x in (("is_weight_raw", raw), ("is_weight", w)):
            m[f"{name}_mean"] = x[active].mean()
            m[f"{name}_min"], m[f"{name}_max"] = x[active].min(), x[active].max()
        m["is_corrected_frac"] = np.sum(active & (w != raw)) / n_tok
    d = a["ref"] - logp
    k3 = np.exp(d) - d - 1
    m["kl"] = k3[active].mean()
    m["entropy"] = a["entropy"][active].mean()

    live = [b for b in range(B) if active[b].any()]

    def aggregate(x):
        if loss_type == "grpo":
            return sum(x[b][active[b]].mean() for b in live) / len(live)
        total = sum(x[b][active[b]].sum() for b in live)
        return total / (len(live) * MAX_LEN) if loss_type == "dr_grpo" else total / n_tok

    m["policy_loss"] = aggregate(pg)
    m["loss"] = aggregate(pg + beta * k3)
    return m


@pytest.mark.parametrize(
    "loss_type,clip,beta,is_setting",
    list(itertools.product(LOSS_TYPES, CLIPS, [0.0, 0.05], IS_SETTINGS)),
)
def test_matches_numpy_reference(loss_type, clip, beta, is_setting):
    eps_low, eps_high, dual_clip = CLIPS[clip]
    is_level, is_mode = is_setting
    cfg = LossConfig(
        loss_type=loss_type, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, beta=beta,
        is_level=is_level, is_mode=is_mode, is_min=0.8, is_max=1.25, max_completion_length=MAX_LEN,
    )
    a = make_batch(seed=SEEDS[loss_type])
    logp, batch = to_jax(a)
    normalizer = loss_normalizer(cfg, batch.mask_BxT)
    loss, metrics = policy_loss(logp, batch, cfg, normalizer, jnp.asarray(a["entropy"]))
    want = ref_policy_loss(a, loss_type, eps_low, eps_high, dual_clip, beta, is_level, is_mode, 0.8, 1.25)
    assert sorted(metrics) == sorted(want)
    np.testing.assert_allclose(float(loss), want["loss"], atol=1e-5, rtol=0)
    for key, value in want.items():
        np.testing.assert_allclose(float(metrics[key]), value, atol=1e-5, rtol=0, err_msg=key)


@pytest.mark.parametrize("seed", SEEDS.values())
def test_reference_cases_exercise_every_branch(seed):
    """The random batches really hit clipping, dual clipping, truncation and masking."""
    a = make_batch(seed)
    m = ref_policy_loss(a, "grpo", 0.2, 0.28, 1.5, 0.05, "token", "mask", 0.8, 1.25)
    assert min(m["clip_frac_low"], m["clip_frac_high"], m["dual_clip_frac"]) > 0
    assert 0 < m["is_corrected_frac"] < 1 and m["is_weight_min"] == 0
    m = ref_policy_loss(a, "grpo", 0.2, 0.28, None, 0.0, "sequence", "truncate", 0.8, 1.25)
    assert m["is_weight_raw_max"] > 1.25 and m["is_weight_max"] == 1.25


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batch_accumulation_equals_full_batch(loss_type):
    cfg = LossConfig(loss_type=loss_type, eps_high=0.28, dual_clip=1.5, beta=0.05, is_level="sequence")
    a = make_batch(seed=3, B=16)
    logp, batch = to_jax(a)
    normalizer = loss_normalizer(cfg, batch.mask_BxT)  # over the whole accumulated batch
    grad_fn = jax.value_and_grad(lambda lp, b: policy_loss(lp, b, cfg, normalizer)[0])
    full_loss, full_grad = grad_fn(logp, batch)
    micro = [grad_fn(logp[i : i + 4], jax.tree.map(lambda x: x[i : i + 4], batch)) for i in range(0, 16, 4)]
    np.testing.assert_allclose(sum(float(l) for l, _ in micro), float(full_loss), atol=1e-6, rtol=0)
    micro_grad = np.concatenate([g for _, g in micro])
    np.testing.assert_allclose(micro_grad, np.asarray(full_grad), atol=1e-7, rtol=0)


def hand_case():
    """Ratios chosen to land in each region for eps_low=0.2, eps_high=0.3, dual_clip=3."""
    rho = np.array([[1.0, 1.5, 0.5, 1.2, 0.9], [1.0, 0.5, 2.0, 5.0, 1.1]])
    adv = np.array([1.0, -2.0])
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], np.float64)
    # 1.5 with A>0: clipped high; 0.5 with A<0: clipped low; 5.0 with A<0: dual clipped.
    unclipped = np.array([[1, 0, 1, 1, 1], [1, 0, 1, 0, 1]], np.float64)
    ref = np.log(rho) + np.array([[0.3, -0.2, 0.1, 0.0, 0.5], [-0.4, 0.2, 0.25, -0.1, 0.05]])
    return rho, adv, mask, unclipped, ref


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gradient_matches_analytic_derivative(loss_type):
    rho, adv, mask, unclipped, ref = hand_case()
    beta = 0.1
    cfg = LossConfig(
        loss_type=loss_type, eps_low=0.2, eps_high=0.3, dual_clip=3.0, beta=beta, max_completion_length=8
    )
    logp = np.log(rho)
    batch = LossBatch(
        mask_BxT=jnp.asarray(mask, jnp.float32), adv_B=jnp.asarray(adv, jnp.float32),
        logp_old_BxT=jnp.zeros(rho.shape), ref_logp_BxT=jnp.asarray(ref, jnp.float32),
    )
    normalizer = loss_normalizer(cfg, batch.mask_BxT)
    grad_fn = jax.value_and_grad(policy_loss, has_aux=True)
    (_, metrics), grad = grad_fn(jnp.asarray(logp, jnp.float32), batch, cfg, normalizer)

    n_B = mask.sum(1, keepdims=True)
    scale = {"grpo": 1 / (2 * n_B), "bnpo": 1 / 9, "dapo": 1 / 9, "dr_grpo": 1 / (2 * 8)}[loss_type]
    # d/dlogp(-rho A) = -rho A where unclipped, 0 where (dual) clipped; d/dlogp k3 = 1 - exp(ref - logp).
    want = scale * mask * (unclipped * -rho * adv[:, None] + beta * (1 - np.exp(ref - logp)))
    np.testing.assert_allclose(np.asarray(grad), want, atol=1e-6, rtol=1e-5)
    for key in ("clip_frac_low", "clip_frac_high", "dual_clip_frac"):
        np.testing.assert_allclose(float(metrics[key]), 1 / 9, rtol=1e-6, err_msg=key)


def test_importance_weights_carry_no_gradient():
    # On-policy (rho == 1): the weight exp(logp - sampler) depends on logp but must act as a constant.
    logp = np.log(np.array([[0.5, 0.2, 0.4]]))
    sampler = logp - np.log(np.array([[0.5, 3.0, 1.0]]))
    cfg = LossConfig(loss_type="bnpo", is_level="token", is_mode="truncate", is_max=2.0)
    batch = LossBatch(
        mask_BxT=jnp.ones((1, 3)), adv_B=jnp.array([1.5]), sampler_logp_BxT=jnp.asarray(sampler, jnp.float32)
    )
    normalizer = loss_normalizer(cfg, batch.mask_BxT)
    grad = jax.grad(lambda lp: policy_loss(lp, batch, cfg, normalizer)[0])(jnp.asarray(logp, jnp.float32))
    np.testing.assert_allclose(np.asarray(grad), -np.array([[0.5, 2.0, 1.0]]) * 1.5 / 3, rtol=1e-6)
    # Off-policy too, for both levels: the sampler logprobs reach the loss only through w.
    a = make_batch()
    logp, batch = to_jax(a)
    for level in ("token", "sequence"):
        cfg = LossConfig(is_level=level)

        def loss_of_sampler(sampler_BxT, cfg=cfg):
            return policy_loss(logp, batch._replace(sampler_logp_BxT=sampler_BxT), cfg, 7.0)[0]

        assert not np.any(np.asarray(jax.grad(loss_of_sampler)(batch.sampler_logp_BxT)))


def test_jit_with_static_config_matches_eager():
    cfg = LossConfig(loss_type="dapo", eps_high=0.28, beta=0.05, is_level="token", is_mode="mask", is_min=0.5)
    logp, batch = to_jax(make_batch(seed=5))
    normalizer = loss_normalizer(cfg, batch.mask_BxT)
    eager, _ = policy_loss(logp, batch, cfg, normalizer)
    jitted, _ = jax.jit(policy_loss, static_argnames="cfg")(logp, batch, cfg=cfg, normalizer=normalizer)
    np.testing.assert_allclose(float(jitted), float(eager), rtol=1e-6)


def test_beta_zero_needs_no_reference_and_all_masked_batch_is_finite():
    a = make_batch()
    logp, batch = to_jax(a, with_ref=False, with_sampler=False)
    cfg = LossConfig()
    loss, metrics = policy_loss(logp, batch, cfg, loss_normalizer(cfg, batch.mask_BxT))
    assert "kl" not in metrics and np.isfinite(float(loss))
    empty = batch._replace(mask_BxT=jnp.zeros_like(batch.mask_BxT))
    loss, metrics = policy_loss(logp, empty, cfg, loss_normalizer(cfg, empty.mask_BxT))
    assert float(loss) == 0.0 and all(np.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"loss_type": "ppo"},
            r"LossConfig.loss_type='ppo' is not one of \('grpo', 'bnpo', 'dr_grpo', 'dapo', 'gspo', 'gspo_token', "
            r"'cispo', 'sapo', 'sft'\)",
        ),
        ({"is_level": "seq"}, r"LossConfig.is_level='seq' is not one of \('none', 'token', 'sequence'\)"),
        ({"is_mode": "clip"}, r"LossConfig.is_mode='clip' is not one of \('truncate', 'mask'\)"),
        ({"eps_low": 1.0}, r"eps_low"),
        ({"eps_high": -0.1}, r"eps_high"),
        ({"dual_clip": 1.0}, r"dual_clip=1.0 must be None or a number > 1"),
        ({"beta": -1.0}, r"beta"),
        ({"is_min": 2.0, "is_max": 1.0}, r"is_min=2.0, is_max=1.0"),
        ({"max_completion_length": 0}, r"max_completion_length"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)


@pytest.mark.parametrize(
    "cfg,change,match",
    [
        (
            LossConfig(),
            {"mask_BxT": np.ones((4, 6))},
            r"batch.mask_BxT has shape \(4, 6\); expected \(4, 5\)",
        ),
        (LossConfig(), {"adv_B": np.ones((4, 1))}, r"batch.adv_B has shape \(4, 1\); expected \(4,\)"),
        (LossConfig(), {"logp_old_BxT": np.ones((3, 5))}, r"batch.logp_old_BxT has shape \(3, 5\)"),
        (LossConfig(beta=0.1), {}, r"beta=0.1 needs batch.ref_logp_BxT"),
        (LossConfig(is_level="sequence"), {}, r"is_level='sequence' needs batch.sampler_logp_BxT"),
    ],
)
def test_bad_batch_raises_before_tracing(cfg, change, match):
    batch = LossBatch(mask_BxT=np.ones((4, 5)), adv_B=np.ones(4))._replace(**change)
    logp = np.zeros((4, 5), np.float32)
    with pytest.raises(ValueError, match=match):
        policy_loss(logp, batch, cfg, 1.0)
    # Under jit the same check fires while tracing, before anything is compiled.
    with pytest.raises(ValueError, match=match):
        jax.jit(policy_loss, static_argnames="cfg")(logp, batch, cfg=cfg, normalizer=1.0)


def test_bad_logp_and_entropy_shapes_raise():
    batch = LossBatch(mask_BxT=np.ones((4, 5)), adv_B=np.ones(4))
    with pytest.raises(ValueError, match=r"logp_BxT has shape \(20,\); expected \(batch, time\)"):
        policy_loss(np.zeros(20), batch, LossConfig(), 1.0)
    with pytest.raises(ValueError, match=r"entropy_BxT has shape \(4, 4\); expected \(4, 5\)"):
        policy_loss(np.zeros((4, 5)), batch, LossConfig(), 1.0, np.zeros((4, 4)))
    with pytest.raises(TypeError, match="LossBatch"):
        policy_loss(np.zeros((4, 5)), {"mask_BxT": np.ones((4, 5))}, LossConfig(), 1.0)


def test_sft_is_the_token_mean_negative_log_likelihood():
    """Advantages, old logprobs and clipping do not reach it; its gradient is -mask / tokens."""
    a = make_batch(seed=2)
    logp, batch = to_jax(a, with_ref=False, with_sampler=False)
    cfg = LossConfig(loss_type="sft", eps_low=0.01, eps_high=0.01)  # clipping would bind if it applied
    normalizer = loss_normalizer(cfg, batch.mask_BxT)
    active = a["mask"] > 0
    assert float(normalizer) == active.sum()
    (loss, metrics), grad = jax.value_and_grad(policy_loss, has_aux=True)(logp, batch, cfg, normalizer)
    want = -a["logp"].astype(np.float64)[active].mean()
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["policy_loss"]), want, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["token_prob"]), np.exp(a["logp"][active]).mean(), rtol=1e-6)
    assert not any(k.startswith("clip_frac") for k in metrics)
    np.testing.assert_allclose(np.asarray(grad), -a["mask"] / active.sum(), rtol=1e-6)
    other = batch._replace(adv_B=-batch.adv_B, logp_old_BxT=batch.logp_old_BxT + 1.0)
    assert float(policy_loss(logp, other, cfg, normalizer)[0]) == float(loss)


def test_sft_with_beta_adds_the_k3_penalty():
    a = make_batch(seed=4)
    logp, batch = to_jax(a, with_sampler=False)
    cfg = LossConfig(loss_type="sft", beta=0.1)
    loss, metrics = policy_loss(logp, batch, cfg, loss_normalizer(cfg, batch.mask_BxT))
    active = a["mask"] > 0
    d = (a["ref"] - a["logp"]).astype(np.float64)
    k3 = np.exp(d) - d - 1
    np.testing.assert_allclose(float(loss), (-a["logp"] + 0.1 * k3)[active].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["kl"]), k3[active].mean(), rtol=1e-5)


def test_sft_refuses_importance_sampling():
    with pytest.raises(ValueError, match=r"is_level='token' does not apply to loss_type='sft'"):
        LossConfig(loss_type="sft", is_level="token")


# GSPO, CISPO, SAPO and the sampler masks against their formulas in float64: values, metrics, and
# gradients by central finite differences of the same formulas.
NEW_TYPES = ["gspo", "gspo_token", "cispo", "sapo"]
CORRECTIONS = {
    "none": {},
    "token_mask": {"token_mask": (0.7, 1.4)},
    "opsm": {"opsm_threshold": 0.05},
    "all": {"token_mask": (0.7, 1.4), "opsm_threshold": 0.05, "is_level": "token", "is_max": 1.25},
}


def make_off_policy_batch(seed=0, B=8, T=10):
    """make_batch's masks, with rows drifting from logp_old by very different amounts: GSPO's
    narrow band (3e-4) holds some sequences and not others, and some ratios pass CISPO's bound."""
    a = make_batch(seed, B, T)
    rng = np.random.default_rng(seed + 100)
    drift_B = np.array([1e-5, 1e-4, 2e-4, 0.05, 0.3, 1e-5, 2.5, 0.5])[:B]
    a["logp_old"] = (a["logp"] + rng.normal(size=(B, T)) * drift_B[:, None]).astype(np.float32)
    a["adv"] = np.array([1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 1.0, -2.0], np.float32)[:B]
    return a


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def ref_loss(a, logp, logp_sg, **kw):
    """The loss `kw` (LossConfig fields) configures, from the formulas in float64. `logp_sg` stands
    wherever a formula stops the gradient, so differences in `logp` alone give the gradient."""
    cfg = LossConfig(**kw)  # for its defaults and aggregate_as only
    a = {k: v.astype(np.float64) for k, v in a.items()}
    mask, old, sampler = a["mask"], a["logp_old"], a["sampler"]
    active = mask > 0
    n_B = mask.sum(1)
    # On-policy distillation: minus the per-token reverse KL to the teacher joins the task's advantage.
    A = cfg.task_weight * a["adv"][:, None] + cfg.distill_weight * (a["teacher"] - old) * np.ones_like(logp)

    def seq_mean(x):
        return ((x * mask).sum(1) / np.maximum(n_B, 1))[:, None] * np.ones_like(logp)

    def frac(x):
        return np.sum(active & x) / active.sum()

    m = {}
    kind = cfg.loss_type
    if kind in ("gspo", "gspo_token", "grpo", "dapo", "bnpo", "dr_grpo"):
        if kind == "gspo":
            r, lo, hi = np.exp(seq_mean(logp - old)), 1 - cfg.seq_eps_low, 1 + cfg.seq_eps_high
        elif kind == "gspo_token":
            r = np.exp(seq_mean(logp_sg - old)) * np.exp(logp - logp_sg)
            lo, hi = 1 - cfg.seq_eps_low, 1 + cfg.seq_eps_high
        else:
            r, lo, hi = np.exp(logp - old), 1 - cfg.eps_low, 1 + cfg.eps_high
        L = -np.minimum(r * A, np.clip(r, lo, hi) * A)
        m["clip_frac_low"], m["clip_frac_high"] = frac((r < lo) & (A < 0)), frac((r > hi) & (A > 0))
    elif kind == "cispo":
        r = np.exp(logp_sg - old)
        L = -np.minimum(r, cfg.cispo_max) * A * logp
        m["clip_frac_high"] = frac(r > cfg.cispo_max)
    else:  # sapo
        tau = np.where(A > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
        L = -sigmoid(tau * (np.exp(logp - old) - 1)) * 4 / tau * A
        r_sg = np.exp(logp_sg - old)
        s = sigmoid(tau * (r_sg - 1))
        m["sapo_weight_mean"] = (4 * s * (1 - s) * r_sg)[active].mean()

    keep = np.ones_like(logp)
    if cfg.is_level == "token":
        keep = np.minimum(np.exp(old - sampler), cfg.is_max)
    if cfg.token_mask is not None:
        k = np.exp(old - sampler)
        outside = (k < cfg.token_mask[0]) | (k > cfg.token_mask[1])
        keep = np.where(outside, 0.0, keep)
        m["token_mask_frac"] = frac(outside)
    if cfg.distill_weight:
        m["distill_reverse_kl"] = (old - a["teacher"])[active].mean()
        m["advantage_mean"] = A[active].mean()
    if cfg.opsm_threshold is not None:
        dropped = (seq_mean(A) < 0) & (seq_mean(sampler - logp_sg) > cfg.opsm_threshold)
        keep = np.where(dropped, 0.0, keep)
        m["opsm_frac"] = frac(dropped)
    L = keep * L
    d = a["ref"] - logp
    k3 = np.exp(d) - d - 1
    m["kl"] = k3[active].mean()
    live = n_B > 0

    def aggregate(x):
        if cfg.aggregate_as == "grpo":
            return ((x * mask).sum(1)[live] / n_B[live]).mean()
        total = (x * mask).sum()
        return total / (live.sum() * MAX_LEN) if cfg.aggregate_as == "dr_grpo" else total / active.sum()

    m["policy_loss"] = aggregate(L)
    m["loss"] = aggregate(L + cfg.beta * k3)
    return m


def ref_gradient(a, **kw):
    logp0 = a["logp"].astype(np.float64)
    grad, h = np.zeros_like(logp0), 1e-6
    for i in np.ndindex(logp0.shape):
        step = np.zeros_like(logp0)
        step[i] = h
        up, down = (ref_loss(a, logp0 + s, logp0, **kw)["loss"] for s in (step, -step))
        grad[i] = (up - down) / (2 * h)
    return grad


def check_against_reference(a, **kw):
    cfg = LossConfig(**kw, max_completion_length=MAX_LEN)
    logp, batch = to_jax(a)
    (loss, metrics), grad = jax.value_and_grad(policy_loss, has_aux=True)(
        logp, batch, cfg, loss_normalizer(cfg, batch.mask_BxT))
    logp0 = a["logp"].astype(np.float64)
    want = ref_loss(a, logp0, logp0, **kw)
    for key, value in want.items():
        np.testing.assert_allclose(float(metrics[key]), value, atol=2e-5, rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(np.asarray(grad), ref_gradient(a, **kw), atol=2e-6, rtol=1e-4)
    return want


@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("loss_type", NEW_TYPES + ["grpo", "dapo"])
def test_objectives_and_sampler_masks_match_their_formulas(loss_type, correction):
    a = make_off_policy_batch(seed=5)
    check_against_reference(a, loss_type=loss_type, beta=0.05, **CORRECTIONS[correction])


@pytest.mark.parametrize("aggregation", [None, "grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("loss_type", NEW_TYPES)
def test_every_aggregation_composes_with_the_new_objectives(loss_type, aggregation):
    a = make_off_policy_batch(seed=9)
    check_against_reference(a, loss_type=loss_type, aggregation=aggregation)


# Distillation alone and added to the task's advantage, under each objective, with the corrections.
@pytest.mark.parametrize("weights", [dict(distill_weight=1.0, task_weight=0.0), dict(distill_weight=0.5)],
                         ids=["alone", "with-task"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "gspo_token", "cispo", "sapo"])
def test_on_policy_distillation_matches_its_formula(loss_type, weights):
    a = make_off_policy_batch(seed=11)
    want = check_against_reference(a, loss_type=loss_type, **weights, **CORRECTIONS["all"])
    assert want["distill_reverse_kl"] != 0


def test_distillation_needs_the_teachers_logprobs_and_some_advantage():
    a = make_off_policy_batch(seed=11)
    logp, batch = to_jax(a)
    with pytest.raises(ValueError, match=r"distill_weight=1.0 needs batch.teacher_logp_BxT"):
        policy_loss(logp, batch._replace(teacher_logp_BxT=None), LossConfig(distill_weight=1.0), 1.0)
    with pytest.raises(ValueError, match=r"task_weight=0 without distill_weight leaves no advantage"):
        LossConfig(task_weight=0.0)
    with pytest.raises(ValueError, match=r"distill_weight=0.5.* does not apply to loss_type='sft'"):
        LossConfig(loss_type="sft", distill_weight=0.5)


def test_the_reference_cases_reach_every_branch():
    """Without this the comparisons above could pass on batches where nothing clips or masks."""
    for seed in (5, 9):
        check_branches(make_off_policy_batch(seed=seed))


def check_branches(a):
    logp0 = a["logp"].astype(np.float64)
    gspo = ref_loss(a, logp0, logp0, loss_type="gspo")
    assert 0 < gspo["clip_frac_low"] and 0 < gspo["clip_frac_high"]
    assert gspo["clip_frac_low"] + gspo["clip_frac_high"] < 0.8  # some sequences inside the band
    assert 0 < ref_loss(a, logp0, logp0, loss_type="cispo")["clip_frac_high"] < 0.5
    masks = ref_loss(a, logp0, logp0, loss_type="dapo", **CORRECTIONS["all"])
    assert 0 < masks["token_mask_frac"] < 1 and 0 < masks["opsm_frac"] < 1
    sapo = ref_loss(a, logp0, logp0, loss_type="sapo")
    assert 0.2 < sapo["sapo_weight_mean"] < 1  # the gate decays off-policy


@pytest.mark.parametrize("loss_type", NEW_TYPES)
def test_all_equal_rewards_give_no_policy_gradient(loss_type):
    a = make_off_policy_batch(seed=3)
    a["adv"] = np.zeros_like(a["adv"])  # what every advantage estimator gives a group of equal rewards
    cfg = LossConfig(loss_type=loss_type, token_mask=(0.7, 1.4), opsm_threshold=0.05)
    logp, batch = to_jax(a)
    grad = jax.grad(lambda lp: policy_loss(lp, batch, cfg, loss_normalizer(cfg, batch.mask_BxT))[0])(logp)
    assert not np.any(np.asarray(grad))


def test_one_token_completions_make_gspo_the_token_clip():
    """With one token a sequence's ratio is the token's: gspo and gspo_token are grpo's clip with
    GSPO's band."""
    a = make_off_policy_batch(seed=4)
    a["mask"] = np.zeros_like(a["mask"])
    a["mask"][:, 0] = 1
    logp, batch = to_jax(a)
    eps = {"eps_low": 0.01, "eps_high": 0.02}
    results = []
    for cfg in (LossConfig(loss_type="grpo", **eps), LossConfig(loss_type="gspo", seq_eps_low=0.01, seq_eps_high=0.02),
                LossConfig(loss_type="gspo_token", seq_eps_low=0.01, seq_eps_high=0.02)):
        norm = loss_normalizer(cfg, batch.mask_BxT)
        results.append(jax.value_and_grad(lambda lp, cfg=cfg, norm=norm: policy_loss(lp, batch, cfg, norm)[0])(logp))
    for loss, grad in results[1:]:
        np.testing.assert_allclose(float(loss), float(results[0][0]), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(grad), np.asarray(results[0][1]), atol=1e-7)


@pytest.mark.parametrize("loss_type", NEW_TYPES)
def test_masked_tokens_neither_count_nor_get_a_gradient(loss_type):
    a = make_off_policy_batch(seed=5)
    cfg = LossConfig(loss_type=loss_type, beta=0.05, token_mask=(0.7, 1.4), opsm_threshold=0.05)
    logp, batch = to_jax(a)
    norm = loss_normalizer(cfg, batch.mask_BxT)
    loss, grad = jax.value_and_grad(lambda lp: policy_loss(lp, batch, cfg, norm)[0])(logp)
    holes = a["mask"] == 0
    assert not np.any(np.asarray(grad)[holes])
    moved = policy_loss(jnp.where(holes, logp - 3.0, logp), batch, cfg, norm)[0]
    assert float(moved) == float(loss)


@pytest.mark.parametrize("loss_type", NEW_TYPES)
def test_new_objectives_accumulate_exactly(loss_type):
    cfg = LossConfig(loss_type=loss_type, beta=0.05, is_level="sequence", token_mask=(0.7, 1.4), opsm_threshold=0.05)
    a = make_off_policy_batch(seed=3, B=8)
    logp, batch = to_jax(a)
    normalizer = loss_normalizer(cfg, batch.mask_BxT)
    grad_fn = jax.value_and_grad(lambda lp, b: policy_loss(lp, b, cfg, normalizer)[0])
    full_loss, full_grad = grad_fn(logp, batch)
    micro = [grad_fn(logp[i : i + 2], jax.tree.map(lambda x: x[i : i + 2], batch)) for i in range(0, 8, 2)]
    np.testing.assert_allclose(sum(float(l) for l, _ in micro), float(full_loss), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.concatenate([g for _, g in micro]), np.asarray(full_grad), atol=1e-7, rtol=0)


def test_sampler_masks_carry_no_gradient_to_the_sampler():
    a = make_off_policy_batch()
    logp, batch = to_jax(a)
    cfg = LossConfig(loss_type="cispo", token_mask=(0.7, 1.4), opsm_threshold=0.05)

    def loss_of_sampler(sampler_BxT):
        return policy_loss(logp, batch._replace(sampler_logp_BxT=sampler_BxT), cfg, 7.0)[0]

    assert not np.any(np.asarray(jax.grad(loss_of_sampler)(batch.sampler_logp_BxT)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"aggregation": "mean"}, r"LossConfig.aggregation='mean' is not one of"),
        ({"loss_type": "grpo", "aggregation": "dapo"},
         r"aggregation='dapo' contradicts loss_type='grpo'.*set loss_type='dapo'"),
        ({"loss_type": "cispo", "dual_clip": 3.0}, r"dual_clip does not apply to loss_type='cispo'"),
        ({"loss_type": "sapo", "dual_clip": 3.0}, r"dual_clip does not apply to loss_type='sapo'"),
        ({"loss_type": "sft", "token_mask": (0.5, 5.0)}, r"token_mask=\(0.5, 5.0\) does not apply to loss_type='sft'"),
        ({"loss_type": "sft", "opsm_threshold": 0.1}, r"opsm_threshold=0.1 does not apply to loss_type='sft'"),
        ({"loss_type": "sft", "aggregation": "grpo"}, r"aggregation='grpo' does not apply to loss_type='sft'"),
        ({"token_mask": (1.2, 5.0)}, r"token_mask=\(1.2, 5.0\) must be None or \[low, high\] with 0 <= low < 1 < high"),
        ({"token_mask": (0.5,)}, r"token_mask=\(0.5,\) must be"),
        ({"opsm_threshold": -0.1}, r"opsm_threshold=-0.1 must be None or a finite number >= 0"),
        ({"cispo_max": 0.0}, r"cispo_max=0.0 must be a finite number > 0"),
        ({"sapo_tau_neg": -1.0}, r"sapo_tau_neg=-1.0 must be a finite number > 0"),
        ({"seq_eps_low": 1.0}, r"seq_eps_low=1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_new_settings_are_one_line_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as e:
        LossConfig(**kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("setting", [{"token_mask": (0.5, 5.0)}, {"opsm_threshold": 0.1}])
def test_sampler_masks_need_the_sampler_logprobs(setting):
    batch = LossBatch(mask_BxT=np.ones((4, 5)), adv_B=np.ones(4))
    with pytest.raises(ValueError, match=f"{next(iter(setting))}=.* needs batch.sampler_logp_BxT"):
        policy_loss(np.zeros((4, 5), np.float32), batch, LossConfig(**setting), 1.0)
