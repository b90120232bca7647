"""The JAX engine in-process: learner-equal logprobs, batching, stops, and in-place weight swaps."""

import asyncio
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bridge.engines.base import SamplingParams, SnapshotRefused
from bridge.engines.jax_engine import JaxEngine
from bridge.engines.scheduler import MIN_BATCH
from jaxrl.compilation import programs
from jaxrl.logprobs import completion_logprobs
from jaxrl.models import load_pretrained
from jaxrl.snapshots import SnapshotWriter
from jaxrl.tiny import build_tiny_model, tiny_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"), "qwen3")


def learner_logprobs(model, prompt, completion, temperature):
    logp, _ = completion_logprobs(
        model, jnp.asarray([prompt]), jnp.ones((1, len(prompt)), jnp.int32),
        jnp.asarray([completion]), jnp.ones((1, len(completion)), jnp.int32), temperature,
    )
    return np.asarray(logp[0])


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_the_learners(model_dir, temperature):
    engine = JaxEngine(model_dir)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    params = SamplingParams(n=3, temperature=temperature, max_tokens=12, seed=3)
    out = run(engine.generate(prompts, params))
    model = load_pretrained(model_dir)
    assert [len(group) for group in out] == [3, 3]
    for prompt, group in zip(prompts, out):
        assert len({tuple(c.token_ids) for c in group}) > 1, "n samples should differ"
        for c in group:
            assert c.policy_version == 0 and len(c.token_ids) == len(c.logprobs) == 12
            np.testing.assert_allclose(c.logprobs, learner_logprobs(model, prompt, c.token_ids, temperature), atol=1e-5)


def test_prompts_of_every_rest_prefill_in_chunks_and_tails_to_the_learners_logprobs(model_dir):
    # Chunks of 16, tails of 4: rests in tails only (1-8), in a chunk short of its width (9-16), in chunks
    # then tails; blocks of two rows, the longest rests together. Then a next turn whose chunk starts off
    # the chunks' grid, one token short of max_seq_len: its step writes past the prompt, within the width.
    engine = JaxEngine(model_dir, max_batch=2 * MIN_BATCH, max_seq_len=40, prefill_chunk=16, prefix_block=4)
    model = load_pretrained(model_dir)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=1.0, max_tokens=2, seed=5)
    prompts = [rng.integers(3, 200, n).tolist() for n in (1, 4, 8, 9, 12, 16, 17, 24, 28, 33, 38)]
    out = run(engine.generate(prompts, params))
    for prompt, [c] in zip(prompts, out):
        np.testing.assert_allclose(c.logprobs, learner_logprobs(model, prompt, c.token_ids, 1.0), atol=1e-5)
    turn = prompts[8] + out[8][0].token_ids + rng.integers(3, 200, 9).tolist()
    [[c]] = run(engine.generate([turn], SamplingParams(temperature=1.0, max_tokens=1, seed=5)))
    assert engine.stats["prefix_cached_tokens"] == 29 and len(turn) == 39  # a rest of 10: one chunk, from slot 29
    np.testing.assert_allclose(c.logprobs, learner_logprobs(model, turn, c.token_ids, 1.0), atol=1e-5)


def test_concurrent_requests_share_device_calls_and_keep_their_own_stops(model_dir):
    engine = JaxEngine(model_dir, batch_window_s=0.05)
    free = run(engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8)))[0][0]
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)

    async def both():
        return await asyncio.gather(
            engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop,))),
            engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8)),
        )

    stopped, unstopped = run(both())
    assert engine.stats["decode_calls"] == 2  # the free run, then both requests in one call
    assert engine.stats["insert_calls"] == 2  # each prefilled its rows once
    assert 0 < engine.stats["insert_s"] < engine.stats["device_s"] < engine.stats["busy_s"]
    assert stopped[0][0].token_ids == free.token_ids[: first + 1]
    assert stopped[0][0].finish_reason == "stop"
    assert unstopped[0][0].token_ids == free.token_ids
    assert unstopped[0][0].finish_reason == "length"


