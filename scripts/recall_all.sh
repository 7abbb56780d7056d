#!/usr/bin/env bash
# The recall benchmark: train every registered causal attention method on the same
# associative-recall task (configs/recall/<method>.py: rows of 1,024 tokens, same parameter count,
# steps and schedule), score each with longctx-recall (accuracy and answer loss by distance), and
# write one markdown table and one plot into $OUT (the report's inputs; per-run outputs and logs stay
# under $RUNS). Sized for ~30 minutes on an idle 2-core CPU.
#
#   scripts/recall_all.sh                      # -> results/recall/{recall.md,recall.png,recall.json}
#   OUT=/tmp/r RUNS=/tmp/runs scripts/recall_all.sh
#   LM_RUNS="runs/default runs/eva" scripts/recall_all.sh   # + zero-shot passkey probe of text LMs
#   ONLY="hybrid_eva hybrid_fma" scripts/recall_all.sh      # these runs only, merged into $OUT's table
#   NEEDLE="dense swa fma" (the default): these runs also get a needle grid in $OUT/needle/<method>/
#   VARIANT=:tiny LENGTH=64 OUT=/tmp/r RUNS=/tmp/runs ONLY=dense NEEDLE= scripts/recall_all.sh
#                                              # a half-minute smoke run of the pipeline: each config's :tiny
#                                              # variant (rows of 64), the table at that length; TRAIN_ARGS="..."
#                                              # adds longctx-train flags, e.g. --config.train.steps=20
#
# The methods come from the registry (longctx.attention.names(), those with a causal form); a
# method without configs/recall/<method>.py is reported and skipped. Then every hybrid stack found
# as configs/recall/hybrid_<method>.py (layer 1 exact, layer 2 the method) is a row hybrid_<method>.
# With ONLY set, just those names run and the report keeps $OUT/recall.json's other rows (--merge).
# Re-running resumes finished or interrupted runs from their checkpoints (a finished run is only
# re-scored).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-.venv/bin/python}"
OUT="${OUT:-results/recall}"
RUNS="${RUNS:-runs/recall}"
NEEDLE="${NEEDLE-dense swa fma}"
VARIANT="${VARIANT:-}"
read -r -a TRAIN_ARGS <<< "${TRAIN_ARGS:-}"
mkdir -p "$OUT" "$RUNS"
# the console scripts, without needing them installed (pip install -e . adds longctx-recall*)
train() { "$PY" -c 'import sys; from longctx.cli import train_main; sys.exit(train_main())' "$@"; }
recall() { "$PY" -c 'import sys; from longctx.cli import recall_main; sys.exit(recall_main())' "$@"; }
report() { "$PY" -c 'import sys; from longctx.cli import recall_report_main; sys.exit(recall_report_main())' "$@"; }

METHODS=$("$PY" -c 'from longctx import attention
print(" ".join(n for n in attention.names() if attention.get_class(n).supports_causal))')
HYBRIDS=$(for f in configs/recall/hybrid_*.py; do [ -f "$f" ] && basename "$f" .py; done)
MERGE=()
if [ -n "${ONLY:-}" ]; then
  METHODS="$ONLY"
  HYBRIDS=""
  [ -f "$OUT/recall.json" ] && MERGE=(--merge)  # (a first table: nothing to merge into)
fi
T0=$(date +%s)
done_runs=()
for m in $METHODS $HYBRIDS; do
  cfg="configs/recall/$m.py"
  if [ ! -f "$cfg" ]; then
    echo "== $m: no $cfg, skipped" | tee -a "$RUNS/skipped.txt"
    continue
  fi
  wd="$RUNS/$m"
  mkdir -p "$wd"
  echo "== $m: training ($cfg)"
  t=$(date +%s)
  train --config="$cfg$VARIANT" --workdir="$wd" --noprogress ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"} 2>&1 | tee "$wd/train.log" | grep -E "^(model|done|error)" || true
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "training $m failed; see $wd/train.log"; continue; }
  echo "$(( $(date +%s) - t )) seconds (wall, this invocation)" > "$wd/recall_train_seconds.txt"
  echo "== $m: scoring"
  recall --workdir="$wd" --noprogress | tee "$wd/recall.log"
  if [[ " $NEEDLE " == *" $m "* ]]; then  # the needle grid: accuracy by row length x depth of the needle
    recall --workdir="$wd" --lengths=256,512,1024 --bins=4 --noprogress --out="$OUT/needle/$m" | tee -a "$wd/recall.log"
  fi
  done_runs+=("$wd")
done
runs=$(IFS=,; echo "${done_runs[*]}")
report --runs="$runs" --out="$OUT" --task=mqar --length="${LENGTH:-1024}" "${MERGE[@]}" \
  --title="Associative recall (fused-pair MQAR) at $(echo "${LENGTH:-1024}" | sed ':a;s/\B[0-9]\{3\}\>/,&/;ta') tokens, by distance"

# optional: zero-shot passkey probe of language models trained on text, at 1x, 2x and 4x their
# training length (a method whose state cannot hold the row is reported as 'capacity')
if [ -n "${LM_RUNS:-}" ]; then
  for lm in $LM_RUNS; do
    seq=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['train']['seq_len'])" "$lm/config.json")
    name=$(basename "$lm")
    for mult in 1 2 4; do
      recall --workdir="$lm" --task=passkey --length=$(( seq * mult )) --rows=64 --bins=4 --noprogress \
        --out="$RUNS/passkey_$name" | tee -a "$RUNS/passkey_$name.log"
    done
    dirs="${dirs:+$dirs,}$RUNS/passkey_$name"
  done
  # one table per length multiple (assumes the LMs share their training length)
  for mult in 1 2 4; do
    report --runs="$dirs" --task=passkey --length=$(( seq * mult )) --out="$OUT/passkey_x$mult" \
      --title="Zero-shot passkey probe of text LMs, rows of $(( seq * mult )) tokens (${mult}x training)"
  done
fi
echo "total wall time: $(( $(date +%s) - T0 )) s"
