"""The snapshot benchmark runs at a tiny size and prints its figures as a JSON last line."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("round_trip_ratio", "round_trip_warm_ratio", "publish_s", "load_s", "publish_ratio", "load_ratio",
        "publish_same_work_ratio", "load_warm_s", "load_warm_ratio", "numpy_save_s", "numpy_publish_s",
        "numpy_load_s", "numpy_load_warm_s", "convert_s", "checksum_s", "size_mb")


def test_tiny_benchmark_prints_figures(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "experiments.bench.snapshots", "--tiny", "--dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    for key in KEYS:
        value = figures[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, figures)
    assert figures["size_mb"] >= 4 and figures["repeats"] == 2
    assert list(tmp_path.iterdir()) == []  # it cleans up after itself
