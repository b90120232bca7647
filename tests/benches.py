"""A benchmark run at its smoke size (`--tiny`), as the bench tests run them: the figures it prints
as its last line."""

import json
import os
import subprocess
import sys
from pathlib import Path

from xla_flags import xla_flags

ROOT = Path(__file__).parents[1]


def tiny_figures(bench: str, *args: str, timeout: float = 300, one_device: bool = False) -> dict:
    """`python -m experiments.bench.BENCH --tiny ARGS`'s last JSON line; `one_device`: one CPU
    device, as some figures are defined (conftest's virtual devices would split the batch)."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)} if one_device else None
    proc = subprocess.run([sys.executable, "-m", f"experiments.bench.{bench}", "--tiny", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
