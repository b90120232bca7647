"""KV-cache sampling over a Decoder: left-padded prefill, then jitted one-token decode steps."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models import Decoder, KVCache, positions_from_mask


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # completion ids, up to and including the stop token
    logprobs: list[list[float]]  # logprob of each sampled token under the sampling distribution
    finish_reasons: list[str]  # "stop" or "length"


@nnx.jit
def _prefill(model: Decoder, tokens_BxT, mask_BxT, cache: KVCache):
    logits_BxTxV, cache = model(tokens_BxT, positions_from_mask(mask_BxT), mask_BxT, cache)
    return logits_BxTxV[:, -1], cache


@nnx.jit
def _decode(model: Decoder, token_B, position_B, cache: KVCache):
    ones = jnp.ones_like(token_B)[:, None]
    logits_Bx1xV, cache = model(token_B[:, None], position_B[:, None], ones, cache)
    return logits_Bx1xV[:, 0], cache


@jax.jit
def _sample(logits_BxV, key, temperature):
    logp_BxV = jax.nn.log_softmax(logits_BxV / jnp.maximum(temperature, 1e-6), axis=-1)
    sampled = jax.random.categorical(key, logp_BxV)
    token_B = jnp.where(temperature > 0, sampled, jnp.argmax(logits_BxV, -1))
    return token_B, jnp.take_along_axis(logp_BxV, token_B[:, None], -1)[:, 0]


def generate(
    model: Decoder,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...] = (),
    temperature: float = 0.0,
    seed: int = 0,
) -> Generation:
    """Samples completions (greedy at temperature 0) for a batch of token-id prompts."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt needs a token")
    batch, prompt_len = len(prompts), max(len(p) for p in prompts)
    tokens = np.zeros((batch, prompt_len), np.int32)
    mask = np.zeros((batch, prompt_len), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, prompt_len - len(p):] = p
        mask[b, prompt_len - len(p):] = 1
    cache = KVCache.empty(model.cfg, batch, prompt_len + max_new_tokens)
    logits, cache = _prefill(model, jnp.asarray(tokens), jnp.asarray(mask), cache)
    position = jnp.asarray(mask.sum(1), jnp.int32)
    key = jax.random.key(seed)
    out_tokens, out_logp = [], []
    done = np.zeros(batch, bool)
    stops = np.asarray(stop_token_ids, np.int32)
    for _ in range(max_new_tokens):
        key, sub = jax.random.split(key)
        token, logp = _sample(logits, sub, jnp.float32(temperature))
        out_tokens.append(np.asarray(token))
        out_logp.append(np.asarray(logp))
        done |= np.isin(out_tokens[-1], stops)
        if done.all():
            break
        logits, cache = _decode(model, token, position, cache)
        position = position + 1
    return _trim(np.stack(out_tokens, 1), np.stack(out_logp, 1), stops)


def _trim(tokens_BxN, logp_BxN, stops) -> Generation:
    result = Generation([], [], [])
    for toks, logps in zip(tokens_BxN, logp_BxN):
        hits = np.flatnonzero(np.isin(toks, stops))
        end = hits[0] + 1 if hits.size else len(toks)
        result.tokens.append(toks[:end].tolist())
        result.logprobs.append(logps[:end].tolist())
        result.finish_reasons.append("stop" if hits.size else "length")
    return result
