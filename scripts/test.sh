#!/usr/bin/env bash
# The test suite (slow tests excluded; run them with: scripts/test.sh -m slow), on one pytest-xdist
# worker per core (at most 4; LONGCTX_TEST_WORKERS=0 runs in one process).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_venv.sh
exec .venv/bin/python -m pytest -q -n "${LONGCTX_TEST_WORKERS:-auto}" --maxprocesses=4 --dist loadgroup "$@"
