"""KV-cache sampling: tokens and logprobs agree with full forward passes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bridge.engines.sampler import PrefixCache, RowParams, Shapes, generate_rows
from jaxrl.models import Decoder, positions_from_mask
from jaxrl.tiny import tiny_config

SHAPES = Shapes(max_seq_len=32, chunk=4, max_batch=4)  # prompts longer than a chunk take several


@pytest.fixture(scope="module")
def model():
    return Decoder(tiny_config("qwen3", vocab_size=128), nnx.Rngs(3))


def generate(model, prompts, max_new_tokens, stop_token_ids=(), temperature=0.0, seed=0, top_p=1.0, top_k=0):
    """One completion per prompt with shared settings (greedy at temperature 0)."""
    n = len(prompts)
    rows = RowParams(
        temperature=np.full(n, temperature, np.float32), top_p=np.full(n, top_p, np.float32),
        top_k=np.full(n, top_k, np.int32), max_tokens=np.full(n, max_new_tokens, np.int32),
        seed=np.arange(n, dtype=np.uint32) + np.uint32(seed), stop_ids=[tuple(stop_token_ids)] * n,
    )
    graphdef, params = nnx.split(model)
    return generate_rows(graphdef, params, prompts, rows, SHAPES, PrefixCache(model.cfg, SHAPES, rows=0))


def _full_logp(model, prompt, completion, temperature):
    """Log-softmax of a full forward pass over prompt + completion, at each completion token."""
    seq = jnp.asarray([prompt + completion])
    mask = jnp.ones_like(seq)
    logits, _ = model(seq, positions_from_mask(mask), mask)
    logp = jax.nn.log_softmax(logits[0, len(prompt) - 1:-1] / temperature, -1)
    return logp, np.asarray(logp)[np.arange(len(completion)), completion]


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_sampled_logprobs_match_a_full_forward_pass(model, temperature):
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [10, 11], [12]]
    out = generate(model, prompts, max_new_tokens=6, temperature=temperature, seed=1)
    for prompt, toks, logps in zip(prompts, out.tokens, out.logprobs):
        assert len(toks) == 6
        _, ref = _full_logp(model, prompt, toks, temperature)
        np.testing.assert_allclose(logps, ref, atol=1e-5)


def test_greedy_follows_argmax_and_stops_at_stop_tokens(model):
    prompts = [[1, 2, 3], [4, 5]]
    free = generate(model, prompts, max_new_tokens=5)
    for prompt, toks in zip(prompts, free.tokens):
        logp, _ = _full_logp(model, prompt, toks, 1.0)
        assert toks == np.asarray(jnp.argmax(logp, -1)).tolist()
    assert free.finish_reasons == ["length", "length"]

    stop = free.tokens[0][-1]
    first = free.tokens[0].index(stop)
    stopped = generate(model, prompts, max_new_tokens=5, stop_token_ids=(stop,))
    assert stopped.tokens[0] == free.tokens[0][:first + 1]
    assert stopped.finish_reasons[0] == "stop"


def test_different_seeds_sample_differently(model):
    a = generate(model, [[1, 2]], max_new_tokens=8, temperature=1.0, seed=0)
    b = generate(model, [[1, 2]], max_new_tokens=8, temperature=1.0, seed=1)
    assert a.tokens != b.tokens


def test_empty_prompt_is_rejected(model):
    with pytest.raises(ValueError, match="every prompt needs a token"):
        generate(model, [[1], []], max_new_tokens=2)


def test_sequences_longer_than_max_seq_len_are_refused(model):
    with pytest.raises(ValueError, match="more than max_seq_len 32"):
        generate(model, [[1] * 30], max_new_tokens=3)


def test_top_k_and_top_p_filters_match_their_definitions():
    from bridge.engines.sampler import _filter_logits

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
    from bridge.engines.sampler import _sample

    n, logits_V = 40_000, np.array([2.0, 1.0, 0.5, 0.0, -1.0, -30.0], np.float32)
    keys = jax.vmap(jax.random.key)(jnp.arange(n))
    for temperature, top_k in ((0.7, 0), (1.3, 3)):
        tokens, logp = _sample(jnp.tile(logits_V, (n, 1)), keys, jnp.full(n, temperature), jnp.ones(n),
                               jnp.full(n, top_k))
        want = np.exp(logits_V / temperature)
        if top_k:
            want[top_k:] = 0
        want /= want.sum()
        freq = np.bincount(np.asarray(tokens), minlength=len(logits_V)) / n
        assert np.all(np.abs(freq - want) <= 5 * np.sqrt(want * (1 - want) / n) + 1e-9), (temperature, freq, want)
        full_logp = np.asarray(jax.nn.log_softmax(logits_V / temperature))
        np.testing.assert_allclose(np.asarray(logp), full_logp[np.asarray(tokens)], rtol=1e-5)


def test_truncated_sampling_reports_full_vocabulary_logprobs(model):
    prompt = [3, 4, 5]
    greedy = generate(model, [prompt], max_new_tokens=6)
    top1 = generate(model, [prompt], max_new_tokens=6, temperature=0.8, top_k=1, seed=5)
    assert top1.tokens == greedy.tokens
    _, ref = _full_logp(model, prompt, top1.tokens[0], 0.8)
    np.testing.assert_allclose(top1.logprobs[0], ref, atol=1e-5)
    assert max(top1.logprobs[0]) < 0  # not the truncated distribution's log(1) = 0
    tiny_p = generate(model, [prompt], max_new_tokens=6, temperature=1.0, top_p=1e-6, seed=7)
    assert tiny_p.tokens == greedy.tokens


def test_rows_in_one_batch_keep_their_own_settings(model):
    graphdef, params = nnx.split(model)
    rows = RowParams(
        temperature=np.array([0.0, 1.0, 1.0], np.float32), top_p=np.ones(3, np.float32),
        top_k=np.zeros(3, np.int32), max_tokens=np.array([2, 7, 4], np.int32),
        seed=np.array([0, 1, 1], np.uint32), stop_ids=[(), (), ()],
    )
    out = generate_rows(graphdef, params, [[1, 2], [1, 2], [1, 2]], rows, SHAPES, PrefixCache(model.cfg, SHAPES, 0))
    assert [len(t) for t in out.tokens] == [2, 7, 4]
    assert out.finish_reasons == ["length"] * 3
    # Same seed and prompt: the shorter row is a prefix of the longer one.
    assert out.tokens[1][:4] == out.tokens[2]
    assert out.tokens[0] == generate(model, [[1, 2]], max_new_tokens=2).tokens[0]


def test_a_continuation_prefills_only_its_new_tokens_and_samples_what_a_fresh_prefill_would(model):
    """An episode's next turn extends its last prompt and completion: with the prefix cache it
    prefills only the new tokens, and samples exactly what it samples without the cache."""
    graphdef, params = nnx.split(model)

    def rows(n, max_tokens, seed):
        return RowParams(np.ones(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.int32),
                         np.full(n, max_tokens, np.int32), np.arange(n, dtype=np.uint32) + seed, [()] * n)

    cached = PrefixCache(model.cfg, SHAPES, rows=4)
    prompts = [[3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8], [9, 10]]  # the first two: one prefill
    first = generate_rows(graphdef, params, prompts, rows(3, 5, 0), SHAPES, cached)
    assert cached.stats == {"prompt_tokens": 14, "cached_tokens": 6}
    assert first.tokens[0] != first.tokens[1]  # same prompt, own seeds
    nxt = [p + t + [11, 12, 13] for p, t in zip(prompts, first.tokens)]
    second = generate_rows(graphdef, params, nxt, rows(3, 4, 7), SHAPES, cached)
    assert cached.stats["cached_tokens"] == 6 + sum(len(p) + len(t) - 1 for p, t in zip(prompts, first.tokens))
    fresh = generate_rows(graphdef, params, nxt, rows(3, 4, 7), SHAPES, PrefixCache(model.cfg, SHAPES, 0))
    assert second.tokens == fresh.tokens
    np.testing.assert_allclose(np.concatenate(second.logprobs), np.concatenate(fresh.logprobs), atol=1e-5)
    for prompt, toks, logps in zip(nxt, second.tokens, second.logprobs):
        np.testing.assert_allclose(logps, _full_logp(model, prompt, toks, 1.0)[1], atol=1e-5)


def test_a_row_samples_the_same_tokens_alone_batched_or_from_the_prefix_cache(model):
    """A row's random stream is its own, so neither batch nor cache changes what it samples. Its
    logprobs may move in the last bits: XLA:CPU picks kernels (and reduction orders) by the whole
    batch's shape, and a cached prefix's keys were computed by decode steps, not a prefill."""
    graphdef, params = nnx.split(model)
    shapes = SHAPES  # the programs the other tests compiled

    def rows(seeds, max_tokens=8):
        n = len(seeds)
        return RowParams(np.ones(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.int32),
                         np.full(n, max_tokens, np.int32), np.asarray(seeds, np.uint64), [()] * n)

    def same(out, ref, i=-1):
        assert out.tokens[i] == ref.tokens[0]
        np.testing.assert_allclose(out.logprobs[i], ref.logprobs[0], atol=1e-5)

    target, seed = [5, 6, 7, 8, 9, 10, 11, 12, 13], 2**63 + 11
    alone = generate_rows(graphdef, params, [target], rows([seed]), shapes, PrefixCache(model.cfg, shapes, 0))
    others = [[1, 2], list(range(1, 21)), [4, 5, 6]]
    for n in (1, 2, 3):  # batches of 2 and 4 rows, the target last
        same(generate_rows(graphdef, params, others[:n] + [target], rows([1, 2, 3][:n] + [seed]), shapes,
                           PrefixCache(model.cfg, shapes, 0)), alone)

    cache = PrefixCache(model.cfg, shapes, rows=4)
    first = generate_rows(graphdef, params, [target[:4]], rows([7], 5), shapes, cache)
    turn = target[:4] + first.tokens[0] + [20, 21]  # an episode's next turn
    fresh = generate_rows(graphdef, params, [turn], rows([seed]), shapes, PrefixCache(model.cfg, shapes, 0))
    cached = generate_rows(graphdef, params, [others[1], turn], rows([1, seed]), shapes, cache)
    assert cache.stats["cached_tokens"] == len(target[:4]) + len(first.tokens[0]) - 1
    same(cached, fresh)


def test_a_batch_prefills_its_leaders_in_blocks_and_every_row_samples_what_it_samples_alone(model):
    """17 rows (blocks of 2 prefilled together, the last one partial): groups sharing a prompt
    interleaved with rows of their own, prompt rests of one to four chunks, one row continuing
    from the prefix cache. Each row samples the tokens it samples alone."""
    graphdef, params = nnx.split(model)
    shapes = Shapes(max_seq_len=32, chunk=4, max_batch=17)
    rng = np.random.default_rng(0)
    shared = [list(rng.integers(1, 128, n)) for n in (3, 14)]
    earlier = list(rng.integers(1, 128, 6))
    prompts = [shared[0], list(rng.integers(1, 128, 9)), shared[1], shared[0], earlier + [7, 8, 9],
               shared[1], list(rng.integers(1, 128, 16)), shared[0], shared[1], [5]]
    prompts += [list(rng.integers(1, 128, n)) for n in (2, 5, 11, 1, 7, 13, 4)]
    seeds = np.arange(len(prompts), dtype=np.uint64) + 100

    def rows(seeds, max_tokens=6):
        n = len(seeds)
        return RowParams(np.ones(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.int32),
                         np.full(n, max_tokens, np.int32), np.asarray(seeds, np.uint64), [()] * n)

    cache = PrefixCache(model.cfg, shapes, rows=17)
    generate_rows(graphdef, params, [earlier], rows([1], 1), shapes, cache)
    batched = generate_rows(graphdef, params, prompts, rows(seeds), shapes, cache)
    assert cache.stats["cached_tokens"] == len(earlier) + 3 * len(shared[0]) - len(shared[0]) + len(shared[1]) * 2
    for prompt, seed, tokens, logprobs in zip(prompts, seeds, batched.tokens, batched.logprobs):
        alone = generate_rows(graphdef, params, [prompt], rows([seed]), shapes, PrefixCache(model.cfg, shapes, 0))
        assert tokens == alone.tokens[0]
        np.testing.assert_allclose(logprobs, alone.logprobs[0], atol=1e-5)
