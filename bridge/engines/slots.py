"""The JAX engine's device side: continuous batching over a fixed set of decode slots with a persistent
KV cache, shaped as JetStream's engine API (`jetstream/engine/engine_api.py`).

One `DecodeState` pytree holds everything a decode step reads of a slot: its keys and values, its
next-token logits, and its row's sampling settings, token budget, position and seed, written once
when the row is inserted. `insert` runs a tick's `Plan` (`bridge.engines.scheduler`): it saves the
caches of rows that ended to the prefix pool, prefills new rows (in chunks, then what is left in
tails, from whatever the pool holds of their prompt) into their slots, and moves live rows down to
the first slots; `generate` advances the first `rows` slots up to `decode_steps` tokens, reading the
prompt that a group of rows shares (a GRPO group's, `Scheduler.groups`) once for the group. `Slots`
is the thin shell that runs a tick: `schedule()`, the device calls, `update_from_output()`. Shapes
are fixed by `Shapes`: per power-of-two row count, one insert and one shared-prompt decode program
per cache window and one decode program per (finer) decode window, all compiled by a warm-up.

Every row carries its own temperature, top-p, top-k, token budget and seed, so requests with
different settings share one compiled program and one tick (`bridge.engines.sampling`).

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
from. The prefix pool forgets everything at a swap, and a row that saw two versions is not kept in
it, so no request ever reuses keys of weights other than those it samples with.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bridge.engines.sampling import sample
from bridge.engines.scheduler import (NO_STOP, Groups, Plan, Row, Scheduler, bucket, group_capacity,
                                      prefill_block_rows, prefill_order)
from jaxrl.models import Decoder, KVCache, ModelConfig
from jaxrl.models.decoder import SharedPrefix, attention_windows, key_windows


class RowSettings(NamedTuple):
    """Each slot's row: how it samples and when it ends (written at insert)."""

    max_tokens: jax.Array  # int32
    stop_ids: jax.Array  # int32 (., max_stop_ids), NO_STOP padding
    temperature: jax.Array  # float32
    top_p: jax.Array  # float32
    top_k: jax.Array  # int32
    seed: jax.Array  # uint32 (., 2): the low and high halves of a 64-bit seed

    @classmethod
    def of(cls, rows: list[Row], n: int, max_stop_ids: int) -> RowSettings:
        """The settings of `rows`, padded to n (padding rows: budget 0, greedy)."""
        out = cls(np.zeros(n, np.int32), np.full((n, max_stop_ids), NO_STOP, np.int32), np.zeros(n, np.float32),
                  np.ones(n, np.float32), np.zeros(n, np.int32), np.zeros((n, 2), np.uint32))
        for k, row in enumerate(rows):
            out.max_tokens[k], out.temperature[k], out.top_p[k], out.top_k[k] = (
                row.max_tokens, row.temperature, row.top_p, row.top_k)
            out.stop_ids[k, :len(row.stop_ids)] = row.stop_ids
            out.seed[k] = row.seed & 0xFFFFFFFF, row.seed >> 32
        return out


class DecodeState(NamedTuple):
    """The decode slots on the device: what `generate` reads and writes, and nothing else."""

    cache: KVCache
    logits: jax.Array  # (B, V) float32: each slot's next-token logits
    live: jax.Array  # (B,) bool: the slot's row samples on
    position: jax.Array  # (B,) int32: tokens its row sampled so far (its key stream's position)
    settings: RowSettings

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, width: int, max_stop_ids: int) -> DecodeState:
        return cls(KVCache.empty(cfg, batch, width), jnp.zeros((batch, cfg.vocab_size), jnp.float32),
                   jnp.zeros(batch, bool), jnp.zeros(batch, jnp.int32),
                   jax.tree.map(jnp.asarray, RowSettings.of([], batch, max_stop_ids)))


