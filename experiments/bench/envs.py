"""Environment throughput through our session layer vs. OpenEnv's own client, same server.

    python -m experiments.bench.envs [--env guess_number] [--sessions 64] [--episodes 16]
                                     [--repeats 5] [--tiny]

One bundled server (`--sessions` slots). `--sessions` concurrent workers each play
`--episodes` episodes: reset(seed) then the solver's actions for that seed, worked out
in-process beforehand so that only the transport is timed, and every episode must end done.
Two ways, in this process: `bridge` = `bridge.envs.session` (Endpoint / Session), `raw` =
openenv's `GenericEnvClient`, one per worker. Each is timed twice: with one session per
worker for all its episodes (`held`, the main figures) and with a new session per episode
(`fresh`, what restarting an episode costs, our accept check included). Each round runs every
variant once, in alternating order; figures are medians over `--repeats` rounds after one
warm-up round, ratios are medians of the per-round ratios. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from openenv.core.generic_client import GenericEnvClient

from bridge.envs.bundled import NAMES, get
from bridge.envs.endpoint import Endpoint
from bridge.envs.session import SessionConfig
from jaxrl.run.api import EnvServerProcess


def plans(env: str, seeds: range) -> dict[int, list[dict]]:
    """The solver's actions per seed (played in-process), as the dicts sent over the wire."""
    spec = get(env)
    return {seed: [a.model_dump(exclude={"metadata"}) for a in spec.demonstration(seed=seed).actions]
            for seed in seeds}


async def bridge_worker(endpoint: Endpoint, seeds: list[int], plan, fresh: bool) -> None:
    for todo in ([[s] for s in seeds] if fresh else [seeds]):
        async with endpoint.session() as env:
            for seed in todo:
                await env.reset(seed=seed)
                for action in plan[seed]:
                    reply = await env.step(action)
                _check(reply["done"], seed)


async def raw_worker(url: str, seeds: list[int], plan, fresh: bool) -> None:
    for todo in ([[s] for s in seeds] if fresh else [seeds]):
        async with GenericEnvClient(base_url=url) as client:
            for seed in todo:
                await client.reset(seed=seed)
                for action in plan[seed]:
                    result = await client.step(action)
                _check(result.done, seed)


def _check(done: bool, seed: int) -> None:
    if not done:
        raise AssertionError(f"seed {seed}: the episode did not end after the solver's actions")


def run_once(way: str, fresh: bool, url: str, sessions: int, episodes: int, plan) -> float:
    """Seconds for `sessions` workers to play `episodes` episodes each."""
    work = [list(range(w * episodes, (w + 1) * episodes)) for w in range(sessions)]

    async def main():
        if way == "bridge":
            endpoint = Endpoint(url, SessionConfig(max_sessions=sessions))
            workers = [bridge_worker(endpoint, seeds, plan, fresh) for seeds in work]
        else:
            workers = [raw_worker(url, seeds, plan, fresh) for seeds in work]
        start = time.perf_counter()
        await asyncio.gather(*workers)
        elapsed = time.perf_counter() - start
        if way == "bridge":
            m = endpoint.metrics
            assert m["sessions_lost"] == m["connect_failures"] == 0, m
        return elapsed

    return asyncio.run(main())


VARIANTS = [(way, fresh) for fresh in (False, True) for way in ("bridge", "raw")]


def measure(env: str, sessions: int, episodes: int, repeats: int) -> dict:
    plan = plans(env, range(sessions * episodes))
    steps = sum(map(len, plan.values()))
    with EnvServerProcess.start(env, max_concurrent_envs=sessions) as server:
        seconds: dict[tuple[str, bool], list[float]] = {v: [] for v in VARIANTS}
        for round_ in range(repeats + 1):
            order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
            for way, fresh in order:
                elapsed = run_once(way, fresh, server.url, sessions, episodes, plan)
                if round_:  # round 0 warms up both sides
                    seconds[way, fresh].append(elapsed)
            if round_:
                print(f"round {round_}: " + ", ".join(
                    f"{way}{' fresh' if fresh else ''} {steps / seconds[way, fresh][-1]:,.0f} steps/s"
                    for way, fresh in VARIANTS), flush=True)

    def rate(way, fresh):
        return statistics.median(steps / s for s in seconds[way, fresh])

    def ratio(fresh):
        return statistics.median(r / b for b, r in zip(seconds["bridge", fresh], seconds["raw", fresh]))

    return {
        "env_steps_per_s": rate("bridge", False),
        "raw_env_steps_per_s": rate("raw", False),
        "bridge_over_raw": ratio(False),
        "fresh_env_steps_per_s": rate("bridge", True),
        "fresh_raw_env_steps_per_s": rate("raw", True),
        "fresh_bridge_over_raw": ratio(True),
        "episodes_per_s": rate("bridge", False) * sessions * episodes / steps,
        "env": env, "sessions": sessions, "episodes": sessions * episodes, "steps": steps,
        "repeats": repeats,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="guess_number", choices=NAMES)
    parser.add_argument("--sessions", type=int, default=64, help="concurrent workers (and server slots)")
    parser.add_argument("--episodes", type=int, default=16, help="episodes per worker")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="4 workers, 2 episodes, 1 round (CI)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.sessions, args.episodes, args.repeats = 4, 2, 1
    figures = measure(args.env, args.sessions, args.episodes, args.repeats)
    print(f"{figures['env']}: {figures['sessions']} sessions, {figures['episodes']} episodes, "
          f"{figures['steps']} steps per run")
    print(f"held sessions:  bridge {figures['env_steps_per_s']:,.0f} steps/s, raw "
          f"{figures['raw_env_steps_per_s']:,.0f} steps/s, bridge/raw {figures['bridge_over_raw']:.2f}")
    print(f"fresh sessions: bridge {figures['fresh_env_steps_per_s']:,.0f} steps/s, raw "
          f"{figures['fresh_raw_env_steps_per_s']:,.0f} steps/s, bridge/raw "
          f"{figures['fresh_bridge_over_raw']:.2f}")
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main()
