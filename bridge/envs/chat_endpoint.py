"""An OpenAI-compatible chat completions endpoint, backed by the bridge's engine, for agent harnesses
that call a model themselves (the `harness` environment kind).

    POST /v1/chat/completions   {messages, tools?, max_tokens?, temperature?, top_p?, stop?}
    GET  /v1/models

Every call carries the endpoint's key as `Authorization: Bearer KEY` (how OpenAI clients send their
`api_key`), as every call to the bridge carries its token: what it generates is trained on, so a
stranger's call must not reach an episode. A call without it, or with another key, is answered 401
before its body is read and leaves the episode as it was. The endpoint listens on 127.0.0.1 unless
told another host (a harness in a container or on another machine), then with TLS unless told
otherwise (`bridge.wire.exposed` is the rule; `EnvSpec` checks it).

The answer is vLLM's with `return_token_ids` and `logprobs`, which is what OpenEnv's capture proxy
(`openenv.core.harness.capture`) reads: the prompt's ids at the top level (`prompt_token_ids`), the
sampled ids on the choice (`token_ids`), and one `logprobs.content` entry per sampled token, its
`token` in the `token_id:N` form so the two channels can be checked against each other.

A request with `tools` gets the model's tool calls back as OpenAI `tool_calls` (read from its text by
the run's tool-call parser, `tool_parser`); a reply whose calls do not parse is returned as its text,
for the harness to answer as it answers any reply it cannot use.

Calls belong to the episode attached to the endpoint (a `GenerationHandle`): one at a time, since an
OpenEnv harness server runs one harness session at a time and the harness cannot say which episode
it is in. A call whose messages continue the episode's last call (its messages, then the model's
reply exactly as it was returned, then new user or tool messages) gets that call's tokens, the
model's reply as sampled and the new messages rendered after it: the model's tokens are never
re-tokenised from text. Any other call is rendered from its messages afresh (a harness that edits
its history starts a new conversation; the episode says so, see bridge.envs.harness).

Each reply is capped at the run's rollout.max_tokens and at what is left of the episode's
rollout.max_total_tokens (counted after the first call's prompt, as any episode's). Once nothing is
left, that call and every later one get a short assistant message saying the budget is spent (as OpenEnv's capture proxy
answers a session over its budget), which is no model output and is not recorded.
A request the endpoint cannot take (malformed, or a prompt longer than the engine holds) gets a 400
naming what is wrong, also kept in `refusals` for the episode's error; no episode attached, a 409.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import ssl
import time
import uuid
from collections.abc import Mapping
from typing import Any

import jinja2
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from bridge.engines.base import PromptTooLong
from bridge.envs.rollout_fn import Generation, GenerationHandle
from bridge.envs.serve import bind_socket
from bridge.tool_calls import ToolCallParser, hidden_special_ids
from bridge.wire import BEARER, is_loopback

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
BUDGET_SPENT = "[The token budget of this episode is spent; the episode ends here.]"


class BadRequest(ValueError):
    """A chat completions request the endpoint cannot take; the message says what to fix."""


@dataclasses.dataclass(frozen=True)
class Call:
    """One model call of an episode: the request's messages and tools, and what the engine did."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    generation: Generation
    reply: dict[str, Any]  # the assistant message returned
    continues: bool  # its prompt is the previous call's prompt + reply + new messages, token for token


def check_messages(body: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The request's messages and tools; BadRequest naming the first thing wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object with a messages list")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}] must be an object with a role among {', '.join(ROLES)}")
        if not isinstance(m.get("content", ""), (str, type(None))):
            raise BadRequest(f"messages[{i}].content must be a string (content parts are not supported)")
    if body.get("n", 1) != 1:
        raise BadRequest("n must be 1: each call is one turn of the episode")
    if body.get("stream"):
        raise BadRequest("stream must be false: this endpoint answers whole completions")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list of OpenAI tool definitions")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise BadRequest(f"{key} must be a whole number >= 1, got {value!r}")
    for key, ok in (("temperature", lambda x: x >= 0), ("top_p", lambda x: 0 < x <= 1)):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value)):
            raise BadRequest(f"{key} is {value!r}: temperature must be >= 0 and top_p in (0, 1]")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
        raise BadRequest("stop must be a string or a list of strings")
    return messages, tools


