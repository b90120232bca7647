"""Learning-rate schedules at their boundaries, gradient clipping, and config validation."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.optim import OptimizerConfig, learning_rate_schedule, make_optimizer


def _lr(cfg, step):
    return float(learning_rate_schedule(cfg)(step))


def test_constant():
    cfg = OptimizerConfig(learning_rate=3e-4, schedule="constant", total_steps=100)
    for step in (0, 1, 50, 99, 100, 1000):
        assert _lr(cfg, step) == pytest.approx(3e-4, rel=1e-6)


def test_constant_with_warmup():
    cfg = OptimizerConfig(learning_rate=2e-4, schedule="constant", warmup_steps=4, total_steps=100)
    expected = {0: 0.0, 1: 0.5e-4, 2: 1e-4, 3: 1.5e-4, 4: 2e-4, 5: 2e-4, 100: 2e-4, 500: 2e-4}
    for step, want in expected.items():
        assert _lr(cfg, step) == pytest.approx(want, rel=1e-6, abs=1e-12), step


def test_warmup_cosine():
    peak, frac = 1e-3, 0.1
    cfg = OptimizerConfig(
        learning_rate=peak, schedule="cosine", warmup_steps=10, total_steps=110, final_lr_fraction=frac
    )

    def cosine(k):  # k steps after warmup, over 100 decay steps
        return peak * (frac + (1 - frac) * 0.5 * (1 + math.cos(math.pi * k / 100)))

    expected = {
        0: 0.0,
        5: peak / 2,
        9: peak * 0.9,
        10: peak,  # end of warmup: the peak
        11: cosine(1),
        35: cosine(25),
        60: peak * (frac + (1 - frac) / 2),  # half-way down
        85: cosine(75),
        110: peak * frac,  # the floor at total_steps ...
        200: peak * frac,  # ... and after it
    }
    for step, want in expected.items():
        assert _lr(cfg, step) == pytest.approx(want, rel=1e-5, abs=1e-12), step


def test_cosine_without_warmup_decays_to_zero():
    cfg = OptimizerConfig(learning_rate=1.0, schedule="cosine", total_steps=8)
    expected = {0: 1.0, 2: 0.5 * (1 + math.cos(math.pi / 4)), 4: 0.5, 8: 0.0, 9: 0.0}
    for step, want in expected.items():
        assert _lr(cfg, step) == pytest.approx(want, rel=1e-5, abs=1e-7), step


def test_warmup_linear():
    peak, frac = 1e-3, 0.2
    cfg = OptimizerConfig(
        learning_rate=peak, schedule="linear", warmup_steps=5, total_steps=25, final_lr_fraction=frac
    )
    end = peak * frac
    expected = {
        0: 0.0,
        1: peak / 5,
        5: peak,
        6: peak + (end - peak) / 20,
        15: (peak + end) / 2,
        24: peak + (end - peak) * 19 / 20,
        25: end,
        1000: end,
    }
    for step, want in expected.items():
        assert _lr(cfg, step) == pytest.approx(want, rel=1e-5, abs=1e-12), step


def test_warmup_equal_to_total():
    cfg = OptimizerConfig(learning_rate=1e-3, schedule="linear", warmup_steps=10, total_steps=10)
    assert _lr(cfg, 0) == 0.0
    assert _lr(cfg, 5) == pytest.approx(5e-4, rel=1e-6)
    assert _lr(cfg, 10) == pytest.approx(1e-3, rel=1e-6)


def _reference_adamw(cfg, grads, params):
    """Plain float64 AdamW over a list of gradient dicts, first clipping each step's gradient
    to max_grad_norm by its global norm (over every leaf together)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    mu = {k: np.zeros_like(v) for k, v in p.items()}
    nu = {k: np.zeros_like(v) for k, v in p.items()}
    updates = []
    for t, g in enumerate(grads, start=1):
        g = {k: np.asarray(v, np.float64) for k, v in g.items()}
        norm = math.sqrt(sum(np.sum(v * v) for v in g.values()))
        if cfg.max_grad_norm is not None and norm > cfg.max_grad_norm:
            g = {k: v * cfg.max_grad_norm / norm for k, v in g.items()}
        lr = _lr(cfg, t - 1)
        u = {}
        for k in p:
            mu[k] = cfg.b1 * mu[k] + (1 - cfg.b1) * g[k]
            nu[k] = cfg.b2 * nu[k] + (1 - cfg.b2) * g[k] ** 2
            mu_hat, nu_hat = mu[k] / (1 - cfg.b1**t), nu[k] / (1 - cfg.b2**t)
            u[k] = -lr * (mu_hat / (np.sqrt(nu_hat) + cfg.eps) + cfg.weight_decay * p[k])
        updates.append(u)
        p = {k: p[k] + u[k] for k in p}
    return updates