class InsertArrays(NamedTuple):
    """A plan's insert, padded to K rows (see `insert`)."""

    save_slot: jax.Array
    save_row: jax.Array
    n_save: jax.Array
    move_from: jax.Array
    move_to: jax.Array
    n_move: jax.Array
    src: jax.Array  # in prefill order, as the rest
    slot: jax.Array
    cached: jax.Array
    leader: jax.Array  # positions in prefill order
    n_new: jax.Array
    chunk_block: jax.Array  # the prefill's steps of `chunk` tokens (`prefill_order`)
    chunk_steps: jax.Array
    tail_block: jax.Array  # then its steps of `tail` tokens
    tail_steps: jax.Array
    tokens: jax.Array  # (K, W)
    prompt_len: jax.Array
    settings: RowSettings


def _copy_rows(dst, src, from_N, to_N, n, width: int):
    """Row to_N[i] of the arrays of `dst` becomes row from_N[i] of those of `src` (None: of `dst`
    itself, as it is by then), for i < n, a cache's keys and values only in their first `width` slots
    (a sliding layer's whole ring where it has no more; a wider one holds rows of fewer than `width`
    tokens in their first slots too). One row at a time, in place: XLA:CPU's scatter of whole rows was
    several times slower."""
    slot_axis = {"k_BxKxHxS": 3, "v_BxKxSxH": 2, "routes_BxSxU": 1}

    def row(path, x, i):
        size = [1, *x.shape[1:]]
        for key in path:
            if getattr(key, "name", None) in slot_axis:
                size[slot_axis[key.name]] = min(width, x.shape[slot_axis[key.name]])
        return jax.lax.dynamic_slice(x, (i,) + (0,) * (x.ndim - 1), size)

    def body(i, dst):
        return jax.tree_util.tree_map_with_path(lambda path, d, s: jax.lax.dynamic_update_slice(
            d, row(path, s, from_N[i]), (to_N[i],) + (0,) * (d.ndim - 1)), dst, dst if src is None else src)

    return jax.lax.fori_loop(0, n, body, dst)


def _compacted(flag_K, *arrays):
    """The entries of `arrays` where flag_K holds, first (in order), and their count: a `_copy_rows` list."""
    order = jnp.argsort(~flag_K, stable=True)
    return (*(a[order] for a in arrays), flag_K.sum(dtype=jnp.int32))


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk", "tail", "width"), donate_argnames=("pool", "state"))
def insert(params, graphdef, pool: KVCache, state: DecodeState, plan: InsertArrays, chunk: int, tail: int,
           width: int):
    """Runs a tick's inserts, in this order: copies the caches of slots plan.save_slot[k] to pool rows
    plan.save_row[k] (k < n_save) and frees every slot of save_slot; prefills n_new new rows into slots
    plan.slot[k] and writes their settings there; moves slot move_from[k] to move_to[k], settings and all
    (k < n_move). Other entries past those counts are padding.

    New row k starts from pool row src[k], whose first cached[k] slots hold its prompt's first tokens
    (copied into its slot first; nothing is copied where nothing is cached), and prefills the rest in
    its slot, `chunk` tokens at a time while more than two tails are left, then `tail` at a time
    (`prefill_steps`), one block of `prefill_block_rows(K)` rows per step (the blocks of
    `prefill_order`: rows come in its order). A row whose leader[k] is another row has the same prompt
    and copies that row's slot once the prefill is done. Its slot's logits become those of its
    prompt's last token. A row of a block that has no part in a step writes nothing.

    Every cache slot the inserts read or write lies in the first `width` (a new row's prompt and the
    `Shapes.past` slots a step may write past it, a saved or moved row's sequence): they copy and
    prefill only those, not the whole width.

    Returns the pool and the decode state.
    """
    model: Decoder = nnx.merge(graphdef, params)
    pool, state = _save_ended(pool, state, plan, width)
    leads_K, cache = _start_from_pool(pool, state.cache, plan, width)
    # Chunks while more than two tails of a prompt are left, then tails.
    cache, logits_BxV = _prefill(model, cache, state.logits, plan, plan.chunk_block, plan.chunk_steps, chunk,
                                 2 * tail, width)
    cache, logits_BxV = _prefill(model, cache, logits_BxV, plan, plan.tail_block, plan.tail_steps, tail, 0, width)
    state = _seat_new_rows(state, cache, logits_BxV, plan, leads_K, width)
    # Moves last (their sources and targets are none of the slots above): every loop that writes the
    # slots in place then follows every read of them (unordered, XLA copied every slot to be safe).
    return pool, _move_rows(state, plan, width)


