"""On-policy distillation against GRPO on the default task: a student half the teacher's size, trained
by the teacher's per-token reverse KL alone, by the task's rewards alone, and by both, at equal steps.

    python -m experiments.distillation [--teacher MODEL_DIR] [--steps N] [--toy] [--out runs/experiments/distillation]

The teacher is the CPU default's trained model (`configs/tiny_cpu.yaml`: warm start, then RL; run once
and exported, unless `--teacher` names one). The student is the same architecture with one layer
instead of two (0.59x the parameters), warm-started once on the environment solver's demonstrations
as the default is; from that shared start each variant trains `--steps` RL steps of the default's
shape (16 groups of 8 episodes):
  grpo     the default's objective on the task's rewards (learner.loss: dapo)
  distill  learner.loss.distill_weight 1, task_weight 0: the teacher's reverse KL per token alone
  both     distill_weight 1 and the task's advantage
OUT/distillation.md holds held-out success (256 test tasks, greedy) of the teacher, the warm-started
student and each variant; OUT/summary.md and compare_*.png the curves. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxrl.run import api
from jaxrl.tiny import build_tiny_model

VARIANTS = {
    "grpo": {},
    "distill": {"learner.loss.distill_weight": 1.0, "learner.loss.task_weight": 0.0},
    "both": {"learner.loss.distill_weight": 1.0},
}


def trained(cfg: api.TrainConfig, model: Path, record: Path) -> tuple[Path, dict]:
    """`cfg` trained once and exported to `model`; its summary (kept in `record`)."""
    if not (model / "config.json").is_file():
        summary = api.train(cfg)
        api.export(cfg.run_dir, model)
        record.write_text(json.dumps(summary))
    return model, json.loads(record.read_text())


def _shape(tiny) -> dict:
    return {"family": tiny.family, "hidden_size": tiny.hidden_size, "intermediate_size": tiny.intermediate_size,
            "num_layers": tiny.num_layers, "seed": tiny.seed}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/experiments/distillation")
    parser.add_argument("--teacher", help="the teacher's model directory (default: train the CPU default's)")
    parser.add_argument("--steps", type=int, default=200, help="RL steps of each variant")
    parser.add_argument("--toy", action="store_true",
                        help="random teacher and student, two variants of two steps, no warm start (CI)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    toy = {"rollout.groups_per_step": 2, "learner.group_size": 4, "eval.episodes": 4, "sft.steps": 0} if args.toy else {}
    base = api.config("configs/tiny_cpu.yaml", {"log.progress": False, "checkpoint_every": 1000, **toy,
                                                "model.dir": str(out / "teacher-start")})
    tiny = base.model.tiny
    half = {**_shape(tiny), "num_layers": 1}
    student = api.config(base, {"model.dir": str(out / "student-start"), "run_dir": str(out / "student-warm"),
                                "model.tiny": half, "steps": 1})
    if args.toy:  # random models of the two sizes, as the runs build them
        teacher, teacher_success = build_tiny_model(out / "teacher-model", **_shape(tiny)), None
        start, start_success = build_tiny_model(out / "student-start", **_shape(student.model.tiny)), None
    else:
        if args.teacher:
            teacher, teacher_success = Path(args.teacher), None
        else:
            teacher_run = api.config(base, {"run_dir": str(out / "teacher")})
            teacher, summary = trained(teacher_run, out / "teacher-model", out / "teacher.json")
            teacher_success = summary.get("eval_after")
        start, summary = trained(student, out / "student-model", out / "student.json")
        start_success = summary.get("eval_after_warm_start", summary.get("eval_after"))
    steps = 2 if args.toy else args.steps
    variants = {k: VARIANTS[k] for k in ("grpo", "distill")} if args.toy else VARIANTS
    runs, success = {}, {}
    for name, overrides in variants.items():
        run_dir = out / "runs" / name
        teacher_cfg = {"teacher": {"model": str(teacher)}} if "learner.loss.distill_weight" in overrides else {}
        cfg = api.config(student, {**overrides, **teacher_cfg, "model.dir": str(start), "model.tiny": None,
                                   "sft.steps": 0, "run_dir": str(run_dir), "steps": steps, "eval.before": False})
        success[name] = api.train(cfg).get("eval_after")
        runs[name] = run_dir
    api.compare_runs(runs, out, keys=["eval/success", "distill_reverse_kl", "entropy"])
    lines = [f"Teacher: {teacher} (held-out success {teacher_success}); student: 1 layer of the teacher's 2, "
             f"warm-started to {start_success}; {steps} RL steps each.", "",
             "| variant | held-out success |", "| --- | --- |"]
    lines += [f"| {name} | {value:.3f} |" for name, value in success.items() if value is not None]
    (out / "distillation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    result = {"out": str(out), "steps": steps, "teacher": teacher_success, "student_start": start_success,
              "variants": success}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    api.restart_tuned()  # the malloc settings `jaxrl train` runs under
    main()