def test_one_program_per_batch_size_compiled_by_the_warm_up(model_dir, tmp_path):
    engine = JaxEngine(model_dir, max_batch=2 * MIN_BATCH, max_seq_len=128, prefill_chunk=16, warm_up=True)
    assert engine.shapes.batches() == [MIN_BATCH, 2 * MIN_BATCH]
    before = programs()
    for length, max_tokens, n in ((3, 5, 1), (40, 2, 3), (100, 20, 2), (7, 60, 12)):
        run(engine.generate([list(range(1, length + 1))], SamplingParams(max_tokens=max_tokens, seed=0, n=n)))
    more = run(engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=9, seed=0, n=9)))  # 18 rows, 16 slots
    assert [[len(c.token_ids) for c in group] for group in more] == [[9] * 9] * 2
    assert programs() == before
    model = load_pretrained(model_dir)  # generation with swapped-in weights compiles nothing either
    with contextlib.closing(SnapshotWriter(tmp_path, model.cfg)) as writer:
        writer.publish(nnx.split(model)[1], 1)
    run(engine.load_snapshot(str(tmp_path), 1))
    before = programs()
    for n in (1, 9):
        run(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, seed=0, n=n)))
    assert programs() == before


def test_stop_strings_cut_at_the_completing_token(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = JaxEngine(model_dir, tokenizer=tokenizer)
    free = run(engine.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=10)))[0][0]
    text = tokenizer.decode(free.token_ids)
    stop = text[len(tokenizer.decode(free.token_ids[:4])) - 1:][:1] or text[-1]
    out = run(engine.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=10, stop=(stop,))))[0][0]
    assert stop in tokenizer.decode(out.token_ids)
    assert stop not in tokenizer.decode(out.token_ids[:-1])
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: len(out.token_ids)]
    with pytest.raises(ValueError, match="stop strings need the engine's tokenizer"):
        run(JaxEngine(model_dir).generate([[1]], SamplingParams(stop=("x",))))


def test_load_snapshot_swaps_weights_and_refuses_bad_snapshots(model_dir, tmp_path):
    engine = JaxEngine(model_dir)
    model = load_pretrained(model_dir)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=1)
    prompt = [4, 5, 6]
    before = run(engine.generate([prompt], params))[0][0]

    perturbed = jax.tree.map(lambda x: x + 0.05 * jnp.sign(x), nnx.state(model, nnx.Param))
    writer = SnapshotWriter(tmp_path / "snaps", model.cfg)
    writer.publish(perturbed, version=7)
    served = engine.params
    served_values = [np.array(x) for x in jax.tree.leaves(served)]
    load_s = run(engine.load_snapshot(str(tmp_path / "snaps"), 7))
    assert load_s > 0 and engine.policy_version == 7
    # New params in the served ones' structure, dtypes and placement; the old ones untouched (a
    # generation that started before the swap goes on with them).
    assert jax.tree.structure(engine.params) == jax.tree.structure(served)
    for new, old, value in zip(jax.tree.leaves(engine.params), jax.tree.leaves(served), served_values):
        assert new.dtype == old.dtype and new.sharding == old.sharding
        np.testing.assert_array_equal(np.asarray(old), value)
    after = run(engine.generate([prompt], params))[0][0]
    assert after.policy_version == 7
    nnx.update(model, perturbed)
    new_ref = learner_logprobs(model, prompt, after.token_ids, 1.0)
    np.testing.assert_allclose(after.logprobs, new_ref, atol=1e-5)
    assert np.abs(np.asarray(after.logprobs) - np.asarray(before.logprobs)).max() > 1e-3 or after.token_ids != before.token_ids

    other_cfg = tiny_config("qwen3", vocab_size=model.cfg.vocab_size, intermediate_size=96)
    from jaxrl.models import Decoder

    SnapshotWriter(tmp_path / "other", other_cfg).publish(nnx.state(Decoder(other_cfg, nnx.Rngs(0)), nnx.Param), 8)
    with pytest.raises(SnapshotRefused, match=r"intermediate_size 96 \(serving 128\)"):
        run(engine.load_snapshot(str(tmp_path / "other"), 8))
    with pytest.raises(SnapshotRefused, match="no finished snapshot with version 9"):
        run(engine.load_snapshot(str(tmp_path / "snaps"), 9))
    assert engine.policy_version == 7
    still = run(engine.generate([prompt], params))[0][0]
    assert still.token_ids == after.token_ids and still.policy_version == 7