def _save_ended(pool: KVCache, state: DecodeState, plan: InsertArrays, width: int):
    """The caches of slots plan.save_slot[k] copied to pool rows plan.save_row[k] (k < n_save), and every
    slot of save_slot freed: (pool, state)."""
    pool = _copy_rows(pool, state.cache, plan.save_slot, plan.save_row, plan.n_save, width)
    # A free slot's length 0 keeps the decode's attention window to the slots in use.
    return pool, state._replace(
        cache=state.cache._replace(length_B=state.cache.length_B.at[plan.save_slot].set(0, mode="drop")),
        live=state.live.at[plan.save_slot].set(False, mode="drop"))


def _start_from_pool(pool: KVCache, cache: KVCache, plan: InsertArrays, width: int):
    """Each new leader row's cached prompt start copied from its pool row into its slot, its length set:
    (which of the K rows lead, the cache)."""
    K = plan.tokens.shape[0]
    # In prefill order the real rows come first (`prefill_order`).
    leads_K = (plan.leader == jnp.arange(K)) & (jnp.arange(K) < plan.n_new)
    cache = _copy_rows(cache, pool, *_compacted(leads_K & (plan.cached > 0), plan.src, plan.slot), width)
    return leads_K, cache._replace(length_B=cache.length_B.at[plan.slot].set(plan.cached, mode="drop"))


def _prefill(model: Decoder, cache: KVCache, logits_BxV, plan: InsertArrays, block_I, steps, size: int,
             more_than: int, width: int):
    """`steps` prefill steps of `size` tokens, step i over the rows of block block_I[i] of
    `prefill_block_rows` rows: a row takes it while more than `more_than` tokens of its prompt are left;
    the others write nothing. A row whose prompt ends in the step gets its last token's logits. Returns
    (cache, logits_BxV)."""
    B, R = cache.length_B.shape[0], prefill_block_rows(plan.tokens.shape[0])

    def step(carry):
        i, cache, logits_BxV = carry
        slot_R, tokens_RxW, prompt_len_R = (jax.lax.dynamic_slice_in_dim(x, block_I[i] * R, R)
                                            for x in (plan.slot, plan.tokens, plan.prompt_len))
        take_R = jnp.where(slot_R < B, slot_R, slot_R[0])  # padding rows (slot B) read the block's first
        part = KVCache(tuple(k[take_R, :, :, :width] for k in cache.k_BxKxHxS),
                       tuple(v[take_R, :, :width] for v in cache.v_BxKxSxH), cache.length_B[take_R],
                       None if cache.routes_BxSxU is None else cache.routes_BxSxU[take_R, :width])
        start_R = part.length_B
        takes_R = (slot_R < B) & (prompt_len_R - start_R > more_than)
        tokens_RxC = jax.vmap(lambda row, s: jax.lax.dynamic_slice(row, (s,), (size,)))(tokens_RxW, start_R)
        slot_RxC = start_R[:, None] + jnp.arange(size)
        h_RxCxD, part = model.hidden(tokens_RxC, slot_RxC, slot_RxC < prompt_len_R[:, None], part)
        last_R = prompt_len_R - 1 - start_R  # the prompt's last token, for rows it is in this chunk
        h_RxD = jnp.take_along_axis(h_RxCxD, jnp.clip(last_R, 0, size - 1)[:, None, None], axis=1)[:, 0]
        ends_here_R = takes_R & (last_R < size)
        logits_RxV = model.logits(h_RxD[:, None])[:, 0]
        logits_BxV = logits_BxV.at[jnp.where(ends_here_R, slot_R, B)].set(logits_RxV, mode="drop")
        return i + 1, _write_taken(cache, part, slot_R, takes_R), logits_BxV

    _, cache, logits_BxV = jax.lax.while_loop(lambda carry: carry[0] < steps, step, (jnp.int32(0), cache, logits_BxV))
    return cache, logits_BxV


