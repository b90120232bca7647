#!/usr/bin/env bash
# Builds .whl/: the wheels that the lent GPU machine (CPython 3.12 x86-64, no network; its packages:
# /work/.library/device/KINDS.md) lacks for `python -m jaxrl.run.cli train` with a bundled OpenEnv
# server, then prints the command that installs them there and runs the GPU bench.
# Run here (PyPI reachable); the run call there must name `.whl` in `carry` (it is git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-path info/exclude)"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"

# Exact pins, one version each (two versions of one name stop the install there). Only what the
# image lacks, plus typing-extensions (below): `--target` + PYTHONPATH would shadow the image's own
# copies (jax, grpcio, protobuf, httpx, anyio, typer, rich, attrs, huggingface-hub... stay theirs).
# The versions are one resolution of `openenv==0.10.0 gin-config submitit tensorboardX` on top of
# the image's packages.
wheels=(
  # jaxrl's own dependencies missing there (tensorboardX: log.tensorboard defaults to true)
  gin-config==0.5.0 submitit==1.5.4 tensorboardX==2.6.5
  # openenv.core.env_server (create_app, Environment, MCP types), served by uvicorn; the bridge
  # talks to it over `websockets`
  openenv==0.10.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 websockets==17.4
  python-multipart==0.0.34 opentelemetry-api==1.45.2
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  # openenv.core.env_server imports its MCP layer at import time: fastmcp (the code is in
  # fastmcp-slim; fastmcp is its metadata-only wrapper) and mcp, with what they import unguarded
  fastmcp==3.4.11 fastmcp-slim==3.4.11 mcp==1.30.0 pydantic-settings==2.16.3 python-dotenv==1.2.4
  py-key-value-aio==0.4.6 beartype==0.23.1 cachetools==8.0.2 platformdirs==4.14.8
  exceptiongroup==1.3.2 httpx-sse==0.4.3 sse-starlette==3.7.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  # The bridge's generated gRPC code checks protobuf >= 7.35.1 (< 8) at import, and the image's
  # protobuf and grpcio versions are unread: ours go in front of theirs (nothing else we import uses them).
  protobuf==7.36.2 grpcio==1.85.3
  # A shadowed copy: pydantic 2.14 imports `typing_extensions.sentinel` (>= 4.16.0; with 4.15
  # `import pydantic` fails) and the image's version is unread. typing_extensions only ever adds,
  # so a newer copy in front of the image's is safe for jax/torch/flax.
  typing-extensions==4.16.0
)
# Left out on purpose (declared by openenv/fastmcp/mcp, but never imported on the train path:
# trainer, bridge and `bridge env serve` processes traced with an import audit hook): gradio +
# gradio-client (~31 MiB, only openenv's web UI), openai, pyjwt/cryptography/authlib (MCP auth),
# cyclopts/keyring/griffe (fastmcp CLI), tomli/tomli-w (openenv CLI), email-validator, and the
# optional accelerators uvicorn/httpx/fastapi try to import (watchfiles, brotli, orjson, sniffio);
# also fastmcp's server extra (`from fastmcp import FastMCP`: MCP servers such as OpenEnv's echo_env,
# not jaxrl's bundled environments). Unchecked floors on the image's own copies: anyio>=4.7,
# rich>=13.9.4, httpx>=0.28.1.

rm -rf .whl
"${PYTHON:-python3}" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d .whl "${wheels[@]}"

n=$(ls .whl/*.whl | wc -l)
[ "$n" -eq "${#wheels[@]}" ] || { echo "expected ${#wheels[@]} wheels, got $n" >&2; exit 1; }
# The run call sends the working tree (tracked + untracked-unignored) plus carried paths: 64 MiB in all.
whl_kib=$(du -sk .whl | cut -f1)
tree_kib=$(git ls-files -z -co --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "wheels: $n, $((whl_kib / 1024)) MiB; working tree: $((tree_kib / 1024)) MiB"
[ $((whl_kib + tree_kib)) -lt $((55 * 1024)) ] || { echo "over 55 MiB: too large to carry" >&2; exit 1; }

# jaxrl is not installed there (no `jaxrl` script): PYTHONPATH=$PWD imports it from the repo root.
echo "On the GPU machine (run with carry=[\".whl\"]):"
echo 'python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && python3 -m experiments.bench.gpu'
