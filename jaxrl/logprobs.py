"""Per-token log-probabilities of completions, chunked over the sequence.

The float32 (B, chunk, V) logits of one chunk exist at a time, forward and backward: the
backward pass recomputes each chunk's logits instead of storing them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxrl.models import moe
from jaxrl.models.decoder import Decoder, dot_over_rows, positions_from_mask


def _contract(x, y, x_dim: int, y_dim: int):
    """x . y over one dimension of each (2-D), in float32."""
    dims = (((x_dim,), (y_dim,)), ((), ()))
    return jax.lax.dot_general(x, y, dims, preferred_element_type=jnp.float32)


def _chunk_logits(h_RxD, w, vocab_major: bool, temperature):
    """(R, V) float32 logits / temperature; w is (V, D) if vocab_major else (D, V)."""
    return _contract(h_RxD, w.astype(h_RxD.dtype), 1, 1 if vocab_major else 0) / temperature


def _chunk_log_softmax(z_RxV, max_R, logsum_R):
    # jax.nn.log_softmax's order of operations: (z - max) - log sum exp(z - max).
    return (z_RxV - max_R[:, None]) - logsum_R[:, None]


def _chunk_forward(h_RxD, w, t_R, temperature, vocab_major: bool, with_entropy: bool):
    """log p(target), the entropy (0 without `with_entropy`), and the row max and log-sum
    that give back the log-softmax from recomputed logits."""
    z_RxV = _chunk_logits(h_RxD, w, vocab_major, temperature)
    max_R = jax.lax.stop_gradient(z_RxV.max(-1))
    logsum_R = jnp.log(jnp.sum(jnp.exp(z_RxV - max_R[:, None]), -1))
    logp_RxV = _chunk_log_softmax(z_RxV, max_R, logsum_R)
    logp_R = jnp.take_along_axis(logp_RxV, t_R[:, None], -1)[:, 0]
    if not with_entropy:
        return logp_R, jnp.zeros_like(logp_R), (max_R, logsum_R)
    return logp_R, -jnp.sum(jnp.exp(logp_RxV) * logp_RxV, -1), (max_R, logsum_R)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _scan_chunks(h_NxRxD, w, t_NxR, temperature, vocab_major: bool, with_entropy: bool):
    logp_NxR, ent_NxR, _ = jax.lax.map(
        lambda a: _chunk_forward(a[0], w, a[1], temperature, vocab_major, with_entropy),
        (h_NxRxD, t_NxR),
    )
    return logp_NxR, ent_NxR


def _scan_chunks_fwd(h, w, t, temperature, vocab_major, with_entropy):
    # symbolic_zeros: primals arrive wrapped (value, perturbed).
    h_NxRxD, w, t_NxR, temperature = h.value, w.value, t.value, temperature.value
    logp_NxR, ent_NxR, norm_NxR = jax.lax.map(
        lambda a: _chunk_forward(a[0], w, a[1], temperature, vocab_major, with_entropy),
        (h_NxRxD, t_NxR),
    )
    return (logp_NxR, ent_NxR), (h_NxRxD, w, t_NxR, temperature, norm_NxR)


def _scan_chunks_bwd(vocab_major, with_entropy, residuals, cotangents):
    """The gradient through the logits of one chunk at a time, written out rather than
    differentiated: no gather transpose, and nothing for an output without a cotangent (the
    train step's entropy is a metric under stop_gradient)."""
    h_NxRxD, w, t_NxR, temperature, norm_NxR = residuals
    dlogp_NxR, dent_NxR = (None if isinstance(c, SymbolicZero) else c for c in cotangents)
    with_entropy = with_entropy and dent_NxR is not None
    zeros_NxR = jnp.zeros(t_NxR.shape, jnp.float32)
    dlogp_NxR = zeros_NxR if dlogp_NxR is None else dlogp_NxR
    dent_NxR = dent_NxR if with_entropy else zeros_NxR
    w_c = w.astype(h_NxRxD.dtype)

    def chunks(dw_in_DxV: bool):
        """The backward over the chunks, the weight's gradient summed (D, V) if `dw_in_DxV`, else in
        w's own layout."""
        def one(carry, xs):
            dw, dtemp = carry
            h_RxD, t_R, (max_R, logsum_R), dlogp_R, dent_R = xs
            z_RxV = _chunk_logits(h_RxD, w_c, vocab_major, temperature)
            logp_RxV = _chunk_log_softmax(z_RxV, max_R, logsum_R)
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
            # w in its own layout: no transposed copy of the (large) head weight.
            dh_RxD = _contract(g_RxV, w_c, 1, 0 if vocab_major else 1).astype(h_RxD.dtype)
            if dw_in_DxV:  # h, the small operand, transposed in memory (`dot_over_rows`)
                dw = dw + dot_over_rows(h_RxD, g_RxV, preferred_element_type=jnp.float32)
            else:
                dw = dw + (_contract(g_RxV, h_RxD, 0, 0) if vocab_major else _contract(h_RxD, g_RxV, 0, 0))
            return (dw, dtemp), dh_RxD

        D, V = h_NxRxD.shape[-1], w.shape[0] if vocab_major else w.shape[1]
        zero = (jnp.zeros((D, V) if dw_in_DxV else w.shape, jnp.float32), jnp.zeros((), jnp.float32))
        (dw, dtemp), dh_NxRxD = jax.lax.scan(one, zero, (h_NxRxD, t_NxR, norm_NxR, dlogp_NxR, dent_NxR))
        return dh_NxRxD, dw.T if dw_in_DxV and vocab_major else dw, dtemp

    # XLA:CPU runs g^T h, a sum over both operands' leading axis, far slower than h^T g with h
    # transposed first (docs/benchmarks.md); a vocabulary-major weight's gradient is then transposed
    # once, after the chunks. Other backends keep w's layout throughout (no second full-size gradient).
    dh_NxRxD, dw, dtemp = jax.lax.platform_dependent(cpu=lambda: chunks(True), default=lambda: chunks(False))
    dtemp = jnp.reshape(dtemp, jnp.shape(temperature)).astype(jnp.result_type(temperature))
    return dh_NxRxD, dw.astype(w.dtype), None, dtemp


_scan_chunks.defvjp(_scan_chunks_fwd, _scan_chunks_bwd, symbolic_zeros=True)


def chunked_logprobs(h_BxCxD, w, targets_BxC, temperature: float, chunk: int, with_entropy: bool,
                     vocab_major: bool = False):
    """log p(target) and (optionally) the entropy at each of C positions, `chunk` at a time.

    w is the output projection as stored: (V, D) if vocab_major (a tied embedding) else (D, V).
    """
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
    logp_NxR, ent_NxR = _scan_chunks(h_NxRxD, w, t_NxR, temperature, vocab_major, with_entropy)

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
    prompt_group: int = 1,
    replay=None,
    routed: bool = False,
):
    """Log-probabilities (B, C) of each completion token given everything before it.

    Prompts are left-padded, completions right-padded; the masks mark real tokens (tool
    results included: they are context even where the loss ignores them). With `prompt_group`
    n > 1, rows come in blocks of n that share one prompt (a GRPO group), and each block's
    prompt goes through the model once instead of n times.

    An MoE model's: `replay` (prompt_routes_BxPxU, completion_routes_BxCxU) routes each token to the
    recorded experts (`Decoder.hidden`); with `routed`, also returns the router's own routes of the
    completion tokens (B, C, U) and the load-balancing statistics of the whole pass.
    """
    prompt_routes, completion_routes = (None, None) if replay is None else replay
    if prompt_group > 1:
        out = model.prefixed_hidden(prompt_BxP[::prompt_group], prompt_mask_BxP[::prompt_group], completion_BxC,
                                    completion_mask_BxC, None if replay is None else prompt_routes[::prompt_group],
                                    completion_routes, routed=routed)
        h_GxPxD, h_BxCxD = out[:2]
        # The hidden state at t predicts token t + 1: the prompt's last one, the first completion token.
        h_BxCxD = jnp.concatenate([jnp.repeat(h_GxPxD[:, -1:], prompt_group, axis=0), h_BxCxD[:, :-1]], axis=1)
        routing = routed and (out[3].own_BxTxU, moe.sum_stats([out[2].stats, out[3].stats]))
    else:
        P = prompt_BxP.shape[1]
        tokens = jnp.concatenate([prompt_BxP, completion_BxC], axis=1)
        mask = jnp.concatenate([prompt_mask_BxP, completion_mask_BxC], axis=1)
        replay_BxTxU = None if replay is None else jnp.concatenate([prompt_routes, completion_routes], axis=1)
        out = model.hidden(tokens, positions_from_mask(mask), mask, replay_BxTxU=replay_BxTxU, routed=routed)
        h_BxCxD = out[0][:, P - 1:-1]
        routing = routed and (out[2].own_BxTxU[:, P:], out[2].stats)
    # The stored weight, not `head_weight()`: a tied embedding's transpose would be copied.
    tied = model.lm_head is None
    w = model.embed_tokens[...] if tied else model.lm_head[...]
    logp, entropy = chunked_logprobs(h_BxCxD, w, completion_BxC, temperature, chunk, with_entropy, tied)
    return (logp, entropy, *routing) if routed else (logp, entropy)


def packed_logprobs(model: Decoder, tokens_RxL, positions_RxL, segments_RxL, prefix_RxL, window,
                    temperature: float = 1.0, chunk: int = 128, with_entropy: bool = False, replay_RxLxU=None,
                    routed: bool = False):
    """Log-probabilities (R, L - 1) of packed tokens 1..L-1, each given the tokens before it of its
    segment and of its prefix segment (`Decoder.packed_hidden`); the first token of a segment gets a
    number that means nothing. An MoE model's `replay_RxLxU` and `routed` as `completion_logprobs`'
    (the own routes of every packed token, (R, L, U))."""
    out = model.packed_hidden(tokens_RxL, positions_RxL, segments_RxL, prefix_RxL, window, replay_RxLxU, routed)
    h_RxLxD = out[0] if routed else out
    tied = model.lm_head is None
    w = model.embed_tokens[...] if tied else model.lm_head[...]
    logp, entropy = chunked_logprobs(h_RxLxD[:, :-1], w, tokens_RxL[:, 1:], temperature, chunk, with_entropy, tied)
    return (logp, entropy, out[1].own_BxTxU, out[1].stats) if routed else (logp, entropy)
