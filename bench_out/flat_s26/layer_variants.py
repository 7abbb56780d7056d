"""EVA's layer (scripts/peer_eva_release.py's shape: 256 -> 4 heads of 64, window 128, chunk 8, causal) written
several ways around the same core, loss+gradient timed interleaved in one process (session 26).

    .venv/bin/python bench_out/flat_s26/layer_variants.py T REPEATS base,flat,bar,bar_out,lay,lay_in,perhead

base: x [1, T, 256] @ W (3-D dots), heads by reshape+transpose (the layer as it was); flat: the same with x and the
output flattened to [T, 256] before the matmuls (what longctx.models.layers.flat_last does); bar / bar_out:
custom VJPs for the q/k/v (and output) projections whose backward materializes the head-merged gradient once
(optimization_barrier) and multiplies 2-D; lay / lay_in: only the head reshapes get such custom VJPs (3-D
dots kept); perhead: the projections' backward per head, no transpose of the gradient. Prints each variant's
gradient difference from the first and the median / minimum times.
"""
import sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages(); keep_freed_memory()
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from longctx import attention
T = int(sys.argv[1]); R = int(sys.argv[2]); which = sys.argv[3].split(",")
H, D, dm = 4, 64, 256
cfg = attention.default_config("eva"); cfg.update({"window_size": 128, "chunk_size": 8, "overlap_window": False, "use_rpe": True, "adaptive_proj": "qk"})
ks = jax.random.split(jax.random.key(0), 4)
proj = {n: (jax.random.normal(k, (dm, dm)) * dm ** -0.5, jnp.zeros((dm,))) for n, k in zip("qkvo", ks)}
x = jax.random.normal(jax.random.key(1), (1, T, dm)); w = jax.random.normal(jax.random.key(2), (1, T, dm))
core = attention.build("eva", cfg, num_heads=H, head_dim=D, causal=True, rngs=nnx.Rngs(0))
gd, cp, rest = nnx.split(core, nnx.Param, ...)
params = {"core": cp, "proj": proj}

def heads_plain(y, B, T):
    return y.reshape(B, T, H, D).transpose(0, 2, 1, 3)

@jax.custom_vjp
def proj_heads(x, W, b):  # x [B,T,C] -> [B,H,T,D]
    B, T, _ = x.shape
    return (x @ W + b).reshape(B, T, H, D).transpose(0, 2, 1, 3)
def _ph_fwd(x, W, b):
    return proj_heads(x, W, b), (x, W)
def _ph_bwd(res, g):
    x, W = res
    B, T, C = x.shape
    gt = g.transpose(0, 2, 1, 3).reshape(B * T, H * D)
    gt = jax.lax.optimization_barrier(gt)
    x2 = x.reshape(B * T, C)
    return (gt @ W.T).reshape(B, T, C), x2.T @ gt, gt.sum(0)
proj_heads.defvjp(_ph_fwd, _ph_bwd)

@jax.custom_vjp
def proj_heads_h(x, W, b):
    B, T, _ = x.shape
    return (x @ W + b).reshape(B, T, H, D).transpose(0, 2, 1, 3)
def _phh_fwd(x, W, b):
    return proj_heads_h(x, W, b), (x, W)
def _phh_bwd(res, g):  # no transpose of g: per-head products
    x, W = res
    B, T, C = x.shape
    Wh = W.reshape(C, H, D)
    dx = sum(g[:, h] @ Wh[:, h].T for h in range(H))
    x2 = x.reshape(B * T, C)
    dW = jnp.stack([x2.T @ g[:, h].reshape(B * T, D) for h in range(H)], axis=1).reshape(C, H * D)
    db = g.sum((0, 2)).reshape(H * D)
    return dx, dW, db
proj_heads_h.defvjp(_phh_fwd, _phh_bwd)

@jax.custom_vjp
def heads_out(o, W, b):  # o [B,H,T,D] -> [B,T,C]
    B, _, T, _ = o.shape
    return o.transpose(0, 2, 1, 3).reshape(B, T, H * D) @ W + b
