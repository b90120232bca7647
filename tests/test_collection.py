"""A step's groups: group filters, dynamic-sampling refills, staleness, failing environments, and
rollout metrics."""

from __future__ import annotations

import collections
import contextlib

import numpy as np
import pytest

from bridge.envs.spec import EnvSpec, RewardError
from bridge.wire import TrajectoryData
from jaxrl.run.collection import Collector, EnvironmentsDown, EnvWatch, StepRollouts, most_common_error, rollout_metrics
from jaxrl.run.config import TrainConfig
from jaxrl.run.rollout_client import RolloutClient
from jaxrl.run.tasks import TaskSource
from jaxrl.run.typed_config import from_dict
from jaxrl.tiny_tokenizer import build_tokenizer
from scripted_engine import TOKEN, ScriptedEngine, in_process_bridge, tool_call


def config(**extra) -> TrainConfig:
    base = {"run_dir": "r", "model": {"dir": "m"},
            "envs": [{"name": "coin", "env_class": "test_collection:Coin"}],
            "rollout": {"groups_per_step": 2, "max_tokens": 8, "max_total_tokens": 16},
            "learner": {"group_size": 2}}
    for k, v in extra.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return from_dict(TrainConfig, base)


def rollout_client(addresses: list[str], cfg: TrainConfig, **kw) -> RolloutClient:
    """The client a run makes of `cfg`: its bridge settings, request deadline and stream width."""
    return RolloutClient(addresses, cfg.bridge, TOKEN, timeout_s=cfg.rollout_timeout_s,
                         streamed_groups=cfg.streamed_groups, **kw)


def traj(group, i, prompt, completion, mask, rewards, finish="stop", version=0, env="coin", **metrics):
    return TrajectoryData(group, i, np.array(prompt, np.int32), np.array(completion, np.int32),
                          np.where(np.array(mask, bool), -0.5, 0.0).astype(np.float32), np.array(mask, np.uint8),
                          np.where(np.array(mask, bool), version, -1).astype(np.int64), rewards, finish, env,
                          metrics={"tool_calls": 1.0, **metrics})


def test_metrics_per_environment_and_counts():
    cfg = config()
    result = StepRollouts([[traj("a", 0, [1], [1, 2], [1, 1], {"env": 1.0}), traj("a", 1, [1, 4, 5], [3], [1], {"env": 0.0})]],
                          collections.Counter(episodes=2, groups_zero_variance=1), 1.0, 0.7, 0.3)
    m = rollout_metrics([t for g in result.summaries() for t in g], result.counts, cfg)
    assert m["reward/mean"] == 0.5 and m["env/coin/success"] == 0.5 and m["env/coin/tool_calls"] == 1.0
    assert m["rollout/groups_zero_variance"] == 1 and m["completion/model_tokens"] == 1.5
    assert m["prompt/tokens"] == 2.0 and m["prompt/tokens_max"] == 3.0


def test_session_waits_are_the_steps_totals():
    waited = dict(pool_waits=1.0, pool_wait_s=0.5, capacity_refusals=2.0)
    result = StepRollouts([[traj("a", 0, [1], [2], [1], {"env": 1.0}, **waited),
                            traj("a", 1, [1], [2], [1], {"env": 1.0}, **waited, action_errors=1.0)],
                           [traj("b", 0, [1], [2], [1], {"env": 1.0}, env="dice")]], collections.Counter(), 1.0, 0.5, 0.5)
    m = rollout_metrics([t for g in result.summaries() for t in g], result.counts, config())
    assert (m["env/coin/pool_waits"], m["env/coin/pool_wait_s"], m["env/coin/capacity_refusals"]) == (2.0, 1.0, 4.0)
    assert m["env/coin/action_errors"] == 0.5 and "env/dice/pool_wait_s" not in m


