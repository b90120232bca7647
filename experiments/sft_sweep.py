"""What the supervised warm start reaches on held-out tasks: tiny model size x SFT settings.

For each setting: build a random tiny model, evaluate it on held-out ("test") tasks, warm-start
it on train-split solver demonstrations (`jaxrl.run.warm_start.run_sft`), evaluate again. One JSON line per
setting (before / after success with standard errors, wall times); a table at the end.

    python -m experiments.sft_sweep --env echo --grid "hidden=64,128 steps=200,400 lr=3e-3"

Not a test: it takes minutes per setting on a CPU.

Measured on 2 shared CPU cores (128 held-out tasks, greedy; the random model scores 0 on all):

    env           model (hid/mlp/L/heads)  steps x batch  lr     SFT wall  held-out after
    echo          64/128/2/4               150 x 32       3e-3     27 s    0.27 +- 0.04
    echo          64/128/2/4               200 x 32       3e-3     22 s    0.56 / 0.59 / 0.60 (seeds 0-2)
    echo          64/128/2/4               250 x 32       3e-3     38 s    0.86 +- 0.03
    echo          64/128/2/4               300 x 32       3e-3     30 s    0.84 / 0.81 (seeds 1-2)
    echo          64/128/2/4               400 x 32       3e-3     69 s    0.93 +- 0.02
    echo          64/128/2/4               400 x 32       1e-2     60 s    0.80 +- 0.04
    echo          64/128/2/4               800 x 32       3e-3    122 s    0.95 +- 0.02
    guess_number  64/128/2/4               300 x 8        3e-3    361 s    0.00
    guess_number  64/128/2/2 (1 KV head)   600 x 8        3e-3    379 s    0.02 +- 0.01
    guess_number  128/256/2/4              300 x 8        3e-3    357 s    0.01 +- 0.01
    guess_number  64/128/2/4              1000 x 8        3e-3    844 s    0.23 +- 0.04
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path

from bridge.envs.spec import EnvSpec
from jaxrl.run.config import SFTConfig
from jaxrl.run.warm_start import evaluate, run_sft
from jaxrl.tiny import build_tiny_model

# grid keys and their types; heads / kv_heads / head_dim default to tiny_config's
KEYS = {
    "hidden": int, "intermediate": int, "layers": int, "heads": int, "kv_heads": int, "head_dim": int,
    "steps": int, "batch": int, "lr": float, "demos": int,
}
DEFAULTS = {"hidden": 64, "intermediate": 128, "layers": 2, "steps": 200, "batch": 32, "lr": 3e-3, "demos": 1024}
EVAL_LIMITS = {  # per-turn tokens, turns, episode tokens: room for the solver's episodes
    "echo": (32, 1, 64),
    "guess_number": (48, 10, 1024),
    "wordle": (16, 8, 512),
}


def parse_grid(text: str) -> list[dict]:
    axes = {}
    for item in text.split():
        key, _, values = item.partition("=")
        if key not in KEYS:
            raise SystemExit(f"unknown grid key {key!r}; known: {', '.join(KEYS)}")
        axes[key] = [KEYS[key](v) for v in values.split(",")]
    return [dict(DEFAULTS, **dict(zip(axes, combo))) for combo in itertools.product(*axes.values())]


def run_one(env: str, setting: dict, episodes: int, seed: int, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    overrides = {"hidden_size": setting["hidden"], "intermediate_size": setting["intermediate"],
                 "num_layers": setting["layers"]}
    for key, field in (("heads", "num_heads"), ("kv_heads", "num_kv_heads"), ("head_dim", "head_dim")):
        if key in setting:
            overrides[field] = setting[key]
    base = build_tiny_model(work / "base", seed=seed, **overrides)
    specs = [EnvSpec(env, bundled=env)]
    max_tokens, max_turns, max_total = EVAL_LIMITS[env]
    limits = dict(max_tokens=max_tokens, max_turns=max_turns, max_total_tokens=max_total)
    before = evaluate(base, specs, env, episodes, seed=seed, **limits)
    cfg = SFTConfig(steps=setting["steps"], batch_size=setting["batch"], learning_rate=setting["lr"],
                    demonstrations=setting["demos"])
    sft = run_sft(base, work / "sft", specs, cfg, seed=seed,
                  on_step=lambda s, m: s % 50 == 0 and print(f"  step {s} loss {m['loss']:.3f}", flush=True))
    after = evaluate(work / "sft", specs, env, episodes, seed=seed, **limits)
    return {
        "env": env, **setting,
        "before": before["success_rate"], "before_se": before["success_stderr"],
        "after": after["success_rate"], "after_se": after["success_stderr"],
        "after_reward": after["mean_reward"], "episodes": episodes, "after_turns": after["mean_turns"],
        "after_finish": after["finish_reasons"],
        "loss": sft["loss"], "token_acc": sft["token_accuracy"], "seq_acc": sft["sequence_accuracy"],
        "sft_s": sft["wall_s"], "train_s": sft["train_s"], "eval_s": after["wall_s"],
        "example": after["examples"][0]["completion"][:200],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="echo", choices=sorted(EVAL_LIMITS))
    parser.add_argument("--grid", default="", help='e.g. "hidden=64,128 steps=200 lr=3e-3,1e-2"')
    parser.add_argument("--episodes", type=int, default=128, help="held-out tasks per evaluation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", help="keep the models under this directory (one folder per setting)")
    args = parser.parse_args()
    rows = []
    for i, setting in enumerate(parse_grid(args.grid)):
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(args.keep) / f"{args.env}-{i}" if args.keep else Path(tmp)
            row = run_one(args.env, setting, args.episodes, args.seed, work)
        row["total_s"] = time.perf_counter() - start
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'env':13} {'hid':>4} {'mlp':>4} {'L':>2} {'H':>2} {'steps':>5} {'bs':>3} {'lr':>7} {'demos':>5} "
          f"{'sft_s':>6} {'before':>12} {'after':>12} {'tok_acc':>7}")
    for r in rows:
        print(f"{r['env']:13} {r['hidden']:4} {r['intermediate']:4} {r['layers']:2} {r.get('heads', 4):2} {r['steps']:5} {r['batch']:3} "
              f"{r['lr']:7.1e} {r['demos']:5} {r['sft_s']:6.0f} {r['before']:6.3f}±{r['before_se']:.3f} "
              f"{r['after']:6.3f}±{r['after_se']:.3f} {r['token_acc']:7.3f}")


if __name__ == "__main__":
    main()