def test_a_bfloat16_snapshot_loads_into_a_float32_engine(model_dir, tmp_path):
    engine = JaxEngine(model_dir)
    model = load_pretrained(model_dir)
    assert model.cfg.param_dtype == "float32"
    perturbed = jax.tree.map(lambda x: x * 1.5, nnx.state(model, nnx.Param))
    SnapshotWriter(tmp_path, model.cfg, dtype="bfloat16").publish(perturbed, 3)
    run(engine.load_snapshot(str(tmp_path), 3))
    want = jax.tree.map(lambda x: np.asarray(x[...].astype(jnp.bfloat16).astype(jnp.float32)), perturbed)
    for got, expected in zip(jax.tree.leaves(engine.params), jax.tree.leaves(want)):
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got), expected)


def test_bad_requests_are_refused(model_dir):
    engine = JaxEngine(model_dir)
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        run(engine.generate([[1], []], SamplingParams()))
    with pytest.raises(ValueError, match="9 stop_token_ids, but the jax engine takes at most 8"):
        run(engine.generate([[1]], SamplingParams(stop_token_ids=tuple(range(9)))))
    with pytest.raises(ValueError, match="n=0 must be >= 1"):
        SamplingParams(n=0)


def test_an_episodes_next_turn_reuses_its_cached_prefix_until_the_weights_change(model_dir):
    engine = JaxEngine(model_dir, max_batch=2, max_seq_len=64, prefix_block=4)  # found by blocks of 4 tokens
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=3)
    prompt = [5, 6, 7, 8, 9]
    [[first]] = run(engine.generate([prompt], params))
    turn = prompt + first.token_ids + [10, 11]
    [[second]] = run(engine.generate([turn], params))
    assert engine.stats["prefix_cached_tokens"] == len(prompt) + len(first.token_ids) - 1
    engine.policy_version += 1  # as a snapshot swap does: keys and values of the old weights are stale
    [[again]] = run(engine.generate([turn], params))
    assert engine.stats["prefix_cached_tokens"] == len(prompt) + len(first.token_ids) - 1
    assert again.token_ids == second.token_ids and again.logprobs == pytest.approx(second.logprobs, abs=1e-5)


def test_slots_ending_with_nothing_to_keep_are_freed_without_a_copy(model_dir):
    from bridge.engines.slots import insert
    from bridge.engines.scheduler import Plan

    engine = JaxEngine(model_dir, max_batch=4, max_seq_len=64, prefill_chunk=16, decode_steps=4)
    slots, scratch = engine.slots, engine.slots.prefix.scratch
    run(engine.generate([[5, 6, 7, 8, 9]] * 3, SamplingParams(max_tokens=4, seed=1)))
    slots.state = slots.state._replace(cache=slots.state.cache._replace(length_B=jnp.asarray([9, 8, 7, 0], jnp.int32)))
    none = np.zeros(0, np.int32)
    plan = Plan(np.asarray([0, 1, 2], np.int32), np.asarray([scratch, 3, scratch], np.int32), none, none, [], none,
                none, none, none, 0, 8)
    arrays = slots._insert_arrays(plan)
    assert int(arrays.n_save) == 1 and (arrays.save_slot[0], arrays.save_row[0]) == (1, 3)
    keys_of_slot_1 = np.asarray(slots.state.cache.k_BxKxHxS[0][1, ..., :8])
    slots.pool, slots.state = insert(engine.params, engine.graphdef, slots.pool, slots.state, arrays,
                                     chunk=16, tail=4, width=slots.shapes.window(8))
    np.testing.assert_array_equal(np.asarray(slots.pool.k_BxKxHxS[0][3, ..., :8]), keys_of_slot_1)
    assert np.asarray(slots.state.cache.length_B).tolist() == [0, 0, 0, 0]


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory):
    """gpt-oss: sinks, and every other layer sliding over 128 keys (the released window): in the group test
    a window that starts inside the group's shared prefix, past a row's first tokens, and in prefills."""
    return build_tiny_model(tmp_path_factory.mktemp("oss"), "gpt_oss", sliding_window=128)


