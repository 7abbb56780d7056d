"""Release fixture for Transformer-VQ: a NumPy (float64) port of the released causal VQ-attention forward.

Follows the official JAX release, github.com/transformer-vq/transformer_vq, branch ``main`` at commit
21943e4eea124fa1eec0939a24f36cfa6fe9c499, files

* ``src/transformer_vq/nn/attn.py`` -- ``VQAttention``: ``get_q`` / ``get_kvg`` (RMS norm of q and k, scale
  tau^-1/2 with tau = sqrt(d_k)), ``get_xl_helpers`` (flipped sinusoid table of length mem_len + block_len, its
  dropout, ``r_proj``, scale tau^-1/2 on r, u and v), ``rel_shift``, ``get_causal_mask``, ``get_agg_biases``,
  ``attn`` (cache scores, recent scores, shared max, normalizer, values) and ``update_state`` (one-hot of the
  block leaving the band, count and running-mean update), ``initial_state``;
* ``src/transformer_vq/nn/vq.py`` -- ``LearnableVQ._get_codebook`` (c_sum / clip(c_count, 0.01)),
  ``get_shortcodes`` (argmin of ||k||^2 - 2 k.c + ||c||^2), ``get_codewords``;
* ``src/transformer_vq/nn/pe.py`` -- ``get_sinusoid_embs`` ([sin || cos], 1 / lam^(2k/width), flip);
* ``src/transformer_vq/nn/norm.py`` -- ``LayerNorm`` (RMS, eps 1e-6, no gain/bias for q and k);
* ``scripts/lm_enwik8.sh`` / README -- agg_cache = 1 and grad_thru_cache = 1 in the paper's runs (the latter
  changes only gradients, not this forward), mem_len = block_len.

The port runs the release's block recurrence (``model.py`` scans the attention over blocks of ``block_len``
tokens, carrying ``pos_offset``, the band ``xlcache`` and the compressive ``aggcache``) from the release's
initial state, in evaluation mode (no dropout), except the case ``dropsin`` which applies a fixed sinusoid-dropout
keep mask (the release draws it from the ``timeless`` rng; it is stored in the fixture) to the [M+L, d_model]
table before ``r_proj``.

It starts at the attention core's inputs: the projected, not yet normalized queries and keys
(``q_proj(x~)``, the key part of ``kvg_proj(x~)``), the values after their SiLU, in the [B, H, T, D] layout the
release transposes them to; and the parameters c_sum [H, S, Dk], c_count [H, S], u, v [H*Dk], r_proj's kernel
W_R [d_model, H*Dk]. The gate, the output projection and the residual are outside the core.

Cases (B = 2, H = 2 codebooks/heads, Dk = 8, Dv = 16, S = 8 codes, d_model = 12 (the sinusoid width),
lam = 1e5, L = block_len = 4, T = 24 = 6 blocks, float64):

* ``main``    -- mem_len M = 4 = L (the paper's setting), agg_cache on;
* ``short``   -- M = 2 < L;
* ``long``    -- M = 6 > L;
* ``dropsin`` -- ``main`` with a sinusoid-dropout keep mask, p_dropsin = 0.2.

Each case stores the output o [B, H, T, Dv], the codes z [B, H, T] and the final state (band k_hat, v, z;
aggcache mean ``upper_div_lower`` and count ``lower``; pos_offset). The codebook is chosen so that every key's
nearest code wins by a clear margin (checked below), so an fp32 argmin agrees with this fp64 one.

Regenerate (writes tests/fixtures/release/transformer_vq.npz):

    .venv/bin/python scripts/release_fixtures/transformer_vq.py
"""

from __future__ import annotations

import pathlib

import numpy as np

RELEASE_COMMIT = "21943e4eea124fa1eec0939a24f36cfa6fe9c499"
BIG = 1e30  # the release's stand-in for infinity in masks and empty-code biases
OUT = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "release" / "transformer_vq.npz"

B, H, DK, DV, S, DMODEL, LAM, L, T = 2, 2, 8, 16, 8, 12, 1e5, 4, 24
CASES = {"main": dict(M=4, p_drop=0.0), "short": dict(M=2, p_drop=0.0), "long": dict(M=6, p_drop=0.0),
         "dropsin": dict(M=4, p_drop=0.2)}


