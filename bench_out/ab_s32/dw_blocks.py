"""dW = xᵀ g over [8192, 256] x [8192, 256]: autodiff's row-contracting dot against blocked forms (alternating)."""
import sys, pathlib; _R = pathlib.Path(__file__).resolve().parents[2]; sys.path[:0] = [str(_R)]
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages(); keep_freed_memory()
import jax, jax.numpy as jnp, numpy as np, time
from longctx.xla_cpu import transposed
r = np.random.default_rng(0)
x, g = (jnp.asarray(r.standard_normal((8192, 256)).astype(np.float32)) for _ in range(2))
HI = jax.lax.Precision.HIGHEST

def blocked(nb, loop):
    def f(x, g):
        xb, gb = x.reshape(nb, -1, 256), g.reshape(nb, -1, 256)
        if loop:
            return jax.lax.fori_loop(0, nb, lambda i, acc: acc + transposed(xb[i]) @ gb[i], jnp.zeros((256, 256)))
        acc = 0.0
        for i in range(nb):
            acc = acc + transposed(xb[i]) @ gb[i]
        return acc
    return f
fs = {"autodiff": lambda x, g: jnp.einsum("nd,ne->de", x, g),
      "xT whole": lambda x, g: transposed(x) @ g,
      "batched xT": lambda x, g: jnp.einsum("bdn,bne->de", transposed(x.reshape(16, 512, 256)), g.reshape(16, 512, 256)),
      "unrolled 16": blocked(16, False), "loop 16": blocked(16, True), "unrolled 8": blocked(8, False),
      "loop 32": blocked(32, True)}
js = {k: jax.jit(f) for k, f in fs.items()}
ref = js["autodiff"](x, g)
for k, f in js.items():
    print(k, float(jnp.max(jnp.abs(f(x, g) - ref))))
    for _ in range(3): jax.block_until_ready(f(x, g))
ts = {k: [] for k in js}
for i in range(30):
    for k, f in (js.items() if i % 2 == 0 else reversed(list(js.items()))):
        t = time.perf_counter(); jax.block_until_ready(f(x, g)); ts[k].append(time.perf_counter() - t)
for k, v in ts.items(): print(f"{k:12s} {np.median(v)*1e3:.3f} ms")
