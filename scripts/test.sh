#!/usr/bin/env bash
# Sets up the test environments and runs the whole test suite in two stages: the main suite in
# .venv (extra arguments go to this pytest), then the vLLM engine tests in their own .venv-vllm. The
# documentation site is built with warnings as errors (scripts/docs.sh) beside the main suite.
set -uo pipefail
cd "$(dirname "$0")/.."

# pytest's exit code 5 means it collected no tests: that is a failure too.
run_pytest() {
  "$@"
  local status=$?
  if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: treating that as a failure" >&2
    return 1
  fi
  return "$status"
}

# .venv-vllm is set up beside .venv and the main suite: pip's installs run on one core each (~2.5 min
# apiece on CI's two cores), which then waited one after the other.
vllm_log="$(mktemp)"
docs_log="$(mktemp)"
trap 'rm -f "$vllm_log" "$docs_log"' EXIT
bash scripts/setup_vllm.sh > "$vllm_log" 2>&1 &
vllm_setup=$!

bash scripts/setup.sh test || { wait "$vllm_setup"; exit 1; }  # leaving no install running
# The site needs .venv (its config page is printed by jaxrl) and takes ~30 s the first time (.venv-docs from
# locks/docs.txt, then the build), ~10 s after: beside the main suite, it adds nothing to the wall time.
bash scripts/docs.sh > "$docs_log" 2>&1 &
docs_build=$!
# Three workers on CI's two cores (a test file stays on one, its module fixtures built once, but for the
# few conftest spreads), in conftest's order: most tests wait on processes they start, and two workers
# kept the cores busy only about 1.7 of 2 on average. A worker that crashes is not replaced: xdist 3.8
# then hangs under loadfile (pytest-xdist#784, #1327); without a restart the run ends, naming the test it crashed in.
run_pytest .venv/bin/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder --durations=30 \
  --max-worker-restart=0 --ignore=tests/vllm "$@"
main_status=$?

docs_status=0
if ! wait "$docs_build"; then
  cat "$docs_log" >&2
  echo "scripts/docs.sh failed: the documentation site does not build with warnings as errors (its output above)" >&2
  docs_status=1
else
  echo "scripts/docs.sh: the documentation site built (build/site), no warnings"
fi

if ! wait "$vllm_setup"; then
  cat "$vllm_log" >&2
  echo "scripts/setup_vllm.sh failed (its output above)" >&2
  exit 1
fi
run_pytest .venv-vllm/bin/python -m pytest -q tests/vllm
vllm_status=$?

[ "$main_status" -eq 0 ] || exit "$main_status"
[ "$docs_status" -eq 0 ] || exit "$docs_status"
exit "$vllm_status"
