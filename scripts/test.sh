#!/usr/bin/env bash
# The test suite (slow tests excluded; run them with: scripts/test.sh -m slow).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_venv.sh
exec .venv/bin/python -m pytest -q "$@"
