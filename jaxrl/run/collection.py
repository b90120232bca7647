"""From environment tasks to a step's groups: requests spread over bridges by load (and moved off
bridges that die), group filters, DAPO dynamic sampling with refills, async prefetch with a
staleness bound, and rollout metrics.

Groups are the unit: GRPO advantages compare the samples of one task, so a group with a failed
or stale episode is dropped whole (and refilled), never trained half. A truncated episode keeps
its place in its group but, with `drop_truncated`, contributes no loss (DAPO overlong filtering).
Rows missing after the refills are padding groups: loss mask 0, constant reward.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Mapping

import numpy as np

from bridge.client import BridgeClient, BridgeError, BridgeUnavailable
from bridge.envs.spec import EnvSpec, RewardError, RolloutFnError
from bridge.wire import PromptGroup, SamplingParams, TrajectoryData
from jaxrl.run.config import TrainConfig
from jaxrl.run.processes import BridgeProcesses, ChildStartError
from jaxrl.run.rewards import RewardWeights
from jaxrl.run.tasks import Task, TaskSource

Group = list[TrajectoryData]
log = logging.getLogger(__name__)
# Per-episode metrics of the bridge's session pools, summed per step: episodes that found the pool
# full, seconds spent getting a session, refusals of a server at capacity.
SESSION_WAITS = ("pool_waits", "pool_wait_s", "capacity_refusals")


class EnvironmentsDown(RuntimeError):
    """Too few episodes succeed: the environments (or the bridge's sessions to them) are failing."""


@dataclasses.dataclass
class StepRollouts:
    groups: list[Group]
    counts: collections.Counter
    wall_s: float
    generate_s: float  # the wall time split by the episodes' own generate/env shares
    env_s: float

    def summaries(self) -> list[list[EpisodeSummary]]:
        return [[EpisodeSummary.of(t) for t in g] for g in self.groups]


class BridgesDown(RuntimeError):
    """No bridge is left: none has served for longer than `bridge.grace_s`, or every bridge the run
    started kept dying. The first line names each bridge and why it died; their log tails follow."""


@dataclasses.dataclass(eq=False)
class _Bridge:
    """One bridge as the client sees it."""

    index: int
    address: str
    client: BridgeClient
    pid: int | None = None  # when the run started it
    alive: bool = True
    down: bool = False  # left down: it kept dying (bridge.max_restarts)
    outstanding: int = 0  # episodes requested from it and not received yet: its load
    died: str = ""  # why it last died (one line)
    tail: str = ""  # the end of its log then, when the run started it


class RolloutClient:
    """Rollout requests spread over bridges by load, that survive bridges dying.

    Groups go to the living bridge with the fewest episodes outstanding (every request under way
    counts: a step's, a prefetch's, an evaluation's). A bridge is dead when its process exits,
    its stream fails, or it misses a health check (`bridge.health_timeout_s`; a watcher thread
    per bridge pings it): its unfinished groups are requested again from the others, its
    complete ones kept, so each group is delivered once (and, seeded by its id, is the same
    episodes wherever it runs). A bridge of the run's own (`started`) is restarted and given the
    newest snapshot before it gets work; a running one (by address) gets work again once it
    answers. With no bridge alive, requests wait up to `bridge.grace_s`, then raise BridgesDown.
    """

    def __init__(self, addresses: list[str], cfg: TrainConfig, token: str, started: BridgeProcesses | None = None):
        if not addresses:
            raise ValueError("no bridge addresses")
        self.cfg, self.token, self.started = cfg, token, started
        self.bridges = [_Bridge(i, a, self._connect(a), started.bridges[i].pid if started else None)
                        for i, a in enumerate(addresses)]
        self.pool = concurrent.futures.ThreadPoolExecutor(8 * len(self.bridges), thread_name_prefix="rollout")
        self.snapshot: tuple[str, int] | None = None  # the newest the bridges were asked to serve
        self.counts: collections.Counter = collections.Counter()  # deaths, restarts, returned, re_requested
        self._changed = threading.Condition()  # guards the bridges' state; notified when it changes
        self._none_since: float | None = None  # when the last living bridge died
        self._closing = threading.Event()
        for b in self.bridges:
            threading.Thread(target=self._watch, args=(b,), daemon=True, name=f"bridge-{b.index}-watch").start()

    def _connect(self, address: str) -> BridgeClient:
        # The deadline of unary calls and of noticing a silent bridge while it streams (keepalive pings).
        b = self.cfg.bridge
        return BridgeClient(address, timeout_s=b.health_timeout_s, token=self.token, tls_ca=b.tls_ca)

    def request(self, tasks: list[Task], group_ids: list[str], group_size: int, params: SamplingParams,
                min_version: int, policy: str = "") -> list[Group]:
        """Trajectories of each task's group, in task order (`policy="solver"`: the environments'
        solvers play)."""
        groups = [PromptGroup(np.zeros(0, np.int32), g, env, fields) for g, (env, fields) in zip(group_ids, tasks)]
        return self.rollout(groups, group_size, params, min_version, policy)

    def rollout(self, groups: list[PromptGroup], group_size: int, params: SamplingParams, min_version: int,
                policy: str = "") -> list[Group]:
        """Each group's `group_size` trajectories (by index), in the order of `groups`."""
        done: dict[str, Group] = {}
        pending = list(groups)
        running: dict[concurrent.futures.Future, tuple[_Bridge, BridgeClient, list[PromptGroup]]] = {}
        while pending or running:
            if pending:
                shares = self._assign(pending, group_size)
                for bridge, (client, share) in shares.items():
                    future = self.pool.submit(self._stream, bridge, client, share, group_size, params, min_version,
                                              policy)
                    running[future] = (bridge, client, share)
                if shares:
                    pending = []
                elif not running:
                    self._wait_for_a_bridge()
                    continue
            finished, _ = concurrent.futures.wait(running, timeout=0.5 if pending else None,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                bridge, client, share = running.pop(future)
                received, error = future.result()
                by_group = collections.defaultdict(list)
                for t in received:
                    by_group[t.group_id].append(t)
                unfinished = [g for g in share if len(by_group[g.group_id]) != group_size]
                done.update({g.group_id: sorted(by_group[g.group_id], key=lambda t: t.index_in_group)
                             for g in share if len(by_group[g.group_id]) == group_size})
                if error is not None:
                    self._failed(bridge, client, error)
                    with self._changed:
                        self.counts["re_requested"] += len(unfinished)
                    log.warning("bridge %d at %s: %d unfinished group(s) requested again from the other bridges",
                                bridge.index, bridge.address, len(unfinished))
                pending += unfinished
        return [done[g.group_id] for g in groups]

    def _assign(self, groups: list[PromptGroup], group_size: int) -> dict[_Bridge, tuple[BridgeClient, list]]:
        """Each group to the living bridge with the least outstanding; none when no bridge lives."""
        shares: dict[_Bridge, tuple[BridgeClient, list]] = {}
        with self._changed:
            alive = [b for b in self.bridges if b.alive]
            for g in groups if alive else ():
                bridge = min(alive, key=lambda b: (b.outstanding, b.index))
                bridge.outstanding += group_size
                shares.setdefault(bridge, (bridge.client, []))[1].append(g)
        return shares

    def _stream(self, bridge: _Bridge, client: BridgeClient, groups: list[PromptGroup], group_size: int,
                params: SamplingParams, min_version: int, policy: str) -> tuple[list[TrajectoryData], Exception | None]:
        """The trajectories `bridge` streamed, and the BridgeUnavailable that cut them short, if one did."""
        r = self.cfg.rollout
        received: list[TrajectoryData] = []
        try:
            for t in client.rollout(groups, group_size, params, min_policy_version=min_version, max_turns=r.max_turns,
                                    max_total_tokens=r.max_total_tokens, timeout_s=self.cfg.rollout_timeout_s,
                                    policy=policy):
                received.append(t)
                with self._changed:
                    bridge.outstanding -= 1
        except BridgeUnavailable as e:
            return received, e
        finally:
            with self._changed:
                bridge.outstanding -= len(groups) * group_size - len(received)
        return received, None

    def _failed(self, bridge: _Bridge, client: BridgeClient, error: BridgeUnavailable) -> None:
        """A stream cut short: the bridge is dead, unless it was only the request's deadline that
        passed and the bridge still answers (then the request is at fault, and `error` is raised)."""
        if error.code is not None and error.code.name == "DEADLINE_EXCEEDED" and bridge.client is client:
            try:
                client.health(timeout_s=self.cfg.bridge.health_timeout_s)
            except BridgeError:
                pass
            else:
                raise error
        self._mark_dead(bridge, client, f"stopped answering ({error})")

    def _mark_dead(self, bridge: _Bridge, client: BridgeClient, why: str) -> None:
        process = self.started.bridges[bridge.index] if self.started is not None else None
        if process is not None:
            process.child.wait(0.2)  # a killed bridge's stream ends a moment before its process is reaped
        with self._changed:
            if self._closing.is_set() or not bridge.alive or bridge.client is not client:
                return  # found dead already, or replaced since
            if process is not None and process.proc.poll() is not None:
                why = _exit_words(process.proc.returncode)
            bridge.alive, bridge.died = False, why
            bridge.tail = process.stderr_tail(10) if process is not None else ""
            self.counts["deaths"] += 1
            if not any(b.alive for b in self.bridges):
                self._none_since = time.monotonic()
            self._changed.notify_all()
        client.close()  # ends its streams under way
        log.warning("bridge %d at %s%s %s; %s", bridge.index, bridge.address,
                    f" (pid {bridge.pid})" if bridge.pid else "", why,
                    "restarting it" if process is not None else "waiting for it to answer again")

    def _watch(self, bridge: _Bridge) -> None:
        """Finds `bridge` dead (its process gone, a health check missed) and brings it back."""
        period = min(1.0, self.cfg.bridge.health_timeout_s / 2)
        while not self._closing.wait(period):
            client = bridge.client
            if bridge.alive:
                why = self._check(bridge, client)
                if why:
                    self._mark_dead(bridge, client, why)
            elif not bridge.down:
                self._revive(bridge)

    def _check(self, bridge: _Bridge, client: BridgeClient) -> str | None:
        """Why `bridge` is dead, or None while it lives."""
        if self.started is not None:
            code = self.started.bridges[bridge.index].proc.poll()
            if code is not None:
                return _exit_words(code)
        try:
            client.health(timeout_s=self.cfg.bridge.health_timeout_s)
        except BridgeUnavailable as e:
            return f"missed a health check (bridge.health_timeout_s={self.cfg.bridge.health_timeout_s:g}: {e})"
        except BridgeError:
            pass  # it answers
        return None

    def _revive(self, bridge: _Bridge) -> None:
        """A started bridge restarted, a running one probed; either given the newest snapshot, then work."""
        pid = None
        if self.started is not None:
            try:
                process = self.started.restart(bridge.index)
            except ChildStartError as e:
                log.warning("restarting bridge %d failed: %s", bridge.index, str(e).splitlines()[0])
                return  # the next round tries again, counted against bridge.max_restarts
            if process is None:
                with self._changed:
                    bridge.down = not self._closing.is_set()
                    self._changed.notify_all()
                if bridge.down:
                    log.error("bridge %d kept dying: left down (bridge.max_restarts=%d within 10 minutes)",
                              bridge.index, self.cfg.bridge.max_restarts)
                return
            address, pid = process.address, process.pid
        else:
            address = bridge.address
        client = self._connect(address)
        try:
            client.health(timeout_s=self.cfg.bridge.health_timeout_s)
            loaded = None
            while True:
                with self._changed:
                    if self.snapshot == loaded and not self._closing.is_set():
                        bridge.client, bridge.address, bridge.pid = client, address, pid
                        bridge.alive, self._none_since = True, None
                        self.counts["restarts" if pid else "returned"] += 1
                        self._changed.notify_all()
                        break
                    if self._closing.is_set():
                        client.close()
                        return
                    loaded = self.snapshot
                client.load_snapshot(*loaded, timeout_s=self.cfg.bridge.start_timeout_s)
        except BridgeError as e:
            client.close()
            if pid:
                log.warning("bridge %d (pid %d) restarted but failed: %s", bridge.index, pid, e)
            return
        log.warning("bridge %d %s at %s%s, serving snapshot version %s", bridge.index,
                    "restarted" if pid else "answers again", address, f" (pid {pid})" if pid else "",
                    loaded[1] if loaded else "(none yet: the model)")

    def _wait_for_a_bridge(self) -> None:
        """Returns once a bridge lives; BridgesDown when none has for `bridge.grace_s`, or none can."""
        grace = self.cfg.bridge.grace_s
        with self._changed:
            while not any(b.alive for b in self.bridges):
                waited = time.monotonic() - (self._none_since or time.monotonic())
                if self._closing.is_set() or all(b.down for b in self.bridges) or waited > grace:
                    raise BridgesDown(self._down_message(waited))
                self._changed.wait(min(1.0, grace - waited + 0.01))

    def _down_message(self, waited: float) -> str:
        b = self.cfg.bridge
        if self._closing.is_set():
            reason = "the rollout client was closed"
        elif all(x.down for x in self.bridges):
            reason = f"every bridge kept dying (bridge.max_restarts={b.max_restarts} within 10 minutes)"
        else:
            reason = f"none has served for {waited:.0f} s (bridge.grace_s={b.grace_s:g})"
        died = "; ".join(f"bridge {x.index} at {x.address}{f' (pid {x.pid})' if x.pid else ''}: {x.died}"
                         for x in self.bridges)
        logs = ([p for p in (self.started.log_path(x.index) for x in self.bridges) if p]
                if self.started is not None else [])
        tails = "".join(f"\nbridge {x.index}'s log ends with:\n{x.tail}" for x in self.bridges if x.tail)
        return f"no bridge left: {reason}; {died}" + (f" (logs: {', '.join(logs)})" if logs else "") + tails

    def _living(self) -> list[tuple[_Bridge, BridgeClient]]:
        with self._changed:
            return [(b, b.client) for b in self.bridges if b.alive]

    def _each(self, call, what: str) -> list:
        """`call(client)` on every living bridge at once; a bridge that does not answer is dead (None)."""
        def one(bridge_client):
            bridge, client = bridge_client
            try:
                return call(client)
            except BridgeUnavailable as e:
                self._mark_dead(bridge, client, f"stopped answering during {what} ({e})")
                return None

        return list(self.pool.map(one, self._living()))

    def stats(self) -> list[dict[str, float]]:
        """The living bridges' counters (`python -m bridge`'s Stats)."""
        return [s for s in self._each(lambda c: c.stats(), "Stats") if s is not None]

    def load_snapshot(self, path: str, version: int) -> None:
        """Has every living bridge serve snapshot `version`; the others get it (or a newer one)
        before they serve again."""
        with self._changed:
            self.snapshot = (path, version)
        self._each(lambda c: c.load_snapshot(path, version, timeout_s=self.cfg.bridge.start_timeout_s),
                   f"LoadSnapshot({version})")

    def metrics(self) -> dict[str, float]:
        """Bridges alive now; deaths, restarts (of the run's own), returns (of running ones) and
        groups requested again, so far."""
        with self._changed:
            return {"bridges/alive": float(sum(b.alive for b in self.bridges)),
                    **{f"bridges/{k}": float(self.counts[k]) for k in ("deaths", "restarts", "returned")},
                    "groups/re_requested": float(self.counts["re_requested"])}

    def close(self) -> None:
        self._closing.set()
        with self._changed:
            self._changed.notify_all()
            clients = [b.client for b in self.bridges]
        self.pool.shutdown(wait=False, cancel_futures=True)
        for c in clients:
            c.close()


def _exit_words(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


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
    """One step's groups (this process's share of them): request, filter, refill; in async mode the
    next step is prefetched."""

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
        self.prefetch = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self.pending: tuple[int, concurrent.futures.Future] | None = None
        self.watch = EnvWatch(cfg.rollout.max_turns, {e.name: e for e in cfg.envs})

    def _keep(self, group: Group, learner_version: int, counts: collections.Counter) -> bool:
        if any(t.finish_reason == "error" for t in group):
            counts["groups_failed"] += 1
            return False
        # Sync mode trains on the version just published only; async on versions at most
        # max_staleness behind. A newer version than the learner's was never published by this run.
        oldest = learner_version - (self.cfg.rollout.max_staleness if self.cfg.rollout.mode == "async" else 0)
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

    def _collect(self, step: int, min_version: int, learner_version_at_use: int) -> StepRollouts:
        r = self.cfg.rollout
        need, taken = self.share.count, 0
        kept: list[Group] = []
        counts: collections.Counter = collections.Counter()
        start = time.perf_counter()
        gen = env = 0.0
        for attempt in range(r.max_refills + 1):
            n = need - len(kept)
            slots = [self.share.slot(taken + i) for i in range(n)]
            tasks = [self.tasks.train(step, slot) for slot in slots]
            ids = [f"{step}-{slot}" for slot in slots]
            taken += n
            groups = self.client.request(tasks, ids, self.cfg.learner.group_size, self.params, min_version)
            counts["requests"] += 1
            episodes = [t for g in groups for t in g]
            check_rewards(episodes)
            self.watch.observe(episodes)
            failed = [t for t in episodes if t.finish_reason == "error"]
            counts["episodes"] += len(episodes)
            counts["episodes_failed"] += len(failed)
            counts["episodes_retried"] += sum(t.metrics.get("retries", 0.0) > 0 for t in episodes)
            if len(episodes) - len(failed) < r.min_success_fraction * len(episodes):
                worst, n = collections.Counter(t.error[:200] for t in failed).most_common(1)[0]
                raise EnvironmentsDown(
                    f"step {step}: only {len(episodes) - len(failed)} of {len(episodes)} episodes succeeded "
                    f"(rollout.min_success_fraction={r.min_success_fraction}); most common error ({n}x): {worst}")
            for t in episodes:
                if t.finish_reason != "error":
                    counts["episodes_scored" if self.rewards.total(t.rewards) is not None else "episodes_unscored"] += 1
            gen += sum(t.generate_s for t in episodes)
            env += sum(t.env_s for t in episodes)
            kept += [g for g in groups if self._keep(g, learner_version_at_use, counts)]
            if len(kept) >= need:
                break
        wall = time.perf_counter() - start
        counts["refills"] = max(counts["requests"] - 1, 0)
        counts["groups_padded"] = need - len(kept)
        share = env / (gen + env) if gen + env > 0 else 0.0
        return StepRollouts(kept, counts, wall, wall * (1 - share), wall * share)

    def collect(self, step: int, learner_version: int) -> StepRollouts:
        """The groups of `step`; async mode returns the prefetched ones and starts the next."""
        if self.cfg.rollout.mode == "sync":
            return self._collect(step, learner_version, learner_version)
        if self.pending is not None and self.pending[0] == step:
            result = self.pending[1].result()
        else:
            result = self._collect(step, learner_version, learner_version)
        self.pending = None
        return result

    def prefetch_next(self, step: int, learner_version: int) -> None:
        """Async mode: generate `step`'s groups with the current weights while the learner trains.

        Used after the update, at version learner_version + 1: trajectories older than
        `max_staleness` versions by then are dropped.
        """
        if self.cfg.rollout.mode != "async" or self.pending is not None:
            return
        min_version = max(0, learner_version - self.cfg.rollout.max_staleness)
        self.pending = (step, self.prefetch.submit(self._collect, step, min_version, learner_version + 1))

    def close(self) -> None:
        self.prefetch.shutdown(wait=False, cancel_futures=True)


class EnvWatch:
    """Warnings, once per environment, about what its episodes show of it and the config:
    episodes cut by `rollout.max_turns: 1` that the environment had not ended (a multi-turn
    environment played for one turn); a session pool far above the capacity the server stated
    when it refused sessions (the episodes queue); and an environment none of whose rewards so
    far, over at least `zero_after` episodes, was anything but 0 (nothing to learn from it)."""

    def __init__(self, max_turns: int, specs: dict[str, EnvSpec], zero_after: int = 512):
        self.max_turns = max_turns
        self.specs = specs
        self.zero_after = zero_after
        self.scored: collections.Counter[str] = collections.Counter()
        self.nonzero: set[str] = set()
        self.warned: set[tuple[str, str]] = set()

    def observe(self, episodes: list[TrajectoryData]) -> None:
        for t in episodes:
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
            if t.rewards:
                self.scored[t.env] += 1
                if any(v != 0 for v in t.rewards.values()):
                    self.nonzero.add(t.env)
            if self.scored[t.env] >= self.zero_after and t.env not in self.nonzero:
                self._warn(t.env, "zero", f"every reward of its {self.scored[t.env]} episodes so far is 0 "
                           f"({', '.join(sorted(t.rewards))}): nothing to learn from yet; check that the environment "
                           "gives rewards (an OpenEnv observation's reward) and that rewards[] scores it")

    def _warn(self, env: str, kind: str, message: str) -> None:
        if (env, kind) not in self.warned:
            self.warned.add((env, kind))
            log.warning("environment %r: %s", env, message)


def check_rewards(episodes: list[TrajectoryData]) -> None:
    """Raises the first RewardError or RolloutFnError the bridge reported: a reward function (or an
    environment's reward) that returned something other than a finite number or None, or a rollout
    function that returned an episode that cannot be trained on, stops the run."""
    for t in episodes:
        if t.finish_reason != "error":
            continue
        for error in (RewardError, RolloutFnError):
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

    @classmethod
    def of(cls, t: TrajectoryData) -> EpisodeSummary:
        return cls(t.env, dict(t.rewards), dict(t.metrics), t.finish_reason, t.num_turns, int(t.loss_mask.sum()),
                   len(t.completion_ids), t.policy_version)


def rollout_metrics(trajs: list[EpisodeSummary], counts: Mapping[str, float], cfg: TrainConfig) -> dict[str, float]:
    """Rewards (summed and per function), per-environment reward/success/tool use, lengths, and the
    step's `counts`, of the episodes kept for training."""
    weights = RewardWeights(cfg.rewards)
    out: dict[str, float] = {f"rollout/{k}": float(v) for k, v in counts.items()}
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
        for m in SESSION_WAITS:  # the step's totals: how much its episodes queued for sessions
            total = sum(t.metrics.get(m, 0.0) for t in ts)
            if total:
                out[f"env/{env}/{m}"] = float(total)
        out[f"env/{env}/episodes"] = float(len(ts))
    out["completion/model_tokens"] = float(np.mean([t.model_tokens for t in trajs]))
    out["completion/total_tokens"] = float(np.mean([t.total_tokens for t in trajs]))
    out["completion/turns"] = float(np.mean([t.num_turns for t in trajs]))
    out["completion/truncated"] = float(np.mean([t.finish_reason == "length" for t in trajs]))
    versions = [t.policy_version for t in trajs]
    out["rollout/oldest_version"] = float(min(versions))
    return out
