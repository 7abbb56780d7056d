"""Prototype, forward+backward: causal flash attention with the query blocks unrolled, each scanning exactly its
visible key blocks (forward: online softmax; backward from the saved log-sum-exp: dq carried, the dk/dv of each
(query block, key block) pair stacked and summed per key block). Against dense:blockwise (default and 1024x512)."""
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


def _kblocks(x, n, bk):
    B, H, _, D = x.shape
    return x[:, :, :n * bk].reshape(B, H, n, bk, D).transpose(2, 0, 1, 3, 4)


def _mask(i, j, bq, bk):
    return (j * bk + jnp.arange(bk))[None, :] <= (i * bq + jnp.arange(bq))[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def attn(q, k, v, bq, bk):
    return attn_fwd(q, k, v, bq, bk)[0]


def attn_fwd(q, k, v, bq, bk):
    B, H, T, D = q.shape
    qs = q * D ** -0.5
    outs, lses = [], []
    for i in range(T // bq):
        qi = qs[:, :, i * bq:(i + 1) * bq]
        n = -(-(i + 1) * bq // bk)

        def step(carry, xs, qi=qi, i=i):
            m, l, acc = carry
            kj, vj, j = xs
            s = jnp.where(_mask(i, j, bq, bk), jnp.einsum("bhqd,bhkd->bhqk", qi, kj, precision=HI), NEG)
            m_new = jnp.maximum(m, jnp.max(s, -1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            return (m_new, l * corr + jnp.sum(p, -1),
                    acc * corr[..., None] + jnp.einsum("bhqk,bhkd->bhqd", p, vj, precision=HI)), None

        init = (jnp.full((B, H, bq), NEG), jnp.zeros((B, H, bq)), jnp.zeros((B, H, bq, D)))
        (m, l, acc), _ = jax.lax.scan(step, init, (_kblocks(k, n, bk), _kblocks(v, n, bk), jnp.arange(n)))
        outs.append(acc / l[..., None]); lses.append(m + jnp.log(l))
    o = jnp.concatenate(outs, 2)
    return o, (qs, k, v, o, jnp.concatenate(lses, 2))


def attn_bwd(bq, bk, res, do):
    qs, k, v, o, lse = res
    B, H, T, D = qs.shape
    delta = jnp.sum(do * o, -1)
    nk = T // bk
    dqs, dk, dv = [], jnp.zeros((nk, B, H, bk, D)), jnp.zeros((nk, B, H, bk, D))
    for i in range(T // bq):
        sl = slice(i * bq, (i + 1) * bq)
        qi, doi, li, di = qs[:, :, sl], do[:, :, sl], lse[:, :, sl], delta[:, :, sl]
        n = -(-(i + 1) * bq // bk)

        def step(dq, xs, qi=qi, doi=doi, li=li, di=di, i=i):
            kj, vj, j = xs
            s = jnp.einsum("bhqd,bhkd->bhqk", qi, kj, precision=HI)
            p = jnp.where(_mask(i, j, bq, bk), jnp.exp(s - li[..., None]), 0.0)
            ds = p * (jnp.einsum("bhqd,bhkd->bhqk", doi, vj, precision=HI) - di[..., None])
            return dq + jnp.einsum("bhqk,bhkd->bhqd", ds, kj, precision=HI), (
                jnp.einsum("bhqk,bhqd->bhkd", ds, qi, precision=HI), jnp.einsum("bhqk,bhqd->bhkd", p, doi, precision=HI))

        dq, (dki, dvi) = jax.lax.scan(step, jnp.zeros_like(qi), (_kblocks(k, n, bk), _kblocks(v, n, bk), jnp.arange(n)))
        dqs.append(dq)
        pad = [(0, nk - n)] + [(0, 0)] * 4
        dk, dv = dk + jnp.pad(dki, pad), dv + jnp.pad(dvi, pad)
    unb = lambda x: x.transpose(1, 2, 0, 3, 4).reshape(B, H, T, D)  # noqa: E731
    return jnp.concatenate(dqs, 2) * D ** -0.5, unb(dk), unb(dv)


attn.defvjp(attn_fwd, attn_bwd)

T = int(sys.argv[1]); reps = int(sys.argv[2]); cfgs = [tuple(map(int, s.split("x"))) for s in sys.argv[3].split(",")]
q, k, v = C.random_qkv(T, 1, 4, T, 64)
w = jax.random.normal(jax.random.key(7), (1, 4, T, 64)); key = jax.random.key(11)
fns = {}
for bq, bk in ((512, 256), (1024, 512)):
    f = CoreFns(build_core("dense", {"impl": "blockwise", "block_q": bq, "block_k": bk}, heads=4, head_dim=64, causal=True))
    a = (f.params, f.rest, q, k, v, w, key)
    fns[f"blockwise {bq}x{bk}"] = (jax.jit(f.grads()).lower(*a).compile(), a)
ref = fns["blockwise 512x256"][0](*fns["blockwise 512x256"][1])[1:]
for bq, bk in cfgs:
    g = jax.jit(jax.grad(lambda q, k, v, w, bq=bq, bk=bk: jnp.sum(attn(q, k, v, bq, bk) * w), argnums=(0, 1, 2)))
    c = g.lower(q, k, v, w).compile(); fns[f"unrolled {bq}x{bk}"] = (c, (q, k, v, w))
    print(bq, bk, "max |d|", [float(jnp.max(jnp.abs(x - y))) for x, y in zip(c(q, k, v, w), ref)], flush=True)
ts = {p: [] for p in fns}
for r in range(reps):
    for p, (c, a) in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
        t = time.perf_counter(); jax.block_until_ready(c(*a)); ts[p].append(time.perf_counter() - t)
for p, v_ in ts.items():
    print(p, "median ms", round(1e3 * statistics.median(v_), 1), "min", round(1e3 * min(v_), 1), flush=True)
