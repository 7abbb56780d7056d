#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv at the repository root)
# and install longctx into it (editable, with the dev extra). Idempotent.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
STAMP=.venv/.longctx-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  # the distribution is named longctx-jax ("longctx" on PyPI is another project): drop an
  # editable install made under the old name first, so that one distribution owns the scripts
  if .venv/bin/python -m pip show --quiet longctx >/dev/null 2>&1; then
    .venv/bin/python -m pip uninstall --quiet --yes longctx
  fi
  .venv/bin/python -m pip install --quiet -e ".[dev]"
  touch "$STAMP"
fi
