#!/usr/bin/env bash
# Creates .venv (if missing) and installs jaxrl editable with the given extras, e.g. `test`.
# torch==2.13.0 (test extra) resolves to the machine's local CPU wheel through pip's find-links.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
[ -x .venv/bin/python ] || python3 -m venv .venv
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/pip install -q --disable-pip-version-check -e "$spec"