def test_env_watch_warns_once_of_one_turn_cuts_and_of_rewards_that_are_always_zero(caplog):
    watch = EnvWatch(max_turns=1, specs={}, task_of=lambda g: {}, zero_after=4)
    with caplog.at_level("WARNING", logger="jaxrl.run.collection"):
        watch.observe([traj("a", i, [1], [2], [1], {"env": 0.0, "fmt": 0.0}, "max_turns") for i in range(3)])
        assert [r.getMessage() for r in caplog.records] == [
            "environment 'coin': its episodes are not done after one turn, but rollout.max_turns is 1: each ends after "
            "the model's first action; raise rollout.max_turns to play them out"]
        watch.observe([traj("b", i, [1], [2], [1], {"env": 0.0, "fmt": 0.0}, "env_done") for i in range(3)]
                      + [traj("c", 0, [1], [2], [1], {"env": 1.0}, env="dice")] * 5)
    assert [r.getMessage() for r in caplog.records][1:] == [
        "environment 'coin': every reward of its 4 episodes so far is 0 (env, fmt): nothing to learn from yet; check "
        "that the environment gives rewards (an OpenEnv observation's reward) and that rewards[] scores it"]
    quiet = EnvWatch(max_turns=2, specs={}, task_of=lambda g: {}, zero_after=4)  # a turn limit above 1, rewards that vary: nothing to say
    caplog.clear()
    quiet.observe([traj("a", i, [1], [2], [1], {"env": float(i % 2)}, "max_turns") for i in range(8)])
    assert not caplog.records


def test_the_bridges_notices_about_what_the_model_sees_are_shown_once(caplog):
    """Every bridge hands its warnings on with an episode; the trainer's console says each once."""
    notice = "reset's observation shows the model nothing (it sent: nothing), and the task has no prompt"
    watch = EnvWatch(max_turns=2, specs={}, task_of=lambda g: {})
    with caplog.at_level("WARNING", logger="jaxrl.run.collection"):
        for bridge in range(2):
            episode = traj(f"{bridge}-0", 0, [1], [2], [1], {"env": 1.0}, finish="error" if bridge else "stop")
            episode.notices = [notice]
            watch.observe([episode, traj(f"{bridge}-0", 1, [1], [2], [1], {"env": 1.0})])
    assert [r.getMessage() for r in caplog.records] == [f"environment 'coin': {notice}"]


def test_env_watch_warns_once_of_a_pool_far_above_the_servers_capacity(caplog):
    specs = {"nim": EnvSpec("nim", url="http://127.0.0.1:1"), "dice": EnvSpec("dice", url="http://127.0.0.1:2",
                                                                             max_concurrent_envs=1)}
    watch = EnvWatch(max_turns=4, specs=specs, task_of=lambda g: {})
    with caplog.at_level("WARNING", logger="jaxrl.run.collection"):
        watch.observe([traj("a", i, [1], [2], [1], {"env": 1.0}, env=env, capacity_refusals=1.0, server_max_sessions=1.0)
                       for i in range(3) for env in ("nim", "dice")])
    assert [r.getMessage() for r in caplog.records] == [
        "environment 'nim': its server allows 1 session(s) at once, but the bridge holds up to 64 for it: episodes "
        "queue for its slots (env/nim/pool_wait_s, capacity_refusals); set max_concurrent_envs: 1 for it, or serve it "
        "with more sessions"]


def test_env_watch_warns_once_of_groups_that_are_not_one_task(caplog):
    """The bridge's group check counts a mixed group in its episodes' metrics; the trainer's console says so once."""
    watch = EnvWatch(max_turns=2, specs={}, task_of=lambda g: {})
    with caplog.at_level("WARNING", logger="jaxrl.run.collection"):
        watch.observe([traj("a", i, [1], [2], [1], {"env": 1.0}, env="gym", groups_mixed=float(i == 1))
                       for i in range(2)] * 2)
        watch.observe([traj("b", i, [1], [2], [1], {"env": 1.0}) for i in range(2)])  # one task: nothing to say
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("environment 'gym': the episodes of a group started from different first prompts")
    assert "data.task_fields" in warning and "env/gym/groups_mixed" in warning and "mixed_groups: error" in warning


