"""Per-token log-probabilities of completions, chunked over the sequence.

The float32 (B, chunk, V) logits of one chunk exist at a time, forward and backward: the
backward pass recomputes each chunk's logits instead of storing them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxrl.models.decoder import Decoder, positions_from_mask


def _chunk_logits(h_RxD, w_DxV, temperature):
    z_RxV = jnp.matmul(h_RxD, w_DxV.astype(h_RxD.dtype), preferred_element_type=jnp.float32)
    return z_RxV / temperature


def _chunk_forward(h_RxD, w_DxV, t_R, temperature, with_entropy: bool):
    """log p(target), the entropy (0 without `with_entropy`) and logsumexp of R rows."""
    z_RxV = _chunk_logits(h_RxD, w_DxV, temperature)
    lse_R = jax.nn.logsumexp(z_RxV, axis=-1)
    logp_R = jnp.take_along_axis(z_RxV, t_R[:, None], -1)[:, 0] - lse_R
    if not with_entropy:
        return logp_R, jnp.zeros_like(logp_R), lse_R
    # -sum p log p = lse - sum p z: one pass over the logits, no (R, V) log-probabilities.
    ent_R = lse_R - jnp.sum(jnp.exp(z_RxV - lse_R[:, None]) * z_RxV, -1)
    return logp_R, ent_R, lse_R


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _scan_chunks(h_NxRxD, w_DxV, t_NxR, temperature, with_entropy: bool):
    logp_NxR, ent_NxR, _ = jax.lax.map(
        lambda a: _chunk_forward(a[0], w_DxV, a[1], temperature, with_entropy), (h_NxRxD, t_NxR)
    )
    return logp_NxR, ent_NxR


def _scan_chunks_fwd(h, w, t, temperature, with_entropy):
    # symbolic_zeros: primals arrive wrapped (value, perturbed).
    h_NxRxD, w_DxV, t_NxR, temperature = h.value, w.value, t.value, temperature.value
    logp_NxR, ent_NxR, lse_NxR = jax.lax.map(
        lambda a: _chunk_forward(a[0], w_DxV, a[1], temperature, with_entropy), (h_NxRxD, t_NxR)
    )
    return (logp_NxR, ent_NxR), (h_NxRxD, w_DxV, t_NxR, temperature, lse_NxR)


def _scan_chunks_bwd(with_entropy, residuals, cotangents):
    """The gradient through the logits of one chunk at a time, written out rather than
    differentiated: no gather transpose, and nothing for an output without a cotangent (the
    train step's entropy is a metric under stop_gradient)."""
    h_NxRxD, w_DxV, t_NxR, temperature, lse_NxR = residuals
    dlogp_NxR, dent_NxR = (None if isinstance(c, SymbolicZero) else c for c in cotangents)
    with_entropy = with_entropy and dent_NxR is not None
    zeros_NxR = jnp.zeros(t_NxR.shape, jnp.float32)
    dlogp_NxR = zeros_NxR if dlogp_NxR is None else dlogp_NxR
    dent_NxR = dent_NxR if with_entropy else zeros_NxR
    w = w_DxV.astype(h_NxRxD.dtype)

    def one(carry, xs):
        dw_DxV, dtemp = carry
        h_RxD, t_R, lse_R, dlogp_R, dent_R = xs
        z_RxV = _chunk_logits(h_RxD, w, temperature)
        logp_RxV = z_RxV - lse_R[:, None]
        p_RxV = jnp.exp(logp_RxV)
        target_RxV = jnp.arange(z_RxV.shape[1])[None, :] == t_R[:, None]
        # d log p_t / dz = onehot(t) - p.
        g_RxV = dlogp_R[:, None] * (target_RxV - p_RxV)
        if with_entropy:
            # Through -sum p log p, then log_softmax, in autodiff's order of operations.
            dlogp_RxV = -dent_R[:, None] * p_RxV * (logp_RxV + 1)
            g_RxV = g_RxV + dlogp_RxV - p_RxV * jnp.sum(dlogp_RxV, -1, keepdims=True)
        # z = logits / temperature, so dz / dtemperature = -z / temperature.
        dtemp = dtemp - jnp.sum(g_RxV * z_RxV) / temperature
        g_RxV = (g_RxV / temperature).astype(h_RxD.dtype)
        dh_RxD = jnp.matmul(g_RxV, w.T, preferred_element_type=jnp.float32).astype(h_RxD.dtype)
        dw_DxV = dw_DxV + jnp.matmul(h_RxD.T, g_RxV, preferred_element_type=jnp.float32)
        return (dw_DxV, dtemp), dh_RxD

    zero = (jnp.zeros(w_DxV.shape, jnp.float32), jnp.zeros((), jnp.float32))
    (dw_DxV, dtemp), dh_NxRxD = jax.lax.scan(
        one, zero, (h_NxRxD, t_NxR, lse_NxR, dlogp_NxR, dent_NxR)
    )
    dtemp = jnp.reshape(dtemp, jnp.shape(temperature)).astype(jnp.result_type(temperature))
    return dh_NxRxD, dw_DxV.astype(w_DxV.dtype), None, dtemp


_scan_chunks.defvjp(_scan_chunks_fwd, _scan_chunks_bwd, symbolic_zeros=True)


def chunked_logprobs(h_BxCxD, w_DxV, targets_BxC, temperature: float, chunk: int, with_entropy: bool):
    """log p(target) and (optionally) the entropy at each of C positions, `chunk` at a time."""
    B, C, D = h_BxCxD.shape
    chunk = min(chunk, C)
    pad = -C % chunk
    h = jnp.pad(h_BxCxD, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets_BxC, ((0, 0), (0, pad)))
    n = (C + pad) // chunk
    # Each chunk's B x chunk rows as one 2-D matmul.
    h_NxRxD = h.reshape(B, n, chunk, D).swapaxes(0, 1).reshape(n, B * chunk, D)
    t_NxR = targets.reshape(B, n, chunk).swapaxes(0, 1).reshape(n, B * chunk)
    temperature = jnp.asarray(temperature, jnp.float32)
    logp_NxR, ent_NxR = _scan_chunks(h_NxRxD, w_DxV, t_NxR, temperature, with_entropy)

    def unchunk(x_NxR):
        return x_NxR.reshape(n, B, chunk).swapaxes(0, 1).reshape(B, -1)[:, :C]

    return unchunk(logp_NxR), (unchunk(ent_NxR) if with_entropy else None)


def completion_logprobs(
    model: Decoder,
    prompt_BxP,
    prompt_mask_BxP,
    completion_BxC,
    completion_mask_BxC,
    temperature: float = 1.0,
    chunk: int = 128,
    with_entropy: bool = False,
):
    """Log-probabilities (B, C) of each completion token given everything before it.

    Prompts are left-padded, completions right-padded; the masks mark real tokens (tool
    results included: they are context even where the loss ignores them).
    """
    P = prompt_BxP.shape[1]
    tokens = jnp.concatenate([prompt_BxP, completion_BxC], axis=1)
    mask = jnp.concatenate([prompt_mask_BxP, completion_mask_BxC], axis=1)
    h_BxTxD, _ = model.hidden(tokens, positions_from_mask(mask), mask)
    # The hidden state at t predicts token t + 1.
    h_BxCxD = h_BxTxD[:, P - 1:-1]
    return chunked_logprobs(
        h_BxCxD, model.head_weight(), completion_BxC, temperature, chunk, with_entropy
    )
