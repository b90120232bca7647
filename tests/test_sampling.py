"""Sampling a token from a row's logits: top-k and top-p as defined, tokens following the tempered and
filtered distribution, the two-level inverse CDF."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bridge.engines.sampling import _filter_logits, _inverse_cdf, cdf_block, sample


def test_top_k_and_top_p_filters_match_their_definitions():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32)
    top_p = np.array([1.0, 0.5, 0.9], np.float32)
    top_k = np.array([3, 0, 5], np.int32)
    kept = np.isfinite(np.asarray(_filter_logits(jnp.asarray(logits), top_p, top_k)))
    for b in range(3):
        order = np.argsort(-logits[b])
        probs = np.exp(logits[b] - logits[b].max())
        probs /= probs.sum()
        mass_before = np.cumsum(probs[order]) - probs[order]
        n_p = int((mass_before < top_p[b]).sum())
        n = min(n_p, top_k[b] or 50)
        assert set(np.flatnonzero(kept[b])) == set(order[:n].tolist()), b


def test_sampled_tokens_follow_the_tempered_and_filtered_distribution():
    n, logits_V = 40_000, np.array([2.0, 1.0, 0.5, 0.0, -1.0, -30.0], np.float32)
    u = jax.random.uniform(jax.random.key(0), (n,))
    for temperature, top_k in ((0.7, 0), (1.3, 3)):
        tokens, logp = sample(jnp.tile(logits_V, (n, 1)), u, jnp.full(n, temperature), jnp.ones(n),
                               jnp.full(n, top_k))
        want = np.exp(logits_V / temperature)
        if top_k:
            want[top_k:] = 0
        want /= want.sum()
        freq = np.bincount(np.asarray(tokens), minlength=len(logits_V)) / n
        assert np.all(np.abs(freq - want) <= 5 * np.sqrt(want * (1 - want) / n) + 1e-9), (temperature, freq, want)
        full_logp = np.asarray(jax.nn.log_softmax(logits_V / temperature))
        np.testing.assert_allclose(np.asarray(logp), full_logp[np.asarray(tokens)], rtol=1e-5)


def test_cdf_blocks_keep_both_prefix_sums_small_and_divide_the_vocabulary_where_they_can():
    for vocab in (1000, 32000, 50257, 151936):
        block = cdf_block(vocab)
        assert max(block, -(-vocab // block)) <= 2 * np.sqrt(vocab) + 8, vocab
    assert 1000 % cdf_block(1000) == 0 and 32000 % cdf_block(32000) == 0


@pytest.mark.parametrize("block", [32, None])  # 32: the last block padded; None: cdf_block(1000) = 25
def test_inverse_cdf_over_many_blocks_picks_the_first_token_reaching_the_mass_and_never_one_without(block):
    V, rows = 1000, 8
    size = block or cdf_block(V)
    rng = np.random.default_rng(0)
    probs = rng.exponential(size=(rows, V)).astype(np.float32)
    probs[rng.random((rows, V)) < 0.3] = 0  # as top-k / top-p leave them
    probs[:, size:2 * size] = 0  # a whole block without mass
    probs[:, size - 1::size] = 0  # the last token of every block
    probs[:, -5:] = 0
    probs[0, 1:] = 0  # a single token
    cdf = np.cumsum(probs.astype(np.float64), -1)
    u = np.concatenate([rng.random((rows, 4000)), np.zeros((rows, 1)), np.full((rows, 1), 1 - 2 ** -24)], 1)
    # Thresholds exactly at block ends, where float32 sums round either way.
    u = np.concatenate([u, 1 - cdf[:, size - 2:V:size] / cdf[:, -1:]], 1).astype(np.float32)
    run = jax.jit(_inverse_cdf, static_argnums=2)
    picked = np.stack([np.asarray(run(jnp.asarray(probs), jnp.asarray(u[:, j]), block))
                       for j in range(u.shape[1])], 1)
    assert np.all(probs[np.arange(rows)[:, None], picked] > 0)
    threshold = (1 - u.astype(np.float64)) * cdf[:, -1:]
    want = np.stack([np.searchsorted(cdf[b], threshold[b], side="left") for b in range(rows)])
    b = np.arange(rows)[:, None]

    def near(index):  # the threshold within float32 rounding of where the token's mass starts or ends
        ends = np.stack([cdf[b, np.maximum(index - 1, 0)], cdf[b, index]])
        return np.any(np.abs(ends - threshold) <= 1e-5 * cdf[:, -1:], 0)

    assert np.array_equal(picked[~near(want)], want[~near(want)])
    assert (~near(want)).mean() > 0.9
    assert np.all(near(picked)[picked != want])
