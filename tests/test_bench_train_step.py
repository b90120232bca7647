"""The train-step benchmark runs a few tiny steps and prints the split of a step as JSON."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_benchmark_prints_the_step_split():
    run = subprocess.run([sys.executable, "-m", "experiments.bench.train_step", "--tiny"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    for key in ("step_s", "generate_s", "env_s", "learn_s", "sync_s"):
        assert isinstance(figures[key], float) and math.isfinite(figures[key]) and figures[key] >= 0, key
    assert figures["step_s"] > 0 and figures["steps_measured"] == 2
    assert figures["generate_s"] + figures["env_s"] + figures["learn_s"] + figures["sync_s"] <= figures["step_s"] * 1.01
