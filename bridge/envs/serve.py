"""Serves a bundled environment as an OpenEnv server: `python -m bridge env serve NAME` (`jaxrl env serve`).

The app is OpenEnv's own (`create_app`): HTTP `/health`, `/schema`, `/metadata`, stateless
`/reset` / `/step` / `/state`, and the WebSocket `/ws` where each connection is one session
with its own environment instance (at most `max_concurrent_envs` at once; one more is answered
`CAPACITY_REACHED`). uvicorn binds 127.0.0.1 unless another host is asked for; port 0 picks a
free port. Once it accepts connections it prints one line, `ENV_LISTENING http://host:port`,
on stdout. SIGTERM / SIGINT stop it (uvicorn re-raises the signal after its graceful stop, so
the exit status is the signal's), as does the exit of `parent_pid` when given.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from collections.abc import Callable

from bridge.envs.bundled import BUNDLED
from bridge.wire import ENV_LISTENING, is_loopback

DEFAULT_MAX_CONCURRENT_ENVS = 64

log = logging.getLogger("bridge.envs.serve")


def build_app(name: str, max_concurrent_envs: int = DEFAULT_MAX_CONCURRENT_ENVS, seed: int = 0):
    """The FastAPI app serving bundled environment `name` (UnknownEnvironmentError if none)."""
    spec = BUNDLED[name]
    if max_concurrent_envs < 1:
        raise ValueError(f"max_concurrent_envs must be at least 1, got {max_concurrent_envs}")
    from openenv.core.env_server import create_app

    app = create_app(spec.factory(seed), spec.action_cls, spec.observation_cls, env_name=name,
                     max_concurrent_envs=max_concurrent_envs)
    app.add_middleware(QuietDisconnects)
    return app


class QuietDisconnects:
    """ASGI middleware: a WebSocket client that closes first is not an application error.

    openenv-core 0.3.0's `/ws` handler closes the socket in a `finally` that only expects
    RuntimeError; when the client has already gone (the usual `close` message, then the
    socket closed) starlette raises WebSocketDisconnect and uvicorn logs a traceback per
    session. This swallows exactly that, for WebSocket scopes only.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "websocket":
            return await self.app(scope, receive, send)
        from starlette.websockets import WebSocketDisconnect

        try:
            await self.app(scope, receive, send)
        except WebSocketDisconnect:
            log.debug("websocket client left before the server closed the session")


def url_for(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port); port 0 picks a free one. OSError if it cannot bind."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


async def serve_app(app, sock: socket.socket, log_level: str = "warning",
                    on_listening: Callable[[str], None] | None = None,
                    parent_pid: int | None = None) -> int:
    """Runs `app` under uvicorn on the bound `sock` until a signal (or the parent's exit)."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=2,
                            lifespan="on")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    watchdog = None
    try:
        while not server.started:
            if serving.done():
                break  # start-up failed: uvicorn logged why
            await asyncio.sleep(0.02)
        else:
            if on_listening is not None:
                on_listening(url_for(host, port))
            if parent_pid:
                watchdog = asyncio.create_task(_watch_parent(parent_pid, server))
        await serving
    except SystemExit as e:  # uvicorn's exit on a failed start-up
        return e.code if isinstance(e.code, int) else 1
    finally:
        if watchdog is not None:
            watchdog.cancel()
    return 0 if server.started else 1


async def _watch_parent(parent_pid: int, server, every_s: float = 1.0) -> None:
    """Asks the server to stop once the process that started it is gone."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(every_s)
    log.warning("parent process %d is gone; shutting down", parent_pid)
    server.should_exit = True


def serve(name: str, host: str = "127.0.0.1", port: int = 0,
          max_concurrent_envs: int = DEFAULT_MAX_CONCURRENT_ENVS, seed: int = 0,
          parent_pid: int | None = None, log_level: str = "warning") -> int:
    """Serves bundled environment `name`; prints `ENV_LISTENING http://host:port` once ready."""
    app = build_app(name, max_concurrent_envs=max_concurrent_envs, seed=seed)
    if not is_loopback(host):
        print(f"warning: serving {name} on {host}, reachable from other machines", file=sys.stderr)

    try:
        sock = bind_socket(host, port)
    except OSError as e:
        print(f"jaxrl env serve: error: cannot listen on {host}:{port}: {e.strerror or e}",
              file=sys.stderr)
        return 1

    def announce(url: str) -> None:
        print(f"{ENV_LISTENING}{url}", flush=True)

    with sock:
        return asyncio.run(serve_app(app, sock, log_level=log_level, on_listening=announce,
                                     parent_pid=parent_pid))
