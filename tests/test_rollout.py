"""Episodes over the real JAX engine: token-in/token-out turns, masks, and how episodes end."""

import asyncio
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from bridge.engines.base import Completion, SamplingParams, derive_seed
from bridge.engines.jax_engine import JaxEngine
from bridge.rollout import ENV_VERSION, TurnResult, run_episode
from jaxrl.tiny import build_tiny_model

TOOL_RESULT = [7, 8, 9]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return JaxEngine(build_tiny_model(tmp_path_factory.mktemp("model"), "qwen3"))


class ToolHook:
    """Answers every turn with TOOL_RESULT; done after `done_after` turns; may fail on a turn."""

    def __init__(self, done_after=99, fail_on=None):
        self.done_after, self.fail_on, self.turns, self.closed = done_after, fail_on, [], False

    async def start(self):
        return [3, 3]

    async def turn(self, completion_ids):
        self.turns.append(list(completion_ids))
        if len(self.turns) == self.fail_on:
            raise ConnectionError("environment went away")
        done = len(self.turns) >= self.done_after
        return TurnResult([] if done else TOOL_RESULT, done, {"env": float(len(self.turns))})

    async def finish(self, trajectory):
        return {}

    async def close(self):
        self.closed = True


PARAMS = SamplingParams(temperature=1.0, max_tokens=5, seed=0)


class SilentHook(ToolHook):
    """An environment that answers nothing and is not done (a TRL class without tools)."""

    async def turn(self, completion_ids):
        self.turns.append(list(completion_ids))
        return TurnResult([], False, {})


def test_single_turn_episode_is_the_engine_completion(engine):
    traj = asyncio.run(run_episode(engine, "g", 0, [1, 2, 3], PARAMS))
    [[direct]] = asyncio.run(engine.generate([[1, 2, 3]], dataclasses.replace(PARAMS, seed=derive_seed(0, 0))))
    assert traj.completion_ids.tolist() == direct.token_ids
    np.testing.assert_array_equal(traj.sampler_logprobs, np.float32(direct.logprobs))
    assert traj.loss_mask.tolist() == [1] * len(direct.token_ids)
    assert traj.finish_reason == direct.finish_reason and traj.num_turns == 1


def test_tool_tokens_are_context_with_mask_zero(engine):
    hook = ToolHook(done_after=3)
    params = dataclasses.replace(PARAMS, max_turns=5, max_total_tokens=100)
    traj = asyncio.run(run_episode(engine, "g", 1, [1, 2], params, hook, env="tools"))
    assert traj.prompt_ids.tolist() == [1, 2, 3, 3]  # the hook's start tokens extend the prompt
    assert traj.finish_reason == "env_done" and traj.num_turns == 3 and hook.closed
    assert traj.rewards == {"env": 3.0}
    pos = 0
    for i, turn in enumerate(hook.turns):
        # Each turn the hook saw is exactly the engine's tokens, kept as produced.
        assert traj.completion_ids[pos:pos + len(turn)].tolist() == turn
        assert traj.loss_mask[pos:pos + len(turn)].tolist() == [1] * len(turn)
        assert ENV_VERSION not in traj.token_versions[pos:pos + len(turn)]
        pos += len(turn)
        if i < 2:
            assert traj.completion_ids[pos:pos + 3].tolist() == TOOL_RESULT
            assert traj.loss_mask[pos:pos + 3].tolist() == [0, 0, 0]
            assert traj.token_versions[pos:pos + 3].tolist() == [ENV_VERSION] * 3
            assert traj.sampler_logprobs[pos:pos + 3].tolist() == [0.0] * 3
            pos += 3
    assert pos == len(traj.completion_ids) == len(traj.loss_mask) == len(traj.sampler_logprobs)


def test_an_moe_episodes_routes_cover_every_fed_token_turn_by_turn(tmp_path):
    from jaxrl.models import load_pretrained

    moe_dir = build_tiny_model(tmp_path, "qwen3_moe")
    moe_engine = JaxEngine(moe_dir)
    params = dataclasses.replace(PARAMS, max_turns=5, max_total_tokens=100)
    traj = asyncio.run(run_episode(moe_engine, "g", 0, [1, 2], params, ToolHook(done_after=3)))
    tokens = np.concatenate([traj.prompt_ids, traj.completion_ids])
    # The last turn's last token is never fed: every token before it has its route.
    assert traj.routes.shape == (len(tokens) - 1, moe_engine.cfg.route_width)
    model = load_pretrained(moe_dir)
    fed = jnp.asarray(tokens[None, :-1])
    _, _, routed = model.hidden(fed, jnp.arange(fed.shape[1])[None], jnp.ones_like(fed), routed=True)
    np.testing.assert_array_equal(traj.routes, np.asarray(routed.own_BxTxU[0]))


