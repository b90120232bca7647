"""Continuous batching over a fixed set of decode slots with a persistent KV cache.

`Slots` holds `max_batch` decode slots. Each `step` is one tick: rows that ended in the last tick
hand their keys and values to the prefix cache and free their slots; live rows move down so they
fill the first slots (a tick decodes only a power-of-two prefix of the slots); waiting rows are
prefilled (`chunk` tokens at a time, from whatever the prefix cache holds of their prompt) and
inserted into free slots; then every live slot advances `decode_steps` tokens. A row that ends
mid-tick frees its slot for the next tick, and a row that arrives mid-tick waits at most one tick.
Shapes are fixed by `Shapes`: one insert and one decode program per power-of-two row count, all of
which a warm-up compiles before the first request.

Every row carries its own temperature, top-p, top-k, token budget and seed, so requests with
different settings share one compiled program and one tick. The logprob reported for a sampled
token is `log_softmax(logits / temperature)` over the whole vocabulary, the quantity the learner
recomputes; top-p / top-k only restrict what can be sampled. At temperature 0 (greedy) it is
`log_softmax(logits)`.

A row samples token t from its own key stream (its seed folded with t, its own decode position),
so what it samples depends neither on the rows beside it nor on when it joined. Its numbers may, in
the last bits: XLA:CPU picks kernels by the whole operand's shape (YNNPACK fusions of dots and row
reductions change summation order with the batch's size; Eigen's dots with the contraction length's
blocking), and a prefix-cached row's keys were computed by decode steps, a fresh one's by a
prefill. Logprobs then move by ~1e-6, and a sampled token only where two candidates tie within that.

Weights may change between ticks (`step` takes them): a live row keeps the keys and values it has
(computed under the weights of their time) and samples its next tokens with the new weights, as
partial rollouts in AReaL and PipelineRL do; recomputing them would cost a prefill of every live row
per swap. Each token records the version of the weights that computed the logits it was sampled
from. The prefix cache forgets everything at a swap, and a row that saw two versions is not kept in
it, so no request ever reuses keys of weights other than those it samples with.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.compilation import bucket
from jaxrl.models import Decoder, KVCache, ModelConfig


@dataclasses.dataclass(eq=False)
class Row:
    """One completion to generate, with its own sampling settings, and what it sampled so far."""

    prompt: list[int]
    max_tokens: int
    seed: int  # up to 64 bits: the row's random stream
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    stop_ids: tuple[int, ...] = ()  # token ids that end the row
    tokens: list[int] = dataclasses.field(default_factory=list)  # up to and including the stop token
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)  # the weights behind each token's logits
    finish_reason: str | None = None  # "stop" or "length" once it ended


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


def _copy_rows(dst, src, from_N, to_N, n):
    """Row to_N[i] of the arrays of `dst` becomes row from_N[i] of those of `src` (None: of `dst`
    itself, as it is by then), for i < n. One row at a time, in place: XLA:CPU's scatter of whole
    rows was several times slower."""
    def body(i, dst):
        return jax.tree.map(lambda d, s: jax.lax.dynamic_update_slice_in_dim(
            d, jax.lax.dynamic_slice_in_dim(s, from_N[i], 1), to_N[i], 0), dst, dst if src is None else src)

    return jax.lax.fori_loop(0, n, body, dst)


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk"), donate_argnames=("pool", "slots", "logits_BxV"))
def _insert(params, graphdef, pool: KVCache, slots: KVCache, logits_BxV, save_slot_K, save_row_K, n_save,
            move_from_K, move_to_K, n_move, src_K, slot_K, cached_K, leader_K, n_new, prefill_block_I, prefill_steps,
            tokens_KxW, prompt_len_K, chunk: int):
    """Between two decode calls, in this order: copies the caches of slots save_slot_K[k] to pool
    rows save_row_K[k] and frees those slots (k < n_save); prefills n_new new rows into slots
    slot_K[k]; moves slot move_from_K[k] to move_to_K[k] (k < n_move). Entries past those counts
    are padding.

    New row k starts from pool row src_K[k], whose first cached_K[k] slots hold its prompt's first
    tokens; prefills the rest `chunk` tokens at a time (a row whose leader_K[k] is another row has
    the same prompt and copies that row's prefill), one block of `prefill_block_rows(K)`
    consecutive rows per step (the blocks of `prefill_order`: rows come in its order). Its slot's
    logits become those of its prompt's last token. A row whose prompt is in its cache already, run
    again by an overlapping block, changes nothing: its chunk is all padding, written past its length.

    Returns the pool, the slots and their logits.
    """
    model: Decoder = nnx.merge(graphdef, params)
    K = tokens_KxW.shape[0]
    R = prefill_block_rows(K)
    pool = _copy_rows(pool, slots, save_slot_K, save_row_K, n_save)
    # A free slot's length 0 keeps the decode's attention window to the slots in use.
    slots = slots._replace(length_B=slots.length_B.at[save_slot_K].set(0, mode="drop"))

    leads_K = leader_K == jnp.arange(K)
    cache = jax.tree.map(lambda x: x[src_K], pool)
    cache = cache._replace(length_B=jnp.where(leads_K, cached_K, prompt_len_K))

    def prefill_body(carry):
        i, cache, logits_KxV = carry
        lo = prefill_block_I[i] * R

        def rows(x):
            return jax.lax.dynamic_slice_in_dim(x, lo, R)

        # Consecutive rows: sliced and written back in place (gathered rows copied the whole cache).
        part = jax.tree.map(rows, cache)
        start_R, prompt_len_R = part.length_B, rows(prompt_len_K)
        tokens_RxC = jax.vmap(lambda row, s: jax.lax.dynamic_slice(row, (s,), (chunk,)))(rows(tokens_KxW), start_R)
        slot_RxC = start_R[:, None] + jnp.arange(chunk)
        h_RxCxD, part = model.hidden(tokens_RxC, slot_RxC, slot_RxC < prompt_len_R[:, None], part)
        last_R = prompt_len_R - 1 - start_R  # the prompt's last token, for rows it is in this chunk
        h_RxD = jnp.take_along_axis(h_RxCxD, jnp.clip(last_R, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
        ends_here_R = (start_R < prompt_len_R) & (last_R < chunk)
        logits_RxV = jnp.where(ends_here_R[:, None], model.logits(h_RxD[:, None])[:, 0], rows(logits_KxV))
        cache = jax.tree.map(lambda whole, x: jax.lax.dynamic_update_slice_in_dim(whole, x, lo, 0), cache, part)
        return i + 1, cache, jax.lax.dynamic_update_slice_in_dim(logits_KxV, logits_RxV, lo, 0)

    logits_KxV = jnp.zeros((K, logits_BxV.shape[1]), jnp.float32)
    _, cache, logits_KxV = jax.lax.while_loop(
        lambda carry: carry[0] < prefill_steps, prefill_body, (jnp.int32(0), cache, logits_KxV))
    slots, logits_BxV = _copy_rows((slots, logits_BxV), (cache, logits_KxV), leader_K, slot_K, n_new)
    # Moves last (their sources and targets are none of the slots above): every loop that writes the
    # slots in place then follows every read of them (unordered, XLA copied every slot to be safe).
    slots, logits_BxV = _copy_rows((slots, logits_BxV), None, move_from_K, move_to_K, n_move)
    slots = slots._replace(length_B=slots.length_B.at[move_from_K].set(0, mode="drop"))
    return pool, slots, logits_BxV


@functools.partial(jax.jit, static_argnames=("graphdef", "rows", "steps"), donate_argnames=("slots", "logits_BxV"))
def _decode(params, graphdef, slots: KVCache, logits_BxV, live_b, position_b, max_tokens_b, stop_ids_bxS,
            temperature_b, top_p_b, top_k_b, seed_lo_b, seed_hi_b, rows: int, steps: int):
    """Advances the first `rows` slots up to `steps` tokens each (b = rows): a live slot samples
    from its logits, then feeds the token back, until it stops or reaches its max_tokens; a row's
    last token is not fed back, so its cache then holds exactly what a continuation reuses. Ends
    early once no slot is live.

    Returns the slots, their logits (of the next token, for rows still live), and the tokens
    sampled (b, steps; -1 where a row sampled nothing) with their logprobs.
    """
    model: Decoder = nnx.merge(graphdef, params)
    cache, logits_bxV = jax.tree.map(lambda x: x[:rows], (slots, logits_BxV))
    # Both halves of a 64-bit seed (a key takes 32 bits): distinct seeds give distinct streams.
    base_keys = jax.vmap(lambda lo, hi: jax.random.fold_in(jax.random.key(lo), hi))(seed_lo_b, seed_hi_b)

    def body(carry):
        i, logits_bxV, cache, live_b, position_b, out_tokens, out_logp = carry
        keys_b = jax.vmap(jax.random.fold_in)(base_keys, position_b)
        token_b, logp_b = _sample(logits_bxV, keys_b, temperature_b, top_p_b, top_k_b)
        out_tokens = out_tokens.at[:, i].set(jnp.where(live_b, token_b, -1))
        out_logp = out_logp.at[:, i].set(jnp.where(live_b, logp_b, 0.0))
        position_b = position_b + live_b
        stopped_b = jnp.any(token_b[:, None] == stop_ids_bxS, axis=-1)
        live_b = live_b & ~stopped_b & (position_b < max_tokens_b)
        logits, cache = model(token_b[:, None], cache.length_B[:, None], live_b[:, None], cache)
        return i + 1, logits[:, 0], cache, live_b, position_b, out_tokens, out_logp

    init = (jnp.int32(0), logits_bxV, cache, live_b, position_b, jnp.full((rows, steps), -1, jnp.int32),
            jnp.zeros((rows, steps), jnp.float32))
    _, logits_bxV, cache, _, _, out_tokens, out_logp = jax.lax.while_loop(
        lambda carry: (carry[0] < steps) & jnp.any(carry[3]), body, init)
    slots, logits_BxV = jax.tree.map(lambda whole, part: jax.lax.dynamic_update_slice_in_dim(whole, part, 0, 0),
                                     (slots, logits_BxV), (cache, logits_bxV))
    return slots, logits_BxV, out_tokens, out_logp


@functools.partial(jax.jit, static_argnames=("cfg", "batch", "width"))
def _empty_cache(cfg, batch: int, width: int) -> KVCache:
    return KVCache.empty(cfg, batch, width)


def _committed(x):
    """On the first device, committed like the arrays the programs return (a jit without array inputs
    returns uncommitted arrays, which would compile every program twice)."""
    return jax.device_put(x, jax.devices()[0])


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The engine's fixed shapes: sequences of up to `max_seq_len` tokens (prompt + completion),
    prompts prefilled `chunk` tokens at a time, `max_batch` decode slots advanced `decode_steps`
    tokens per device call (batches bucketed to powers of two), up to `max_stop_ids` stop ids a row."""

    max_seq_len: int
    chunk: int
    max_batch: int
    decode_steps: int = 16
    max_stop_ids: int = 8

    @property
    def width(self) -> int:
        """Cache slots per row: a chunk written at the last prompt token still fits."""
        return self.max_seq_len + self.chunk

    def batch(self, rows: int) -> int:
        return min(bucket(rows, 1), self.max_batch)

    def batches(self) -> list[int]:
        """Every batch size a run can use: what a warm-up compiles."""
        return sorted({self.batch(n) for n in range(1, self.max_batch + 1)})


class PrefixCache:
    """KV rows of recent sequences kept on the device, so that an episode's next turn (whose prompt
    extends its last prompt and completion) prefills only the new tokens.

    Rows inserted together with the same prompt prefill it once. A row being generated has claimed
    the pool row its sequence goes to when it ends (the one it extends, when free); otherwise the
    least recently used row is overwritten first. Everything is forgotten when the weights change.
    With `rows=0` nothing is kept.
    """

    def __init__(self, cfg: ModelConfig, shapes: Shapes, rows: int):
        self.cfg, self.shapes = cfg, shapes
        self.tokens: list[tuple[int, ...]] = [()] * rows
        self.scratch = rows  # the pool's last row: where nothing is kept
        self.used = [0] * rows
        self.claimed: set[int] = set()
        self.clock = 0
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0}
        self.clear()

    def forget(self) -> None:
        """Forgets every row (new weights)."""
        self.tokens = [()] * len(self.tokens)
        self.claimed.clear()

    def clear(self) -> None:
        """Forgets every row and allocates the pool anew (a failed call may have consumed it)."""
        self.pool = _committed(_empty_cache(self.cfg, len(self.tokens) + 1, self.shapes.width))
        self.forget()

    def plan(self, prompts: list[list[int]], batch: int) -> tuple[np.ndarray, ...]:
        """(src, dst, cached, leader) per row of `batch` rows inserted together (padding rows:
        scratch); dst is the pool row claimed for the row's sequence when it ends."""
        scratch = self.scratch
        src, dst = np.full(batch, scratch, np.int32), np.full(batch, scratch, np.int32)
        cached, leader = np.zeros(batch, np.int32), np.arange(batch, dtype=np.int32)
        first: dict[tuple[int, ...], int] = {}
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
                    if best not in self.claimed:  # the episode's next turn extends its row in place
                        dst[b] = best
            if dst[b] == scratch:
                free = [s for s in range(scratch) if s not in self.claimed]
                if free:
                    dst[b] = min(free, key=lambda s: (len(self.tokens[s]) > 0, self.used[s]))
            if dst[b] != scratch:
                self.claimed.add(int(dst[b]))
                self.used[dst[b]] = self.clock
        return src, dst, cached, leader

    def keep(self, row: int, sequence: list[int] | None) -> None:
        """Pool row `row` now holds `sequence` (None: nothing worth keeping); its claim ends."""
        if row != self.scratch:
            self.claimed.discard(row)
            self.tokens[row] = () if sequence is None else tuple(sequence)


