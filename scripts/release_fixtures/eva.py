"""A NumPy (float64) port of the released EVA forward passes, and the generator of the fidelity fixture
``tests/fixtures/release/eva.npz``.

Follows ``HKUNLP/efficient-attention`` at commit ``531ff5169b56fcec9d0a361125cffb62ab5e8781``:

* ``efficient-attention/efficient_attention/causal_eva.py`` -- ``CausalEVAttention.forward``, the training and
  evaluation branch (no incremental state), its ``prm_projection``, ``T5RelativePositionBias`` (one table shared
  by the heads) and ``causal_window_1d_partition``;
* ``efficient-attention/efficient_attention/eva.py`` -- ``EVA.forward`` (1-D, bidirectional), with the
  per-head ``T5RelativePositionBias`` of that file, and what it inherits: ``local_attention.py``
  (``LocalAttention.window_partition``), ``abstract_attention.py`` (``MultiheadAttention.proj_and_split_heads``:
  one fused q/k/v projection), ``attn_utils.py`` (``pad_to_multiple``, ``window_1d_partition``,
  ``prm_projection``).

The port re-derives each step in its own terms and keeps the release's order of operations and index
conventions: the input is padded to whole blocks *before* the projections, padded positions are masked with the
release's finite ``-5e4``, chunk means divide by the chunk size, the relative-position buckets are taken from
in-window indices with the release's float32 logarithm, and the causal chunk mask hides every chunk from the
query's own chunk on. Attention dropout is zero and the layers are run in both modes: evaluation (``ω = µ``)
and training (``ω = µ + ε`` with the stored standard-normal draws ``ε`` standing in for ``torch.randn_like``).

Cases (batch 2, 2 heads of 8, model width 16, random non-trivial weights for every parameter, LayerNorm affine
parameters and the bias tables included):

* ``causal``: causal layer, 60 tokens (padded to 64), window 16, chunk size 4, no overlap, ``adaptive_proj='qk'``,
  T5 bias (16 buckets, maximal distance 16, so the logarithmic buckets are reached);
* ``causal_ovl``: causal layer, 40 tokens, window 8, chunk size 4, ``overlap_window`` (the window reaches 8 keys
  further left), no relative bias (the release indexes it by in-window position, see the test's docstring);
* ``bidir``: bidirectional layer, 30 tokens (padded to 32), window 8, 8 landmarks (chunks of 4), no overlap,
  ``adaptive_proj='default'`` (Linear + LayerNorm), T5 bias per head (8 buckets a side, maximal distance 8).

Stored per case ``<case>/...``: the input ``x`` [B, T, D], every weight in the release's layout (``nn.Linear``:
``[out, in]``), the draws ``eps`` [B, H, C, d], the per-head projections ``q, k, v`` [B, H, T, d], the head outputs
before the output projection ``heads_eval``, ``heads_train`` [B, H, T, d] (what an attention core returns; the
output projection ``o_w, o_b`` is stored, its result is not, to keep the file small).

Regenerate (deterministic; no torch needed)::

    .venv/bin/python scripts/release_fixtures/eva.py
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "release" / "eva.npz"
MASKED = -5e4  # the release's fill value for masked logits
COMMIT = "531ff5169b56fcec9d0a361125cffb62ab5e8781"


# ---------------------------------------------------------------------------------------------------------------
# small pieces
# ---------------------------------------------------------------------------------------------------------------


def dense(x, weight, bias):
    """nn.Linear with a [out, in] weight."""
    return np.einsum("...i,oi->...o", x, weight) + bias


def norm_last(x, gain, shift, eps=1e-5):
    """nn.LayerNorm over the last axis (biased variance)."""
    centred = x - x.mean(axis=-1, keepdims=True)
    var = (centred**2).mean(axis=-1, keepdims=True)
    return centred / np.sqrt(var + eps) * gain + shift


def softmax_last(x):
    z = x - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def pad_rows(x, multiple, axis):
    """Zero-pad ``axis`` at the end to a multiple; also returns the padded-position flags [N]."""
    n = x.shape[axis]
    total = -(-n // multiple) * multiple
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, total - n)
    return np.pad(x, widths), np.arange(total) >= n


def group_rows(x, size, before=0, after=0, fill=0.0):
    """[..., N, f] -> [..., N/size, before+size+after, f]: group g holds rows g*size-before .. (g+1)*size+after-1,
    rows outside [0, N) take ``fill``."""
    n = x.shape[-2]
    widths = [(0, 0)] * (x.ndim - 2) + [(before, after), (0, 0)]
    xp = np.pad(x, widths, constant_values=fill)
    starts = np.arange(n // size) * size
    idx = starts[:, None] + np.arange(before + size + after)[None, :]
    return xp[..., idx, :]


def heads_split(x, heads):
    b, n, width = x.shape
    return x.reshape(b, n, heads, width // heads).transpose(0, 2, 1, 3)


def heads_merge(x):
    b, h, n, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, n, h * d)


def bucket_of(offset, *, one_sided, n_buckets, far):
    """The release's T5 bucket of ``offset = key index - query index`` (int array), its arithmetic in float32."""
    back = -offset
    base = np.zeros_like(back)
    if one_sided:
        dist = np.maximum(back, 0)
    else:
        n_buckets //= 2
        base = np.where(back < 0, n_buckets, 0)
        dist = np.abs(back)
    exact = n_buckets // 2
    ratio = np.maximum(dist, 1).astype(np.float32) / np.float32(exact)
    scaled = np.log(ratio) / np.float32(math.log(far / exact)) * np.float32(n_buckets - exact)
    large = np.minimum(exact + np.trunc(scaled).astype(np.int64), n_buckets - 1)
    return base + np.where(dist < exact, dist, large)


