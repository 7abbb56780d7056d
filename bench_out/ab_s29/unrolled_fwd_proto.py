"""Prototype, forward only: causal flash attention with the query blocks unrolled (independent, so XLA:CPU can run
them side by side) and each block's scan over exactly its visible key blocks (no cond), against dense:blockwise's
forward (its default 512x256 and 1024x512) and the rows form (all visible keys of a block in one matmul)."""
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


def unrolled(q, k, v, bq, bk):
    B, H, T, D = q.shape
    qs = q * D ** -0.5
    outs = []
    for i in range(T // bq):
        qi = qs[:, :, i * bq:(i + 1) * bq]
        e = (i + 1) * bq
        nkb = e // bk
        kb = k[:, :, :e].reshape(B, H, nkb, bk, D).transpose(2, 0, 1, 3, 4)
        vb = v[:, :, :e].reshape(B, H, nkb, bk, D).transpose(2, 0, 1, 3, 4)
        qpos = i * bq + jnp.arange(bq)

        def step(carry, xs, qi=qi, qpos=qpos):
            m, l, acc = carry
            kj, vj, j = xs
            s = jnp.einsum("bhqd,bhkd->bhqk", qi, kj, precision=HI)
            kpos = j * bk + jnp.arange(bk)
            s = jnp.where(kpos[None, :] <= qpos[:, None], s, NEG)
            m_new = jnp.maximum(m, jnp.max(s, -1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            return (m_new, l * corr + jnp.sum(p, -1),
                    acc * corr[..., None] + jnp.einsum("bhqk,bhkd->bhqd", p, vj, precision=HI)), None

        init = (jnp.full((B, H, bq), NEG), jnp.zeros((B, H, bq)), jnp.zeros((B, H, bq, D)))
        (m, l, acc), _ = jax.lax.scan(step, init, (kb, vb, jnp.arange(nkb)))
        outs.append(acc / l[..., None])
    return jnp.concatenate(outs, axis=2)


def rows(q, k, v, bq):
    B, H, T, D = q.shape
    qs = q * D ** -0.5
    outs = []
    for i in range(T // bq):
        e = (i + 1) * bq
        s = jnp.einsum("bhqd,bhkd->bhqk", qs[:, :, i * bq:e], k[:, :, :e], precision=HI)
        s = jnp.where(jnp.arange(e)[None, :] <= (i * bq + jnp.arange(bq))[:, None], s, NEG)
        p = jnp.exp(s - jnp.max(s, -1, keepdims=True))
        outs.append(jnp.einsum("bhqk,bhkd->bhqd", p, v[:, :, :e], precision=HI) / jnp.sum(p, -1)[..., None])
    return jnp.concatenate(outs, axis=2)


T = int(sys.argv[1]); reps = int(sys.argv[2])
q, k, v = C.random_qkv(T, 1, 4, T, 64)
fns = {}
for bq, bk in ((512, 256), (1024, 512)):
    f = CoreFns(build_core("dense", {"impl": "blockwise", "block_q": bq, "block_k": bk}, heads=4, head_dim=64, causal=True))
    fns[f"blockwise {bq}x{bk}"] = (jax.jit(f.forward()).lower(f.params, f.rest, q, k, v).compile(), (f.params, f.rest, q, k, v))
ref = fns["blockwise 512x256"][0](*fns["blockwise 512x256"][1])
for bq, bk in ((512, 256), (1024, 512), (512, 512), (256, 256)):
    c = jax.jit(lambda q, k, v, bq=bq, bk=bk: unrolled(q, k, v, bq, bk)).lower(q, k, v).compile()
    fns[f"unrolled {bq}x{bk}"] = (c, (q, k, v))
    print(bq, bk, "max |d|", float(jnp.max(jnp.abs(c(q, k, v) - ref))), flush=True)
c = jax.jit(lambda q, k, v: rows(q, k, v, 512)).lower(q, k, v).compile(); fns["rows 512"] = (c, (q, k, v))
ts = {p: [] for p in fns}
for r in range(reps):
    for p, (c, a) in (list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]):
        t = time.perf_counter(); jax.block_until_ready(c(*a)); ts[p].append(time.perf_counter() - t)
for p, v_ in ts.items():
    print(p, "median ms", round(1e3 * statistics.median(v_), 1), "min", round(1e3 * min(v_), 1), flush=True)