class Slots:
    """The decode slots: their device state (keys and values, next-token logits) and, on the host,
    the row in each slot and the rows waiting for one. Not thread-safe: one caller at a time."""

    def __init__(self, cfg: ModelConfig, shapes: Shapes, prefix: PrefixCache):
        self.cfg, self.shapes, self.prefix = cfg, shapes, prefix
        self.waiting: collections.deque[Row] = collections.deque()
        self.stats = {"decode_calls": 0, "insert_calls": 0, "rows": 0, "tokens": 0}
        self.reset()

    def reset(self) -> None:
        """Empties every slot and the prefix cache, with device state anew (after a failed call)."""
        B = self.shapes.max_batch
        self.cache = _committed(_empty_cache(self.cfg, B, self.shapes.width))
        self.logits_BxV = _committed(jnp.zeros((B, self.cfg.vocab_size), jnp.float32))
        self.rows: list[Row | None] = [None] * B
        self.keep_row = np.full(B, self.prefix.scratch, np.int32)  # where each slot's sequence goes when it ends
        self.logits_version = np.zeros(B, np.int64)  # the weights that computed each slot's logits
        self.ended: list[tuple[int, int, list[int] | None]] = []  # (slot, pool row, sequence) to save and free
        self.version: int | None = None
        self.prefix.clear()

    def add(self, rows: list[Row]) -> None:
        """Queues rows for a slot; each must fit max_seq_len and max_stop_ids."""
        for row in rows:
            if not row.prompt or row.max_tokens < 1 or len(row.prompt) + row.max_tokens > self.shapes.max_seq_len:
                raise ValueError(f"a row needs a prompt and 1 <= max_tokens, within max_seq_len "
                                 f"{self.shapes.max_seq_len} tokens in all; got {len(row.prompt)} + {row.max_tokens}")
            if len(row.stop_ids) > self.shapes.max_stop_ids:
                raise ValueError(f"{len(row.stop_ids)} stop token ids, more than the engine's "
                                 f"{self.shapes.max_stop_ids}")
        self.waiting.extend(rows)

    def drop(self, rows: list[Row]) -> None:
        """Forgets rows no one waits for any more, waiting or in a slot."""
        gone = set(rows)
        self.waiting = collections.deque(r for r in self.waiting if r not in gone)
        for s, row in enumerate(self.rows):
            if row in gone:
                self.rows[s] = None
                self.prefix.keep(int(self.keep_row[s]), None)
                self.ended.append((s, self.prefix.scratch, None))

    def busy(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.rows)

    def step(self, graphdef, params, version: int) -> list[Row]:
        """One tick (see the module's docstring) with these weights; returns the rows that ended."""
        if version != self.version:  # cached keys and values of other weights
            self.prefix.forget()
            self.keep_row[:] = self.prefix.scratch
            self.ended = [(s, self.prefix.scratch, None) for s, _, _ in self.ended]
            self.version = version
        ended, self.ended = self.ended, []
        for _, row, sequence in ended:
            self.prefix.keep(row, sequence)
        live = [s for s, r in enumerate(self.rows) if r is not None]
        new = [self.waiting.popleft() for _ in range(min(len(self.waiting), self.shapes.max_batch - len(live)))]
        b = self.shapes.batch(len(live) + len(new)) if live or new else 0
        free = [s for s in range(b) if self.rows[s] is None]
        moves = list(zip([s for s in live if s >= b], free))  # live rows into the first b slots
        for src, dst in moves:
            self.rows[dst], self.rows[src] = self.rows[src], None
            for state in (self.keep_row, self.logits_version):
                state[dst] = state[src]
        if ended or moves or new:
            self._insert(graphdef, params, version, ended, moves, new, free[len(moves):])
        return self._decode(graphdef, params, version, b) if b else []

    def _insert(self, graphdef, params, version: int, ended, moves, new: list[Row], free: list[int],
                batch: int | None = None) -> None:
        B, S, W = self.shapes.max_batch, self.prefix.scratch, self.shapes.width
        K = batch or self.shapes.batch(max(len(ended), len(moves), len(new)))

        def pad(values, fill):
            return np.asarray(list(values) + [fill] * (K - len(values)), np.int32)

        tokens = np.zeros((K, W), np.int32)
        prompt_len = np.ones(K, np.int32)  # padding rows: one token, nothing to prefill
        for k, row in enumerate(new):
            tokens[k, :len(row.prompt)] = row.prompt
            prompt_len[k] = len(row.prompt)
        src, dst, cached, leader = self.prefix.plan([row.prompt for row in new], K)
        order, block_I, steps = prefill_order(prompt_len, cached, leader, len(new), self.shapes.chunk, W)
        position = np.argsort(order).astype(np.int32)  # of each row in `order`
        slot = pad(free[:len(new)], B)
        self.prefix.pool, self.cache, self.logits_BxV = _insert(
            params, graphdef, self.prefix.pool, self.cache, self.logits_BxV,
            pad([s for s, _, _ in ended], B), pad([r for _, r, _ in ended], S), np.int32(len(ended)),
            pad([s for s, _ in moves], B), pad([d for _, d in moves], B), np.int32(len(moves)),
            src[order], slot[order], cached[order], position[leader[order]], np.int32(len(new)), block_I, steps,
            tokens[order], prompt_len[order], chunk=self.shapes.chunk)
        for k, row in enumerate(new):
            self.rows[slot[k]] = row
            self.keep_row[slot[k]] = dst[k]
            self.logits_version[slot[k]] = version
        self.stats["insert_calls"] += 1
        self.stats["rows"] += len(new)

    def _decode(self, graphdef, params, version: int, b: int) -> list[Row]:
        rows = self.rows[:b]
        live = np.array([r is not None for r in rows])

        def per_row(get, dtype, fill):
            return np.array([fill if r is None else get(r) for r in rows], dtype)

        seed = per_row(lambda r: r.seed, np.uint64, 0)
        stop_ids = np.full((b, self.shapes.max_stop_ids), -2, np.int32)
        for s, row in enumerate(rows):
            if row is not None:
                stop_ids[s, :len(row.stop_ids)] = row.stop_ids
        self.cache, self.logits_BxV, tokens_bxN, logp_bxN = _decode(
            params, graphdef, self.cache, self.logits_BxV, live, per_row(lambda r: len(r.tokens), np.int32, 0),
            per_row(lambda r: r.max_tokens, np.int32, 0), stop_ids,
            per_row(lambda r: r.temperature, np.float32, 0.0), per_row(lambda r: r.top_p, np.float32, 1.0),
            per_row(lambda r: r.top_k, np.int32, 0), (seed & 0xFFFFFFFF).astype(np.uint32),
            (seed >> 32).astype(np.uint32), rows=b, steps=self.shapes.decode_steps)
        tokens_bxN, logp_bxN = jax.device_get((tokens_bxN, logp_bxN))
        self.stats["decode_calls"] += 1
        ended = []
        for s, row in enumerate(rows):
            if row is None:
                continue
            n = int((tokens_bxN[s] >= 0).sum())
            row.tokens += tokens_bxN[s, :n].tolist()
            row.logprobs += logp_bxN[s, :n].tolist()
            row.versions += [int(self.logits_version[s])] + [version] * (n - 1)
            self.logits_version[s] = version
            self.stats["tokens"] += n
            if row.tokens[-1] in row.stop_ids or len(row.tokens) >= row.max_tokens:
                row.finish_reason = "stop" if row.tokens[-1] in row.stop_ids else "length"
                self.rows[s] = None
                self.ended.append((s, int(self.keep_row[s]), row.prompt + row.tokens[:-1]))
                ended.append(row)
        return ended

    def warm_up(self, graphdef, params) -> None:
        """Compiles (or loads from the persistent cache) every insert and decode program."""
        for n in self.shapes.batches():
            self._insert(graphdef, params, 0, [], [], [], [], batch=n)
            self._decode(graphdef, params, 0, n)
        self.reset()
        self.stats = dict.fromkeys(self.stats, 0)
