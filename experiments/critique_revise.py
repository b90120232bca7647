"""A custom rollout function trained end to end: answer, be told the score, revise; rewarded on the revision.

    python -m experiments.critique_revise [--toy] [--out runs/experiments/critique_revise]

The episode is the rollout function below (an environment entry `rollout_fn:`), run in the bridge:
it plays the bundled echo game ("Repeat exactly: amber river") in-process for two steps, the
model's first answer, then, told its score, a revision. The revision's score is the
episode's reward (`env`); the first answer's is logged beside it (`answer`, weight 0), so the
curves show whether the model learns to improve on its own answer. The model is the tiny CPU
default's, warm-started on the echo game's demonstrations (a second environment of the run,
never sampled for RL: `data.mix`). The bridge imports this module: run from the repository root.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bridge.envs.bundled.echo import EchoAction, EchoEnvironment
from bridge.envs.rollout_fn import Episode, GenerationHandle, Turn
from jaxrl.run import api


async def critique_and_revise(task: dict, handle: GenerationHandle) -> Episode:
    """Two steps of one echo episode: the answer, then the revision after the environment's feedback."""
    env = EchoEnvironment()
    first = env.reset(seed=task["seed"], max_steps=2, reward_mode="similarity")
    prompt = handle.chat_ids([{"role": "user", "content": first.text}])
    answer = await handle.generate(prompt)
    seen = env.step(EchoAction(message=answer.text))
    critique = handle.reply_ids(answer, [{"role": "user", "content": (
        f"That scored {seen.reward:.2f} of 1. Write the requested text again, exactly.")}])
    revision = await handle.generate(prompt + answer.ids + critique)
    revised = env.step(EchoAction(message=revision.text))
    env.close()
    return Episode(prompt, [Turn.model(answer), Turn.context(critique), Turn.model(revision)],
                   {"env": revised.reward, "answer": seen.reward})


def settings(out: Path, toy: bool) -> dict:
    """The run: the tiny CPU default's model and warm start, RL on the rollout function only."""
    cfg = {
        "run_dir": str(out / "run"),
        "envs": [{"name": "revise", "rollout_fn": "experiments.critique_revise:critique_and_revise"},
                 {"name": "echo", "bundled": "echo", "max_concurrent_envs": 64}],
        "data.mix": {"revise": 1.0, "echo": 0.0},
        "sft.envs": ["echo"],
        "rewards": [{"fn": "env"}, {"fn": "env", "name": "answer", "weight": 0.0}],
        "rollout.max_total_tokens": 128,  # answer, feedback and revision (the engine holds 64 + 128 a sequence)
        "checkpoint_every": 50,
        "log.progress": False,
    }
    if toy:
        cfg.update({"steps": 2, "sft.steps": 2, "sft.demonstrations": 8, "sft.batch_size": 8, "eval.episodes": 4,
                    "rollout.groups_per_step": 2, "learner.group_size": 4, "model.dir": str(out / "tiny-model")})
    else:
        cfg.update({"steps": 40, "eval.episodes": 64})
    return cfg


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/experiments/critique_revise")
    parser.add_argument("--toy", action="store_true", help="seconds, not minutes (CI)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    cfg = api.config("configs/tiny_cpu.yaml", settings(out, args.toy))
    summary = api.train(cfg)
    rows = api.read_metrics(cfg.run_dir)
    keys = ["reward/env", "reward/answer", "eval/success", "eval/reward/mean", "kl", "completion/model_tokens"]
    table = api.summary_table(rows, [k for k in keys if any(k in r for r in rows)])
    print(table)
    (out / "summary.md").write_text(f"# critique and revise\n\n```\n{table}\n```\n")
    trained = [r for r in rows if "reward/env" in r]  # not the final evaluation's row
    quarter = max(len(trained) // 4, 1)
    first, last = trained[:quarter], trained[-quarter:]
    result = {"run_dir": cfg.run_dir, "steps": summary["steps"], "plots": str(Path(cfg.run_dir) / "plots"),
              **{f"{k}_{part}": round(sum(r[k] for r in rs) / len(rs), 4)
                 for k in ("reward/env", "reward/answer") for part, rs in (("first_quarter", first),
                                                                            ("last_quarter", last))}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    api.restart_tuned()  # the malloc settings `jaxrl train` runs under: XLA reuses its scratch memory
    main()
