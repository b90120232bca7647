"""Per-token log-probabilities of completions, chunked over the sequence.

The float32 (B, chunk, V) logits of one chunk exist at a time, forward and backward: each chunk
is rematerialised in the backward pass instead of stored.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl.models.decoder import Decoder, head_logits, positions_from_mask


def chunked_logprobs(h_BxCxD, w_DxV, targets_BxC, temperature: float, chunk: int, with_entropy: bool):
    """log p(target) and (optionally) the entropy at each of C positions, `chunk` at a time."""
    B, C, D = h_BxCxD.shape
    chunk = min(chunk, C)
    pad = -C % chunk
    h = jnp.pad(h_BxCxD, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets_BxC, ((0, 0), (0, pad)))
    n = (C + pad) // chunk
    h_NxBxKxD = h.reshape(B, n, chunk, D).swapaxes(0, 1)
    t_NxBxK = targets.reshape(B, n, chunk).swapaxes(0, 1)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one_chunk(h_BxKxD, t_BxK):
        logp_BxKxV = jax.nn.log_softmax(head_logits(h_BxKxD, w_DxV) / temperature, axis=-1)
        logp_BxK = jnp.take_along_axis(logp_BxKxV, t_BxK[..., None], -1)[..., 0]
        if not with_entropy:
            return logp_BxK, jnp.zeros_like(logp_BxK)
        return logp_BxK, -jnp.sum(jnp.exp(logp_BxKxV) * logp_BxKxV, -1)

    logp_NxBxK, ent_NxBxK = jax.lax.map(lambda a: one_chunk(*a), (h_NxBxKxD, t_NxBxK))
    logp_BxC = logp_NxBxK.swapaxes(0, 1).reshape(B, -1)[:, :C]
    ent_BxC = ent_NxBxK.swapaxes(0, 1).reshape(B, -1)[:, :C]
    return logp_BxC, (ent_BxC if with_entropy else None)


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
