"""An openenv `Environment` subclass run in the bridge's own process: one instance per episode,
answering as OpenEnv's server would for the same class (`_LocalSession`), so that an environment
can be developed and trained on without serving it, and behaves the same once served."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import json
import logging
from collections.abc import Callable
from typing import Any

from bridge.envs.openenv_episode import Schemas, SessionConnector
from bridge.envs.session import EnvServerError
from bridge.envs.spec import EnvConfigError, EnvSpec, import_object

log = logging.getLogger(__name__)


class _LocalSession:
    """An in-process openenv Environment that answers as OpenEnv's server does over `/ws` (the
    handler of `openenv.core.env_server.http_server`): the environment is built, reset, stepped and
    closed on one worker thread of its own, or awaited where it overrides `reset_async` /
    `step_async`; an MCP environment's MCP session stays open for the session; `reset` gets the
    task fields its signature accepts (the server's own filter); actions are parsed by the
    server's `deserialize_action` (MCP list/call actions included); failures are the server's
    VALIDATION_ERROR / EXECUTION_ERROR answers (EnvServerError)."""

    def __init__(self, name: str, make: Callable[[], Any], action_cls: type):
        self.where = f"environment {name!r} (in-process)"
        self.make = make
        self.action_cls = action_cls
        self.env: Any = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"env-{name}")
        self._stack = contextlib.AsyncExitStack()

    async def start(self) -> None:
        """Builds the environment (its constructor's errors raised as they are)."""
        self.env = await self._in_thread(self.make)
        mcp_session = getattr(self.env, "mcp_session", None)
        if callable(mcp_session):
            await self._stack.enter_async_context(mcp_session())

    async def _in_thread(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._thread, lambda: fn(*args, **kwargs))

    async def _answer(self, what: str, call) -> dict:
        from openenv.core.env_server.serialization import serialize_observation
        from openenv.core.env_server.types import WSObservationResponse
        from pydantic import ValidationError

        try:
            # Through JSON as the server sends it: enums as values, tool results as plain objects.
            return json.loads(WSObservationResponse(data=serialize_observation(await call())).model_dump_json())["data"]
        except ValidationError as e:
            raise EnvServerError(f"{self.where} {what}", "VALIDATION_ERROR", "Invalid message",
                                 {"errors": e.errors(include_url=False)}) from None
        except Exception as e:
            raise EnvServerError(f"{self.where} {what}", "EXECUTION_ERROR", str(e), {}) from None

    async def reset(self, **task) -> dict:
        from openenv.core.env_server import Environment
        from openenv.core.env_server.http_server import HTTPEnvServer

        env = self.env
        overridden = env.reset_async.__func__ is not Environment.reset_async
        fn = env.reset_async if overridden else env.reset
        kwargs = HTTPEnvServer._get_valid_kwargs(None, inspect.signature(fn), task)
        return await self._answer("reset", lambda: fn(**kwargs) if overridden else self._in_thread(fn, **kwargs))

    async def step(self, action: dict) -> dict:
        from openenv.core.env_server import Environment
        from openenv.core.env_server.serialization import deserialize_action

        env = self.env

        async def call():
            parsed = deserialize_action(action, self.action_cls)
            if env.step_async.__func__ is not Environment.step_async:
                return await env.step_async(parsed)
            return await self._in_thread(env.step, parsed)

        return await self._answer("step", call)

    async def release(self) -> None:
        """As Session.release; an in-process environment is built again for the next episode."""
        await self.close()

    async def close(self) -> None:
        """Ends the MCP session and closes the environment; like the server, never raises."""
        try:
            await self._stack.aclose()
            if self.env is not None:
                await self._in_thread(self.env.close)
        except Exception as e:
            log.warning("%s: closing it failed: %s: %s", self.where, type(e).__name__, e)
        finally:
            self._thread.shutdown(wait=False)


def _action_class(spec: EnvSpec, env_cls: type) -> type:
    """The Action class: `action_class` in the spec, else `step`'s annotation, else for an MCP
    environment CallToolAction (what OpenEnv's MCP environments are served with)."""
    from openenv.core.env_server import Action
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.mcp_types import CallToolAction

    if spec.action_class:
        action_cls = import_object(spec.action_class, f"environment {spec.name!r}: action_class")
    else:
        action_cls = inspect.get_annotations(env_cls.step, eval_str=True).get("action")
        if issubclass(env_cls, MCPEnvironment) and action_cls in (None, Action):
            action_cls = CallToolAction
    if not (inspect.isclass(action_cls) and issubclass(action_cls, Action)) or action_cls is Action:
        raise EnvConfigError(
            f"environment {spec.name!r}: cannot tell the Action class of {env_cls.__name__}: annotate "
            f"`def step(self, action: MyAction)` or set action_class: 'module:MyAction'")
    return action_cls


def _returned_schema(method: Any) -> dict[str, Any] | None:
    """The JSON schema of the Observation class `method` is annotated to return (None: not annotated)."""
    from openenv.core.env_server import Observation

    try:
        returned = inspect.get_annotations(method, eval_str=True).get("return")
    except NameError:  # an annotation only a type checker resolves
        return None
    if inspect.isclass(returned) and issubclass(returned, Observation):
        return returned.model_json_schema()
    return None


class InProcessConnector(SessionConnector):
    """Opens episodes on fresh instances of the Environment class `env_cls`, each built by `make`
    (its constructor with the spec's env_kwargs)."""

    def __init__(self, spec: EnvSpec, env_cls: type, make: Callable[[], Any]):
        super().__init__(spec)
        self.env_cls = env_cls
        self.make = make
        self.action_cls = _action_class(spec, env_cls)

    async def schemas(self) -> Schemas:
        """As the class annotates them; this process's openenv sends metadata (`_LocalSession._answer`)."""
        reset = _returned_schema(self.env_cls.reset)
        step = _returned_schema(self.env_cls.step)
        return Schemas(self.action_cls.model_json_schema(), step or reset or {}, reset, True)

    async def new_session(self) -> _LocalSession:
        session = _LocalSession(self.spec.name, self.make, self.action_cls)
        try:
            await session.start()
        except BaseException:
            await session.close()
            raise
        return session
