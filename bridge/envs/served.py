"""A running OpenEnv server reached by url, with no environment-specific package: its `/schema`
says what a model turn means, and its sessions come from the endpoint's pool (`endpoint`), whose
waits and refusals each episode reports, so that a run can see a server too small for it."""

from __future__ import annotations

from typing import Any

from bridge.envs.endpoint import Endpoint
from bridge.envs.openenv_episode import Schemas, SessionConnector
from bridge.envs.session import Session
from bridge.envs.spec import EnvSpec


class ServedConnector(SessionConnector):
    """Opens episodes on the OpenEnv server behind `endpoint`."""

    def __init__(self, spec: EnvSpec, endpoint: Endpoint):
        super().__init__(spec)
        self.endpoint = endpoint

    async def schemas(self) -> Schemas:
        await self.endpoint.check()
        schemas = await self.endpoint.schema()
        # openenv >= 0.10 states reset's schema apart, and sends metadata; openenv-core 0.2 / 0.3 do neither.
        new = "reset_observation" in schemas
        return Schemas(schemas.get("action") or {}, schemas.get("observation") or {},
                       (schemas["reset_observation"] or {}) if new else None, new)

    async def new_session(self) -> Session:
        return await self.endpoint.open()

    def session_metrics(self, session: Session) -> dict[str, float]:
        """How long the episode waited for its session (the pool's bound, the server's capacity), and
        that capacity once a refusal stated it."""
        metrics = {"pool_waits": float(session.pool_waited), "pool_wait_s": session.wait_s,
                   "capacity_refusals": float(session.capacity_refusals)}
        if self.endpoint.metrics["server_max_sessions"]:
            metrics["server_max_sessions"] = float(self.endpoint.metrics["server_max_sessions"])
        return metrics

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self.endpoint.metrics)

    async def aclose(self) -> None:
        await self.endpoint.aclose()
