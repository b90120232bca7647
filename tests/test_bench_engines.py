"""The engines benchmark keeps working (tiny sizes; the figures themselves are not asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_tiny_engines_benchmark_prints_its_figures():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench.engines", "--tiny"], cwd=Path(__file__).parents[1],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("jax_tok_s", "jax_bridge_tok_s", "bridge_over_inproc", "hf_generate_tok_s"):
        assert figures[key] > 0, key
    assert "vllm_cpu_tok_s" in figures
