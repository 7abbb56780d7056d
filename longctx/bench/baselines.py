"""Benchmark-only baselines (not registry methods): the bidirectional approximations the KDEformer
paper compares against in its Fig. 4, run by ``longctx-bench quality`` at an equal budget ``F``
of keys / features per query.

* ``performer``: FAVOR+ (Choromanski et al., 2021) positive orthogonal random features,
  ``φ(x) = exp(ωᵀx − ‖x‖²/2)/√F`` with ``x = q·d^{-1/4}`` (resp. ``k``), ``F`` features whose
  directions come in orthogonal blocks of ``d`` and whose lengths are chi-distributed (so each
  ``ω`` is marginally N(0, I)); output ``φ(Q)(φ(K)ᵀV) / φ(Q)(φ(K)ᵀ1)``. One stabiliser per query
  and one global stabiliser for the keys (both cancel in the ratio).
* ``reformer_lsh``: Reformer-style LSH bucket attention (Kitaev et al., 2020): angular LSH by
  random rotations (``bucket = argmax([xR; −xR])``, ``N/c`` buckets), queries and keys each sorted
  by (bucket, position) and cut into equal chunks of ``c``; a query chunk attends exactly to the
  key chunk of the same rank and the one before it ("look one back"); ``n_hashes`` rounds
  combined by their log-sum-exps. Budget: ``2·c·n_hashes = F`` keys per query (default
  ``n_hashes = 2``, ``c = F/4``). q and k are hashed separately with the same rotations (the
  paper's GloVe test uses K = Q); keys colliding in several rounds are counted once per round
  (no de-duplication).

Both draw every random quantity from an explicit key.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def orthogonal_features(key, num_features: int, dim: int):
    """ω [F, d]: orthogonal blocks of d rows (QR of Gaussian blocks), row norms chi_d-distributed."""
    n_blocks = -(-num_features // dim)
    k_blocks, k_norm = jax.random.split(key)
    blocks = []
    for kb in jax.random.split(k_blocks, n_blocks):
        qm, _ = jnp.linalg.qr(jax.random.normal(kb, (dim, dim), jnp.float32))
        blocks.append(qm.T)
    w = jnp.concatenate(blocks, axis=0)[:num_features]
    norms = jnp.linalg.norm(jax.random.normal(k_norm, (num_features, dim), jnp.float32), axis=-1)
    return w * norms[:, None]


def performer(q, k, v, key, num_features: int):
    """FAVOR+ bidirectional attention. q, k [B,H,N,d], v [B,H,N,dv] -> [B,H,N,dv] (fp32)."""
    d = q.shape[-1]
    w = orthogonal_features(key, num_features, d)
    s = d**-0.25
    qs, ks = q.astype(jnp.float32) * s, k.astype(jnp.float32) * s
    lq = jnp.einsum("bhnd,fd->bhnf", qs, w, precision=HIGHEST) - 0.5 * jnp.sum(qs * qs, -1, keepdims=True)
    lk = jnp.einsum("bhnd,fd->bhnf", ks, w, precision=HIGHEST) - 0.5 * jnp.sum(ks * ks, -1, keepdims=True)
    phi_q = jnp.exp(lq - jnp.max(lq, axis=-1, keepdims=True))
    phi_k = jnp.exp(lk - jnp.max(lk, axis=(-2, -1), keepdims=True))
    kv = jnp.einsum("bhnf,bhne->bhfe", phi_k, v.astype(jnp.float32), precision=HIGHEST)
    num = jnp.einsum("bhnf,bhfe->bhne", phi_q, kv, precision=HIGHEST)
    den = jnp.einsum("bhnf,bhf->bhn", phi_q, jnp.sum(phi_k, axis=2), precision=HIGHEST)
    return num / jnp.maximum(den, 1e-30)[..., None]


def _sorted_chunks(x, order, c):
    B, H, N, e = x.shape
    xs = jnp.take_along_axis(x, order[..., None], axis=2)
    return xs.reshape(B, H, N // c, c, e)


def reformer_lsh(q, k, v, key, chunk: int, n_hashes: int = 2):
    """LSH bucket attention (look one back), n_hashes rounds. N must be a multiple of ``chunk``."""
    B, H, N, d = q.shape
    if N % chunk:
        raise ValueError(f"reformer_lsh: length {N} must be a multiple of the chunk size {chunk}")
    nc = N // chunk
    n_buckets = max(2, nc + nc % 2)
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
    pos = jnp.arange(N, dtype=jnp.int32)
    outs, lses = [], []
    for kr in jax.random.split(key, n_hashes):
        rot = jax.random.normal(kr, (B, H, d, n_buckets // 2), jnp.float32)

        def bucket(x, rot=rot):
            r = jnp.einsum("bhnd,bhdr->bhnr", x, rot, precision=HIGHEST)
            return jnp.argmax(jnp.concatenate([r, -r], axis=-1), axis=-1).astype(jnp.int32)

        oq = jnp.argsort(bucket(qf) * N + pos, axis=-1)
        ok = jnp.argsort(bucket(kf) * N + pos, axis=-1)
        Qs = _sorted_chunks(qf, oq, chunk)
        Ks, Vs = _sorted_chunks(kf, ok, chunk), _sorted_chunks(vf, ok, chunk)
        Kb = jnp.concatenate([Ks, jnp.roll(Ks, 1, axis=2)], axis=3)  # own chunk + the one before (cyclic)
        Vb = jnp.concatenate([Vs, jnp.roll(Vs, 1, axis=2)], axis=3)
        if nc == 1:  # the chunk before is the chunk itself: keep one copy
            Kb, Vb = Ks, Vs
        s = jnp.einsum("bhcqd,bhckd->bhcqk", Qs, Kb, precision=HIGHEST) * d**-0.5
        lse = jax.nn.logsumexp(s, axis=-1)
        o = jnp.einsum("bhcqk,bhcke->bhcqe", jnp.exp(s - lse[..., None]), Vb, precision=HIGHEST)
        inv = jnp.argsort(oq, axis=-1)
        outs.append(jnp.take_along_axis(o.reshape(B, H, N, -1), inv[..., None], axis=2))
        lses.append(jnp.take_along_axis(lse.reshape(B, H, N), inv, axis=-1))
    lse_all = jnp.stack(lses)  # [R,B,H,N]
    w = jax.nn.softmax(lse_all, axis=0)
    return jnp.sum(w[..., None] * jnp.stack(outs), axis=0)


BASELINES = ("performer", "reformer_lsh")


def describe(name: str, budget: int) -> str:
    if name == "performer":
        return f"FAVOR+ positive orthogonal random features, F = {budget}"
    if name == "reformer_lsh":
        return f"LSH bucket attention, 2 hash rounds × (chunk {budget // 4} + look-one-back) = {budget} keys/query"
    raise ValueError(f"unknown baseline {name!r}; allowed: {', '.join(BASELINES)}")


def make(name: str, budget: int):
    """(q, k, v, key) -> out for baseline ``name`` at ``budget`` keys / features per query."""
    if name == "performer":
        return lambda q, k, v, key: performer(q, k, v, key, budget)
    if name == "reformer_lsh":
        c = max(1, budget // 4)
        return lambda q, k, v, key: reformer_lsh(q, k, v, key, c, 2)
    raise ValueError(f"unknown baseline {name!r}; allowed: {', '.join(BASELINES)}")


def op_rel_err(approx, exact) -> float:
    """Mean over (batch, head) of ‖approx − exact‖₂ / ‖exact‖₂ (spectral norms of [N, dv] matrices),
    the paper's GloVe metric."""
    import numpy as np

    a = np.asarray(approx, np.float64)
    b = np.asarray(exact, np.float64)
    errs = []
    for i in range(a.shape[0]):
        for h in range(a.shape[1]):
            errs.append(np.linalg.norm(a[i, h] - b[i, h], 2) / max(np.linalg.norm(b[i, h], 2), 1e-300))
    return float(math.fsum(errs) / len(errs))


__all__ = ["BASELINES", "describe", "make", "op_rel_err", "orthogonal_features", "performer", "reformer_lsh"]