def _write_taken(cache: KVCache, part: KVCache, slot_R, takes_R) -> KVCache:
    """Row r of `part` written to slot slot_R[r] of `cache` where takes_R[r] holds, one row at a time."""

    def write(r, cache):
        row = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, r, 1), part)
        return jax.lax.cond(takes_R[r], lambda c: jax.tree.map(
            lambda whole, x: jax.lax.dynamic_update_slice(whole, x, (slot_R[r],) + (0,) * (x.ndim - 1)), c, row),
            lambda c: c, cache)

    return jax.lax.fori_loop(0, slot_R.shape[0], write, cache)


def _seat_new_rows(state: DecodeState, cache: KVCache, logits_BxV, plan: InsertArrays, leads_K, width: int):
    """Followers copy their leader's prefilled slot; every new row goes live with its settings."""
    K = plan.tokens.shape[0]
    follows_K = ~leads_K & (jnp.arange(K) < plan.n_new)
    cache, logits_BxV = _copy_rows((cache, logits_BxV), None, *_compacted(follows_K, plan.slot[plan.leader], plan.slot),
                                   width)
    return state._replace(
        cache=cache, logits=logits_BxV, live=state.live.at[plan.slot].set(True, mode="drop"),
        position=state.position.at[plan.slot].set(0, mode="drop"),
        settings=jax.tree.map(lambda whole, new: whole.at[plan.slot].set(new, mode="drop"), state.settings,
                              plan.settings))


def _move_rows(state: DecodeState, plan: InsertArrays, width: int) -> DecodeState:
    """Slot move_from[k] moved to move_to[k], settings and all (k < n_move), and freed."""
    state = _copy_rows(state, None, plan.move_from, plan.move_to, plan.n_move, width)
    return state._replace(cache=state.cache._replace(length_B=state.cache.length_B.at[plan.move_from].set(0, mode="drop")),
                          live=state.live.at[plan.move_from].set(False, mode="drop"))


def _slots_from(x, offset_b, width: int, axis: int):
    """Each row's `width` slots from its own offset on (`axis`: the slot axis of a row)."""
    return jax.vmap(lambda row, o: jax.lax.dynamic_slice_in_dim(row, o, width, axis))(x, offset_b)


def _new_slots_into(x, narrow, start_b, offset_b, steps: int, axis: int):
    """Writes the `steps` slots from `start_b` of each row of `narrow` (a call's cut of x: x's slots from
    offset_b on) back into x: all that a decode call of that many steps can have written. A call of more
    steps than its cut is wide runs over the whole cache (the host's windows hold a row's length plus
    `steps`), where slicing and writing back both clamp a row's start to the cut's last `n` slots."""
    n = min(steps, narrow.shape[axis + 1])
    new = _slots_from(narrow, start_b, n, axis)
    return jax.vmap(lambda row, p, o: jax.lax.dynamic_update_slice_in_dim(row, p, o, axis))(x, new, offset_b + start_b)


@functools.partial(jax.jit, static_argnames=("graphdef", "rows", "steps", "width", "prefix_width"),
                   donate_argnames=("state",))