def test_env_watch_warns_once_of_an_environment_that_plays_one_task_for_every_group(caplog):
    """Every episode of every step gets the same question, and every group was handed the same task; a group
    check cannot see it (each group is one task), the first prompts of many groups can."""
    watch = EnvWatch(max_turns=2, specs={}, task_of=lambda g: {"level": 1}, same_after=4)
    with caplog.at_level("WARNING", logger="jaxrl.run.collection"):
        for step in range(6):
            watch.observe([traj(f"{step}-0", i, [5, 6], [2], [1], {"env": 1.0}, env="gym") for i in range(2)])
            watch.observe([traj(f"{step}-0", i, [5, step], [2], [1], {"env": 1.0}, env="varied") for i in range(2)])
        late = EnvWatch(max_turns=2, specs={}, task_of=lambda g: {}, same_after=4)  # only the first 4 groups count
        late.observe([traj(f"{g}-0", 0, [5, 6 if g < 3 else g], [2], [1], {"env": 1.0}) for g in range(8)])
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("environment 'gym': its first 4 groups all started from the same first prompt and "
                              "they were all handed the same task: every episode plays one task")
    assert "data.task_fields" in warning and "data.splits" in warning


class SecretGuess:
    """TRL's guess-number class as environment_factory takes it: every row has the same prompt, and
    reset(**row) keeps the row's secret number, which the prompt never shows."""

    def reset(self, **row) -> str:
        self.secret, self.guessed = row["secret"], None
        return ""

    def guess(self, n: int) -> str:
        """Guess the secret number.

        Args:
            n: The number to guess.
        """
        self.guessed = n
        return "correct" if n == self.secret else "wrong"

    def reward(self) -> float:
        return float(self.guessed == self.secret)


