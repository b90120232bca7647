#!/usr/bin/env bash
# Creates .venv (if missing) and installs jaxrl editable with the given extras, e.g. `test`, at the
# exact versions of locks/main.txt (pip constraints: a registry release changes nothing until
# scripts/lock.sh is run on purpose). torch==2.13.0+cpu is the machine's local wheel (pip's find-links).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/pip --disable-pip-version-check)
# openenv-core (0.2 / 0.3, the package's earlier name) installs the same `openenv/` directory as openenv: an
# environment that had it loses both, so that the install below writes `openenv/` alone.
if "${pip[@]}" show -q openenv-core 2>/dev/null; then
  "${pip[@]}" uninstall -q -y openenv-core openenv
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
# An editable install writes jaxrl.egg-info into the tree: one at a time where flock(1) is (scripts/test.sh
# sets up .venv-vllm beside this).
locked=(); command -v flock > /dev/null && locked=(flock .setup.lock)
${locked[@]+"${locked[@]}"} "${pip[@]}" install -q -c locks/main.txt -e "$spec"
if [[ ",$extras," == *",test,"* ]]; then
  # A real openenv-core 0.3.0 server for the wire-compatibility tests (the catalogue's servers pin
  # 0.2.3 / 0.3.0). Its code only, beside the environment's packages rather than among them: tests
  # serve with PYTHONPATH=.venv/openenv-core-0.3.0, its dependencies being openenv's.
  "${pip[@]}" install -q --no-deps --upgrade --target .venv/openenv-core-0.3.0 openenv-core==0.3.0
fi
