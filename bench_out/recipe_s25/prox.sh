#!/usr/bin/env bash
# usage: bash prox.sh NAME STEPS [overrides...]: trains configs/main.py for STEPS updates (a whole cosine schedule)
# in runs/recipe/NAME, validates once at the end, prints the wall time, median training tokens/s and the
# validation bits per byte (session 25's recipe check, results.md).
set -u
NAME=$1; STEPS=$2; shift 2
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
rm -rf "runs/recipe/$NAME"; mkdir -p runs/recipe
t0=$(date +%s)
.venv/bin/longctx-train --config=configs/main.py --workdir="runs/recipe/$NAME" --noprogress \
  --config.train.steps="$STEPS" --config.train.eval_every="$STEPS" --config.train.ckpt_every=100000 "$@" \
  > "runs/recipe/$NAME.log" 2>&1 || { echo "$NAME failed: runs/recipe/$NAME.log"; exit 1; }
t1=$(date +%s)
.venv/bin/python - "runs/recipe/$NAME" "$NAME" $((t1 - t0)) <<'PY'
import json, statistics, sys
folder, name, wall = sys.argv[1:]
rows = [json.loads(line) for line in open(f"{folder}/metrics.jsonl")]
tok = statistics.median(r["tokens_per_sec"] for r in rows if r.get("split") == "train" and "tokens_per_sec" in r)
val = [r for r in rows if r.get("split") == "valid"][-1]
print(f"{name} wall {wall} s tok/s med {tok:.0f} valid step {val['step']} bits/byte {val['bits_per_token']:.4f}")
PY