@pytest.mark.parametrize("env_class, one_task", [
    ("test_collection:SecretGuess", False),
    ("tests.workers.openenv_catalogue:GridWorldEnvironment", True),  # reset() takes no task
])
def test_one_task_for_every_group_is_warned_of_only_where_the_reset_was_handed_one(env_class, one_task, tmp_path,
                                                                                  caplog):
    """Sixteen groups all start from one first prompt either way; TRL's rows differ in the secret their reset
    reads (no warning), while the catalogue's grid world takes no field of its seed-drawn tasks (warned)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": "Find the number.", "secret": {k}}}\n' for k in range(16)))
    cfg = config(envs=[{"name": "game", "env_class": env_class}], rollout={"groups_per_step": 16, "max_turns": 2},
                 data={"train_file": str(rows)} if not one_task else {})
    tok = build_tokenizer()
    engine = ScriptedEngine(tok, lambda p: tool_call("guess", {"n": 3}) if "guess" in p else "DOWN")
    with in_process_bridge(engine, {"envs": [e.to_dict() for e in cfg.envs]}, tok) as address:
        client = rollout_client([address], cfg)
        try:
            with caplog.at_level("WARNING", logger="jaxrl.run.collection"):
                result = Collector(cfg, client, TaskSource(cfg), (0,)).collect(0, 0)
        finally:
            client.close()
    assert result.counts["episodes_failed"] == 0 and len({t.prompt_ids.tobytes() for g in result.groups for t in g}) == 1
    warnings = [r.getMessage() for r in caplog.records if "plays one task" in r.getMessage()]
    if one_task:
        [warning] = warnings
        assert warning.startswith("environment 'game': its first 16 groups all started from the same first prompt "
                                  "and their tasks differ only in field(s) its reset does not take (seed)")
    else:
        assert warnings == []


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
    envs = {"envs": [{"name": "coin", "env_class": "test_collection:Coin"}]}
    with contextlib.ExitStack() as stack:
        out = []
        for _ in range(2):
            engine = ScriptedEngine(tok, lambda p: tool_call("flip", {}) if "<tool_response>" not in p else "ok")
            out.append((stack.enter_context(in_process_bridge(engine, envs, tok)), engine))
        yield out


def test_dynamic_sampling_drops_zero_variance_groups_and_refills(bridges):
    # Every Coin group has zero variance (the reward is fixed by the task): all dropped, refilled
    # up to max_refills, then the step trains on padding.
    cfg = config(rollout={"dynamic_sampling": True, "max_refills": 2})
    client = rollout_client([bridges[0][0]], cfg)
    try:
        result = Collector(cfg, client, TaskSource(cfg), (0,)).collect(0, 0)
    finally:
        client.close()
    assert result.groups == [] and result.counts["requests"] == 3 and result.counts["refills"] == 2
    assert result.counts["groups_zero_variance"] == 6 and result.counts["groups_padded"] == 2


def test_stream_takes_groups_as_they_complete_and_never_trains_a_stale_token(bridges):
    cfg = config(rollout={"mode": "stream", "in_flight_groups": 3, "max_staleness": 1},
                 learner={"loss": {"is_level": "token"}})
    engine = bridges[0][1]
    client = rollout_client([bridges[0][0]], cfg)
    collector = Collector(cfg, client, TaskSource(cfg), (0,))
    try:
        first = collector.collect(0, 0)
        assert len(first.groups) == 2 and first.staleness_max == 0 and first.counts["tokens_lag_0"] > 0
        # New weights: the groups sampled before (in flight or done and waiting) are two versions old.
        engine.policy_version = 2
        second = collector.collect(1, 2)
    finally:
        collector.close()
        client.close()
        engine.policy_version = 0
    versions = np.concatenate([t.token_versions[t.loss_mask.astype(bool)] for g in second.groups for t in g])
    assert len(second.groups) == 2 and versions.min() >= 1 and second.staleness_max <= 1
    looked_at = second.counts["groups_looked_at"]
    assert looked_at == 2 + second.counts["groups_stale"] and second.counts["groups_stale"] <= 3
    ids = [g[0].group_id for g in first.groups + second.groups]
    assert len(set(ids)) == 4  # each group requested once, numbered on from step 0's


def test_stream_with_dynamic_sampling_over_two_bridges_looks_at_as_many_groups_as_the_refills_allow(bridges):
    # Every Coin group has zero variance: a step looks at (max_refills + 1) x its groups, then pads.
    cfg = config(rollout={"mode": "stream", "dynamic_sampling": True, "max_refills": 2},
                 learner={"loss": {"is_level": "token"}})
    client = rollout_client([b for b, _ in bridges], cfg)
    collector = Collector(cfg, client, TaskSource(cfg), (0,))
    calls = [engine.calls for _, engine in bridges]
    try:
        result = collector.collect(0, 0)
    finally:
        collector.close()
        client.close()
    assert result.groups == [] and result.counts["groups_zero_variance"] == 6
    assert result.counts["groups_looked_at"] == 6 and result.counts["groups_padded"] == 2
    assert all(engine.calls > before for (_, engine), before in zip(bridges, calls))  # both bridges served


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
    foreign = [traj("a", 0, [1], [1], [1], {"env": 1.0}, version=999), ok[1]]
    assert not collector._keep(foreign, learner_version=5, counts=counts)
    assert counts == {"groups_stale": 1, "groups_failed": 1, "groups_foreign_version": 1}


def test_async_mode_requests_the_next_step_while_this_one_trains_and_not_past_the_last():
    requested = []

    class Client:
        def request(self, tasks, ids, group_size, params, min_version, policy=""):
            requested.append((ids[0].split("-")[0], min_version))
            return [[traj(i, k, [1], [1], [1], {"env": float(k)}, version=max(min_version, 3)) for k in range(group_size)]
                    for i in ids]

    cfg = config(rollout={"mode": "async", "max_staleness": 1}, learner={"loss": {"is_level": "token"}}, steps=2)
    collector = Collector(cfg, Client(), TaskSource(cfg), (0,))
    try:
        first = collector.collect(0, 3)
        second = collector.collect(1, 4)  # the groups requested while step 0 trained, at version 3
    finally:
        collector.close()
    # Step 0 at the version just published; step 1 requested once, behind step 0, at most max_staleness behind
    # the version it trains at; no step 2.
    assert requested == [("0", 3), ("1", 2)]
    assert len(first.groups) == len(second.groups) == 2 and second.staleness_max == 1


def test_sync_mode_trains_only_on_the_version_just_published():
    collector = Collector(config(), client=None, tasks=None, stop_ids=(0,))
    counts = collections.Counter()
    assert collector._keep([traj("a", 0, [1], [1, 2], [1, 1], {"env": 1.0}, version=5)], 5, counts)
    older = traj("a", 0, [1], [1, 2], [1, 1], {"env": 1.0}, version=5)
    older.token_versions[0] = 4  # one turn sampled before the last publish
    assert not collector._keep([older], 5, counts)
    assert not collector._keep([traj("a", 0, [1], [1], [1], {"env": 1.0}, version=999)], 5, counts)
    assert counts == {"groups_stale": 1, "groups_foreign_version": 1}


def test_too_many_failed_episodes_stop_the_run():
    cfg = config(envs=[{"name": "coin", "env_class": "test_collection:Coin"}], rollout={"min_success_fraction": 0.5})

    class FailingClient:
        def request(self, tasks, ids, group_size, params, min_version, policy=""):
            groups = [[traj(i, k, [1], [], [], {}, finish="error") for k in range(group_size)] for i in ids]
            for g in groups:
                for t in g:
                    t.error = "dropped after 2 retries: EndpointUnavailable: server gone"
            return groups

    collector = Collector(cfg, FailingClient(), TaskSource(cfg), (0,))
    with pytest.raises(EnvironmentsDown, match="only 0 of 4 episodes succeeded.*4x.*server gone"):
        collector.collect(0, 0)


def test_dynamic_sampling_keeps_only_groups_with_two_distinct_rewards():
    # NaN-free host rule of DAPO's filter: None (no function applies) is left out, then at least two
    # distinct rewards must remain.
    cfg = config(rollout={"dynamic_sampling": True},
                 rewards=[{"fn": "env"}, {"fn": "test_collection:Coin", "name": "x"}])
    collector = Collector(cfg, client=None, tasks=None, stop_ids=(0,))
    counts = collections.Counter()

    def group(*rewards):
        return [traj("a", i, [1], [1], [1], r) for i, r in enumerate(rewards)]

    assert collector._keep(group({"env": 0.0}, {"env": 1.0}), 0, counts)
    assert collector._keep(group({"env": 1.0}, {"env": 0.0, "x": 2.0}), 0, counts)  # 1.0 vs 2.0
    assert not collector._keep(group({"env": 1.0}, {"env": 1.0}), 0, counts)
    assert not collector._keep(group({}, {"env": 1.0}), 0, counts)  # one reward only
    assert not collector._keep(group({}, {}), 0, counts)
    assert counts == {"groups_zero_variance": 3}


def test_a_reward_error_stops_the_step_naming_the_function():
    class Client:
        def request(self, tasks, ids, group_size, params, min_version, policy=""):
            groups = [[traj(i, k, [1], [1], [1], {"env": 1.0}) for k in range(group_size)] for i in ids]
            groups[1][0].finish_reason = "error"
            groups[1][0].error = "RewardError: reward function 'f' (m:f) for episode 0-1/0 of 'coin' returned nan"
            return groups

    cfg = config()
    with pytest.raises(RewardError, match=r"^reward function 'f' \(m:f\) for episode 0-1/0 of 'coin' returned nan$"):
        Collector(cfg, Client(), TaskSource(cfg), (0,)).collect(0, 0)


def test_episodes_scored_and_unscored_are_counted():
    class Client:
        def request(self, tasks, ids, group_size, params, min_version, policy=""):
            return [[traj(i, 0, [1], [1], [1], {}), traj(i, 1, [1], [1], [1], {"env": 0.0})] for i in ids]

    cfg = config()
    result = Collector(cfg, Client(), TaskSource(cfg), (0,)).collect(0, 0)
    assert (result.counts["episodes_scored"], result.counts["episodes_unscored"]) == (2, 2)


def test_the_most_common_error_is_shown_whole():
    long = "the first prompt of environment 'snake' has 15062 tokens, " + "x" * 300 + " observation_field"
    failed = [traj("g", i, [1], [2], [1], {}, finish="error") for i in range(3)]
    for t, error in zip(failed, (long, "RuntimeError: other", long)):
        t.error = error
    assert most_common_error(failed) == f"(2x): {long}"
