"""Trajectories to learner batches: padding and masks, group filters, dynamic-sampling refills,
staleness, and requests spread over two bridges."""

from __future__ import annotations

import asyncio
import collections
import math
import threading

import numpy as np
import pytest

from bridge.client import BridgeClient
from bridge.envs.episode import runtime_from_dict
from bridge.server import serve
from bridge.wire import TrajectoryData
from jaxrl.run.config import TrainConfig
from jaxrl.run.collection import Collector, EnvironmentsDown, RolloutClient, StepRollouts, build_batch, bucket, rollout_metrics
from jaxrl.run.tasks import TaskSource
from jaxrl.tiny_tokenizer import build_tokenizer
from jaxrl.run.typed_config import from_dict
from scripted_engine import ScriptedEngine, tool_call


def config(**extra) -> TrainConfig:
    base = {"run_dir": "r", "model": {"dir": "m"},
            "envs": [{"name": "coin", "env_class": "test_rollouts:Coin"}],
            "rollout": {"groups_per_step": 2, "max_tokens": 8, "max_total_tokens": 16},
            "learner": {"group_size": 2}}
    for k, v in extra.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return from_dict(TrainConfig, base)


def traj(group, i, prompt, completion, mask, rewards, finish="stop", version=0, env="coin"):
    return TrajectoryData(group, i, np.array(prompt, np.int32), np.array(completion, np.int32),
                          np.where(np.array(mask, bool), -0.5, 0.0).astype(np.float32), np.array(mask, np.uint8),
                          np.where(np.array(mask, bool), version, -1).astype(np.int64), rewards, finish, env,
                          metrics={"tool_calls": 1.0})


def test_batch_pads_prompts_left_completions_right_and_fills_missing_groups():
    cfg = config(rollout={"drop_truncated": True}, rewards=[{"fn": "env"}, {"fn": "test_rollouts:Coin", "name": "x"}])
    groups = [[traj("a", 0, [5, 6, 7], [1, 2, 3], [1, 0, 1], {"env": 1.0}),
               traj("a", 1, [5], [4] * 20, [1] * 20, {"env": 0.0, "x": 2.0}, finish="length")]]
    batch = build_batch(groups, cfg, pad_id=0, with_sampler_logp=True)
    B, P, C = 4, bucket(3), 16
    assert batch["prompt_BxP"].shape == (B, P) and batch["completion_BxC"].shape == (B, C)
    assert list(batch["prompt_BxP"][0, -3:]) == [5, 6, 7] and batch["prompt_mask_BxP"][0].sum() == 3
    assert list(batch["completion_BxC"][0, :4]) == [1, 2, 3, 0] and list(batch["loss_mask_BxC"][0, :3]) == [1, 0, 1]
    assert batch["completion_mask_BxC"][1].sum() == C  # cut to the budget
    assert batch["loss_mask_BxC"][1].sum() == 0  # truncated: no loss (overlong filtering)
    assert batch["rewards_BxR"][0, 0] == 1.0 and math.isnan(batch["rewards_BxR"][0, 1])
    assert batch["sampler_logp_BxC"][0, 0] == -0.5 and batch["sampler_logp_BxC"][0, 1] == 0.0
    # the missing group: padding rows with one prompt token, no loss, constant reward
    assert batch["loss_mask_BxC"][2:].sum() == 0 and (batch["prompt_mask_BxP"][2:].sum(1) == 1).all()
    assert (batch["rewards_BxR"][2:] == 0).all()


def test_metrics_per_environment_and_counts():
    cfg = config()
    result = StepRollouts([[traj("a", 0, [1], [1, 2], [1, 1], {"env": 1.0}), traj("a", 1, [1], [3], [1], {"env": 0.0})]],
                          collections.Counter(episodes=2, groups_zero_variance=1), 1.0, 0.7, 0.3)
    m = rollout_metrics(result, cfg)
    assert m["reward/mean"] == 0.5 and m["env/coin/success"] == 0.5 and m["env/coin/tool_calls"] == 1.0
    assert m["rollout/groups_zero_variance"] == 1 and m["completion/model_tokens"] == 1.5


class Coin:
    """A tool environment whose reward is fixed by the task: heads (seed even) pays 1."""

    def reset(self, seed: int = 0, **task) -> str:
        self.seed = seed
        return f"Flip the coin (task {seed})."

    def flip(self) -> str:
        """Flips the coin."""
        return "flipped"

    def reward(self) -> float:
        return float(self.seed % 2 == 0)


