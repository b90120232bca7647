"""Flax NNX decoder of every family (`jaxrl.models.families`): dense or mixture-of-experts MLPs, with
an optional KV cache.

Parameters carry logical axis names (`out_sharding` metadata); `LOGICAL_AXIS_RULES` maps them
onto a mesh with `fsdp`, `expert` and `tp` axes.

An MoE model's forward passes take an optional replayed route of every token (`replay_BxTxU`: per MoE
layer in order, its top-k expert ids; U = MoE layers x top-k) and, asked with `routed=True`, also return
`Routed`: the router's own route of every token and the load-balancing statistics.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models import moe
from jaxrl.models.config import ModelConfig, YarnScaling

# Logical parameter axes -> mesh axes. Hidden size is split over fsdp, head / mlp / vocab
# dimensions over tp (Megatron-style column/row parallel layers).
LOGICAL_AXIS_RULES = (
    ("embed", "fsdp"),
    ("vocab", "tp"),
    ("q_heads", "tp"),
    ("kv_heads", "tp"),
    ("mlp", "tp"),
    ("norm", None),
    ("expert", "expert"),
)

_INIT_STD = 0.02
# Causal attention without a cache runs over blocks of queries, each against the keys up to its
# last query: at least this many queries per block, at most this many blocks (an unrolled loop).
_MIN_QUERY_BLOCK = 64
_MAX_QUERY_BLOCKS = 16
# Packed rows run their queries in blocks of this many, each against a window of keys ending with it.
QUERY_BLOCK = _MIN_QUERY_BLOCK


class KVCache(NamedTuple):
    """Keys and values of every layer: row b holds its tokens, in order, at slots [0, length_B[b]); a
    sliding layer's only its last ones, in a ring of `ring_slots` slots (position p at slot p % slots), so
    that its memory is bounded by the window, not by the sequences."""

    # One buffer per layer, heads before slots: a decode step's attention reads each head's keys
    # in place as one contiguous matrix (one stacked L-layer buffer made XLA CPU copy each layer's
    # slice every step; slots before heads made it transpose the whole cache). Keys are stored
    # transposed (head dim before slots): q . k is then a plain matmul, which XLA CPU ran
    # faster than the same product against slot-major keys (docs/benchmarks.md).
    k_BxKxHxS: tuple[jax.Array, ...]
    v_BxKxSxH: tuple[jax.Array, ...]
    length_B: jax.Array  # int32
    # An MoE model's: the route its routers gave the token in each slot (`moe.route_dtype`), recorded
    # as keys and values are, so that a sampler can report every token's route (None: dense models).
    routes_BxSxU: jax.Array | None = None

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
        slots = [max_len if cfg.sliding(i) is None else ring_slots(cfg, max_len) for i in range(cfg.num_layers)]
        routes = (jnp.full((batch, max_len, cfg.route_width), moe.no_route(cfg.num_experts),
                           moe.route_dtype(cfg.num_experts)) if cfg.route_width else None)
        return cls(
            tuple(jnp.zeros((batch, cfg.num_kv_heads, cfg.head_dim, s), cfg.jnp_dtype) for s in slots),
            tuple(jnp.zeros((batch, cfg.num_kv_heads, s, cfg.head_dim), cfg.jnp_dtype) for s in slots),
            jnp.zeros((batch,), jnp.int32),
            routes,
        )


def ring_slots(cfg: ModelConfig, max_len: int) -> int:
    """Slots of a sliding layer's ring in a cache of `max_len`: its window, or fewer where no sequence is
    that long. No more than the window: a query then sees every key the ring holds (`RingSlots`)."""
    return min(cfg.sliding_window, max_len)


class RingSlots(NamedTuple):
    """Where a call's new tokens go in sliding layers' rings and what its queries see there (`ring_attention`).
    A ring holds its row's last `slots` positions; a query sees those of them in its window."""

    write_BxT: jax.Array  # each new token's ring slot; `slots` (out of range) for padding and evicted ones
    visible_BxTxR: jax.Array  # query t may attend to ring slot r: before this call's writes, or after (T = 1)
    own_BxTxT: jax.Array | None  # with T > 1: query t may attend to the call's token t' (t' <= t, in the window)

    @classmethod
    def of(cls, start_B, mask_BxT, slots: int, window: int) -> RingSlots:
        """Of rows whose first start_B positions are in their rings and whose new (right-padded) tokens
        are at positions start_B + t. One query reads its ring after its own key is written, which only
        evicts a key out of its window; more read it as it was (their later keys would evict earlier
        queries' keys from a ring of only the window) and their own keys beside it."""
        B, T = mask_BxT.shape
        t_T = jnp.arange(T)
        real_B = mask_BxT.sum(-1, dtype=jnp.int32)
        # Only a row's last `slots` real tokens: earlier ones would be evicted by later ones of the call.
        written_BxT = mask_BxT & (t_T >= real_B[:, None] - slots)
        write_BxT = jnp.where(written_BxT, (start_B[:, None] + t_T) % slots, slots)
        # The position ring slot r holds: the last one written there, negative where none was.
        last_Bx1 = start_B[:, None] - 1 + (T == 1)
        held_BxR = last_Bx1 - (last_Bx1 - jnp.arange(slots)) % slots
        query_BxTx1 = (start_B[:, None] + t_T)[:, :, None]
        visible_BxTxR = (held_BxR >= 0)[:, None] & (query_BxTx1 - held_BxR[:, None] < window)
        # The call's own keys: right padding puts every key a real query sees among the real ones.
        own_TxT = (t_T[None] <= t_T[:, None]) & (t_T[:, None] - t_T[None] < window)
        return cls(write_BxT, visible_BxTxR, None if T == 1 else jnp.broadcast_to(own_TxT, (B, T, T)))


def _write_ring(ring_k_BxKxHxR, ring_v_BxKxRxH, k_BxTxKxH, v_BxTxKxH, write_BxT):
    """Row b's new keys and values at ring slots write_BxT[b] (out of range: not written)."""
    new_k_BxKxHxT = k_BxTxKxH.transpose(0, 2, 3, 1).astype(ring_k_BxKxHxR.dtype)
    new_v_BxKxTxH = v_BxTxKxH.transpose(0, 2, 1, 3).astype(ring_v_BxKxRxH.dtype)
    ring_k = jax.vmap(lambda c, x, s: c.at[:, :, s].set(x, mode="drop"))(ring_k_BxKxHxR, new_k_BxKxHxT, write_BxT)
    ring_v = jax.vmap(lambda c, x, s: c.at[:, s].set(x, mode="drop"))(ring_v_BxKxRxH, new_v_BxKxTxH, write_BxT)
    return ring_k, ring_v


def _write_rows(cache_BxKxSxH, new_BxTxKxH, start_B):
    """Row b's new values at slots [start_B[b], start_B[b] + T)."""
    new_BxKxTxH = new_BxTxKxH.transpose(0, 2, 1, 3).astype(cache_BxKxSxH.dtype)
    return jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice(c, x, (0, s, 0)))(cache_BxKxSxH, new_BxKxTxH, start_B)


def _write_route_rows(routes_BxSxU, new_BxTxU, start_B):
    """Row b's new routes at slots [start_B[b], start_B[b] + T)."""
    new = new_BxTxU.astype(routes_BxSxU.dtype)
    return jax.vmap(lambda r, x, s: jax.lax.dynamic_update_slice(r, x, (s, 0)))(routes_BxSxU, new, start_B)


def _write_key_rows(cache_BxKxHxS, new_BxTxKxH, start_B):
    """Row b's new keys at slots [start_B[b], start_B[b] + T) of the transposed key cache."""
    new_BxKxHxT = new_BxTxKxH.transpose(0, 2, 3, 1).astype(cache_BxKxHxS.dtype)
    return jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice(c, x, (0, 0, s)))(cache_BxKxHxS, new_BxKxHxT, start_B)


