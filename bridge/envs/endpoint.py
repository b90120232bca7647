"""One OpenEnv server and the sessions this process holds on it: a bounded pool (released sessions
kept open for the next episode's reset), capacity back-off and a circuit breaker, so that many
episodes share a server of few slots without errors, and a dead server costs one quick failure
per episode instead of a hang.

openenv-core 0.3.0's server creates the session's environment right after the WebSocket
handshake. At capacity it sends an unsolicited `CAPACITY_REACHED` error frame and closes; when
it has a slot it sends nothing. So `Endpoint.open` sends a `state` message (read-only, answered
even before any reset) and only hands the session out once a non-capacity reply came back; a
capacity answer is a back-off and a retry, never an error and never a breaker failure.

Per endpoint, `breaker_failures` failures in a row (connect errors, unconfirmed or lost
sessions; not capacity, not error replies) open a circuit breaker: nothing is attempted until a
cooldown has passed, then one trial session decides whether it closes again. `open()` waits for
that trial rather than being refused: its callers (episodes, replayed when lost) would only
retry, and a refusal would burn their retries on a breaker that is about to decide; when the
trial fails they all get EndpointUnavailable at once.

    endpoint = Endpoint(server.url, SessionConfig(max_sessions=64))
    async with endpoint.session() as env:
        first = await env.reset(seed=3)
        reply = await env.step({"message": "hi"})  # {"observation", "reward", "done"}
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from bridge.envs.session import (EndpointUnavailable, EnvServerError, Session, SessionConfig, backoff_s,
                                 why_failed)
from bridge.wire import is_loopback

log = logging.getLogger(__name__)

CAPACITY_REACHED = "CAPACITY_REACHED"
# Error codes the server sends right before closing the socket: the session never started.
SESSION_FATAL = frozenset({"FACTORY_ERROR", "SESSION_ERROR"})
# Waiting for the peer's close frame after ours (a failed keepalive included): a live server
# answers in milliseconds, and until it does or this passes, calls on a dead session block.
CLOSE_TIMEOUT_S = 1.0
# pool_waits / pool_wait_s: opens that found the pool full / seconds spent opening (pool and
# server capacity); server_max_sessions: the capacity the server states when it refuses (0: unknown).
METRICS = ("sessions_opened", "sessions_reused", "sessions_active", "capacity_waits", "connect_failures",
           "sessions_lost", "timeouts", "server_errors", "breaker_opens", "pool_waits", "pool_wait_s",
           "server_max_sessions")
# A session pool this many times the capacity its server states only queues there: warn once.
CAPACITY_WARN_RATIO = 2
# The pool of an Endpoint whose SessionConfig leaves max_sessions to the environment's config.
DEFAULT_POOL = 64


class Endpoint:
    """One OpenEnv server: a pool of at most `config.max_sessions` sessions (DEFAULT_POOL if unset) and its
    breaker.

    Use it from one event loop (its pool is an asyncio.Semaphore). The pool wait itself is not
    bounded: it is this process's own queue; `capacity_wait_s` bounds the wait for the server.
    """

    def __init__(self, url: str, config: SessionConfig = SessionConfig(), name: str = ""):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"environment server url must be http(s)://host:port, got {url!r}")
        self.url = url.rstrip("/")
        self.ws_url = "ws" + self.url[len("http"):] + "/ws"
        self.name = name or parts.netloc
        self.config = config
        self.metrics: dict[str, float] = dict.fromkeys(METRICS, 0)
        # A local server is reached directly, whatever proxy the environment names.
        self._direct = is_loopback(parts.hostname)
        # The pool: slots not in use, released sessions kept open for reuse (each holds its slot),
        # and the open() calls waiting for either (handed a session, or None: a slot).
        self.pool = DEFAULT_POOL if config.max_sessions is None else config.max_sessions
        self._free_slots = self.pool
        self._idle: collections.deque[Session] = collections.deque()
        self._pool_waiters: collections.deque[asyncio.Future[Session | None]] = collections.deque()
        self._sessions: set[Session] = set()
        self._capacity_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._failures: collections.deque[float] = collections.deque()
        self._opened_at: float | None = None   # the breaker is open (or half-open) since then
        self._trial = False                    # a half-open trial session is being opened
        self._trial_over = asyncio.Event()     # set when that trial has decided (or given up)
        self._schema: dict[str, Any] | None = None
        self._closed = False
        self._capacity_warned = False

    def __str__(self) -> str:
        return f"environment server {self.name!r} ({self.url})"

    # -- sessions -------------------------------------------------------------------------------

    async def open(self) -> Session:
        """A session the server has accepted. Waits for a pool slot, then for a server slot
        (backing off on CAPACITY_REACHED); EndpointUnavailable if it cannot get one."""
        if self._closed:
            raise EndpointUnavailable(f"{self} is closed (Endpoint.aclose was called)")
        start = time.monotonic()
        pool_waited = not self._idle and not self._free_slots
        reused, refusals = await self._acquire(), 0
        if reused is None:
            try:
                ws, refusals = await self._connect_accepted()
            except BaseException:
                self._hand_over(None)
                raise
            if isinstance(ws, Session):
                reused = ws
            else:
                session = Session(self, ws, pool_waited, time.monotonic() - start, refusals)
                self._sessions.add(session)
                self.metrics["sessions_opened"] += 1
                self.metrics["sessions_active"] += 1
        if reused is not None:
            session = reused
            session.pool_waited, session.wait_s = pool_waited, time.monotonic() - start
            session.capacity_refusals = refusals
            self.metrics["sessions_reused"] += 1
        self.metrics["pool_waits"] += pool_waited
        self.metrics["pool_wait_s"] += session.wait_s
        return session

    async def _acquire(self) -> Session | None:
        """A released session (to reuse), or None: a pool slot of our own. Waits when neither is free."""
        session = self._take_idle()
        if session is not None:
            return session
        if self._free_slots:
            self._free_slots -= 1
            return None
        handed = asyncio.get_running_loop().create_future()
        self._pool_waiters.append(handed)
        try:
            return await handed
        except BaseException:
            if handed.done() and not handed.cancelled():  # handed over as we were cancelled: pass it on
                self._hand_over(handed.result())
            else:
                self._pool_waiters.remove(handed)
            raise

    def _take_idle(self) -> Session | None:
        """A released session still connected, if the pool holds one (dead ones give their slot back)."""
        while self._idle:
            session = self._idle.popleft()
            session.idle = False
            self.metrics["sessions_active"] += 1
            if session.connected:
                return session
            session.drop()  # released, then closed by the server or a missed ping
        return None

    def _hand_over(self, session: Session | None) -> None:
        """A released session, or a freed slot (None), to the first open() waiting, else to the pool."""
        while self._pool_waiters:
            waiter = self._pool_waiters.popleft()
            if not waiter.done():
                waiter.set_result(session)
                return
        if session is None:
            self._free_slots += 1
        else:
            session.idle = True
            self._idle.append(session)
            self.metrics["sessions_active"] -= 1

    def keep(self, session: Session) -> bool:
        """Takes a released, still connected session back for another episode's reset (first to an
        open() waiting for the pool, else to one waiting for the server's capacity); False (the caller
        closes it) when sessions are not reused or the endpoint is closing."""
        if not self.config.reuse or self._closed:
            return False
        self._hand_over(session)
        if self._idle and self._capacity_waiters:
            self._capacity_waiters.popleft().set_result(None)
        return True

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Session]:
        """`async with endpoint.session() as s:` open() ... close()."""
        s = await self.open()
        try:
            yield s
        finally:
            await s.close()

    async def _connect_accepted(self) -> tuple[ClientConnection | Session, int]:
        """A connection the server accepted, or a session released meanwhile into the pool while the
        server was at capacity; and how many times the server refused first."""
        cfg = self.config
        deadline = time.monotonic() + cfg.capacity_wait_s
        trial = await self._enter_breaker()
        try:
            for waits in itertools.count():
                ws = await self._connect(trial)
                reply = await self._confirm(ws, trial)
                code = reply["data"].get("code") if reply["type"] == "error" else None
                if code in SESSION_FATAL:
                    ws.transport.abort()
                    self.metrics["server_errors"] += 1
                    self.breaker_failure(trial)
                    raise EnvServerError(f"{self} open", code, str(reply["data"].get("message")),
                                         reply["data"])
                self._breaker_success()
                if code != CAPACITY_REACHED:
                    return ws, waits
                await ws.close()  # the server closes a refused socket itself
                self.metrics["capacity_waits"] += 1
                self._note_capacity(reply["data"].get("max_sessions"))
                if not self._idle:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise EndpointUnavailable(
                            f"{self} stayed at capacity ({reply['data'].get('max_sessions', '?')} "
                            f"sessions) for {cfg.capacity_wait_s:g} s; other clients hold its slots: "
                            "raise the server's max_concurrent_envs or lower SessionConfig.max_sessions")
                    await self._wait_for_free_slot(
                        min(backoff_s(waits, cfg.capacity_backoff_s, cfg.capacity_backoff_max_s), left))
                # A session released into the pool (also while we connected) holds a slot the server
                # refuses us: take it rather than ask the full server again.
                idle = self._take_idle()
                if idle is not None:
                    self._hand_over(None)  # our pool slot; the idle session brings its own
                    return idle, waits + 1
        finally:
            if trial:
                self._trial = False
                self._trial_over.set()

    async def _connect(self, trial: bool) -> ClientConnection:
        cfg = self.config
        try:
            return await connect(
                self.ws_url, proxy=None if self._direct else True,
                open_timeout=cfg.connect_timeout_s, ping_interval=cfg.ping_interval_s,
                ping_timeout=cfg.ping_timeout_s, close_timeout=CLOSE_TIMEOUT_S,
                max_size=cfg.max_message_bytes, compression="deflate" if cfg.compress else None)
        except (OSError, TimeoutError, WebSocketException) as e:
            self.metrics["connect_failures"] += 1
            self.metrics["timeouts"] += isinstance(e, TimeoutError)
            self.breaker_failure(trial)
            raise EndpointUnavailable(
                f"cannot connect to {self} at {self.ws_url}: {why_failed(e, cfg.connect_timeout_s)}; "
                "check that the server is running and the url is right") from None

    async def _confirm(self, ws: ClientConnection, trial: bool) -> dict[str, Any]:
        """The server's first frame: capacity or fatal errors arrive unasked, else state's reply."""
        try:
            async with asyncio.timeout(self.config.step_timeout_s):
                try:
                    await ws.send('{"type":"state"}')
                except ConnectionClosed:
                    pass  # a refusal closes at once; its frame still waits to be read
                reply = json.loads(await ws.recv())
            if not isinstance(reply.get("data"), dict) or "type" not in reply:
                raise ValueError(f"not an OpenEnv reply: {reply!r:.200}")
            return reply
        except BaseException as e:
            ws.transport.abort()
            if not isinstance(e, (TimeoutError, ConnectionClosed, ValueError, AttributeError)):
                raise  # cancelled
            self.metrics["timeouts"] += isinstance(e, TimeoutError)
            self.breaker_failure(trial)
            raise EndpointUnavailable(
                f"{self} accepted a connection but did not confirm the session "
                f"({why_failed(e, self.config.step_timeout_s)}); check that the server is healthy") from None

    def _note_capacity(self, max_sessions: Any) -> None:
        """Keeps the capacity a refusal states; warns once when our pool is far above it."""
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            return
        self.metrics["server_max_sessions"] = max_sessions
        pool = self.pool
        if not self._capacity_warned and pool >= CAPACITY_WARN_RATIO * max_sessions:
            self._capacity_warned = True
            log.warning("%s allows %d session(s) at once, but the session pool for it holds %d: episodes queue for "
                        "its slots (see env/%s/pool_wait_s and capacity_refusals); set max_concurrent_envs: %d for "
                        "this environment, or serve it with more sessions (create_app(..., max_concurrent_envs=N) "
                        "and SUPPORTS_CONCURRENT_SESSIONS = True)", self, max_sessions, pool, self.name, max_sessions)

    async def _wait_for_free_slot(self, delay: float) -> None:
        """Sleeps `delay`, or less when one of our own sessions frees a server slot first."""
        freed = asyncio.get_running_loop().create_future()
        self._capacity_waiters.append(freed)
        try:
            await asyncio.wait([freed], timeout=delay)
        finally:
            with contextlib.suppress(ValueError):
                self._capacity_waiters.remove(freed)

    def release_slot(self, session: Session) -> None:
        """`session` ended: its pool slot goes to the next open(), and a server slot is free."""
        if session in self._sessions:
            self._sessions.discard(session)
            if session.idle:
                self._idle.remove(session)
            else:
                self.metrics["sessions_active"] -= 1
            self._hand_over(None)
            # One waiter retries now (all of them would mostly meet CAPACITY_REACHED again).
            if self._capacity_waiters:
                self._capacity_waiters.popleft().set_result(None)

    # -- circuit breaker ------------------------------------------------------------------------

    @property
    def breaker_state(self) -> str:
        """"closed" (sessions open normally), "open" (refused) or "half_open" (one trial)."""
        if self._opened_at is None:
            return "closed"
        if time.monotonic() - self._opened_at < self.config.breaker_cooldown_s:
            return "open"
        return "half_open"

    async def _enter_breaker(self) -> bool:
        """Waits while the breaker is open, and while another call's trial session decides; True
        when this call is the half-open trial. EndpointUnavailable when the trial waited for failed."""
        while True:
            state = self.breaker_state
            if state == "closed":
                return False
            if state == "open":
                await asyncio.sleep(self._opened_at + self.config.breaker_cooldown_s - time.monotonic())
            elif not self._trial:
                self._trial = True
                self._trial_over = asyncio.Event()
                return True
            else:
                opened_at, over = self._opened_at, self._trial_over
                await over.wait()
                if self._opened_at is not None and self._opened_at != opened_at:
                    raise EndpointUnavailable(
                        f"{self}: circuit breaker open (it failed {self.config.breaker_failures} times in a "
                        f"row and the trial session failed too; the next trial in "
                        f"{self.config.breaker_cooldown_s:g} s); retry later")

    def breaker_failure(self, trial: bool = False) -> None:
        now = time.monotonic()
        if self._opened_at is not None:
            if trial:
                self._opened_at = now  # the trial failed: open again for a full cooldown
                self._trial_over.set()
            return
        self._failures.append(now)
        while self._failures[0] < now - self.config.breaker_window_s:
            self._failures.popleft()
        if len(self._failures) >= self.config.breaker_failures:
            self._opened_at = now
            self._failures.clear()
            self.metrics["breaker_opens"] += 1

    def answered(self) -> None:
        """A session got its reply: a run of failures is broken (an open breaker stays open)."""
        self._failures.clear()

    def _breaker_success(self) -> None:
        """The server accepted or refused a new session: it is alive, the breaker closes."""
        self._failures.clear()
        self._opened_at = None
        self._trial_over.set()  # callers waiting for a trial go ahead

    # -- HTTP -----------------------------------------------------------------------------------

    async def schema(self) -> dict[str, Any]:
        """GET /schema: {"action", "observation", "state"} JSON schemas (fetched once)."""
        if self._schema is None:
            self._schema = await self._get_json("/schema")
        return self._schema

    async def check(self) -> None:
        """Fails fast (EndpointUnavailable) unless /health and /schema answer."""
        health = await self._get_json("/health")
        if health.get("status") != "healthy":
            raise EndpointUnavailable(f"{self} answers /health with {health!r}, not healthy")
        await self.schema()

    async def _get_json(self, path: str) -> dict[str, Any]:
        try:
            async with httpx.AsyncClient(trust_env=not self._direct,
                                         timeout=self.config.connect_timeout_s) as client:
                response = await client.get(self.url + path)
                response.raise_for_status()
                body = response.json()
            if not isinstance(body, dict):
                raise ValueError(f"expected a JSON object, got {type(body).__name__}")
            return body
        except (httpx.HTTPError, ValueError) as e:
            raise EndpointUnavailable(f"{self}: GET {path} failed: {type(e).__name__}: {e}; "
                                      "check that an OpenEnv server runs at this url") from None

    async def aclose(self) -> None:
        """Closes every open session; open() refuses afterwards."""
        self._closed = True
        await asyncio.gather(*(s.close() for s in list(self._sessions)))
