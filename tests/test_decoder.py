"""Decoder logits against transformers' PyTorch models, and KV-cache decoding against full passes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxrl.models import Decoder, KVCache, YarnScaling, load_pretrained, positions_from_mask
from jaxrl.models.decoder import SharedPrefix, cached_attention, causal_attention, packed_attention, \
    packed_windows, prefixed_attention, shared_prefix_attention
from jaxrl.tiny import tiny_config

VOCAB = 300

VARIANTS = [
    ("llama", dict()),
    ("llama", dict(qkv_bias=True, o_bias=True, mlp_bias=True)),
    ("qwen2", dict()),
    ("qwen3", dict()),
    ("qwen3", dict(num_layers=3, num_kv_heads=1)),
    # Qwen3's long-context YaRN: a ramp over dimensions 0-5 at this head size, attention factor 1.14
    ("qwen3", dict(rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=64))),
    ("qwen3_moe", dict()),
    ("qwen3_moe", dict(num_layers=3, norm_topk_prob=True, mlp_only_layers=(1,), num_experts_per_tok=3)),
    ("qwen3_moe", dict(num_layers=4, decoder_sparse_step=2)),
    ("gpt_oss", dict()),  # YaRN, sinks, layer 0 sliding over 4 keys, biased router and experts
    # MQA; layers 1 and 2 sliding over 3 keys; a clamp the SwiGLU's inputs reach
    ("gpt_oss", dict(num_layers=3, num_kv_heads=1, sliding_window=3, sliding_layers=(1, 2), swiglu_limit=0.5)),
]


def _hf_model_dir(tmp_path, family, tied, overrides, seed=0):
    """A transformers model with every weight (norms and biases too) randomised, saved to disk."""
    cfg = tiny_config(family, tied=tied, vocab_size=VOCAB, **overrides)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return model.eval()


def _padded_batch(rng, lengths, total):
    tokens = rng.integers(0, VOCAB, (len(lengths), total))
    mask = np.zeros((len(lengths), total), np.int32)
    for b, n in enumerate(lengths):
        mask[b, total - n:] = 1
    return tokens * mask, mask


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family,overrides", VARIANTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(VARIANTS)])
def test_logits_match_transformers(tmp_path, family, overrides, tied):
    hf_model = _hf_model_dir(tmp_path, family, tied, overrides)
    model = load_pretrained(tmp_path)
    tokens, mask = _padded_batch(np.random.default_rng(0), [12, 7, 3], 12)
    positions = np.asarray(positions_from_mask(jnp.asarray(mask)))
    if model.cfg.rope_scaling is not None:
        # Far positions exercise every band of the frequency scaling.
        positions = positions + 5000
    ours, _ = model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))
    with torch.no_grad():
        ref = hf_model(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        ).logits.numpy()
    ours = np.asarray(ours)
    assert np.isfinite(ours).all(), "padding rows must stay finite (their gradients would be NaN)"
    valid = mask.astype(bool)
    assert np.abs(ref[valid]).max() > 0.5, "weights too small for a meaningful comparison"
    np.testing.assert_allclose(ours[valid], ref[valid], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family, slots", [("llama", 16), ("qwen2", 16), ("qwen3", 16), ("qwen3", 512),
                                           ("qwen3_moe", 16), ("gpt_oss", 16), ("gpt_oss", 512)])
def test_cached_decoding_matches_full_forward(family, slots):
    """With 512 slots the queries attend to the smallest of key_windows (64 slots)."""
    cfg = tiny_config(family, vocab_size=VOCAB)
    model = Decoder(cfg, nnx.Rngs(1))
    rng = np.random.default_rng(1)
    lengths, steps, T = [6, 4, 1], 5, 6
    rows = [rng.integers(0, VOCAB, n + steps) for n in lengths]
    # Right-padded prompts: each row's tokens from slot 0, decoded from its own length on.
    prompt = np.zeros((3, T), np.int32)
    for b, (row, n) in enumerate(zip(rows, lengths)):
        prompt[b, :n] = row[:n]
    prompt_mask = (np.arange(T) < np.asarray(lengths)[:, None]).astype(np.int32)

    @nnx.jit
    def step(model, tokens, positions, mask, cache):
        return model(tokens, positions, mask, cache)

    cache = KVCache.empty(cfg, batch=3, max_len=slots)
    logits, cache = step(model, jnp.asarray(prompt), jnp.arange(T)[None].repeat(3, 0), jnp.asarray(prompt_mask), cache)
    got = [[logits[b, n - 1]] for b, n in enumerate(lengths)]
    for t in range(steps):
        tokens = np.asarray([[row[n + t]] for row, n in zip(rows, lengths)], np.int32)
        logits, cache = step(model, jnp.asarray(tokens), cache.length_B[:, None], jnp.ones((3, 1), jnp.int32), cache)
        for b in range(3):
            got[b].append(logits[b, 0])
    for b, (row, n) in enumerate(zip(rows, lengths)):
        expected, _ = model(jnp.asarray(row[None]), jnp.arange(len(row))[None], jnp.ones((1, len(row)), jnp.int32))
        np.testing.assert_allclose(np.asarray(got[b]), np.asarray(expected[0, n - 1:]), atol=1e-5, rtol=0)
    assert np.asarray(cache.length_B).tolist() == [n + steps for n in lengths]


def test_a_sliding_layers_cache_holds_its_window_and_decodes_as_a_full_forward():
    """gpt-oss sliding over 8 keys in layer 0 (layer 1 full), 40 tokens a row fed in calls of 1 to 12 tokens
    (right-padded, rows feeding different numbers, none at all in some calls, as an engine's rows that
    ended do): layer 0's cache is a ring of 8 slots, layer 1's all 48, and every fed token's logits are the
    full forward pass's."""
    cfg = tiny_config("gpt_oss", vocab_size=VOCAB, sliding_window=8)
    model = Decoder(cfg, nnx.Rngs(5))
    rng = np.random.default_rng(5)
    rows = rng.integers(0, VOCAB, (3, 40))
    cache = KVCache.empty(cfg, batch=3, max_len=48)
    assert [k.shape[-1] for k in cache.k_BxKxHxS] == [v.shape[2] for v in cache.v_BxKxSxH] == [8, 48]

    @nnx.jit
    def step(model, tokens, positions, mask, cache):
        return model(tokens, positions, mask, cache)

    # Tokens each row feeds per call (with 0s: the call's padding rows), each call as wide as its most.
    calls = [[5, 12, 1], [12, 3, 0], [1, 1, 1], [3, 9, 12], [0, 1, 7], [9, 6, 1], [1, 8, 10], [9, 0, 8]]
    fed, got = np.zeros(3, int), [[] for _ in range(3)]
    for counts in calls:
        T = max(counts)
        tokens, mask = np.zeros((3, T), np.int32), np.arange(T)[None] < np.asarray(counts)[:, None]
        for b, n in enumerate(counts):
            tokens[b, :n] = rows[b, fed[b]:fed[b] + n]
        logits, cache = step(model, jnp.asarray(tokens), jnp.asarray(fed[:, None] + np.arange(T)), jnp.asarray(mask),
                             cache)
        for b, n in enumerate(counts):
            got[b].extend(np.asarray(logits[b, :n]))
        fed += counts
    assert fed.tolist() == [40, 40, 40] and np.asarray(cache.length_B).tolist() == [40, 40, 40]
    expected, _ = model(jnp.asarray(rows), jnp.arange(40)[None].repeat(3, 0), jnp.ones((3, 40), jnp.int32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=0)


def test_cached_decoding_past_the_smallest_window_sees_every_slot():
    cfg = tiny_config("qwen3", vocab_size=VOCAB)
    model = Decoder(cfg, nnx.Rngs(4))
    row = np.random.default_rng(4).integers(0, VOCAB, 202)
    expected, _ = model(jnp.asarray(row[None]), jnp.arange(202)[None], jnp.ones((1, 202), jnp.int32))
    cache = KVCache.empty(cfg, batch=1, max_len=512)  # windows 64, 128, ..., 512: the prompt needs 256
    _, cache = model(jnp.asarray(row[None, :200]), jnp.arange(200)[None], jnp.ones((1, 200), jnp.int32), cache)
    got = []
    for t in (200, 201):
        logits, cache = model(jnp.asarray(row[None, t:t + 1]), cache.length_B[:, None], jnp.ones((1, 1), jnp.int32), cache)
        got.append(logits[0, 0])
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected[0, 200:]), atol=1e-5, rtol=0)


