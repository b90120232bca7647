"""Keeping a run's children serving: one restart policy (`RestartWindow`) and one watcher
(`Watched`), for its bundled environment servers (`EnvServers`) and its bridges (`Bridges`).

A watched child is looked at on a thread of its own every period: while it serves, `probe` says
why it is dead (its process exited, it missed a health check); once it is dead it is brought back
(`revive`: restarted as it was, or, for a running bridge that is not the run's own, probed until it
answers again) as often as its window allows, then left down (`give_up`), which the run reports:
`EnvServers.check()` raises EnvServerDown, and a request with no bridge left raises BridgesDown.

Starting, stopping and restarting a process is `jaxrl.run.processes`'s; which bridge gets which
groups is `jaxrl.run.rollout_client`'s.
"""

from __future__ import annotations

import abc
import collections
import logging
import threading
import time
from pathlib import Path

from bridge.client import BridgeClient, BridgeError, BridgeUnavailable
from jaxrl.run.config import BridgeConfig
from jaxrl.run.processes import BridgeProcess, BridgeProcesses, ChildStartError, EnvServerProcess

log = logging.getLogger(__name__)


class RestartWindow:
    """At most `max_restarts` restarts within any `window_s`: a child that dies more often than that
    fails for a reason a restart does not cure."""

    def __init__(self, max_restarts: int, window_s: float = 600.0):
        self.max_restarts, self.window_s = max_restarts, window_s
        self._times: collections.deque[float] = collections.deque()

    def allow(self) -> bool:
        """Whether one more restart fits in the window; one that does is counted."""
        now = time.monotonic()
        while self._times and self._times[0] < now - self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True


class Watched(abc.ABC):
    """A child kept serving by its watcher thread (see the module's docstring): subclasses say why
    it is dead (`probe`), what its death changes (`died`), how it comes back (`revive`, which sets
    `alive` again) and what leaving it down means (`give_up`, which sets `down`). `window`: None for
    a child that is not the run's to restart (it is only probed again, never given up)."""

    def __init__(self, label: str, window: RestartWindow | None):
        self.label, self.window = label, window
        self.alive = True
        self.down = False

    def watch(self, period_s: float, stop: threading.Event) -> threading.Thread:
        """Starts the watcher thread; it ends once `stop` is set."""
        thread = threading.Thread(target=self._watch, args=(period_s, stop), daemon=True, name=f"{self.label}-watch")
        thread.start()
        return thread

    def _watch(self, period_s: float, stop: threading.Event) -> None:
        while not stop.wait(period_s):
            if self.alive:
                why = self.probe()
                if why is None:
                    continue
                self.died(why)
            if self.alive or self.down:
                continue
            if self.window is not None and not self.window.allow():
                self.give_up()
                continue
            try:
                self.revive()
            except ChildStartError as e:  # still dead: the next round tries again, counted in the window
                log.warning("restarting %s failed: %s", self.label, str(e).splitlines()[0])

    @abc.abstractmethod
    def probe(self) -> str | None: ...

    @abc.abstractmethod
    def died(self, why: str) -> None: ...

    @abc.abstractmethod
    def revive(self) -> None: ...

    @abc.abstractmethod
    def give_up(self) -> None: ...


class EnvServerDown(RuntimeError):
    """A bundled environment server kept exiting: it is not restarted again."""


