"""KV-cache sampling over a Decoder: one jitted program per (batch, prompt, new-token) bucket.

Every row carries its own temperature, top-p, top-k, token budget and seed, so requests with
different settings share one compiled program and one batch. The logprob reported for a sampled
token is `log_softmax(logits / temperature)` over the whole vocabulary, the quantity the learner
recomputes; top-p / top-k only restrict what can be sampled. At temperature 0 (greedy) it is
`log_softmax(logits)`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.compilation import bucket
from jaxrl.models import Decoder, KVCache, positions_from_mask

MIN_PROMPT_BUCKET = 16
MIN_NEW_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class RowParams:
    """Per-row sampling settings as arrays of shape (B,)."""

    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray  # 0: no top-k
    max_tokens: np.ndarray
    seed: np.ndarray
    stop_ids: list[tuple[int, ...]]  # token ids that end each row


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # completion ids, up to and including the stop token
    logprobs: list[list[float]]
    finish_reasons: list[str]  # "stop" or "length"


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


def _sample(logits_BxV, key_B, temperature_B, top_p_B, top_k_B):
    greedy_B = temperature_B <= 0
    scaled = logits_BxV / jnp.where(greedy_B, 1.0, temperature_B)[:, None]
    logp_BxV = jax.nn.log_softmax(scaled, axis=-1)
    needs_filter = jnp.any((top_p_B < 1) | (top_k_B > 0))
    candidates = jax.lax.cond(
        needs_filter, lambda s: _filter_logits(s, top_p_B, top_k_B), lambda s: s, scaled
    )
    sampled_B = jax.vmap(jax.random.categorical)(key_B, candidates)
    token_B = jnp.where(greedy_B, jnp.argmax(logits_BxV, -1), sampled_B).astype(jnp.int32)
    return token_B, jnp.take_along_axis(logp_BxV, token_B[:, None], -1)[:, 0]


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new"))
def _generate(params, graphdef, tokens_BxP, mask_BxP, stop_ids_BxS, temperature_B, top_p_B,
              top_k_B, max_tokens_B, seed_B, max_new: int):
    """Prefill then decode up to `max_new` tokens, stopping early once every row is done."""
    model: Decoder = nnx.merge(graphdef, params)
    B, P = tokens_BxP.shape
    cache = KVCache.empty(model.cfg, B, P + max_new)
    logits_BxPxV, cache = model(tokens_BxP, positions_from_mask(mask_BxP), mask_BxP, cache)
    base_keys = jax.vmap(jax.random.key)(seed_B)

    def body(carry):
        t, logits_BxV, cache, position_B, done_B, out_tokens, out_logp = carry
        keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(base_keys, t)
        token_B, logp_B = _sample(logits_BxV, keys_B, temperature_B, top_p_B, top_k_B)
        out_tokens = out_tokens.at[:, t].set(jnp.where(done_B, -1, token_B))
        out_logp = out_logp.at[:, t].set(jnp.where(done_B, 0.0, logp_B))
        stopped_B = jnp.any(token_B[:, None] == stop_ids_BxS, axis=-1)
        done_B = done_B | stopped_B | (t + 1 >= max_tokens_B)
        logits, cache = model(token_B[:, None], position_B[:, None], jnp.ones((B, 1), jnp.int32), cache)
        return t + 1, logits[:, 0], cache, position_B + 1, done_B, out_tokens, out_logp

    def cond(carry):
        t, *_, done_B, _, _ = carry
        return (t < max_new) & ~jnp.all(done_B)

    init = (
        jnp.int32(0), logits_BxPxV[:, -1], cache, mask_BxP.sum(-1).astype(jnp.int32),
        jnp.zeros((B,), bool), jnp.full((B, max_new), -1, jnp.int32), jnp.zeros((B, max_new), jnp.float32),
    )
    *_, out_tokens, out_logp = jax.lax.while_loop(cond, body, init)
    return out_tokens, out_logp


def generate_rows(
    graphdef, params, prompts: list[list[int]], rows: RowParams, max_batch: int | None = None
) -> Generation:
    """Generates one completion per prompt row, padding shapes to buckets."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt needs a token")
    n = len(prompts)
    B = bucket(n, 1) if max_batch is None else min(bucket(n, 1), max(max_batch, n))
    P = bucket(max(len(p) for p in prompts), MIN_PROMPT_BUCKET)
    max_new = bucket(int(rows.max_tokens.max()), MIN_NEW_BUCKET)
    tokens = np.zeros((B, P), np.int32)
    mask = np.zeros((B, P), np.int32)
    mask[n:, -1] = 1  # padding rows: one dummy token so no row is empty
    for b, p in enumerate(prompts):
        tokens[b, P - len(p):] = p
        mask[b, P - len(p):] = 1

    def pad(x, fill):
        return np.concatenate([np.asarray(x), np.full(B - n, fill, np.asarray(x).dtype)])

    stops = np.full((B, bucket(max(len(s) for s in rows.stop_ids), 4)), -2, np.int32)
    for b, ids in enumerate(rows.stop_ids):
        stops[b, :len(ids)] = ids
    out_tokens, out_logp = jax.device_get(_generate(
        params, graphdef, tokens, mask, stops,
        pad(rows.temperature.astype(np.float32), 0.0), pad(rows.top_p.astype(np.float32), 1.0),
        pad(rows.top_k.astype(np.int32), 0), pad(rows.max_tokens.astype(np.int32), 1),
        pad(rows.seed.astype(np.uint32), 0), max_new=max_new,
    ))
    result = Generation([], [], [])
    for b in range(n):
        length = int((out_tokens[b] >= 0).sum())
        toks = out_tokens[b, :length].tolist()
        result.tokens.append(toks)
        result.logprobs.append(out_logp[b, :length].tolist())
        result.finish_reasons.append("stop" if toks and toks[-1] in rows.stop_ids[b] else "length")
    return result


def generate(
    model: Decoder,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...] = (),
    temperature: float = 0.0,
    seed: int = 0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> Generation:
    """Samples one completion per prompt with shared settings (greedy at temperature 0)."""
    n = len(prompts)
    rows = RowParams(
        temperature=np.full(n, temperature, np.float32), top_p=np.full(n, top_p, np.float32),
        top_k=np.full(n, top_k, np.int32), max_tokens=np.full(n, max_new_tokens, np.int32),
        seed=np.arange(n, dtype=np.uint32) + np.uint32(seed),
        stop_ids=[tuple(stop_token_ids)] * n,
    )
    graphdef, params = nnx.split(model)
    return generate_rows(graphdef, params, prompts, rows)