@pytest.mark.parametrize("directory", ["model_dir", "oss_dir"])
def test_a_groups_rows_read_their_shared_prompt_once_and_sample_what_they_sample_apart(directory, request):
    model_dir = request.getfixturevalue(directory)

    def engine(prefix_block):  # found by blocks of 4 tokens, or of 256: no prompt here has a whole block
        return JaxEngine(model_dir, max_batch=MIN_BATCH, max_seq_len=256, prefill_chunk=16, decode_steps=8,
                         prefix_block=prefix_block)

    shared, apart = engine(4), engine(256)
    prompt = [3 + i % 200 for i in range(120)]  # with the tokens sampled, more than the 136 slots a row reads
    first = SamplingParams(n=MIN_BATCH, max_tokens=30, seed=7)
    [group], [group_apart] = run(shared.generate([prompt], first)), run(apart.generate([prompt], first))
    turns = [prompt + c.token_ids + [40, 41] for c in group]  # each row's next turn
    later = SamplingParams(max_tokens=20, seed=8)
    out, out_apart = run(shared.generate(turns, later)), run(apart.generate(turns, later))
    assert shared.stats["shared_decode_calls"] >= 4 and apart.stats["shared_decode_calls"] == 0  # of 7 calls: not where all fit
    model = load_pretrained(model_dir)
    for context, c, c_apart in [(prompt, a, b) for a, b in zip(group, group_apart)] + [
            (t, a, b) for t, [a], [b] in zip(turns, out, out_apart)]:
        assert c.token_ids == c_apart.token_ids
        np.testing.assert_allclose(c.logprobs, c_apart.logprobs, atol=1e-5)
        np.testing.assert_allclose(c.logprobs, learner_logprobs(model, context, c.token_ids, 1.0), atol=1e-5)


@pytest.fixture(scope="module")
def oss8_dir(tmp_path_factory):
    """gpt-oss whose sliding layers (every other one) keep rings of 8 slots: prompts and turns far past them."""
    return build_tiny_model(tmp_path_factory.mktemp("oss8"), "gpt_oss", sliding_window=8)


def test_a_sliding_window_engine_samples_the_learners_greedy_tokens_past_its_window_and_next_turns(oss8_dir):
    engine = JaxEngine(oss8_dir, max_batch=4, max_seq_len=64, prefill_chunk=16, prefix_block=4)
    width = engine.shapes.width
    for cache in (engine.slots.state.cache, engine.slots.pool):  # the decode slots' and the prefix pool's
        assert [k.shape[-1] for k in cache.k_BxKxHxS] == [v.shape[2] for v in cache.v_BxKxSxH] == [8, width]
    model = load_pretrained(oss8_dir)
    rng = np.random.default_rng(1)
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    prompts = [rng.integers(3, 200, n).tolist() for n in (3, 13, 30)]
    first = [c for [c] in run(engine.generate(prompts, greedy))]
    turns = [p + c.token_ids + [40, 41] for p, c in zip(prompts, first)]  # of up to 42 tokens, then 10 more
    second = [c for [c] in run(engine.generate(turns, greedy))]
    assert engine.stats["prefix_cached_tokens"] == sum(len(p) + len(c.token_ids) - 1 for p, c in zip(prompts, first))
    for context, c in zip(prompts + turns, first + second):
        n = len(context) + len(c.token_ids)
        logits, _ = model(jnp.asarray([context + c.token_ids]), jnp.arange(n)[None], jnp.ones((1, n), jnp.int32))
        assert len(c.token_ids) == 10 and c.token_ids == np.asarray(logits[0, len(context) - 1:-1]).argmax(-1).tolist()
        np.testing.assert_allclose(c.logprobs, learner_logprobs(model, context, c.token_ids, 1.0), atol=1e-5)


