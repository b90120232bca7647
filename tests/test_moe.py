"""Mixture-of-experts math against references: the grouped matmul against a dense product over every
expert, routing and the load-balancing loss against transformers' Qwen3-MoE code, gpt-oss's biased
router and experts against its."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.gpt_oss import modeling_gpt_oss as hf_oss
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_moe

from jaxrl.models import moe


@pytest.mark.parametrize("sizes, past, biased", [([5, 0, 17, 1, 0, 40, 3, 0], 0, False), ([0] * 7 + [64], 0, True),
                                                 ([1] * 8, 0, False), ([300, 2, 0, 0, 1, 0, 0, 9], 0, False),
                                                 ([5, 0, 17, 1], 30, True)])
def test_blocked_experts_are_the_ragged_dot_ones_with_their_gradients(sizes, past, biased):
    """The CPU's blocks against `ragged_dot` (XLA:CPU's dense expansion: exact, however slow), gpt-oss's
    biases and activation or Qwen's; `past` pairs after every group (another shard's experts) add nothing."""
    rng = np.random.default_rng(len(sizes) + sum(sizes))
    N, A, E, D, I = 50, sum(sizes) + past, len(sizes), 24, 20

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape) / 3, jnp.float32)

    x = normal(N, D)
    token_A = jnp.asarray(rng.integers(0, N, A), jnp.int32)
    expert_A = jnp.asarray(np.repeat(np.arange(E + 1), sizes + [past]), jnp.int32)
    weight_A = jnp.asarray(rng.uniform(size=A), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    experts = (normal(E, D, 2 * I), normal(E, I, D)) + ((normal(E, 2 * I), normal(E, D)) if biased else (None, None))
    activation = moe.expert_activation("clamped_swiglu" if biased else "silu_glu", limit=1.0, alpha=1.702)

    def run(path):
        return lambda x, w, experts: path(x, token_A, expert_A, w, sizes, experts, activation)

    want = run(moe.ragged_experts)(x, weight_A, experts)
    np.testing.assert_allclose(run(moe.blocked_experts)(x, weight_A, experts), want, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(want)).max() > 0.1

    def grads(path):
        return jax.grad(lambda *a: jnp.sum(jnp.sin(run(path)(*a))), (0, 1, 2))(x, weight_A, experts)

    got, ref = jax.tree.leaves(grads(moe.blocked_experts)), jax.tree.leaves(grads(moe.ragged_experts))
    assert len(got) == len(ref) == 4 + 2 * biased
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_block_rows_keep_padding_under_half_the_work():
    for assignments, experts in [(16, 8), (512, 128), (8192, 16), (10**6, 64)]:
        b = moe._block_rows(assignments, experts)
        assert 8 <= b <= 256 and b & (b - 1) == 0
        assert experts * b <= max(assignments, 8 * experts), (assignments, experts, b)


def test_experts_forward_is_every_expert_on_every_token_then_picked():
    rng = np.random.default_rng(0)
    N, D, E, I, K = 37, 16, 6, 12, 2
    x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(N)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(N, K)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(E, D, 2 * I)) / 4, jnp.float32)
    down = jnp.asarray(rng.normal(size=(E, I, D)) / 4, jnp.float32)
    got = moe.experts_forward(x, experts, weights, gate_up, down, moe.silu_glu)
    want = moe.every_expert_forward(x, experts, weights, gate_up, down, moe.silu_glu)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def grads(f):
        return jax.grad(lambda x, e, w, gu, d: jnp.sum(f(x, e, w, gu, d, moe.silu_glu) ** 2), (0, 2, 3, 4))
    for g, r in zip(grads(moe.experts_forward)(x, experts, weights, gate_up, down),
                    grads(moe.every_expert_forward)(x, experts, weights, gate_up, down)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("norm_topk", [False, True])
def test_routing_is_transformers_and_a_replayed_route_keeps_the_routers_gradient(norm_topk):
    rng = np.random.default_rng(1)
    N, D, E, K = 20, 16, 8, 3
    x = rng.normal(size=(N, D)).astype(np.float32)
    w_router = rng.normal(size=(E, D)).astype(np.float32)
    config = hf_moe.Qwen3MoeConfig(hidden_size=D, num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm_topk)
    router = hf_moe.Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.tensor(w_router))
        _, hf_weights, hf_experts = router(torch.tensor(x))
    logits = jnp.asarray(x @ w_router.T)
    experts, weights, own = moe.route(logits, K, "softmax", norm_topk)
    np.testing.assert_array_equal(experts, hf_experts.numpy())
    np.testing.assert_array_equal(own, experts)
    np.testing.assert_allclose(weights, hf_weights.numpy(), rtol=1e-6, atol=1e-6)

    replay = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(N)]), jnp.int32)
    experts, weights, own = moe.route(logits, K, "softmax", norm_topk, replay)
    np.testing.assert_array_equal(experts, replay)
    np.testing.assert_array_equal(own, hf_experts.numpy())  # still the router's own choice, for the metrics
    probs = jax.nn.softmax(logits)
    want = jnp.take_along_axis(probs, replay, -1)
    np.testing.assert_allclose(weights, want / want.sum(-1, keepdims=True) if norm_topk else want, rtol=1e-6)
    c = jnp.asarray(rng.normal(size=(N, K)), jnp.float32)
    grad = jax.grad(lambda z: (moe.route(z, K, "softmax", norm_topk, replay)[1] * c).sum())(logits)
    assert np.abs(np.asarray(grad)).max() > 1e-3, "the replayed experts' weights must still train the router"


def test_topk_softmax_scoring_weights_the_chosen_experts_by_a_softmax_of_their_logits():
    logits = jnp.asarray([[0.5, 3.0, -1.0, 2.0], [1.0, 1.5, 4.0, 0.0]])
    experts, weights, _ = moe.route(logits, 2, "topk_softmax", False)
    np.testing.assert_array_equal(experts, [[1, 3], [2, 1]])
    np.testing.assert_allclose(weights, jax.nn.softmax(jnp.asarray([[3.0, 2.0], [4.0, 1.5]])), rtol=1e-6)
    with pytest.raises(ValueError, match="router scoring 'sigmoid'"):
        moe.route(logits, 2, "sigmoid", False)


def test_gpt_oss_router_and_biased_clamped_experts_are_transformers():
    """A biased router's top-k softmax, experts with biases and the clamped, interleaved SwiGLU: the
    inputs are large enough that the clamp cuts gates and ups on both sides."""
    rng = np.random.default_rng(3)
    N, D, E, I, K, limit = 40, 16, 6, 12, 2, 3.0
    config = hf_oss.GptOssConfig(hidden_size=D, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
                                 swiglu_limit=limit)
    block = hf_oss.GptOssMLP(config)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p))
    x = rng.normal(size=(N, D)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.tensor(x)[None])[0][0].numpy()
    w = {name: jnp.asarray(p.detach().numpy()) for name, p in block.named_parameters()}
    logits = jnp.asarray(x) @ w["router.weight"].T + w["router.bias"]
    experts, weights, _ = moe.route(logits, K, "topk_softmax", False)
    got = moe.experts_forward(jnp.asarray(x), experts, weights, w["experts.gate_up_proj"], w["experts.down_proj"],
                              moe.expert_activation("clamped_swiglu", limit, config.swiglu_alpha),
                              w["experts.gate_up_proj_bias"], w["experts.down_proj_bias"])
    h = jnp.einsum("nd,edg->eng", jnp.asarray(x), w["experts.gate_up_proj"]) + w["experts.gate_up_proj_bias"][:, None]
    assert (h[..., ::2] > limit).any() and (h[..., 1::2] < -limit).any() and (h[..., 1::2] > limit).any()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_load_balancing_loss_is_transformers_over_layers_and_real_tokens():
    rng = np.random.default_rng(2)
    layers, N, E, K = 3, 26, 8, 2
    logits = [rng.normal(size=(N, E)).astype(np.float32) for _ in range(layers)]
    mask = (rng.uniform(size=N) < 0.7).astype(np.int64)
    want = hf_moe.load_balancing_loss_func(tuple(torch.tensor(z) for z in logits), E, K,
                                           torch.tensor(mask[None])).item()
    stats = [moe.router_stats(jnp.asarray(z), jax.lax.top_k(jax.nn.softmax(jnp.asarray(z)), K)[1],
                              jnp.asarray(mask, bool)) for z in logits]
    np.testing.assert_allclose(moe.load_balancing_loss(moe.sum_stats(stats)), want, rtol=1e-5)


def test_routes_are_stored_in_the_smallest_unsigned_integer_beside_no_route():
    assert moe.route_dtype(8) == moe.route_dtype(254) == np.uint8 and moe.no_route(8) == 255
    assert moe.route_dtype(256) == np.uint16 and moe.no_route(256) == 65535


def test_a_token_without_a_recorded_route_takes_its_routers_own():
    logits = jnp.asarray([[0.5, 3.0, -1.0, 2.0], [1.0, 1.5, 4.0, 0.0]])
    replay = jnp.asarray([[0, 2], [moe.no_route(4)] * 2], jnp.uint8)
    experts, _, own = moe.route(logits, 2, "softmax", True, replay)
    np.testing.assert_array_equal(experts, [[0, 2], [2, 1]])
    np.testing.assert_array_equal(own, [[1, 3], [2, 1]])
