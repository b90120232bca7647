"""Decode slots over a KV cache: tokens and logprobs agree with full forward passes, and a row samples
what it samples alone, whatever joins or leaves the slots around it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bridge.engines.slots import Shapes, Slots
from bridge.engines.scheduler import MIN_BATCH, Row
from jaxrl.models import Decoder, KVCache, positions_from_mask
from jaxrl.tiny import tiny_config

# Prompts longer than a chunk take several; rows longer than 3 tokens take several decode calls.
SHAPES = Shapes(max_seq_len=32, chunk=4, max_batch=4, decode_steps=3)


@pytest.fixture(scope="module")
def model():
    return Decoder(tiny_config("qwen3", vocab_size=128), nnx.Rngs(3))


@pytest.fixture(scope="module")
def oss_model():
    """gpt-oss sliding over 8 keys in layer 0 (layer 1 full, both with sinks): rows here run to 40 tokens."""
    return Decoder(tiny_config("gpt_oss", vocab_size=128, sliding_window=8), nnx.Rngs(3))


def slots_for(model, shapes=SHAPES, prefix_rows=0):
    """Slots whose prefix pool finds sequences by blocks of one token: every shared prefix, however short."""
    return Slots(model.cfg, shapes, prefix_rows, prefix_block=1)


def run(model, rows, slots=None, version=0):
    """Steps the slots until every row ended; returns the rows."""
    slots = slots or slots_for(model)
    graphdef, params = nnx.split(model)
    slots.add(rows)
    while slots.busy():
        slots.step(graphdef, params, version)
    return rows


def rows_of(prompts, max_tokens, stop_ids=(), temperature=0.0, seed=0, top_p=1.0, top_k=0):
    """One row per prompt with shared settings (greedy at temperature 0), seeds seed, seed + 1, ..."""
    return [Row(list(p), max_tokens, seed + i, temperature, top_p, top_k, tuple(stop_ids))
            for i, p in enumerate(prompts)]


def generate(model, prompts, max_new_tokens, **kwargs):
    return run(model, rows_of(prompts, max_new_tokens, **kwargs))


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
    for prompt, row in zip(prompts, generate(model, prompts, max_new_tokens=6, temperature=temperature, seed=1)):
        assert len(row.tokens) == 6 and row.versions == [0] * 6
        _, ref = _full_logp(model, prompt, row.tokens, temperature)
        np.testing.assert_allclose(row.logprobs, ref, atol=1e-5)


def test_greedy_follows_argmax_and_stops_at_stop_tokens(model):
    prompts = [[1, 2, 3], [4, 5]]
    free = generate(model, prompts, max_new_tokens=5)
    for prompt, row in zip(prompts, free):
        logp, _ = _full_logp(model, prompt, row.tokens, 1.0)
        assert row.tokens == np.asarray(jnp.argmax(logp, -1)).tolist()
    assert [row.finish_reason for row in free] == ["length", "length"]

    stop = free[0].tokens[-1]
    first = free[0].tokens.index(stop)
    stopped = generate(model, prompts, max_new_tokens=5, stop_ids=(stop,))
    assert stopped[0].tokens == free[0].tokens[:first + 1]
    assert stopped[0].finish_reason == "stop"


def test_different_seeds_sample_differently(model):
    a = generate(model, [[1, 2]], max_new_tokens=8, temperature=1.0, seed=0)
    b = generate(model, [[1, 2]], max_new_tokens=8, temperature=1.0, seed=1)
    assert a[0].tokens != b[0].tokens


def test_rows_that_do_not_fit_are_refused(model):
    with pytest.raises(ValueError, match="within max_seq_len 32 tokens in all; got 30 \\+ 3"):
        generate(model, [[1] * 30], max_new_tokens=3)
    with pytest.raises(ValueError, match="a row needs a prompt"):
        generate(model, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="9 stop token ids, more than the engine's 8"):
        generate(model, [[1]], max_new_tokens=2, stop_ids=range(9))


def test_truncated_sampling_reports_full_vocabulary_logprobs(model):
    prompt = [3, 4, 5]
    [greedy] = generate(model, [prompt], max_new_tokens=6)
    [top1] = generate(model, [prompt], max_new_tokens=6, temperature=0.8, top_k=1, seed=5)
    assert top1.tokens == greedy.tokens
    _, ref = _full_logp(model, prompt, top1.tokens, 0.8)
    np.testing.assert_allclose(top1.logprobs, ref, atol=1e-5)
    assert max(top1.logprobs) < 0  # not the truncated distribution's log(1) = 0
    [tiny_p] = generate(model, [prompt], max_new_tokens=6, temperature=1.0, top_p=1e-6, seed=7)
    assert tiny_p.tokens == greedy.tokens


def test_rows_in_one_batch_keep_their_own_settings(model):
    rows = [Row([1, 2], 2, 0, temperature=0.0), Row([1, 2], 7, 1), Row([1, 2], 4, 1)]
    run(model, rows)
    assert [len(r.tokens) for r in rows] == [2, 7, 4]
    assert [r.finish_reason for r in rows] == ["length"] * 3
    # Same seed and prompt: the shorter row is a prefix of the longer one.
    assert rows[1].tokens[:4] == rows[2].tokens
    assert rows[0].tokens == generate(model, [[1, 2]], max_new_tokens=2)[0].tokens


def test_a_continuation_prefills_only_its_new_tokens_and_samples_what_a_fresh_prefill_would(model):
    """An episode's next turn extends its last prompt and completion: with the prefix cache it
    prefills only the new tokens, and samples exactly what it samples without the cache."""

    def rows(prompts, max_tokens, seed):
        return rows_of(prompts, max_tokens, temperature=1.0, seed=seed)

    cached = slots_for(model, prefix_rows=4)
    prompts = [[3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8], [9, 10]]  # the first two: one prefill
    first = run(model, rows(prompts, 5, 0), cached)
    assert cached.prefix.stats == {"prompt_tokens": 14, "cached_tokens": 6}
    assert first[0].tokens != first[1].tokens  # same prompt, own seeds
    nxt = [p + r.tokens + [11, 12, 13] for p, r in zip(prompts, first)]
    second = run(model, rows(nxt, 4, 7), cached)
    assert cached.prefix.stats["cached_tokens"] == 6 + sum(len(p) + len(r.tokens) - 1 for p, r in zip(prompts, first))
    fresh = run(model, rows(nxt, 4, 7))
    assert [r.tokens for r in second] == [r.tokens for r in fresh]
    np.testing.assert_allclose(np.concatenate([r.logprobs for r in second]),
                               np.concatenate([r.logprobs for r in fresh]), atol=1e-5)
    for prompt, row in zip(nxt, second):
        np.testing.assert_allclose(row.logprobs, _full_logp(model, prompt, row.tokens, 1.0)[1], atol=1e-5)


def same(row, alone):
    assert row.tokens == alone.tokens
    np.testing.assert_allclose(row.logprobs, alone.logprobs, atol=1e-5)


def test_a_row_samples_the_same_tokens_alone_batched_or_from_the_prefix_cache(model):
    """A row's random stream is its own, so neither batch nor cache changes what it samples. Its
    logprobs may move in the last bits: XLA:CPU picks kernels (and reduction orders) by the whole
    batch's shape, and a cached prefix's keys were computed by decode steps, not a prefill."""
    target, seed = [5, 6, 7, 8, 9, 10, 11, 12, 13], 2**63 + 11

    def row(prompt, seed, max_tokens=8):
        return Row(list(prompt), max_tokens, seed)

    [alone] = run(model, [row(target, seed)])
    others = [[1, 2], list(range(1, 21)), [4, 5, 6]]
    for n in (1, 2, 3):  # batches of 2 and 4 rows, the target last
        same(run(model, [row(p, s) for p, s in zip(others[:n], (1, 2, 3))] + [row(target, seed)])[-1], alone)

    cache = slots_for(model, prefix_rows=4)
    [first] = run(model, [row(target[:4], 7, 5)], cache)
    turn = target[:4] + first.tokens + [20, 21]  # an episode's next turn
    [fresh] = run(model, [row(turn, seed)])
    cached = run(model, [row(others[1], 1), row(turn, seed)], cache)
    assert cache.prefix.stats["cached_tokens"] == len(target[:4]) + len(first.tokens) - 1
    same(cached[1], fresh)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", ["model", "oss_model"])
def test_a_row_inserted_into_running_slots_samples_what_it_samples_alone(name, temperature, request):
    """Rows join and leave the slots around the target: it is inserted while eleven rows run,
    they end while it runs (and it moves down to the first slot), and new rows join after. gpt-oss's
    target outgrows its sliding layer's ring of 8 slots, which moves with it."""
    model = request.getfixturevalue(name)
    graphdef, params = nnx.split(model)
    target = Row([7, 8, 9, 10, 11], 12, 2**40 + 5, temperature)
    [alone] = run(model, [Row(target.prompt, 12, target.seed, temperature)])
    slots = slots_for(model, Shapes(max_seq_len=32, chunk=4, max_batch=2 * MIN_BATCH, decode_steps=3))
    others = [Row([1 + i % 5, 2, 3][:1 + i % 3], 4 + i % 3, i) for i in range(MIN_BATCH + 3)]
    slots.add(others)
    slots.step(graphdef, params, 0)
    slots.add([target])
    slots.step(graphdef, params, 0)
    # Inserted into the first free slot (a row's lists are filled when it ends).
    assert slots.rows[len(others)] is target and slots.scheduler.length[len(others)] == 3
    while len([r for r in slots.rows if r is not None]) > 1:
        slots.step(graphdef, params, 0)
    slots.step(graphdef, params, 0)
    assert slots.rows[0] is target  # moved down: MIN_BATCH slots decoded, not 2 * MIN_BATCH
    slots.add([Row([3, 1], 6, 9), Row([2, 2, 2], 3, 10)])
    while slots.busy():
        slots.step(graphdef, params, 0)
    same(target, alone)
    assert slots.stats["rows"] == len(others) + 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decode_calls_of_more_steps_than_their_window_sample_what_short_calls_do(model, temperature):
    """A call may run more steps than its window holds slots (a batch-synchronous engine runs until
    every row ended): every slot it wrote goes back to the cache, and the next turn continues from it."""
    long = Shapes(max_seq_len=32, chunk=4, max_batch=4, decode_steps=40)
    assert long.decode_steps > long.windows()[-1]
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    slots = slots_for(model, long, prefix_rows=4)  # keeps each turn's rows for the next
    for turn in range(2):
        short_rows = rows_of(prompts, 9, temperature=temperature, seed=3)
        long_rows = rows_of(prompts, 9, temperature=temperature, seed=3)
        run(model, short_rows)
        run(model, long_rows, slots)
        for a, b in zip(long_rows, short_rows):
            same(a, b)
        prompts = [p + r.tokens + [3, 4] for p, r in zip(prompts, long_rows)]  # the next turn
    assert slots.scheduler.prefix.stats["cached_tokens"] > 0  # the second turn read the first's keys


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_decoded_in_windows_narrower_than_the_cache_sample_what_a_full_pass_gives(model, temperature):
    """A decode call reads only its narrowest decode window that holds its rows: short rows read
    the first 128 of 302 slots and sample what a one-window cache samples; a row growing past 128
    moves to the next window mid-row. Every logprob is the full forward pass's, greedy its argmax."""
    wide = Shapes(max_seq_len=300, chunk=4, max_batch=4, decode_steps=3)
    assert wide.decode_windows() == (128, 192, 256, 302)
    short = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    narrow_rows = run(model, rows_of(short, 16, temperature=temperature, seed=5), slots_for(model, wide))
    for a, b in zip(narrow_rows, run(model, rows_of(short, 16, temperature=temperature, seed=5))):
        same(a, b)
    crossing = list(np.random.default_rng(1).integers(1, 128, 118))  # 118 + 16 tokens: windows 128, then 192
    for prompt, row in zip(short + [crossing], narrow_rows + run(
            model, rows_of([crossing], 16, temperature=temperature, seed=5), slots_for(model, wide))):
        logp, at_tokens = _full_logp(model, prompt, row.tokens, temperature or 1.0)
        np.testing.assert_allclose(row.logprobs, at_tokens, atol=1e-5)
        if not temperature:
            assert row.tokens == np.asarray(logp).argmax(-1).tolist()