# ----------------------------------------------------------------------------- pieces of the release's forward
def rms(x, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def sin_table(n_pos, width, lam, flip):
    """Rows: positions 0..n_pos-1 (reversed when ``flip``); columns: sin of every frequency, then cos."""
    pos = np.arange(n_pos, dtype=np.float64)
    freq = 1.0 / lam ** (np.arange(0, width, 2, dtype=np.float64) / width)
    ang = pos[:, None] * freq[None, :]
    tab = np.concatenate([np.sin(ang), np.cos(ang)], axis=1)
    return tab[::-1] if flip else tab


def skew(scores):
    """Transformer-XL relative shift of [..., Lq, W]: one zero column on the left, view as [W+1, Lq], drop the
    first row, view as [Lq, W] again."""
    *lead, lq, w = scores.shape
    padded = np.concatenate([np.zeros((*lead, lq, 1)), scores], axis=-1)
    return padded.reshape(*lead, w + 1, lq)[..., 1:, :].reshape(*lead, lq, w)


def band_mask(M, invalid, local):
    """[L, M+L] keep mask over (band ++ block) keys for the block's queries: allocated slots (j >= invalid),
    causal (j - M <= i), and with ``local`` also j >= i (distance M + i - j <= M)."""
    i = np.arange(L)[:, None]
    j = np.arange(M + L)[None, :]
    keep = (j >= invalid) & (j - M <= i)
    if local:
        keep &= j >= i
    return keep


def nearest_code(k, C):
    """k [B,H,n,Dk], C [H,S,Dk] -> codes z [B,H,n] (argmin of the expanded squared distance), the distances."""
    d2 = (np.sum(k * k, -1)[..., None] - 2.0 * np.einsum("bhnk,hsk->bhns", k, C)
          + np.sum(C * C, -1)[None, :, None, :])
    return np.argmin(d2, axis=-1), d2


def initial_state(M):
    return {"pos": 0,
            "z": np.full((B, H, M), S, np.int64),  # code S = "no code": its one-hot is the zero vector
            "k_hat": np.zeros((B, H, M, DK)), "v": np.zeros((B, H, M, DV)),
            "mean": np.zeros((B, H, S, DV)), "count": np.zeros((B, H, S))}


def block_step(state, q, k, v, C, r, u, vb, M):
    """One block of L queries: q, k [B,H,L,Dk] normalized and scaled; v [B,H,L,Dv]; r [H, M+L, Dk] (flipped,
    scaled); u, vb [1,H,1,Dk] scaled. Returns (o [B,H,L,Dv], z [B,H,L], new state)."""
    z, _ = nearest_code(k, C)
    k_hat = np.take_along_axis(C[None], z[..., None], axis=2)  # the forward value of sg(c_z) + st(k)
    rz = np.concatenate([state["z"], z], axis=-1)
    rk = np.concatenate([state["k_hat"], k_hat], axis=-2)
    rv = np.concatenate([state["v"], v], axis=-2)

    qu, qv = q + u, q + vb
    cnt = state["count"]
    code_bias = np.where(cnt == 0, -BIG, np.log(np.maximum(cnt, 1.0)))
    s_cache = np.einsum("bhlk,hsk->bhls", qu, C) + code_bias[..., None, :]

    invalid = max(M - state["pos"], 0)
    s_ac = np.einsum("bhlk,bhwk->bhlw", qu, rk)
    s_bd = skew(np.einsum("bhlk,hwk->bhlw", qv, r)) * band_mask(M, invalid, local=True)
    keep = band_mask(M, invalid, local=False).astype(np.float64)  # agg_cache on: the whole band is attended
    s_rec = (s_ac + s_bd) * keep - BIG * (1.0 - keep)

    top = np.maximum(s_cache.max(-1), s_rec.max(-1))[..., None]
    a_cache, a_rec = np.exp(s_cache - top), np.exp(s_rec - top)
    den = (a_rec.sum(-1) + a_cache.sum(-1))[..., None]
    o = np.einsum("bhlw,bhwv->bhlv", a_rec / den, rv) + np.einsum("bhls,bhsv->bhlv", a_cache / den, state["mean"])

    # the oldest L of the M+L recent entries leave the band and join the per-code running means
    leaving = rz[..., :L]
    onehot = (leaving[..., None] == np.arange(S)).astype(np.float64)  # code S -> all zeros
    new_cnt = cnt + onehot.sum(-2)
    keep_old = cnt / np.maximum(new_cnt, 1.0)
    add = onehot / np.maximum(new_cnt, 1.0)[..., None, :]
    new_mean = keep_old[..., None] * state["mean"] + np.einsum("bhls,bhlv->bhsv", add, rv[..., :L, :])
    new = {"pos": state["pos"] + L, "z": rz[..., -M:], "k_hat": rk[..., -M:, :], "v": rv[..., -M:, :],
           "mean": new_mean, "count": new_cnt}
    return o, z, new


def release_forward(q_pre, k_pre, v, c_sum, c_count, u, vb, W_R, M, keep_sin=None, p_drop=0.0):
    """The whole sequence, block by block from the initial state. keep_sin: [M+L, d_model] bool keep mask of the
    (flipped) sinusoid table, applied as inverted dropout with rate p_drop."""
    scale = DK ** -0.25  # tau^-1/2, tau = sqrt(d_k)
    C = c_sum / np.maximum(c_count[..., None], 0.01)
    q, k = rms(q_pre) * scale, rms(k_pre) * scale
    tab = sin_table(M + L, DMODEL, LAM, flip=True)
    if keep_sin is not None:
        tab = np.where(keep_sin, tab / (1.0 - p_drop), 0.0)
    r = (tab @ W_R).reshape(M + L, H, DK).transpose(1, 0, 2) * scale
    uu = u.reshape(1, H, 1, DK) * scale
    vv = vb.reshape(1, H, 1, DK) * scale
    state = initial_state(M)
    outs, codes = [], []
    for n in range(T // L):
        sl = slice(n * L, (n + 1) * L)
        o, z, state = block_step(state, q[:, :, sl], k[:, :, sl], v[:, :, sl], C, r, uu, vv, M)
        outs.append(o)
        codes.append(z)
    return np.concatenate(outs, axis=2), np.concatenate(codes, axis=2), state, (q, k, C)


# ----------------------------------------------------------------------------- inputs and the fixture
def make_inputs(seed=0):
    rng = np.random.default_rng(seed)
    q_pre = rng.normal(size=(B, H, T, DK))
    k_pre = rng.normal(size=(B, H, T, DK))
    v_pre = rng.normal(size=(B, H, T, DV))
    v = v_pre / (1.0 + np.exp(-v_pre))  # SiLU, as get_kvg applies it
    # codewords: six on the sphere of normalized keys (radius Dk^1/4), two far away (never chosen: empty codes)
    dirs = rng.normal(size=(H, S, DK))
    dirs /= np.linalg.norm(dirs, axis=-1, keepdims=True)
    radius = np.full((H, S), DK ** 0.25)
    radius[:, -2:] = 12.0
    codes = dirs * radius[..., None]
    # counts on both sides of the 0.01 clip; c_sum = codeword * clip(count) so c_sum / clip(count) = codeword
    c_count = rng.choice([0.003, 0.5, 1.0, 2.5, 7.0], size=(H, S))
    c_sum = codes * np.maximum(c_count, 0.01)[..., None]
    u = 0.5 * rng.normal(size=(H * DK,))
    vb = 0.5 * rng.normal(size=(H * DK,))
    W_R = rng.normal(size=(DMODEL, H * DK)) / np.sqrt(DMODEL)
    keep_sin = rng.random(size=(CASES["dropsin"]["M"] + L, DMODEL)) >= CASES["dropsin"]["p_drop"]
    return dict(q=q_pre, k=k_pre, v=v, c_sum=c_sum, c_count=c_count, u=u, v_bias=vb, W_R=W_R,
                dropsin_keep=keep_sin)


def margin(k, C):
    """Smallest gap, over all keys, between the nearest and the second-nearest code's squared distance."""
    _, d2 = nearest_code(k, C)
    two = np.sort(d2, axis=-1)[..., :2]
    return float(np.min(two[..., 1] - two[..., 0]))


def main():
    for seed in range(100):
        inp = make_inputs(seed)
        _, _, _, (q, k, C) = release_forward(inp["q"], inp["k"], inp["v"], inp["c_sum"], inp["c_count"], inp["u"],
                                             inp["v_bias"], inp["W_R"], M=4)
        if margin(k, C) > 0.05:
            break
    else:
        raise RuntimeError("no seed with a clear nearest-code margin")
    out = {f"in_{name}": val for name, val in inp.items()}
    out["meta"] = np.array([B, H, DK, DV, S, DMODEL, L, T])
    out["lam"] = np.array(LAM)
    out["seed"] = np.array(seed)
    out["release_commit"] = np.array(RELEASE_COMMIT)
    for case, spec in CASES.items():
        M = spec["M"]
        keep = inp["dropsin_keep"] if spec["p_drop"] > 0 else None
        o, z, st, _ = release_forward(inp["q"], inp["k"], inp["v"], inp["c_sum"], inp["c_count"], inp["u"],
                                      inp["v_bias"], inp["W_R"], M=M, keep_sin=keep, p_drop=spec["p_drop"])
        out[f"{case}_M"] = np.array(M)
        out[f"{case}_p_dropsin"] = np.array(spec["p_drop"])
        out[f"{case}_o"] = o
        out[f"{case}_z"] = z
        for name in ("pos", "z", "k_hat", "v", "mean", "count"):
            out[f"{case}_state_{name}"] = np.asarray(st[name])
        used = int((st["count"] > 0).sum())
        print(f"{case}: M={M} |o|max={np.abs(o).max():.3f} codes in the cache {used}/{B * H * S} "
              f"seed={seed} margin={margin(k, C):.3f}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
