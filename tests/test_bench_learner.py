"""The learner benchmark runs at tiny sizes and prints its figures as a JSON last line."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("train_tokens_per_s", "ratio_vs_torch", "peak_mem_mb", "logp_peak_mem_chunked_mb",
        "logp_peak_mem_unchunked_mb", "logp_mem_ratio_unchunked_vs_chunked", "max_rss_mb")


def test_tiny_benchmark_prints_figures():
    # One CPU device, as the figure is defined (conftest's 8 virtual devices would split the batch).
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    run = subprocess.run(
        [sys.executable, "-m", "experiments.bench.learner", "--tiny"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    for key in KEYS:
        value = figures[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, figures)
    assert figures["logp_peak_mem_chunked_mb"] < figures["logp_peak_mem_unchunked_mb"]
    # Same weights and loss in both frameworks: their first gradients agree.
    assert figures["grad_norm_rel_diff"] < 1e-3