def test_a_dropped_row_frees_its_slot_for_a_waiting_one(model):
    graphdef, params = nnx.split(model)
    slots = slots_for(model, Shapes(max_seq_len=32, chunk=4, max_batch=2, decode_steps=3))
    gone, kept, waiting = Row([1, 2], 20, 1), Row([3, 4], 9, 2), Row([5, 6], 6, 3)
    slots.add([gone, kept, waiting])
    slots.step(graphdef, params, 0)
    assert slots.rows == [gone, kept] and list(slots.waiting) == [waiting]
    slots.drop([gone])
    slots.step(graphdef, params, 0)
    assert slots.rows == [waiting, kept] and gone.tokens == [] and gone.finish_reason is None  # nobody waits for it
    while slots.busy():
        slots.step(graphdef, params, 0)
    for row in (kept, waiting):
        same(row, run(model, [Row(row.prompt, row.max_tokens, row.seed)])[0])


def test_new_weights_between_decode_calls_reach_the_rows_under_way(model):
    """A swap between two calls: a live row keeps its keys and values and samples its next tokens
    with the new weights; each token carries the version that computed its logits. Nothing it
    cached under the old weights serves a request under the new ones."""
    graphdef, params = nnx.split(model)
    new_params = jax.tree.map(lambda x: x * 1.5, params)
    prompt = [5, 6, 7, 8]
    slots = slots_for(model, prefix_rows=4)
    row = Row(prompt, 9, 0)
    slots.add([row])
    slots.step(graphdef, params, 0)
    slots.step(graphdef, new_params, 1)
    while slots.busy():
        slots.step(graphdef, new_params, 1)
    # The token sampled first after the swap came from logits of the old weights.
    assert row.versions == [0] * 4 + [1] * 5
    [old] = run(model, [Row(prompt, 4, 0)])
    same(Row(prompt, 4, 0, tokens=row.tokens[:4], logprobs=row.logprobs[:4]), old)
    # The later ones: the new weights over the old weights' keys of the prompt and first 3 tokens.
    seq, L = prompt + row.tokens, len(prompt) + 3
    empty = KVCache.empty(model.cfg, 1, 32)
    _, cache = model(jnp.asarray([seq[:L]]), jnp.arange(L)[None], jnp.ones((1, L), bool), empty)
    new_model = nnx.merge(graphdef, new_params)
    rest = seq[L:-1]
    logits, _ = new_model(jnp.asarray([rest]), L + jnp.arange(len(rest))[None], jnp.ones((1, len(rest)), bool), cache)
    logp = np.asarray(jax.nn.log_softmax(logits[0], -1))
    np.testing.assert_allclose(row.logprobs[4:], logp[np.arange(len(rest)), row.tokens[4:]], atol=1e-5)

    before = slots.prefix.stats["cached_tokens"]
    [turn] = run(new_model, [Row(prompt + row.tokens + [3], 2, 0)], slots, version=1)
    assert slots.prefix.stats["cached_tokens"] == before  # the row saw two versions: not kept
    run(new_model, [Row(prompt + row.tokens + [3] + turn.tokens + [4], 2, 0)], slots, version=1)
    assert slots.prefix.stats["cached_tokens"] == before + len(prompt + row.tokens) + len(turn.tokens)


