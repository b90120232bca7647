"""From environment tasks to a step's groups: this process's share of them, requested through the
run's `RolloutClient`, group filters, DAPO dynamic sampling with refills, async prefetch and
streaming with a staleness bound, warnings about what the episodes show of the environments, and
rollout metrics.

The three modes differ only in where a step's groups come from. sync: requested when the step
starts, at the version just published. async: requested while the previous step trains. stream:
`rollout.in_flight_groups` groups under way at all times, each requested alone, so a step takes
groups as they complete; episodes under way when new weights arrive go on with them (partial
rollouts: every token carries the version that sampled it), and a group is judged by its oldest
token.

Groups are the unit: GRPO advantages compare the samples of one task, so a group with a failed
or stale episode is dropped whole (and refilled), never trained half. A truncated episode keeps
its place in its group but, with `drop_truncated`, contributes no loss (DAPO overlong filtering).
Rows missing after the refills are padding groups: loss mask 0, constant reward.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from bridge.envs.spec import EnvConfigError, EnvSpec, MixedGroupError, RewardError, RolloutFnError, reset_fields
from bridge.wire import TrajectoryData
from jaxrl.run.config import TrainConfig
from jaxrl.run.rewards import RewardWeights
from jaxrl.run.rollout_client import Group, RolloutClient
from jaxrl.run.tasks import TaskSource

log = logging.getLogger(__name__)
# Per-episode metrics of the bridge's session pools, summed per step: episodes that found the pool
# full, seconds spent getting a session, refusals of a server at capacity.
SESSION_WAITS = ("pool_waits", "pool_wait_s", "capacity_refusals")


def oldest_trainable(cfg: TrainConfig, learner_version: int) -> int:
    """The oldest policy version a step at `learner_version` may train on: that version in sync mode,
    at most `rollout.max_staleness` behind it in async and stream modes."""
    return max(0, learner_version - (cfg.rollout.max_staleness if cfg.rollout.mode != "sync" else 0))


class EnvironmentsDown(RuntimeError):
    """Too few episodes succeed: the environments (or the bridge's sessions to them) are failing."""


@dataclasses.dataclass
class StepRollouts:
    groups: list[Group]
    counts: collections.Counter
    wall_s: float
    generate_s: float  # the wall time split by the episodes' own generate/env/reward-model shares
    env_s: float
    reward_s: float = 0.0
    staleness_max: int = 0  # versions between the learner and the oldest token trained

    def summaries(self) -> list[list[EpisodeSummary]]:
        return [[EpisodeSummary.of(t) for t in g] for g in self.groups]


@dataclasses.dataclass(frozen=True)
class Share:
    """The groups of every step that one process of a run collects: slots [first, first + count) of
    the step's `total`, and for refills slots past `total`, interleaved with the other processes'
    (whose shares are as large), so that group ids never collide. One process: slots 0, 1, 2..."""

    first: int
    count: int
    total: int

    def slot(self, i: int) -> int:
        """The slot (group id STEP-SLOT, task) of this share's i-th group of a step."""
        if i < self.count:
            return self.first + i
        return self.total + (i - self.count) * (self.total // self.count) + self.first // self.count


class Collector:
    """One step's groups (this process's share of them): request, filter, refill, from the source the
    rollout mode names (`SOURCES`), picked once."""

    def __init__(self, cfg: TrainConfig, client: RolloutClient, tasks: TaskSource, stop_ids: tuple[int, ...],
                 share: Share | None = None):
        self.cfg = cfg
        g = cfg.rollout.groups_per_step
        self.share = Share(0, g, g) if share is None else share
        self.client = client
        self.tasks = tasks
        self.rewards = RewardWeights(cfg.rewards)
        # Seeds each group by the run seed and its id (step-slot): the same episodes on every rerun.
        self.params = cfg.sampling_params(stop_ids)
        self.watch = EnvWatch(cfg.rollout.max_turns, {e.name: e for e in cfg.envs}, self.task_of)
        self.source = SOURCES[cfg.rollout.mode](self)

    def task_of(self, group_id: str) -> dict[str, Any]:
        """The task fields of training group `group_id` (STEP-SLOT: every mode numbers them so)."""
        step, slot = map(int, group_id.split("-"))
        return self.tasks.train(step, slot)[1]

    def _keep(self, group: Group, learner_version: int, counts: collections.Counter) -> bool:
        if any(t.finish_reason == "error" for t in group):
            counts["groups_failed"] += 1
            return False
        # A newer version than the learner's was never published by this run.
        oldest = oldest_trainable(self.cfg, learner_version)
        versions = [t.token_versions[t.loss_mask.astype(bool)] for t in group]
        versions = np.concatenate(versions) if versions else np.zeros(0, np.int64)
        if len(versions) and versions.max() > learner_version:
            counts["groups_foreign_version"] += 1
            log.warning("dropped group %s: sampled with version %d, but this run has published up to %d (another "
                        "client loaded weights into the bridge?)", group[0].group_id, versions.max(), learner_version)
            return False
        if len(versions) and versions.min() < oldest:
            counts["groups_stale"] += 1
            return False
        if self.cfg.rollout.dynamic_sampling:
            # No learning signal: fewer than two rewards, or all equal.
            rewards = [self.rewards.total(t.rewards) for t in group]
            if len({r for r in rewards if r is not None}) <= 1:
                counts["groups_zero_variance"] += 1
                return False
        return True

    def _tally(self, episodes: list[TrajectoryData], counts: collections.Counter) -> None:
        """What the step's counts and the environment warnings take of `episodes`, kept or not."""
        check_rewards(episodes)
        self.watch.observe(episodes)
        counts["episodes"] += len(episodes)
        counts["episodes_failed"] += sum(t.finish_reason == "error" for t in episodes)  # logged when 0 too
        for t in episodes:
            if t.finish_reason != "error":
                counts["episodes_scored" if self.rewards.total(t.rewards) is not None else "episodes_unscored"] += 1
        counts["episodes_retried"] += sum(t.metrics.get("retries", 0.0) > 0 for t in episodes)

    def _check_success(self, step: int, episodes: list[TrajectoryData]) -> None:
        failed = [t for t in episodes if t.finish_reason == "error"]
        fraction = self.cfg.rollout.min_success_fraction
        if len(episodes) - len(failed) < fraction * len(episodes):
            raise EnvironmentsDown(
                f"step {step}: only {len(episodes) - len(failed)} of {len(episodes)} episodes succeeded "
                f"(rollout.min_success_fraction={fraction}); most common error {most_common_error(failed)}")

    def request(self, step: int, slots: list[int], min_version: int) -> list[Group]:
        """Groups of training tasks (step, slot) from the bridges, sampled by weights >= min_version."""
        tasks = [self.tasks.train(step, slot) for slot in slots]
        return self.client.request(tasks, [f"{step}-{slot}" for slot in slots], self.cfg.learner.group_size,
                                   self.params, min_version)

    def requested(self, step: int, min_version: int, learner_version_at_use: int) -> StepRollouts:
        """`step`'s groups requested now, refilled as the filters drop some."""
        r = self.cfg.rollout
        need, taken = self.share.count, 0
        kept: list[Group] = []
        counts: collections.Counter = collections.Counter()
        start = time.perf_counter()
        episodes_all: list[TrajectoryData] = []
        for attempt in range(r.max_refills + 1):
            n = need - len(kept)
            groups = self.request(step, [self.share.slot(taken + i) for i in range(n)], min_version)
            taken += n
            counts["requests"] += 1
            episodes = [t for g in groups for t in g]
            self._tally(episodes, counts)
            self._check_success(step, episodes)
            episodes_all += episodes
            kept += [g for g in groups if self._keep(g, learner_version_at_use, counts)]
            if len(kept) >= need:
                break
        counts["refills"] = max(counts["requests"] - 1, 0)
        return self._result(kept, counts, start, episodes_all, learner_version_at_use)

    def streamed(self, step: int, learner_version: int, stream: GroupStream) -> StepRollouts:
        """The first groups of `stream` to complete that may be trained at `learner_version`; at most
        (max_refills + 1) x the share's groups are looked at, as the other modes request."""
        need = self.share.count
        kept: list[Group] = []
        counts: collections.Counter = collections.Counter()
        start = time.perf_counter()
        episodes_all: list[TrajectoryData] = []
        for _ in range(need * (self.cfg.rollout.max_refills + 1)):
            group = stream.take(learner_version)
            self._tally(group, counts)
            episodes_all += group
            if self._keep(group, learner_version, counts):
                kept.append(group)
            if len(kept) >= need:
                break
        self._check_success(step, episodes_all)
        counts["groups_looked_at"] = len(episodes_all) // max(self.cfg.learner.group_size, 1)
        return self._result(kept, counts, start, episodes_all, learner_version)

    def _result(self, kept: list[Group], counts: collections.Counter, start: float,
                episodes: list[TrajectoryData], learner_version: int) -> StepRollouts:
        """The step's groups with its counts, timings and the staleness of the tokens it trains."""
        wall = time.perf_counter() - start
        counts["groups_padded"] = self.share.count - len(kept)
        gen = sum(t.generate_s for t in episodes)
        env = sum(t.env_s for t in episodes)
        rew = sum(t.reward_s for t in episodes)
        lags = [learner_version - t.token_versions[t.loss_mask.astype(bool)] for g in kept for t in g]
        lags = np.concatenate(lags) if lags else np.zeros(0, np.int64)
        counts["trained_tokens"] += len(lags)
        counts["trained_token_lag_sum"] += int(lags.sum())
        for lag, n in zip(*np.unique(lags, return_counts=True)):
            counts[f"tokens_lag_{lag}"] += int(n)  # tokens per policy version, by how far behind
        total = gen + env + rew
        shares = [x / total if total > 0 else 0.0 for x in (gen, env, rew)]
        return StepRollouts(kept, counts, wall, wall * (1 - shares[1] - shares[2]), wall * shares[1], wall * shares[2],
                            int(lags.max()) if len(lags) else 0)

    def collect(self, step: int, learner_version: int) -> StepRollouts:
        """The groups of `step` to train at `learner_version`."""
        return self.source.take(step, learner_version)

    def close(self) -> None:
        self.source.close()


class SyncSource:
    """sync: a step's groups requested when it starts, sampled by the weights just published."""

    def __init__(self, collector: Collector):
        self.collector = collector

    def take(self, step: int, learner_version: int) -> StepRollouts:
        return self.collector.requested(step, learner_version, learner_version)

    def close(self) -> None:
        pass


class AsyncSource:
    """async: the next step's groups are generated with the current weights while this step trains
    (taken at the next version: tokens more than `max_staleness` versions behind it are dropped)."""

    def __init__(self, collector: Collector):
        self.collector = collector
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self._next: tuple[int, concurrent.futures.Future] | None = None

    def take(self, step: int, learner_version: int) -> StepRollouts:
        c = self.collector
        if self._next is not None and self._next[0] == step:
            result = self._next[1].result()
        else:  # the first step, or one whose prefetch the run did not take
            result = c.requested(step, learner_version, learner_version)
        self._next = None
        if step + 1 < c.cfg.steps:
            self._next = (step + 1, self._pool.submit(c.requested, step + 1, oldest_trainable(c.cfg, learner_version),
                                                      learner_version + 1))
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StreamSource:
    """stream: groups taken as they complete from a `GroupStream`, started at the first step taken
    (groups are numbered on from its)."""

    def __init__(self, collector: Collector):
        self.collector = collector
        self._stream: GroupStream | None = None

    def take(self, step: int, learner_version: int) -> StepRollouts:
        c = self.collector
        if self._stream is None:
            self._stream = GroupStream(c.request, c.share, c.cfg, first_step=step, learner_version=learner_version)
        return c.streamed(step, learner_version, self._stream)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()


SOURCES: dict[str, Callable[[Collector], SyncSource | AsyncSource | StreamSource]] = {
    "sync": SyncSource, "async": AsyncSource, "stream": StreamSource}


class GroupStream:
    """Stream mode's supply of groups: `rollout.in_flight_groups` groups under way or done and not
    yet taken, one request each, so a group is handed over the moment its last episode ends and the
    bridge never waits for a step to start; the bound keeps groups from piling up (and going stale)
    while the learner trains. Groups are numbered on from the first step's (STEP-SLOT ids and tasks
    as the other modes draw them), in the order they are requested; they complete in any order."""

    def __init__(self, request: Callable[[int, list[int], int], list[Group]], share: Share, cfg: TrainConfig,
                 first_step: int, learner_version: int):
        self._request, self._share, self._cfg = request, share, cfg
        self._version = learner_version  # a request may be served by weights max_staleness older
        self._next = first_step * share.count
        self._lock = threading.Lock()
        self._done: queue.Queue[Group | BaseException] = queue.Queue()
        self._closed = threading.Event()
        # This process's part of the run's groups under way (all of them with one process).
        self._n = max(1, cfg.streamed_groups * share.count // share.total)
        self._room = threading.Semaphore(self._n)  # a group takes one until a step takes the group
        self._pool = concurrent.futures.ThreadPoolExecutor(self._n, thread_name_prefix="stream")
        for _ in range(self._n):
            self._pool.submit(self._supply)

    def _supply(self) -> None:
        while True:
            self._room.acquire()
            if self._closed.is_set():
                return
            with self._lock:
                step, i = divmod(self._next, self._share.count)
                self._next += 1
            try:
                [group] = self._request(step, [self._share.slot(i)], oldest_trainable(self._cfg, self._version))
            except BaseException as e:  # the step that takes it raises it
                self._done.put(e)
                return
            self._done.put(group)

    def take(self, learner_version: int) -> Group:
        """The next group to complete (waits for one), the requests from now on for `learner_version`;
        raises what stopped a request."""
        self._version = learner_version
        item = self._done.get()
        if isinstance(item, BaseException):
            raise item
        self._room.release()
        return item

    def close(self) -> None:
        self._closed.set()
        self._room.release(self._n)  # wakes every supplier waiting for room, to see it closed
        self._pool.shutdown(wait=False, cancel_futures=True)


class EnvWatch:
    """Warnings, once per environment, about what its episodes show of it and the config: the
    bridge's notices about what the model sees (an empty first turn, action fields left out);
    episodes cut by `rollout.max_turns: 1` that the environment had not ended (a multi-turn
    environment played for one turn); a session pool far above the capacity the server stated
    when it refused sessions (the episodes queue); a group whose episodes started from different
    first prompts (the bridge's group check: not one task); its first `same_after` groups all started
    from one first prompt and were handed tasks that differ in no field their reset takes (one task
    for the whole run: a reset that takes no field of its seed-drawn tasks; `task_of` gives a group
    id's task); and an environment none of whose rewards so far, over at least `zero_after` episodes,
    was anything but 0 (nothing to learn from it).

    One first prompt alone says nothing: TRL's rows share a prompt and differ in the columns reset
    reads (a secret number). Which fields a reset takes is known for an env_class (its signature);
    a served environment's reset is not seen from here, so tasks that differ count as read there."""

    def __init__(self, max_turns: int, specs: dict[str, EnvSpec], task_of: Callable[[str], dict[str, Any]],
                 zero_after: int = 512, same_after: int = 16):
        self.max_turns = max_turns
        self.specs = specs
        self.task_of = task_of
        self.zero_after = zero_after
        self.same_after = same_after
        self.groups: dict[str, set[str]] = collections.defaultdict(set)
        self.first_prompts: dict[str, set[bytes]] = collections.defaultdict(set)
        self.tasks: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)  # of the groups above
        self.reads: dict[str, frozenset[str] | None] = {}  # by environment: the task fields its reset takes
        self.scored: collections.Counter[str] = collections.Counter()
        self.nonzero: set[str] = set()
        self.warned: set[tuple[str, str]] = set()

    def observe(self, episodes: list[TrajectoryData]) -> None:
        for t in episodes:
            for notice in t.notices:  # the bridge's, about what the model sees (every bridge sends its own)
                self._warn(t.env, notice, notice)
            if t.finish_reason == "error":
                continue
            if self.max_turns == 1 and t.finish_reason == "max_turns":
                self._warn(t.env, "max_turns", "its episodes are not done after one turn, but rollout.max_turns is 1: "
                           "each ends after the model's first action; raise rollout.max_turns to play them out")
            capacity = int(t.metrics.get("server_max_sessions", 0))
            spec = self.specs.get(t.env)
            if capacity and spec is not None and spec.queues_at(capacity):
                self._warn(t.env, "capacity", f"its server allows {capacity} session(s) at once, but the bridge holds up "
                           f"to {spec.pool_size} for it: episodes queue for its slots (env/{t.env}/pool_wait_s, "
                           f"capacity_refusals); set max_concurrent_envs: {capacity} for it, or serve it with more "
                           "sessions")
            if t.metrics.get("groups_mixed"):
                self._warn(t.env, "groups_mixed", "the episodes of a group started from different first prompts, so "
                           "the group is not one task (its reset ignores the task's seed, or is random): pin the task "
                           "with fields its reset reads (data.task_fields, data.train_file rows, or data.splits on a "
                           f"server with task routes); env/{t.env}/groups_mixed counts such groups, and the "
                           "environment's mixed_groups: error stops the run on them")
            self._watch_tasks(t)
            if t.rewards:
                self.scored[t.env] += 1
                if any(v != 0 for v in t.rewards.values()):
                    self.nonzero.add(t.env)
            if self.scored[t.env] >= self.zero_after and t.env not in self.nonzero:
                self._warn(t.env, "zero", f"every reward of its {self.scored[t.env]} episodes so far is 0 "
                           f"({', '.join(sorted(t.rewards))}): nothing to learn from yet; check that the environment "
                           "gives rewards (an OpenEnv observation's reward) and that rewards[] scores it")

    def _watch_tasks(self, t: TrajectoryData) -> None:
        groups = self.groups[t.env]
        if len(groups) >= self.same_after or t.group_id in groups:
            return
        groups.add(t.group_id)
        self.first_prompts[t.env].add(t.prompt_ids.tobytes())
        self.tasks[t.env].append(self.task_of(t.group_id))
        if len(groups) < self.same_after or len(self.first_prompts[t.env]) > 1:
            return
        tasks = self.tasks[t.env]
        differ = sorted(k for k in set().union(*tasks)
                        if len({json.dumps(task[k], sort_keys=True, default=str) if k in task else None
                                for task in tasks}) > 1)
        reads = self._reset_fields(t.env)
        if any(reads is None or k in reads for k in differ):
            return  # the reset was handed different tasks: what it keeps unshown (a secret) differs
        handed = (f"their tasks differ only in field(s) its reset does not take ({', '.join(differ)})" if differ
                  else "they were all handed the same task")
        self._warn(t.env, "one_task", f"its first {self.same_after} groups all started from the same first prompt "
                   f"and {handed}: every episode plays one task; pin tasks with fields its reset reads "
                   "(data.task_fields, data.train_file rows) or data.splits, unless the run means to train on one "
                   "task")

    def _reset_fields(self, env: str) -> frozenset[str] | None:
        if env not in self.reads:
            spec = self.specs.get(env)
            try:
                self.reads[env] = reset_fields(spec) if spec is not None else None
            except EnvConfigError:  # the bridge imported it; this process cannot: say nothing it cannot tell
                self.reads[env] = None
        return self.reads[env]

    def _warn(self, env: str, kind: str, message: str) -> None:
        if (env, kind) not in self.warned:
            self.warned.add((env, kind))
            log.warning("environment %r: %s", env, message)


def most_common_error(failed: list[TrajectoryData]) -> str:
    """`(Nx): ERROR`: the error most of `failed` ended with, whole (those alike in their first 200
    characters count as one)."""
    first: dict[str, str] = {}
    for t in failed:
        first.setdefault(t.error[:200], t.error)
    kind, n = collections.Counter(t.error[:200] for t in failed).most_common(1)[0]
    return f"({n}x): {first[kind]}"


def check_rewards(episodes: list[TrajectoryData]) -> None:
    """Raises the first RewardError, RolloutFnError or MixedGroupError the bridge reported: a reward
    function (or an environment's reward) that returned something other than a finite number or None,
    a rollout function that returned an episode that cannot be trained on, or a group of episodes that
    started from different prompts (mixed_groups: error), stops the run."""
    for t in episodes:
        if t.finish_reason != "error":
            continue
        for error in (RewardError, RolloutFnError, MixedGroupError):
            prefix = f"{error.__name__}: "
            if t.error.startswith(prefix):
                raise error(t.error[len(prefix):])


@dataclasses.dataclass(frozen=True)
class EpisodeSummary:
    """What a step's metrics read of one trajectory: small enough for the processes of a
    multi-host run to exchange every step (jaxrl.run.distributed), where a trajectory is not."""

    env: str
    rewards: dict[str, float]
    metrics: dict[str, float]
    finish_reason: str
    num_turns: int
    model_tokens: int
    total_tokens: int
    policy_version: int
    prompt_tokens: int

    @classmethod
    def of(cls, t: TrajectoryData) -> EpisodeSummary:
        return cls(t.env, dict(t.rewards), dict(t.metrics), t.finish_reason, t.num_turns, int(t.loss_mask.sum()),
                   len(t.completion_ids), t.policy_version, len(t.prompt_ids))


def rollout_metrics(trajs: list[EpisodeSummary], counts: Mapping[str, float], cfg: TrainConfig) -> dict[str, float]:
    """Rewards (summed and per function), per-environment reward/success/tool use, lengths, and the
    step's `counts`, of the episodes kept for training."""
    weights = RewardWeights(cfg.rewards)
    out: dict[str, float] = {f"rollout/{k}": float(v) for k, v in counts.items()}
    if counts.get("trained_tokens"):
        out["rollout/staleness_mean"] = counts["trained_token_lag_sum"] / counts["trained_tokens"]
    if not trajs:
        return out
    summed = [weights.total(t.rewards) for t in trajs]
    summed = [s for s in summed if s is not None]
    if summed:
        out["reward/mean"] = float(np.mean(summed))
        out["reward/std"] = float(np.std(summed))
    for k in weights.keys:
        vals = [t.rewards[k] for t in trajs if k in t.rewards]
        if vals:
            out[f"reward/{k}"] = float(np.mean(vals))
    by_env = collections.defaultdict(list)
    for t in trajs:
        by_env[t.env].append(t)
    threshold = cfg.eval.success_threshold
    for env, ts in by_env.items():
        rs = [weights.total(t.rewards) for t in ts]
        rs = [r for r in rs if r is not None]
        if rs:
            out[f"env/{env}/reward"] = float(np.mean(rs))
            out[f"env/{env}/success"] = float(np.mean([r >= threshold for r in rs]))
        for m in ("tool_calls", "tool_errors", "action_errors", "env_steps", "retries"):
            vals = [t.metrics.get(m, 0.0) for t in ts]
            if any(vals):
                out[f"env/{env}/{m}"] = float(np.mean(vals))
        # The step's totals: how much its episodes queued for sessions, and its groups that were not one task.
        for m in (*SESSION_WAITS, "groups_mixed", "judge_malformed"):
            total = sum(t.metrics.get(m, 0.0) for t in ts)
            if total:
                out[f"env/{env}/{m}"] = float(total)
        out[f"env/{env}/episodes"] = float(len(ts))
    # Against the learner's prompt width (learner/prompt_width): what padding the step pays for.
    out["prompt/tokens"] = float(np.mean([t.prompt_tokens for t in trajs]))
    out["prompt/tokens_max"] = float(max(t.prompt_tokens for t in trajs))
    out["completion/model_tokens"] = float(np.mean([t.model_tokens for t in trajs]))
    out["completion/total_tokens"] = float(np.mean([t.total_tokens for t in trajs]))
    out["completion/turns"] = float(np.mean([t.num_turns for t in trajs]))
    out["completion/truncated"] = float(np.mean([t.finish_reason == "length" for t in trajs]))
    versions = [t.policy_version for t in trajs]
    out["rollout/oldest_version"] = float(min(versions))
    return out