@pytest.fixture(scope="module")
def slot_engine(model_dir):
    """4 slots advanced 4 tokens per device call, every program compiled up front."""
    return JaxEngine(model_dir, max_batch=4, max_seq_len=64, prefill_chunk=16, decode_steps=4, warm_up=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_joins_running_slots_and_samples_what_it_samples_alone(slot_engine, temperature):
    engine = slot_engine
    target = ([[9, 8, 7, 6, 5]], SamplingParams(temperature=temperature, max_tokens=12, seed=5))
    [[alone]] = run(engine.generate(*target))

    async def scenario():
        long = asyncio.create_task(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=40, seed=1)))
        await engine.generate([[4, 5]], SamplingParams(max_tokens=2, seed=2))  # done after the first call
        joined = await engine.generate(*target)
        return await long, joined

    before, compiled = engine.stats["decode_calls"], programs()
    [[long]], [[joined]] = run(scenario())
    assert engine.stats["decode_calls"] - before == 10  # the long row's 10 calls: the others rode along
    assert programs() == compiled
    assert joined.token_ids == alone.token_ids and len(long.token_ids) == 40
    np.testing.assert_allclose(joined.logprobs, alone.logprobs, atol=1e-5)


def test_new_weights_reach_a_completion_under_way_and_tag_its_tokens(slot_engine):
    engine = slot_engine
    params = SamplingParams(max_tokens=40, seed=1)
    [[old]] = run(engine.generate([[1, 2, 3]], params))
    served = engine.params
    new = jax.tree.map(lambda x: x * 1.5, served)

    async def scenario():
        long = asyncio.create_task(engine.generate([[1, 2, 3]], params))
        await engine.generate([[4, 5]], SamplingParams(max_tokens=2, seed=2))  # done after the first call
        await engine.swap(new, 1)  # from the second call on
        return await long

    compiled = programs()
    try:
        [[swapped]] = run(scenario())
        [[after]] = run(engine.generate([[1, 2, 3]], params))
    finally:
        run(engine.swap(served, 0))
    assert programs() == compiled
    # One call of 4 tokens, and the token sampled from the logits that call left: old weights.
    assert swapped.token_versions == [0] * 5 + [1] * 35 and swapped.policy_version == 0
    assert swapped.token_ids[:5] == old.token_ids[:5]
    np.testing.assert_allclose(swapped.logprobs[:5], old.logprobs[:5], atol=1e-5)
    assert swapped.token_ids != old.token_ids
    assert after.token_versions == [1] * 40 and after.policy_version == 1