def test_a_batch_prefills_its_leaders_in_blocks_and_every_row_samples_what_it_samples_alone(model):
    """17 rows (blocks of 2 prefilled together, the last one partial): groups sharing a prompt
    interleaved with rows of their own, prompt rests of one to four chunks, one row continuing
    from the prefix cache. Each row samples the tokens it samples alone."""
    shapes = Shapes(max_seq_len=32, chunk=4, max_batch=17)
    rng = np.random.default_rng(0)
    shared = [list(rng.integers(1, 128, n)) for n in (3, 14)]
    earlier = list(rng.integers(1, 128, 6))
    prompts = [shared[0], list(rng.integers(1, 128, 9)), shared[1], shared[0], earlier + [7, 8, 9],
               shared[1], list(rng.integers(1, 128, 16)), shared[0], shared[1], [5]]
    prompts += [list(rng.integers(1, 128, n)) for n in (2, 5, 11, 1, 7, 13, 4)]
    seeds = range(100, 100 + len(prompts))

    cache = slots_for(model, shapes, prefix_rows=17)
    run(model, [Row(earlier, 1, 1)], cache)
    batched = run(model, [Row(p, 6, s) for p, s in zip(prompts, seeds)], cache)
    assert cache.prefix.stats["cached_tokens"] == len(earlier) + 2 * len(shared[0]) + 2 * len(shared[1])
    for prompt, seed, row in zip(prompts, seeds, batched):
        same(row, run(model, [Row(prompt, 6, seed)], slots_for(model, shapes))[0])


