"""The warm start: solver demonstrations through the real hook, their batches, a short SFT run,
and held-out evaluation (its accounting exactly, with scripted engines; a tiny model end to end)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from bridge.engines.base import Completion, SamplingParams
from bridge.envs.bundled import NAMES
from bridge.envs.episode import EnvRuntime
from bridge.envs.spec import EnvSpec
from bridge.rollout import Trajectory, run_episode
from bridge.tool_calls import get_parser
from jaxrl.run.config import SFTConfig
from jaxrl.models import load_pretrained
from jaxrl.run.warm_start import demonstrations, evaluate, in_process_spec, run_sft, sft_batch
from jaxrl.sharding import MeshConfig
from jaxrl.tiny import build_tiny_model
from jaxrl.tiny_tokenizer import build_tokenizer
from scripted_engine import ScriptedEngine, segments


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tok):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", tokenizer=tok)


class ReplayEngine:
    """Writes the given model turns in order, token for token: a policy that learned a demonstration."""

    name, policy_version = "replay", 0

    def __init__(self, turns):
        self.turns = iter(turns)

    async def generate(self, prompts, params):
        ids = next(self.turns)
        return [[Completion(ids, [0.0] * len(ids), "stop", 0)]]


SPECS = [EnvSpec(name, bundled=name) for name in NAMES] + [
    EnvSpec("guess_tool", bundled="guess_number", action="tool", tool_name="act")]


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_demonstrations_win_and_replay_through_the_rollout_loop(tok, spec):
    demos = demonstrations([spec], tok, 3, seed=5)
    assert len(demos) == 3
    for demo in demos:
        assert demo.rewards == {"env": 1.0} and demo.finish_reason == "env_done"
        assert len(demo.loss_mask) == len(demo.completion_ids)
        parts = segments(demo)
        model_turns = [ids for m, ids in parts if m == 1]
        assert [m for m, _ in parts] == [1, 0] * (len(model_turns) - 1) + [1]
        assert all(ids[-1] == tok.eos_token_id for ids in model_turns)
        assert all(tok.decode(ids).endswith("<|im_start|>assistant\n") for m, ids in parts if m == 0)
        if spec.name.startswith("guess"):
            assert tok.decode(model_turns[0]).startswith("<tool_call>\n{")

    # The model turns, played by an engine through the real rollout loop, give the same episode.
    demo = demos[0]
    runtime = EnvRuntime([in_process_spec(spec)], tok, get_parser())

    async def replay():
        await runtime.start()
        hook = runtime.hook(spec.name, {"seed": 5, "split": "train"})
        engine = ReplayEngine([ids for m, ids in segments(demo) if m == 1])
        return await run_episode(engine, "g", 0, [], SamplingParams(max_tokens=64), hook, env=spec.name,
                                 max_turns=64, max_total_tokens=4096)

    traj = asyncio.run(replay())
    assert traj.rewards == {"env": 1.0}
    assert (traj.prompt_ids, traj.completion_ids, traj.loss_mask) == (
        demo.prompt_ids, demo.completion_ids, demo.loss_mask)


def test_demonstrations_need_a_solver(tok):
    with pytest.raises(ValueError, match=r"\['remote'\] have no solver"):
        demonstrations([EnvSpec("remote", url="http://127.0.0.1:1")], tok, 2)


def test_demonstrations_split_over_environments_and_stay_in_their_split(tok):
    demos = demonstrations([EnvSpec("echo", bundled="echo"), EnvSpec("guess", bundled="guess_number")], tok, 5)
    assert [d.env for d in demos] == ["echo"] * 3 + ["guess"] * 2
    from bridge.envs.bundled.echo import task_for_seed

    targets = [tok.decode(d.completion_ids, skip_special_tokens=True) for d in demos[:3]]
    assert targets == [task_for_seed(s, "train")["target"] for s in range(3)]


def test_sft_batch_pads_prompts_left_and_completions_right():
    a = Trajectory("g", 0, [5, 6, 7], [8, 9, 10, 11], loss_mask=[1, 1, 0, 1])
    b = Trajectory("g", 1, [4], [3], loss_mask=[1])
    batch = sft_batch([a, b], pad_id=0, prompt_len=4, completion_len=6)
    assert {k: v.shape for k, v in batch.items()} == {
        "prompt_BxP": (2, 4), "prompt_mask_BxP": (2, 4), "completion_BxC": (2, 6),
        "completion_mask_BxC": (2, 6), "loss_mask_BxC": (2, 6), "rewards_BxR": (2, 1)}
    np.testing.assert_array_equal(batch["prompt_BxP"], [[0, 5, 6, 7], [0, 0, 0, 4]])
    np.testing.assert_array_equal(batch["prompt_mask_BxP"], [[0, 1, 1, 1], [0, 0, 0, 1]])
    np.testing.assert_array_equal(batch["completion_BxC"], [[8, 9, 10, 11, 0, 0], [3, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["completion_mask_BxC"], [[1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["loss_mask_BxC"], [[1, 1, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0]])
    assert not batch["rewards_BxR"].any()
    assert sft_batch([a, b], pad_id=0)["completion_BxC"].shape == (2, 4)  # widths default to the longest
    with pytest.raises(ValueError, match="trajectory 0 .* 3 prompt / 4 completion tokens .* holds 2 / 6"):
        sft_batch([a, b], pad_id=0, prompt_len=2, completion_len=6)


def test_short_sft_run_lowers_the_loss_and_writes_a_model(tiny_dir, tmp_path, tok):
    cfg = SFTConfig(steps=12, batch_size=8, learning_rate=1e-2, demonstrations=16)
    seen = []
    out = tmp_path / "sft"
    metrics = run_sft(tiny_dir, out, [EnvSpec("echo", bundled="echo")], cfg, MeshConfig(fsdp=-1),
                      on_step=lambda step, m: seen.append(step))
    assert seen == list(range(12))
    assert metrics["loss"] < metrics["loss_first"] - 1.0
    assert 0 < metrics["token_accuracy"] <= 1 and metrics["demonstrations"] == 16
    assert load_pretrained(out).cfg.vocab_size == len(tok)
    assert (out / "tokenizer_config.json").exists()


class Echo:
    """Scripted echo policies: right on every task, or on even targets' lengths only."""

    @staticmethod
    def right(prompt):
        return prompt.split("Repeat exactly: ")[-1].split("<|im_end|>")[0]

    @staticmethod
    def half(prompt):
        target = Echo.right(prompt)
        return target if len(target) % 2 == 0 else "no"