def _ho_fwd(o, W, b):
    B, _, T, _ = o.shape
    ot = jax.lax.optimization_barrier(o.transpose(0, 2, 1, 3).reshape(B * T, H * D))
    return (ot @ W + b).reshape(B, T, -1), (ot, W, B, T)
def _ho_bwd(res, g):
    ot, W, B, T = res
    g2 = g.reshape(B * T, -1)
    do = (g2 @ W.T).reshape(B, T, H, D).transpose(0, 2, 1, 3)
    return do, ot.T @ g2, g2.sum(0)
heads_out.defvjp(_ho_fwd, _ho_bwd)


import functools
@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def to_heads(y, H):  # [B,T,H*D] -> [B,H,T,D]
    B, T, C = y.shape
    return y.reshape(B, T, H, C // H).transpose(0, 2, 1, 3)
def _th_fwd(y, H):
    return to_heads(y, H), None
def _th_bwd(H, _, g):
    B, H_, T, D = g.shape
    return (jax.lax.optimization_barrier(g.transpose(0, 2, 1, 3).reshape(B, T, H_ * D)),)
to_heads.defvjp(_th_fwd, _th_bwd)

@jax.custom_vjp
def from_heads(o):  # [B,H,T,D] -> [B,T,H*D]
    B, H_, T, D = o.shape
    return jax.lax.optimization_barrier(o.transpose(0, 2, 1, 3).reshape(B, T, H_ * D))
def _fh_fwd(o):
    return from_heads(o), o.shape
def _fh_bwd(shape, g):
    B, H_, T, D = shape
    return (g.reshape(B, T, H_, D).transpose(0, 2, 1, 3),)
from_heads.defvjp(_fh_fwd, _fh_bwd)

def make(variant):
    def layer(params, x):
        B, T, _ = x.shape
        P = params["proj"]
        if variant == "base":
            q, k, v = (heads_plain(x @ P[n][0] + P[n][1], B, T) for n in "qkv")
        elif variant in ("bar", "bar_out"):
            q, k, v = (proj_heads(x, *P[n]) for n in "qkv")
        elif variant == "perhead":
            q, k, v = (proj_heads_h(x, *P[n]) for n in "qkv")
        elif variant in ("lay", "lay_in"):
            q, k, v = (to_heads(x @ P[n][0] + P[n][1], H) for n in "qkv")
        elif variant == "flat":
            x2 = x.reshape(B * T, dm)
            q, k, v = ((x2 @ P[n][0] + P[n][1]).reshape(B, T, H, D).transpose(0, 2, 1, 3) for n in "qkv")
        o, _ = nnx.merge(gd, params["core"], rest)(q, k, v)
        if variant == "flat":
            o2 = o.transpose(0, 2, 1, 3).reshape(B * T, dm)
            return (o2 @ P["o"][0] + P["o"][1]).reshape(B, T, dm)
        if variant == "lay":
            return from_heads(o) @ P["o"][0] + P["o"][1]
        if variant == "bar_out":
            return heads_out(o, *P["o"])
        o = o.transpose(0, 2, 1, 3).reshape(B, T, dm)
        return o @ P["o"][0] + P["o"][1]
    return layer

fns = {}
ref = None
for v in which:
    layer = make(v)
    g = jax.jit(jax.grad(lambda p, x, w, f=layer: jnp.sum(f(p, x) * w), argnums=(0, 1)))
    out = g(params, x, w)
    if ref is None: ref = out
    else:
        err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30)) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
        print(v, "max rel err vs first", err)
    fns[v] = g
for f in fns.values():
    jax.block_until_ready(f(params, x, w))
ts = {k_: [] for k_ in fns}
for _ in range(R):
    for name, f in fns.items():
        t = time.perf_counter(); jax.block_until_ready(f(params, x, w)); ts[name].append(time.perf_counter() - t)
for name, xx in ts.items():
    print(f"T {T} {name:10s} med {np.median(xx)*1e3:7.1f}  min {min(xx)*1e3:7.1f}", flush=True)
