"""Custom rollout functions (`rollout_fn: module:function`): the generation handle, the checks on
what a function returns (each failure one line naming it), the TRL adapter, and episodes through a
real gRPC bridge next to a tool environment."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import numpy as np
import pytest

from bridge.client import BridgeClient
from bridge.engines.base import SamplingParams
from bridge.envs.runtime import runtime_from_dict
from bridge.envs.rollout_fn import Episode, GenerationHandle, Turn, from_trl, run_rollout_fn
from bridge.envs.spec import EnvConfigError, EnvSpec, RewardError, RolloutFnError
from bridge.wire import PromptGroup
from jaxrl.run.collection import check_rewards
from jaxrl.tiny_tokenizer import build_tokenizer
from scripted_engine import TOKEN, ScriptedEngine, in_process_bridge, segments, tool_call

TOK = build_tokenizer()
PARAMS = SamplingParams(max_tokens=16, stop_token_ids=(TOK.eos_token_id,), seed=7)


def policy(prompt: str) -> str:
    return "better answer" if "Revise" in prompt else "first answer"


async def answer_then_revise(task, handle):
    """Answers, is asked to revise, revises; rewarded on the revision."""
    messages = [{"role": "user", "content": f"Say something about {task['seed']}."}]
    prompt = handle.chat_ids(messages)
    answer = await handle.generate(prompt)
    ask = handle.reply_ids(answer, [{"role": "user", "content": "Revise it."}])
    revision = await handle.generate(prompt + answer.ids + ask, max_tokens=8)
    return Episode(prompt, [Turn.model(answer), Turn.context(ask), Turn.model(revision)],
                   {"revision": float("better" in revision.text), "answer": float("better" in answer.text)},
                   {"critiques": 1.0})


async def wrong_mask(task, handle):
    g = await handle.generate([1, 2, 3])
    return Episode([1, 2, 3], [Turn(g.ids, g.logprobs, [1] * (len(g.ids) - 1))], {"env": 1.0})


async def nan_reward(task, handle):
    g = await handle.generate([1, 2, 3])
    return Episode([1, 2, 3], [Turn.model(g)], {"env": math.nan})


async def retokenised(task, handle):
    g = await handle.generate([1, 2, 3])
    ids = TOK.encode(g.text + "!", add_special_tokens=False)
    return Episode([1, 2, 3], [Turn(ids, [-0.5] * len(ids), [1] * len(ids))], {"env": 1.0})


async def wrong_logprobs(task, handle):
    g = await handle.generate([1, 2, 3])
    return Episode([1, 2, 3], [Turn(g.ids, [0.0] * len(g.ids), [1] * len(g.ids))], {"env": 1.0})


async def raises(task, handle):
    raise ConnectionError("the judge is down")


async def ported_from_trl(task, handle):
    """A TRL rollout_func ported: its generation call becomes the handle's; its return goes through from_trl."""
    prompt_ids = handle.chat_ids([{"role": "user", "content": "Guess."}])
    out = await handle.generate(prompt_ids)
    return from_trl({"prompt_ids": [prompt_ids], "completion_ids": [out.ids], "logprobs": [out.logprobs],
                     "env_reward": [float(len(out.ids) > 2)]})


def sync_function(task, handle):
    return None


def run(fn, label="rollout_fn 'test_rollout_fn:fn'", max_total_tokens=None):
    engine = ScriptedEngine(TOK, policy)
    params = dataclasses.replace(PARAMS, max_total_tokens=max_total_tokens)
    return asyncio.run(run_rollout_fn(fn, label, engine, TOK, "g", 0, "crit", {"seed": 3}, params, {}))


def test_a_two_turn_episode_keeps_the_generated_tokens_and_masks_the_request():
    t = run(answer_then_revise)
    assert t.finish_reason == "stop" and not t.error and t.num_turns == 2
    (m1, first), (m0, ask), (m2, revision) = segments(t)
    assert (m1, m0, m2) == (1, 0, 1)
    assert TOK.decode(first, skip_special_tokens=True) == "first answer"
    assert TOK.decode(revision, skip_special_tokens=True) == "better answer"
    assert TOK.decode(ask) == TOK.apply_chat_template(
        [{"role": "user", "content": "-"}, {"role": "assistant", "content": "first answer"},
         {"role": "user", "content": "Revise it."}], tokenize=False, add_generation_prompt=True).split(
        "first answer" + TOK.eos_token)[1]
    assert t.rewards == {"revision": 1.0, "answer": 0.0} and t.metrics["critiques"] == 1.0
    assert t.sampler_logprobs.tolist() == [-0.5 if m else 0.0 for m in t.loss_mask]
    assert set(t.token_versions) == {0, -1}