class ChatEndpoint:
    """The endpoint of one harness environment; `attach` an episode's handle while it runs. Calls must
    carry `key`; `tls` (certificate chain file, private key file) serves HTTPS."""

    def __init__(self, port: int, model_name: str, parser: ToolCallParser, key: str, host: str = "127.0.0.1",
                 tls: tuple[str, str] | None = None):
        if not key:
            raise ValueError("the chat endpoint needs a key its harness calls with")
        self.port = port
        self.host = host
        self.tls = tls
        self.model_name = model_name
        self.parser = parser
        self.handle: GenerationHandle | None = None
        self.calls: list[Call] = []
        self.refusals: list[str] = []  # the attached episode's 400s, newest last
        self.spent = False  # the attached episode's budget: every later call is told so
        self._server: uvicorn.Server | None = None
        self._task = None
        routes = Starlette(routes=[Route("/v1/chat/completions", self._complete, methods=["POST"]),
                                   Route("/v1/models", self._models, methods=["GET"])])
        self.app = KeyCheck(routes, key, f"{host}:{port}")

    @contextlib.contextmanager
    def attach(self, handle: GenerationHandle):
        """Calls made inside the block are the episode's (its `calls`, generated with `handle`)."""
        self.handle, self.calls, self.refusals, self.spent = handle, [], [], False
        try:
            yield self.calls
        finally:
            self.handle = None

    async def start(self) -> None:
        """Listens on host:port; connections made from now on are answered once the loop runs."""
        cert, key = self.tls or (None, None)
        # A harness holding a request open must not hold up the bridge's shutdown for ever.
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5,
                                ssl_certfile=cert, ssl_keyfile=key)
        if self.tls is not None:
            try:
                config.load()  # here, not in the server's task: a certificate that cannot serve fails the start
            except (OSError, ssl.SSLError) as e:  # SSLError: a file that is not PEM, a key of another certificate
                raise OSError(f"cannot serve TLS with harness_tls_cert {cert} and harness_tls_key {key} "
                              f"({e.strerror or e}); give a PEM certificate (chain) and its private key") from None
        try:
            sock = bind_socket(self.host, self.port)
        except OSError as e:
            raise OSError(f"cannot listen on {self.host}:{self.port} ({e.strerror or e}); set the environment's "
                          "harness_port to a free port (the one its harness is configured to call) and its "
                          "harness_host to an address of this machine") from None
        sock.listen(64)
        if self.tls is None and not is_loopback(self.host):
            log.warning("chat endpoint on %s:%d without TLS (harness_insecure): its key and the episodes travel in "
                        "clear text", self.host, self.port)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._task
            self._server = None

    async def _models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model"}]})

    async def _complete(self, request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body())
            messages, tools = check_messages(body)
        except json.JSONDecodeError as e:
            return self._refuse(f"the request body is not JSON ({e})")
        except BadRequest as e:
            return self._refuse(str(e))
        handle = self.handle
        if handle is None:
            return _error(409, "no episode is running on this endpoint; the bridge attaches one while its "
                               "harness session is open")
        try:
            ids, continues = self.prompt(handle, messages, tools)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as e:  # what the template raises
            return self._refuse(f"the model's chat template cannot render these messages ({type(e).__name__}: "
                                f"{e}); send OpenAI chat messages the model's template takes")
        self.spent = self.spent or self.room(handle, ids, continues) < 1
        if self.spent:
            return JSONResponse(self.budget_spent())
        room = self.room(handle, ids, continues)
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        stop = body.get("stop")
        try:
            g = await handle.generate(ids, max_tokens=min(room, asked or room),
                                      temperature=body.get("temperature"), top_p=body.get("top_p"),
                                      stop=[stop] if isinstance(stop, str) else stop)
        except PromptTooLong as e:
            return self._refuse(f"{e} (the bridge's rollout.max_prompt_tokens + rollout.max_total_tokens)")
        reply = self.reply(handle, g, bool(tools))
        if handle is self.handle:  # the episode may have ended (timed out) while this call generated
            self.calls.append(Call(messages, tools, g, reply, continues))
        return JSONResponse(self.response(g, reply))

    def reply(self, handle: GenerationHandle, g: Generation, tools: bool) -> dict[str, Any]:
        """The assistant message of `g`: its text, or with tools offered, its parsed tool calls."""
        if not tools:
            return {"role": "assistant", "content": g.text}
        hidden = hidden_special_ids(handle.tokenizer, self.parser.delimiters)
        parsed = self.parser.parse(handle.tokenizer.decode([t for t in g.ids if t not in hidden]))
        if parsed.errors or not parsed.calls:
            return {"role": "assistant", "content": g.text}
        return {"role": "assistant", "content": parsed.content or None, "tool_calls": [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed.calls]}

    def room(self, handle: GenerationHandle, ids: list[int], continues: bool) -> int:
        """How many tokens the call may generate: the run's per-turn limit, within what is left of the
        episode's budget (after the first call's prompt) when the call continues the episode."""
        limit = handle.max_tokens
        if handle.max_total_tokens and self.calls and continues:
            used = len(ids) - len(self.calls[0].generation.prompt_ids)
            limit = min(limit, handle.max_total_tokens - used)
        return limit

    def budget_spent(self) -> dict[str, Any]:
        return {"id": f"budget-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": BUDGET_SPENT}}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}

    def _refuse(self, message: str) -> JSONResponse:
        if self.handle is not None:
            self.refusals.append(message)
        return _error(400, message)

    def prompt(self, handle: GenerationHandle, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None) -> tuple[list[int], bool]:
        """The call's prompt ids, and whether they continue the last call's conversation token for token."""
        if self.calls:
            last = self.calls[-1]
            n = len(last.messages)
            reply = messages[n] if len(messages) > n + 1 else None
            if (messages[:n] == last.messages and tools == last.tools and reply is not None
                    and _same_reply(reply, last.reply)
                    and all(m.get("role") in ("user", "tool") for m in messages[n + 1:])):
                g = last.generation
                return g.prompt_ids + g.ids + handle.reply_ids(g, messages[n + 1:]), True
        return handle.chat_ids(messages, tools), not self.calls

    def response(self, g: Generation, reply: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "prompt_token_ids": g.prompt_ids,
            "choices": [{
                "index": 0, "token_ids": g.ids, "message": reply,
                "finish_reason": "tool_calls" if reply.get("tool_calls") else g.finish_reason,
                "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp, "token_id": t}
                                         for t, lp in zip(g.ids, g.logprobs)]},
            }],
            "usage": {"prompt_tokens": len(g.prompt_ids), "completion_tokens": len(g.ids),
                      "total_tokens": len(g.prompt_ids) + len(g.ids)},
        }


