#!/usr/bin/env bash
# device check 3 (session 29): eva's and fma's Pallas kernels against their XLA paths on the GPU, one process per
# method with its own time limit; rows kept in kernels.partial.json as they come
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/env.txt
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" 2>&1 | tee -a $OUT/env.txt
for m in ${METHODS:-eva fma}; do
  T0=$(date +%s)
  timeout ${BENCH_S:-150} python3 -m longctx.bench.cli kernels --out $OUT/b_$m --noprogress --causal --methods $m \
    --lengths ${LENGTHS:-4k,16k} --repeats 5 --warmup 2 --max_cell_s 40 >> $OUT/bench_$m.log 2>&1
  echo "bench $m rc=$? in $(( $(date +%s) - T0 )) s"; tail -4 $OUT/bench_$m.log
  cat $OUT/b_$m/kernels.md 2>/dev/null || cat $OUT/b_$m/kernels.partial.json 2>/dev/null | head -c 3000
  rm -f $OUT/b_$m/kernels.png
done