def test_each_turn_samples_with_a_seed_of_its_own(engine):
    hook = ToolHook(done_after=3)
    params = dataclasses.replace(PARAMS, max_turns=5, max_total_tokens=100)
    asyncio.run(run_episode(engine, "g", 0, [1, 2], params, hook))
    seeds = [derive_seed(PARAMS.seed, k) for k in range(3)]  # turn k's: distinct streams
    assert len(set(seeds)) == 3
    context = [1, 2, 3, 3]
    for turn, seed in zip(hook.turns, seeds, strict=True):
        [[direct]] = asyncio.run(engine.generate([context], dataclasses.replace(PARAMS, seed=seed)))
        assert direct.token_ids == turn
        context += turn + TOOL_RESULT


def test_a_turn_cut_by_max_tokens_that_nothing_answers_ends_by_length_not_max_turns(engine):
    traj = asyncio.run(run_episode(engine, "g", 0, [1], dataclasses.replace(PARAMS, max_turns=1), SilentHook()))
    assert len(traj.completion_ids) == PARAMS.max_tokens and traj.num_turns == 1  # cut, not stopped
    assert traj.finish_reason == "length"


def test_episodes_end_at_max_turns_and_at_the_token_budget(engine):
    params = dataclasses.replace(PARAMS, max_turns=2, max_total_tokens=100)
    traj = asyncio.run(run_episode(engine, "g", 0, [1], params, ToolHook()))
    assert traj.finish_reason == "max_turns" and traj.num_turns == 2
    params = dataclasses.replace(PARAMS, max_turns=50, max_total_tokens=12)
    traj = asyncio.run(run_episode(engine, "g", 0, [1], params, ToolHook()))
    assert traj.finish_reason == "length"
    # Turns of 5 and 4 tokens around one answer: the second answer does not fit and is not appended.
    assert traj.loss_mask.tolist() == [1] * 5 + [0] * 3 + [1] * 4 and traj.num_turns == 2


def test_a_failing_environment_ends_the_episode_with_an_error(engine):
    hook = ToolHook(fail_on=2)
    params = dataclasses.replace(PARAMS, max_turns=5, max_total_tokens=100)
    traj = asyncio.run(run_episode(engine, "g", 0, [1], params, hook))
    assert traj.finish_reason == "error"
    assert "ConnectionError: environment went away" in traj.error
    assert hook.closed and traj.num_turns == 2


class _SwappedMidCompletion:
    """An engine whose weights change while it samples: the last token comes from version 5."""

    policy_version = 4

    async def generate(self, prompts, params):
        return [[Completion([11, 12, 13], [-1.0, -2.0, -3.0], "length", 4, [4, 4, 5])]]


def test_each_token_keeps_the_version_that_sampled_it():
    params = SamplingParams(max_tokens=3, max_turns=2, max_total_tokens=32)
    traj = asyncio.run(run_episode(_SwappedMidCompletion(), "g", 0, [1, 2], params, ToolHook(done_after=2)))
    assert traj.token_versions.tolist() == [4, 4, 5] + [ENV_VERSION] * len(TOOL_RESULT) + [4, 4, 5]
    assert traj.loss_mask.tolist() == [1, 1, 1] + [0] * len(TOOL_RESULT) + [1, 1, 1]


def test_a_first_prompt_the_engine_cannot_hold_names_the_keys_that_size_it(engine):
    class LongObservation(ToolHook):
        async def start(self):
            return [3] * engine.shapes.max_seq_len

    hook = LongObservation()
    params = dataclasses.replace(PARAMS, max_turns=5, max_total_tokens=100)
    traj = asyncio.run(run_episode(engine, "g", 0, [1], params, hook, env="snake"))
    assert traj.finish_reason == "error" and hook.closed
    assert traj.error == (
        f"the first prompt of environment 'snake' has {engine.shapes.max_seq_len + 1} tokens, but the bridge holds "
        f"{engine.shapes.max_seq_len} tokens per sequence (rollout.max_prompt_tokens + rollout.max_total_tokens): "
        "raise rollout.max_prompt_tokens, or show the model less of each observation (the environment's "
        "observation_field or observation_template)")
