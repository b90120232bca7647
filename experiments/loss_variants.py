"""Loss variants compared: grpo, dapo and dr_grpo aggregation, each with and without sequence-level
importance correction, over 3 seeds on the bundled echo environment; a plot and a table.

    python -m experiments.loss_variants [--toy] [--out runs/experiments/loss_variants]

Every variant starts from the same model: the tiny CPU default's, warm-started once on the echo
solver's demonstrations and exported (RL on the random model would have no reward to compare).
Each (variant, seed) is a `jaxrl train` run of its own under OUT/runs/; OUT/summary.md holds the
per-run table and the reward curves (compare_reward.png), OUT/variants.md the mean +- sd over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from jaxrl.run import api

VARIANTS = {f"{loss}{'+seq_is' if corrected else ''}": {"learner.loss.loss_type": loss,
                                                        "learner.loss.is_level": "sequence" if corrected else "none"}
            for loss in ("grpo", "dapo", "dr_grpo") for corrected in (False, True)}
SEEDS = (0, 1, 2)


def warm_model(base: api.TrainConfig, out: Path) -> Path:
    """The shared start: one run of the default's warm start (and a single RL step), exported."""
    model = out / "warm-model"
    if (model / "config.json").is_file():
        return model
    run = api.config(base, {"run_dir": str(out / "warm"), "steps": 1, "eval.episodes": 0})
    api.train(run)
    return api.export(run.run_dir, model)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/experiments/loss_variants")
    parser.add_argument("--toy", action="store_true", help="two variants, one seed, two steps, no warm start (CI)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    size = ({"rollout.groups_per_step": 2, "learner.group_size": 4, "eval.episodes": 4,
             "model.dir": str(out / "tiny-model")} if args.toy else {"eval.episodes": 64})
    base = api.config("configs/tiny_cpu.yaml", {"log.progress": False, "checkpoint_every": 100, **size})
    model = base.model.dir if args.toy else warm_model(base, out)  # toy: the random model, built by the first run
    variants = dict(list(VARIANTS.items())[::5]) if args.toy else VARIANTS  # toy: grpo and dr_grpo+seq_is
    seeds = SEEDS[:1] if args.toy else SEEDS
    runs, finals = {}, {}
    for name, overrides in variants.items():
        for seed in seeds:
            run_dir = out / "runs" / f"{name}_seed{seed}"
            cfg = api.config(base, {**overrides, "model.dir": str(model), "sft.steps": 0,
                                    **({} if args.toy else {"model.tiny": None}),
                                    "seed": seed, "data.seed": seed, "run_dir": str(run_dir),
                                    "steps": 2 if args.toy else 30, "eval.before": False})
            summary = api.train(cfg)
            runs[f"{name}_seed{seed}"] = run_dir
            rows = api.read_metrics(run_dir)
            tail = [r["reward/mean"] for r in rows[-10:] if "reward/mean" in r]
            finals.setdefault(name, []).append((summary.get("eval_after", float("nan")), statistics.mean(tail)))
    table, plot = api.compare_runs(runs, out, keys=["eval/success", "kl", "entropy", "grad_norm"])
    print(table)
    lines = ["| variant | held-out success (mean +- sd) | reward, last 10 steps (mean +- sd) |", "| --- | --- | --- |"]
    for name, values in finals.items():
        cols = [[v[i] for v in values] for i in (0, 1)]
        lines.append(f"| {name} | " + " | ".join(
            f"{statistics.mean(c):.3f} +- {statistics.stdev(c) if len(c) > 1 else 0.0:.3f}" for c in cols) + " |")
    (out / "variants.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    result = {"out": str(out), "plot": str(plot), "runs": len(runs),
              "variants": {n: [round(statistics.mean(v[i] for v in vs), 4) for i in (0, 1)] for n, vs in finals.items()}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    api.restart_tuned()  # the malloc settings `jaxrl train` runs under: XLA reuses its scratch memory
    main()
