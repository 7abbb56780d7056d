"""A NumPy (float64) port of the released KDEformer forward pass, and the generator of the fidelity fixture
``tests/fixtures/release/kdeformer.npz``.

Follows ``majid-daliri/kdeformer`` at commit ``427df2d56b7b97d1547464396755d3a453ea7e82``:

* ``KDEformer.py`` -- ``KDEformer.forward`` (after its ``b t h e -> b h t e`` rearrangement), with what it calls:
  ``Angular_LSH`` (projections ``[B, H, d, r]`` drawn afresh per call, bits weighted ``2^t``, the code looked up
  in the table of ``unit_hamming_distance_array``), ``CosineHammingLSH.forward`` (the block-diagonal "heavy"
  part over the sorted queries and keys, with the ones column appended to the values), ``power_method``
  (20 iterations on the Gram of the augmented, sorted values from a random start; returns ``‖G x‖``) and
  ``KDEformer.calc_A_res`` (``P ∝ ‖ṽ_j‖/λ + 1/N`` over the *sorted* key positions, ``m`` draws with replacement,
  weights ``1/(m P)``, a sample masked for every query of the query block whose index equals the sample's
  sorted position ``// b``); the output is the numerator columns divided by the ones column.
* ``vit_models/kdeformer.py`` -- only the caller's logit scale: ``q`` and ``k`` are each multiplied by
  ``sqrt(softmax_temp)`` with ``softmax_temp = d^-1/2`` before hashing (the root file takes them already scaled).

The port keeps the release's order of operations and index conventions (samples index the sorted keys; the
sampled-column mask is built from query-block membership). The release's random draws are explicit inputs here
and stored: the projections ``W`` (fp32 values), the power method's start vector ``x0`` and the uniforms ``u`` that
pick the sampled sorted positions by inverse CDF of ``P`` (standing in for ``torch.multinomial``; the picked
positions ``index`` are stored too). ``torch.sort`` of the hash codes is not specified to be stable; the port
sorts stably (ties by position), one of the orders the release may produce.

Cases (self-attention, as the release's layers use it; bidirectional: the release has no causal form):

* ``main``: B=2, H=2, N=64, d=16, dv=16, bucket b=8 (8 blocks), m=24 samples, r=4 projections;
* ``r7``: B=1, H=2, N=128, d=8, dv=12, b=16, m=32, r=7 (the BigGAN and ViT setting of r).

Inputs are Gaussian (values with a mean offset, so the ones column is not negligible); the seeds are chosen so
that no hash projection lies within 1e-3 of zero (an fp32 implementation hashes the same).

Stored per case ``<case>/...``: ``q, k, v`` [B,H,N,·] (fp32), ``W`` [B,H,d,r] (fp32), ``x0`` [B,H,dv+1], ``u``
[B,H,m]; the release's codes ``code_q, code_k`` [B,H,N] (table values), ``sort_q, sort_k`` [B,H,N], ``lam``
[B,H], ``P`` [B,H,N] (over sorted key positions), ``index`` [B,H,m] (sorted positions), ``sparse`` and ``res``
[B,H,N,dv+1] (heavy and sampled parts, numerator and ones column), and the output ``out`` [B,H,N,dv].

Regenerate (deterministic; no torch needed)::

    .venv/bin/python scripts/release_fixtures/kdeformer.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

COMMIT = "427df2d56b7b97d1547464396755d3a453ea7e82"
ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "release" / "kdeformer.npz"

CASES = {
    "main": dict(B=2, H=2, N=64, d=16, dv=16, bucket=8, samples=24, projs=4, seed=1),
    "r7": dict(B=1, H=2, N=128, d=8, dv=12, bucket=16, samples=32, projs=7, seed=7),
}
POWER_ITERS = 20
MARGIN = 1e-3


def reflected_table(bits: int) -> np.ndarray:
    """The release's lookup table: for one bit [0, 1]; for n bits, the (n-1)-bit table followed by its reverse
    offset by 2^(n-1)."""
    table = np.array([0, 1], np.int64)
    for n in range(2, bits + 1):
        table = np.concatenate([table, table[::-1] + (1 << (n - 1))])
    return table


def projections(x, W):
    """<x_i, w_t> per (b, h): x [B,H,N,d], W [B,H,d,r] -> [B,H,N,r]."""
    return np.einsum("bhnd,bhdr->bhnr", x, W)


def hash_codes(x, W):
    """Bits 1[<w_t, x> > 0] weighted 2^t, then looked up in the reflected table."""
    r = W.shape[-1]
    bins = ((projections(x, W) > 0).astype(np.int64) << np.arange(r)).sum(-1)
    return reflected_table(r)[bins]


def gather_rows(x, order):
    """x [B,H,N,e], order [B,H,N] -> x[b, h, order[b, h, t]]."""
    return np.take_along_axis(x, order[..., None], axis=2)


def heavy_part(q, k, vaug, sort_q, sort_k, bucket):
    """Block-diagonal part: sorted queries in blocks of N/nb, sorted keys in blocks of ``bucket``;
    exp(q.k) summed against the augmented values, returned in the original query order."""
    B, H, N, _ = q.shape
    nb = k.shape[2] // bucket
    bq = N // nb
    qs = gather_rows(q, sort_q).reshape(B, H, nb, bq, -1)
    ks = gather_rows(k, sort_k).reshape(B, H, nb, bucket, -1)
    vs = gather_rows(vaug, sort_k).reshape(B, H, nb, bucket, -1)
    block = np.einsum("bhcqk,bhcke->bhcqe", np.exp(np.einsum("bhcqd,bhckd->bhcqk", qs, ks)), vs)
    block = block.reshape(B, H, N, -1)
    return gather_rows(block, np.argsort(sort_q, axis=-1))  # back to the query order


def power_norm(gram, x0, iters):
    """The release's power method: normalise the start, iterate x <- Gx/|Gx|, return |G x| of the last step."""
    x = x0 / np.linalg.norm(x0, axis=-1, keepdims=True)
    for _ in range(iters):
        y = np.einsum("bhef,bhf->bhe", gram, x)
        x = y / np.linalg.norm(y, axis=-1, keepdims=True)
    return np.linalg.norm(y, axis=-1)


