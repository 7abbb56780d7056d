#!/usr/bin/env bash
# Regenerate every file in results/ and then BENCHMARKS.md (`longctx-bench report`). Run on an otherwise
# idle machine; on a 2-core CPU the whole script takes hours (the attention sweep and the recall models
# dominate). Each step writes one folder of results/ and can be run alone:
#
#   bash scripts/bench_all.sh                          # every step
#   STEPS="attention_8k_32k report" bash scripts/bench_all.sh
#
# Steps that need something optional say so and are skipped: the peer comparisons need torch and einops
# (pip install torch einops) and checkouts of the authors' releases ($EVA_RELEASE_REPO, $TVQ_RELEASE_REPO,
# $TVQ_RELEASE_PYTHON: see scripts/peer_*_release.py); kernels_gpu needs a GPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-results}"
PY="${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}"
BENCH=("$PY" -m longctx.bench.cli)
STEPS="${STEPS:-attention attention_8k_32k decode quality train precision packing kernels kernels_gpu peers recall compare report}"

# attention cores: fwd / fwd+bwd time, XLA memory, peak RSS, GFLOP/s, scaling exponents, every method, 1k-128k
# (cells over the memory budget or the per-cell time cap are skipped and say so)
attention() {
  "${BENCH[@]}" attention --out "$OUT" --lengths 1k,2k,4k,8k,16k,32k,64k,128k \
    --batch 1 --heads 4 --head_dim 64 --dtype float32 --repeats 3 --warmup 2 \
    --mem_budget_gb 16 --max_cell_s 200 --matmul_n 4096
}
# the fastest exact and efficient cores beside PyTorch's SDPA in one run (the summary's newest rows)
attention_8k_32k() {
  "${BENCH[@]}" attention --out "$OUT/attention_8k_32k" --methods dense:blockwise,transformer_vq,eva,torch_sdpa \
    --lengths 8k,16k,32k --causal --batch 1 --heads 4 --head_dim 64 --repeats 5 --warmup 2 --max_cell_s 300 \
    --matmul_n 0
}
# decoding: per-token latency and state size at context positions
decode() {
  "${BENCH[@]}" decode --out "$OUT" --positions 1k,8k,32k,128k --batch 1 --heads 4 --head_dim 64 \
    --steps 32 --warmup 3 --prefill_chunk 4096 --mem_budget_gb 16 --max_prefill_s 120
}
# quality vs exact attention: Gaussian q/k/v and q/k/v of layer 0 of a dense model (trained once into
# runs/bench_quality, reused when it holds a checkpoint)
quality() {
  "${BENCH[@]}" quality --out "$OUT" --lengths 1k,2k,4k,8k --heads 4 --head_dim 64 --seeds 5 \
    --workdir "${QUALITY_WORKDIR:-runs/bench_quality}" --train_steps 300 --layer 0
}
# full-model training: tokens/s, peak memory, validation bits/byte after a fixed number of steps
train() {
  "${BENCH[@]}" train --out "$OUT" --runs runs/bench_train --steps 150 --eval_tokens 32768 \
    --config.train.seq_len=512 --config.train.batch_size=8
}
# bf16 against fp32: every built-in config (its own rows, batch and schedule) trained 300 steps in each dtype
precision() {
  for dt in float32 bfloat16; do
    "${BENCH[@]}" train --out "$OUT/precision/$dt" --runs "runs/bench_precision/$dt" --steps 300 --eval_tokens 32768 \
      --noxla_mem --config.model.dtype=$dt
  done
  # more seeds for the methods named here (those whose seed-0 difference is past the tolerance)
  for seed in 1 2; do for dt in float32 bfloat16; do
    "${BENCH[@]}" train --out "$OUT/precision/seed$seed/$dt" --runs "runs/bench_precision/seed$seed/$dt" --steps 300 \
      --eval_tokens 32768 --noxla_mem --methods "${PRECISION_SEED_METHODS:-fma_linear}" --config.model.dtype=$dt \
      --config.train.seed=$seed
  done; done
}
# short documents: data.packing='segments' against 'document', dense, same model and updates (scripts/packing_bench.py)
packing() {
  "$PY" scripts/packing_bench.py --corpus runs/packing/corpus --runs runs/packing --out "$OUT/packing" --overwrite
}
# Pallas kernels against the XLA paths they must match (on a CPU: interpret mode, the differences are the result)
kernels() {
  "${BENCH[@]}" kernels --out "$OUT" --lengths 256,1k,4k --heads 4 --head_dim 64 --repeats 3 --warmup 1 --max_cell_s 120
}
# the same kernels compiled on a GPU
kernels_gpu() {
  if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
    echo "kernels_gpu: no GPU, skipped"; return 0
  fi
  "${BENCH[@]}" kernels --out "$OUT/kernels_gpu/eva" --methods eva --lengths 1k,4k --causal --repeats 5 --warmup 2
  "${BENCH[@]}" kernels --out "$OUT/kernels_gpu/fma" --methods fma --lengths 4k,16k --causal --repeats 5 --warmup 2
  "${BENCH[@]}" kernels --out "$OUT/kernels_gpu/transformer_vq" --methods transformer_vq --lengths 4k,16k --causal \
    --repeats 3 --warmup 1
}
# ours against the authors' releases (EVA: PyTorch layer and core; Transformer-VQ: JAX training step)
peers() {
  if [ -n "${EVA_RELEASE_REPO:-}" ] && "$PY" -c 'import torch, einops' 2>/dev/null; then
    "$PY" scripts/peer_eva_release.py --lengths 8k,16k --repeats 9 --warmup 2 --out "$OUT/peer_eva"
    "$PY" scripts/peer_eva_release.py --lengths 8k,16k --repeats 9 --warmup 2 --no_proj --out "$OUT/peer_eva_core"
  else
    echo "peer_eva: needs torch, einops and EVA_RELEASE_REPO, skipped"
  fi
  if [ -n "${TVQ_RELEASE_REPO:-}" ] && [ -x "${TVQ_RELEASE_PYTHON:-/tmp/tvqrel/bin/python}" ]; then
    "$PY" scripts/peer_tvq_release.py --lengths 1k,4k,16k --repeats 5 --warmup 2 --out "$OUT/peer_tvq" \
      --release_python "${TVQ_RELEASE_PYTHON:-/tmp/tvqrel/bin/python}"
  else
    echo "peer_tvq: needs TVQ_RELEASE_REPO and the release's Python (TVQ_RELEASE_PYTHON), skipped"
  fi
}
# recall by distance: every causal method trained on the same associative-recall task
recall() {
  OUT="$OUT/recall" PY="$PY" bash scripts/recall_all.sh
}
# which method to use: every causal method at equal training FLOPs, 2 contexts x 3 seeds + hybrids (about 3 h on a
# 2-core CPU; resumable: a rerun trains only the runs without a result; `--plan` prints the runs and estimate)
compare() {
  "${BENCH[@]}" compare --out "$OUT/compare" ${COMPARE_ARGS:-}
}
# BENCHMARKS.md from results/ (keeps its hand-written "How to read this")
report() {
  "${BENCH[@]}" report --out "$OUT" --output BENCHMARKS.md
}

for step in $STEPS; do
  echo "== $step"
  "$step"
done
