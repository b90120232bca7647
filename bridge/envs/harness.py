"""The `harness` environment kind: episodes played by an agent harness that an OpenEnv server runs
and serves on its `WS /harness` route (OpenEnv RFC 005, production mode), the harness calling our
model through the bridge's chat completions endpoint (bridge.envs.chat_endpoint) with the
environment's key (`harness_api_key_file`) as its API key.

One episode: connect to `/harness` (the server starts a fresh harness session and answers
`session_started`), send the task as one user message (`harness_message`, a format string over the
task's fields), and read the turn's events up to `turn_complete`. Meanwhile the harness calls the
endpoint, which generates with the engine and records each call. The trajectory is assembled from
those calls, token-in/token-out: the first call's prompt is the episode's prompt, each model reply is
trained as sampled (ids and logprobs from the engine, never re-tokenised), and what the harness
added between two calls (tool results, its own feedback on a reply it could not use) is context,
loss mask 0. A harness that does not continue its conversation (it edits or drops history) makes
an episode that cannot be one token sequence: the episode ends as an error saying so.

The reward is the environment's, read from the turn's events as OpenEnv's own rollout reads it
(`openenv.core.harness.rollout._tool_result_reward`): the last tool result carrying a `reward`,
else `reward` in the `turn_complete` event's data; named `env`. A recoverable `error` event (the
harness could not use a reply and told the model) is part of the episode, counted in
`action_errors` as a reply the environment could not take is in any other kind; a terminal one (the harness died, the turn timed out) ends the episode as an error.

The server runs one harness session at a time (OpenEnv's HarnessEnvironment is not concurrent), and
a harness cannot tell the endpoint which episode it is in: the episodes of one harness environment
run one after another.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import websockets

from bridge.envs.chat_endpoint import ChatEndpoint
from bridge.envs.endpoint import CAPACITY_REACHED
from bridge.envs.rollout_fn import Episode, GenerationHandle, Turn
from bridge.envs.session import backoff_s
from bridge.envs.spec import EnvConfigError, EnvSpec
from bridge.tool_calls import ToolCallParser
from bridge.wire import token_file

log = logging.getLogger(__name__)

REWARD = "env"


class HarnessError(RuntimeError):
    """The harness route failed the episode (a terminal error event, a refused session, a conversation
    that cannot be one token sequence)."""


class HarnessConnector:
    """A `harness` environment: its chat endpoint, and the episode function the bridge runs with a
    generation handle, as it runs a rollout function's."""

    mode = "harness"

    def __init__(self, spec: EnvSpec, parser: ToolCallParser):
        self.spec = spec
        self.parser = parser
        self.label = f"harness {spec.harness}"
        self.endpoint: ChatEndpoint | None = None  # built by start: its key is read (or written) there
        self.metrics: dict[str, float] = {}
        self._one_at_a_time = asyncio.Lock()

    async def start(self) -> None:
        spec = self.spec
        self.endpoint = ChatEndpoint(spec.harness_port, spec.name, self.parser, api_key(spec), spec.harness_host,
                                     None if spec.harness_tls_cert is None else
                                     (spec.harness_tls_cert, spec.harness_tls_key))
        await self.endpoint.start()

    async def aclose(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.aclose()

    async def fn(self, task: dict[str, Any], handle: GenerationHandle) -> Episode:
        async with self._one_at_a_time:
            with self.endpoint.attach(handle) as calls:
                try:
                    events = await self.play(self.message(task))
                except HarnessError as e:
                    if self.endpoint.refusals:  # the likely cause, which the server does not pass on
                        raise HarnessError(f"{e}; the chat endpoint had refused its call: "
                                           f"{self.endpoint.refusals[-1]}") from None
                    raise
            return episode_from(calls, events, self.spec.name)

    def message(self, task: dict[str, Any]) -> str:
        """The user message that starts the episode of `task`."""
        try:
            return self.spec.harness_message.format_map(task)
        except (KeyError, IndexError, AttributeError) as e:
            raise HarnessError(f"environment {self.spec.name!r}: harness_message {self.spec.harness_message!r} "
                               f"names {e}, which the task lacks (its fields: {', '.join(task) or 'none'}); "
                               "fix harness_message or the data file's columns") from None

    async def play(self, message: str) -> list[dict[str, Any]]:
        """The events of one harness turn on a fresh session, through `turn_complete`. The server frees
        the previous episode's session only after its socket has closed: a refusal at capacity is
        waited out (session.capacity_* back-off) rather than fail the episode."""
        url = "ws" + self.spec.harness[len("http"):] + "/harness"
        session = self.spec.session
        deadline, attempt = time.monotonic() + session.capacity_wait_s, 0
        while True:
            async with websockets.connect(url, open_timeout=session.connect_timeout_s, max_size=None,
                                          ping_interval=session.ping_interval_s,
                                          ping_timeout=session.ping_timeout_s) as ws:
                started = json.loads(await ws.recv())
                if started.get("type") == "session_started":
                    return await self._turn(ws, url, message)
            at_capacity = (started.get("data") or {}).get("code") == CAPACITY_REACHED
            if not at_capacity or time.monotonic() >= deadline:
                raise HarnessError(f"{url} refused the session: {_said(started)}")
            await asyncio.sleep(backoff_s(attempt, session.capacity_backoff_s, session.capacity_backoff_max_s))
            attempt += 1

    @staticmethod
    async def _turn(ws, url: str, message: str) -> list[dict[str, Any]]:
        await ws.send(json.dumps({"type": "message", "content": message}))
        events = []
        async for frame in ws:
            event = json.loads(frame)
            events.append(event)
            if event.get("type") == "turn_complete":
                return events
            if event.get("type") == "protocol_error" or (
                    event.get("type") == "error" and not event.get("data", {}).get("recoverable")):
                raise HarnessError(f"the harness at {url} failed the turn: {_said(event)}")
        raise HarnessError(f"{url} closed the session before turn_complete")


def api_key(spec: EnvSpec) -> str:
    """The key every call to `spec`'s endpoint must carry: harness_api_key_file's (written with a fresh
    key when the file does not exist, as the bridge's --token-file is); EnvConfigError naming the key."""
    what = f"environment {spec.name!r}: harness_api_key_file"
    if spec.harness_api_key_file is None:
        raise EnvConfigError(f"{what} is not set: the endpoint its harness calls needs a key; name a file (a new key "
                             "is written there if it does not exist), or let `jaxrl train` start this bridge (it "
                             "gives each run a key of its own)")
    path = Path(spec.harness_api_key_file).expanduser()
    try:
        key, written = token_file(path, what)
    except ValueError as e:
        raise EnvConfigError(str(e)) from None
    if written:
        log.warning("%s: wrote a new key to %s; give it to the harness as its API key (e.g. OPENAI_API_KEY)",
                    what, path)
    return key


def episode_from(calls: list, events: list[dict[str, Any]], env: str) -> Episode:
    """The episode the harness played: its calls as turns, the environment's reward, its counts."""
    if not calls:
        raise HarnessError(f"environment {env!r}: the harness finished without calling the model; check the "
                           "server's harness calls http://<harness_host>:<harness_port>/v1 (https with TLS) with "
                           "the key of harness_api_key_file as its API key (the bridge's log names refused calls)")
    broken = next((k for k, c in enumerate(calls) if not c.continues), None)
    if broken is not None:
        raise HarnessError(f"environment {env!r}: model call {broken + 1} does not continue the conversation of "
                           "the call before it (the harness changed its history), so the episode is not one "
                           "token sequence; use a harness that appends to its conversation")
    first = calls[0].generation
    turns = [Turn.model(first)]
    context = len(first.prompt_ids) + len(first.ids)
    for call in calls[1:]:
        g = call.generation
        turns += [Turn.context(g.prompt_ids[context:]), Turn.model(g)]
        context = len(g.prompt_ids) + len(g.ids)
    errors = sum(e.get("type") == "error" for e in events)
    return Episode(first.prompt_ids, turns, {REWARD: env_reward(events)}, {"action_errors": float(errors)})


def env_reward(events: list[dict[str, Any]]) -> float | None:
    """The environment's reward in a turn's events (None: the environment gave none)."""
    for event in reversed(events):
        data = event.get("data") or {}
        if event.get("type") == "tool_result" and isinstance(data.get("result"), dict):
            if data["result"].get("reward") is not None:
                return _number(data["result"]["reward"])
    done = events[-1].get("data") or {}
    return None if done.get("reward") is None else _number(done["reward"])


def _number(value: Any) -> float:
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise HarnessError(f"the harness reported reward {value!r}, not a number") from None
    if not math.isfinite(reward):
        raise HarnessError(f"the harness reported reward {value!r}, not a finite number")
    return reward


def _said(frame: dict[str, Any]) -> str:
    data = frame.get("data") or {}
    return str(data.get("message") or frame)[:300]
