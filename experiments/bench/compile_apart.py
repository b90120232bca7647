"""A learner step after its process compiled the programs, against one that had a child compile them.

    python -m experiments.bench.compile_apart [--tiny] [--steps 30] [--widths 4]

Three processes in turn, each under the malloc settings `jaxrl train` runs with (jaxrl/host_memory.py),
build vs_trl's 1 x 8 learner (its tiny Qwen3 shape, eight completions of one ~54-token prompt, a run's
`learner.prompt_widths` compiled side by side at the first step) and time its steps:
  here     compiles every program itself (`jaxrl.compilation.APART_MIN_BYTES` out of reach), fresh cache
  apart    as a run does: a child compiles each program into a fresh persistent cache, this one loads it
  loaded   loads `apart`'s cache, as a second run of a config does

Figures (last line, JSON): per process `compile_s` (the first step, its compiles included), `step_s`
(median of the rest), `max_rss_mb`; `here_over_apart_step` above 1 is what compiling apart saves
a step; `apart_over_loaded_step` near 1 means a first run steps as fast as a second.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOAD = dict(vocab=1000, hidden=128, intermediate=256, layers=4, heads=4, kv_heads=2, rows=8, prompt=54,
                completion=128, max_prompt_tokens=512)
TINY = dict(vocab=256, hidden=32, intermediate=64, layers=1, heads=2, kv_heads=1, rows=4, prompt=20,
            completion=16, max_prompt_tokens=256)


def measure(mode: str, cache: str, steps: int, widths: int, sizes: dict) -> dict:
    """One process's figures (see the module docstring)."""
    from jaxrl.host_memory import restart_tuned

    restart_tuned()
    import numpy as np
    from flax import nnx

    import jaxrl.compilation as compilation
    from jaxrl.learner import Learner, prompt_widths
    from jaxrl.losses import LossConfig
    from jaxrl.models import Decoder
    from jaxrl.sharding import MeshConfig, make_mesh
    from jaxrl.tiny import tiny_config
    from jaxrl.train_step import LearnerConfig

    if mode == "here":
        compilation.APART_MIN_BYTES = 1 << 62
    compilation.use_persistent_cache(cache)
    s = sizes
    model_cfg = tiny_config("qwen3", vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                            num_layers=s["layers"], num_heads=s["heads"], head_dim=32, num_kv_heads=s["kv_heads"])
    widths_P = prompt_widths(s["max_prompt_tokens"], widths)
    B, P, C = s["rows"], widths_P[0], s["completion"]
    rng = np.random.default_rng(0)
    prompt_mask = (np.arange(P) >= P - s["prompt"]).astype(np.int32)[None].repeat(B, 0)
    completion_mask = (np.arange(C)[None] < rng.integers(C // 2, C + 1, B)[:, None]).astype(np.int32)
    batch = {"prompt_BxP": rng.integers(1, s["vocab"], P)[None].repeat(B, 0) * prompt_mask,  # one prompt, 8 rows
             "prompt_mask_BxP": prompt_mask,
             "completion_BxC": rng.integers(1, s["vocab"], (B, C)) * completion_mask,
             "completion_mask_BxC": completion_mask, "loss_mask_BxC": completion_mask,
             "rewards_BxR": rng.random((B, 1)).astype(np.float32)}
    cfg = LearnerConfig(group_size=B, loss=LossConfig(loss_type="dapo", beta=0.0))
    learner = Learner(Decoder(model_cfg, nnx.Rngs(0)), cfg, make_mesh(MeshConfig()), widths_P)
    start = time.perf_counter()
    learner.update(batch)
    compile_s = time.perf_counter() - start
    step_s = [learner.update(batch)["step_s"] for _ in range(steps)]
    return {"compile_s": compile_s, "step_s": statistics.median(step_s[1:]), "compiles": compilation.compiles(),
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="toy sizes (the CI check)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per process (default 30; --tiny 3)")
    p.add_argument("--widths", type=int, default=4, help="learner.prompt_widths (a run's default: 4)")
    p.add_argument("--part", choices=["here", "apart", "loaded"], help=argparse.SUPPRESS)  # one process's share
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes, steps = (TINY, args.steps or 3) if args.tiny else (WORKLOAD, args.steps or 30)
    if args.part:
        figures = measure(args.part, args.cache, steps, args.widths, sizes)
        print(json.dumps(figures), flush=True)
        return figures

    results = {}
    with tempfile.TemporaryDirectory() as here_cache, tempfile.TemporaryDirectory() as apart_cache:
        for part, cache in (("here", here_cache), ("apart", apart_cache), ("loaded", apart_cache)):
            cmd = [sys.executable, "-m", "experiments.bench.compile_apart", "--part", part, "--cache", cache,
                   "--steps", str(steps), "--widths", str(args.widths)] + ["--tiny"] * args.tiny
            env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}  # each process tunes itself
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if done.returncode:
                raise SystemExit(f"the {part} process failed: {done.stderr.strip().splitlines()[-1:]}")
            results[part] = json.loads(done.stdout.strip().splitlines()[-1])
            print(part, json.dumps(results[part]), flush=True)
    figures = {f"{part}_{key}": round(value, 4) for part, r in results.items() for key, value in r.items()}
    figures["here_over_apart_step"] = round(results["here"]["step_s"] / results["apart"]["step_s"], 3)
    figures["apart_over_loaded_step"] = round(results["apart"]["step_s"] / results["loaded"]["step_s"], 3)
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
