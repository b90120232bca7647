"""The environments benchmark keeps working (tiny sizes; the figures themselves are not asserted)."""

import json
import subprocess
import sys
from pathlib import Path


def test_tiny_envs_benchmark_prints_its_figures():
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench.envs", "--tiny"], cwd=Path(__file__).parents[1],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("env_steps_per_s", "raw_env_steps_per_s", "bridge_over_raw", "fresh_env_steps_per_s",
                "fresh_raw_env_steps_per_s", "fresh_bridge_over_raw", "episodes_per_s",
                "sessions", "episodes", "steps"):
        assert figures[key] > 0, key
