"""One OpenEnv session over the WebSocket `/ws` transport: one environment instance on the server
(one WebSocket connection), its limits (`SessionConfig`), and the errors that tell a caller whether
to replay the episode. Where sessions come from (a bounded pool, capacity back-off, the circuit
breaker) is `endpoint`'s.

The protocol is request / reply: `{"type": "reset" | "step" | "state", "data": ...}` answered by
`{"type": "observation" | "state", "data": ...}` or `{"type": "error", "data": {"message",
"code", ...}}`; `{"type": "close"}` ends the session.

What openenv-core 0.3.0's server does, and how this module meets it:

- After a `close` message it destroys the environment and only then closes the socket. A
  client-initiated close frame is echoed at once, before the slot is free; so `Session.close`
  waits for the server's own close, which makes our pool and the server's count agree.
- Replies carry no ids: a reply that timed out would be read as the answer to the next call.
  A timed-out, dropped or cancelled call therefore ends the session (`SessionLost`); the
  episode restarts from `reset()` on a new session, never on a silently re-created one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
from typing import TYPE_CHECKING, Any

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

if TYPE_CHECKING:
    from bridge.envs.endpoint import Endpoint


def _field(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class SessionConfig:
    """Per-endpoint limits; every field is checked on construction."""

    max_sessions: int | None = _field(None, "pool bound per endpoint; null: the environment's max_concurrent_envs "
                                            "(an Endpoint made on its own: 64)")
    connect_timeout_s: float = _field(10.0, "seconds to open a session (WebSocket handshake)")
    step_timeout_s: float = _field(60.0, "seconds for each reset / step / state reply")
    ping_interval_s: float | None = _field(10.0, "seconds between WebSocket pings (null: none); they keep a "
                                                 "session alive through long generations")
    ping_timeout_s: float = _field(20.0, "a ping unanswered this long: the server is frozen, the session lost")
    capacity_backoff_s: float = _field(0.05, "first wait after the server refuses a session at capacity; it "
                                             "doubles (with jitter) up to capacity_backoff_max_s")
    capacity_backoff_max_s: float = _field(2.0, "longest wait between capacity refusals")
    capacity_wait_s: float = _field(600.0, "then the endpoint is unavailable: no server slot came free")
    breaker_failures: int = _field(5, "failures in a row within breaker_window_s that open the circuit breaker")
    breaker_window_s: float = _field(30.0, "the circuit breaker's window")
    breaker_cooldown_s: float = _field(5.0, "seconds the open breaker waits before one trial session (success "
                                            "closes it, failure re-opens it)")
    max_message_bytes: int = _field(16 * 2**20, "largest WebSocket message accepted")
    compress: bool = _field(False, "permessage-deflate on the session's WebSocket: worth its CPU only for large "
                                   "observations over a slow network; off, neither side compresses")
    # As TRL reuses its environment_factory instances: no connect, handshake and server-side teardown
    # per episode.
    reuse: bool = _field(True, "an episode that ends leaves its session open for the next episode's reset "
                               "(one WebSocket, reset again per episode); false: a fresh session per episode, "
                               "for servers whose reset does not start afresh")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("ping_interval_s", "max_sessions") and value is None:
                continue
            if f.type == "bool":
                if not isinstance(value, bool):
                    _bad(f.name, value, "true or false")
                continue
            if f.type in ("int", "int | None"):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    _bad(f.name, value, "an integer >= 1")
            elif (isinstance(value, bool) or not isinstance(value, (int, float))
                  or not math.isfinite(value) or value <= 0):
                _bad(f.name, value, "a finite number of seconds > 0"
                     + (", or None for no pings" if f.name == "ping_interval_s" else ""))
        if self.capacity_backoff_max_s < self.capacity_backoff_s:
            _bad("capacity_backoff_max_s", self.capacity_backoff_max_s,
                 f"at least capacity_backoff_s ({self.capacity_backoff_s})")


def backoff_s(attempt: int, first_s: float, max_s: float) -> float:
    """The wait before retry `attempt` (0 for the first): `first_s` doubling up to `max_s`, with
    jitter (half to all of it), so that many callers failing together do not retry together."""
    return min(first_s * 2.0 ** min(attempt, 64), max_s) * random.uniform(0.5, 1.0)


def _bad(name: str, value: Any, allowed: str):
    raise ValueError(f"SessionConfig.{name} must be {allowed}, got {value!r}")


class EnvError(Exception):
    """Base of the errors this module raises."""


class EnvServerError(EnvError):
    """The server answered an error frame (not capacity); `.code`, `.message`, `.details`."""

    def __init__(self, where: str, code: str, message: str, details: dict[str, Any]):
        self.code, self.message, self.details = code, message, details
        text = f"{where} answered {code}: {message}"
        errors = details.get("errors")
        if isinstance(errors, list):  # pydantic's list: the useful part of a VALIDATION_ERROR
            text += " (" + "; ".join(_pydantic_error(e) for e in errors) + ")"
        super().__init__(text)


def _is_reward(value: Any) -> bool:
    """None (no reward) or a finite number, booleans included as OpenEnv's Observation allows them."""
    return value is None or (isinstance(value, (int, float)) and math.isfinite(value))


def _pydantic_error(error: Any) -> str:
    if not isinstance(error, dict):
        return str(error)
    loc = ".".join(map(str, error.get("loc", ()))) or "action"
    return f"{loc}: {error.get('msg', error)}"


class SessionLost(EnvError):
    """The connection dropped, closed or a reply timed out: restart the episode from reset()
    on a new session."""


class EndpointUnavailable(EnvError):
    """No session could be opened: cannot connect, breaker open, or no slot in time."""


