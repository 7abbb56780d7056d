"""Weight and bias gradients of a [8192,256] x [256,256] linear: forms, timed alone, alternating, medians."""
import sys, pathlib; _R = pathlib.Path(__file__).resolve().parents[2]; sys.path[:0] = [str(_R)]
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages(); keep_freed_memory()
import jax, jax.numpy as jnp, numpy as np, time
from longctx.xla_cpu import transposed
r = np.random.default_rng(0)
x, g1, g2, g3 = (jnp.asarray(r.standard_normal((8192, 256)).astype(np.float32)) for _ in range(4))
fs = {
 "dW autodiff form": lambda x, g1, g2, g3: jnp.einsum("nd,ne->de", x, g1),
 "dW x3 autodiff": lambda x, g1, g2, g3: [jnp.einsum("nd,ne->de", x, g) for g in (g1, g2, g3)],
 "dW x3 xT once": lambda x, g1, g2, g3: (lambda xt: [xt @ g for g in (g1, g2, g3)])(transposed(x)),
 "dW x3 concat": lambda x, g1, g2, g3: transposed(x) @ jnp.concatenate([g1, g2, g3], 1),
 "plain matmul": lambda x, g1, g2, g3: x @ g1[:256],
 "db sum0": lambda x, g1, g2, g3: jnp.sum(g1, 0),
 "db ones dot": lambda x, g1, g2, g3: jnp.ones((8192,), jnp.float32) @ g1,
 "transpose x": lambda x, g1, g2, g3: transposed(x),
}
js = {k: jax.jit(f) for k, f in fs.items()}
for f in js.values():
    for _ in range(3): jax.block_until_ready(f(x, g1, g2, g3))
ts = {k: [] for k in js}
for i in range(25):
    for k, f in js.items():
        t = time.perf_counter(); jax.block_until_ready(f(x, g1, g2, g3)); ts[k].append(time.perf_counter() - t)
for k, v in ts.items(): print(f"{k:18s} {np.median(v)*1e3:.3f} ms")
