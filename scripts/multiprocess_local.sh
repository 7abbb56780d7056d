#!/usr/bin/env bash
# A multi-process training job on this machine through JAX's distributed runtime:
#   scripts/multiprocess_local.sh N [--devices K] [--logdir DIR] -- <longctx-train arguments>
# starts N processes on 127.0.0.1 (a free coordinator port, process ids 0..N-1, K simulated CPU devices
# each, CPU collectives over gloo), each running the same longctx-train command; process i logs to
# DIR/process_<i>.log (default <workdir>/logs). When one exits non-zero the others are stopped.
# Example (2 processes x 4 devices, one mesh of data 2 x fsdp 4):
#   scripts/multiprocess_local.sh 2 --devices 4 -- --config=configs/default.py:tiny \
#     --config.mesh.data=2 --config.mesh.fsdp=4 --workdir=runs/mp
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m longctx.train.launch_local "$@"
