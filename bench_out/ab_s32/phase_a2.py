"""Phase A fwd+bwd at 8k: the reference against rewrites of its batched mat-vec dots (alternating, medians)."""
import sys, pathlib; _R = pathlib.Path(__file__).resolve().parents[2]; sys.path[:0] = [str(_R)]
from longctx.host_memory import keep_freed_memory, restart_with_huge_pages
restart_with_huge_pages(); keep_freed_memory()
import functools, jax, jax.numpy as jnp, numpy as np, time
from flax import nnx
from longctx import attention
from pallas_kernels import eva_chunks_ref as R
T, C, P = 8192, 1024, 8
core = attention.build("eva", attention.default_config("eva"), num_heads=4, head_dim=64, causal=True, rngs=nnx.Rngs(0))
params = core.chunk_params(); opts = core.opts
r = np.random.default_rng(0)
q, k, v = (jnp.asarray(r.standard_normal((1, 4, C, P, 64)).astype(np.float32)) for _ in range(3))
valid = jnp.ones((C, P), bool)
noise = jnp.asarray(r.standard_normal((1, 4, C, 64)).astype(np.float32))
w1, w2 = (jnp.asarray(r.standard_normal((1, 4, C, 64)).astype(np.float32)) for _ in range(2))

def rf2(x, omega, scale, rf_scale):
    lead = x.shape[:-2]
    xf, of = x.reshape(-1, x.shape[-2], x.shape[-1]), omega.reshape(-1, 1, omega.shape[-1])
    dot = jnp.sum(xf * of, axis=-1).reshape(lead + (x.shape[-2],))
    sq = 0.5 * jnp.sum(x * x, axis=-1)
    return scale * (dot - sq)

def beta2(omega, k_ch, v_ch, k_valid, scale, rf_scale, rf=R.rf_log_feature):
    logits = jnp.where(k_valid, rf(k_ch, omega, scale, rf_scale), R.NEG)
    w = jax.nn.softmax(logits, axis=-1)
    w = jnp.where(k_valid, w, 0.0)
    return functools.reduce(jnp.add, [w[..., p, None] * v_ch[..., p, :] for p in range(v_ch.shape[-2])])

def summaries(variant):
    def f(q_ch, k_ch, v_ch, k_valid, params, noise):
        P = q_ch.shape[-2]
        q_bar = jnp.sum(q_ch, axis=-2) / P
        k_bar = jnp.sum(k_ch, axis=-2) / P
        k_hat, mu = R.representatives(q_bar, k_bar, params, opts)
        omega = mu + noise
        if variant == "ref":
            return k_hat, R.chunk_beta(omega, k_ch, v_ch, k_valid, 0.125, opts.rf_scale)
        if variant == "rf2":
            return k_hat, R.chunk_beta.__wrapped__(omega, k_ch, v_ch, k_valid, 0.125, opts.rf_scale) if hasattr(R.chunk_beta, "__wrapped__") else \
                k_hat, None
        if variant == "beta2":
            return k_hat, beta2(omega, k_ch, v_ch, k_valid, 0.125, opts.rf_scale)
        if variant == "both":
            return k_hat, beta2(omega, k_ch, v_ch, k_valid, 0.125, opts.rf_scale, rf=rf2)
    return f

fs = {}
for name in ("ref", "beta2", "both"):
    S = summaries(name)
    def loss(params, q, k, v, noise, w1, w2, S=S):
        kh, b = S(q, k, v, valid, params, noise)
        return jnp.sum(kh * w1) + jnp.sum(b * w2)
    fs[name] = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
args = (params, q, k, v, noise, w1, w2)
ref = fs["ref"](*args)
for n, f in fs.items():
    g = f(*args)
    print(n, "max diff", max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(g))))
for f in fs.values():
    for _ in range(3): jax.block_until_ready(f(*args))
ts = {n: [] for n in fs}
for i in range(40):
    for n, f in (fs.items() if i % 2 == 0 else reversed(list(fs.items()))):
        t = time.perf_counter(); jax.block_until_ready(f(*args)); ts[n].append(time.perf_counter() - t)
for n, tv in ts.items(): print(f"{n:6s} {np.median(tv)*1e3:.2f} ms")
