"""Prototype: causal exact attention in unrolled row blocks (all visible keys of a query block in one matmul, no
loop), backward recomputed from the saved log-sum-exp. Times fwd+bwd at T against dense:blockwise 1024x512."""
import functools
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

HI = jax.lax.Precision.HIGHEST
NEG = -1e30


def _diag_mask(bq):
    r = jnp.arange(bq)
    return r[None, :] <= r[:, None]


def _fwd_block(qi, k, v, i, bq):
    e = (i + 1) * bq
    s = jnp.einsum("bhqd,bhkd->bhqk", qi, k[:, :, :e], precision=HI)
    keep = jnp.concatenate([jnp.ones((bq, e - bq), bool), _diag_mask(bq)], axis=1)
    s = jnp.where(keep, s, NEG)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhqk,bhkd->bhqd", p, v[:, :, :e], precision=HI) / l
    return o, (m + jnp.log(l))[..., 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def rows(q, k, v, bq):
    return rows_fwd(q, k, v, bq)[0]


def rows_fwd(q, k, v, bq):
    T, D = q.shape[2], q.shape[3]
    qs = q * D ** -0.5
    outs, lses = zip(*[_fwd_block(qs[:, :, i * bq:(i + 1) * bq], k, v, i, bq) for i in range(T // bq)])
    o = jnp.concatenate(outs, axis=2)
    return o, (qs, k, v, o, jnp.concatenate(lses, axis=2))


def rows_bwd(bq, res, do):
    qs, k, v, o, lse = res
    B, H, T, D = qs.shape
    delta = jnp.sum(do * o, axis=-1)
    dqs, dk, dv = [], jnp.zeros_like(k), jnp.zeros_like(v)
    for i in range(T // bq):
        e = (i + 1) * bq
        sl = slice(i * bq, (i + 1) * bq)
        qi, doi = qs[:, :, sl], do[:, :, sl]
        s = jnp.einsum("bhqd,bhkd->bhqk", qi, k[:, :, :e], precision=HI)
        keep = jnp.concatenate([jnp.ones((bq, e - bq), bool), _diag_mask(bq)], axis=1)
        p = jnp.exp(jnp.where(keep, s, NEG) - lse[:, :, sl, None])
        dp = jnp.einsum("bhqd,bhkd->bhqk", doi, v[:, :, :e], precision=HI)
        ds = p * (dp - delta[:, :, sl, None])
        dqs.append(jnp.einsum("bhqk,bhkd->bhqd", ds, k[:, :, :e], precision=HI))
        pad = [(0, 0), (0, 0), (0, T - e), (0, 0)]
        dk = dk + jnp.pad(jnp.einsum("bhqk,bhqd->bhkd", ds, qi, precision=HI), pad)
        dv = dv + jnp.pad(jnp.einsum("bhqk,bhqd->bhkd", p, doi, precision=HI), pad)
    return jnp.concatenate(dqs, axis=2) * D ** -0.5, dk, dv


rows.defvjp(rows_fwd, rows_bwd)

T = int(sys.argv[1]); reps = int(sys.argv[2]); bqs = [int(s) for s in sys.argv[3].split(",")]
q, k, v = C.random_qkv(T, 1, 4, T, 64)
w = jax.random.normal(jax.random.key(7), (1, 4, T, 64)); key = jax.random.key(11)
core = build_core("dense", {"impl": "blockwise", "block_q": 1024, "block_k": 512}, heads=4, head_dim=64, causal=True)
f = CoreFns(core)
ref = jax.jit(f.grads()).lower(f.params, f.rest, q, k, v, w, key).compile()
fns = {"blockwise 1024x512": (ref, (f.params, f.rest, q, k, v, w, key))}
g_ref = ref(*fns["blockwise 1024x512"][1])
for bq in bqs:
    g = jax.jit(jax.grad(lambda q, k, v, w, bq=bq: jnp.sum(rows(q, k, v, bq) * w), argnums=(0, 1, 2)))
    c = g.lower(q, k, v, w).compile()
    fns[f"rows {bq}"] = (c, (q, k, v, w))
    got = c(q, k, v, w)
    print(bq, "max |d| vs blockwise:", [float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, g_ref[1:])], flush=True)
ts = {p: [] for p in fns}
for r in range(reps):
    for p, (c, a) in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
        t = time.perf_counter(); jax.block_until_ready(c(*a)); ts[p].append(time.perf_counter() - t)
for p, v_ in ts.items():
    print(p, "median ms", round(1e3 * statistics.median(v_), 1), "min", round(1e3 * min(v_), 1), flush=True)