def test_causal_attention_gradients_are_autodiffs_of_plain_attention():
    """The query blocks' written-out backward against autodiff of one masked softmax over all keys:
    keys before the queries (S > T), left padding, two query heads per KV head, three query blocks."""
    B, T, S, N, K, H = 3, 130, 140, 4, 2, 8
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, N, H), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((B, S, K, H), np.float32)) for _ in range(2))
    mask = jnp.asarray(np.arange(S)[None] >= np.array([[0], [5], [100]]))
    weights = jnp.asarray(rng.standard_normal((B, T, N, H), np.float32)) * mask[:, S - T:, None, None]

    def plain(q, k, v):
        k, v = (jnp.repeat(x, N // K, axis=2) for x in (k, v))
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
        visible = (np.arange(S)[None] <= S - T + np.arange(T)[:, None])[None] & mask[:, None]
        probs = jax.nn.softmax(jnp.where(visible[:, None], scores, jnp.finfo(jnp.float32).min), -1)
        return jnp.einsum("bnts,bsnh->btnh", probs, v)

    want, got = (jax.grad(lambda *a, f=f: jnp.sum(f(*a) * weights), argnums=range(3))(q, k, v)
                 for f in (plain, lambda q, k, v: causal_attention(q, k, v, mask)))
    assert all(float(jnp.abs(w).max()) > 1e-2 for w in want)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_prefixed_attention_is_attention_over_each_rows_prefix_then_its_own_keys():
    """Prefixes read once per group give what every row attending to its own copy gives, values and
    gradients: left-padded prefixes, right-padded rows, two query heads per KV head, three query blocks."""
    G, n, P, T, N, K, H = 2, 3, 7, 130, 4, 2, 8
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((G * n, T, *s), np.float32)) for s in ((N, H), (K, H), (K, H)))
    k_p, v_p = (jnp.asarray(rng.standard_normal((G, P, K, H), np.float32)) for _ in range(2))
    mask_p = jnp.asarray(np.arange(P)[None] >= np.array([[2], [0]]))
    mask = jnp.asarray(np.arange(T)[None] < np.array([[130], [70], [1], [100], [129], [64]]))
    weights = jnp.asarray(rng.standard_normal((G * n, T, N, H), np.float32)) * mask[:, :, None, None]

    def copied(q, k_p, v_p, k, v):
        def rows(prefix, own):
            return jnp.concatenate([jnp.repeat(prefix, n, axis=0), own], axis=1)
        return causal_attention(q, rows(k_p, k), rows(v_p, v), rows(mask_p, mask))

    def shared(q, k_p, v_p, k, v):
        return prefixed_attention(q, k_p, v_p, mask_p, k, v, mask)

    args = (q, k_p, v_p, k, v)
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(shared(*args))[real], np.asarray(copied(*args))[real], atol=1e-6)
    want, got = (jax.grad(lambda *a, f=f: jnp.sum(f(*a) * weights), argnums=range(5))(*args) for f in (copied, shared))
    assert all(float(jnp.abs(g).max()) > 1e-2 for g in want)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_packed_attention_at_every_window_is_plain_attention_within_segments_and_their_prefix():
    """Windows 128 (with its prefix keys), 256 (run as the whole row's causal blocks: no fewer keys)
    and the whole row, values and gradients: groups of a 40-token prompt and completions that see
    it (beyond window 128 from its start), lone segments, a padding tail."""
    B, T, N, K, H = 2, 512, 4, 2, 8
    rng = np.random.default_rng(0)
    segments, prefix = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for b in range(B):
        at, s = 0, 0
        while at + 220 <= T:
            s += 1
            if rng.random() < 0.6:  # a group: its prompt, then completions its last ones' windows start after
                at = -(-at // 64) * 64
                segments[b, at:at + 40] = prefix[b, at:at + 40] = s
                pid, at = s, at + 40
                for _ in range(3):
                    s, n = s + 1, int(rng.integers(40, 61))
                    segments[b, at:at + n], prefix[b, at:at + n] = s, pid
                    at += n
            else:
                n = int(rng.integers(1, 61))
                segments[b, at:at + n] = prefix[b, at:at + n] = s
                at += n
    q = jnp.asarray(rng.standard_normal((B, T, N, H), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((B, T, K, H), np.float32)) for _ in range(2))
    real = segments > 0
    weights = jnp.asarray(rng.standard_normal((B, T, N, H), np.float32)) * real[:, :, None, None]
    seg_q, pre_q, seg_k = segments[:, :, None], prefix[:, :, None], segments[:, None, :]
    visible = (np.arange(T)[None] <= np.arange(T)[:, None])[None] & ((seg_q == seg_k) | (pre_q == seg_k)) & (seg_q > 0)

    def plain(q, k, v):
        k, v = (jnp.repeat(x, N // K, axis=2) for x in (k, v))
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
        probs = jax.nn.softmax(jnp.where(visible[:, None], scores, jnp.finfo(jnp.float32).min), -1)
        return jnp.einsum("bnts,bsnh->btnh", probs, v)

    want = jax.grad(lambda *a: jnp.sum(plain(*a) * weights), argnums=range(3))(q, k, v)
    assert packed_windows(T) == (128, 256, 512)
    for window in range(3):
        def packed(q, k, v, window=window):
            return packed_attention(q, k, v, jnp.asarray(segments), jnp.asarray(prefix), window)

        np.testing.assert_allclose(np.asarray(packed(q, k, v))[real], np.asarray(plain(q, k, v))[real], atol=1e-5)
        got = jax.grad(lambda *a: jnp.sum(packed(*a) * weights), argnums=range(3))(q, k, v)
        for w, g in zip(want, got):
            np.testing.assert_allclose(g, w, atol=1e-5)


def test_shared_prefix_attention_is_cached_attention_over_each_rows_prefix_then_its_slots():
    """Six cache rows in three groups (of 3, 2 and 1 rows; prefixes of 7, 3 and all 10 slots, one group
    of padding), two query heads per KV head, two queries per row: each row's queries see the same as over
    one cache holding its group's prefix and then its own slots."""
    B, T, N, K, H, S, P, n = 6, 2, 4, 2, 8, 12, 10, 3
    group, length = np.array([0, 0, 1, 2, 1, 0]), np.array([7, 3, 10, 0])
    members, rank = np.zeros((4, n), np.int32), np.zeros(B, np.int32)
    for u in range(3):
        rows = np.flatnonzero(group == u)
        members[u, :len(rows)], rank[rows] = rows, np.arange(len(rows))
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, N, H), np.float32)
    k_p, v_p = rng.standard_normal((4, K, H, P), np.float32), rng.standard_normal((4, K, P, H), np.float32)
    k, v = rng.standard_normal((B, K, H, S), np.float32), rng.standard_normal((B, K, S, H), np.float32)
    visible = np.arange(S)[None, None] <= np.array([3, 5, 1, 7, 9, 4])[:, None, None] + np.arange(T)[:, None]
    got = shared_prefix_attention(q, k, v, visible, k_p, v_p, SharedPrefix((k_p,), (v_p,), length, members, group, rank))
    k_all, v_all = np.zeros((B, K, H, P + S), np.float32), np.zeros((B, K, P + S, H), np.float32)
    visible_all = np.zeros((B, T, P + S), bool)
    for b in range(B):
        L = length[group[b]]
        k_all[b, ..., :L], k_all[b, ..., L:L + S] = k_p[group[b], ..., :L], k[b]
        v_all[b, :, :L], v_all[b, :, L:L + S] = v_p[group[b], :, :L], v[b]
        visible_all[b, :, :L], visible_all[b, :, L:L + S] = True, visible[b]
    np.testing.assert_allclose(got, cached_attention(q, k_all, v_all, visible_all), atol=1e-6)
    # A free slot of a decode's batch sees nothing: no prefix (a padding group) and no slot of its own.
    alone = SharedPrefix((k_p,), (v_p,), length, members, np.full(B, 3, np.int32), np.zeros(B, np.int32))
    nothing = shared_prefix_attention(q, k, v, np.zeros_like(visible), k_p, v_p, alone)
    assert np.all(np.asarray(nothing) == 0)


def _plain_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, visible_BxTxS, sinks_N=None):
    """One masked softmax over every key, the sinks a last column dropped after it, as transformers'
    gpt-oss eager attention computes it: the reference of every attention path with sinks and windows."""
    N, K, H = q_BxTxNxH.shape[2], k_BxSxKxH.shape[2], q_BxTxNxH.shape[3]
    k, v = (jnp.repeat(x, N // K, axis=2) for x in (k_BxSxKxH, v_BxSxKxH))
    scores = jnp.einsum("btnh,bsnh->bnts", q_BxTxNxH, k) / np.sqrt(H)
    scores = jnp.where(visible_BxTxS[:, None], scores, jnp.finfo(jnp.float32).min)
    if sinks_N is not None:
        sinks = jnp.broadcast_to(sinks_N[None, :, None, None], (*scores.shape[:3], 1))
        scores = jnp.concatenate([scores, sinks], -1)
    probs = jax.nn.softmax(scores, -1)[..., :k.shape[1]]
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


def _grads(f, weights, args):
    """Gradients of sum(f(*args) * weights) with respect to every argument."""
    return jax.grad(lambda *a: jnp.sum(f(*a) * weights), argnums=range(len(args)))(*args)


SINKS_AND_WINDOWS = [(True, None), (False, 17), (True, 17), (True, 90)]
SINKS_AND_WINDOWS_IDS = ["sinks", "window-17", "sinks-window-17", "sinks-window-90"]


@pytest.mark.parametrize("with_sinks, sliding", SINKS_AND_WINDOWS, ids=SINKS_AND_WINDOWS_IDS)
def test_causal_attention_with_sinks_and_a_sliding_window_is_plain_attention(with_sinks, sliding):
    """Values and gradients (the sinks' too, through the written-out backward): keys before the queries,
    left padding, three query blocks whose first keys lie beyond a window of 17 (and not of 90)."""
    B, T, S, N, K, H = 3, 130, 140, 4, 2, 8
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((B, T, N, H), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((B, S, K, H), np.float32)) for _ in range(2))
    sinks = jnp.asarray(rng.standard_normal(N, np.float32) + 1) if with_sinks else None
    mask = jnp.asarray(np.arange(S)[None] >= np.array([[0], [5], [100]]))
    weights = jnp.asarray(rng.standard_normal((B, T, N, H), np.float32)) * mask[:, S - T:, None, None]
    query_Tx1, key_1xS = S - T + np.arange(T)[:, None], np.arange(S)[None]
    visible = (key_1xS <= query_Tx1) & (key_1xS > query_Tx1 - (sliding or S))
    visible = jnp.asarray(visible[None] & np.asarray(mask)[:, None])

    args = (q, k, v) + ((sinks,) if with_sinks else ())
    want = _grads(lambda q, k, v, *s: _plain_attention(q, k, v, visible, *s), weights, args)
    got = _grads(lambda q, k, v, *s: causal_attention(q, k, v, mask, *s, sliding=sliding), weights, args)
    real = np.asarray(mask)[:, S - T:]
    np.testing.assert_allclose(np.asarray(causal_attention(q, k, v, mask, sinks, sliding))[real],
                               np.asarray(_plain_attention(q, k, v, visible, sinks))[real], atol=1e-5)
    assert all(float(jnp.abs(w).max()) > 1e-2 for w in want)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=1e-5)