def _same_reply(message: Mapping[str, Any], reply: Mapping[str, Any]) -> bool:
    """Whether a history message is the model's `reply` as the endpoint returned it (harnesses strip
    whitespace they do not care about, and may re-serialise tool call arguments)."""
    def calls(m: Mapping[str, Any]) -> list[tuple[Any, Any]]:
        out = []
        for c in m.get("tool_calls") or []:
            f = (c.get("function") or {}) if isinstance(c, Mapping) else {}
            arguments = f.get("arguments")
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                pass
            out.append((f.get("name"), arguments))
        return out

    return (message.get("role") == "assistant" and (message.get("content") or "").strip()
            == (reply.get("content") or "").strip() and calls(message) == calls(reply))


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                        status_code=status)


class KeyCheck:
    """ASGI middleware: an HTTP call that does not carry `Authorization: Bearer KEY` (compared in
    constant time) is answered 401 here, so no route sees it: its body is never read, nothing is
    generated and the attached episode neither records it nor counts it as a refusal."""

    def __init__(self, app, key: str, where: str):
        self.app = app
        self.where = where
        self._expected = (BEARER + key).encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            sent = dict(scope["headers"]).get(b"authorization")
            if sent is None or not hmac.compare_digest(sent, self._expected):
                why = "no key" if sent is None else "a wrong key"
                log.warning("chat endpoint on %s refused %s %s: the call carried %s", self.where, scope["method"],
                            scope["path"], why)
                answer = _error(401, f"this endpoint requires its key as `Authorization: Bearer KEY` (the harness's "
                                     f"OpenAI API key: the environment's harness_api_key_file) and the call carried "
                                     f"{why}")
                answer.headers["WWW-Authenticate"] = "Bearer"
                return await answer(scope, receive, send)
        return await self.app(scope, receive, send)


class _Server(uvicorn.Server):
    """uvicorn inside the bridge's event loop: the bridge's own SIGTERM/SIGINT handling stays in charge."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
