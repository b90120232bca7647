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
    """Rows per block of `_blocked_matmul`: a power of two near half the mean rows an expert gets (so
    blocks padded to it add at most about half the work), from 8 to 256."""
    mean = max(1, assignments // (2 * experts))
    return int(min(256, max(8, 2 ** int(np.log2(mean)))))


def blocks(assignments: int, experts: int) -> tuple[int, int]:
    """(blocks, rows per block) of `_blocked_matmul` over `assignments` rows: blocks enough for any split
    of the rows over the experts."""
    b = _block_rows(assignments, experts)
    return -(-(assignments + experts * (b - 1)) // b), b


def _blocked_matmul(x_AxD, w_ExDxF, sizes_E):
    """`ragged_dot` as blocks of rows that each belong to one expert: every expert's rows padded to whole
    blocks, one batched matmul of each block with its expert's weight (rows past the groups: zeros). Its
    work grows with the rows, not with the experts (XLA:CPU lowers `ragged_dot` to a dense product over
    every expert)."""
    A, D = x_AxD.shape
    E = w_ExDxF.shape[0]
    n, b = blocks(A, E)
    padded_E = -(-sizes_E // b) * b
    padded_end_E = jnp.cumsum(padded_E)
    start_E = jnp.cumsum(sizes_E) - sizes_E
    expert_A = jnp.repeat(jnp.arange(E), sizes_E, total_repeat_length=A)
    grouped_A = jnp.arange(A) < sizes_E.sum()
    # A row past the groups goes nowhere: past the blocks, each to its own place (the indices stay unique).
    dest_A = jnp.where(grouped_A, (padded_end_E - padded_E)[expert_A] + jnp.arange(A) - start_E[expert_A],
                       n * b + jnp.arange(A))
    x_PxD = jnp.zeros((n * b, D), x_AxD.dtype).at[dest_A].set(x_AxD, unique_indices=True, mode="drop")
    expert_n = jnp.minimum(jnp.searchsorted(padded_end_E, jnp.arange(n) * b, side="right"), E - 1)
    y = jnp.einsum("nbd,ndf->nbf", x_PxD.reshape(n, b, D), w_ExDxF[expert_n], preferred_element_type=jnp.float32)
    return y.reshape(n * b, -1).at[dest_A].get(mode="fill", fill_value=0).astype(x_AxD.dtype)


def grouped_matmul(x_AxD, w_ExDxF, sizes_E):
    """Rows sorted by expert (the first sizes_E[0] rows expert 0's, ...) each times its expert's weight,
    rows past the groups zeros: `jax.lax.ragged_dot` on GPU and TPU, blocks of rows on CPU."""

    def ragged(x, w, sizes):
        return jax.lax.ragged_dot(x, w, sizes.astype(jnp.int32), preferred_element_type=jnp.float32).astype(x.dtype)

    return jax.lax.platform_dependent(x_AxD, w_ExDxF, sizes_E, cpu=_blocked_matmul, default=ragged)


def experts_forward(x_NxD, experts_NxK, weights_NxK, gate_up_ExDxG, down_ExIxD, activation, gate_up_bias_ExG=None,
                    down_bias_ExD=None, first_expert=0, mesh=None):
    """sum_k weights[n, k] * expert_{experts[n, k]}(x[n]), each expert down(activation(x gate_up)). The
    token-expert pairs are sorted by expert and run as two grouped matmuls.

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
    h_AxG = grouped_matmul(x_NxD[token_A], gate_up_ExDxG, sizes_E)
    if gate_up_bias_ExG is not None:
        h_AxG = h_AxG + gate_up_bias_ExG.at[expert_A].get(mode="fill", fill_value=0).astype(h_AxG.dtype)
    out_AxD = grouped_matmul(activation(h_AxG), down_ExIxD, sizes_E)
    if down_bias_ExD is not None:
        out_AxD = out_AxD + down_bias_ExD.at[expert_A].get(mode="fill", fill_value=0).astype(out_AxD.dtype)
    weight_A = jnp.where(mine_NxK, weights_NxK, 0).reshape(-1)[order_A]
    out_AxD = out_AxD * weight_A[:, None].astype(out_AxD.dtype)
    return jnp.zeros_like(x_NxD).at[token_A].add(out_AxD)


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