def generate(params, graphdef, state: DecodeState, rows: int, steps: int, width: int,
             groups: Groups | None = None, prefix_width: int = 0):
    """Advances the first `rows` slots up to `steps` tokens each (b = rows): a live slot samples from its
    logits, then feeds the token back, until it stops or reaches its max_tokens; a row's last token is
    not fed back, so its cache then holds exactly what a continuation reuses. Ends early once no slot
    is live. The b slots' lengths plus `steps` must fit in the cache's first `width` slots: the decode
    reads and writes only those (a wider slot is cut to them).

    With `groups`, slot b continues the prefix of group g = groups.group[b], the first groups.length[g]
    slots of slot groups.src[g] (which the b slot holds too): the decode reads each group's prefix once
    (its first `prefix_width` slots), and of each slot only the `width` slots past its prefix, which
    must hold what it has past the prefix plus `steps`. A sliding layer's ring (of no more slots than
    its window) is read whole, cut to `width` only where no group prefix comes before the slots.

    Returns the state, the tokens sampled (b, steps; -1 where a slot sampled nothing) with their
    logprobs, and which of the b slots are still live.
    """
    model: Decoder = nnx.merge(graphdef, params)
    part = jax.tree.map(lambda x: x[:rows], state)
    s = part.settings
    # Both halves of a 64-bit seed (a key takes 32 bits): distinct seeds give distinct streams.
    base_keys = jax.vmap(lambda seed: jax.random.fold_in(jax.random.key(seed[0]), seed[1]))(s.seed)
    # A slot is live from the call's start until it stops, so at step i a live slot samples at
    # position + i: every step's uniforms drawn at once, before the loop (threefry is a loop of its
    # own on XLA:CPU, and was ~4% of a step drawn in it).
    u_bxS = jax.vmap(lambda key, p: jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, p + i)))(
        jnp.arange(steps)))(base_keys, part.position)

    def body(carry):
        i, logits_bxV, cache, live_b, position_b, out_tokens, out_logp = carry
        token_b, logp_b = sample(logits_bxV, u_bxS[:, i], s.temperature, s.top_p, s.top_k)
        out_tokens = out_tokens.at[:, i].set(jnp.where(live_b, token_b, -1))
        out_logp = out_logp.at[:, i].set(jnp.where(live_b, logp_b, 0.0))
        position_b = position_b + live_b
        stopped_b = jnp.any(token_b[:, None] == s.stop_ids, axis=-1)
        live_b = live_b & ~stopped_b & (position_b < s.max_tokens)
        logits, cache = model(token_b[:, None], (offset_b + cache.length_B)[:, None], live_b[:, None], cache,
                              windowed=False, shared=shared)
        return i + 1, logits[:, 0], cache, live_b, position_b, out_tokens, out_logp

    # Cut once per call and written back at its end: cutting the attention's window out of the whole
    # cache at every step was most of a step's time. A width chosen on the device (a switch over
    # windows) made XLA copy the whole cache into the chosen branch, which cost more than it saved.
    wide = part.cache
    rings = [model.cfg.sliding(i) is not None for i in range(model.cfg.num_layers)]
    if groups is None:
        shared, offset_b = None, jnp.zeros(rows, jnp.int32)
        narrow = wide._replace(k_BxKxHxS=tuple(k[..., :width] for k in wide.k_BxKxHxS),
                               v_BxKxSxH=tuple(v[:, :, :width] for v in wide.v_BxKxSxH),
                               routes_BxSxU=None if wide.routes_BxSxU is None else wide.routes_BxSxU[:, :width])
    else:
        offset_b = groups.length[groups.group]
        shared = SharedPrefix(tuple(None if ring else k[groups.src, ..., :prefix_width]
                                    for k, ring in zip(wide.k_BxKxHxS, rings)),
                              tuple(None if ring else v[groups.src, :, :prefix_width]
                                    for v, ring in zip(wide.v_BxKxSxH, rings)),
                              groups.length, groups.members, groups.group, groups.rank)
        narrow = KVCache(tuple(k if ring else _slots_from(k, offset_b, width, 2)
                               for k, ring in zip(wide.k_BxKxHxS, rings)),
                         tuple(v if ring else _slots_from(v, offset_b, width, 1)
                               for v, ring in zip(wide.v_BxKxSxH, rings)),
                         wide.length_B - offset_b,
                         None if wide.routes_BxSxU is None else _slots_from(wide.routes_BxSxU, offset_b, width, 0))
    init = (jnp.int32(0), part.logits, narrow, part.live, part.position, jnp.full((rows, steps), -1, jnp.int32),
            jnp.zeros((rows, steps), jnp.float32))
    _, logits, narrow, live, position, out_tokens, out_logp = jax.lax.while_loop(
        lambda carry: (carry[0] < steps) & jnp.any(carry[3]), body, init)
    # A step writes each row's keys and values at its length, which grows by at most one a step: only
    # the `steps` slots from where each row started can differ from the wide cache, so only those go
    # back (the whole window's copy back was ~5% of a 64-row call). A ring, bounded by its window, goes
    # back whole.
    start_b = init[2].length_B

    def back(x, n, ring: bool, axis: int):
        return (jax.lax.dynamic_update_slice_in_dim(x, n, 0, axis + 1) if ring
                else _new_slots_into(x, n, start_b, offset_b, steps, axis))

    cache = KVCache(tuple(back(k, n, ring, 2) for k, n, ring in zip(wide.k_BxKxHxS, narrow.k_BxKxHxS, rings)),
                    tuple(back(v, n, ring, 1) for v, n, ring in zip(wide.v_BxKxSxH, narrow.v_BxKxSxH, rings)),
                    narrow.length_B + offset_b,
                    None if wide.routes_BxSxU is None else
                    _new_slots_into(wide.routes_BxSxU, narrow.routes_BxSxU, start_b, offset_b, steps, 0))
    part = part._replace(cache=cache, logits=logits, live=live, position=position)
    state = jax.tree.map(lambda whole, p: jax.lax.dynamic_update_slice_in_dim(whole, p, 0, 0), state, part)
    return state, out_tokens, out_logp, live


