"""Sampling a token from each row's logits, with the row's own temperature, top-p and top-k: the JAX
engine's decode steps call `sample` (bridge.engines.slots).

The logprob reported for a sampled token is `log_softmax(logits / temperature)` over the whole
vocabulary, the quantity the learner recomputes; top-p / top-k only restrict what can be sampled. At
temperature 0 (greedy) it is `log_softmax(logits)`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _filter_logits(logits_BxV, top_p_B, top_k_B):
    """Logits outside each row's top-k / top-p set become -inf."""
    V = logits_BxV.shape[-1]
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V)
    kth_B = jnp.take_along_axis(sorted_BxV, (k_B - 1)[:, None], -1)
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    keep_sorted = before_BxV < top_p_B[:, None]
    cutoff_B = jnp.min(jnp.where(keep_sorted, sorted_BxV, jnp.inf), axis=-1)
    threshold_B = jnp.maximum(kth_B[:, 0], cutoff_B)
    return jnp.where(logits_BxV >= threshold_B[:, None], logits_BxV, -jnp.inf)


def _first_reaching(cum_BxN, threshold_B, mass_BxN):
    """Each row's first entry with mass whose cumulative mass reaches its threshold; where rounding leaves
    none, its last entry with mass. Never an entry without mass (a token top-k / top-p removed)."""
    N = cum_BxN.shape[-1]
    index_N = jnp.arange(N, dtype=jnp.int32)
    has_BxN = mass_BxN > 0
    first_B = jnp.min(jnp.where((cum_BxN >= threshold_B[:, None]) & has_BxN, index_N, N), -1)
    return jnp.minimum(first_B, jnp.max(jnp.where(has_BxN, index_N, -1), -1))


def cdf_block(vocab: int) -> int:
    """`_inverse_cdf`'s block for a vocabulary: near its square root, so that both levels' prefix-sum
    matrices are small (blocks of 32 made Qwen's 151,936 tokens a 4,748 x 4,748 one), and a divisor
    of it where one is close (no padding to copy each step), else a multiple of 8."""
    root = math.sqrt(vocab)
    near = [d for d in range(max(1, math.ceil(root / 2)), math.floor(2 * root) + 1) if vocab % d == 0]
    return min(near, key=lambda d: abs(d - root)) if near else 8 * math.ceil(root / 8)


def _inverse_cdf(probs_BxV, u_B, block: int | None = None):
    """The token at which each row's cumulative mass first reaches (1 - u) of its total, u in [0, 1):
    one uniform a row, where the Gumbel trick draws one per vocabulary entry (threefry over B x V was a
    fifth of a decode step on CPU). In two levels, blocks of `block` tokens (`cdf_block`) and then the
    tokens of the chosen block, each prefix sum a small matmul: a cumulative sum over the vocabulary
    is a reduce-window on XLA:CPU, most of a step's sampling."""
    B, V = probs_BxV.shape
    block = block or cdf_block(V)
    n = -(-V // block)
    x_BxnxK = jnp.pad(probs_BxV, ((0, 0), (0, n * block - V))).reshape(B, n, block)
    mass_Bxn = x_BxnxK.sum(-1)
    hi = jax.lax.Precision.HIGHEST  # full float32 sums on every backend
    cum_Bxn = jnp.dot(mass_Bxn, jnp.triu(jnp.ones((n, n), probs_BxV.dtype)), precision=hi)
    threshold_B = (1 - u_B) * cum_Bxn[:, -1]
    block_B = _first_reaching(cum_Bxn, threshold_B, mass_Bxn)
    x_BxK = jnp.take_along_axis(x_BxnxK, block_B[:, None, None], 1)[:, 0]
    before_B = (jnp.take_along_axis(cum_Bxn, block_B[:, None], 1) - jnp.take_along_axis(mass_Bxn, block_B[:, None], 1))[:, 0]
    cum_BxK = jnp.dot(x_BxK, jnp.triu(jnp.ones((block, block), probs_BxV.dtype)), precision=hi)
    return block_B * block + _first_reaching(cum_BxK, threshold_B - before_B, x_BxK)


def sample(logits_BxV, u_B, temperature_B, top_p_B, top_k_B):
    """Each row's token and its logprob, the token the inverse CDF of its filtered, tempered
    distribution gives at its uniform u_B in [0, 1)."""
    greedy_B = temperature_B <= 0
    scaled = logits_BxV / jnp.where(greedy_B, 1.0, temperature_B)[:, None]
    # One exponential pass serves the sampled token's log-softmax and the sampling: the top token
    # survives any filter, so the filtered probabilities are these with the removed ones zeroed.
    max_B = jnp.max(scaled, -1)
    exp_BxV = jnp.exp(scaled - max_B[:, None])
    log_total_B = jnp.log(jnp.sum(exp_BxV, -1))
    needs_filter = jnp.any((top_p_B < 1) | (top_k_B > 0))
    probs_BxV = jax.lax.cond(
        needs_filter, lambda: jnp.where(_filter_logits(scaled, top_p_B, top_k_B) > -jnp.inf, exp_BxV, 0.0),
        lambda: exp_BxV)
    sampled_B = _inverse_cdf(probs_BxV, u_B)
    # The argmax is a slow variadic reduce on XLA:CPU: only when a row is greedy.
    token_B = jax.lax.cond(jnp.any(greedy_B), lambda: jnp.where(greedy_B, jnp.argmax(logits_BxV, -1), sampled_B),
                           lambda: sampled_B).astype(jnp.int32)
    return token_B, jnp.take_along_axis(scaled, token_B[:, None], -1)[:, 0] - max_B - log_total_B