@pytest.fixture(scope="module")
def bridges():
    """Two in-process bridges with scripted engines over the Coin environment."""
    tok = build_tokenizer()
    out = []
    for _ in range(2):
        engine = ScriptedEngine(tok, lambda prompt: tool_call("flip", {}) if "<tool_response>" not in prompt else "ok")
        runtime = runtime_from_dict({"envs": [{"name": "coin", "env_class": "test_rollouts:Coin"}]}, tok)
        ready, box = threading.Event(), {}

        def on_listening(address, box=box):
            box["address"] = address
            ready.set()

        thread = threading.Thread(target=lambda e=engine, r=runtime, o=on_listening: asyncio.run(
            serve(e, port=0, on_listening=o, handle_signals=False, grace_s=1.0, envs=r)), daemon=True)
        thread.start()
        assert ready.wait(60)
        out.append((box["address"], engine, thread))
    yield out
    for address, _, thread in out:
        with BridgeClient(address) as c:
            c.shutdown()
        thread.join(10)


def test_requests_are_spread_over_bridges_and_returned_in_task_order(bridges):
    cfg = config(rollout={"groups_per_step": 6})
    client = RolloutClient([a for a, _, _ in bridges], cfg)
    try:
        calls = [e.calls for _, e, _ in bridges]
        tasks = [("coin", {"seed": s}) for s in range(6)]
        from bridge.engines.base import SamplingParams

        groups = client.request(tasks, [f"g{i}" for i in range(6)], 2, SamplingParams(max_tokens=8), 0)
        assert [g[0].group_id for g in groups] == [f"g{i}" for i in range(6)]
        assert all(len(g) == 2 and [t.index_in_group for t in g] == [0, 1] for g in groups)
        assert [g[0].rewards["env"] for g in groups] == [1.0, 0.0] * 3
        assert all(e.calls > c for (_, e, _), c in zip(bridges, calls))  # both bridges worked
    finally:
        client.close()


def test_dynamic_sampling_drops_zero_variance_groups_and_refills(bridges):
    # Every Coin group has zero variance (the reward is fixed by the task): all dropped, refilled
    # up to max_refills, then the step trains on padding.
    cfg = config(rollout={"dynamic_sampling": True, "max_refills": 2})
    client = RolloutClient([bridges[0][0]], cfg)
    try:
        result = Collector(cfg, client, TaskSource(cfg), (0,)).collect(0, 0)
    finally:
        client.close()
    assert result.groups == [] and result.counts["requests"] == 3 and result.counts["refills"] == 2
    assert result.counts["groups_zero_variance"] == 6 and result.counts["groups_padded"] == 2


def test_failed_and_stale_groups_are_dropped():
    cfg = config(rollout={"mode": "async", "max_staleness": 1}, learner={"loss": {"is_level": "token"}})
    collector = Collector(cfg, client=None, tasks=None, stop_ids=(0,))
    counts = collections.Counter()
    ok = [traj("a", 0, [1], [1], [1], {"env": 1.0}, version=4), traj("a", 1, [1], [1], [1], {"env": 0.0}, version=5)]
    assert collector._keep(ok, learner_version=5, counts=counts)
    stale = [traj("a", 0, [1], [1], [1], {"env": 1.0}, version=3), ok[1]]
    assert not collector._keep(stale, learner_version=5, counts=counts)
    failed = [traj("a", 0, [1], [], [], {}, finish="error"), ok[1]]
    assert not collector._keep(failed, learner_version=5, counts=counts)
    assert counts == {"groups_stale": 1, "groups_failed": 1}


def test_too_many_failed_episodes_stop_the_run():
    cfg = config(envs=[{"name": "coin", "env_class": "test_rollouts:Coin"}], rollout={"min_success_fraction": 0.5})

    class FailingClient:
        def request(self, tasks, ids, group_size, params, min_version):
            groups = [[traj(i, k, [1], [], [], {}, finish="error") for k in range(group_size)] for i in ids]
            for g in groups:
                for t in g:
                    t.error = "dropped after 2 retries: EndpointUnavailable: server gone"
            return groups

    collector = Collector(cfg, FailingClient(), TaskSource(cfg), (0,))
    with pytest.raises(EnvironmentsDown, match="only 0 of 4 episodes succeeded.*4x.*server gone"):
        collector.collect(0, 0)
