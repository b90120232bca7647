"""Shared pieces of the environment episode tests: running one episode through the real hook and
rollout loop, the checks on its token masks, a TRL-style tool class, and OpenEnv's catalogue
environments served as OpenEnv ships them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from bridge.engines.base import SamplingParams
from bridge.envs.spec import EnvSpec
from bridge.rollout import ENV_VERSION, run_episode
from scripted_engine import ScriptedEngine, segments

PARAMS = SamplingParams(temperature=1.0, max_tokens=64, seed=0)

CATALOGUE = Path(__file__).parent / "workers" / "openenv_catalogue.py"
CLASSES = {"grid": "tests.workers.openenv_catalogue:GridWorldEnvironment",
           "arithmetic": "tests.workers.openenv_catalogue:ArithmeticEnvironment",
           "nim": "tests.workers.openenv_catalogue:NimEnvironment",
           "board": "tests.workers.openenv_catalogue:BoardEnvironment",
           "quiz": "tests.workers.openenv_catalogue:QuizEnvironment",
           "echo_mcp": "tests.workers.openenv_catalogue:EchoMCPEnvironment"}
WHERE = ("served", "in_process")
# openenv-core 0.3.0's code (the catalogue's servers pin 0.2.3 / 0.3.0), beside the environment's packages.
OPENENV_CORE_0_3 = Path(sys.prefix) / "openenv-core-0.3.0"


def run(engine, runtime, env, task, max_turns=8, budget=2048):
    async def go():
        await runtime.start()
        try:
            hook = runtime.hook(env, task)
            params = dataclasses.replace(PARAMS, max_turns=max_turns, max_total_tokens=budget)
            return await run_episode(engine, "g", 0, [], params, hook, env=env)
        finally:  # its sessions held their servers' slots (one, on most catalogue servers) until collected
            await runtime.aclose()

    return asyncio.run(go())


def check_masks(traj, tok):
    assert len(traj.loss_mask) == len(traj.completion_ids) == len(traj.token_versions)
    for t, m, v, lp in zip(traj.completion_ids, traj.loss_mask, traj.token_versions, traj.sampler_logprobs):
        assert (v == ENV_VERSION) == (m == 0)
        if m == 0:
            assert lp == 0.0
    for m, ids in segments(traj):
        if m == 0:  # what the environment wrote ends by opening the model's next turn
            assert tok.decode(ids).endswith("<|im_start|>assistant\n")


def scripted(tok, replies):
    replies = iter(replies)
    return ScriptedEngine(tok, lambda prompt: next(replies))


def env_turns(traj, tok):
    return [tok.decode(ids) for m, ids in segments(traj) if m == 0]


class Counter:
    """A TRL-style environment: tools are its documented public methods."""

    def reset(self, start: int = 0, **task) -> str:
        self.value, self.done = start, False
        return f"The counter is at {start}. Reach 3."

    def add(self, amount: int) -> str:
        """Adds to the counter.

        Args:
            amount: How much to add.
        """
        if amount < 0:
            raise ValueError("amount must be positive")
        self.value += amount
        self.done = self.value >= 3
        return f"counter = {self.value}"

    def reward(self) -> float:
        return 1.0 if self.value == 3 else 0.0


@contextlib.contextmanager
def serve_catalogue(names, old_names=()):
    """One process serving each named catalogue environment on its own port, as OpenEnv ships it:
    name -> url. With `old_names`, a second process (started alongside) serves those with openenv-core
    0.3.0, and (urls, old urls) are yielded."""
    procs = [_start_catalogue(names)] + ([_start_catalogue(old_names, old_openenv=True)] if old_names else [])
    try:
        found = [_catalogue_urls(proc, n) for proc, n in zip(procs, (names, old_names))]
        yield found[0] if not old_names else tuple(found)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


def _start_catalogue(names, old_openenv=False):
    env = dict(os.environ)
    if old_openenv:
        assert (OPENENV_CORE_0_3 / "openenv").is_dir(), f"{OPENENV_CORE_0_3} is missing: run scripts/setup.sh test"
        env["PYTHONPATH"] = os.pathsep.join([str(OPENENV_CORE_0_3), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, str(CATALOGUE), *names], stdout=subprocess.PIPE, text=True, env=env)


def _catalogue_urls(proc, names):
    urls = {}
    for _ in names:
        line = proc.stdout.readline()
        assert line.startswith("ENV_LISTENING "), line
        _, name, url = line.split()
        urls[name] = url
    return urls


def catalogue_spec(urls, name, where, **keys):
    return EnvSpec(name, **({"url": urls[name]} if where == "served" else {"env_class": CLASSES[name]}), **keys)