class Session:
    """One environment instance on the server; one call at a time. Get one from Endpoint.open."""

    def __init__(self, endpoint: Endpoint, ws: ClientConnection, pool_waited: bool = False, wait_s: float = 0.0,
                 capacity_refusals: int = 0):
        self._endpoint = endpoint
        self._ws = ws
        self._busy = False
        self.closed = False
        self.idle = False  # released and kept open in its endpoint's pool
        # How getting this session went: the pool was full, seconds until accepted, server refusals.
        self.pool_waited, self.wait_s, self.capacity_refusals = pool_waited, wait_s, capacity_refusals

    @property
    def connected(self) -> bool:
        """The connection is open (a missed keepalive or the server may have closed it meanwhile)."""
        return self._ws.state is State.OPEN

    async def reset(self, **kwargs: Any) -> dict[str, Any]:
        """Starts an episode; kwargs (seed, split, task fields) go to the environment's reset."""
        return await self._call("reset", {"type": "reset", "data": kwargs}, "observation")

    async def step(self, action: dict[str, Any]) -> dict[str, Any]:
        """Plays one action: {"observation": ..., "reward": ..., "done": ...}."""
        return await self._call("step", {"type": "step", "data": action}, "observation")

    async def state(self) -> dict[str, Any]:
        """The environment's state (episode id, step count, environment-specific fields)."""
        return await self._call("state", {"type": "state"}, "state")

    async def release(self) -> None:
        """Done with this session: kept open for another episode's reset when its endpoint reuses
        sessions (and nothing went wrong on it), else closed; never raises."""
        if not self.closed and self.connected and self._endpoint.keep(self):
            return
        await self.close()

    async def close(self) -> None:
        """Ends the session on the server and frees its slot; idempotent, never raises."""
        if self.closed:
            return
        self.closed = True
        try:
            # The server closes the socket once the environment is destroyed (see module doc).
            async with asyncio.timeout(self._endpoint.config.step_timeout_s):
                await self._ws.send('{"type":"close"}')
                await self._ws.wait_closed()
        except (TimeoutError, ConnectionClosed, OSError):
            pass
        finally:
            self.drop()

    async def _call(self, what: str, message: dict[str, Any], expect: str) -> dict[str, Any]:
        if self.closed:
            raise SessionLost(f"{self._endpoint}: {what} on a closed session; open a new one "
                              "and restart the episode from reset()")
        if not self.connected:  # e.g. a keepalive ping went unanswered meanwhile
            protocol = self._ws.protocol
            raise self._lost(f"the connection closed before {what} "
                             f"({_frame_why(protocol.close_rcvd, protocol.close_sent)})")
        if self._busy:
            raise RuntimeError(f"{self._endpoint}: {what} while another call on this session "
                               "waits for its reply; await each call before the next")
        text = json.dumps(message)  # an unserializable action is the caller's error, raised as is
        self._busy = True
        try:
            async with asyncio.timeout(self._endpoint.config.step_timeout_s):
                await self._ws.send(text)
                raw = await self._ws.recv()
            reply = json.loads(raw)
            kind, data = reply["type"], reply["data"]
            if not isinstance(data, dict):
                raise TypeError(f"data is a {type(data).__name__}, not an object")
        except TimeoutError:
            self._endpoint.metrics["timeouts"] += 1
            limit = self._endpoint.config.step_timeout_s
            raise self._lost(f"no reply to {what} within {limit:g} s (server frozen or overloaded)"
                             ) from None
        except ConnectionClosed as e:
            raise self._lost(f"the connection closed during {what} ({_closed_why(e)})") from None
        except (ValueError, KeyError, TypeError) as e:
            raise self._lost(f"unreadable reply to {what}: {e}") from None
        except BaseException:
            # Cancelled (or worse) mid-call: a late reply would answer the next call.
            self.drop()
            raise
        finally:
            self._busy = False
        if kind == "error":
            self._endpoint.metrics["server_errors"] += 1
            raise EnvServerError(f"{self._endpoint} {what}", str(data.get("code", "UNKNOWN")),
                                 str(data.get("message", "")), data)
        if kind != expect:
            raise self._lost(f"expected a {expect!r} reply to {what}, got {kind!r}")
        # A server's reply is untrusted input: a reward that is no number is a bad reply, the episode replayed
        # (a reward function of the user's raising on one is a bug, and stops the run).
        if kind == "observation" and not _is_reward(data.get("reward")):
            raise self._lost(f"unreadable reply to {what}: its reward {data['reward']!r} is not a finite number")
        self._endpoint.answered()
        return data

    def _lost(self, why: str) -> SessionLost:
        """Ends the session as lost (a breaker failure) and says so."""
        self._endpoint.metrics["sessions_lost"] += 1
        self._endpoint.breaker_failure()
        self.drop()
        return SessionLost(f"{self._endpoint}: {why}; the episode is lost: restart it from "
                           "reset() on a new session")

    def drop(self) -> None:
        """Drops the connection (if still open) and gives the pool slot back, exactly once."""
        self.closed = True
        self._ws.transport.abort()
        self._endpoint.release_slot(self)


def why_failed(e: BaseException, timeout_s: float) -> str:
    """Why a connect or a call failed, in words for an error message."""
    if isinstance(e, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(e, ConnectionClosed):
        return _closed_why(e)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _closed_why(e: ConnectionClosed) -> str:
    return _frame_why(e.rcvd, e.sent)


def _frame_why(rcvd, sent) -> str:
    frame = rcvd or sent
    if frame is None:
        return "dropped without a close frame"
    return f"close code {frame.code}{': ' + frame.reason if frame.reason else ''}"