def _run(cfg, grads, params):
    opt = make_optimizer(cfg)
    p = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    state = opt.init(p)
    updates = []
    for g in grads:
        u, state = opt.update({k: jnp.asarray(v, jnp.float32) for k, v in g.items()}, state, p)
        updates.append({k: np.asarray(v) for k, v in u.items()})
        p = {k: p[k] + u[k] for k in p}
    return updates


# Global norms 13, 0.3, 5: the first and last are clipped to 1, the middle one is not; per leaf,
# "a" and "b" would be clipped by different factors. Adam is nearly scale-free on one step, so
# the history across steps is what shows the clipping.
GRADS = [
    {"a": np.array([3.0, -4.0]), "b": np.array([12.0])},
    {"a": np.array([0.1, 0.2]), "b": np.array([-0.2])},
    {"a": np.array([-3.0, 0.0]), "b": np.array([4.0])},
]
PARAMS = {"a": np.array([0.5, -1.0]), "b": np.array([2.0])}


def _assert_updates_close(got, want, **tol):
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        for k in w:
            np.testing.assert_allclose(g[k], w[k], err_msg=f"update {step} leaf {k}", **tol)


@pytest.mark.parametrize("max_grad_norm", [1.0, None])
def test_adamw_matches_reference(max_grad_norm):
    cfg = OptimizerConfig(
        learning_rate=1e-2,
        schedule="cosine",
        warmup_steps=1,
        total_steps=4,
        weight_decay=0.1,
        max_grad_norm=max_grad_norm,
    )
    _assert_updates_close(_run(cfg, GRADS, PARAMS), _reference_adamw(cfg, GRADS, PARAMS), rtol=2e-5, atol=1e-9)


def test_clipping_changes_updates_and_none_does_not_clip():
    base = dict(learning_rate=1e-2, schedule="constant", total_steps=10)
    clipped = _run(OptimizerConfig(**base, max_grad_norm=1.0), GRADS, PARAMS)
    unclipped = _run(OptimizerConfig(**base, max_grad_norm=None), GRADS, PARAMS)
    never_reached = _run(OptimizerConfig(**base, max_grad_norm=1e6), GRADS, PARAMS)
    # Updates after the first see the clipped history, and differ clearly.
    assert max(np.max(np.abs(clipped[1][k] - unclipped[1][k])) for k in PARAMS) > 1e-3
    # None behaves exactly like a threshold nothing reaches.
    _assert_updates_close(unclipped, never_reached, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(schedule="exponential"), "optimizer.schedule"),
        (dict(schedule="Cosine"), "optimizer.schedule"),
        (dict(warmup_steps=20, total_steps=10), "optimizer.warmup_steps"),
        (dict(warmup_steps=-1), "optimizer.warmup_steps"),
        (dict(learning_rate=0.0), "optimizer.learning_rate"),
        (dict(learning_rate=-1e-4), "optimizer.learning_rate"),
        (dict(learning_rate=float("nan")), "optimizer.learning_rate"),
        (dict(max_grad_norm=0.0), "optimizer.max_grad_norm"),
        (dict(max_grad_norm=-1.0), "optimizer.max_grad_norm"),
    ],
)
def test_bad_config_raises_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        OptimizerConfig(**kwargs)


def test_unknown_schedule_lists_allowed_values():
    with pytest.raises(ValueError) as err:
        OptimizerConfig(schedule="exponential")
    for name in ("constant", "cosine", "linear"):
        assert name in str(err.value)
