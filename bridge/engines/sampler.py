"""KV-cache sampling over a Decoder: one jitted program per batch size.

Prompts are prefilled a fixed chunk at a time into a cache of a fixed width, and the decode loop
runs until every row is done, so prompt and completion lengths never change a shape: a run
compiles one program per batch-size bucket (`Shapes.batches()`), all of which a warm-up can
compile before the first request.

Every row carries its own temperature, top-p, top-k, token budget and seed, so requests with
different settings share one compiled program and one batch. The logprob reported for a sampled
token is `log_softmax(logits / temperature)` over the whole vocabulary, the quantity the learner
recomputes; top-p / top-k only restrict what can be sampled. At temperature 0 (greedy) it is
`log_softmax(logits)`.

A row samples from its own key stream (its seed folded with the decode step), so what it samples
does not depend on the rows beside it. Its numbers may, in the last bits: XLA:CPU picks kernels by
the whole operand's shape (YNNPACK fusions of dots and row reductions change summation order with
the batch's size; Eigen's dots with the contraction length's blocking), and a prefix-cached row's
keys were computed by decode steps, a fresh one's by a prefill. Logprobs then move by ~1e-6, and a
sampled token only where two candidates tie within that.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.compilation import bucket
from jaxrl.models import Decoder, KVCache, ModelConfig

@dataclasses.dataclass(frozen=True)
class RowParams:
    """Per-row sampling settings as arrays of shape (B,)."""

    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray  # 0: no top-k
    max_tokens: np.ndarray
    seed: np.ndarray  # up to 64 bits: the row's random key
    stop_ids: list[tuple[int, ...]]  # token ids that end each row

    def slice(self, lo: int, hi: int) -> RowParams:
        return RowParams(self.temperature[lo:hi], self.top_p[lo:hi], self.top_k[lo:hi], self.max_tokens[lo:hi],
                         self.seed[lo:hi], self.stop_ids[lo:hi])


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
    # Inverse CDF: one uniform per row where the Gumbel trick draws one per vocabulary entry
    # (threefry over B x V was a fifth of a decode step on CPU). The first token whose cumulative
    # mass reaches (1 - u) of the total: never a token of probability 0, u in [0, 1).
    probs_BxV = jnp.exp(candidates - jnp.max(candidates, -1, keepdims=True))
    cdf_BxV = jnp.cumsum(probs_BxV, -1)
    u_B = jax.vmap(jax.random.uniform)(key_B)
    sampled_B = jnp.sum(cdf_BxV < ((1 - u_B) * cdf_BxV[:, -1])[:, None], -1)
    # The argmax is a slow variadic reduce on XLA:CPU: only when a row is greedy.
    token_B = jax.lax.cond(jnp.any(greedy_B), lambda: jnp.where(greedy_B, jnp.argmax(logits_BxV, -1), sampled_B),
                           lambda: sampled_B).astype(jnp.int32)
    return token_B, jnp.take_along_axis(logp_BxV, token_B[:, None], -1)[:, 0]


def prefill_block_rows(batch: int) -> int:
    """Rows prefilled together: an eighth of the batch, so that a batch of groups that share
    their prompts (one row to prefill in each group of 8) prefills about 1/8 of its rows."""
    return max(1, batch // 8)


def prefill_order(prompt_len: np.ndarray, cached: np.ndarray, leader: np.ndarray, real_rows: int,
                  chunk: int, width: int) -> tuple[np.ndarray, np.ndarray, np.int32]:
    """The batch's rows reordered for the prefill: (order, the rows with a prompt rest to prefill
    first; block_I, for each prefill step the block of `prefill_block_rows` rows (of the new
    order) it runs, as many steps as the block's longest rest needs; the number of steps). Rows
    that copy a leader's prefill and padding rows (from `real_rows` on) prefill nothing."""
    B = len(prompt_len)
    R = prefill_block_rows(B)
    todo = [b for b in range(real_rows) if leader[b] == b and cached[b] < prompt_len[b]]
    planned = set(todo)
    order = np.asarray(todo + [b for b in range(B) if b not in planned], np.int32)
    steps = []
    for j in range(-(-len(todo) // R)):
        block = order[j * R:(j + 1) * R]
        steps += [j] * int(-(-max(prompt_len[block] - np.minimum(cached[block], prompt_len[block])) // chunk))
    block_I = np.zeros(-(-B // R) * -(-width // chunk), np.int32)  # a last, partial block is slid back in place
    block_I[:len(steps)] = steps
    return order, block_I, np.int32(len(steps))


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk"), donate_argnames=("pool",))
def _generate(params, graphdef, pool: KVCache, src_B, dst_B, cached_B, leader_B, prefill_block_I, prefill_steps,
              tokens_BxW, prompt_len_B, stop_ids_BxS, temperature_B, top_p_B, top_k_B, max_tokens_B,
              seed_lo_B, seed_hi_B, chunk: int):
    """Row b starts from pool row src_B[b], whose first cached_B[b] slots hold its prompt's first
    tokens; prefills the rest `chunk` tokens at a time (a row whose leader_B[b] is another row
    has the same prompt and copies that row's prefill), one block of `prefill_block_rows`
    consecutive rows per step (the blocks of `prefill_order`: rows come in its order); decodes
    until every row stops or reaches its max_tokens; writes its cache (prompt and completion but
    the last token, never fed back) to pool row dst_B[b]. One program per batch size: the cache
    width W and `chunk` are the engine's, so prompt and completion lengths never change a shape.
    A row whose prompt is in its cache already, run again by an overlapping block, changes
    nothing: its chunk is all padding, written past its length.

    Returns the completions (B, W; -1 past a row's end), their logprobs, and the pool.
    """
    model: Decoder = nnx.merge(graphdef, params)
    B, W = tokens_BxW.shape
    R = prefill_block_rows(B)
    leads_B = leader_B == jnp.arange(B)
    cache = KVCache(tuple(k[src_B] for k in pool.k_BxKxHxS), tuple(v[src_B] for v in pool.v_BxKxSxH),
                    jnp.where(leads_B, cached_B, prompt_len_B))

    def prefill_body(carry):
        i, cache, logits_BxV = carry
        lo = prefill_block_I[i] * R

        def rows(x):
            return jax.lax.dynamic_slice_in_dim(x, lo, R)

        # Consecutive rows: sliced and written back in place (gathered rows copied the whole cache).
        part = jax.tree.map(rows, cache)
        start_R, prompt_len_R = part.length_B, rows(prompt_len_B)
        tokens_RxC = jax.vmap(lambda row, s: jax.lax.dynamic_slice(row, (s,), (chunk,)))(rows(tokens_BxW), start_R)
        slot_RxC = start_R[:, None] + jnp.arange(chunk)
        h_RxCxD, part = model.hidden(tokens_RxC, slot_RxC, slot_RxC < prompt_len_R[:, None], part)
        last_R = prompt_len_R - 1 - start_R  # the prompt's last token, for rows it is in this chunk
        h_RxD = jnp.take_along_axis(h_RxCxD, jnp.clip(last_R, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
        ends_here_R = (start_R < prompt_len_R) & (last_R < chunk)
        logits_RxV = jnp.where(ends_here_R[:, None], model.logits(h_RxD[:, None])[:, 0], rows(logits_BxV))
        cache = jax.tree.map(lambda whole, x: jax.lax.dynamic_update_slice_in_dim(whole, x, lo, 0), cache, part)
        return i + 1, cache, jax.lax.dynamic_update_slice_in_dim(logits_BxV, logits_RxV, lo, 0)

    logits_BxV = jnp.zeros((B, model.cfg.vocab_size), jnp.float32)
    _, cache, logits_BxV = jax.lax.while_loop(
        lambda carry: carry[0] < prefill_steps, prefill_body, (jnp.int32(0), cache, logits_BxV))
    cache, logits_BxV = jax.tree.map(lambda x: x[leader_B], (cache, logits_BxV))
    # Both halves of a 64-bit seed (a key takes 32 bits): distinct seeds give distinct streams.
    base_keys = jax.vmap(lambda lo, hi: jax.random.fold_in(jax.random.key(lo), hi))(seed_lo_B, seed_hi_B)

    def body(carry):
        t, logits_BxV, cache, done_B, out_tokens, out_logp = carry
        keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(base_keys, t)
        token_B, logp_B = _sample(logits_BxV, keys_B, temperature_B, top_p_B, top_k_B)
        out_tokens = out_tokens.at[:, t].set(jnp.where(done_B, -1, token_B))
        out_logp = out_logp.at[:, t].set(jnp.where(done_B, 0.0, logp_B))
        stopped_B = jnp.any(token_B[:, None] == stop_ids_BxS, axis=-1)
        done_B = done_B | stopped_B | (t + 1 >= max_tokens_B)
        # A row's last token is not fed back: the cache then holds exactly what a continuation reuses.
        logits, cache = model(token_B[:, None], cache.length_B[:, None], ~done_B[:, None], cache)
        return t + 1, logits[:, 0], cache, done_B, out_tokens, out_logp

    def cond(carry):
        t, _, _, done_B, _, _ = carry
        return (t < W) & ~jnp.all(done_B)

    init = (jnp.int32(0), logits_BxV, cache, max_tokens_B <= 0, jnp.full((B, W), -1, jnp.int32),
            jnp.zeros((B, W), jnp.float32))
    _, _, cache, _, out_tokens, out_logp = jax.lax.while_loop(cond, body, init)
    pool = jax.tree.map(lambda p, c: p.at[dst_B].set(c), pool, cache)
    return out_tokens, out_logp, pool


@functools.partial(jax.jit, static_argnames=("cfg", "batch", "width"))
def _empty_cache(cfg, batch: int, width: int) -> KVCache:
    return KVCache.empty(cfg, batch, width)


class PrefixCache:
    """KV rows of recent sequences kept on the device, so that an episode's next turn (whose prompt
    extends its last prompt and completion) prefills only the new tokens.

    Rows of one call with the same prompt prefill it once. The least recently used row is
    overwritten first; all rows are forgotten when the weights change. With `rows=0` nothing is
    kept across calls.
    """

    def __init__(self, cfg: ModelConfig, shapes: Shapes, rows: int):
        self.cfg, self.shapes = cfg, shapes
        self.tokens: list[tuple[int, ...]] = [()] * rows
        self.used = [0] * rows
        self.clock = 0
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0}
        self.clear()

    def clear(self) -> None:
        """Forgets every row (new weights, or a failed call that may have consumed the pool)."""
        # The last row: scratch. Committed to the device like the pool `_generate` returns (a jit
        # without array inputs returns uncommitted arrays, which would compile every program twice).
        self.pool = jax.device_put(_empty_cache(self.cfg, len(self.tokens) + 1, self.shapes.width), jax.devices()[0])
        self.tokens = [()] * len(self.tokens)

    def plan(self, prompts: list[list[int]], batch: int) -> tuple[np.ndarray, ...]:
        """(src, dst, cached, leader) per row of a batch of `batch` rows (padding rows: scratch)."""
        scratch = len(self.tokens)
        src, dst = np.full(batch, scratch, np.int32), np.full(batch, scratch, np.int32)
        cached, leader = np.zeros(batch, np.int32), np.arange(batch, dtype=np.int32)
        first: dict[tuple[int, ...], int] = {}
        claimed: set[int] = set()
        self.clock += 1
        for b, prompt in enumerate(map(tuple, prompts)):
            self.stats["prompt_tokens"] += len(prompt)
            if prompt in first:
                leader[b] = first[prompt]
                self.stats["cached_tokens"] += len(prompt)
            else:
                first[prompt] = b
                # The last token first: a cheap test that rules out nearly every other episode's row.
                best = max((s for s, t in enumerate(self.tokens)
                            if t and len(t) < len(prompt) and prompt[len(t) - 1] == t[-1] and prompt[:len(t)] == t),
                           key=lambda s: len(self.tokens[s]), default=None)
                if best is not None:
                    src[b], cached[b] = best, len(self.tokens[best])
                    self.stats["cached_tokens"] += int(cached[b])
                    if best not in claimed:  # the episode's next turn extends its row in place
                        dst[b] = best
            if dst[b] == scratch:
                free = [s for s in range(scratch) if s not in claimed]
                if free:
                    dst[b] = min(free, key=lambda s: (len(self.tokens[s]) > 0, self.used[s]))
            if dst[b] != scratch:
                claimed.add(int(dst[b]))
                self.used[dst[b]] = self.clock
        return src, dst, cached, leader

    def keep(self, dst: np.ndarray, sequences: list[list[int]]) -> None:
        for row, seq in zip(dst, sequences):
            if row < len(self.tokens):
                self.tokens[row] = tuple(seq)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The engine's fixed shapes: sequences of up to `max_seq_len` tokens (prompt + completion),
    prompts prefilled `chunk` tokens at a time, batches bucketed to powers of two up to `max_batch`."""

    max_seq_len: int
    chunk: int
    max_batch: int

    @property
    def width(self) -> int:
        """Cache slots per row: a chunk written at the last prompt token still fits."""
        return self.max_seq_len + self.chunk

    def batch(self, rows: int) -> int:
        return min(bucket(rows, 1), max(self.max_batch, rows))

    def batches(self) -> list[int]:
        """Every batch size a run can use: what a warm-up compiles."""
        return sorted({self.batch(n) for n in range(1, self.max_batch + 1)})


def generate_rows(graphdef, params, prompts: list[list[int]], rows: RowParams, shapes: Shapes,
                  prefix: PrefixCache) -> Generation:
    """Generates one completion per prompt row; max_tokens must leave each row within max_seq_len."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt needs a token")
    n = len(prompts)
    longest = max(len(p) + int(m) for p, m in zip(prompts, rows.max_tokens))
    if longest > shapes.max_seq_len:
        raise ValueError(f"a prompt and its max_tokens take {longest} tokens, more than max_seq_len "
                         f"{shapes.max_seq_len}")
    B, W = shapes.batch(n), shapes.width
    tokens = np.zeros((B, W), np.int32)
    prompt_len = np.ones(B, np.int32)  # padding rows: one token, no completion
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
        prompt_len[b] = len(p)

    def pad(x, fill):
        return np.concatenate([np.asarray(x), np.full(B - n, fill, np.asarray(x).dtype)])

    stops = np.full((B, bucket(max(len(s) for s in rows.stop_ids), 4)), -2, np.int32)
    for b, ids in enumerate(rows.stop_ids):
        stops[b, :len(ids)] = ids
    seed = pad(rows.seed.astype(np.uint64), 0)
    src, dst, cached, leader = prefix.plan(prompts, B)
    order, block_I, steps = prefill_order(prompt_len, cached, leader, n, shapes.chunk, W)
    position = np.argsort(order).astype(np.int32)  # of each row in `order`
    out_tokens, out_logp, prefix.pool = _generate(
        params, graphdef, prefix.pool, src[order], dst[order], cached[order], position[leader[order]], block_I,
        steps, tokens[order], prompt_len[order], stops[order],
        *(x[order] for x in (pad(rows.temperature.astype(np.float32), 0.0), pad(rows.top_p.astype(np.float32), 1.0),
                             pad(rows.top_k.astype(np.int32), 0), pad(rows.max_tokens.astype(np.int32), 0),
                             (seed & 0xFFFFFFFF).astype(np.uint32), (seed >> 32).astype(np.uint32))),
        chunk=shapes.chunk,
    )
    out_tokens, out_logp = (x[position] for x in jax.device_get((out_tokens, out_logp)))
    result = Generation([], [], [])
    for b in range(n):
        length = int((out_tokens[b] >= 0).sum())
        toks = out_tokens[b, :length].tolist()
        result.tokens.append(toks)
        result.logprobs.append(out_logp[b, :length].tolist())
        result.finish_reasons.append("stop" if toks and toks[-1] in rows.stop_ids[b] else "length")
    prefix.keep(dst, [p + t[:-1] for p, t in zip(prompts, result.tokens)])
    return result
