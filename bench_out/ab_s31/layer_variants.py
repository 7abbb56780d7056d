import sys, pathlib; _R = pathlib.Path(__file__).resolve().parents[2]; sys.path[:0] = [str(_R), str(_R / "scripts")]
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages(); keep_freed_memory()
import jax, jax.numpy as jnp, numpy as np, time
from flax import nnx
from longctx import attention
from longctx.xla_cpu import flat_last
T=int(sys.argv[1]) if len(sys.argv)>1 else 8192
d_model, heads, D = 256, 4, 64
cfg = attention.default_config("eva")
cfg.update({"window_size": 128, "chunk_size": 8, "overlap_window": False, "use_rpe": True, "adaptive_proj": "qk"})
core = attention.build("eva", cfg, num_heads=heads, head_dim=D, causal=True, rngs=nnx.Rngs(0))
graphdef, core_params, rest = nnx.split(core, nnx.Param, ...)
ks = jax.random.split(jax.random.key(0), 4)
proj = {n: (jax.random.normal(k, (d_model, d_model)) * d_model ** -0.5, jnp.zeros((d_model,))) for n, k in zip("qkvo", ks)}
params = {"core": core_params, "proj": proj}
def layer_A(params, x):
    B, T, _ = x.shape
    heads_of = lambda y: y.reshape(B, T, heads, D).transpose(0, 2, 1, 3)
    lin = lambda y, n: flat_last(lambda z: z @ params["proj"][n][0] + params["proj"][n][1], y)
    q, k, v = (heads_of(lin(x, n)) for n in "qkv")
    o, _ = nnx.merge(graphdef, params["core"], rest)(q, k, v)
    return lin(o.transpose(0, 2, 1, 3).reshape(B, T, d_model), "o")
def layer_B(params, x):
    B, T, _ = x.shape
    def to_heads(n):
        W, b = params["proj"][n]
        return jnp.einsum("btc,chd->bhtd", x, W.reshape(d_model, heads, D)) + b.reshape(heads, 1, D)
    q, k, v = (to_heads(n) for n in "qkv")
    o, _ = nnx.merge(graphdef, params["core"], rest)(q, k, v)
    W, b = params["proj"]["o"]
    return jnp.einsum("bhtd,hdc->btc", o, W.reshape(heads, D, d_model)) + b
r=np.random.default_rng(0)
x=jnp.asarray(r.standard_normal((1,T,256)).astype(np.float32)); w=jnp.asarray(r.standard_normal((1,T,256)).astype(np.float32))
fs={}
for name, L in (("A", layer_A), ("B", layer_B)):
    fs[name]=jax.jit(jax.grad(lambda p, x, w, L=L: jnp.sum(L(p, x) * w), argnums=(0, 1)))
    jax.block_until_ready(fs[name](params,x,w)); jax.block_until_ready(fs[name](params,x,w))
ga=fs["A"](params,x,w); gb=fs["B"](params,x,w)
print("max grad diff", max(float(jnp.max(jnp.abs(a-b))) for a,b in zip(jax.tree_util.tree_leaves(ga), jax.tree_util.tree_leaves(gb))))
ts={k:[] for k in fs}
for i in range(12):
    for k in (("A","B") if i%2==0 else ("B","A")):
        t=time.perf_counter(); jax.block_until_ready(fs[k](params,x,w)); ts[k].append(time.perf_counter()-t)
for k,v in ts.items(): print(k, round(np.median(v)*1e3,1))
