"""Policy objectives compared on the default task: grpo, dapo, dr_grpo, gspo, cispo and sapo, 3 seeds
each, from one shared warm-started model; held-out success with its standard error, a table and a plot.

    python -m experiments.loss_variants [--toy] [--steps N] [--set KEY=VALUE ...] [--out runs/experiments/loss_variants]

Every variant starts from the same model: the CPU default's (`configs/tiny_cpu.yaml`) warm start,
run once and exported, then trains the default's RL phase (`--steps`, default the config's) under
its own `learner.loss.loss_type`, everything else the default's (or `--set`'s, applied to every RL run:
e.g. `--set learner.num_iterations=2`, where the objectives' ratios leave 1). Each (variant, seed) is a `jaxrl
train` run of its own under OUT/runs/; OUT/summary.md holds the per-run table and the curves
(compare_reward.png), OUT/variants.md held-out success per variant: the mean over seeds +- its
standard error (sd / sqrt(seeds)), and the same for the reward of the last 10 steps.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from jaxrl.run import api

VARIANTS = {name: {"learner.loss.loss_type": name} for name in ("grpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo")}
SEEDS = (0, 1, 2)


def warm_model(base: api.TrainConfig, out: Path) -> tuple[Path, float]:
    """The shared start: one run of the default's warm start (and a single RL step), exported; with
    its held-out success after the warm start."""
    model, run = out / "warm-model", api.config(base, {"run_dir": str(out / "warm"), "steps": 1})
    if not (model / "config.json").is_file():
        summary = api.train(run)
        api.export(run.run_dir, model)
        (out / "warm.json").write_text(json.dumps(summary))
    return model, json.loads((out / "warm.json").read_text()).get("eval_after_warm_start", float("nan"))


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/experiments/loss_variants")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key of every RL run (dotted), repeatable")
    parser.add_argument("--toy", action="store_true", help="two variants, one seed, two steps, no warm start (CI)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    size = ({"rollout.groups_per_step": 2, "learner.group_size": 4, "eval.episodes": 4,
             "model.dir": str(out / "tiny-model")} if args.toy else {})
    base = api.config("configs/tiny_cpu.yaml", {"log.progress": False, "checkpoint_every": 1000, **size})
    if args.toy:  # the random model, built by the first run
        model, warm = base.model.dir, float("nan")
    else:
        model, warm = warm_model(base, out)
    variants = {k: VARIANTS[k] for k in ("grpo", "cispo")} if args.toy else VARIANTS
    seeds = SEEDS[:1] if args.toy else SEEDS
    steps = 2 if args.toy else (args.steps or base.steps)
    runs, finals = {}, {}
    for name, overrides in variants.items():
        for seed in seeds:
            run_dir = out / "runs" / f"{name}_seed{seed}"
            cfg = api.config(api.config(base, args.set), {**overrides, "model.dir": str(model), "sft.steps": 0,
                                    **({} if args.toy else {"model.tiny": None}),
                                    "seed": seed, "data.seed": seed, "run_dir": str(run_dir),
                                    "steps": steps, "eval.before": False})
            summary = api.train(cfg)
            runs[f"{name}_seed{seed}"] = run_dir
            rows = api.read_metrics(run_dir)
            tail = [r["reward/mean"] for r in rows[-10:] if "reward/mean" in r]
            finals.setdefault(name, []).append((summary.get("eval_after", float("nan")), statistics.mean(tail)))
    table, plot = api.compare_runs(runs, out, keys=["eval/success", "kl", "entropy", "grad_norm"])
    print(table)
    lines = [f"Warm start (shared): held-out success {warm:.3f}; {steps} RL steps per run, seeds {list(seeds)}.", "",
             "| variant | held-out success (mean +- s.e.) | reward, last 10 steps (mean +- s.e.) |",
             "| --- | --- | --- |"]
    result = {}
    for name, values in finals.items():
        cols = [mean_and_stderr([v[i] for v in values]) for i in (0, 1)]
        lines.append(f"| {name} | " + " | ".join(f"{m:.3f} +- {se:.3f}" for m, se in cols) + " |")
        result[name] = [round(x, 4) for col in cols for x in col]
    (out / "variants.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    summary = {"out": str(out), "plot": str(plot), "runs": len(runs), "warm_start": warm, "steps": steps,
               "variants": result}  # name: [success, its s.e., reward, its s.e.]
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    api.restart_tuned()  # the malloc settings `jaxrl train` runs under: XLA reuses its scratch memory
    main()
