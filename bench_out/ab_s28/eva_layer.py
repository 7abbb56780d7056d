"""Time our EVA peer layer (projections + core) fwd+bwd at T, medians; env XLA_FLAGS applies. Prints JSON."""
import json
import os
import statistics
import sys
import time

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
from longctx.host_memory import keep_freed_memory

keep_freed_memory()
import jax
import peer_eva_release as P

T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 9
proj = os.environ.get("NOPROJ") is None
params, f_fwd, f_grad = P.our_layer(256, 4, 128, 8, proj=proj)
x = jax.random.normal(jax.random.key(1), (1, T, 256)); w = jax.random.normal(jax.random.key(2), (1, T, 256))
jax.block_until_ready(f_grad(params, x, w)); jax.block_until_ready(f_grad(params, x, w))
ts = []
for _ in range(reps):
    t = time.perf_counter(); jax.block_until_ready(f_grad(params, x, w)); ts.append(time.perf_counter() - t)
print(json.dumps({"T": T, "flags": os.environ.get("XLA_FLAGS", ""), "median_ms": round(1e3 * statistics.median(ts), 1),
                  "min_ms": round(1e3 * min(ts), 1), "all": [round(1e3 * t, 1) for t in ts]}))