def test_a_sliding_layer_keeps_a_ring_of_its_window_in_the_slots_and_in_the_pool(oss_model):
    shapes = Shapes(max_seq_len=1024, chunk=64, max_batch=4)
    slots = slots_for(oss_model, shapes, prefix_rows=8)
    cfg, width = oss_model.cfg, shapes.width
    for cache, rows in ((slots.state.cache, 4), (slots.pool, 8 + 1)):
        assert [k.shape for k in cache.k_BxKxHxS] == [(rows, 2, 32, 8), (rows, 2, 32, width)]
        assert [v.shape for v in cache.v_BxKxSxH] == [(rows, 2, 8, 32), (rows, 2, width, 32)]
        assert cache.routes_BxSxU.shape == (rows, width, cfg.route_width)  # a route per position, as before
        # Keys and values of 2 heads of 32 float32s a slot: 8 + width slots a row, where full layers had 2 x width.
        assert sum(x.nbytes for x in cache.k_BxKxHxS + cache.v_BxKxSxH) == rows * 2 * (2 * 32 * 4) * (8 + width)


@pytest.mark.parametrize("chunk", [4, 16], ids=["chunks-within-the-window", "chunks-past-the-window"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_sliding_models_rows_past_its_window_sample_what_a_full_pass_gives(oss_model, chunk, temperature):
    """Rows of 13 to 40 tokens through a ring of 8 slots, prefilled in steps of fewer and of more tokens than
    it holds: every logprob is the full forward pass's, greedy its argmax."""
    shapes = Shapes(max_seq_len=48, chunk=chunk, max_batch=4, decode_steps=3)
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(1, 128, n)) for n in (3, 13, 30)]
    rows = run(oss_model, rows_of(prompts, 10, temperature=temperature, seed=4), slots_for(oss_model, shapes))
    for prompt, row in zip(prompts, rows):
        assert len(row.tokens) == 10
        logp, at_tokens = _full_logp(oss_model, prompt, row.tokens, temperature or 1.0)
        np.testing.assert_allclose(row.logprobs, at_tokens, atol=1e-5)
        if not temperature:
            assert row.tokens == np.asarray(logp).argmax(-1).tolist()


