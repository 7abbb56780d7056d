"""Release fixture for VCC: a float64 NumPy port of the authors' released RoBERTa VCC encoder forward.

Follows mlpen/VCC at commit 356f8066c0df714eacfc15317cbf4d5d9acd9416, files
``src/roberta/models/vcc.py`` (``WeightedAttention``, ``VccEncoderLayer``, ``VccEncoder``),
``src/roberta/models/prenorm.py`` (``EncoderLayer``: the segment-local dense layer) and
``src/roberta/models/mra_projection/{formatter,coarser,selector,finer}.py`` (VIP-first sort, block means and
the append-only difference bank with its block -> bank-row table, attention-based selection, fine-token
reconstruction and the final materialization). Evaluation mode: no dropout, no exploration; the
straight-through scores have forward value 1 everywhere.

Configuration: batch 2, 64 tokens, hidden 8, 2 heads (head size 4), intermediate 16, LayerNorm eps 1e-5,
``encoder_layer_types`` = 1 prenorm ``EncoderLayer`` (``short_segment_size`` 32) + 2 ``VccEncoderLayer``,
``num_important_tokens`` 8, ``block_size`` 4 (14 blocks), ``num_fine_blocks`` 3, ``scale_correction`` True,
``coarser_type`` 'mean', ``selector_type`` 'attention_based_selector', no positions in the mixed states
(RoBERTa: absolute positions are part of the embedding, so the input here is the embedding output).
Row 0: 5 VIP tokens (3 slots filled by the earliest other tokens, importance 0), no padding. Row 1: 10 VIP
tokens (2 are compressed with the rest), its last 6 tokens padding (one block all padding, one half padded).
The released encoder's final LayerNorm is not applied (the stored output is the hidden state before it).

Parameters: random (seeded) LayerNorm scales/biases and FFN weights/biases; the query/key/value/output
projections are random with zero biases (longctx's block has no attention-projection biases).

Stored outputs (``[B, 64, 8]``), from the same port run in two forms:
  * ``out_release``: as released: block means divide by ``count + 1e-4``, key biases
    ``log(score + 1e-4) + log(num_dups + 1e-4)``, exact (erf) GELU;
  * ``out_exact``: the same with the block means dividing by ``max(count, 1)``, biases exactly ``log k``
    on averaged keys (longctx's documented exact forms) and the tanh-approximate GELU of longctx's MLP.
Per VCC layer also the selection logits of both forms (``ell{i}``, ``ell_exact{i}``, [B, 14]) and the chosen
blocks in the release's order (``fine{i}``, [B, 3], descending score; the two forms choose the same blocks).

Regenerate: ``.venv/bin/python scripts/release_fixtures/vcc.py`` (writes ``tests/fixtures/release/vcc.npz``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

COMMIT = "356f8066c0df714eacfc15317cbf4d5d9acd9416"
OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "release" / "vcc.npz"

BATCH, N, D, HEADS, D_FF = 2, 64, 8, 2, 16
N_VIP, BLOCK, N_FINE = 8, 4, 3
SEGMENT = 32
N_DENSE, N_VCC = 1, 2
LN_EPS = 1e-5
MASK_NEG = -1000.0
SEED = 7

_erf = np.vectorize(math.erf)


# --------------------------------------------------------------------------- building blocks
def layer_norm(x, p):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + LN_EPS) * p["g"] + p["b"]


def gelu(x, exact):
    if exact:
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def affine(x, w, b):
    """A torch-style Linear: w [out, in]."""
    return x @ w.T + b


def heads(x):
    """[B, R, D] -> [B, H, R, D/H] (head-major split of the hidden axis)."""
    Bn, R, _ = x.shape
    return x.reshape(Bn, R, HEADS, D // HEADS).transpose(0, 2, 1, 3)


def softmax(s):
    s = s - s.max(-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(-1, keepdims=True)


def attn_probs(p, q_in, k_in, bias):
    """Probabilities [B, H, Rq, Rk] of already-normalized rows; q and k are each divided by d_h^(1/4)."""
    root = math.sqrt(math.sqrt(D // HEADS))
    q = heads(affine(q_in, p["wq"], p["bq"])) / root
    k = heads(affine(k_in, p["wk"], p["bk"])) / root
    return softmax(q @ k.transpose(0, 1, 3, 2) + bias[:, None, None, :])


def attention_block(p, x, bias):
    """Self-attention output (after the output projection) of rows x with per-key bias [B, R]."""
    xn = layer_norm(x, p["ln_a"])
    probs = attn_probs(p, xn, xn, bias)
    ctx = probs @ heads(affine(xn, p["wv"], p["bv"]))
    ctx = ctx.transpose(0, 2, 1, 3).reshape(x.shape)
    return affine(ctx, p["wo"], p["bo"])


def ffn(p, x, exact_gelu):
    return affine(gelu(affine(layer_norm(x, p["ln_f"]), p["w1"], p["b1"]), exact_gelu), p["w2"], p["b2"])


# --------------------------------------------------------------------------- the released pieces
def prenorm_layer(p, x, mask, exact_gelu):
    """prenorm.EncoderLayer on segments of SEGMENT tokens (VccEncoder.short_segment_forward)."""
    Bn, n, d = x.shape
    g = n // SEGMENT
    xs, ms = x.reshape(Bn * g, SEGMENT, d), mask.reshape(Bn * g, SEGMENT)
    a = attention_block(p, xs, MASK_NEG * (1.0 - ms)) + xs
    return (ffn(p, a, exact_gelu) + a).reshape(Bn, n, d)


def block_means(tokens, mask, release_eps):
    """Coarser.to_coarse: (means [B, nb, d], block mask [B, nb], differences [B, nb, k, d])."""
    Bn, m, d = tokens.shape
    nb = m // BLOCK
    t = (tokens * mask[:, :, None]).reshape(Bn, nb, BLOCK, d)
    cnt = mask.reshape(Bn, nb, BLOCK).sum(-1)
    den = cnt + 1e-4 if release_eps else np.maximum(cnt, 1.0)
    means = t.sum(2) / den[:, :, None]
    return means, (cnt > 0).astype(np.float64), means[:, :, None, :] - t


class DiffBank:
    """The append-only difference cache: a bank of rows and a per-example block -> bank-row table."""

    def __init__(self, diff):
        self.rows = diff
        self.table = np.tile(np.arange(diff.shape[1]), (diff.shape[0], 1))

    def append(self, diff, blocks):
        start = self.rows.shape[1]
        self.table[np.arange(diff.shape[0])[:, None], blocks] = np.arange(start, start + diff.shape[1])[None]
        self.rows = np.concatenate([self.rows, diff], axis=1)

    def read(self, blocks):
        bi = np.arange(blocks.shape[0])[:, None]
        return self.rows[bi, self.table[bi, blocks]]


def select_blocks(p, vip, imp, coarse, cmask):
    """Selector (attention_based_selector, eval): (order [B, nb] by descending score, ell [B, nb])."""
    probs = attn_probs(p, layer_norm(vip, p["ln_a"]), layer_norm(coarse, p["ln_a"]), MASK_NEG * (1.0 - cmask))
    per_slot = probs.mean(1) * imp[:, :, None]
    ell = np.log(per_slot.mean(1) + 1e-5)
    order = np.argsort(-ell, axis=1, kind="stable")
    return order, ell


def vcc_layer(p, st, release_eps, exact_gelu):
    """VccEncoderLayer.forward: coarser -> selector -> finer -> layer on [fine; coarse; VIP] rows."""
    Bn = st["vip"].shape[0]
    bi = np.arange(Bn)[:, None]
    # Coarser: block means (first layer: from the tokens; later: from last layer's fine rows + coarse rows)
    if "fine_rows" not in st:
        coarse, cmask, diff = block_means(st["tokens"], st["tok_mask"], release_eps)
        st["bank"] = DiffBank(diff)
        st["cmask"] = cmask
    else:
        coarse = coarser_update(st, release_eps)
    # Selector
    order, ell = select_blocks(p, st["vip"], st["imp"], coarse, st["cmask"])
    fine_idx, coarse_idx = order[:, :N_FINE], order[:, N_FINE:]
    # Finer
    tm = st["tok_mask"].reshape(Bn, -1, BLOCK)
    fine_rows = (coarse[bi, fine_idx][:, :, None] - st["bank"].read(fine_idx)).reshape(Bn, N_FINE * BLOCK, D)
    fine_mask = tm[bi, fine_idx].reshape(Bn, N_FINE * BLOCK)
    coarse_rows, coarse_mask = coarse[bi, coarse_idx], st["cmask"][bi, coarse_idx]
    n_f, n_c = fine_rows.shape[1], coarse_rows.shape[1]
    rows = np.concatenate([fine_rows, coarse_rows, st["vip"]], axis=1)
    mask = np.concatenate([fine_mask, coarse_mask, st["vip_mask"]], axis=1)
    scores = np.ones(mask.shape)  # 1 + s - stopgrad(s): forward value 1
    dups = np.concatenate([np.ones(n_f), np.full(n_c, float(BLOCK)), np.ones(st["vip"].shape[1])])[None]
    if release_eps:
        bias = MASK_NEG * (1.0 - mask) + np.log(scores + 1e-4) + np.log(dups + 1e-4)
    else:
        bias = MASK_NEG * (1.0 - mask) + np.log(scores) + np.log(dups)
    # encode
    a = attention_block(p, rows, bias)
    f = ffn(p, a + rows, exact_gelu)
    new = (f + a) * scores[:, :, None] + rows
    st.update(fine_rows=new[:, :n_f], fine_idx=fine_idx, fine_mask=fine_mask, coarse_rows=new[:, n_f:n_f + n_c],
              coarse_idx=coarse_idx, vip=new[:, n_f + n_c:])
    return ell, fine_idx


def coarser_update(st, release_eps):
    """Coarser in a later layer: new means of the fine blocks, diffs appended to the bank, rows back in block order."""
    Bn = st["vip"].shape[0]
    bi = np.arange(Bn)[:, None]
    means, _, diff = block_means(st["fine_rows"], st["fine_mask"], release_eps)
    blocks = np.concatenate([st["fine_idx"], st["coarse_idx"]], axis=1)
    back = np.argsort(blocks, axis=1)
    coarse = np.concatenate([means, st["coarse_rows"]], axis=1)[bi, back]
    st["bank"].append(diff, st["fine_idx"])
    return coarse


def vcc_encoder(params, x, mask, importance, release_eps=True, exact_gelu=True):
    """VccEncoder.forward without its final LayerNorm: (hidden [B, n, d], per-VCC-layer (ell, fine blocks))."""
    Bn = x.shape[0]
    bi = np.arange(Bn)[:, None]
    for i in range(N_DENSE):
        x = prenorm_layer(params[i], x, mask, exact_gelu)
    # Formatter.to_vcc_input
    x = x * mask[:, :, None]
    order = np.argsort(-importance, axis=1, kind="stable")  # VIP first, stable
    xs, ms, im = x[bi, order], mask[bi, order], importance[bi, order]
    st = {"vip": xs[:, :N_VIP], "vip_mask": ms[:, :N_VIP], "imp": im[:, :N_VIP],
          "tokens": xs[:, N_VIP:], "tok_mask": ms[:, N_VIP:]}
    picks = []
    for i in range(N_DENSE, N_DENSE + N_VCC):
        picks.append(vcc_layer(params[i], st, release_eps, exact_gelu))
    # Formatter.from_vcc_input: coarser, then finer over all blocks, then the inverse sort
    coarse = coarser_update(st, release_eps)
    nb = coarse.shape[1]
    toks = (coarse[:, :, None] - st["bank"].read(np.tile(np.arange(nb), (Bn, 1)))).reshape(Bn, nb * BLOCK, D)
    toks = toks * st["tok_mask"][:, :, None]
    full = np.concatenate([st["vip"], toks], axis=1)
    return full[bi, np.argsort(order, axis=1)], picks


# --------------------------------------------------------------------------- fixture
def make_params(rng, n_layers):
    out = []
    std = 1.0 / math.sqrt(D)
    for _ in range(n_layers):
        p = {}
        for nm in ("wq", "wk", "wv", "wo"):
            p[nm] = rng.normal(size=(D, D)) * std * (2.0 if nm in ("wq", "wk") else 1.0)
        for nm in ("bq", "bk", "bv", "bo"):
            p[nm] = np.zeros(D)  # longctx's block has no attention-projection biases
        for nm in ("ln_a", "ln_f"):
            p[nm] = {"g": 1.0 + 0.2 * rng.normal(size=D), "b": 0.2 * rng.normal(size=D)}
        p["w1"], p["b1"] = rng.normal(size=(D_FF, D)) * std, 0.3 * rng.normal(size=D_FF)
        p["w2"], p["b2"] = rng.normal(size=(D, D_FF)) / math.sqrt(D_FF), 0.3 * rng.normal(size=D)
        out.append(p)
    return out


def make_inputs(rng):
    x = rng.normal(size=(BATCH, N, D))
    mask = np.ones((BATCH, N))
    mask[1, -6:] = 0.0
    imp = np.zeros((BATCH, N))
    imp[0, rng.choice(N, 5, replace=False)] = 1.0
    imp[1, rng.choice(N - 6, 10, replace=False)] = 1.0  # VIP flags only on real tokens
    return x, mask, imp


def flat(params):
    out = {}
    for i, p in enumerate(params):
        for nm, v in p.items():
            if isinstance(v, dict):
                out[f"l{i}_{nm}_g"], out[f"l{i}_{nm}_b"] = v["g"], v["b"]
            else:
                out[f"l{i}_{nm}"] = v
    return out


def main():
    rng = np.random.default_rng(SEED)
    params = make_params(rng, N_DENSE + N_VCC)
    x, mask, imp = make_inputs(rng)
    out_release, picks = vcc_encoder(params, x, mask, imp, release_eps=True, exact_gelu=True)
    out_exact, picks_exact = vcc_encoder(params, x, mask, imp, release_eps=False, exact_gelu=False)
    data = {"x": x, "mask": mask, "importance": imp, "out_release": out_release, "out_exact": out_exact,
            **flat(params)}
    for j, ((ell, fine), (ell_e, fine_e)) in enumerate(zip(picks, picks_exact)):
        assert (np.sort(fine, 1) == np.sort(fine_e, 1)).all(), "the two forms choose different blocks"
        srt = np.sort(ell, axis=1)[:, ::-1]
        margin = (srt[:, N_FINE - 1] - srt[:, N_FINE]).min()
        print(f"VCC layer {j}: fine blocks {fine.tolist()}, top-h margin {margin:.3g}")
        data[f"ell{j}"], data[f"ell_exact{j}"], data[f"fine{j}"] = ell, ell_e, fine
    print("max |out_release - out_exact| =", np.abs(out_release - out_exact).max())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **{k: np.asarray(v) for k, v in data.items()})
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
