"""Release fixture for FMA: a NumPy (float64) port of the authors' released causal forward, and the generator of
``tests/fixtures/release/fma.npz``.

Follows GitHub yanmingk/FMA at commit 66c689a32a67ca1a43c6382ce0894f34155f9714 (its only commit):

* ``mha.py`` -- ``MHA``: L = log2(n/m) - 1 coarse levels; ``convolute`` (per-level ``groupedconv`` downsampling:
  a depthwise strided Conv1d d -> p d, kernel = stride = m 2^(l-1), out channel f p + r, viewed as
  (d, p, groups) and transposed to summary row G p + r); ``stage1`` (one max over all levels, exp-sums, the
  ``scale_attn`` factor (m 2^(l-1)) // p on coarse levels, one normaliser); ``stage2`` (values); ``forward``
  (Q / sqrt(d) first). Heads are folded into the batch, so the conv weights are shared across heads.
* ``qk_fine.py``, ``cv_fine.py`` -- the 2m-wide banded products against keys/values padded in front with m zero
  rows: slot j of query i reads padded row m floor(i/m) + j, masked where j > (i mod m) + m.
* ``qk_coarse.py``, ``cv_coarse.py`` -- the 2p-wide coarse products against summaries padded in front with 2p
  zero rows: slot j of query i reads padded row 2p floor(i / 2w) + j (w = m_l), kept where
  floor((i mod 2w) / w) >= floor(j / p) (the parity mask).
* ``configs.py`` -- MASKVAL; a masked score is the reduction over d of MASKVAL / (d + 1), i.e. d MASKVAL/(d+1).

The zero rows the kernels pad with are not masked (score 0, value 0): they are kept here, as released.
Dropout is off (``training=False``); the forward then makes no random draw. The conv parameters are drawn here
with PyTorch's Conv1d default law (U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = m_l) from a NumPy generator and
stored in the release's (torch) layout: weight [p d, 1, m_l], bias [p d].

Configuration: batch 1, 2 heads (folded: 2 rows of the release's batch), n = T = 64, m = 4, p = 2, d = 8, so
L = 3 coarse levels with groups of 4, 8 and 16; ``downsampling='groupedconv'``; both ``scale_attn`` values
(True is longctx's ``multiplicity_weighting``). Also the same layer (block_size 64, 3 levels) run on the
first T = 32 tokens (``out_short_*``): the release still runs its third level, whose queries then all read only
the zero chunk.

Regenerate: ``.venv/bin/python scripts/release_fixtures/fma.py``
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

RELEASE_COMMIT = "66c689a32a67ca1a43c6382ce0894f34155f9714"
MASKVAL = -65504.0
SEED = 20240611
BATCH, HEADS, N, M, P, D = 1, 2, 64, 4, 2, 8
N_SHORT = 32  # a shorter input to the same layer (block_size N)
OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "release" / "fma.npz"


def coarse_levels(n: int, m: int) -> int:
    return int(math.log2(n // m)) - 1


def masked_score(d: int) -> float:
    """The value a masked slot holds: each of the d reduction terms is MASKVAL / (d + 1)."""
    return d * (MASKVAL / (d + 1))


def depthwise_strided_conv(x, weight, bias, width: int, p: int):
    """x [b, n, d] -> summaries [b, (n // width) p, d], row G p + r (the release's view/transpose/reshape)."""
    b, n, d = x.shape
    groups = n // width
    xg = x[:, : groups * width].reshape(b, groups, width, d)  # [b, G, t, f]
    wt = weight[:, 0, :].reshape(d, p, width)  # out channel f p + r -> [f, r, t]
    out = np.einsum("bgtf,frt->bgrf", xg, wt) + bias.reshape(d, p).T[None, None]  # [b, G, r, f]
    return out.reshape(b, groups * p, d)


def fine_scores(q, k, m: int):
    """[b, n, 2m]: slot j of query i against padded key m floor(i/m) + j; masked where j > (i mod m) + m."""
    b, n, d = q.shape
    kp = np.concatenate([np.zeros((b, m, d)), k], axis=1)
    out = np.empty((b, n, 2 * m))
    for i in range(n):
        base = m * (i // m)
        for j in range(2 * m):
            if j > (i % m) + m:
                out[:, i, j] = masked_score(d)
            else:
                out[:, i, j] = np.einsum("bf,bf->b", q[:, i], kp[:, base + j])
    return out


def coarse_scores(q, ks, p: int):
    """[b, n, 2p]: slot j of query i against padded summary 2p floor(i / 2w) + j; kept where the half
    floor(j/p) is at most the query's parity floor((i mod 2w) / w)."""
    b, n, d = q.shape
    w = p * n // ks.shape[1]
    kp = np.concatenate([np.zeros((b, 2 * p, d)), ks], axis=1)
    out = np.empty((b, n, 2 * p))
    for i in range(n):
        parity = (i % (2 * w)) // w
        for j in range(2 * p):
            if parity >= j // p:
                out[:, i, j] = np.einsum("bf,bf->b", q[:, i], kp[:, 2 * p * (i // (2 * w)) + j])
            else:
                out[:, i, j] = masked_score(d)
    return out


def fine_values(c, v, m: int):
    b, n, _ = c.shape
    vp = np.concatenate([np.zeros((b, m, v.shape[2])), v], axis=1)
    out = np.zeros((b, n, v.shape[2]))
    for i in range(n):
        for j in range(2 * m):
            if j <= (i % m) + m:
                out[:, i] += c[:, i, j, None] * vp[:, m * (i // m) + j]
    return out


def coarse_values(c, vs, p: int):
    b, n, _ = c.shape
    w = p * n // vs.shape[1]
    vp = np.concatenate([np.zeros((b, 2 * p, vs.shape[2])), vs], axis=1)
    out = np.zeros((b, n, vs.shape[2]))
    for i in range(n):
        parity = (i % (2 * w)) // w
        for j in range(2 * p):
            if parity >= j // p:
                out[:, i] += c[:, i, j, None] * vp[:, 2 * p * (i // (2 * w)) + j]
    return out


def release_forward(q, k, v, conv_k, conv_v, *, m: int, p: int, block_size: int, scale_attn: bool):
    """The released causal forward on heads-folded q, k, v [b, n, d]; conv_k / conv_v: per level (weight, bias)."""
    d = q.shape[2]
    L = coarse_levels(block_size, m)
    q = q / math.sqrt(d)
    ks, vs = [k], [v]
    for l in range(L):
        width = m * 2**l
        ks.append(depthwise_strided_conv(k, *conv_k[l], width, p))
        vs.append(depthwise_strided_conv(v, *conv_v[l], width, p))
    scores = [fine_scores(q, ks[0], m)] + [coarse_scores(q, ks[l], p) for l in range(1, L + 1)]
    top = np.max(np.stack([s.max(axis=2) for s in scores], axis=2), axis=2, keepdims=True)
    mult = [1] + [(m * 2 ** (l - 1)) // p if scale_attn else 1 for l in range(1, L + 1)]
    expd = [np.exp(s - top) for s in scores]
    total = sum(mult[l] * expd[l].sum(axis=2, keepdims=True) for l in range(L + 1))
    weights = [mult[l] * expd[l] / total for l in range(L + 1)]
    out = fine_values(weights[0], vs[0], m)
    for l in range(1, L + 1):
        out = out + coarse_values(weights[l], vs[l], p)
    return out


def main():
    rng = np.random.default_rng(SEED)
    L = coarse_levels(N, M)
    def f32_exact(x):  # stored as float32; the port runs in float64 on exactly those values
        return x.astype(np.float32).astype(np.float64)

    q, k, v = (f32_exact(rng.standard_normal((BATCH, HEADS, N, D))) for _ in range(3))
    arrays = {"q": q, "k": k, "v": v}
    conv = {"k": [], "v": []}
    for l in range(L):
        width = M * 2**l
        bound = 1.0 / math.sqrt(width)  # torch Conv1d default: fan_in = (in_channels / groups) * kernel_size
        for name in ("k", "v"):
            weight = f32_exact(rng.uniform(-bound, bound, (P * D, 1, width)))
            bias = f32_exact(rng.uniform(-bound, bound, (P * D,)))
            conv[name].append((weight, bias))
            arrays[f"conv_{name}_{l + 1}_weight"] = weight
            arrays[f"conv_{name}_{l + 1}_bias"] = bias

    def folded(x):
        return x.reshape(BATCH * HEADS, x.shape[2], D)

    for scale_attn in (True, False):
        out = release_forward(folded(q), folded(k), folded(v), conv["k"], conv["v"], m=M, p=P, block_size=N,
                              scale_attn=scale_attn)
        arrays[f"out_scale_attn_{int(scale_attn)}"] = out.reshape(BATCH, HEADS, N, D)
        # the same layer (block_size N, L levels) on a shorter input: its top level then holds only zero slots
        short = release_forward(folded(q[:, :, :N_SHORT]), folded(k[:, :, :N_SHORT]), folded(v[:, :, :N_SHORT]),
                                conv["k"], conv["v"], m=M, p=P, block_size=N, scale_attn=scale_attn)
        arrays[f"out_short_scale_attn_{int(scale_attn)}"] = short.reshape(BATCH, HEADS, N_SHORT, D)
    arrays["config"] = np.array([N, M, P, D, HEADS, L])
    arrays["maskval"] = np.array(MASKVAL)
    arrays = {key: (val.astype(np.float32) if key in ("q", "k", "v") or key.startswith("conv_") else val)
              for key, val in arrays.items()}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, release_commit=np.array(RELEASE_COMMIT), **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
