#!/usr/bin/env bash
# Creates .venv-trl: TRL's GRPOTrainer on the local CPU torch wheel, apart from .venv, for the peer
# benchmark `python -m experiments.bench.vs_trl`. jaxrl itself is NOT installed there: the TRL side
# imports only experiments/bench/guess_env.py (plain Python) and reads the model as a Hugging Face
# directory. Skips everything when this script did not change since the last successful setup.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-trl
stamp="$venv/.setup-stamp"
key="$(sha256sum scripts/setup_trl.sh | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
rm -f "$stamp"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/pip" --disable-pip-version-check)

# torch must be the local CPU wheel (pip's find-links): the constraint makes pip fail rather than
# fetch a CUDA build (GBs, useless here) when that wheel is missing. transformers is held at the
# main venv's 5.19 so that both sides render the chat template with the same code.
cat > "$venv/constraints.txt" <<'CONSTRAINTS'
torch==2.13.0+cpu
transformers==5.19.*
CONSTRAINTS
"${pip[@]}" install -q -c "$venv/constraints.txt" "trl==1.16.*" "torch==2.13.0" "transformers==5.19.*"

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