def sampled_part(q, k_sorted, vaug_sorted, sort_q, bucket, x0, u):
    """The sampled residual over the sorted keys: returns (P, λ, index, res [B,H,N,dv+1])."""
    B, H, N, _ = q.shape
    m = u.shape[-1]
    nb = k_sorted.shape[2] // bucket
    bq = N // nb
    lam = power_norm(np.einsum("bhne,bhnf->bhef", vaug_sorted, vaug_sorted), x0, POWER_ITERS)
    P = np.linalg.norm(vaug_sorted, axis=-1) / lam[..., None] + 1.0 / k_sorted.shape[2]
    P = P / np.abs(P).sum(-1, keepdims=True)
    cdf = np.cumsum(P, axis=-1)
    index = np.stack([np.stack([np.minimum(np.searchsorted(cdf[b, h], u[b, h], side="right"), N - 1)
                                for h in range(H)]) for b in range(B)])
    # keep[b, h, i, s] = 0 when query i belongs to the query block numbered index[s] // bucket
    keep = np.ones((B, H, m, N))
    members = sort_q.reshape(B, H, nb, bq)
    for b in range(B):
        for h in range(H):
            for s in range(m):
                keep[b, h, s, members[b, h, index[b, h, s] // bucket]] = 0.0
    keep = keep.transpose(0, 1, 3, 2)
    k_pick = np.take_along_axis(k_sorted, index[..., None], axis=2)
    v_pick = np.take_along_axis(vaug_sorted, index[..., None], axis=2)
    weight = 1.0 / (np.take_along_axis(P, index, axis=-1) * m)
    a_pick = np.exp(np.einsum("bhnd,bhsd->bhns", q, k_pick)) * keep
    res = np.einsum("bhns,bhse->bhne", a_pick, weight[..., None] * v_pick)
    return P, lam, index, res


def release_forward(q, k, v, W, x0, u, bucket):
    """The released forward on [B,H,N,·] inputs, the caller's d^-1/4 per side applied first. Returns a dict of
    the intermediates and the output."""
    d = q.shape[-1]
    temp = d**-0.5
    q = q * np.sqrt(temp)
    k = k * np.sqrt(temp)
    code_q, code_k = hash_codes(q, W), hash_codes(k, W)
    sort_k = np.argsort(code_k, axis=-1, kind="stable")
    sort_q = np.argsort(code_q, axis=-1, kind="stable")
    vaug = np.concatenate([v, np.ones(v.shape[:-1] + (1,))], axis=-1)
    sparse = heavy_part(q, k, vaug, sort_q, sort_k, bucket)
    P, lam, index, res = sampled_part(q, gather_rows(k, sort_k), gather_rows(vaug, sort_k), sort_q, bucket, x0, u)
    total = sparse + res
    out = total[..., :-1] / total[..., -1:]
    return dict(code_q=code_q, code_k=code_k, sort_q=sort_q, sort_k=sort_k, lam=lam, P=P, index=index,
                sparse=sparse, res=res, out=out)


def draw_case(spec):
    """Inputs and the release's draws for one case (fp32 inputs and projections, as a float32 layer sees)."""
    rng = np.random.default_rng(spec["seed"])
    B, H, N, d, dv, r, m = (spec[n] for n in ("B", "H", "N", "d", "dv", "projs", "samples"))
    q = rng.standard_normal((B, H, N, d)).astype(np.float32)
    k = rng.standard_normal((B, H, N, d)).astype(np.float32)
    v = (rng.standard_normal((B, H, N, dv)) + 0.5).astype(np.float32)
    W = rng.standard_normal((B, H, d, r)).astype(np.float32)
    x0 = rng.standard_normal((B, H, dv + 1))
    u = rng.uniform(size=(B, H, m))
    return q, k, v, W, x0, u


def build() -> dict[str, np.ndarray]:
    arrays = {"commit": np.array(COMMIT)}
    for case, spec in CASES.items():
        q, k, v, W, x0, u = draw_case(spec)
        f64 = lambda a: a.astype(np.float64)  # noqa: E731
        margin = min(np.abs(projections(f64(x), f64(W))).min() for x in (q, k))
        if margin < MARGIN:
            raise SystemExit(f"{case}: a projection within {margin:.2g} of zero; choose another seed")
        got = release_forward(f64(q), f64(k), f64(v), f64(W), x0, u, spec["bucket"])
        stored = dict(q=q, k=k, v=v, W=W, x0=x0, u=u, **got)
        arrays.update({f"{case}/{name}": value for name, value in stored.items()})
    return arrays


def main():
    arrays = build()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT.relative_to(ROOT)} ({OUT.stat().st_size} bytes, {len(arrays)} arrays)")


if __name__ == "__main__":
    main()