def t5_bias(table, n_q, n_k, *, one_sided, far, scale):
    """Bias [H_t, n_q, n_k] from in-window indices 0..n_q-1 (queries) and 0..n_k-1 (keys); table [n_buckets, H_t]."""
    offset = np.arange(n_k)[None, :] - np.arange(n_q)[:, None]
    b = bucket_of(offset, one_sided=one_sided, n_buckets=table.shape[0], far=far)
    return scale * np.moveaxis(table[b], -1, 0)


def rf_exponent(keys, omega):
    """The release's unnormalised random-feature exponent: d^-1/2 (ω·k) - d^-1/2 |k|^2 / 2. keys [..., P, d],
    omega [..., d] -> [..., P]."""
    s = keys.shape[-1] ** -0.5
    return np.einsum("...d,...pd->...p", omega, s * keys) - s * (keys**2).sum(-1) / 2.0


# ---------------------------------------------------------------------------------------------------------------
# the two forwards
# ---------------------------------------------------------------------------------------------------------------


def causal_forward(x, w, cfg, eps=None):
    """CausalEVAttention.forward (self-attention on x [B, T, D]); eps None: evaluation."""
    H, W, P = cfg["heads"], cfg["window"], cfg["chunk"]
    ext = W if cfg["overlap"] else 0
    B, T, D = x.shape
    d = D // H
    s = d**-0.5
    xp, padded = pad_rows(x, W, axis=1)
    N = xp.shape[1]
    q, k, v = (heads_split(dense(xp, w[f"{n}_w"], w[f"{n}_b"]), H) for n in ("q", "k", "v"))
    pad_col = np.broadcast_to(padded[None, None, :, None], (B, 1, N, 1)).astype(np.float64)

    bq = group_rows(q, W)
    bk, bv = group_rows(k, W, before=ext), group_rows(v, W, before=ext)

    # chunk statistics
    cq, ck, cv = (group_rows(t, P) for t in (q, k, v))
    cmask = group_rows(pad_col, P, fill=1.0) > 0.5  # [B, 1, C, P, 1]
    cq, ck, cv = (np.where(cmask, 0.0, t) for t in (cq, ck, cv))
    q_rep = norm_last(dense(cq.mean(-2), w["mq_w"], w["mq_b"]), w["mq_g"], w["mq_s"])
    k_rep = norm_last(dense(ck.mean(-2), w["mk_w"], w["mk_b"]), w["mk_g"], w["mk_s"])
    centre = q_rep + k_rep
    omega = centre if eps is None else centre + eps
    expo = np.where(cmask[..., 0], MASKED, rf_exponent(ck, omega))
    beta = np.einsum("bhcp,bhcpd->bhcd", softmax_last(expo), cv)

    # chunk logits and the chunk-level causal mask (hidden from the query's own chunk on)
    chunk_logit = np.einsum("bhgid,bhcd->bhgic", bq, s * k_rep)
    C = N // P
    hide = np.arange(C)[None, None, :] >= np.arange(C)[:, None, None]  # [c_query, slot, c_key]
    hide = np.broadcast_to(hide, (C, P, C)).reshape(N, C).reshape(N // W, W, C)
    chunk_logit = np.where(hide, MASKED, chunk_logit)

    # local logits
    q_pad = group_rows(pad_col, W, fill=1.0) > 0.5  # [B, 1, G, W, 1]
    k_pad = np.swapaxes(group_rows(pad_col, W, before=ext, fill=1.0) > 0.5, -1, -2)  # [B, 1, G, 1, W+ext]
    local = np.einsum("bhgie,bhgje->bhgij", bq, bk) * s
    if cfg["rpe"]:
        local = local + t5_bias(w["rpe"], W, W + ext, one_sided=True, far=W + ext, scale=s)[None, :, None]
    local = np.where(q_pad | k_pad, MASKED, local)
    future = np.arange(W + ext)[None, :] > np.arange(W)[:, None] + ext
    local = np.where(future, MASKED, local)

    probs = softmax_last(np.concatenate([local, chunk_logit], axis=-1))
    p_loc, p_ch = probs[..., : W + ext], probs[..., W + ext:]
    o = np.einsum("bhgij,bhgjd->bhgid", p_loc, bv) + np.einsum("bhgic,bhcd->bhgid", p_ch, beta)
    heads = o.reshape(B, H, N, d)
    out = dense(heads_merge(heads), w["o_w"], w["o_b"])[:, :T]
    return heads[:, :, :T], out, (q[:, :, :T], k[:, :, :T], v[:, :, :T])


def bidir_forward(x, w, cfg, eps=None):
    """EVA.forward, 1-D, no overlap window (x [B, T, D]); eps None: evaluation."""
    H, W, C = cfg["heads"], cfg["window"], cfg["landmarks"]
    B, T, D = x.shape
    d = D // H
    s = d**-0.5
    xp, padded = pad_rows(x, W, axis=1)
    N = xp.shape[1]
    fused = dense(xp, w["qkv_w"], w["qkv_b"]).reshape(B, N, 3, H, d).transpose(2, 0, 3, 1, 4)
    q, k, v = fused[0], fused[1], fused[2]
    pad_col = np.broadcast_to(padded[None, None, :, None], (B, 1, N, 1)).astype(np.float64)

    bq, bk, bv = group_rows(q, W), group_rows(k, W), group_rows(v, W)

    P = N // C
    cq, ck, cv = (group_rows(t, P) for t in (q, k, v))
    cmask = group_rows(pad_col, P, fill=1.0) > 0.5
    cq, ck, cv = (np.where(cmask, 0.0, t) for t in (cq, ck, cv))
    q_rep = norm_last(dense(cq.mean(-2), w["mq_w"], w["mq_b"]), w["mq_g"], w["mq_s"])
    k_rep = norm_last(dense(ck.mean(-2), w["mk_w"], w["mk_b"]), w["mk_g"], w["mk_s"])
    centre = 0.5 * (q_rep + k_rep)
    omega = centre if eps is None else centre + eps
    expo = np.where(cmask[..., 0], MASKED, rf_exponent(ck, omega))
    beta = np.einsum("bhcp,bhcpd->bhcd", softmax_last(expo), cv)

    chunk_logit = np.einsum("bhgid,bhcd->bhgic", bq, s * k_rep)  # every chunk visible

    k_pad = np.swapaxes(group_rows(pad_col, W, fill=1.0) > 0.5, -1, -2)
    local = np.einsum("bhgie,bhgje->bhgij", bq, bk) * s
    local = local + t5_bias(w["rpe"], W, W, one_sided=False, far=W, scale=s)[None, :, None]
    local = np.where(k_pad, MASKED, local)

    probs = softmax_last(np.concatenate([local, chunk_logit], axis=-1))
    p_loc, p_ch = probs[..., :W], probs[..., W:]
    o = np.einsum("bhgij,bhgjd->bhgid", p_loc, bv) + np.einsum("bhgic,bhcd->bhgid", p_ch, beta)
    heads = o.reshape(B, H, N, d)
    out = dense(heads_merge(heads), w["o_w"], w["o_b"])[:, :T]
    return heads[:, :, :T], out, (q[:, :, :T], k[:, :, :T], v[:, :, :T])


# ---------------------------------------------------------------------------------------------------------------
# fixture
# ---------------------------------------------------------------------------------------------------------------

CASES = {
    "causal": dict(kind="causal", batch=2, heads=2, width=16, length=60, window=16, chunk=4, overlap=False, rpe=True),
    "causal_ovl": dict(kind="causal", batch=2, heads=2, width=16, length=40, window=8, chunk=4, overlap=True,
                       rpe=False),
    "bidir": dict(kind="bidir", batch=2, heads=2, width=16, length=30, window=8, landmarks=8),
}


def rpe_buckets(window, ext):
    return max(min(int((window + ext) / 2), 64), 16)


def make_weights(rng, cfg):
    D, H = cfg["width"], cfg["heads"]
    d = D // H
    lin = lambda o, i: (rng.uniform(-1, 1, (o, i)) * math.sqrt(6.0 / (o + i)), 0.1 * rng.standard_normal(o))  # noqa: E731
    w = {}
    if cfg["kind"] == "causal":
        for n in ("q", "k", "v"):
            w[f"{n}_w"], w[f"{n}_b"] = lin(D, D)
    else:
        w["qkv_w"], w["qkv_b"] = lin(3 * D, D)
    w["o_w"], w["o_b"] = lin(D, D)
    for n in ("mq", "mk"):
        w[f"{n}_w"], w[f"{n}_b"] = lin(d, d)
        w[f"{n}_g"] = 1.0 + 0.3 * rng.standard_normal(d)
        w[f"{n}_s"] = 0.3 * rng.standard_normal(d)
    if cfg["kind"] == "causal":
        if cfg["rpe"]:
            ext = cfg["window"] if cfg["overlap"] else 0
            w["rpe"] = rng.standard_normal((rpe_buckets(cfg["window"], ext), 1))
    else:
        w["rpe"] = rng.standard_normal((rpe_buckets(cfg["window"], 0), H))
    return w


def build(seed=0):
    rng = np.random.default_rng(seed)
    arrays = {"commit": np.array(COMMIT)}
    for name, cfg in CASES.items():
        B, T, D, H, W = cfg["batch"], cfg["length"], cfg["width"], cfg["heads"], cfg["window"]
        N = -(-T // W) * W
        C = N // cfg["chunk"] if cfg["kind"] == "causal" else cfg["landmarks"]
        w = make_weights(rng, cfg)
        x = rng.standard_normal((B, T, D))
        eps = rng.standard_normal((B, H, C, D // H))
        fwd = causal_forward if cfg["kind"] == "causal" else bidir_forward
        heads_eval, _, (q, k, v) = fwd(x, w, cfg)
        heads_train, _, _ = fwd(x, w, cfg, eps)
        arrays.update({f"{name}/{key}": val for key, val in w.items()})
        arrays.update({f"{name}/x": x, f"{name}/eps": eps, f"{name}/q": q, f"{name}/k": k, f"{name}/v": v,
                       f"{name}/heads_eval": heads_eval, f"{name}/heads_train": heads_train})
    return arrays


def main():
    arrays = build()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT.relative_to(ROOT)} ({OUT.stat().st_size} bytes, {len(arrays)} arrays)")


if __name__ == "__main__":
    main()
