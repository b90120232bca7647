"""An OpenEnv server reached by url: a server of one session queues the episodes, and says so."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from bridge.envs.runtime import EnvRuntime
from bridge.rollout import run_episode
from bridge.tool_calls import get_parser
from episodes import PARAMS, catalogue_spec, serve_catalogue
from jaxrl.tiny_tokenizer import build_tokenizer
from scripted_engine import ScriptedEngine, tool_call


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def catalogue():
    with serve_catalogue(["nim"]) as urls:
        yield urls


def test_a_one_session_server_queues_episodes_and_says_so_in_metrics(tok, catalogue, caplog):
    def play(spec, n=3):
        runtime = EnvRuntime([spec], tok, get_parser())
        engine = ScriptedEngine(tok, lambda prompt: tool_call("nim", {"take": 3}), delay_s=0.05)
        params = dataclasses.replace(PARAMS, max_turns=4, max_total_tokens=2048)

        async def go():
            await runtime.start()
            try:
                return await asyncio.gather(*(run_episode(engine, f"g{i}", 0, [], params, runtime.hook("nim", {}),
                                                          env="nim")
                                              for i in range(n)))
            finally:
                await runtime.aclose()  # its sessions stay open for reuse until then, holding the server's slot

        trajs = asyncio.run(go())
        assert all(t.finish_reason == "env_done" and t.rewards == {"env": 1.0} for t in trajs), [t.error for t in trajs]
        return trajs, runtime.connectors["nim"].metrics

    with caplog.at_level(logging.WARNING, logger="bridge.envs.endpoint"):
        trajs, stats = play(catalogue_spec(catalogue, "nim", "served"))  # the default pool: 64 sessions
    assert sum(t.metrics["capacity_refusals"] for t in trajs) > 0 and max(t.metrics["pool_wait_s"] for t in trajs) > 0
    assert stats["server_max_sessions"] == 1 and stats["capacity_waits"] > 0
    assert max(t.metrics.get("server_max_sessions", 0) for t in trajs) == 1  # for the trainer's warning
    warnings = [r.getMessage() for r in caplog.records if "allows 1 session(s) at once" in r.getMessage()]
    assert len(warnings) == 1 and "the session pool for it holds 64" in warnings[0]
    assert "set max_concurrent_envs: 1 for this environment" in warnings[0]
    trajs, stats = play(catalogue_spec(catalogue, "nim", "served", max_concurrent_envs=1))
    assert sum(t.metrics["pool_waits"] for t in trajs) == 2 and stats["capacity_waits"] == 0
