"""Mixture-of-experts math: routing, the experts' grouped matmul, and the load-balancing statistics.

Pure functions of arrays; `decoder.MoE` holds the weights. A token's route is its `top_k` expert ids.
With a replayed route (rollout routing replay, R3: arXiv 2510.11370) the token goes to the recorded
experts instead of its router's top-k, and their weights still come from its own router's scores over
them, so the router keeps its gradient.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

SCORINGS = ("softmax", "topk_softmax")


class RouterStats(NamedTuple):
    """One or more MoE layers' routing over the real tokens of a forward pass: what the load-balancing
    loss needs, summed (layers add up), and the router's own top-k of every token."""

    top_k_counts_E: jax.Array  # float32: assignments of the router's own top-k to each expert
    probs_E: jax.Array  # float32: the softmax of the router's logits, summed over tokens
    tokens: jax.Array  # float32: real tokens, once per layer


def route_dtype(num_experts: int):
    """The unsigned integer routes are stored and sent as: the smallest that holds every expert id and
    `no_route` beside them."""
    return np.uint8 if num_experts < 255 else np.uint16


def no_route(num_experts: int) -> int:
    """The id that marks a token without a recorded route (one no sampler ever fed to the model)."""
    return int(np.iinfo(route_dtype(num_experts)).max)


def route(logits_NxE, top_k: int, scoring: str, norm_topk: bool, replay_NxK=None):
    """(experts_NxK int32, weights_NxK float32, own_NxK int32): each token's experts (`replay_NxK` where
    given and recorded, else its router's top-k `own_NxK`) and their weights from the router's scores
    over them. A replayed token without a recorded route (`no_route`) takes its own.

    `softmax` (Qwen-MoE, Mixtral): probabilities over every expert, optionally renormalised over the
    chosen ones (`norm_topk`). `topk_softmax` (gpt-oss): a softmax over the chosen experts' logits."""
    logits = logits_NxE.astype(jnp.float32)
    if scoring not in SCORINGS:
        raise ValueError(f"router scoring {scoring!r}; one of {SCORINGS}")
    probs = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else None
    own = jax.lax.top_k(logits if probs is None else probs, top_k)[1]
    experts = own
    if replay_NxK is not None:
        recorded_Nx1 = replay_NxK[:, :1] != no_route(logits.shape[-1])
        experts = jnp.where(recorded_Nx1, replay_NxK.astype(jnp.int32), own)
    if scoring == "topk_softmax":
        return experts, jax.nn.softmax(jnp.take_along_axis(logits, experts, -1), axis=-1), own
    weights = jnp.take_along_axis(probs, experts, -1)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdims=True)
    return experts, weights, own


def router_stats(logits_NxE, own_NxK, mask_N) -> RouterStats:
    """The load-balancing statistics of one layer over the tokens where mask_N holds."""
    E = logits_NxE.shape[-1]
    real_N = mask_N.astype(jnp.float32)
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    counts_E = jnp.zeros(E, jnp.float32).at[own_NxK.reshape(-1)].add(jnp.repeat(real_N, own_NxK.shape[-1]))
    return RouterStats(jax.lax.stop_gradient(counts_E), (probs_NxE * real_N[:, None]).sum(0), real_N.sum())


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """Switch Transformer's auxiliary loss as transformers computes it for Qwen-MoE and gpt-oss
    (`load_balancing_loss_func`): E * sum_e f_e P_e, f the share of top-k assignments and P the mean
    router probability of expert e, both over every layer's real tokens together."""
    E = stats.probs_E.shape[-1]
    rows = jnp.maximum(stats.tokens, 1.0)
    return E * jnp.sum((stats.top_k_counts_E / rows) * (stats.probs_E / rows))


def sum_stats(stats: list[RouterStats]) -> RouterStats:
    return RouterStats(*(sum(parts) for parts in zip(*stats)))


