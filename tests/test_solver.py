"""Solver episodes: each bundled environment's solver wins through the real hook, and its replies,
written by an engine through the rollout loop, give the same episode token for token."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bridge.engines.base import Completion, SamplingParams
from bridge.envs.bundled import BUNDLED, NAMES
from bridge.envs.runtime import EnvRuntime
from bridge.envs.solver import solver_episode
from bridge.envs.spec import EnvSpec
from bridge.rollout import run_episode
from bridge.tool_calls import get_parser
from jaxrl.tiny_tokenizer import build_tokenizer
from scripted_engine import segments


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class ReplayEngine:
    """Writes the given model turns in order, token for token: a policy that learned a demonstration."""

    name, policy_version = "replay", 0

    def __init__(self, turns):
        self.turns = iter(turns)

    async def generate(self, prompts, params):
        ids = next(self.turns)
        return [[Completion(ids, [0.0] * len(ids), "stop", 0)]]


def in_process(name: str, **extra) -> EnvSpec:
    entry = BUNDLED[name]
    return EnvSpec(extra.pop("env_name", name), env_class=f"{entry.env_cls.__module__}:{entry.env_cls.__qualname__}",
                   action_class=f"{entry.action_cls.__module__}:{entry.action_cls.__qualname__}",
                   **{"solver": name, **extra})


SPECS = [in_process(name) for name in NAMES] + [in_process("guess_number", env_name="guess_tool", action="tool",
                                                           tool_name="act")]


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_the_solver_wins_and_its_replies_replay_through_the_rollout_loop(tok, spec):
    runtime = EnvRuntime([spec], tok, get_parser())
    task = {"seed": 5, "split": "train"}

    async def play():
        await runtime.start()
        demo = await solver_episode(runtime, "g", 0, spec.name, task)
        engine = ReplayEngine([ids for m, ids in segments(demo) if m == 1])
        params = SamplingParams(max_tokens=64, max_turns=64, max_total_tokens=4096)
        replay = await run_episode(engine, "g", 0, [], params, runtime.hook(spec.name, task), env=spec.name)
        await runtime.aclose()
        return demo, replay

    demo, replay = asyncio.run(play())
    assert demo.rewards == {"env": 1.0} and demo.finish_reason == "env_done", demo.error
    parts = segments(demo)
    model_turns = [ids for m, ids in parts if m == 1]
    assert [m for m, _ in parts] == [1, 0] * (len(model_turns) - 1) + [1]
    assert all(ids[-1] == tok.eos_token_id for ids in model_turns)
    assert all(tok.decode(ids).endswith("<|im_start|>assistant\n") for m, ids in parts if m == 0)
    if spec.name.startswith("guess"):
        assert tok.decode(model_turns[0]).startswith("<tool_call>\n{")
    assert replay.rewards == {"env": 1.0}
    for field in ("prompt_ids", "completion_ids", "loss_mask"):
        np.testing.assert_array_equal(getattr(replay, field), getattr(demo, field))


def test_a_failing_solver_ends_its_episode_as_an_error(tok):
    spec = in_process("echo", env_name="echo", solver="guess_number")  # the wrong solver for this game
    runtime = EnvRuntime([spec], tok, get_parser())

    async def play():
        await runtime.start()
        try:
            return await solver_episode(runtime, "g", 0, "echo", {"seed": 1})
        finally:
            await runtime.aclose()

    traj = asyncio.run(play())
    assert traj.finish_reason == "error" and traj.error.startswith("solver: ")


def test_a_solver_the_environment_does_not_stop_in_time_ends_as_an_error(tok, monkeypatch):
    import bridge.envs.solver

    monkeypatch.setattr(bridge.envs.solver, "MAX_SOLVER_TURNS", 1)  # guess_number's solver needs several guesses
    spec = in_process("guess_number")
    runtime = EnvRuntime([spec], tok, get_parser())

    async def play():
        await runtime.start()
        try:
            return await solver_episode(runtime, "g", 0, spec.name, {"seed": 0, "split": "train"})  # five guesses
        finally:
            await runtime.aclose()

    traj = asyncio.run(play())
    assert traj.finish_reason == "error" and traj.num_turns == 1
    assert traj.error == "solver: the environment did not end the episode within 1 turns (it ended by 'max_turns')"
