"""The learner alone on saved trajectories, no bridge: offline ablations on one fixed set of episodes.

    python -m experiments.offline_learner [--toy] [--trajectories FILE] [--out runs/experiments/offline_learner]

First (unless --trajectories names a file saved before) a bridge plays groups of episodes of the
bundled echo game with the tiny CPU default's model, scored by similarity (a dense reward a
random model also earns), and saves them (OUT/trajectories.jsonl, JSON lines). Then, for each
ablation, a fresh learner trains several epochs over the same groups, batch by batch, with no
bridge and no generation: how far each loss moves the policy on stale data, with and without
importance-sampling correction. Metrics per update go to OUT/NAME/metrics.jsonl; OUT/summary.md
compares them (compare_reward.png plots the policy's entropy per update).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxrl.models import load_tokenizer
from jaxrl.run import api

ABLATIONS = {
    "grpo": {"learner.loss.loss_type": "grpo", "learner.loss.is_level": "none"},
    "grpo+token_is": {"learner.loss.loss_type": "grpo", "learner.loss.is_level": "token"},
    "dapo": {"learner.loss.loss_type": "dapo", "learner.loss.is_level": "none"},
    "dr_grpo+seq_is": {"learner.loss.loss_type": "dr_grpo", "learner.loss.is_level": "sequence"},
}


def collect(cfg: api.TrainConfig, path: Path, steps: int) -> Path:
    """`steps` steps' worth of groups played by a bridge, saved to `path`."""
    with api.start_bridge(cfg, path.parent / "collect") as bridge:
        for step in range(steps):
            api.save_trajectories(path, bridge.episodes(step=step), append=step > 0)
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/experiments/offline_learner")
    parser.add_argument("--trajectories", help="a file saved by an earlier run of this script (skips collecting)")
    parser.add_argument("--toy", action="store_true", help="two ablations, a few updates (CI)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    size = {"rollout.groups_per_step": 2, "learner.group_size": 4, "model.dir": str(out / "tiny-model")} \
        if args.toy else {}
    cfg = api.config("configs/tiny_cpu.yaml", {"data.task_fields": {"echo": {"reward_mode": "similarity"}},
                                               "log.progress": False, **size})
    path = Path(args.trajectories) if args.trajectories else collect(cfg, out / "trajectories.jsonl",
                                                                       2 if args.toy else 16)
    groups = api.load_trajectories(path)
    # As a run sizes it from its environments' first prompts: here from the prompts the trajectories hold.
    longest = max(len(t.prompt_ids) for g in groups for t in g)
    cfg = api.config(cfg, {"rollout.max_prompt_tokens": cfg.rollout.max_prompt_tokens or api.prompt_budget(longest)})
    per_batch = cfg.rollout.groups_per_step
    batches = [[t for g in groups[i:i + per_batch] for t in g] for i in range(0, len(groups) - per_batch + 1, per_batch)]
    epochs = 1 if args.toy else 4
    runs = {}
    for name, overrides in (list(ABLATIONS.items())[::3] if args.toy else ABLATIONS.items()):
        run_cfg = api.config(cfg, {**overrides, "steps": epochs * len(batches)})
        learner = api.make_learner(run_cfg)  # builds the toy model first when --trajectories skipped collecting
        pad_id = load_tokenizer(run_cfg.model.dir).pad_token_id
        runs[name] = out / name
        with api.MetricsLogger(runs[name], tensorboard=False) as logger:
            for epoch in range(epochs):
                for batch in batches:
                    logger.log(learner.step + 1, {**learner.update(api.rl_batch(batch, run_cfg, pad_id)),
                                                  "epoch": float(epoch)})
    table, plot = api.compare_runs(runs, out, metric="entropy", keys=["loss", "grad_norm", "clip_frac_low",
                                                                      "clip_frac_high", "is_weight_raw_mean"])
    print(table)
    result = {"out": str(out), "trajectories": str(path), "groups": len(groups), "updates": epochs * len(batches),
              "plot": str(plot), "final": {n: {k: round(v, 4) for k, v in api.read_metrics(d)[-1].items()
                                               if k in ("entropy", "loss", "grad_norm", "clip_frac_high")}
                                           for n, d in runs.items()}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    api.restart_tuned()  # the malloc settings `jaxrl train` runs under: XLA reuses its scratch memory
    main()
