#!/usr/bin/env bash
# Upgrades the locks on purpose: resolves each environment's ranges afresh (pyproject.toml through
# scripts/requirements.py) in a scratch venv, writes the exact versions to locks/<name>.txt, sets the
# environments up from the new locks, regenerates the gRPC stubs, and runs what checks them: the test
# suite for main and vllm, the TRL bench at smoke size for trl, the site's strict build for docs. Commit
# the locks (and stubs) it leaves.
#
#   bash scripts/lock.sh [--no-test] [main] [vllm] [trl] [docs]     (no name: all four)
#
# Everyone else installs from the locks (scripts/setup*.sh, CI): a registry release changes nothing
# until this script is run and its result committed.
set -euo pipefail
cd "$(dirname "$0")/.."
names=()
run_tests=1
for arg in "$@"; do
  case "$arg" in
    --no-test) run_tests=0 ;;
    main | vllm | trl | docs) names+=("$arg") ;;
    *) echo "usage: bash scripts/lock.sh [--no-test] [main] [vllm] [trl] [docs]" >&2; exit 2 ;;
  esac
done
[ ${#names[@]} -gt 0 ] || names=(main vllm trl docs)

mkdir -p build locks
for name in "${names[@]}"; do
  scratch="build/lock-$name"
  rm -rf "$scratch"
  python3 -m venv "$scratch"
  python3 scripts/requirements.py "$name" > "$scratch/requirements.txt"
  # torch stays the machine's local CPU wheel (pip's find-links): a range it does not pin would fetch
  # a CUDA build of several GB.
  echo "torch==2.13.0+cpu" > "$scratch/torch.txt"
  echo "lock.sh: resolving $name" >&2
  "$scratch/bin/pip" install -q --disable-pip-version-check -c "$scratch/torch.txt" -r "$scratch/requirements.txt"
  {
    echo "# The exact versions of the '$name' environment (scripts/requirements.py $name), installed"
    echo "# as pip constraints by scripts/setup*.sh. Resolved by scripts/lock.sh on $(date -u +%F) with"
    echo "# Python $("$scratch/bin/python" -c 'import platform; print(platform.python_version(), platform.machine())'). Do not edit: rerun scripts/lock.sh."
    "$scratch/bin/pip" freeze --disable-pip-version-check
  } > "locks/$name.txt"
  rm -rf "$scratch"
done
git --no-pager diff --stat -- locks || true

[ "$run_tests" -eq 1 ] || exit 0
for name in "${names[@]}"; do
  if [ "$name" = main ]; then
    bash scripts/setup.sh test
    bash scripts/gen_proto.sh  # the stubs are what the locked grpcio-tools generates
  fi
done
if [[ " ${names[*]} " == *" main "* || " ${names[*]} " == *" vllm "* ]]; then
  bash scripts/test.sh
fi
if [[ " ${names[*]} " == *" trl "* ]]; then
  bash scripts/setup_trl.sh
  .venv/bin/python -m experiments.bench.vs_trl --tiny
fi
if [[ " ${names[*]} " == *" docs "* ]]; then
  bash scripts/docs.sh
fi