@pytest.mark.parametrize("with_sinks, sliding", SINKS_AND_WINDOWS, ids=SINKS_AND_WINDOWS_IDS)
def test_prefixed_attention_with_sinks_and_a_sliding_window_is_plain_attention(with_sinks, sliding):
    """A row is its left-padded prefix and then its right-padded tokens, one sequence: the window
    reaches back into the prefix from the row's first tokens only."""
    G, n, P, T, N, K, H = 2, 3, 7, 130, 4, 2, 8
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((G * n, T, *s), np.float32)) for s in ((N, H), (K, H), (K, H)))
    k_p, v_p = (jnp.asarray(rng.standard_normal((G, P, K, H), np.float32)) for _ in range(2))
    sinks = jnp.asarray(rng.standard_normal(N, np.float32) + 1) if with_sinks else None
    mask_p = jnp.asarray(np.arange(P)[None] >= np.array([[2], [0]]))
    mask = jnp.asarray(np.arange(T)[None] < np.array([[130], [70], [1], [100], [129], [64]]))
    weights = jnp.asarray(rng.standard_normal((G * n, T, N, H), np.float32)) * mask[:, :, None, None]
    query_Tx1, key_1xS = P + np.arange(T)[:, None], np.arange(P + T)[None]
    mask_all = np.concatenate([np.repeat(np.asarray(mask_p), n, 0), np.asarray(mask)], 1)
    visible = (key_1xS <= query_Tx1) & (key_1xS > query_Tx1 - (sliding or P + T))
    visible = jnp.asarray(visible[None] & mask_all[:, None])

    def plain(q, k_p, v_p, k, v, *s):
        def rows(prefix, own):
            return jnp.concatenate([jnp.repeat(prefix, n, axis=0), own], axis=1)
        return _plain_attention(q, rows(k_p, k), rows(v_p, v), visible, *s)

    def shared(q, k_p, v_p, k, v, *s):
        return prefixed_attention(q, k_p, v_p, mask_p, k, v, mask, *s, sliding=sliding)

    args = (q, k_p, v_p, k, v) + ((sinks,) if with_sinks else ())
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(shared(*args))[real], np.asarray(plain(*args))[real], atol=1e-5)
    want, got = _grads(plain, weights, args), _grads(shared, weights, args)
    assert all(float(jnp.abs(w).max()) > 1e-2 for w in want)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_packed_attention_with_sinks_and_a_sliding_window_counts_positions_not_slots():
    """Every window (128 with prefix keys, 256 as the whole row's causal blocks, 512), values and
    gradients: completions packed after one another continue their prompt's positions, so the window
    of 50 positions reaches a completion's prompt across its siblings' slots."""
    B, T, N, K, H, sliding = 2, 512, 4, 2, 8, 50
    rng = np.random.default_rng(3)
    segments, prefix, positions = (np.zeros((B, T), np.int32) for _ in range(3))
    for b in range(B):
        at, s = 0, 0
        while at + 220 <= T:
            s, at = s + 1, -(-at // 64) * 64
            segments[b, at:at + 40] = prefix[b, at:at + 40] = s
            positions[b, at:at + 40] = np.arange(40)
            pid, at = s, at + 40
            for _ in range(3):
                s, m = s + 1, int(rng.integers(30, 61))
                segments[b, at:at + m], prefix[b, at:at + m], positions[b, at:at + m] = s, pid, 40 + np.arange(m)
                at += m
    q = jnp.asarray(rng.standard_normal((B, T, N, H), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((B, T, K, H), np.float32)) for _ in range(2))
    sinks = jnp.asarray(rng.standard_normal(N, np.float32) + 1)
    real = segments > 0
    weights = jnp.asarray(rng.standard_normal((B, T, N, H), np.float32)) * real[:, :, None, None]
    seg_q, pre_q, seg_k = segments[:, :, None], prefix[:, :, None], segments[:, None, :]
    visible = ((np.arange(T)[None] <= np.arange(T)[:, None])[None] & ((seg_q == seg_k) | (pre_q == seg_k))
               & (seg_q > 0) & (positions[:, :, None] - positions[:, None, :] < sliding))
    assert (visible & (np.arange(T)[:, None] - np.arange(T)[None] >= sliding)).any(), "no key beyond the window"

    args = (q, k, v, sinks)
    want = _grads(lambda *a: _plain_attention(*a[:3], jnp.asarray(visible), a[3]), weights, args)
    for window in range(3):
        def packed(q, k, v, sinks, window=window):
            return packed_attention(q, k, v, jnp.asarray(segments), jnp.asarray(prefix), window, sinks, sliding,
                                    jnp.asarray(positions))

        np.testing.assert_allclose(np.asarray(packed(*args))[real],
                                   np.asarray(_plain_attention(q, k, v, jnp.asarray(visible), sinks))[real], atol=1e-5)
        for w, g in zip(want, _grads(packed, weights, args)):
            np.testing.assert_allclose(g, w, atol=1e-5)


def test_cached_and_shared_prefix_attention_with_sinks_are_plain_attention():
    """The full layers' decode paths: a cache row's visible slots and, in groups, its prefix's real slots,
    against one softmax with the sink column."""
    B, T, N, K, H, S, P, n = 6, 2, 4, 2, 8, 12, 10, 3
    group, length = np.array([0, 0, 1, 2, 1, 0]), np.array([7, 3, 10, 0])
    members, rank = np.zeros((4, n), np.int32), np.zeros(B, np.int32)
    for u in range(3):
        rows = np.flatnonzero(group == u)
        members[u, :len(rows)], rank[rows] = rows, np.arange(len(rows))
    rng = np.random.default_rng(4)
    q = rng.standard_normal((B, T, N, H), np.float32)
    k_p, v_p = rng.standard_normal((4, K, H, P), np.float32), rng.standard_normal((4, K, P, H), np.float32)
    k, v = rng.standard_normal((B, K, H, S), np.float32), rng.standard_normal((B, K, S, H), np.float32)
    sinks = rng.standard_normal(N, np.float32) + 1
    query = np.array([3, 5, 1, 7, 9, 4])[:, None, None] + np.arange(T)[:, None]
    visible = np.arange(S)[None, None] <= query
    got = shared_prefix_attention(q, k, v, visible, k_p, v_p, SharedPrefix((k_p,), (v_p,), length, members, group,
                                                                           rank), sinks)
    k_all, v_all = np.zeros((B, P + S, K, H), np.float32), np.zeros((B, P + S, K, H), np.float32)
    visible_all = np.zeros((B, T, P + S), bool)
    for b in range(B):
        L = length[group[b]]
        k_all[b, :L], k_all[b, L:L + S] = k_p[group[b], ..., :L].transpose(2, 0, 1), k[b].transpose(2, 0, 1)
        v_all[b, :L], v_all[b, L:L + S] = v_p[group[b], :, :L].transpose(1, 0, 2), v[b].transpose(1, 0, 2)
        visible_all[b, :, :L], visible_all[b, :, L:L + S] = True, visible[b]
    want = _plain_attention(q, k_all, v_all, visible_all, sinks)
    np.testing.assert_allclose(got, want, atol=1e-6)
    cache_k, cache_v = k_all.transpose(0, 2, 3, 1), v_all.transpose(0, 2, 1, 3)
    np.testing.assert_allclose(cached_attention(q, cache_k, cache_v, visible_all, sinks), want, atol=1e-6)


def test_attention_windows_halve_down_to_the_smallest():
    from jaxrl.models.decoder import attention_windows

    assert attention_windows(2112) == (132, 264, 528, 1056, 2112)
    assert attention_windows(100) == (100,)


def test_key_windows_step_evenly_in_aligned_steps_at_most_eight():
    from jaxrl.models.decoder import key_windows

    assert key_windows(704) == (128, 256, 384, 512, 640, 704)
    assert key_windows(512) == tuple(range(64, 513, 64))
    assert key_windows(100) == (64, 100)
    assert key_windows(16) == (16,)
    assert len(key_windows(32832)) == 8 and key_windows(32832)[0] % 64 == 0


def test_bfloat16_compute_stays_close_to_float32():
    cfg = tiny_config("qwen3", vocab_size=VOCAB)
    model32 = Decoder(cfg, nnx.Rngs(2))
    model16 = Decoder(cfg.replace(dtype="bfloat16"), nnx.Rngs(2))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, VOCAB, (2, 8)))
    mask = jnp.ones((2, 8), jnp.int32)
    pos = positions_from_mask(mask)
    l32, _ = model32(tokens, pos, mask)
    l16, _ = model16(tokens, pos, mask)
    assert l16.dtype == jnp.float32  # logits are always accumulated in float32
    assert jnp.abs(l32 - l16).max() < 0.05
    assert jnp.abs(l32).max() > 0.05


def test_parameters_carry_logical_sharding_axes():
    cfg = tiny_config("qwen2", tied=False, vocab_size=VOCAB)
    model = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    specs = jax.tree.map(
        lambda v: tuple(v.get_value()), nnx.get_partition_spec(nnx.state(model, nnx.Param)),
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )
    attn = specs["layers"][0]["self_attn"]
    assert attn["q_proj"]["kernel"] == ("embed", "q_heads")
    assert attn["q_proj"]["bias"] == ("q_heads",)
    assert attn["o_proj"]["kernel"] == ("q_heads", "embed")
    assert specs["embed_tokens"] == ("vocab", "embed")
    assert specs["lm_head"] == ("embed", "vocab")
    assert specs["layers"][1]["mlp"]["down_proj"]["kernel"] == ("mlp", "embed")
    assert specs["norm"]["weight"] == ("norm",)
