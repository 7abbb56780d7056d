"""dense:blockwise causal fwd+bwd at T for several (block_q, block_k), one process, alternating; medians."""
import statistics
import sys
import time

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path[:0] = [str(ROOT)]
from longctx.host_memory import keep_freed_memory

keep_freed_memory()
import jax
import jax.numpy as jnp

from longctx.bench import common as C
from longctx.bench.cores import CoreFns, build_core

T = int(sys.argv[1]); reps = int(sys.argv[2]); pairs = [tuple(map(int, s.split("x"))) for s in sys.argv[3].split(",")]
q, k, v = C.random_qkv(T, 1, 4, T, 64)
w = jax.random.normal(jax.random.key(7), (1, 4, T, 64)); key = jax.random.key(11)
fns = {}
for bq, bk in pairs:
    core = build_core("dense", {"impl": "blockwise", "block_q": bq, "block_k": bk}, heads=4, head_dim=64, causal=True)
    f = CoreFns(core)
    c = jax.jit(f.grads()).lower(f.params, f.rest, q, k, v, w, key).compile()
    fns[(bq, bk)] = (c, (f.params, f.rest, q, k, v, w, key))
    jax.block_until_ready(c(*fns[(bq, bk)][1]))
ts = {p: [] for p in fns}
for r in range(reps):
    for p, (c, a) in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
        t = time.perf_counter(); jax.block_until_ready(c(*a)); ts[p].append(time.perf_counter() - t)
for p, v_ in ts.items():
    print(p, "median ms", round(1e3 * statistics.median(v_), 1), "min", round(1e3 * min(v_), 1), flush=True)