def test_evaluate_counts_successes_and_standard_errors(tok):
    specs = [EnvSpec("echo", bundled="echo")]
    right = evaluate(ScriptedEngine(tok, Echo.right), specs, "echo", 10, tokenizer=tok)
    assert right["success_rate"] == 1.0 and right["success_stderr"] == 0.0 and right["episodes"] == 10
    assert right["mean_reward"] == 1.0 and right["errors"] == 0

    from bridge.envs.bundled.echo import task_for_seed

    even = np.mean([len(task_for_seed(s, "test")["target"]) % 2 == 0 for s in range(40)])
    half = evaluate(ScriptedEngine(tok, Echo.half), specs, "echo", 40, tokenizer=tok)
    assert half["success_rate"] == pytest.approx(even)
    assert half["success_stderr"] == pytest.approx(math.sqrt(even * (1 - even) / 40))
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        evaluate(ScriptedEngine(tok, Echo.right), specs, "nope", 4, tokenizer=tok)


class SeedEngine(ScriptedEngine):
    """Echoes correctly only when the sampling seed is odd: pass@2 always finds one."""

    async def generate(self, prompts, params):
        [[completion]] = await super().generate(prompts, params)
        if params.seed % 2 == 0:
            ids = self.tokenizer.encode("no", add_special_tokens=False) + [self.tokenizer.eos_token_id]
            completion = Completion(ids, [0.0] * len(ids), "stop", 0)
        return [[completion]]


def test_evaluate_pass_at_k(tok):
    specs = [EnvSpec("echo", bundled="echo")]
    one = evaluate(SeedEngine(tok, Echo.right), specs, "echo", 8, tokenizer=tok)
    two = evaluate(SeedEngine(tok, Echo.right), specs, "echo", 8, pass_k=2, tokenizer=tok)
    assert one["success_rate"] == 0.5 and two["success_rate"] == 1.0 and two["mean_reward"] == 0.5


def test_evaluate_a_random_tiny_model(tiny_dir):
    out = evaluate(tiny_dir, [EnvSpec("guess", bundled="guess_number")], "guess", 6, max_tokens=16, max_turns=2)
    assert out["episodes"] == 6 and out["errors"] == 0, out["first_error"]
    assert 0 <= out["success_rate"] <= 1 and 0 <= out["mean_reward"] <= 1
    assert out["success_stderr"] == pytest.approx(math.sqrt(out["success_rate"] * (1 - out["success_rate"]) / 6))
    assert 1 <= out["mean_turns"] <= 2 and out["mean_model_tokens"] > 0
