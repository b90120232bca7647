#!/usr/bin/env bash
# Sets up the test environment and runs the whole test suite. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test || exit 1
.venv/bin/python -m pytest -q "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: treating that as a failure" >&2
  exit 1
fi
exit "$status"
