"""Rollout requests over a run's bridges: each group to the living bridge with the least work, the
unfinished groups of a bridge that dies requested again from the others, and calls every bridge
answers (Stats, LoadSnapshot). Which bridges live, and bringing dead ones back, is
`jaxrl.run.supervision.Bridges`'s.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import weakref
from collections.abc import Callable

import numpy as np

from bridge.client import BridgeClient, BridgeError, BridgeUnavailable
from bridge.wire import PromptGroup, SamplingParams, TrajectoryData
from jaxrl.run.config import BridgeConfig
from jaxrl.run.processes import BridgeProcesses
from jaxrl.run.supervision import Bridge, Bridges, BridgesDown
from jaxrl.run.tasks import Task

Group = list[TrajectoryData]
log = logging.getLogger(__name__)
CHECK_EVERY_S = 1.0


class RolloutClient:
    """Rollout requests spread over bridges by load, that survive bridges dying.

    Groups go to the living bridge with the fewest episodes outstanding (every request under way
    counts: a step's, a prefetch's, an evaluation's). A bridge whose stream fails is dead: its
    unfinished groups are requested again from the others, its complete ones kept, so each group
    is delivered once (and, seeded by its id, is the same episodes wherever it runs). With no bridge
    alive, requests wait for one (see `Bridges.wait_for_one`). `started`: the bridges the run
    started itself, restarted when they die. `check`: raises when the run cannot go on (an environment
    server left down); called every CHECK_EVERY_S while a request waits, so that it stops then
    rather than when the bridges' episode replays run out. `timeout_s`: a request's deadline (None:
    none); `streamed_groups`: stream mode's groups under way at once.
    """

    def __init__(self, addresses: list[str], cfg: BridgeConfig, token: str, started: BridgeProcesses | None = None,
                 check: Callable[[], None] = lambda: None, timeout_s: float | None = None, streamed_groups: int = 0):
        self.cfg = cfg
        self.check = check
        self.timeout_s = timeout_s
        self.bridges = Bridges(addresses, cfg, token, started)
        # A thread per request under way: a step's or an evaluation's per bridge, and stream mode's groups.
        self.pool = concurrent.futures.ThreadPoolExecutor(8 * len(addresses) + streamed_groups,
                                                          thread_name_prefix="rollout")
        self.outstanding = [0] * len(addresses)  # by bridge: episodes requested and not received yet, its load
        self.re_requested = 0  # groups requested again after their bridge died
        self._lock = threading.Lock()  # guards the two above and the one below
        self._cut_short: weakref.WeakSet[BridgeClient] = weakref.WeakSet()  # clients whose streams failed

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
        running: dict[concurrent.futures.Future, tuple[Bridge, BridgeClient, list[PromptGroup]]] = {}
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
                    self.bridges.wait_for_one()
                    continue
            finished, _ = concurrent.futures.wait(running, timeout=0.5 if pending else CHECK_EVERY_S,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
            self.check()
            if self.bridges.closing.is_set():
                # close() cancelled the streams not yet started, and wait() never reports a future that
                # its pool's shutdown cancelled: without this the request would wait forever.
                raise BridgesDown("the rollout client was closed while a request was under way")
            for future in finished:
                bridge, client, share = running.pop(future)
                pending += self._received(bridge, client, share, group_size, *future.result(), done)
        return [done[g.group_id] for g in groups]

    def _received(self, bridge: Bridge, client: BridgeClient, share: list[PromptGroup], group_size: int,
                  received: list[TrajectoryData], error: BridgeUnavailable | None, done: dict[str, Group]) -> list:
        """Keeps the complete groups of `share` in `done`; returns the others, to request again."""
        by_group = collections.defaultdict(list)
        for t in received:
            by_group[t.group_id].append(t)
        unfinished = [g for g in share if len(by_group[g.group_id]) != group_size]
        done.update({g.group_id: sorted(by_group[g.group_id], key=lambda t: t.index_in_group)
                     for g in share if len(by_group[g.group_id]) == group_size})
        if error is not None:
            self._failed(bridge, client, error)
            with self._lock:
                self.re_requested += len(unfinished)
                first = client not in self._cut_short
                self._cut_short.add(client)
            # One line a bridge's death, not one a stream it cut (stream mode has one a group under way). A run
            # of one bridge waits for it to come back (restarted, or answering again) instead.
            where = "from the other bridges" if len(self.outstanding) > 1 else "once it serves again"
            if first:
                log.warning("bridge %d at %s: its unfinished groups will be requested again %s "
                            "(groups/re_requested counts them)", bridge.index, bridge.address, where)
        return unfinished

    def _assign(self, groups: list[PromptGroup], group_size: int) -> dict[Bridge, tuple[BridgeClient, list]]:
        """Each group to the living bridge with the least outstanding; none when no bridge lives."""
        shares: dict[Bridge, tuple[BridgeClient, list]] = {}
        living = self.bridges.living()
        with self._lock:
            for g in groups if living else ():
                bridge, client = min(living, key=lambda bc: (self.outstanding[bc[0].index], bc[0].index))
                self.outstanding[bridge.index] += group_size
                shares.setdefault(bridge, (client, []))[1].append(g)
        return shares

    def _stream(self, bridge: Bridge, client: BridgeClient, groups: list[PromptGroup], group_size: int,
                params: SamplingParams, min_version: int, policy: str) -> tuple[list[TrajectoryData], Exception | None]:
        """The trajectories `bridge` streamed, and the BridgeUnavailable that cut them short, if one did."""
        received: list[TrajectoryData] = []
        try:
            for t in client.rollout(groups, group_size, params, min_policy_version=min_version,
                                    timeout_s=self.timeout_s, policy=policy):
                received.append(t)
                with self._lock:
                    self.outstanding[bridge.index] -= 1
        except BridgeUnavailable as e:
            return received, e
        finally:
            with self._lock:
                self.outstanding[bridge.index] -= len(groups) * group_size - len(received)
        return received, None

    def _failed(self, bridge: Bridge, client: BridgeClient, error: BridgeUnavailable) -> None:
        """A stream cut short: the bridge is dead, unless it was only the request's deadline that
        passed and the bridge still answers (then the request is at fault, and `error` is raised)."""
        if error.code is not None and error.code.name == "DEADLINE_EXCEEDED" and bridge.client is client:
            try:
                client.health(timeout_s=self.cfg.health_timeout_s)
            except BridgeError:
                pass
            else:
                raise error
        bridge.died(f"stopped answering ({error})", client)

    def _each(self, call, what: str) -> dict[BridgeClient, object]:
        """`call(client)` on every living bridge at once, by the client called; a bridge that does not
        answer is dead (None)."""
        def one(bridge_client):
            bridge, client = bridge_client
            try:
                return call(client)
            except BridgeUnavailable as e:
                bridge.died(f"stopped answering during {what} ({e})", client)
                return None

        living = self.bridges.living()
        return dict(zip([client for _, client in living], self.pool.map(one, living)))

    def stats(self) -> dict[BridgeClient, dict[str, float]]:
        """The living bridges' counters (`python -m bridge`'s Stats), by the client each is called
        through: a restarted bridge is another process, with another client and counters anew."""
        return {c: s for c, s in self._each(lambda c: c.stats(), "Stats").items() if s is not None}

    def load_snapshot(self, path: str, version: int) -> None:
        """Has every living bridge serve snapshot `version`; the others get it (or a newer one)
        before they serve again."""
        self.bridges.serve(path, version)
        self._each(lambda c: c.load_snapshot(path, version, timeout_s=self.cfg.start_timeout_s),
                   f"LoadSnapshot({version})")

    def metrics(self) -> dict[str, float]:
        """Bridges alive now; deaths, restarts (of the run's own), returns (of running ones) and
        groups requested again, so far."""
        with self._lock:
            return {**self.bridges.metrics(), "groups/re_requested": float(self.re_requested)}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.bridges.close()
