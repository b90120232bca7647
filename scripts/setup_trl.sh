#!/usr/bin/env bash
# Creates .venv-trl: TRL's GRPOTrainer at the versions of locks/trl.txt, apart from .venv, for the peer
# benchmark `python -m experiments.bench.vs_trl`. jaxrl itself is NOT installed there: the TRL side
# imports only experiments/bench/guess_env.py (plain Python) and reads the model as a Hugging Face
# directory. Skips everything when neither the lock nor this script changed since the last successful setup.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-trl
stamp="$venv/.setup-stamp"
key="$(sha256sum locks/trl.txt scripts/requirements.py scripts/setup_trl.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
rm -f "$stamp"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/pip" --disable-pip-version-check)

# At the exact versions of locks/trl.txt (scripts/requirements.py trl asks for TRL 1.16 with transformers at the
# main venv's minor, so that both sides render the chat template with the same code). The lock pins
# torch==2.13.0+cpu, the local CPU wheel: pip fails rather than fetch a CUDA build when that wheel is missing.
"$venv/bin/python" scripts/requirements.py trl > "$venv/requirements.txt"
"${pip[@]}" install -q -c locks/trl.txt -r "$venv/requirements.txt"

"$venv/bin/python" - <<'PY'
import sys
import torch
if not torch.__version__.endswith("+cpu"):
    sys.exit(f"setup_trl: torch {torch.__version__} is installed, not a +cpu build")
import trl
from trl import GRPOConfig, GRPOTrainer  # noqa: F401  (fails here rather than in the bench)
print(f"setup_trl: trl {trl.__version__}, torch {torch.__version__}")
PY
echo "$key" > "$stamp"