def test_the_handle_seeds_each_call_of_an_episode_on_its_own():
    seen = []

    class Recording(ScriptedEngine):
        async def generate(self, prompts, params):
            seen.append(params.seed)
            return await super().generate(prompts, params)

    asyncio.run(run_rollout_fn(answer_then_revise, "p", Recording(TOK, policy), TOK, "g", 0, "crit", {"seed": 1},
                               PARAMS))
    assert len(seen) == 2 and len(set(seen)) == 2 and PARAMS.seed not in seen


@pytest.mark.parametrize("fn, error, message", [
    (wrong_mask, RolloutFnError, "rollout_fn 'test_rollout_fn:fn' (environment 'crit', episode g/0): turn 0 has 5 "
                                 "ids, 5 logprobs and 4 loss mask entries; they must be equal"),
    (nan_reward, RewardError, "rollout_fn 'test_rollout_fn:fn' (environment 'crit', episode g/0) (reward 'env') "
                              "returned nan; rewards must be finite (None: does not apply)"),
    (retokenised, RolloutFnError, "which the handle did not generate there (re-tokenised text?)"),
    (wrong_logprobs, RolloutFnError, "has logprob 0, but the handle generated that token with -0.5"),
])
def test_a_wrong_episode_stops_the_run_in_one_line_naming_the_function(fn, error, message):
    t = run(fn)
    assert t.finish_reason == "error"
    with pytest.raises(error) as caught:
        check_rewards([_data(t)])
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert "rollout_fn 'test_rollout_fn:fn'" in str(caught.value)


def test_an_episode_longer_than_the_token_budget_is_refused():
    t = run(answer_then_revise, max_total_tokens=8)
    assert t.error.startswith("RolloutFnError: ") and "over rollout.max_total_tokens=8" in t.error


def test_a_function_that_raises_costs_its_episode_not_the_run():
    t = run(raises)
    assert t.finish_reason == "error" and t.error == "ConnectionError: the judge is down"
    check_rewards([_data(t)])  # an environment failure, counted like one


def test_a_trl_rollout_func_ports_through_from_trl():
    t = run(ported_from_trl)
    assert not t.error and t.rewards == {"env_reward": 1.0} and all(t.loss_mask)
    with pytest.raises(RolloutFnError, match="field 'prompt_ids' must hold one entry"):
        from_trl({"prompt_ids": [1, 2], "completion_ids": [[3]], "logprobs": [[-0.5]]})


def test_a_rollout_fn_entry_is_checked_when_the_bridge_builds_it():
    with pytest.raises(EnvConfigError, match="must be an `async def` function"):
        runtime_from_dict({"envs": [{"name": "x", "rollout_fn": "test_rollout_fn:sync_function"}]}, TOK)
    with pytest.raises(EnvConfigError, match="has no 'nope'"):
        runtime_from_dict({"envs": [{"name": "x", "rollout_fn": "test_rollout_fn:nope"}]}, TOK)
    with pytest.raises(EnvConfigError, match="exactly one of bundled, url, env_class, rollout_fn"):
        EnvSpec("x", env_class="m:C", rollout_fn="m:f")
    with pytest.raises(EnvConfigError, match="no solver"):
        EnvSpec("x", rollout_fn="m:f", solver="echo")


class Coin:
    def reset(self, seed: int = 0, **task) -> str:
        self.seed = seed
        return "Flip the coin."

    def flip(self) -> str:
        """Flips the coin."""
        return "heads"

    def reward(self) -> float:
        return 1.0


def test_groups_of_a_rollout_fn_and_a_tool_environment_through_a_bridge():
    envs = {"envs": [{"name": "crit", "rollout_fn": "test_rollout_fn:answer_then_revise"},
                     {"name": "coin", "env_class": "test_rollout_fn:Coin"}]}
    engine = ScriptedEngine(TOK, lambda p: policy(p) if "coin" not in p else tool_call("flip", {}))
    with in_process_bridge(engine, envs, TOK) as address, BridgeClient(address, token=TOKEN) as client:
        groups = [PromptGroup(np.zeros(0, np.int32), f"c{i}", "crit", {"seed": i}) for i in range(2)]
        groups.append(PromptGroup(np.zeros(0, np.int32), "k", "coin", {"seed": 0}))
        trajs = list(client.rollout(groups, 3, dataclasses.replace(PARAMS, max_turns=2, max_total_tokens=64)))
    crit = [t for t in trajs if t.env == "crit"]
    assert len(crit) == 6 and {t.group_id for t in crit} == {"c0", "c1"}
    assert all(t.rewards == {"revision": 1.0, "answer": 0.0} and t.finish_reason == "stop" for t in crit)
    assert all(t.policy_version == 0 and t.metrics["critiques"] == 1.0 for t in crit)
    assert len([t for t in trajs if t.env == "coin" and t.rewards.get("env") == 1.0]) == 3


def _data(t):
    """A bridge Trajectory as the trainer receives it."""
    from bridge import wire

    return wire.trajectory_from_proto(wire.trajectory_to_proto(t))
