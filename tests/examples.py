"""An example experiment run at its toy size (`--toy`), as CI runs them: the JSON it prints last."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def toy_result(example: str, out: Path, *args: str, timeout: float = 300) -> dict:
    """`python -m experiments.EXAMPLE --toy --out OUT ARGS` from the repository root (where the bridge
    imports rollout functions from), its last stdout line."""
    proc = subprocess.run([sys.executable, "-m", f"experiments.{example}", "--toy", "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
