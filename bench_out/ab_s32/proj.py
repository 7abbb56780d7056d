"""Projection-only layer (q/k/v/out projections, heads transposes, elementwise core o = q*k + v) fwd+bwd at 8k:
JAX variants against torch, alternating, medians."""
import sys, pathlib, os; _R = pathlib.Path(__file__).resolve().parents[2]; sys.path[:0] = [str(_R)]
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages(); keep_freed_memory()
import jax, jax.numpy as jnp, numpy as np, time, torch
from longctx.xla_cpu import flat_last, transposed, rows_dot
torch.set_num_threads(2)
T, C, H, D = 8192, 256, 4, 64
r = np.random.default_rng(0)
x_np = r.standard_normal((1, T, C)).astype(np.float32); w_np = r.standard_normal((1, T, C)).astype(np.float32)
Ws = {n: (r.standard_normal((C, C)).astype(np.float32) * C**-0.5, np.zeros(C, np.float32)) for n in "qkvo"}
params = jax.tree_util.tree_map(jnp.asarray, Ws)
heads_of = lambda y: y.reshape(1, T, H, D).transpose(0, 2, 1, 3)
merge = lambda o: o.transpose(0, 2, 1, 3).reshape(1, T, C)

@jax.custom_vjp
def lin_t(x, W, b):
    return x @ W + b
def lin_t_fwd(x, W, b):
    return x @ W + b, (x, W)
def lin_t_bwd(res, g):
    x, W = res
    return g @ W.T, rows_dot(transposed(x), g), jnp.sum(g, 0)
lin_t.defvjp(lin_t_fwd, lin_t_bwd)

@jax.custom_vjp
def lin_p(x, W, b):
    return x @ W + b
def lin_p_bwd(res, g):
    x, W = res
    return g @ W.T, jnp.einsum("nd,ne->de", x, g), jnp.sum(g, 0)
lin_p.defvjp(lin_t_fwd, lin_p_bwd)

@jax.custom_vjp
def lin_g(x, W, b):
    return x @ W + b
def lin_g_fwd(x, W, b):
    return x @ W + b, (transposed(x), W)
def lin_g_bwd(res, g):
    xt, W = res
    return g @ W.T, xt @ g, jnp.sum(g, 0)
lin_g.defvjp(lin_g_fwd, lin_g_bwd)

def layer_G(p, x):
    lin = lambda y, n: flat_last(lambda z: lin_g(z, *p[n]), y)
    q, k, v = (heads_of(lin(x, n)) for n in "qkv")
    return lin(merge(core(q, k, v)), "o")

def layer_H(p, x):  # G for q, k, v only; the output projection as autodiff writes it
    lin = lambda y, n: flat_last(lambda z: lin_g(z, *p[n]), y)
    q, k, v = (heads_of(lin(x, n)) for n in "qkv")
    return flat_last(lambda z: z @ p["o"][0] + p["o"][1], merge(core(q, k, v)))

from blocked_dw import mm_i  # noqa: E402

def layer_I(p, x):
    lin = lambda y, n: flat_last(lambda z: mm_i(z, p[n][0]) + p[n][1], y)
    q, k, v = (heads_of(lin(x, n)) for n in "qkv")
    return lin(merge(core(q, k, v)), "o")

def layer_F(p, x):
    lin = lambda y, n: flat_last(lambda z: lin_p(z, *p[n]), y)
    q, k, v = (heads_of(lin(x, n)) for n in "qkv")
    return lin(merge(core(q, k, v)), "o")

def core(q, k, v): return q * k + v

def layer_A(p, x):
    lin = lambda y, n: flat_last(lambda z: z @ p[n][0] + p[n][1], y)
    q, k, v = (heads_of(lin(x, n)) for n in "qkv")
    return lin(merge(core(q, k, v)), "o")
def layer_B(p, x):
    lin = lambda y, n: flat_last(lambda z: lin_t(z, *p[n]), y)
    q, k, v = (heads_of(lin(x, n)) for n in "qkv")
    return lin(merge(core(q, k, v)), "o")
def layer_C(p, x):
    W = jnp.concatenate([p[n][0] for n in "qkv"], 1); b = jnp.concatenate([p[n][1] for n in "qkv"])
    y = flat_last(lambda z: z @ W + b, x)
    q, k, v = (heads_of(t) for t in jnp.split(y, 3, axis=-1))
    return flat_last(lambda z: z @ p["o"][0] + p["o"][1], merge(core(q, k, v)))
def layer_D(p, x):
    W = jnp.concatenate([p[n][0] for n in "qkv"], 1); b = jnp.concatenate([p[n][1] for n in "qkv"])
    y = flat_last(lambda z: lin_t(z, W, b), x)
    q, k, v = (heads_of(t) for t in jnp.split(y, 3, axis=-1))
    return flat_last(lambda z: lin_t(z, *p["o"]), merge(core(q, k, v)))
def layer_E(p, x):  # C, heads by reshape [T, 3, H, D] -> one transpose
    W = jnp.concatenate([p[n][0] for n in "qkv"], 1); b = jnp.concatenate([p[n][1] for n in "qkv"])
    y = flat_last(lambda z: z @ W + b, x).reshape(1, T, 3, H, D).transpose(2, 0, 3, 1, 4)
    return flat_last(lambda z: z @ p["o"][0] + p["o"][1], merge(core(y[0], y[1], y[2])))

x, w = jnp.asarray(x_np), jnp.asarray(w_np)
fs = {}
for name, L in (("A", layer_A), ("I", layer_I)):
    fs[name] = jax.jit(jax.grad(lambda p, x, w, L=L: jnp.sum(L(p, x) * w), argnums=(0, 1)))
ref = fs["A"](params, x, w)
for k, f in fs.items():
    g = f(params, x, w)
    print(k, "max grad diff", max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(g))))
lin_t_ = {n: torch.nn.Linear(C, C) for n in "qkvo"}
xt = torch.from_numpy(x_np.transpose(1, 0, 2).copy()).requires_grad_(True); wt = torch.from_numpy(w_np.transpose(1, 0, 2).copy())
def torch_step():
    for m in lin_t_.values(): m.zero_grad(set_to_none=True)
    xt.grad = None
    q, k, v = (lin_t_[n](xt).contiguous().view(1, T, H, D).transpose(1, 2) for n in "qkv")
    o = (q * k + v).transpose(1, 2).contiguous().view(T, 1, C)
    (lin_t_["o"](o) * wt).sum().backward()
calls = {k: (lambda f=f: jax.block_until_ready(f(params, x, w))) for k, f in fs.items()}
calls["torch"] = torch_step
for f in calls.values():
    for _ in range(3): f()
ts = {k: [] for k in calls}
for i in range(41):
    for k, f in (calls.items() if i % 2 == 0 else reversed(list(calls.items()))):
        t = time.perf_counter(); f(); ts[k].append(time.perf_counter() - t)
for k, v in ts.items(): print(f"{k:6s} {np.median(v)*1e3:.2f} ms")