def test_a_sliding_models_next_turn_continues_from_the_pool_and_a_prompt_leaving_it_earlier_does_not(oss_model):
    """A next turn continues its episode's pool row (whose ring holds the window before it); a prompt sharing
    only its first 10 of 20 tokens is prefilled whole (the ring no longer holds the window before token
    10). Each samples what it samples without the pool, the full forward pass's logprobs."""
    shapes = Shapes(max_seq_len=48, chunk=4, max_batch=4, decode_steps=3)
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(1, 128, n)) for n in (12, 5)]
    cached = slots_for(oss_model, shapes, prefix_rows=4)
    first = run(oss_model, rows_of(prompts, 9, temperature=1.0, seed=0), cached)
    turns = [p + r.tokens + [11, 12, 13] for p, r in zip(prompts, first)]
    leaving = prompts[0][:10] + [99, 98]
    second = run(oss_model, rows_of(turns + [leaving], 16, temperature=1.0, seed=7), cached)
    assert cached.prefix.stats["cached_tokens"] == sum(len(p) + len(r.tokens) - 1 for p, r in zip(prompts, first))
    fresh = run(oss_model, rows_of(turns + [leaving], 16, temperature=1.0, seed=7), slots_for(oss_model, shapes))
    for prompt, row, alone in zip(turns + [leaving], second, fresh):
        same(row, alone)
        np.testing.assert_allclose(row.logprobs, _full_logp(oss_model, prompt, row.tokens, 1.0)[1], atol=1e-5)
