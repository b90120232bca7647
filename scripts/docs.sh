#!/usr/bin/env bash
# Builds the documentation site (mkdocs.yml, docs/) into build/site with warnings as errors: a broken
# link or anchor, a page missing from the nav, an API reference that does not resolve, all fail it.
# Sets up .venv-docs first (MkDocs and its plugins at the exact versions of locks/docs.txt; skipped when
# neither the lock nor this script changed since the last successful setup). The config-key page is
# printed by jaxrl's own environment (.venv, scripts/setup.sh; or $JAXRL_PYTHON): scripts/docs_hooks.py.
#
#   bash scripts/docs.sh [--setup-only] [mkdocs build arguments...]
#   .venv-docs/bin/mkdocs serve          # the site on http://127.0.0.1:8000 while you edit
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-docs
stamp="$venv/.setup-stamp"
key="$(sha256sum locks/docs.txt scripts/requirements.py scripts/docs.sh | sha256sum | cut -d' ' -f1)"
if ! { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ -x "$venv/bin/mkdocs" ]; }; then
  rm -f "$stamp"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  python3 scripts/requirements.py docs > "$venv/requirements.txt"
  "$venv/bin/pip" install -q --disable-pip-version-check -c locks/docs.txt -r "$venv/requirements.txt"
  echo "$key" > "$stamp"
fi
if [ "${1:-}" = --setup-only ]; then
  exit 0
fi
export NO_MKDOCS_2_WARNING=1  # Material's notice of its end of life (2027), printed at every build
exec "$venv/bin/mkdocs" build --strict --site-dir build/site "$@"
