#!/usr/bin/env bash
# Every table and plot of BENCHMARKS.md, on an idle 2-core CPU. The attention step's per-cell cap
# (200 s) lets every method reach forward+backward at 32k where its memory allows, beside the
# torch_sdpa row. Timed 2026-11-25 on a 2-core AMD EPYC VM: 99 minutes (attention 57, decode 4,
# quality 13 incl. a 300-step dense run, train 23, kernels 3). Each attention variant and direction
# runs in a child process; one killed by the out-of-memory killer keeps the rows it finished, and
# `longctx-bench attention --update --methods ...` reruns some variants into the same results.
# Cells that would exceed the memory budget or the per-cell time limit are skipped and say so
# (128k runs only for the methods that fit). Run on an otherwise idle machine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-bench_out}"
# QUALITY_WORKDIR: a dense checkpoint to capture q/k/v from (default: trained here, 300 steps)
BENCH=".venv/bin/longctx-bench"

# 1. attention cores: fwd / fwd+bwd time, XLA memory, peak RSS, GFLOP/s, scaling exponents
$BENCH attention --out "$OUT" --lengths 1k,2k,4k,8k,16k,32k,64k,128k \
  --batch 1 --heads 4 --head_dim 64 --dtype float32 --repeats 3 --warmup 2 \
  --mem_budget_gb 16 --max_cell_s 200 --matmul_n 4096

# 2. decoding: per-token latency and state size at context positions
$BENCH decode --out "$OUT" --positions 1k,8k,32k,128k --batch 1 --heads 4 --head_dim 64 \
  --steps 32 --warmup 3 --prefill_chunk 4096 --mem_budget_gb 16 --max_prefill_s 120

# 3. quality vs exact attention: Gaussian q/k/v and q/k/v of layer 0 of a dense model trained here
$BENCH quality --out "$OUT" --lengths 1k,2k,4k,8k --heads 4 --head_dim 64 --seeds 5 \
  --workdir "${QUALITY_WORKDIR:-$OUT/quality_dense_run}" --train_steps 300 --layer 0

# 4. full-model training: tokens/s, peak memory, validation bits/byte after a fixed number of steps
$BENCH train --out "$OUT" --steps 150 --seq_len 512 --batch_size 8 --eval_tokens 32768

# 5. Pallas kernels against the XLA paths they must match (on a CPU: interpret mode, the
#    differences are the result; on a GPU or TPU run it with --lengths 8k,16k,32k,64k)
$BENCH kernels --out "$OUT" --lengths 256,1k,4k --heads 4 --head_dim 64 --repeats 3 --warmup 1 --max_cell_s 120

# 6. BENCHMARKS.md at the repository root (links the PNGs in $OUT)
$BENCH report --out "$OUT" --output BENCHMARKS.md
