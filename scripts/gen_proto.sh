#!/usr/bin/env bash
# Regenerates bridge/proto stubs (committed; tests/test_proto.py fails when they are stale).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
.venv/bin/python -m grpc_tools.protoc -I. --python_out="$out" --grpc_python_out="$out" bridge/proto/bridge.proto