class EnvServers:
    """A run's bundled environment servers, each watched: one that exits (killed, crashed) is
    restarted on its port within `poll_s`, so the URL the bridge was given stays valid, and counted
    in `restarts`. One that exits more than `max_restarts` times within `window_s` is a real
    failure: it is left down, and `check()` raises EnvServerDown naming it and its log. A context
    manager: leaving it stops the watchers, then every server.
    """

    def __init__(self, max_restarts: int = 3, window_s: float = 600.0, poll_s: float = 0.2):
        self.max_restarts, self.window_s, self.poll_s = max_restarts, window_s, poll_s
        self.restarts: collections.Counter[str] = collections.Counter()
        self.error: str | None = None
        self._watched: dict[str, _EnvServer] = {}
        self._watchers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    @property
    def servers(self) -> dict[str, EnvServerProcess]:
        """Each server as it runs now (the newest of its restarts), by key."""
        with self._lock:
            return {key: w.server for key, w in self._watched.items()}

    def start(self, key: str, name: str, **kwargs) -> EnvServerProcess:
        """Starts bundled environment `name` (EnvServerProcess.start arguments) and watches it as `key`."""
        server = EnvServerProcess.start(name, **kwargs)
        watched = _EnvServer(self, key, server)
        with self._lock:
            self._watched[key] = watched
        self._watchers.append(watched.watch(self.poll_s, self._stopping))
        return server

    def check(self) -> None:
        """Raises EnvServerDown if a server kept exiting and was left down."""
        if self.error is not None:
            raise EnvServerDown(self.error)

    def metrics(self) -> dict[str, float]:
        """`env/<key>/restarts`: how many times each server was restarted so far."""
        return {f"env/{key}/restarts": float(self.restarts[key]) for key in self.servers}

    def __enter__(self) -> EnvServers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stops the watchers (a restart under way is given a few seconds), then every server."""
        self._stopping.set()
        deadline = time.monotonic() + 5.0
        for thread in self._watchers:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        for server in self.servers.values():
            server.stop()


class _EnvServer(Watched):
    def __init__(self, owner: EnvServers, key: str, server: EnvServerProcess):
        super().__init__(f"environment server {key!r}", RestartWindow(owner.max_restarts, owner.window_s))
        self.owner, self.key, self.server = owner, key, server

    def probe(self) -> str | None:
        return None if self.server.alive else self.server.exit_words()

    def died(self, why: str) -> None:
        self.alive = False

    def revive(self) -> None:
        old = self.server
        log.warning("environment server %r (pid %d) %s; restarting it on port %d (log: %s)",
                    self.key, old.pid, old.exit_words(), old.port, old.log_path)
        fresh = old.restart()
        with self.owner._lock:
            if self.owner._stopping.is_set():
                fresh.stop(term_s=1.0)
                return
            self.server, self.alive = fresh, True
            self.owner.restarts[self.key] += 1
        log.warning("environment server %r restarted (pid %d, restart %d)", self.key, fresh.pid,
                    self.owner.restarts[self.key])

    def give_up(self) -> None:
        self.down = True
        s = self.server
        self.owner.error = (f"environment server {self.key!r} (pid {s.pid}) exited {self.window.max_restarts + 1} "
                            f"times within {self.window.window_s:g} s (the last time it {s.exit_words()}); it is not "
                            f"restarted again: see its log {s.log_path or '(none kept)'}")
        log.error("%s", self.owner.error)


class BridgesDown(RuntimeError):
    """No bridge is left: none has served for longer than `bridge.grace_s`, or every bridge the run
    started kept dying. The first line names each bridge and why it died; their log tails follow."""


class Bridges:
    """The run's bridges as its clients see them, each watched: a bridge is dead when its process
    exits, it misses a health check (`bridge.health_timeout_s`), or a client's call to it fails
    (`Bridge.died`). A bridge of the run's own (`started`) is restarted, within `bridge.max_restarts`
    in 10 minutes, and given the newest snapshot (`serve`) before it serves again; a running one (by
    address) serves again once it answers. `changed` guards their state and is notified when it
    changes.
    """

    def __init__(self, addresses: list[str], cfg: BridgeConfig, token: str, started: BridgeProcesses | None = None):
        if not addresses:
            raise ValueError("no bridge addresses")
        self.cfg, self.token = cfg, token
        self.changed = threading.Condition()
        self.closing = threading.Event()
        self.snapshot: tuple[str, int] | None = None  # the newest the bridges were asked to serve
        self.counts: collections.Counter = collections.Counter()  # deaths, restarts, returned
        self.members = [Bridge(self, i, a, started.bridges[i] if started else None, started)
                        for i, a in enumerate(addresses)]
        self.none_since: float | None = None  # when the last living bridge died (None while one lives)
        self.started = started
        for b in self.members:
            b.watch(min(1.0, cfg.health_timeout_s / 2), self.closing)

    def connect(self, address: str) -> BridgeClient:
        # The deadline of unary calls and of noticing a silent bridge while it streams (keepalive pings).
        return BridgeClient(address, timeout_s=self.cfg.health_timeout_s, token=self.token, tls_ca=self.cfg.tls_ca)

    def living(self) -> list[tuple[Bridge, BridgeClient]]:
        """The bridges that serve now, each with the client to call it through."""
        with self.changed:
            return [(b, b.client) for b in self.members if b.alive]

    def serve(self, path: str, version: int) -> None:
        """Snapshot `version` (at `path`) is the newest: a bridge that comes back loads it first."""
        with self.changed:
            self.snapshot = (path, version)

    def relaunch(self, model: Path) -> None:
        """The run's own bridges stopped and started again on the model directory `model` (a LoRA
        run's warm-started base, see jaxrl.run.train), serving it as version 0: planned, so neither
        deaths nor restarts. Between requests only: none serves meanwhile. Raises BridgeStartError."""
        with self.changed:
            for b in self.members:
                b.alive, b.down = False, True  # their watchers leave them be
            self.snapshot = None
        processes = self.started.relaunch(model)
        with self.changed:
            for b, process in zip(self.members, processes):
                b.client.close()
                b.process, b.address, b.pid = process, process.address, process.pid
                b.client = self.connect(process.address)
                b.alive, b.down = True, False
            self.changed.notify_all()

    def wait_for_one(self) -> None:
        """Returns once a bridge lives; BridgesDown when none has for `bridge.grace_s`, or none can."""
        grace = self.cfg.grace_s
        with self.changed:
            while not any(b.alive for b in self.members):
                waited = time.monotonic() - (self.none_since or time.monotonic())
                if self.closing.is_set() or all(b.down for b in self.members) or waited > grace:
                    raise BridgesDown(self._down_message(waited))
                self.changed.wait(min(1.0, grace - waited + 0.01))

    def _down_message(self, waited: float) -> str:
        if self.closing.is_set():
            reason = "the rollout client was closed"
        elif all(x.down for x in self.members):
            reason = f"every bridge kept dying (bridge.max_restarts={self.cfg.max_restarts} within 10 minutes)"
        else:
            reason = f"none has served for {waited:.0f} s (bridge.grace_s={self.cfg.grace_s:g})"
        died = "; ".join(f"bridge {x.index} at {x.address}{f' (pid {x.pid})' if x.pid else ''}: {x.cause}"
                         for x in self.members)
        logs = [x.process.log_path for x in self.members if x.process is not None and x.process.log_path]
        tails = "".join(f"\nbridge {x.index}'s log ends with:\n{x.tail}" for x in self.members if x.tail)
        return f"no bridge left: {reason}; {died}" + (f" (logs: {', '.join(logs)})" if logs else "") + tails

    def metrics(self) -> dict[str, float]:
        """Bridges alive now; deaths, restarts (of the run's own) and returns (of running ones) so far."""
        with self.changed:
            return {"bridges/alive": float(sum(b.alive for b in self.members)),
                    **{f"bridges/{k}": float(self.counts[k]) for k in ("deaths", "restarts", "returned")}}

    def close(self) -> None:
        """Stops the watchers and closes every client (their calls under way end)."""
        self.closing.set()
        with self.changed:
            self.changed.notify_all()
            clients = [b.client for b in self.members]
        for c in clients:
            c.close()


class Bridge(Watched):
    """One bridge of `Bridges`: where it listens, the client to call it through, and, when it died,
    why (`cause`) and the end of its log (`tail`, for a bridge the run started: its `process`)."""

    def __init__(self, owner: Bridges, index: int, address: str, process: BridgeProcess | None,
                 started: BridgeProcesses | None):
        super().__init__(f"bridge {index}", RestartWindow(owner.cfg.max_restarts) if started else None)
        self.owner, self.index, self.address = owner, index, address
        self.process, self._started = process, started
        self.client = owner.connect(address)
        self.probed = self.client  # the client of the watcher's last probe
        self.pid = process.pid if process is not None else None
        self.cause = ""
        self.tail = ""

    def probe(self) -> str | None:
        process, self.probed = self.process, self.client
        exited = process.exit_words() if process is not None else None
        if exited is not None:
            return exited
        timeout = self.owner.cfg.health_timeout_s
        try:
            self.probed.health(timeout_s=timeout)
        except BridgeUnavailable as e:
            return f"missed a health check (bridge.health_timeout_s={timeout:g}: {e})"
        except BridgeError:
            pass  # it answers
        return None

    def died(self, why: str, client: BridgeClient | None = None) -> None:
        """The bridge is dead (unless `client`, the one a failed call went through, or by default the
        one the watcher probed, was replaced since: a relaunch may have replaced the bridge meanwhile)."""
        owner, client = self.owner, client or self.probed
        process = self.process
        if process is not None:
            process.wait(0.2)  # a killed bridge's stream ends a moment before its process is reaped
        with owner.changed:
            if owner.closing.is_set() or not self.alive or self.client is not client:
                return  # found dead already, or replaced since
            self.alive, self.cause = False, (process.exit_words() if process is not None else None) or why
            self.tail = process.stderr_tail(10) if process is not None else ""
            owner.counts["deaths"] += 1
            if not any(b.alive for b in owner.members):
                owner.none_since = time.monotonic()
            owner.changed.notify_all()
        client.close()  # ends its streams under way
        log.warning("bridge %d at %s%s %s; %s", self.index, self.address, f" (pid {self.pid})" if self.pid else "",
                    self.cause, "restarting it" if process is not None else "waiting for it to answer again")

    def revive(self) -> None:
        """A started bridge restarted, a running one probed; either given the newest snapshot, then work."""
        address, pid = self.address, None
        if self._started is not None:
            process = self._started.restart(self.index)
            if process is None:  # the bridges are stopping
                return
            self.process, address, pid = process, process.address, process.pid
        client = self.owner.connect(address)
        try:
            client.health(timeout_s=self.owner.cfg.health_timeout_s)
            self._catch_up(client, address, pid)
        except BridgeError as e:
            client.close()
            if pid:
                log.warning("bridge %d (pid %d) restarted but failed: %s", self.index, pid, e)

    def _catch_up(self, client: BridgeClient, address: str, pid: int | None) -> None:
        """Loads the newest snapshot into the bridge at `client`, again while a newer one came
        meanwhile, then puts the bridge back to work (unless the bridges closed meanwhile)."""
        owner, loaded = self.owner, None
        while True:
            with owner.changed:
                if owner.closing.is_set():
                    client.close()
                    return
                if owner.snapshot == loaded:
                    self.client, self.address, self.pid = client, address, pid
                    self.alive, owner.none_since = True, None
                    owner.counts["restarts" if pid else "returned"] += 1
                    owner.changed.notify_all()
                    break
                loaded = owner.snapshot
            client.load_snapshot(*loaded, timeout_s=owner.cfg.start_timeout_s)
        log.warning("bridge %d %s at %s%s, serving snapshot version %s", self.index,
                    "restarted" if pid else "answers again", address, f" (pid {pid})" if pid else "",
                    loaded[1] if loaded else "(none yet: the model)")

    def give_up(self) -> None:
        self.process.stop(grace_s=0.0, term_s=1.0)  # it may be hung rather than gone
        with self.owner.changed:
            self.down = not self.owner.closing.is_set()
            self.owner.changed.notify_all()
        if self.down:
            log.error("bridge %d kept dying: left down (bridge.max_restarts=%d within 10 minutes)", self.index,
                      self.owner.cfg.max_restarts)