def test_an_adapter_snapshot_serves_the_learners_lora_model(model_dir, tmp_path):
    from jaxrl.learner import Learner
    from jaxrl.losses import LossConfig
    from jaxrl.models.lora import LoraConfig, adapter_config
    from jaxrl.optim import OptimizerConfig
    from jaxrl.sharding import MeshConfig, make_mesh
    from jaxrl.train_step import LearnerConfig

    from batches import make_batch

    lora = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "up_proj", "down_proj"))
    engine = JaxEngine(model_dir, lora=adapter_config(lora))
    prompt, params = [4, 5, 6], SamplingParams(temperature=1.0, max_tokens=8, seed=2)
    base = run(engine.generate([prompt], params))[0][0]
    np.testing.assert_allclose(base.logprobs, learner_logprobs(load_pretrained(model_dir), prompt, base.token_ids, 1.0),
                               atol=1e-5)  # zero adapters: the base model

    cfg = LearnerConfig(group_size=4, lora=lora, loss=LossConfig(loss_type="dapo"),
                        optimizer=OptimizerConfig(learning_rate=0.05))
    learner = Learner(load_pretrained(model_dir), cfg, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    for seed in range(2):
        learner.update(make_batch(seed))
    writer = SnapshotWriter(tmp_path / "snaps", learner.model().cfg, lora=lora, base_model=str(model_dir))
    writer.publish(learner.state.params, version=2)
    served = engine.params
    run(engine.load_snapshot(str(tmp_path / "snaps"), 2))
    # The base arrays are the ones loaded at start, shared; only the adapters are new.
    flat_old, flat_new = nnx.to_flat_state(served), nnx.to_flat_state(engine.params)
    assert [p for p, _ in flat_old] == [p for p, _ in flat_new]
    for (path, old), (_, new) in zip(flat_old, flat_new):
        assert (old[...] is new[...]) == ("lora" not in path), path
    after = run(engine.generate([prompt], params))[0][0]
    assert after.policy_version == 2
    np.testing.assert_allclose(after.logprobs, learner_logprobs(learner.model(), prompt, after.token_ids, 1.0),
                               atol=1e-5)
    assert np.abs(np.asarray(learner_logprobs(learner.model(), prompt, after.token_ids, 1.0)) -
                  learner_logprobs(load_pretrained(model_dir), prompt, after.token_ids, 1.0)).max() > 1e-3

    model = load_pretrained(model_dir)
    SnapshotWriter(tmp_path / "whole", model.cfg).publish(nnx.state(model, nnx.Param), 3)
    with pytest.raises(SnapshotRefused, match="holds whole weights, but this engine serves adapters"):
        run(engine.load_snapshot(str(tmp_path / "whole"), 3))
    other = LoraConfig(rank=8, alpha=8.0, targets=lora.targets)
    from jaxrl.models.lora import add_lora

    SnapshotWriter(tmp_path / "rank8", model.cfg, lora=other).publish(
        nnx.state(add_lora(load_pretrained(model_dir), other), nnx.LoRAParam), 4)
    with pytest.raises(SnapshotRefused, match="adapters of rank 8"):
        run(engine.load_snapshot(str(tmp_path / "rank8"), 4))
    with pytest.raises(SnapshotRefused, match="holds LoRA adapters, but this engine serves whole weights"):
        run(JaxEngine(model_dir).load_snapshot(str(tmp_path / "snaps"), 2))
    assert engine.policy_version == 2


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe")


def own_routes(model, tokens):
    """The model's own route of every token in one full forward pass."""
    tokens = jnp.asarray([tokens])
    _, _, routed = model.hidden(tokens, jnp.arange(tokens.shape[1])[None], jnp.ones_like(tokens), routed=True)
    return np.asarray(routed.own_BxTxU[0])


@pytest.mark.parametrize("directory", ["moe_model_dir", "oss8_dir"])  # gpt-oss: routes of every position, rings of 8
def test_an_moe_engine_records_every_fed_tokens_route_in_prefill_decode_and_cached_prefixes(directory, request):
    moe_model_dir = request.getfixturevalue(directory)
    engine = JaxEngine(moe_model_dir, max_batch=MIN_BATCH, max_seq_len=256, prefill_chunk=16, decode_steps=8,
                       prefix_block=4, warm_up=True)
    model = load_pretrained(moe_model_dir)
    before = programs()
    prompt = [3 + i % 200 for i in range(120)]  # shared by a group: decoded reading it once
    [group] = run(engine.generate([prompt], SamplingParams(n=MIN_BATCH, max_tokens=30, seed=7)))
    turns = [prompt + c.token_ids + [40, 41] for c in group]  # next turns: their prefixes come from the pool
    later = run(engine.generate(turns, SamplingParams(max_tokens=20, seed=8)))
    assert engine.stats["shared_decode_calls"] > 0 and engine.stats["prefix_cached_tokens"] > 0
    assert programs() == before, "the routes' reads are compiled by the warm-up"
    for context, c in [(prompt, c) for c in group] + [(t, c) for t, [c] in zip(turns, later)]:
        fed = context + c.token_ids[:-1]
        assert c.routes.dtype == np.uint8 and c.routes.shape == (len(fed), model.cfg.route_width)
        np.testing.assert_array_equal(c.routes, own_routes(model, fed))
        np.testing.assert_allclose(c.logprobs, learner_logprobs(model, context, c.token_ids, 1.0), atol=1e-5)


def test_a_dense_engine_reports_no_routes(model_dir):
    [[c]] = run(JaxEngine(model_dir).generate([[5, 6, 7]], SamplingParams(max_tokens=3, seed=0)))
    assert c.routes is None