def _param(rngs: nnx.Rngs | None, shape, axes, cfg: ModelConfig, init: str) -> nnx.Param:
    dtype = cfg.jnp_param_dtype
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class Linear(nnx.Module):
    def __init__(self, d_in, d_out, axes, bias, cfg: ModelConfig, rngs: nnx.Rngs):
        self.kernel = _param(rngs, (d_in, d_out), axes, cfg, "normal")
        self.bias = _param(rngs, (d_out,), axes[1:], cfg, "zeros") if bias else None
        self.dtype = cfg.jnp_dtype
        self.lora = nnx.data(None)  # low-rank adapters, added by jaxrl.models.lora.add_lora

    def __call__(self, x):
        y = matmul_2d(x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        if self.lora is not None:
            y = y + self.lora(x.astype(self.dtype))
        return y


def matmul_2d(x_NxD, w_DxF, **kwargs):
    """`x @ w` over the last axis as one 2-D matmul.

    With 3-D activations XLA CPU copies the output gradient transposed before the weight
    gradient's dot (a full extra pass, slower than the dot itself); flattened it does not.
    """
    y = jnp.matmul(x_NxD.reshape(-1, x_NxD.shape[-1]), w_DxF, **kwargs)
    return y.reshape(*x_NxD.shape[:-1], w_DxF.shape[-1])


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, cfg: ModelConfig):
        self.weight = _param(None, (dim,), ("norm",), cfg, "ones")
        self.eps = cfg.rms_norm_eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        # Same rounding order as transformers: normalise in float32, cast, then scale.
        return self.weight[...].astype(x.dtype) * xf.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies (head_dim / 2,), float32, with Llama-3 or YaRN scaling if configured."""
    dim = cfg.head_dim
    # The power in float64, rounded to float32: transformers' (torch's vectorised float32 pow) is an ulp off
    # the exact one more rarely than numpy's float32 pow is, and at position 5000 an ulp of one frequency
    # moved gpt-oss's tiny logits by 1e-4.
    exponents = (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)).astype(np.float64)
    pos_freqs = (np.float64(cfg.rope_theta) ** exponents).astype(np.float32)
    inv_freq = 1.0 / pos_freqs
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    if isinstance(scaling, YarnScaling):
        return _yarn_inv_freq(pos_freqs, cfg.rope_theta, scaling)
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(pos_freqs: np.ndarray, theta: float, scaling: YarnScaling) -> np.ndarray:
    """transformers' `_compute_yarn_parameters`, in its float32 order of operations: the dimensions that
    turn fewer than beta_slow times over the original length are scaled by 1 / factor, those that turn
    more than beta_fast times kept, the ones between blended along a linear ramp."""
    dim = 2 * len(pos_freqs)

    def correction_dim(rotations):
        return dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp
    scaled = 1.0 / (np.float32(scaling.factor) * pos_freqs)
    return (scaled * (1 - kept) + (1.0 / pos_freqs) * kept).astype(np.float32)


def rope_scale(cfg: ModelConfig) -> float:
    """The factor on cos and sin: YaRN's attention factor (transformers' `get_mscale` rule where config.json
    gives none), 1 otherwise."""
    scaling = cfg.rope_scaling
    if not isinstance(scaling, YarnScaling):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(m=1.0):
        return 1.0 if scaling.factor <= 1 else 0.1 * m * math.log(scaling.factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.mscale) / mscale(scaling.mscale_all_dim)
    return mscale()


def rope_tables(positions_BxT, cfg: ModelConfig):
    """cos and sin of each position's RoPE angles, (B, T, 1, H) each: computed once for all layers,
    where XLA recomputed them inside every layer's fused rotation (a decode step's largest small ops)."""
    freqs_BxTxF = positions_BxT[..., None].astype(jnp.float32) * jnp.asarray(rope_inv_freq(cfg))
    angles_BxTx1xH = jnp.concatenate([freqs_BxTxF] * 2, -1)[:, :, None, :]
    scale = rope_scale(cfg)
    if scale == 1.0:
        return jnp.cos(angles_BxTx1xH), jnp.sin(angles_BxTx1xH)
    return jnp.cos(angles_BxTx1xH) * np.float32(scale), jnp.sin(angles_BxTx1xH) * np.float32(scale)


def apply_rope(x_BxTxNxH, rope):
    cos, sin = rope
    xf = x_BxTxNxH.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x_BxTxNxH.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int = 0):
        d, h, k, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(d, h * hd, ("embed", "q_heads"), cfg.qkv_bias, cfg, rngs)
        self.k_proj = Linear(d, k * hd, ("embed", "kv_heads"), cfg.qkv_bias, cfg, rngs)
        self.v_proj = Linear(d, k * hd, ("embed", "kv_heads"), cfg.qkv_bias, cfg, rngs)
        self.o_proj = Linear(h * hd, d, ("q_heads", "embed"), cfg.o_bias, cfg, rngs)
        self.q_norm = RMSNorm(hd, cfg) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg) if cfg.qk_norm else None
        self.sinks = _param(rngs, (h,), ("q_heads",), cfg, "zeros") if cfg.attention_sinks else None
        self.num_heads, self.num_kv_heads, self.head_dim = h, k, hd
        self.sliding = cfg.sliding(layer)

    def _qkv(self, x_BxTxD, rope):
        B, T, _ = x_BxTxD.shape
        K, H = self.num_kv_heads, self.head_dim
        q = self.q_proj(x_BxTxD).reshape(B, T, self.num_heads, H)
        k = self.k_proj(x_BxTxD).reshape(B, T, K, H)
        v = self.v_proj(x_BxTxD).reshape(B, T, K, H)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, rope), apply_rope(k, rope), v

    def _sinks(self):
        return None if self.sinks is None else self.sinks[...]

    def __call__(self, x_BxTxD, rope, keys: _KeySlots, layer_cache):
        B, T, _ = x_BxTxD.shape
        q, k, v = self._qkv(x_BxTxD, rope)
        sinks = self._sinks()
        if layer_cache is not None and self.sliding is not None:
            out, layer_cache = ring_attention(q, k, v, layer_cache[0], layer_cache[1], keys.ring, sinks)
        elif layer_cache is not None:
            shared_kv = layer_cache[2:]
            layer_cache = (_write_key_rows(layer_cache[0], k, keys.start_B), _write_rows(layer_cache[1], v, keys.start_B))
            if keys.shared is not None:
                out = shared_prefix_attention(q, *layer_cache, keys.visible_BxTxS, *shared_kv, keys.shared, sinks)
            elif keys.window is None:
                out = cached_attention(q, *layer_cache, keys.visible_BxTxS, sinks)
            else:
                out = windowed_cached_attention(q, *layer_cache, keys.visible_BxTxS, keys.window, sinks)
        elif keys.segments_BxT is not None:
            out = packed_attention(q, k, v, keys.segments_BxT, keys.prefix_BxT, keys.window, sinks, self.sliding,
                                   keys.positions_BxT)
        else:
            out = causal_attention(q, k, v, keys.mask_BxT, sinks, self.sliding)
        return self.o_proj(out.reshape(B, T, -1)), layer_cache

    def prefixed(self, x_GxPxD, x_BxTxD, rope_GxP, rope_BxT, mask_GxP, mask_BxT):
        """Attention of G prefixes and of B = G * n rows continuing them (row b: prefix b // n).
        A continuation's queries see its prefix's real keys before its own (`prefixed_attention`)."""
        (G, P, _), (B, T, _) = x_GxPxD.shape, x_BxTxD.shape
        q_p, k_p, v_p = self._qkv(x_GxPxD, rope_GxP)
        q, k, v = self._qkv(x_BxTxD, rope_BxT)
        sinks = self._sinks()
        out_p = causal_attention(q_p, k_p, v_p, mask_GxP, sinks, self.sliding)
        out = prefixed_attention(q, k_p, v_p, mask_GxP, k, v, mask_BxT, sinks, self.sliding)
        return self.o_proj(out_p.reshape(G, P, -1)), self.o_proj(out.reshape(B, T, -1))


def softmax_with_sink(scores, sink):
    """(probabilities, the sink's (..., 1)): a softmax over the last axis with one more logit, `sink`
    (broadcast to the rows), that takes its share of the mass and adds nothing to the output (gpt-oss's
    attention sinks). Rows of fully masked scores (a finite fill) give the sink all of it: zeros."""
    max_ = jax.lax.stop_gradient(jnp.maximum(scores.max(-1, keepdims=True), sink))
    e, sink_e = jnp.exp(scores - max_), jnp.exp(sink - max_)
    total = e.sum(-1, keepdims=True) + sink_e
    return e / total, sink_e / total


def _head_sinks(sinks_N, shape):
    """Each query head's sink logit, float32, shaped to broadcast over `shape`'s heads axis 1 (B, N, ...)."""
    return sinks_N.astype(jnp.float32).reshape(1, -1, *(1,) * (len(shape) - 2))


@jax.custom_vjp
def _softmax_attention(q_BxNxTxH, k_BxNxSxH, v_BxNxSxH, visible_BxTxS, sinks_N=None):
    return _softmax_attention_fwd(q_BxNxTxH, k_BxNxSxH, v_BxNxSxH, visible_BxTxS, sinks_N)[0]


def _softmax_attention_fwd(q_BxNxTxH, k_BxNxSxH, v_BxNxSxH, visible_BxTxS, sinks_N=None):
    scale = np.float32(1 / math.sqrt(q_BxNxTxH.shape[-1]))
    scores = jnp.einsum("bnth,bnsh->bnts", q_BxNxTxH * scale.astype(q_BxNxTxH.dtype), k_BxNxSxH,
                        preferred_element_type=jnp.float32)
    # A finite fill keeps fully masked rows (left padding) finite: uniform, unused, no NaN.
    scores = jnp.where(visible_BxTxS[:, None], scores, jnp.finfo(jnp.float32).min)
    if sinks_N is None:
        probs_f32, sink_prob_BxNxTx1 = jax.nn.softmax(scores, axis=-1), None
    else:
        probs_f32, sink_prob_BxNxTx1 = softmax_with_sink(scores, _head_sinks(sinks_N, scores.shape))
    probs_BxNxTxS = probs_f32.astype(v_BxNxSxH.dtype)
    out_BxNxTxH = jnp.einsum("bnts,bnsh->bnth", probs_BxNxTxS, v_BxNxSxH)
    return out_BxNxTxH, (q_BxNxTxH, k_BxNxSxH, v_BxNxSxH, visible_BxTxS, probs_BxNxTxS, out_BxNxTxH, sinks_N,
                         sink_prob_BxNxTx1)


def _softmax_attention_bwd(residuals, dout_BxNxTxH):
    """Written out: the softmax's row sums come from dout . out (T x H) instead of a pass
    over the (T, S) scores, and the scale applies to q / dq rather than to the scores. A sink is a
    column whose value is zero: its logit's gradient is -p_sink * (dout . out), summed over rows."""
    q, k, v, visible_BxTxS, probs, out, sinks_N, sink_prob_BxNxTx1 = residuals
    scale = np.float32(1 / math.sqrt(q.shape[-1]))
    dv = dot_over_rows(probs, dout_BxNxTxH)
    dprobs = jnp.einsum("bnth,bnsh->bnts", dout_BxNxTxH, v, preferred_element_type=jnp.float32)
    rowsum_BxNxTx1 = jnp.sum(dout_BxNxTxH * out, -1, keepdims=True, dtype=jnp.float32)
    dscores = jnp.where(visible_BxTxS[:, None], probs * (dprobs - rowsum_BxNxTx1), 0).astype(q.dtype)
    dq = jnp.einsum("bnts,bnsh->bnth", dscores, k) * scale.astype(q.dtype)
    dk = dot_over_rows(dscores, q * scale.astype(q.dtype))
    dsinks = None if sinks_N is None else (-(sink_prob_BxNxTx1 * rowsum_BxNxTx1).sum((0, 2, 3))).astype(sinks_N.dtype)
    return dq, dk, dv, None, dsinks


_softmax_attention.defvjp(_softmax_attention_fwd, _softmax_attention_bwd)


def dot_over_rows(a_xTxA, b_xTxB, preferred_element_type=None):
    """a^T b (..., A, B): the sum over the row axis T that a and b share, batched over leading axes.

    XLA:CPU runs a dot summing over its lhs's second-to-last axis outside YNNPACK, far slower than
    a plain matmul (docs/benchmarks.md), so on CPU `a` is transposed in memory first; the barrier
    keeps XLA from folding the transpose back into the dot. Other backends take it as it is."""
    def transposed_first(a, b):
        a_xAxT = jax.lax.optimization_barrier(jnp.swapaxes(a, -1, -2))
        return jnp.einsum("...at,...tb->...ab", a_xAxT, b, preferred_element_type=preferred_element_type)

    def as_it_is(a, b):
        return jnp.einsum("...ta,...tb->...ab", a, b, preferred_element_type=preferred_element_type)

    return jax.lax.platform_dependent(a_xTxA, b_xTxB, cpu=transposed_first, default=as_it_is)


def causal_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxS, sinks_N=None, sliding: int | None = None):
    """Each query over the real keys at or before it (no cache): query t sits at key slot
    S - T + t, so keys before the queries' own (S > T) are a prefix every query sees. With `sliding`,
    a query sees only the keys fewer than `sliding` slots before it (itself included); with `sinks_N`,
    each query head's softmax has that extra logit (`softmax_with_sink`).

    Blocks of queries see only the keys up to their last query: that skips most of the masked
    upper triangle (about half the work) and keeps each block's scores small enough to stay in
    cache. KV heads are repeated to the query heads and moved before time once, so every block
    is a plain batched matmul on contiguous slices (XLA CPU runs the grouped 5-D einsum, or
    per-block transposes, far slower). Rows of fully masked queries (left padding) are finite
    and unused.
    """
    B, T, N, H = q_BxTxNxH.shape
    G, offset = N // k_BxSxKxH.shape[2], k_BxSxKxH.shape[1] - T
    q_BxNxTxH = q_BxTxNxH.transpose(0, 2, 1, 3)
    k_BxNxSxH = jnp.repeat(k_BxSxKxH, G, axis=2).transpose(0, 2, 1, 3)
    v_BxNxSxH = jnp.repeat(v_BxSxKxH, G, axis=2).transpose(0, 2, 1, 3)

    def visible(start, end):
        seen = offset + end
        query_Qx1 = offset + jnp.arange(start, end)[:, None]
        causal_QxS = jnp.arange(seen)[None, :] <= query_Qx1
        if sliding is not None:
            causal_QxS &= jnp.arange(seen)[None, :] > query_Qx1 - sliding
        return causal_QxS[None] & mask_BxS[:, None, :seen]

    out = _causal_blocks(q_BxNxTxH, k_BxNxSxH, v_BxNxSxH, offset, visible, sinks_N, reach=sliding)
    return out.transpose(0, 2, 1, 3)


def causal_block(length: int) -> int:
    """Queries per block of `causal_attention` over `length` queries."""
    return max(_MIN_QUERY_BLOCK, -(-length // _MAX_QUERY_BLOCKS))


def _causal_blocks(q_BxNxTxH, k_BxNxSxH, v_BxNxSxH, offset: int, visible, sinks_N=None, reach: int | None = None):
    """Each block of queries over the keys up to its last (query t at key slot offset + t), as
    `visible(start, end)` (B, end - start, offset + end) lets it see them. With `reach`, no query sees
    a key `reach` or more slots before it: a block reads none of those."""
    T = q_BxNxTxH.shape[2]
    block = causal_block(T)
    outs = []
    for start in range(0, T, block):
        end = min(start + block, T)
        first = 0 if reach is None else max(0, offset + start - reach + 1)
        outs.append(_softmax_attention(q_BxNxTxH[:, :, start:end], k_BxNxSxH[:, :, first:offset + end],
                                       v_BxNxSxH[:, :, first:offset + end], visible(start, end)[..., first:], sinks_N))
    return jnp.concatenate(outs, axis=2)


def prefixed_attention(q_BxTxNxH, k_GxPxKxH, v_GxPxKxH, mask_GxP, k_BxTxKxH, v_BxTxKxH, mask_BxT, sinks_N=None,
                       sliding: int | None = None):
    """Queries of B = G * n rows, row b continuing prefix b // n, over that prefix's real keys and over
    their own up to themselves, with one softmax over both (cascade attention). The n rows, queries
    and query heads of one KV head are the rows of one matmul against their prefix's keys, which are
    read once for the group: repeated to each row, they and their gradient (summed back over the
    rows) were copied n times (docs/benchmarks.md). Blocks of queries see their own keys up to their
    last query, as in `causal_attention`. `sinks_N` and `sliding` as there: the prefix (left-padded)
    and the row (right-padded) are one sequence, prefix slot p at P - p slots before the row's first."""
    B, T, N, H = q_BxTxNxH.shape
    K = k_GxPxKxH.shape[2]
    q_BxTxNxH = q_BxTxNxH * np.float32(1 / math.sqrt(H)).astype(q_BxTxNxH.dtype)
    k_GxKxPxH, v_GxKxPxH = k_GxPxKxH.transpose(0, 2, 1, 3), v_GxPxKxH.transpose(0, 2, 1, 3)
    k_BxNxTxH = jnp.repeat(k_BxTxKxH, N // K, axis=2).transpose(0, 2, 1, 3)
    v_BxNxTxH = jnp.repeat(v_BxTxKxH, N // K, axis=2).transpose(0, 2, 1, 3)
    block = causal_block(T)
    outs = []
    for start in range(0, T, block):
        first = 0 if sliding is None else max(0, start - sliding + 1)
        outs.append(_prefixed_block(q_BxTxNxH[:, start:start + block], k_GxKxPxH, v_GxKxPxH, mask_GxP,
                                    k_BxNxTxH[:, :, first:start + block], v_BxNxTxH[:, :, first:start + block],
                                    mask_BxT[:, first:], start, first, sinks_N, sliding))
    return jnp.concatenate(outs, axis=1)


def _prefixed_block(q_BxQxNxH, k_GxKxPxH, v_GxKxPxH, mask_GxP, k_BxNxSxH, v_BxNxSxH, mask_BxT, start: int,
                    first: int, sinks_N, sliding: int | None):
    """`prefixed_attention` of the (scaled) queries at start.. over their prefix and own keys first.."""
    B, Q, N, H = q_BxQxNxH.shape
    G, K, P, _ = k_GxKxPxH.shape
    n, g, S = B // G, N // K, k_BxNxSxH.shape[2]
    fill = jnp.finfo(jnp.float32).min
    q_GxKxRxH = q_BxQxNxH.reshape(G, n, Q, K, g, H).transpose(0, 3, 1, 2, 4, 5).reshape(G, K, n * Q * g, H)
    prefix_GxKxRxP = jnp.einsum("gkrh,gkph->gkrp", q_GxKxRxH, k_GxKxPxH, preferred_element_type=jnp.float32)
    prefix_GxKxnxQxgxP = jnp.where(mask_GxP[:, None, None], prefix_GxKxRxP, fill).reshape(G, K, n, Q, g, P)
    query_Qx1 = start + jnp.arange(Q)[:, None]
    if sliding is not None:
        # Prefix slot p is P - p slots before the row's first token.
        near_QxP = jnp.arange(P)[None] - P > query_Qx1 - sliding
        prefix_GxKxnxQxgxP = jnp.where(near_QxP[:, None], prefix_GxKxnxQxgxP, fill)
    own_BxNxQxS = jnp.einsum("bnqh,bnsh->bnqs", q_BxQxNxH.transpose(0, 2, 1, 3), k_BxNxSxH,
                             preferred_element_type=jnp.float32)
    key_1xS = first + jnp.arange(S)[None]
    visible_QxS = key_1xS <= query_Qx1
    if sliding is not None:
        visible_QxS &= key_1xS > query_Qx1 - sliding
    visible_BxQxS = visible_QxS[None] & mask_BxT[:, None, :S]
    own_BxNxQxS = jnp.where(visible_BxQxS[:, None], own_BxNxQxS, fill)

    def rows(x_GxKxnxQxg):
        return x_GxKxnxQxg.transpose(0, 2, 1, 4, 3).reshape(B, N, Q)

    def groups(x_BxNxQ):
        return x_BxNxQ.reshape(G, n, K, g, Q).transpose(0, 2, 1, 4, 3)

    # The softmax written out over the two parts (and the sink); its max only keeps exp in range.
    max_BxNxQ = jnp.maximum(rows(prefix_GxKxnxQxgxP.max(-1)), own_BxNxQxS.max(-1))
    if sinks_N is not None:
        sink_1xNx1 = _head_sinks(sinks_N, max_BxNxQ.shape)
        max_BxNxQ = jnp.maximum(max_BxNxQ, sink_1xNx1)
    max_BxNxQ = jax.lax.stop_gradient(max_BxNxQ)
    prefix_e = jnp.exp(prefix_GxKxnxQxgxP - groups(max_BxNxQ)[..., None])
    own_e = jnp.exp(own_BxNxQxS - max_BxNxQ[..., None])
    total_BxNxQ = rows(prefix_e.sum(-1)) + own_e.sum(-1)
    if sinks_N is not None:
        total_BxNxQ += jnp.exp(sink_1xNx1 - max_BxNxQ)
    out_GxKxRxH = jnp.einsum("gkrp,gkph->gkrh", prefix_e.reshape(G, K, n * Q * g, P).astype(v_GxKxPxH.dtype),
                             v_GxKxPxH)
    out_BxQxNxH = out_GxKxRxH.reshape(G, K, n, Q, g, H).transpose(0, 2, 3, 1, 4, 5).reshape(B, Q, N, H)
    out_BxQxNxH += jnp.einsum("bnqs,bnsh->bnqh", own_e.astype(v_BxNxSxH.dtype), v_BxNxSxH).transpose(0, 2, 1, 3)
    return (out_BxQxNxH / total_BxNxQ.transpose(0, 2, 1)[..., None]).astype(q_BxQxNxH.dtype)


def packed_windows(length: int) -> tuple[int, ...]:
    """Key windows the query blocks of a packed row may be limited to: powers of two from two
    query blocks, and the whole row."""
    windows, w = [], 2 * QUERY_BLOCK
    while w < length:
        windows.append(w)
        w *= 2
    return (*windows, length)


def prefix_window(window: int, length: int) -> int:
    """Keys of a query block's prefix segment (its group's shared prompt) read apart from its
    window, where they lie before it: a quarter of the window, at least a query block; none where
    the window is the whole row. Tied to the window so that the windows stay one short list."""
    return 0 if window >= length else max(QUERY_BLOCK, window // 4)


def window_keys(window: int, length: int) -> float:
    """Keys a query of a packed row reads on average at `window` (of `packed_windows(length)`):
    its window and prefix window, or, where that is no fewer, the causal blocks' share of the
    whole row, which `packed_attention` then runs instead."""
    return min(window + prefix_window(window, length), (length + causal_block(length)) / 2)


def _segment_causal_attention(q_BxNxTxH, k_BxNxTxH, v_BxNxTxH, segments_BxT, prefix_BxT, positions_BxT, sinks_N,
                              sliding):
    """Packed rows' attention over the whole row in `causal_attention`'s blocks, a query seeing the
    keys at or before it of its own segment and of its prefix segment: half the keys of
    `_segment_window_attention` at the whole row, in static slices (docs/benchmarks.md)."""
    def visible(start, end):
        seg_q, pre_q = segments_BxT[:, start:end, None], prefix_BxT[:, start:end, None]
        seg_k = segments_BxT[:, None, :end]
        causal_QxS = jnp.arange(end)[None, :] <= jnp.arange(start, end)[:, None]
        seen = causal_QxS[None] & ((seg_q == seg_k) | (pre_q == seg_k)) & (seg_q > 0)
        if sliding is not None:
            seen &= positions_BxT[:, start:end, None] - positions_BxT[:, None, :end] < sliding
        return seen

    return _causal_blocks(q_BxNxTxH, k_BxNxTxH, v_BxNxTxH, 0, visible, sinks_N)


def _segment_window_attention(q_BxNxTxH, k_BxNxTxH, v_BxNxTxH, segments_BxT, prefix_BxT, positions_BxT, sinks_N,
                              sliding, window: int, prefix_keys: int):
    """Each block of QUERY_BLOCK queries against the `window` keys that end with it, a query
    seeing the keys at or before it of its own segment and of its prefix segment: the work is
    T x window, not T x T. With `prefix_keys`, each block also reads that many keys from the start
    of its queries' prefix segment (one per block: a group starts at a block's start), the ones
    before its window, so a completion far from its prompt still sees all of it."""
    B, N, T, H = q_BxNxTxH.shape
    Q = QUERY_BLOCK
    # Keys padded in front (segment 0: never visible), so every block's window is one slice.
    front = ((0, 0), (0, 0), (window, 0), (0, 0))
    k_pad, v_pad = jnp.pad(k_BxNxTxH, front), jnp.pad(v_BxNxTxH, front)
    seg_pad = jnp.pad(segments_BxT, ((0, 0), (window, 0)))
    pos_pad = None if sliding is None else jnp.pad(positions_BxT, ((0, 0), (window, 0)))
    # Key j of a block's window sits j + QUERY_BLOCK - window slots after the block's first query.
    causal_QxW = jnp.arange(window)[None, :] + Q - window <= jnp.arange(Q)[:, None]
    # Each block's prefix segment (0: none) and the padded slot its keys are read from (its first).
    foreign_BxT = (prefix_BxT != segments_BxT) & (segments_BxT > 0)
    pid_BxZ = jnp.where(foreign_BxT, prefix_BxT, 0).reshape(B, T // Q, Q).max(-1)
    first_BxZ = jnp.argmax(segments_BxT[:, None] == pid_BxZ[..., None], axis=-1)
    from_BxZ = jnp.minimum(first_BxZ + window, T + window - prefix_keys).astype(jnp.int32)
    take = jax.vmap(functools.partial(jax.lax.dynamic_slice_in_dim, slice_size=prefix_keys, axis=-2))

    def near(pos_q, pos_k):
        """Where the keys at positions pos_k (B, X) lie within the queries' (B, Q) sliding window."""
        return pos_q[:, :, None] - pos_k[:, None, :] < sliding

    def block(xs):
        start, from_B = xs
        q = jax.lax.dynamic_slice_in_dim(q_BxNxTxH, start, Q, axis=2)
        k = jax.lax.dynamic_slice_in_dim(k_pad, start + Q, window, axis=2)
        v = jax.lax.dynamic_slice_in_dim(v_pad, start + Q, window, axis=2)
        seg_q = jax.lax.dynamic_slice_in_dim(segments_BxT, start, Q, axis=1)
        pre_q = jax.lax.dynamic_slice_in_dim(prefix_BxT, start, Q, axis=1)
        seg_k = jax.lax.dynamic_slice_in_dim(seg_pad, start + Q, window, axis=1)
        seen_BxQxW = (seg_q[:, :, None] == seg_k[:, None, :]) | (pre_q[:, :, None] == seg_k[:, None, :])
        visible_BxQxW = causal_QxW[None] & seen_BxQxW & (seg_q[:, :, None] > 0)
        if sliding is not None:
            pos_q = jax.lax.dynamic_slice_in_dim(positions_BxT, start, Q, axis=1)
            visible_BxQxW &= near(pos_q, jax.lax.dynamic_slice_in_dim(pos_pad, start + Q, window, axis=1))
        if prefix_keys:
            slot_BxP = from_B[:, None] + jnp.arange(prefix_keys)
            seg_p = jnp.take_along_axis(seg_pad, slot_BxP, axis=1)
            # Only the prefix keys before the window: the window already holds the others.
            visible_BxQxP = ((pre_q[:, :, None] == seg_p[:, None, :]) & (slot_BxP < start + Q)[:, None]
                             & (seg_q != pre_q)[:, :, None])
            if sliding is not None:
                visible_BxQxP &= near(pos_q, jnp.take_along_axis(pos_pad, slot_BxP, axis=1))
            k = jnp.concatenate([take(k_pad, from_B), k], axis=2)
            v = jnp.concatenate([take(v_pad, from_B), v], axis=2)
            visible_BxQxW = jnp.concatenate([visible_BxQxP, visible_BxQxW], axis=2)
        return _softmax_attention(q, k, v, visible_BxQxW, sinks_N)

    out_ZxBxNxQxH = jax.lax.map(block, (jnp.arange(0, T, Q), from_BxZ.T))
    return out_ZxBxNxQxH.transpose(1, 2, 0, 3, 4).reshape(B, N, T, H)


def packed_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segments_BxT, prefix_BxT, window, sinks_N=None,
                     sliding: int | None = None, positions_BxT=None):
    """Causal attention within segments of packed rows (T a multiple of QUERY_BLOCK), a query also
    seeing its prefix segment (a group's shared prompt; its own segment otherwise), each query block
    over `packed_windows(T)[window]` keys and `prefix_window` of its prefix's (enough for the longest
    segment and prefix of the batch), or over the keys up to it where that reads no more. `sinks_N` as
    in `causal_attention`; with `sliding`, a query sees only keys fewer than `sliding` positions before
    it (`positions_BxT`: a completion's keys follow its prompt's in positions, not in slots)."""
    B, T, N, H = q_BxTxNxH.shape
    G = N // k_BxTxKxH.shape[2]
    q = q_BxTxNxH.transpose(0, 2, 1, 3)
    k = jnp.repeat(k_BxTxKxH, G, axis=2).transpose(0, 2, 1, 3)
    v = jnp.repeat(v_BxTxKxH, G, axis=2).transpose(0, 2, 1, 3)
    # window_keys grows with the window: the windows that read fewer keys than the whole row come first.
    narrower = [w for w in packed_windows(T) if window_keys(w, T) < window_keys(T, T)]
    branches = [functools.partial(_segment_window_attention, sliding=sliding, window=w,
                                  prefix_keys=prefix_window(w, T)) for w in narrower]
    branches.append(functools.partial(_segment_causal_attention, sliding=sliding))
    out = jax.lax.switch(jnp.minimum(window, len(narrower)), branches, q, k, v, segments_BxT, prefix_BxT,
                         positions_BxT, sinks_N)
    return out.transpose(0, 2, 1, 3)


def cached_attention(q_BxTxNxH, k_BxKxHxS, v_BxKxSxH, visible_BxTxS, sinks_N=None):
    """Queries over a KV cache; the G query heads of a KV head and the T queries form the rows of
    one matmul per (batch, KV head), so the cache is read in place, never copied per query head.
    `sinks_N` as in `causal_attention`."""
    B, T, N, H = q_BxTxNxH.shape
    K = k_BxKxHxS.shape[1]
    q_BxKxGTxH = q_BxTxNxH.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4).reshape(B, K, -1, H)
    scores = jnp.einsum("bkqh,bkhs->bkqs", q_BxKxGTxH, k_BxKxHxS, preferred_element_type=jnp.float32)
    scores = scores.reshape(B, K, N // K, T, -1) / np.float32(math.sqrt(H))
    scores = jnp.where(visible_BxTxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
    if sinks_N is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        probs = softmax_with_sink(scores, sinks_N.astype(jnp.float32).reshape(1, K, N // K, 1, 1))[0]
    probs = probs.astype(v_BxKxSxH.dtype).reshape(B, K, N // K * T, -1)
    out_BxKxGTxH = jnp.einsum("bkqs,bksh->bkqh", probs, v_BxKxSxH)
    return out_BxKxGTxH.reshape(B, K, N // K, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


class SharedPrefix(NamedTuple):
    """Keys and values that groups of cache rows all continue (a GRPO group's prompt), held once per
    group: row b continues prefix group_B[b], whose first length_U[u] slots are real, and is row
    rank_B[b] of the group's members_Uxn (padding entries: any row, unused)."""

    # Per layer, heads before slots as a KVCache's; None for a sliding layer (its ring holds its window).
    k_UxKxHxP: tuple[jax.Array | None, ...]
    v_UxKxPxH: tuple[jax.Array | None, ...]
    length_U: jax.Array  # int32
    members_Uxn: jax.Array  # int32
    group_B: jax.Array  # int32
    rank_B: jax.Array  # int32


def shared_prefix_attention(q_BxTxNxH, k_BxKxHxS, v_BxKxSxH, visible_BxTxS, k_UxKxHxP, v_UxKxPxH,
                            shared: SharedPrefix, sinks_N=None):
    """Queries over their group's prefix and then their own cache row, with one softmax over both
    (cascade attention). A group's rows, queries and query heads are the rows of one matmul against
    its prefix, so the prefix is read once per group, not once per row; the two parts' softmaxes are
    merged by their maxima and sums. `sinks_N` as in `causal_attention`. Full layers only: a sliding
    layer's ring holds the whole window of its row (`ring_attention`)."""
    B, T, N, H = q_BxTxNxH.shape
    K, (U, n), P = k_BxKxHxS.shape[1], shared.members_Uxn.shape, k_UxKxHxP.shape[-1]
    g = N // K
    R = g * T
    scale, fill = np.float32(1 / math.sqrt(H)), jnp.finfo(jnp.float32).min
    q_BxKxRxH = q_BxTxNxH.reshape(B, T, K, g, H).transpose(0, 2, 3, 1, 4).reshape(B, K, R, H)

    def part(scores, visible, v_xKxSxH):
        """One part's unnormalised output, max and sum of exp, (., K, rows, .), of its masked scores."""
        max_ = jnp.max(jnp.where(visible, scores, fill), -1, keepdims=True)
        e = jnp.where(visible, jnp.exp(scores - max_), 0)
        rows = (*v_xKxSxH.shape[:2], -1)
        out = jnp.einsum("xkrs,xksh->xkrh", e.reshape(*rows, e.shape[-1]).astype(v_xKxSxH.dtype), v_xKxSxH,
                         preferred_element_type=jnp.float32)
        return out, max_.reshape(*rows, 1), e.sum(-1).reshape(*rows, 1)

    own = jnp.einsum("bkrh,bkhs->bkrs", q_BxKxRxH, k_BxKxHxS, preferred_element_type=jnp.float32) * scale
    own_out, own_max, own_sum = part(own.reshape(B, K, g, T, -1), visible_BxTxS[:, None, None], v_BxKxSxH)
    q_UxKxMxH = q_BxKxRxH[shared.members_Uxn].transpose(0, 2, 1, 3, 4).reshape(U, K, n * R, H)
    pre = jnp.einsum("ukmh,ukhp->ukmp", q_UxKxMxH, k_UxKxHxP, preferred_element_type=jnp.float32) * scale
    # Rows M = (member, query head, query): masks of (U, 1, n, 1, T, P) broadcast over the heads.
    real_Ux1x1x1x1xP = (jnp.arange(P) < shared.length_U[:, None])[:, None, None, None, None]
    # Back to rows: (U, K, n, R, .) indexed by (group, rank) gives (B, K, R, .).
    pre_out, pre_max, pre_sum = (x.reshape(U, K, n, R, -1)[shared.group_B, :, shared.rank_B]
                                 for x in part(pre.reshape(U, K, n, g, T, P), real_Ux1x1x1x1xP, v_UxKxPxH))
    max_ = jnp.maximum(own_max, pre_max)
    if sinks_N is not None:
        # Row r of a KV head's rows is query head r // T of its group.
        sink_1xKxRx1 = jnp.repeat(sinks_N.astype(jnp.float32).reshape(K, g), T, axis=1)[None, :, :, None]
        max_ = jnp.maximum(max_, sink_1xKxRx1)
    own_w, pre_w = jnp.exp(own_max - max_), jnp.exp(pre_max - max_)
    total = own_sum * own_w + pre_sum * pre_w
    if sinks_N is not None:
        total += jnp.exp(sink_1xKxRx1 - max_)
    # A row that sees nothing (a free slot of the batch) gets 0, not 0 / 0.
    out_BxKxRxH = (own_out * own_w + pre_out * pre_w) / jnp.where(total > 0, total, 1)
    out = out_BxKxRxH.reshape(B, K, g, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)
    return out.astype(q_BxTxNxH.dtype)


def ring_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, ring_k_BxKxHxR, ring_v_BxKxRxH, ring: RingSlots, sinks_N=None):
    """A sliding layer's queries over its ring cache and their own keys (`RingSlots`), one softmax over both:
    (output, the ring's keys and values with the new ones written)."""
    ring_k, ring_v = _write_ring(ring_k_BxKxHxR, ring_v_BxKxRxH, k_BxTxKxH, v_BxTxKxH, ring.write_BxT)
    if ring.own_BxTxT is None:
        return cached_attention(q_BxTxNxH, ring_k, ring_v, ring.visible_BxTxR, sinks_N), (ring_k, ring_v)
    # In the cache's dtype, as a later call reads them.
    k_BxKxHxS = jnp.concatenate([ring_k_BxKxHxR, k_BxTxKxH.transpose(0, 2, 3, 1).astype(ring_k.dtype)], -1)
    v_BxKxSxH = jnp.concatenate([ring_v_BxKxRxH, v_BxTxKxH.transpose(0, 2, 1, 3).astype(ring_v.dtype)], 2)
    visible_BxTxS = jnp.concatenate([ring.visible_BxTxR, ring.own_BxTxT], -1)
    return cached_attention(q_BxTxNxH, k_BxKxHxS, v_BxKxSxH, visible_BxTxS, sinks_N), (ring_k, ring_v)


def attention_windows(slots: int, smallest: int = 128) -> tuple[int, ...]:
    """Cache prefixes a query may be limited to, halving from the whole cache down to `smallest`."""
    windows = [slots]
    while windows[0] // 2 >= smallest:
        windows.insert(0, windows[0] // 2)
    return tuple(windows)


def key_windows(slots: int, most: int = 8, align: int = 64) -> tuple[int, ...]:
    """Cache prefixes one program's attention switches between: evenly spaced, multiples of `align`,
    at most `most` of them (each is a branch of every layer's attention to compile), so that the
    keys read past the slots in use are under one step, not up to the whole as with halving."""
    step = align * -(-slots // (most * align))
    return tuple(range(step, slots, step)) + (slots,)


def windowed_cached_attention(q_BxTxNxH, k_BxKxHxS, v_BxKxSxH, visible_BxTxS, window, sinks_N=None):
    """`cached_attention` over the first key_windows(S)[window] slots only: a prefill chunk reads
    the slots in use (within a step), not the whole cache, whose width is fixed."""
    windows = key_windows(v_BxKxSxH.shape[2])

    def over(w):
        return lambda: cached_attention(q_BxTxNxH, k_BxKxHxS[..., :w], v_BxKxSxH[:, :, :w], visible_BxTxS[..., :w],
                                        sinks_N)

    return jax.lax.switch(window, [over(w) for w in windows])


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, f, ("embed", "mlp"), cfg.mlp_bias, cfg, rngs)
        self.up_proj = Linear(d, f, ("embed", "mlp"), cfg.mlp_bias, cfg, rngs)
        self.down_proj = Linear(f, d, ("mlp", "embed"), cfg.mlp_bias, cfg, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nnx.Module):
    """A mixture of experts: a linear router picks each token's top-k experts (`jaxrl.models.moe.route`),
    each a gated MLP; the experts' weights are stacked, gate and up fused: (E, D, 2I) and (E, I, D).

    gpt-oss's fused gate/up interleaves gate and up columns (transformers' layout): it is kept so and read
    strided by its activation (`moe.clamped_swiglu`). Snapshots, `hf_names` and `params_from_hf_tensors`
    map a tensor to a parameter by name and at most a transpose; a de-interleaved copy would need a
    permutation at each of those edges (snapshots, engines' reloads, export)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.router = Linear(d, e, ("embed", None), cfg.router_bias, cfg, rngs)
        self.gate_up = _param(rngs, (e, d, 2 * f), ("expert", "embed", "mlp"), cfg, "normal")
        self.down = _param(rngs, (e, f, d), ("expert", "mlp", "embed"), cfg, "normal")
        self.gate_up_bias = _param(rngs, (e, 2 * f), ("expert", "mlp"), cfg, "zeros") if cfg.expert_bias else None
        self.down_bias = _param(rngs, (e, d), ("expert", "embed"), cfg, "zeros") if cfg.expert_bias else None
        self.top_k, self.norm_topk, self.dtype = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.jnp_dtype
        self.scoring = cfg.router_scoring
        self.activation = (cfg.expert_activation, cfg.swiglu_limit, cfg.swiglu_alpha)

    def __call__(self, x_BxTxD, mask_BxT, replay_BxTxK=None):
        """(output, the router's own top-k (B, T, K), its statistics over the tokens where mask_BxT holds)."""
        B, T, D = x_BxTxD.shape
        x_NxD = x_BxTxD.reshape(B * T, D).astype(self.dtype)
        logits_NxE = self.router(x_NxD)
        replay = None if replay_BxTxK is None else replay_BxTxK.reshape(B * T, -1)
        experts, weights, own = moe.route(logits_NxE, self.top_k, self.scoring, self.norm_topk, replay)
        biases = [None if b is None else b[...].astype(self.dtype) for b in (self.gate_up_bias, self.down_bias)]
        y_NxD = moe.experts_forward(x_NxD, experts, weights, self.gate_up[...].astype(self.dtype),
                                    self.down[...].astype(self.dtype), moe.expert_activation(*self.activation),
                                    *biases, mesh=jax.sharding.get_abstract_mesh())
        stats = moe.router_stats(logits_NxE, own, mask_BxT.reshape(-1))
        return y_NxD.reshape(B, T, D), own.reshape(B, T, -1), stats


class Routed(NamedTuple):
    """What the MoE layers of a forward pass did: each token's route by its routers' own top-k (U = MoE
    layers x top-k, layer by layer) and the load-balancing statistics over its real tokens."""

    own_BxTxU: jax.Array  # int32
    stats: moe.RouterStats


def _routed(parts: list) -> Routed | None:
    """The `Routed` of one forward pass from its MoE layers' (own route, stats); None without MoE layers."""
    if not parts:
        return None
    return Routed(jnp.concatenate([own for own, _ in parts], -1), moe.sum_stats([stats for _, stats in parts]))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int = 0):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.self_attn = Attention(cfg, rngs, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.mlp = MoE(cfg, rngs) if cfg.is_moe(layer) else MLP(cfg, rngs)

    def _mlp(self, x, mask, replay, parts: list):
        """The MLP's output; an MoE layer appends its (own route, stats) to `parts`."""
        if not isinstance(self.mlp, MoE):
            return self.mlp(x)
        y, own, stats = self.mlp(x, mask, replay)
        parts.append((own, stats))
        return y

    def __call__(self, x, rope, keys, layer_cache, replay=None, parts: list | None = None):
        attn, kv = self.self_attn(self.input_layernorm(x), rope, keys, layer_cache)
        x = x + attn
        mask = keys.mask_BxT if keys.segments_BxT is None else keys.segments_BxT > 0
        return x + self._mlp(self.post_attention_layernorm(x), mask, replay, [] if parts is None else parts), kv

    def prefixed(self, x_GxPxD, x_BxTxD, rope_GxP, rope_BxT, mask_GxP, mask_BxT, replay_p=None, replay=None,
                 parts_p: list | None = None, parts: list | None = None):
        """The layer over G prefixes and the B rows continuing them (see `Attention.prefixed`)."""
        attn_p, attn = self.self_attn.prefixed(self.input_layernorm(x_GxPxD), self.input_layernorm(x_BxTxD),
                                               rope_GxP, rope_BxT, mask_GxP, mask_BxT)
        x_GxPxD, x_BxTxD = x_GxPxD + attn_p, x_BxTxD + attn
        return (x_GxPxD + self._mlp(self.post_attention_layernorm(x_GxPxD), mask_GxP, replay_p,
                                    [] if parts_p is None else parts_p),
                x_BxTxD + self._mlp(self.post_attention_layernorm(x_BxTxD), mask_BxT, replay,
                                    [] if parts is None else parts))


class _KeySlots(NamedTuple):
    mask_BxT: jax.Array  # True on real tokens
    start_B: jax.Array | None  # with a cache: each row's slot of its first new token
    visible_BxTxS: jax.Array | None  # with a cache: query t may attend to key slot s
    # With a cache: the key_windows entry that holds every visible slot (None: the whole cache);
    # packed: the packed_windows one.
    window: jax.Array | None = None
    segments_BxT: jax.Array | None = None  # packed rows: each token's segment (0: padding)
    prefix_BxT: jax.Array | None = None  # packed rows: the other segment each token sees (a shared prompt)
    shared: SharedPrefix | None = None  # with a cache: each row's group prefix, before its cache row
    positions_BxT: jax.Array | None = None  # packed rows of a model with sliding layers: each token's position
    ring: RingSlots | None = None  # with a cache and sliding layers: their rings' slots


class Decoder(nnx.Module):
    """Causal LM. `__call__` returns logits; `hidden` + `logits` let callers chunk the head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg, "normal")
        self.layers = nnx.List([DecoderLayer(cfg, rngs, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg, "normal")
        )

    def _replays(self, replay_BxTxU) -> list:
        """Each layer's slice of a replayed route (None for dense layers, or without one)."""
        K, replays, j = self.cfg.num_experts_per_tok, [None] * self.cfg.num_layers, 0
        if replay_BxTxU is None:
            return replays
        for i in self.cfg.moe_layers:
            replays[i], j = replay_BxTxU[..., j:j + K], j + K
        return replays

    def hidden(self, tokens_BxT, positions_BxT, mask_BxT, cache: KVCache | None = None, windowed: bool = True,
               shared: SharedPrefix | None = None, replay_BxTxU=None, routed: bool = False):
        """Final normed hidden states (B, T, D) and the updated cache (and `Routed` with `routed`).

        mask_BxT is 1 on real tokens and 0 on padding. Without a cache, causality follows slot
        order (left padding is the usual layout) and positions only drive RoPE. With a cache the
        new tokens are right-padded (each row's real ones first, at positions length_B + t): they
        are written at slots [length_B, length_B + T), each attends to the slots up to its own,
        and a row's length grows by its real tokens (the padding's slots are overwritten later).
        The cache needs T free slots past every row's length. Queries attend over the smallest
        of `key_windows` that holds the slots in use, or with `windowed=False` over the whole cache
        (a caller that already cut the cache to what it uses: a window's slice is a copy). With `shared`,
        each cache row continues its group's prefix (`shared_prefix_attention`): its slots come after
        the prefix's, positions count from the prefix's start, and the whole cache is read. A sliding
        layer's ring (`RingSlots`) holds the last tokens of the whole sequence, prefix included: it
        writes only real tokens and is always read whole.
        """
        B, T = tokens_BxT.shape
        mask_BxT = mask_BxT.astype(bool)
        if cache is None:
            keys = _KeySlots(mask_BxT, None, None)
        else:
            # A full layer's slots (a model of sliding layers only reads none of what they shape).
            full = next((i for i in range(self.cfg.num_layers) if self.cfg.sliding(i) is None), 0)
            slots = cache.v_BxKxSxH[full].shape[2]
            query_slot_BxTx1 = (cache.length_B[:, None] + jnp.arange(T))[:, :, None]
            windows = key_windows(slots)
            window = jnp.minimum(jnp.searchsorted(jnp.asarray(windows), jnp.max(cache.length_B) + T),
                                 len(windows) - 1) if windowed and shared is None else None
            visible_BxTxS = jnp.arange(slots) <= query_slot_BxTx1
            ring = None
            if self.cfg.sliding_layers:
                # Rings count whole sequences: a row's slots come after its group prefix's length_U.
                start_B = cache.length_B if shared is None else cache.length_B + shared.length_U[shared.group_B]
                ring = RingSlots.of(start_B, mask_BxT, cache.v_BxKxSxH[self.cfg.sliding_layers[0]].shape[2],
                                    self.cfg.sliding_window)
            keys = _KeySlots(mask_BxT, cache.length_B, visible_BxTxS, window, shared=shared, ring=ring)

        x = self._embed(tokens_BxT)
        rope = rope_tables(positions_BxT, self.cfg)
        new_k, new_v, parts = [], [], []
        for i, (layer, replay) in enumerate(zip(self.layers, self._replays(replay_BxTxU))):
            x, kv = layer(x, rope, keys,
                          None if cache is None else (cache.k_BxKxHxS[i], cache.v_BxKxSxH[i])
                          + (() if shared is None else (shared.k_UxKxHxP[i], shared.v_UxKxPxH[i])), replay, parts)
            if cache is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
        if cache is not None:
            routes = cache.routes_BxSxU
            if routes is not None:
                routes = _write_route_rows(routes, _routed(parts).own_BxTxU, cache.length_B)
            cache = KVCache(tuple(new_k), tuple(new_v), cache.length_B + mask_BxT.sum(-1, dtype=jnp.int32), routes)
        return (self.norm(x), cache, _routed(parts)) if routed else (self.norm(x), cache)

    def packed_hidden(self, tokens_RxL, positions_RxL, segments_RxL, prefix_RxL, window, replay_RxLxU=None,
                      routed: bool = False):
        """Final normed hidden states (R, L, D) of packed rows (and `Routed` with `routed`): segments
        (numbered from 1 in each row, 0 for padding) attend within themselves and to their prefix segment
        (a shared prompt before them; their own where they have none), each query block over
        `packed_windows(L)[window]` keys."""
        keys = _KeySlots(segments_RxL > 0, None, None, window, segments_RxL, prefix_RxL,
                         positions_BxT=positions_RxL if self.cfg.sliding_layers else None)
        x = self._embed(tokens_RxL)
        rope = rope_tables(positions_RxL, self.cfg)
        parts = []
        for layer, replay in zip(self.layers, self._replays(replay_RxLxU)):
            x, _ = layer(x, rope, keys, None, replay, parts)
        return (self.norm(x), _routed(parts)) if routed else self.norm(x)

    def prefixed_hidden(self, prefix_GxP, prefix_mask_GxP, tokens_BxT, mask_BxT, replay_GxPxU=None, replay_BxTxU=None,
                        routed: bool = False):
        """`hidden` of B = G * n rows that share prefixes, each prefix computed once: row b is
        prefix b // n (left-padded) followed by its own tokens (right-padded, real ones first).
        Returns the prefixes' final normed hidden states (G, P, D) and the rows' (B, T, D) (and with
        `routed`, the prefixes' and the rows' `Routed`)."""
        G, B = prefix_GxP.shape[0], tokens_BxT.shape[0]
        prefix_mask_GxP, mask_BxT = prefix_mask_GxP.astype(bool), mask_BxT.astype(bool)
        positions_GxP = positions_from_mask(prefix_mask_GxP)
        positions_BxT = positions_from_mask(mask_BxT, jnp.repeat(prefix_mask_GxP.sum(-1, dtype=jnp.int32), B // G))
        rope_GxP, rope_BxT = rope_tables(positions_GxP, self.cfg), rope_tables(positions_BxT, self.cfg)
        x_GxPxD, x_BxTxD = self._embed(prefix_GxP), self._embed(tokens_BxT)
        parts_p, parts = [], []
        for layer, replay_p, replay in zip(self.layers, self._replays(replay_GxPxU), self._replays(replay_BxTxU)):
            x_GxPxD, x_BxTxD = layer.prefixed(x_GxPxD, x_BxTxD, rope_GxP, rope_BxT, prefix_mask_GxP, mask_BxT,
                                              replay_p, replay, parts_p, parts)
        if routed:
            return self.norm(x_GxPxD), self.norm(x_BxTxD), _routed(parts_p), _routed(parts)
        return self.norm(x_GxPxD), self.norm(x_BxTxD)

    def _embed(self, tokens_BxT):
        return jnp.take(self.embed_tokens[...], tokens_BxT, axis=0).astype(self.cfg.jnp_dtype)

    def head_weight(self):
        """The (D, V) output projection: the embedding's transpose when tied."""
        return self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]

    def logits(self, h_BxTxD):
        return head_logits(h_BxTxD, self.head_weight())

    def __call__(self, tokens_BxT, positions_BxT, mask_BxT, cache: KVCache | None = None, windowed: bool = True,
                 shared: SharedPrefix | None = None, replay_BxTxU=None, routed: bool = False):
        out = self.hidden(tokens_BxT, positions_BxT, mask_BxT, cache, windowed, shared, replay_BxTxU, routed)
        return (self.logits(out[0]), *out[1:])


def head_logits(h_BxTxD, w_DxV):
    """Float32 logits of hidden states under the output projection."""
    return matmul_2d(h_BxTxD, w_DxV.astype(h_BxTxD.dtype), preferred_element_type=jnp.float32)


def positions_from_mask(mask_BxT, offset_B=None):
    """Positions counting only real tokens (left padding gets position 0)."""
    pos = jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)
    return pos if offset_B is None else pos + offset_B[:, None]
