#!/usr/bin/env bash
# device check 4 (session 29): longctx-bench profile on the GPU (device-plane op times), eva (kernels) and dense
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for m in eva dense:blockwise; do
  T0=$(date +%s)
  timeout 100 python3 -m longctx.bench.cli profile --out $OUT/p_${m%%:*} --noprogress --method $m --length 4k --calls 5 --top 12 > $OUT/p_${m%%:*}.log 2>&1
  echo "profile $m rc=$? in $(( $(date +%s) - T0 )) s"; grep -v "^WARNING" $OUT/p_${m%%:*}.log | head -42
  rm -rf $OUT/p_${m%%:*}/trace
done
