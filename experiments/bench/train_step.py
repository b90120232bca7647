"""Wall time of one training step of the tiny config, and where it goes.

    python -m experiments.bench.train_step [--config configs/tiny_cpu.yaml] [--steps 8] [--tiny]

Runs `jaxrl train` in-process with real processes (bridge, environment servers) on the config,
without its warm start and evaluations, and averages the steps after the first (compilation).
Last line (JSON): `step_s` (mean wall time per step) split into `generate_s` and `env_s` (the
rollout's wall time, divided by the episodes' own generate / environment shares), `learn_s`
(the jitted update) and `sync_s` (snapshot publish + the bridge's load); `other_s` is the rest
(batch building, logging, checkpoint scheduling).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from jaxrl.run import api

PARTS = ("generate_s", "env_s", "learn_s", "sync_s")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tiny", action="store_true", help="3 steps of 2 small groups (CI smoke run)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    steps = 3 if args.tiny else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"run_dir={tmp}/run", f"steps={steps}", "sft.steps=0", "eval.episodes=0",
                     "log.progress=false", "log.tensorboard=false", f"checkpoint_every={steps}"]
        if args.tiny:
            overrides += ["rollout.groups_per_step=2"]
        cfg = api.config(args.config, overrides + args.set)
        with open(f"{tmp}/train.log", "w") as log:
            api.train(cfg, out=log)
        rows = [r for r in api.read_metrics(cfg.run_dir) if "time/step_s" in r][1:]
    figures = {"step_s": statistics.mean(r["time/step_s"] for r in rows)}
    for part in PARTS:
        figures[part] = statistics.mean(r[f"time/{part}"] for r in rows)
    figures["other_s"] = figures["step_s"] - sum(figures[p] for p in PARTS)
    figures = {k: round(v, 4) for k, v in figures.items()}
    figures.update(steps_measured=len(rows), episodes_per_step=cfg.groups_per_step_rows,
                   rollout_mode=cfg.rollout.mode)
    for k, v in figures.items():
        print(f"{k:>18}: {v}")
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    api.restart_tuned()  # malloc as `jaxrl train` and the bridge run it (jaxrl.host_memory)
    main()