def _block_rows(assignments: int, experts: int) -> int:
    """Rows per block of `blocked_experts`: a power of two near half the mean rows an expert gets (so
    blocks padded to it add at most about half the work), from 8 to 256."""
    mean = max(1, assignments // (2 * experts))
    return int(min(256, max(8, 2 ** int(np.log2(mean)))))


def blocks(assignments: int, experts: int) -> tuple[int, int]:
    """(blocks, rows per block) of `blocked_experts` over `assignments` rows: blocks enough for any split
    of the rows over the experts."""
    b = _block_rows(assignments, experts)
    return -(-(assignments + experts * (b - 1)) // b), b


def experts_forward(x_NxD, experts_NxK, weights_NxK, gate_up_ExDxG, down_ExIxD, activation, gate_up_bias_ExG=None,
                    down_bias_ExD=None, first_expert=0, mesh=None):
    """sum_k weights[n, k] * expert_{experts[n, k]}(x[n]), each expert down(activation(x gate_up)). The
    token-expert pairs are sorted by expert and run through their experts as groups: `ragged_experts` on
    GPU and TPU, `blocked_experts` on CPU.

    The weights may be a shard of the experts, those from `first_expert` on: pairs of other experts add
    nothing (and sort past every group). Under a `mesh` with an `expert` axis of more than one device, the
    experts are split over it (`expert_parallel`)."""
    if mesh is not None and not mesh.empty and mesh.shape.get("expert", 1) > 1:
        return expert_parallel(x_NxD, experts_NxK, weights_NxK, gate_up_ExDxG, down_ExIxD, activation, mesh,
                               gate_up_bias_ExG, down_bias_ExD)
    N, K = experts_NxK.shape
    E = gate_up_ExDxG.shape[0]
    local_NxK = experts_NxK - first_expert
    mine_NxK = (local_NxK >= 0) & (local_NxK < E)
    key_A = jnp.where(mine_NxK, local_NxK, E).reshape(-1)  # E: another shard's pair, after every group
    order_A = jnp.argsort(key_A, stable=True)
    expert_A, token_A = key_A[order_A], order_A // K
    sizes_E = jnp.zeros(E, jnp.int32).at[key_A].add(1, mode="drop")
    weight_A = jnp.where(mine_NxK, weights_NxK, 0).reshape(-1)[order_A]
    experts = (gate_up_ExDxG, down_ExIxD, gate_up_bias_ExG, down_bias_ExD)
    return jax.lax.platform_dependent(x_NxD, token_A, expert_A, weight_A, sizes_E, experts,
                                      cpu=functools.partial(blocked_experts, activation=activation),
                                      default=functools.partial(ragged_experts, activation=activation))


def ragged_experts(x_NxD, token_A, expert_A, weight_A, sizes_E, experts, activation):
    """The pairs sorted by expert (token_A[a] to expert_A[a] with weight_A[a]; expert E: none here, past
    every group) through their experts (gate_up, down and their biases or None) as two `jax.lax.ragged_dot`s,
    summed into each token's output."""
    gate_up, down, gate_up_bias, down_bias = experts

    def grouped(x, w):
        return jax.lax.ragged_dot(x, w, sizes_E, preferred_element_type=jnp.float32).astype(x.dtype)

    h_AxG = grouped(x_NxD[token_A], gate_up)
    if gate_up_bias is not None:
        h_AxG = h_AxG + gate_up_bias.at[expert_A].get(mode="fill", fill_value=0).astype(h_AxG.dtype)
    out_AxD = grouped(activation(h_AxG), down)
    if down_bias is not None:
        out_AxD = out_AxD + down_bias.at[expert_A].get(mode="fill", fill_value=0).astype(out_AxD.dtype)
    return jnp.zeros_like(x_NxD).at[token_A].add(out_AxD * weight_A[:, None].astype(out_AxD.dtype))


def blocked_experts(x_NxD, token_A, expert_A, weight_A, sizes_E, experts, activation):
    """`ragged_experts` for XLA:CPU, which lowers `ragged_dot` to a product with every expert: each expert's
    pairs padded to whole blocks of `blocks` rows, and the blocks in use run one after another, each through
    its expert's whole MLP (`_expert_blocks`). A block reads its expert's weights where they lie and the
    weights' gradients add up in place, where a batched matmul of every block copied an expert's weights
    per block and scattered their gradients back (docs/benchmarks.md)."""
    A, E, D = token_A.shape[0], sizes_E.shape[0], x_NxD.shape[1]
    n, b = blocks(A, E)
    padded_E = -(-sizes_E // b) * b
    padded_end_E = jnp.cumsum(padded_E)
    start_E = jnp.cumsum(sizes_E) - sizes_E
    expert = jnp.minimum(expert_A, E - 1)
    # A pair past the groups goes nowhere: past the blocks, each to its own place (the indices stay unique).
    dest_A = jnp.where(expert_A < E, (padded_end_E - padded_E)[expert] + jnp.arange(A) - start_E[expert],
                       n * b + jnp.arange(A))
    # Padding rows take token 0 with weight 0: they add nothing, and their gradients are zeros.
    token_P = jnp.zeros(n * b, jnp.int32).at[dest_A].set(token_A, unique_indices=True, mode="drop")
    weight_P = jnp.zeros(n * b, weight_A.dtype).at[dest_A].set(weight_A, unique_indices=True, mode="drop")
    expert_n = jnp.minimum(jnp.searchsorted(padded_end_E, jnp.arange(n) * b, side="right"), E - 1)
    x_NxBxD, *experts = _vary_alike(x_NxD[token_P].reshape(n, b, D), *experts)
    y_NxBxD = _expert_blocks(x_NxBxD, expert_n, padded_end_E[-1] // b, tuple(experts), activation)
    y_PxD = y_NxBxD.reshape(n * b, D) * weight_P[:, None].astype(y_NxBxD.dtype)
    return jnp.zeros_like(x_NxD).at[token_P].add(y_PxD)


def _block_mlp(x_bxD, e, experts, activation):
    """(h, y) of one block's rows through expert e: h its gate and up projection, y its output."""
    gate_up, down, gate_up_bias, down_bias = experts
    h = jnp.dot(x_bxD, gate_up[e], preferred_element_type=jnp.float32).astype(x_bxD.dtype)
    if gate_up_bias is not None:
        h = h + gate_up_bias[e].astype(h.dtype)
    y = jnp.dot(activation(h), down[e], preferred_element_type=jnp.float32).astype(x_bxD.dtype)
    return h, (y if down_bias is None else y + down_bias[e].astype(y.dtype))


def _vary_alike(*arrays):
    """`arrays` (None kept), each made to vary over every `shard_map` axis one of them varies over (zeros of
    the others added; outside `shard_map`, nothing changes). A loop's carry must be typed as what its body
    makes of them, and so must a hand-written gradient: JAX sums it back over the axes its array did not vary
    over (expert parallelism's weights vary over `expert` alone, its tokens over the batch axes too)."""
    zero = sum(jnp.zeros_like(a, shape=(), dtype=jnp.float32) for a in arrays if a is not None)
    return tuple(None if a is None else a + zero.astype(a.dtype) for a in arrays)


def _run_blocks(x_NxBxD, expert_n, used, experts, activation, keep_h: bool):
    """Blocks [0, used) through their experts: the outputs (zeros past `used`), and with `keep_h` the gate and
    up projections (what the backward pass needs)."""
    n, b, _ = x_NxBxD.shape

    def body(i, carry):
        y, h_all = carry
        h, out = _block_mlp(x_NxBxD[i], expert_n[i], experts, activation)
        return y.at[i].set(out), (h_all.at[i].set(h) if keep_h else h_all)

    h_all = jnp.zeros_like(x_NxBxD, shape=(n, b, experts[0].shape[-1]) if keep_h else ())
    return jax.lax.fori_loop(0, used, body, (jnp.zeros_like(x_NxBxD), h_all))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _expert_blocks(x_NxBxD, expert_n, used, experts, activation):
    """Each block of rows x_NxBxD[i], i < used, through expert expert_n[i]'s MLP; zeros past `used`. A loop
    of a number of blocks known only when it runs: its gradient is written out (`_expert_blocks_bwd`). The
    rows and the experts vary alike (`_vary_alike`)."""
    return _run_blocks(x_NxBxD, expert_n, used, experts, activation, keep_h=False)[0]


def _expert_blocks_fwd(x_NxBxD, expert_n, used, experts, activation):
    y, h_all = _run_blocks(x_NxBxD, expert_n, used, experts, activation, keep_h=True)
    return y, (x_NxBxD, expert_n, used, experts, h_all)


def _expert_blocks_bwd(activation, residuals, dy_NxBxD):
    """Per block: the activation's gradient from its kept input, the input's gradient, and the expert's
    weight (and bias) gradients added to that expert's in place."""
    x_NxBxD, expert_n, used, experts, h_all = residuals
    gate_up, down, gate_up_bias, down_bias = experts

    def t_dot(a, b, contract):  # a . b contracting a's and b's axes `contract`, in float32
        return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)

    def body(i, grads):
        dx, d_gate_up, d_down, d_gate_up_bias, d_down_bias = grads
        e, dy = expert_n[i], dy_NxBxD[i]
        a, activation_vjp = jax.vjp(activation, h_all[i])
        d_down = d_down.at[e].add(t_dot(a, dy, ((0,), (0,))))
        (dh,) = activation_vjp(t_dot(dy, down[e], ((1,), (1,))).astype(a.dtype))
        d_gate_up = d_gate_up.at[e].add(t_dot(x_NxBxD[i], dh, ((0,), (0,))))
        if gate_up_bias is not None:
            d_gate_up_bias = d_gate_up_bias.at[e].add(dh.sum(0, dtype=jnp.float32))
        if down_bias is not None:
            d_down_bias = d_down_bias.at[e].add(dy.sum(0, dtype=jnp.float32))
        return (dx.at[i].set(t_dot(dh, gate_up[e], ((1,), (1,))).astype(dx.dtype)), d_gate_up, d_down,
                d_gate_up_bias, d_down_bias)

    def zeros(w):
        return None if w is None else jnp.zeros_like(w, dtype=jnp.float32)

    grads = jax.lax.fori_loop(0, used, body, (jnp.zeros_like(x_NxBxD), *map(zeros, experts)))
    d_experts = tuple(None if w is None else g.astype(w.dtype) for w, g in zip(experts, grads[1:]))
    return grads[0], None, None, d_experts


_expert_blocks.defvjp(_expert_blocks_fwd, _expert_blocks_bwd)


def expert_parallel(x_NxD, experts_NxK, weights_NxK, gate_up_ExDxG, down_ExIxD, activation, mesh,
                    gate_up_bias_ExG=None, down_bias_ExD=None):
    """`experts_forward` with the experts split over the mesh's `expert` axis: each device gathers the
    tokens (and their routes) of its `expert` group, runs them through the experts it holds, and the
    group's outputs are summed back to the devices the tokens came from (a reduce-scatter). Tokens stay
    split over the other batch axes; a device's grouped matmuls take only its experts' pairs."""
    # Tokens are split over every axis that does not split heads (jaxrl.sharding.BATCH_AXES).
    rows = P(tuple(a for a in mesh.axis_names if a != "tp"), None)
    experts = P("expert", *([None] * (gate_up_ExDxG.ndim - 1)))
    biased = gate_up_bias_ExG is not None

    def shard(x_nxD, experts_nxK, weights_nxK, gate_up, down, *biases):
        gathered = [jax.lax.all_gather(a, "expert", tiled=True) for a in (x_nxD, experts_nxK, weights_nxK)]
        first = jax.lax.axis_index("expert") * gate_up.shape[0]
        y = experts_forward(*gathered, gate_up, down, activation, *biases, first_expert=first)
        return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)

    args = (x_NxD, experts_NxK, weights_NxK, gate_up_ExDxG, down_ExIxD)
    bias_args = (gate_up_bias_ExG, down_bias_ExD) if biased else ()
    in_specs = (rows, rows, rows, experts, experts) + ((P("expert", None),) * 2 if biased else ())
    return jax.shard_map(shard, mesh=mesh, in_specs=in_specs, out_specs=rows)(*args, *bias_args)


def every_expert_forward(x_NxD, experts_NxK, weights_NxK, gate_up_ExDxG, down_ExIxD, activation):
    """`experts_forward` the dense way: every expert on every token, then each token's own picked. The
    reference the grouped path is checked and measured against (E / K times its arithmetic)."""
    h_ExNxG = jnp.einsum("nd,edg->eng", x_NxD, gate_up_ExDxG)
    out_ExNxD = jnp.einsum("eni,eid->end", activation(h_ExNxG), down_ExIxD)
    picked_NxKxD = out_ExNxD[experts_NxK, jnp.arange(x_NxD.shape[0])[:, None]]
    return (picked_NxKxD * weights_NxK[..., None].astype(picked_NxKxD.dtype)).sum(1)


ACTIVATIONS = ("silu_glu", "clamped_swiglu")


def silu_glu(h_AxG):
    """Qwen-MoE's expert activation: silu(gate) * up, gate and up the two halves of the fused projection."""
    gate, up = jnp.split(h_AxG, 2, axis=-1)
    return jax.nn.silu(gate) * up


def clamped_swiglu(h_AxG, limit: float, alpha: float):
    """gpt-oss's expert activation: (up + 1) * gate * sigmoid(alpha * gate), gate clamped above at `limit`
    and up to [-limit, limit]; gate and up interleaved in the fused projection (even and odd columns)."""
    gate = jnp.minimum(h_AxG[..., ::2], limit)
    up = jnp.clip(h_AxG[..., 1::2], -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * alpha)


def expert_activation(name: str, limit: float, alpha: float):
    """The activation `experts_forward` applies, by its config name (one of ACTIVATIONS)."""
    if name == "silu_glu":
        return silu_glu
    if name == "clamped_swiglu":
        return functools.partial(clamped_swiglu, limit=limit, alpha=alpha)
    raise ValueError(f"expert activation {name!r}; one of {ACTIVATIONS}")
