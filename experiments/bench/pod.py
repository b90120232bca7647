"""What a multi-host run adds to a step: the exchange of the processes' step summaries, the
assembly of each process's rows of the global batch, and the run's metrics from the exchange,
against a step of one process on as many devices.

    python -m experiments.bench.pod [--tiny] [--processes 2] [--devices 8] [--groups 8 ...]

Two runs of the same steps on synthetic trajectories (no bridge: only the learner's side is
measured), each in fresh processes: 1 process x DEVICES CPU devices, then PROCESSES processes x
DEVICES / PROCESSES (jax.distributed on 127.0.0.1), each process holding its share of the groups.
Per step, `share` is what `jaxrl train` does between collecting and updating: `exchange_step`,
`rl_batch` of the process's rows, the rows put on the global mesh (`put_batch`, the part of
`Learner.update` that assembles the global batch), and `rollout_metrics` of every process's
episodes; `update` is `Learner.update`.

Figures (last line, JSON; medians over the measured steps, process 0's clock):
  added_fraction       (share, several processes - share, one process) / (share + update, one
                       process): what multi-host assembly and global metrics add to a step, as a
                       fraction of the single-process step (target: < 0.05)
  share_ms_one, share_ms_multi, update_ms_one, update_ms_multi
  share_fraction_multi share / (share + update), several processes
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULTS = dict(groups=8, group_size=8, prompt_len=64, completion_len=192, hidden=256, layers=4, steps=5)
TINY = dict(groups=2, group_size=4, prompt_len=16, completion_len=16, hidden=64, layers=2, steps=3)


def _trajectories(api, group: int, size: int, prompt_len: int, completion_len: int, vocab: int):
    """Group `group`'s episodes, the same in every run (seeded by the group)."""
    rng = np.random.default_rng(group)
    out = []
    for i in range(size):
        c = int(rng.integers(completion_len // 2, completion_len + 1))
        mask = (rng.random(c) < 0.8).astype(np.uint8)
        out.append(api.TrajectoryData(
            f"0-{group}", i, rng.integers(0, vocab, prompt_len).astype(np.int32),
            rng.integers(0, vocab, c).astype(np.int32), np.where(mask, -1.0, 0.0).astype(np.float32), mask,
            np.where(mask, 0, -1).astype(np.int64), {"env": float(rng.random() < 0.5)}, "stop", "echo",
            num_turns=1, metrics={"env_steps": 1.0}))
    return out


def worker(args) -> None:
    """One process of a run: its share of the groups, `steps` steps; process 0 writes the timings."""
    import jax

    if args.processes > 1:
        jax.distributed.initialize(args.coordinator, args.processes, args.process_id)
    from jaxrl.run import api
    from jaxrl.sharding import put_batch

    cfg = api.config({"run_dir": args.out, "model": {"dir": args.model}, "envs": [{"name": "echo", "bundled": "echo"}],
                      "rollout": {"groups_per_step": args.groups, "max_prompt_tokens": args.prompt_len,
                                  "max_tokens": args.completion_len, "max_total_tokens": args.completion_len},
                      "learner": {"group_size": args.group_size, "optimizer": {"learning_rate": 1e-4}}})
    learner = api.make_learner(cfg)
    vocab = learner.model().cfg.vocab_size
    per = args.groups // args.processes
    mine = range(args.process_id * per, (args.process_id + 1) * per)
    groups = [_trajectories(api, g, args.group_size, args.prompt_len, args.completion_len, vocab) for g in mine]
    trajs = [t for g in groups for t in g]
    result = api.StepRollouts(groups, collections.Counter(episodes=len(trajs), requests=1), 1.0, 0.5, 0.5)
    exchange = api.Exchange(600)
    share, update = [], []
    for _ in range(args.steps + 1):  # the first step compiles
        t0 = time.perf_counter()
        step = api.exchange_step(exchange, result, args.prompt_len, False, {}, {"time/rollout_s": 1.0})
        batch = api.rl_batch(trajs, cfg, 0, rows=len(trajs), prompt_len=step.prompt_len)
        jax.block_until_ready(put_batch(batch, learner.mesh))
        api.rollout_metrics([e for g in step.groups for e in g], step.counts, cfg)
        t1 = time.perf_counter()
        learner.update(batch)
        share.append(t1 - t0)
        update.append(time.perf_counter() - t1)
    if args.process_id == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "timings.json").write_text(json.dumps({"share": share[1:], "update": update[1:]}))
    if args.processes > 1:
        jax.distributed.shutdown()


def _run(processes: int, devices: int, sizes: dict, model: Path, out: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices // processes}"}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()]
    procs = [subprocess.Popen([sys.executable, "-m", "experiments.bench.pod", "--worker", *flags,
                               f"--processes={processes}", f"--process-id={i}", f"--coordinator={address}",
                               f"--model={model}", f"--out={out}"], env=env, cwd=Path(__file__).parents[2])
             for i in range(processes)]
    for p in procs:
        if p.wait(timeout=1200):
            raise SystemExit(f"pod bench: a worker of the {processes}-process run failed (exit {p.returncode})")
    return json.loads((out / "timings.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="smoke sizes (CI)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=8, help="CPU devices in all, split over the processes")
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"default {value}")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else (TINY if args.tiny else DEFAULTS)[k]
             for k in DEFAULTS}
    if args.worker:
        for k, v in sizes.items():
            setattr(args, k, v)
        return worker(args)
    if sizes["groups"] % args.processes or args.devices % args.processes:
        raise SystemExit(f"pod bench: --groups {sizes['groups']} and --devices {args.devices} must split over "
                         f"{args.processes} processes")
    from jaxrl.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="jaxrl-pod-bench-") as tmp:
        model = build_tiny_model(Path(tmp) / "model", "qwen3", hidden_size=sizes["hidden"],
                                 intermediate_size=2 * sizes["hidden"], num_layers=sizes["layers"])
        worker_sizes = {k: v for k, v in sizes.items() if k not in ("hidden", "layers")}
        one = _run(1, args.devices, worker_sizes, model, Path(tmp) / "one")
        multi = _run(args.processes, args.devices, worker_sizes, model, Path(tmp) / "multi")
    med = {f"{what}_{run}": statistics.median(t[what]) for run, t in (("one", one), ("multi", multi))
           for what in ("share", "update")}
    figures = {
        "added_fraction": round((med["share_multi"] - med["share_one"]) / (med["share_one"] + med["update_one"]), 4),
        "share_fraction_multi": round(med["share_multi"] / (med["share_multi"] + med["update_multi"]), 4),
        **{f"{k.replace('_one', '_ms_one').replace('_multi', '_ms_multi')}": round(v * 1000, 2) for k, v in med.items()},
        "processes": args.processes, "devices": args.devices, "steps_measured": sizes["steps"],
        **{k: v for k, v in sizes.items() if k != "steps"},
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