@jax.jit
def _slot_routes(routes_BxSxU, slots_n):
    """The recorded routes of slots slots_n (padded to one of the engine's batch sizes)."""
    return routes_BxSxU[slots_n]


@functools.partial(jax.jit, static_argnames=("cfg", "batch", "width", "max_stop_ids"))
def _empty_state(cfg, batch: int, width: int, max_stop_ids: int) -> DecodeState:
    return DecodeState.empty(cfg, batch, width, max_stop_ids)


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
    prompts prefilled `chunk` tokens at a time and their last few `tail` (a quarter chunk) at a
    time, `max_batch` decode slots advanced `decode_steps` tokens per device call (batches
    bucketed to powers of two), up to `max_stop_ids` stop ids a row."""

    max_seq_len: int
    chunk: int
    max_batch: int
    decode_steps: int = 16
    max_stop_ids: int = 8

    @property
    def tail(self) -> int:
        return max(1, self.chunk // 4)

    @property
    def past(self) -> int:
        """Slots a prefill step may write past its row's prompt: a chunk taken with just over two
        tails left, or a tail."""
        return max(self.tail, self.chunk - 2 * self.tail)

    @property
    def width(self) -> int:
        """Cache slots per row: a prefill step's writes past the longest prompt still fit."""
        return self.max_seq_len + self.past

    def batch(self, rows: int) -> int:
        return min(bucket(rows), self.max_batch)

    def batches(self) -> list[int]:
        """Every batch size a run can use: what a warm-up compiles."""
        return sorted({self.batch(n) for n in range(1, self.max_batch + 1)})

    def windows(self) -> tuple[int, ...]:
        """Every cache width a decode call may be cut to: what a warm-up compiles, with each batch size.
        Down to a quarter of the whole at most: each width is two programs per batch size to compile
        before serving (at 2,112 slots, halving to 128 made 5 widths: 40 programs for 4 batch sizes)."""
        return attention_windows(self.width, smallest=max(128, self.width // 4))

    def window(self, used: int) -> int:
        """The narrowest of `windows()` that holds `used` slots."""
        return next((w for w in self.windows() if w >= used), self.width)

    def decode_windows(self) -> tuple[int, ...]:
        """The widths a decode call of rows apart may be cut to: finer than `windows()`, since such a
        call's attention reads every slot of its window at every step, most of a step's time, where an
        insert reads them once. Multiples of 64 from 128, at most 8 (`key_windows`)."""
        return tuple(w for w in key_windows(self.width) if w >= min(128, self.width))

    def decode_window(self, used: int) -> int:
        """The narrowest of `decode_windows()` that holds `used` slots."""
        return next((w for w in self.decode_windows() if w >= used), self.width)


class Slots:
    """A tick: the scheduler's plan, the device calls that run it, the scheduler's update from their
    output. Holds the device state (decode slots, prefix pool). Not thread-safe: one caller at a time."""

    def __init__(self, cfg: ModelConfig, shapes: Shapes, pool_rows: int, prefix_block: int = 16):
        self.cfg, self.shapes = cfg, shapes
        self.scheduler = Scheduler(shapes.max_batch, shapes.max_seq_len, pool_rows, prefix_block,
                                   cfg.sliding_window if cfg.sliding_layers else 0)
        self.pool_rows = pool_rows
        self.device_s = self.insert_s = 0.0
        self.reset()

    @property
    def prefix(self):
        return self.scheduler.prefix

    @property
    def stats(self) -> dict[str, int]:
        return self.scheduler.stats

    @property
    def rows(self) -> list[Row | None]:
        return self.scheduler.rows

    @property
    def waiting(self):
        return self.scheduler.waiting

    def reset(self) -> None:
        """Empties every slot and the pool, with device state anew (after a failed call)."""
        s = self.shapes
        self.state = _committed(_empty_state(self.cfg, s.max_batch, s.width, s.max_stop_ids))
        self.pool = _committed(_empty_cache(self.cfg, self.pool_rows + 1, s.width))
        self.scheduler.reset()

    def add(self, rows: list[Row]) -> None:
        """Queues rows for a slot; each must fit max_seq_len and max_stop_ids."""
        for row in rows:
            if len(row.stop_ids) > self.shapes.max_stop_ids:
                raise ValueError(f"{len(row.stop_ids)} stop token ids, more than the engine's "
                                 f"{self.shapes.max_stop_ids}")
        self.scheduler.add(rows)

    def drop(self, rows: list[Row]) -> None:
        self.scheduler.drop(rows)

    def busy(self) -> bool:
        return self.scheduler.busy()

    def step(self, graphdef, params, version: int) -> list[Row]:
        """One tick with these weights; returns the rows that ended. `device_s` grows by the time spent
        in its device calls (dispatch and wait), the rest of the tick being the host's plan and update;
        `insert_s` by the inserts' part of it."""
        plan = self.scheduler.schedule(version)
        arrays = self._insert_arrays(plan) if plan.inserts else None
        start = time.perf_counter()
        if arrays is not None:
            used = max([plan.span] + [len(row.prompt) + self.shapes.past for row in plan.new])
            self.pool, self.state = insert(params, graphdef, self.pool, self.state, arrays, chunk=self.shapes.chunk,
                                           tail=self.shapes.tail, width=self.shapes.window(used))
            # Waited for before the decode is dispatched (the decode needs its state anyway), so that
            # the inserts' saves, copies and prefill are timed apart from the decoding.
            jax.block_until_ready(self.state)
            self.insert_s += time.perf_counter() - start
        if not plan.batch:
            self.device_s += time.perf_counter() - start
            return []
        # The device's lengths are the host's: a slot past the batch's rows is free (length 0).
        steps, own = self.shapes.decode_steps, self.shapes.windows()[0]
        groups = self.scheduler.groups(plan.batch, steps, own, self.shapes.width) if own < self.shapes.width else None
        if groups is None:
            used = self.scheduler.in_use(range(plan.batch)) + steps
            self.state, tokens, logprobs, live = generate(params, graphdef, self.state, rows=plan.batch, steps=steps,
                                                          width=self.shapes.decode_window(used))
        else:
            self.state, tokens, logprobs, live = generate(
                params, graphdef, self.state, rows=plan.batch, steps=steps, width=own,
                groups=groups, prefix_width=self.shapes.window(int(groups.length.max())))
        output = jax.device_get((tokens, logprobs, live))
        ended = self.scheduler.update_from_output(plan, *output, version)
        if ended and self.state.cache.routes_BxSxU is not None:
            # In update_from_output's order: the slots that sampled and are no longer live.
            self._attach_routes(ended, np.flatnonzero((output[0] >= 0).any(-1) & ~output[2]))
        self.device_s += time.perf_counter() - start
        return ended

    def _attach_routes(self, rows: list[Row], slots: np.ndarray) -> None:
        """Each ended row's routes, read from its slot before an insert reuses it: one transfer of the
        rows' slots (their count padded to a batch size, whose programs the warm-up compiled)."""
        index = np.zeros(self.shapes.batch(len(slots)), np.int32)
        index[:len(slots)] = slots
        routes = jax.device_get(_slot_routes(self.state.cache.routes_BxSxU, index))
        for row, fed in zip(rows, routes):
            row.routes = fed[:len(row.prompt) + len(row.tokens) - 1]

    def _insert_arrays(self, plan: Plan, batch: int | None = None) -> InsertArrays:
        B, S, W = self.shapes.max_batch, self.prefix.scratch, self.shapes.width
        n_new = len(plan.new)
        K = batch or self.shapes.batch(max(len(plan.save_slot), len(plan.move_from), n_new, 1))

        def pad(values, fill):
            out = np.full(K, fill, np.int32)
            out[:len(values)] = values
            return out

        tokens = np.zeros((K, W), np.int32)
        prompt_len = np.ones(K, np.int32)  # padding rows: one token, nothing to prefill
        for k, row in enumerate(plan.new):
            tokens[k, :len(row.prompt)] = row.prompt
            prompt_len[k] = len(row.prompt)
        cached, leader = pad(plan.cached, 0), np.arange(K, dtype=np.int32)
        leader[:n_new] = plan.leader
        order, *passes = prefill_order(prompt_len, cached, leader, n_new, self.shapes.chunk, self.shapes.tail, W)
        position = np.argsort(order).astype(np.int32)  # of each row in `order`
        # Slots that end with nothing worth keeping (another version's, dropped) are freed, not copied.
        kept = np.argsort(plan.save_row == S, kind="stable")
        return InsertArrays(
            pad(plan.save_slot[kept], B), pad(plan.save_row[kept], S), np.int32((plan.save_row != S).sum()),
            pad(plan.move_from, B), pad(plan.move_to, B), np.int32(len(plan.move_from)),
            pad(plan.src, S)[order], pad(plan.slot, B)[order], cached[order], position[leader[order]], np.int32(n_new),
            *passes, tokens[order], prompt_len[order],
            jax.tree.map(lambda x: x[order], RowSettings.of(plan.new, K, self.shapes.max_stop_ids)))

    def warm_up(self, graphdef, params) -> None:
        """Compiles (or loads from the persistent cache) every insert and decode program."""
        none, own = np.zeros(0, np.int32), self.shapes.windows()[0]
        for n in self.shapes.batches():
            plan = Plan(none, none, none, none, [], none, none, none, none, n, 0)
            U, m = group_capacity(n)
            groups = Groups(np.zeros(U, np.int32), np.zeros(U, np.int32), np.zeros((U, m), np.int32),
                            np.zeros(n, np.int32), np.zeros(n, np.int32))
            for width in self.shapes.decode_windows():
                self.state, *_ = generate(params, graphdef, self.state, rows=n, steps=self.shapes.decode_steps,
                                          width=width)
            if self.state.cache.routes_BxSxU is not None:
                _slot_routes(self.state.cache.routes_BxSxU, np.zeros(n, np.int32))
            for width in self.shapes.windows():
                self.pool, self.state = insert(params, graphdef, self.pool, self.state, self._insert_arrays(plan, n),
                                               chunk=self.shapes.chunk, tail=self.shapes.tail, width=width)
                if own < self.shapes.width:
                    self.state, *_ = generate(params, graphdef, self.state, rows=n, steps=self.shapes.decode_steps,
                                              width=own, groups=groups, prefix_width=width)
        self.reset()
        self.scheduler.stats = dict.fromkeys(self.scheduler.stats, 0)
        self.device_s = self.insert_s = 0.0
