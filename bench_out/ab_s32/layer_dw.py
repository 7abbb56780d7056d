"""The peer's EVA layer (projections + our core, training path) at 8k, fwd+bwd: projections as autodiff writes them
against weight gradients from x transposed in blocks first (custom VJP), alternating, medians."""
import sys, pathlib; _R = pathlib.Path(__file__).resolve().parents[2]; sys.path[:0] = [str(_R), str(_R / "scripts")]
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages(); keep_freed_memory()
import jax, jax.numpy as jnp, numpy as np, time
from flax import nnx
from longctx import attention
from longctx.xla_cpu import flat_last, transposed
T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
d_model, heads, D = 256, 4, 64

from blocked_dw import mm_i  # noqa: E402

cfg = attention.default_config("eva")
core = attention.build("eva", cfg, num_heads=heads, head_dim=D, causal=True, rngs=nnx.Rngs(0))
graphdef, core_params, rest = nnx.split(core, nnx.Param, ...)
ks = jax.random.split(jax.random.key(0), 4)
proj = {n: (jax.random.normal(k, (d_model, d_model)) * d_model ** -0.5, jnp.zeros((d_model,))) for n, k in zip("qkvo", ks)}
params = {"core": core_params, "proj": proj}
def make(mm):
    def layer(params, x, key):
        B, T, _ = x.shape
        heads_of = lambda y: y.reshape(B, T, heads, D).transpose(0, 2, 1, 3)
        lin = lambda y, n: flat_last(lambda z: mm(z, params["proj"][n][0]) + params["proj"][n][1], y)
        q, k, v = (heads_of(lin(x, n)) for n in "qkv")
        o, _ = nnx.merge(graphdef, params["core"], rest)(q, k, v, deterministic=False, key=key)
        return lin(o.transpose(0, 2, 1, 3).reshape(B, T, d_model), "o")
    return jax.jit(jax.grad(lambda p, x, w, key: jnp.sum(layer(p, x, key) * w), argnums=(0, 1)))
r = np.random.default_rng(0)
x = jnp.asarray(r.standard_normal((1, T, 256)).astype(np.float32)); w = jnp.asarray(r.standard_normal((1, T, 256)).astype(np.float32))
key = jax.random.key(1)
fs = {"autodiff": make(lambda z, W: z @ W), "blocked xT": make(mm_i)}
ref = fs["autodiff"](params, x, w, key)
for n, f in fs.items():
    gr = f(params, x, w, key)
    print(n, max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(gr))))
    for _ in range(2): jax.block_until_ready(f(params, x, w, key))
ts = {n: [] for n in fs}
for i in range(int(sys.argv[2]) if len(sys.argv) > 2 else 15):
    for n, f in (fs.items() if i % 2 == 0 else reversed(list(fs.items()))):
        t = time.perf_counter(); jax.block_until_ready(f(params, x, w, key)); ts[n].append(time.perf_counter() - t)
for n, tv in ts.items(): print(f"{n:12s} {np.median(tv)*1e3:.1f} ms")
