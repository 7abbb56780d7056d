"""dense's unrolled full-pass path (self_blockwise_attention) against the position-general loop (blockwise_attention),
causal fwd+bwd, batch 1, 4 heads of 64, block sizes given; one process, alternating calls, medians; compile times.
Usage: dense_self_blocks.py T REPS 512x256,1024x512"""
import statistics
import sys
import time

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]; sys.path[:0] = [str(ROOT)]
from longctx.host_memory import keep_freed_memory

keep_freed_memory()
import jax
import jax.numpy as jnp

from longctx.attention.dense import blockwise_attention, self_blockwise_attention
from longctx.bench import common as C

T, reps = int(sys.argv[1]), int(sys.argv[2])
pairs = [tuple(map(int, s.split("x"))) for s in sys.argv[3].split(",")]
q, k, v = C.random_qkv(T, 1, 4, T, 64)
w = jax.random.normal(jax.random.key(7), (1, 4, T, 64))
pos, valid = jnp.arange(T), jnp.ones((T,), bool)
fns, ref = {}, None
for bq, bk in pairs:
    for name, f in (("loop", lambda q, k, v, bq=bq, bk=bk: blockwise_attention(q, k, v, pos, pos, valid, causal=True,
                                                                                block_q=bq, block_k=bk)),
                    ("unrolled", lambda q, k, v, bq=bq, bk=bk: self_blockwise_attention(q, k, v, causal=True,
                                                                                       block_q=bq, block_k=bk))):
        g = jax.jit(jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2)))
        t0 = time.perf_counter(); c = g.lower(q, k, v).compile(); ct = time.perf_counter() - t0
        r = c(q, k, v); ref = ref or r
        print(f"{name} {bq}x{bk}: compile {ct:.1f} s, max |grad - first| {max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(r, ref)):.1e}", flush=True)
        fns[f"{name} {bq}x{bk}"] = c
ts = {n: [] for n in fns}
for r in range(reps):
    for n, c in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
        t = time.perf_counter(); jax.block_until_ready(c(q, k, v)); ts[n].append(time.perf_counter() - t)
for n, v_ in ts.items():
    print(n, "median ms", round(1e3 * statistics.median(v_), 1), "min", round(1e3 * min(v_), 1), flush=True)
