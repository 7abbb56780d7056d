#!/usr/bin/env bash
# The main job: train configs/main.py on the built-in corpus (the Python
# standard library's sources, no download), then evaluate on the test split and
# print a sample. Extra arguments go to longctx-train (e.g. --config.train.steps=200).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_venv.sh
WORKDIR="${WORKDIR:-runs/main}"
CONFIG="${CONFIG:-configs/main.py}"
.venv/bin/longctx-train --config="$CONFIG" --workdir="$WORKDIR" "$@"
.venv/bin/longctx-eval --workdir="$WORKDIR" --split=test
.venv/bin/longctx-sample --workdir="$WORKDIR" --prompt="def" --num_tokens=400
