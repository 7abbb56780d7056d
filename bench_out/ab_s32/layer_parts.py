"""Where the peer layer's time goes beyond the core: core deterministic / training path, the no-projection layer
(heads transposes), the full layer; fwd+bwd at 8k, alternating, medians."""
import sys, pathlib; _R = pathlib.Path(__file__).resolve().parents[2]; sys.path[:0] = [str(_R), str(_R / "scripts")]
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages(); keep_freed_memory()
import jax, jax.numpy as jnp, numpy as np, time
from flax import nnx
from peer_eva_release import our_layer
from longctx import attention
T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
cfg = attention.default_config("eva")
core = attention.build("eva", cfg, num_heads=4, head_dim=64, causal=True, rngs=nnx.Rngs(0))
g, cp, rest = nnx.split(core, nnx.Param, ...)
r = np.random.default_rng(0)
q, k, v, do = (jnp.asarray(r.standard_normal((1, 4, T, 64)).astype(np.float32)) for _ in range(4))
key = jax.random.key(0)
def core_loss(p, q, k, v, do, key, det):
    return jnp.sum(nnx.merge(g, p, rest)(q, k, v, deterministic=det, key=None if det else key)[0] * do)
c_det = jax.jit(jax.grad(lambda *a: core_loss(*a, True), argnums=(0, 1, 2, 3)))
c_tr = jax.jit(jax.grad(lambda *a: core_loss(*a, False), argnums=(0, 1, 2, 3)))
pn, fn_fwd, fn_grad = our_layer(256, 4, 128, 8, proj=False)
pp, fp_fwd, fp_grad = our_layer(256, 4, 128, 8, proj=True)
x = jnp.asarray(r.standard_normal((1, T, 256)).astype(np.float32)); w = jnp.asarray(r.standard_normal((1, T, 256)).astype(np.float32))
calls = {"core det": lambda: c_det(cp, q, k, v, do, key), "core train": lambda: c_tr(cp, q, k, v, do, key),
         "layer noproj": lambda: fn_grad(pn, x, w, key), "layer": lambda: fp_grad(pp, x, w, key)}
for f in calls.values():
    for _ in range(3): jax.block_until_ready(f())
ts = {n: [] for n in calls}
for i in range(int(sys.argv[2]) if len(sys.argv) > 2 else 9):
    for name, f in calls.items():
        t = time.perf_counter(); jax.block_until_ready(f()); ts[name].append(time.perf_counter() - t)
for n, tv in ts.items(): print(f"{n:14s} {np.median(tv)*1e3:.1f} ms")
