"""The VCC stacks (docs/methods/vcc.md; § numbers below are its sections): the encoder stack (§2, §4.1) and VCC-LM (§4.2, our causal
extension), stack wrappers over the backbone's own transformer blocks (same parameter tree:
a dense checkpoint loads unchanged): pre-LN blocks, and in the encoder also post-norm ones
(``model.post_norm``: an imported BERT or RoBERTa, below).

Encoder
-------

    y, states = stack(blocks, x, None, positions=pos, important=vip, deterministic=True, key=None, aux=aux)

x: [B, n, d] embedded tokens; positions: [n] (or [B, n]) absolute positions; important: [B, n] bool
VIP tokens (the encoder's masked positions); ``valid`` ([B, n] bool, default all) marks padding.

Pipeline (§2.8):
  1. the first ``num_dense_layers`` blocks run as plain layers, each on consecutive segments of
     ``dense_segment_len`` tokens independently (no cross-segment attention);
  2. format (§2.9): a stable sort puts the VIP tokens first; the first ``num_vip`` slots are P
     (fewer VIPs: the earliest other tokens fill the slots, with imp = 0; more: the surplus is
     compressed with the rest, counted in the ``vip_overflow`` metric and logged once; none: the
     slots, filled by the row's earliest tokens, all get imp = 1, counted in ``vip_empty_rows``
     and logged once), the rest C is cut into
     nb = (n - n_p)/k blocks of k tokens and stored as T(C) in two levels: ``coarse`` [B, nb, d]
     (masked block means) and ``diff`` [B, nb, k, d] = coarse - token (§2.7);
  3. every other block is one VCC layer (:func:`vcc_layer`): selection of h blocks by the VIP rows'
     attention to the block means (§2.4: the layer's own LN, W_Q, W_K; per-head softmax over blocks,
     head mean, imp-masked mean over the n_p slots, log(. + 1e-5)); in training with probability
     ``explore_prob`` per example a random ranking instead, and the straight-through gate δ; then
     the unchanged layer on the rows [P; all nb block means; h·k fine tokens] with key bias
     0 / log k + δ_c / δ_f, selected means masked as keys (masked-coarse layout, §2.9), the update
     multiplied by (1 + δ); decompression: VIP rows and fine tokens get their own update, every
     token of an unselected block its block's update (only ``coarse`` moves; ``diff`` is unchanged
     there), fine blocks rewrite their mean and diffs by scatter;
  4. materialize the tokens (coarse - diff), un-permute.

Rows of any length work: a rest that is not a whole number of blocks is padded with invalid
tokens (masked keys, excluded from means, dropped on output); when a row has no more blocks than
the fine budget every block is fine (nothing to compress: the layer is exact).

Positions travel with rows: rotary models rotate a block mean at the round-half-to-even mean of
its valid members' positions (§4.1, §8.9); learned / sinusoidal positions were added at the
input.

Departures from the paper / reference code:
  * selection score: the reference code's per-head softmax form, not the paper's Eq. 53 (§8.1);
  * two resolutions (k, 1) only; the L-level version (§2.10) is not implemented;
  * means divide by max(count, 1) (reference: count + 1e-4); biases are exactly log k and δ
    (reference: log(· + 1e-4));
  * masked-coarse layout and scatter in place of the reference's complement set and diff bank
    (§2.9; same values up to float summation order);
  * all-padding blocks get ℓ = -1e30 after the log, so they never outrank a valid block at eval;
  * under padding (§8.14): a partly padded block's position is the mean of its valid members only
    (reference: all members), and VIP flags on padding tokens are dropped (no slot, no score
    weight, no overflow count; reference: kept);
  * a row with no VIP token takes its filled slots as the VIP queries (reference: every block
    scores the same);
  * the VCC layers are a Python loop over the backbone's separate blocks, not ``nn.scan`` over
    stacked parameters (§2.9), so the parameter tree stays the dense model's; no remat;
  * attention inside a layer has no probability dropout (the project's block has none); the
    block's residual dropouts apply to the compressed rows;
  * post-norm blocks (``model.post_norm``, an imported BERT / RoBERTa; our extension: the release
    wraps pre-LN layers only, §2.1, §8.8, and its RoBERTa runs were continued from the authors' own
    pre-LN RoBERTa, §3.2): such a block has no residual form x + γ(x), so the layer's update of a
    compressed row is the block's output minus its input, γ(y) = block(y) - y (for a pre-LN block
    that is A + F, the release's update), multiplied by the gate (1 + δ) and decompressed as above:
    VIP rows and fine tokens become the block's output itself, every token of an unselected block
    moves by its block's update (so only its mean is normalized, not each token). The block's q, k
    and v, and with them the selection's VIP queries and block-mean keys, are those of the rows
    themselves (the block has no norm before its attention; the release: its pre-attention LN). With
    every block fine the stack is the post-norm model exactly. VCC-LM (below) takes pre-LN blocks only.

VCC-LM (decoder)
----------------
:class:`VCCDecoderStack`: in every layer a query in window j (positions [t0, t0 + w)) attends to
the band [t0 - g, t] exactly, to the tokens of h old blocks (before t0 - g) chosen by the past
anchors' queries [t0 - a, t0) (§4.2's ℓ_j, top-h; exploration and the straight-through δ in
training), and to every other old block as one key/value W_K,V LN_a(mean of the block's layer
inputs) at RoPE angle of the block centre with a +log k bias. Projections and FFN run on every
token (history rows are never updated). One function, :func:`lm_layer`, serves the parallel pass
(a chunk from an empty state, windows under ``lax.map`` with remat), chunked training/evaluation
and token-by-token decoding; the state (:func:`lm_init_state`) has a static capacity and raises
:class:`CapacityError` when fed more.

Packed rows (``segment_ids`` [B, T], §4.3, ours): both stacks lay every document out as a row of its own
(:class:`DocumentLayout`, ``max_documents`` slots per packed row), since every count of the method (VIP slots,
block grid, fine budget, segment-local layers; VCC-LM's windows, blocks, anchors and state) starts at a row's first
token. VCC-LM (:func:`lm_layer_packed`) runs the call's leading run that continues the carried document from the
carried state and every other document from the empty state, and returns the last document's state with its id
(``segment``) and length (``doc_length``).

Departures from the VCC-LM design of §4.2 (ours):
  * the block accumulator keeps the last k layer inputs ([B, k, d]) instead of a running sum, and the
    anchor ring the last a queries; the key/value cache carries g front and w back padding slots so a
    window's band is one fixed-length slice;
  * the selected fine keys/values are gathered from the key/value cache at every step (not cached
    apart at the window start), and the selection is evaluated at every call for every window the
    call touches (kept only where the window starts in the call): the same values, more reads while
    decoding (O(a·T_max/k·d) per token instead of per window);
  * the "first_token" anchor option is not implemented (past anchors only);
  * a window that started in an earlier call reuses the carried selection with δ = 0 (the carried
    state is stop-gradient anyway);
  * exploration ranks the window's old blocks only, so an explored window refines min(h, old
    blocks) usable blocks like an unexplored one.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
from flax import nnx

from longctx import attention
from longctx.attention.base import Aux, check_capacity, continues_state
from longctx.errors import ConfigError
from longctx.models.blocks import TransformerBlock, get_block, split_key
from longctx.models.layers import apply_rotary, dropout
from pallas_kernels.precision import statistic

logger = logging.getLogger(__name__)
_warned: set[str] = set()  # warnings already logged in this process (each once)

NEG = -1e9  # masked keys in fp32 logits
NEG_ELL = -1e30  # selection logits of all-padding blocks
EPS = 1e-5  # ℓ = log(p̄ + EPS) (reference)


# ----------------------------------------------------------------------------- one pre-LN layer on given rows
def project(block, y, pos, rotary: bool):
    """q, k, v [B, H, R, Dh] of rows y [B, R, d] at per-row positions pos [B, R] (the block's LN_a, W_qkv; a
    post-norm block projects the rows themselves, as it does in the plain loop), rotated with the block's
    rotary base. Grouped-query attention (the block's ``num_kv_heads`` < ``num_heads``): the block's own
    projection, whose k and v heads are repeated to the query heads of their group."""
    if block.num_kv_heads != block.num_heads:
        if rotary != block.rotary:
            raise ValueError(f"vcc: rotary={rotary} but the block's own projection has rotary={block.rotary}")
        return block.project(y, pos)
    B, R, _ = y.shape
    H, Dh = block.num_heads, block.head_dim
    qkv = block.qkv(y if block.post_norm else block.norm1(y)).reshape(B, R, 3, H, Dh).transpose(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    if rotary:
        rotate = jax.vmap(lambda a, p: apply_rotary(a, p, block.rope_theta))
        q, k = rotate(q, pos), rotate(k, pos)
    return q, k, v


def finish(block, y, q, k, v, key_bias, gate, *, deterministic: bool, keys):
    """y + (A + F) · gate: the block's attention (through its core, with ``key_bias`` [B, R]) and
    MLP on rows y; gate [B, R] or None (= 1). A post-norm block (``model.post_norm``) has no residual
    form y + (A + F): its update is its output minus its input, z - y with z = LN2(x1 + F(x1)),
    x1 = LN1(y + A), so the rows become z + (z - y) · (gate - 1) (z itself where the gate is 1: the
    forward value always, the straight-through δ being 0; our extension, module docstring)."""
    B, R, _ = y.shape
    _, k_attn, k_mlp, k_res = keys
    o, _ = block.core(q, k, v, None, key_bias=key_bias)
    o = o.transpose(0, 2, 1, 3).reshape(B, R, block.num_heads * block.head_dim)
    a = dropout(block.out(o.astype(y.dtype)), block.dropout_rate, deterministic, k_attn)
    if block.post_norm:
        x1 = block.norm1(y + a)
        f = block.mlp(x1, deterministic=deterministic, key=k_mlp)
        z = block.norm2(x1 + dropout(f, block.dropout_rate, deterministic, k_res))
        return z if gate is None else z + (z - y) * (gate - 1.0)[..., None].astype(z.dtype)
    if gate is None:
        y1 = y + a
        f = block.mlp(block.norm2(y1), deterministic=deterministic, key=k_mlp)
        return y1 + dropout(f, block.dropout_rate, deterministic, k_res)
    f = block.mlp(block.norm2(y + a), deterministic=deterministic, key=k_mlp)
    u = a + dropout(f, block.dropout_rate, deterministic, k_res)
    return y + u * gate[..., None].astype(u.dtype)


def dense_layer(block, y, pos, valid, *, rotary: bool, deterministic: bool, key):
    """The plain layer on rows y [B, R, d] (keys masked where not ``valid``)."""
    keys = split_key(key, 4)
    q, k, v = project(block, y, pos, rotary)
    return finish(block, y, q, k, v, jnp.where(valid, 0.0, NEG), None, deterministic=deterministic, keys=keys)


def segment_local_layer(block, x, pos, valid, seg: int, *, rotary: bool, deterministic: bool, key):
    """The plain layer run independently on consecutive segments of ``seg`` tokens (§2.8);
    the last segment is padded (padding keys masked) when ``seg`` does not divide n."""
    B, n, d = x.shape
    s = min(seg, n)
    pad = (-n) % s
    xp = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
    pp = jnp.pad(pos, ((0, 0), (0, pad)))
    vp = jnp.pad(valid, ((0, 0), (0, pad)))
    G = (n + pad) // s
    y = dense_layer(block, xp.reshape(B * G, s, d), pp.reshape(B * G, s), vp.reshape(B * G, s), rotary=rotary,
                    deterministic=deterministic, key=key)
    return y.reshape(B, n + pad, d)[:, :n]


# ----------------------------------------------------------------------------- packed rows: documents as rows
@dataclasses.dataclass(frozen=True)
class DocumentLayout:
    """Packed rows (``segment_ids`` [B, T]) laid out with each document as its own row (docs/methods/vcc.md §4.3):
    document i of row b (``base.document_starts``' runs, numbered from 0) holds the slot ``[b, i]`` of a
    [B, D, T] layout, its tokens first, then padding. VCC's math has no mid-row restart (its VIP slots, block
    grid, fine budget and VCC-LM's windows and state all count from a row's first token), so each document runs
    as a row of its own; ``D`` (``max_documents``) is static."""

    lengths: jax.Array  # [B, D] int32: tokens of each document (0: an unused slot)
    doc: jax.Array  # [B, T] int32: the slot of each token's document
    src: jax.Array  # [B, D, T] int32: the packed token at each slot position (clipped where padding)
    dst: jax.Array  # [B, T] int32: each packed token's place in the flattened [D * T] slots

    @property
    def in_doc(self):
        """[B, D, T] bool: the slot position holds one of its document's tokens."""
        return jnp.arange(self.src.shape[2]) < self.lengths[..., None]

    def to_docs(self, a):
        """a [B, T, ...] -> [B, D, T, ...] (padding positions hold some other token: mask them with ``in_doc``)."""
        B, D, T = self.src.shape
        idx = self.src.reshape((B, D * T) + (1,) * (a.ndim - 2))
        return jnp.take_along_axis(a, idx, axis=1).reshape((B, D, T) + a.shape[2:])

    def from_docs(self, y):
        """y [B, D, T, ...] -> [B, T, ...]: each packed token from its document's slot."""
        B, D, T = y.shape[:3]
        flat = y.reshape((B, D * T) + y.shape[3:])
        return jnp.take_along_axis(flat, self.dst.reshape((B, T) + (1,) * (y.ndim - 3)), axis=1)


def document_layout(segment_ids, max_documents: int) -> DocumentLayout:
    """The :class:`DocumentLayout` of ``segment_ids`` [B, T] with ``min(max_documents, T)`` slots; a row with more
    documents is refused (``check_capacity``: a host error when traced, never a silent merge)."""
    B, T = segment_ids.shape
    D = min(max_documents, T)
    doc = jnp.cumsum(jnp.concatenate([jnp.zeros((B, 1), jnp.int32),
                                      (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)], axis=1), axis=1)
    check_capacity(doc[:, -1] + 1, D, "vcc: a packed row holds {needed} documents but the stack lays out at most "
                   "{capacity} (model.attention.vcc.max_documents, or the row's length); raise max_documents")
    lengths = jnp.sum(doc[:, :, None] == jnp.arange(D), axis=1).astype(jnp.int32)  # [B, D]
    starts = jnp.cumsum(lengths, axis=1) - lengths
    t = jnp.arange(T, dtype=jnp.int32)
    src = jnp.minimum(starts[:, :, None] + t, T - 1)
    local = t - jnp.take_along_axis(starts, jnp.minimum(doc, D - 1), axis=1)
    return DocumentLayout(lengths=lengths, doc=doc, src=src, dst=doc * T + local)


# ----------------------------------------------------------------------------- format / T(C) / materialize
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VCCState:
    """The VIP rows and the two-level T(C) of the rest (§2.7, §2.9). Token recovery:
    C[b·k + j] = (coarse[b] - diff[b, j]) · tok_valid[b, j]."""

    P: jax.Array  # [B, n_p, d]
    coarse: jax.Array  # [B, nb, d]   masked mean of each block's valid tokens
    diff: jax.Array  # [B, nb, k, d] coarse - valid · token
    vip_valid: jax.Array  # [B, n_p] bool  the slot holds a real (non-padding) token
    imp: jax.Array  # [B, n_p] bool  the slot counts in the selection score: a real VIP token (a row with
    #                  none: every valid slot, the fallback of format_rows)
    vip_pos: jax.Array  # [B, n_p] int32
    tok_valid: jax.Array  # [B, nb, k] bool
    tok_pos: jax.Array  # [B, nb, k] int32
    block_valid: jax.Array  # [B, nb] bool (>= 1 valid token)
    coarse_pos: jax.Array  # [B, nb] int32  round-half-to-even mean of the valid members' positions
    perm: jax.Array  # [B, n] int32: row i of [P; C] is token perm[i]


def masked_mean(x, valid, axis):
    """Mean of x over ``axis`` counting only ``valid`` entries (max(count, 1) divisor, §8.4)."""
    w = valid.astype(x.dtype)[..., None]
    cnt = jnp.sum(valid, axis=axis).astype(x.dtype)
    return jnp.sum(w * x, axis=axis) / jnp.maximum(cnt, 1)[..., None]


def format_rows(x, vip, valid, pos, num_vip: int, k: int) -> tuple[VCCState, jax.Array]:
    """(state, overflow [B]): VIP-first permutation and T(C) (§2.8, §2.9)."""
    B, n, d = x.shape
    n_c = n - num_vip
    if n_c < 0 or n_c % k:
        raise ValueError(f"vcc: a row of {n} tokens with num_vip={num_vip} leaves {n_c} tokens, not a positive "
                         f"multiple of block_size={k}; choose num_vip so that (row length - num_vip) % block_size == 0")
    nb = n_c // k
    # VIP flags on padding are dropped (a padding token takes no slot and is not counted as overflow); the
    # release keeps the flag, so a padded VIP would take a slot there (departure, docs/methods/vcc.md §8.14)
    vip = vip & valid
    x = x * valid[..., None].astype(x.dtype)  # padding tokens are zeroed
    perm = jnp.argsort(jnp.where(vip, 0, 1), axis=1, stable=True).astype(jnp.int32)

    def take(a):
        return jnp.take_along_axis(a, perm.reshape(perm.shape + (1,) * (a.ndim - 2)), axis=1)

    xs, vs, ps, ims = take(x), take(valid), take(pos), take(vip)
    Cb = xs[:, num_vip:].reshape(B, nb, k, d)
    tok_valid = vs[:, num_vip:].reshape(B, nb, k)
    tok_pos = ps[:, num_vip:].reshape(B, nb, k)
    coarse = masked_mean(Cb, tok_valid, 2)
    diff = coarse[:, :, None] - tok_valid[..., None].astype(Cb.dtype) * Cb
    cnt = jnp.sum(tok_valid, -1)
    # a partly padded block sits at the rounded mean of its *valid* members' positions (the release averages
    # all members, padding included; departure, docs/methods/vcc.md §8.14)
    mean_pos = jnp.sum(jnp.where(tok_valid, tok_pos, 0), -1) / jnp.maximum(cnt, 1)
    # a row with no VIP token: its slots (the earliest valid tokens) act as the VIP queries of the score, which
    # would otherwise be log(1e-5) for every block and refine the first h blocks whatever the row holds
    # (our fallback, docs/methods/vcc.md §2.8; the stack counts such rows in ``vip_empty_rows`` and logs once)
    imp = jnp.where(jnp.any(vip, axis=1, keepdims=True), ims[:, :num_vip], vs[:, :num_vip])
    state = VCCState(
        P=xs[:, :num_vip], coarse=coarse, diff=diff, vip_valid=vs[:, :num_vip], imp=imp,
        vip_pos=ps[:, :num_vip], tok_valid=tok_valid, tok_pos=tok_pos, block_valid=cnt > 0,
        coarse_pos=jnp.round(mean_pos).astype(jnp.int32), perm=perm)
    overflow = jnp.maximum(jnp.sum(vip, 1) - num_vip, 0)
    return state, overflow


def tokens_of(state: VCCState):
    """The rest tokens C [B, nb, k, d] recovered from T(C)."""
    return (state.coarse[:, :, None] - state.diff) * state.tok_valid[..., None].astype(state.diff.dtype)


def materialize(state: VCCState):
    """[B, n, d] in the original token order (§2.9 'Materialize')."""
    B, nb, k, d = state.diff.shape
    X = jnp.concatenate([state.P, tokens_of(state).reshape(B, nb * k, d)], axis=1)
    inv = jnp.argsort(state.perm, axis=1)
    return jnp.take_along_axis(X, inv[..., None], axis=1)


# ----------------------------------------------------------------------------- selection (§2.4)
def selection_logits(q_vip, k_coarse, imp, block_valid):
    """ℓ [B, nb] fp32: log(p̄ + 1e-5), p̄_b = (1/n_p) Σ_i imp_i (1/H) Σ_η softmax_b(q·κ/√d_h + mask_b);
    all-padding blocks get -1e30 (never outrank a valid block)."""
    B, H, n_p, D = q_vip.shape
    with statistic("VCC's block selection scores: rounding them would change which blocks are refined"):
        s = jnp.einsum("bhid,bhjd->bhij", q_vip.astype(jnp.float32), k_coarse.astype(jnp.float32)) * D**-0.5
        s = s + jnp.where(block_valid, 0.0, NEG)[:, None, None, :]
        pi = jax.nn.softmax(s, axis=-1)
        pbar = jnp.einsum("bhij,bi->bj", pi, imp.astype(jnp.float32)) / (H * max(n_p, 1))
    return jnp.where(block_valid, jnp.log(pbar + EPS), NEG_ELL)


def choose_blocks(ell, h: int, *, explore_prob: float, deterministic: bool, key, eligible=None):
    """fine_idx [B, h] int32: top-h of ℓ (ties: lower index); in training, per example with
    probability ``explore_prob``, the top-h of a uniformly random ranking instead. ``eligible``
    ([nb] or [B, nb] bool, optional): the random ranking puts these blocks first (VCC-LM: the old
    blocks, so an explored window gets min(h, old blocks) usable blocks, not the old share of h)."""
    ranked = ell
    if not deterministic and explore_prob > 0.0:
        if key is None:
            raise ValueError("vcc: training (deterministic=False) with explore_prob > 0 needs a PRNG key")
        ke, ku = jax.random.split(key)
        explore = jax.random.bernoulli(ke, explore_prob, (ell.shape[0],))
        u = jax.random.uniform(ku, ell.shape)  # in [0, 1)
        if eligible is not None:
            u = jnp.where(eligible, u, -1.0)
        ranked = jnp.where(explore[:, None], u, ell)
    return jax.lax.top_k(ranked, h)[1].astype(jnp.int32)


def ste_delta(ell, sel):
    """δ [B, nb]: g - stop_gradient(g) with g = softmax(ℓ) on selected blocks, 1 - softmax(ℓ) on the
    others (forward value exactly 0; it only gives ℓ a gradient)."""
    pt = jax.nn.softmax(ell, axis=-1)
    g = jnp.where(sel, pt, 1.0 - pt)
    return g - jax.lax.stop_gradient(g)


def _gather_blocks(a, idx):
    """a [B, nb, ...] at idx [B, h] -> [B, h, ...]."""
    return jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), axis=1)


def _scatter_blocks(a, idx, val):
    bidx = jnp.arange(a.shape[0])[:, None]
    return a.at[bidx, idx].set(val, unique_indices=True)


def compression_matrices(fine_idx, nb: int, k: int):
    """The dense-matrix form of one example's compression (§2.3), for references and tests:
    (S_c [r_c, n_c], S_c^† [n_c, r_c], D [r_c]) with rows = the unselected blocks in order, then the
    tokens of the selected blocks (in ``fine_idx`` order); r_c = nb - h + h·k. NumPy, host-side."""
    import numpy as np

    fine = [int(b) for b in np.asarray(fine_idx)]
    coarse = [b for b in range(nb) if b not in fine]
    rows = []  # (start token, length)
    rows += [(b * k, k) for b in coarse]
    rows += [(b * k + j, 1) for b in fine for j in range(k)]
    S = np.zeros((len(rows), nb * k))
    S_dag = np.zeros((nb * k, len(rows)))  # one-hot: token -> the row that holds it
    for r, (a, s) in enumerate(rows):
        S[r, a:a + s] = 1.0 / s
        S_dag[a:a + s, r] = 1.0
    D = np.array([float(s) for _, s in rows])
    return S, S_dag, D


# ----------------------------------------------------------------------------- one VCC layer (§2.9)
def vcc_layer(block, st: VCCState, *, h: int, rotary: bool, scale_correction: bool, ste_gate: bool,
              explore_prob: float, deterministic: bool, key, probe=None, fine_idx=None):
    """One VCC layer on T(C): returns (new state, info {'fine_idx', 'sel', 'ell'}).

    ``probe`` ([B, nb], tests): added to ℓ, so its gradient is d loss / d ℓ. ``fine_idx`` ([B, h],
    tests): a forced selection instead of the ranking."""
    B, n_p, d = st.P.shape
    nb, k = st.diff.shape[1], st.diff.shape[2]
    k_sel, k_attn, k_mlp, k_res = split_key(key, 4)
    # 1. rows [P; coarse]: LN, Q, K, V once
    Yc = jnp.concatenate([st.P, st.coarse], axis=1)
    qc, kc, vc = project(block, Yc, jnp.concatenate([st.vip_pos, st.coarse_pos], axis=1), rotary)
    # 2-3. selection
    ell = selection_logits(qc[:, :, :n_p], kc[:, :, n_p:], st.imp, st.block_valid)
    if probe is not None:
        ell = ell + probe
    if fine_idx is None:
        fine_idx = choose_blocks(jax.lax.stop_gradient(ell), h, explore_prob=explore_prob,
                                 deterministic=deterministic, key=k_sel)
    bidx = jnp.arange(B)[:, None]
    sel = jnp.zeros((B, nb), bool).at[bidx, fine_idx].set(True)
    delta = ste_delta(ell, sel) if (ste_gate and not deterministic) else jnp.zeros((B, nb))
    delta_f = jnp.take_along_axis(delta, fine_idx, axis=1)  # [B, h]
    # 4. fine rows of the selected blocks, rebuilt from T(C)
    f_valid = _gather_blocks(st.tok_valid, fine_idx)  # [B, h, k]
    Fb = (_gather_blocks(st.coarse, fine_idx)[:, :, None] - _gather_blocks(st.diff, fine_idx))
    Fb = Fb * f_valid[..., None].astype(Fb.dtype)
    Yf = Fb.reshape(B, h * k, d)
    qf, kf, vf = project(block, Yf, _gather_blocks(st.tok_pos, fine_idx).reshape(B, h * k), rotary)
    # 5. key bias and gate of the rows [P (n_p); coarse (nb); fine (h·k)]
    logk = math.log(k) if scale_correction else 0.0
    bias = jnp.concatenate([
        jnp.where(st.vip_valid, 0.0, NEG),
        jnp.where(st.block_valid & ~sel, logk + delta, NEG),
        jnp.where(f_valid.reshape(B, h * k), jnp.repeat(delta_f, k, axis=1), NEG),
    ], axis=1)
    gate = jnp.concatenate([jnp.ones((B, n_p)), 1.0 + delta, 1.0 + jnp.repeat(delta_f, k, axis=1)], axis=1)
    # 6. the layer on the compressed rows
    Y = jnp.concatenate([Yc, Yf], axis=1)
    q, kk, v = (jnp.concatenate(t, axis=2) for t in ((qc, qf), (kc, kf), (vc, vf)))
    Yn = finish(block, Y, q, kk, v, bias, gate, deterministic=deterministic, keys=(None, k_attn, k_mlp, k_res))
    # 7. decompression into T(C)
    Fn = Yn[:, n_p + nb:].reshape(B, h, k, d)
    m = masked_mean(Fn, f_valid, 2)
    coarse = _scatter_blocks(Yn[:, n_p:n_p + nb], fine_idx, m)
    diff = _scatter_blocks(st.diff, fine_idx, m[:, :, None] - f_valid[..., None].astype(Fn.dtype) * Fn)
    new = dataclasses.replace(st, P=Yn[:, :n_p], coarse=coarse, diff=diff)
    return new, {"fine_idx": fine_idx, "sel": sel, "ell": ell}


# ----------------------------------------------------------------------------- the stack
def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        logger.warning(message)


def _report_vips(overflow, empty, num_vip: int) -> None:
    """Log, once per process, that VIP tokens were compressed for want of slots (the spec keeps the release's
    semantics, §8.5, counted in ``vip_overflow``) or that rows had none (the slot fallback of
    :func:`format_rows`). Concrete counts are checked here; traced ones by a host callback that runs only when
    a count is positive (nothing crosses to the host otherwise)."""

    def host(overflow, empty):
        overflow, empty = int(jnp.max(overflow)), int(jnp.max(empty))
        if overflow > 0:
            _warn_once("overflow", f"vcc: more VIP tokens than the num_vip={num_vip} VIP slots: {overflow} surplus "
                       "VIP tokens in a batch were compressed with the other tokens (metric vip_overflow; "
                       "raise num_vip, or mark fewer VIP tokens)")
        if empty > 0:
            _warn_once("empty", f"vcc: {empty} rows of a batch hold no VIP token; their first {num_vip} tokens "
                       "act as their VIP queries (metric vip_empty_rows; docs/methods/vcc.md §2.8)")

    if not isinstance(overflow, jax.core.Tracer) and not isinstance(empty, jax.core.Tracer):
        host(overflow, empty)
        return
    jax.lax.cond((overflow > 0) | (empty > 0), lambda: jax.debug.callback(host, overflow, empty), lambda: None)


class VCCEncoderStack(nnx.Module):
    """Runs the backbone's blocks as n_dense segment-local layers + VCC layers (module docstring)."""

    takes_post_norm = True  # model.post_norm blocks (module docstring); read by the config's rules
    takes_segments = True  # packed rows: each document laid out as its own row (DocumentLayout)

    def __init__(self, cfg, *, rngs: nnx.Rngs | None = None):
        name = cfg.attention.name
        vc = attention.default_config(name)
        vc.update(cfg.attention.get(name) or {})
        if cfg.causal:
            raise ConfigError(f"model.attention.name={name!r}: the VCC encoder stack is bidirectional; "
                              "VCC-LM (docs/methods/vcc.md §4.2) is not implemented")
        if not issubclass(get_block(cfg.block), TransformerBlock):
            raise ConfigError(f"model.attention.name={name!r} wraps the pre-LN transformer block (it needs the "
                              f"residual form x + γ(x)); model.block={cfg.block!r} is not one")
        if vc.num_dense_layers > cfg.num_layers:
            raise ConfigError(f"model.attention.{name}.num_dense_layers={vc.num_dense_layers} exceeds "
                              f"model.num_layers={cfg.num_layers}")
        self.num_vip, self.block_size, self.num_fine = vc.num_vip, vc.block_size, vc.num_fine_blocks
        self.num_dense, self.segment_len = vc.num_dense_layers, vc.dense_segment_len
        self.explore_prob, self.scale_correction, self.ste_gate = vc.explore_prob, vc.scale_correction, vc.ste_gate
        self.rotary = cfg.positions == "rotary"
        self.max_documents = vc.max_documents

    def init_state(self, blocks, batch_size: int, max_len: int | None = None):
        raise ValueError("vcc: the encoder stack (bidirectional) has no prefix state")

    def layer_kwargs(self, deterministic: bool, h: int):
        return dict(h=h, rotary=self.rotary, scale_correction=self.scale_correction,
                    ste_gate=self.ste_gate, explore_prob=self.explore_prob, deterministic=deterministic)

    def __call__(self, blocks, x, states=None, *, positions, important=None, valid=None, deterministic=True,
                 key=None, aux: Aux | None = None, return_info: bool = False, segment_ids=None):
        """``segment_ids`` [B, n] int32 (packed rows): every document is encoded as a row of its own
        (:class:`DocumentLayout`), its positions the packed row's (restarting at each document), so it gets its own
        VIP slots, blocks, fine budget and segment-local layers, exactly what it gets alone (in training the
        exploration draws are the laid-out rows' own)."""
        if states is not None and any(s is not None for s in states):
            raise ValueError("vcc: the encoder stack takes no carried state")
        B, n, _ = x.shape
        pos = jnp.broadcast_to(positions, (B, n)).astype(jnp.int32)
        valid = jnp.ones((B, n), bool) if valid is None else valid
        if important is None:
            _warn_once("none", f"vcc: important=None: no VIP token in any row; each row's first {self.num_vip} "
                       "tokens act as its VIP queries for the block selection (docs/methods/vcc.md §2.8)")
        vip = jnp.zeros((B, n), bool) if important is None else important.astype(bool)
        if segment_ids is None:
            return self._encode(blocks, x, pos, valid, vip, important is not None, deterministic=deterministic,
                                key=key, aux=aux, return_info=return_info)
        lay = document_layout(segment_ids, self.max_documents)
        D = lay.src.shape[1]
        flat = lambda a: lay.to_docs(a).reshape((B * D, n) + a.shape[2:])  # noqa: E731
        in_doc = lay.in_doc.reshape(B * D, n)
        out = self._encode(blocks, flat(x), flat(pos), flat(valid) & in_doc, flat(vip) & in_doc,
                           important is not None, deterministic=deterministic, key=key, aux=aux,
                           return_info=return_info)
        # the selection info (return_info) stays per laid-out row: [B * D, ...], slot-major within a row
        return (lay.from_docs(out[0].reshape(B, D, n, -1)),) + tuple(out[1:])

    def _encode(self, blocks, x, pos, valid, vip, vips_given: bool, *, deterministic, key, aux, return_info):
        """The stack on rows x [B, n, d] (positions, validity and VIP flags [B, n]); ``vips_given``: the caller
        passed ``important``."""
        B, n, _ = x.shape
        # a row whose rest is not a whole number of blocks is padded with invalid tokens (masked keys,
        # excluded from block means, dropped on output); a row with no more blocks than the fine
        # budget keeps every block at token resolution (nothing to compress: the layer is exact)
        n_pad = self.num_vip + max(1, -(-(n - self.num_vip) // self.block_size)) * self.block_size
        if n_pad != n:
            pad = ((0, 0), (0, n_pad - n))
            x = jnp.pad(x, pad + ((0, 0),))
            pos = jnp.pad(pos, pad, mode="edge") if n else jnp.zeros((B, n_pad), jnp.int32)
            valid, vip = jnp.pad(valid, pad), jnp.pad(vip, pad)
        h = min(self.num_fine, (n_pad - self.num_vip) // self.block_size)
        keys = split_key(key, len(blocks))
        for i in range(self.num_dense):
            x = segment_local_layer(blocks[i], x, pos, valid, self.segment_len, rotary=self.rotary,
                                    deterministic=deterministic, key=keys[i])
        st, overflow = format_rows(x, vip, valid, pos, self.num_vip, self.block_size)
        infos = []
        for i in range(self.num_dense, len(blocks)):
            st, info = vcc_layer(blocks[i], st, key=keys[i], **self.layer_kwargs(deterministic, h))
            infos.append(info)
        y = materialize(st)[:, :n]
        vip_rows = jnp.any(vip & valid, axis=1)
        empty = jnp.sum(~vip_rows & jnp.any(valid, axis=1))  # rows with tokens but no VIP: the slot fallback
        _report_vips(jnp.sum(overflow), empty if vips_given else jnp.zeros((), empty.dtype), self.num_vip)
        if aux is not None:
            aux.add_metric("vip_overflow", jnp.sum(overflow))
            aux.add_metric("vip_empty_rows", empty)
        states = [None] * len(blocks)
        return (y, states, infos) if return_info else (y, states)




# ============================================================================= VCC-LM (§4.2)
@dataclasses.dataclass(frozen=True)
class LMOptions:
    """Static settings of a VCC-LM layer: window w, local band g, block size k (k | w, k | g), fine
    budget h, anchors a (the queries of the a positions before a window choose its fine blocks)."""

    window: int
    local: int
    block_size: int
    num_fine: int
    anchors: int
    rotary: bool
    scale_correction: bool
    ste_gate: bool
    explore_prob: float


def lm_init_state(block, opts: LMOptions, batch_size: int, max_len: int, d_model: int):
    """Empty per-layer VCC-LM state for ``max_len`` tokens (§4.2). The key/value cache
    has ``local`` slots of front padding and ``window`` slots of back padding so a window's band
    [t0 - g, t0 + w) is one fixed-length slice; ``xbuf``/``qbuf`` hold the last k layer inputs and
    the last a queries (block means and anchors that straddle a chunk border)."""
    H, Dh, k = block.num_heads, block.head_dim, opts.block_size
    nbmax = -(-max_len // k)
    h = min(opts.num_fine, nbmax)
    B, g, w = batch_size, opts.local, opts.window
    return {
        "k": jnp.zeros((B, H, g + max_len + w, Dh), jnp.float32),
        "v": jnp.zeros((B, H, g + max_len + w, Dh), jnp.float32),
        "ck": jnp.zeros((B, H, nbmax, Dh), jnp.float32),
        "cv": jnp.zeros((B, H, nbmax, Dh), jnp.float32),
        "xbuf": jnp.zeros((B, k, d_model), jnp.float32),
        "qbuf": jnp.zeros((B, H, opts.anchors, Dh), jnp.float32),
        "sel": jnp.zeros((B, h), jnp.int32),
        "length": jnp.zeros((), jnp.int32),
        # packed calls (lm_layer_packed): the id of the document the state summarizes (0: none) and its tokens
        "segment": jnp.zeros((B,), jnp.int32),
        "doc_length": jnp.zeros((B,), jnp.int32),
    }


def lm_select(anchors, anchor_valid, ck, nb_j, h: int, *, explore_prob: float, deterministic: bool, key):
    """Fine blocks of one window from its past anchors (§4.2): ℓ(b) = log(mean over heads and
    valid anchors of softmax_{b' < nb_j}(q·κ_{b'}/√d_h) + 1e-5) for b < nb_j, top-h (exploration in
    training: a random ranking of the old blocks only, so a window with fewer than h old blocks gets all of
    them). anchors [B, H, a, Dh], anchor_valid [a], ck [B, H, nbmax, Dh] -> (sel [B, h], ℓ [B, nbmax])."""
    B, H, a, Dh = anchors.shape
    nbmax = ck.shape[2]
    old = jnp.arange(nbmax) < nb_j
    s = jnp.einsum("bhad,bhjd->bhaj", anchors.astype(jnp.float32), ck.astype(jnp.float32)) * Dh**-0.5
    pi = jax.nn.softmax(jnp.where(old, s, NEG), axis=-1)
    w = anchor_valid.astype(jnp.float32)
    pbar = jnp.einsum("bhaj,a->bj", pi, w) / (H * jnp.maximum(jnp.sum(w), 1.0))
    ell = jnp.where(old, jnp.log(pbar + EPS), NEG_ELL)
    sel = choose_blocks(jax.lax.stop_gradient(ell), h, explore_prob=explore_prob, deterministic=deterministic,
                        key=key, eligible=old)
    return sel, ell


def lm_layer(block, x, st, opts: LMOptions, *, deterministic: bool, key, aligned: bool, n_valid=None):
    """One VCC-LM layer on a chunk x [B, T, d] that follows the prefix summarized by ``st``: returns
    (y, new state, info). The same function serves the parallel pass (one chunk from an empty state,
    ``aligned``: it starts at a window border), chunked training/evaluation and token-by-token
    decoding, so they agree up to float summation order (and select the same blocks).

    ``n_valid`` (int32 scalar, :func:`lm_layer_packed`): only the chunk's first ``n_valid`` tokens are fed (the
    rest is padding after them: its outputs are garbage and the state is left as the ``n_valid`` tokens leave it)."""
    B, T, d = x.shape
    H, Dh = block.num_heads, block.head_dim
    k, w, g, a = opts.block_size, opts.window, opts.local, opts.anchors
    nbmax = st["ck"].shape[2]
    h = st["sel"].shape[1]
    M = st["k"].shape[2] - g - w
    s = st["length"]
    nv = T if n_valid is None else n_valid
    check_capacity(s + nv, M, "vcc: the VCC-LM state holds {capacity} tokens (init_state max_len) but {needed} "
                   "were fed; build it with a larger max_len")
    k_sel, k_attn, k_mlp, k_res = split_key(key, 4)
    pos = s + jnp.arange(T, dtype=jnp.int32)
    q, kk, v = project(block, x, jnp.broadcast_to(pos, (B, T)), opts.rotary)
    K0, V0 = st["k"], st["v"]
    if n_valid is not None:  # room for the padding's T slots past the state's capacity (sliced off below)
        K0, V0 = (jnp.pad(c, ((0, 0), (0, 0), (0, T), (0, 0))) for c in (K0, V0))
    Kc = jax.lax.dynamic_update_slice(K0, kk.astype(jnp.float32), (0, 0, g + s, 0))
    Vc = jax.lax.dynamic_update_slice(V0, v.astype(jnp.float32), (0, 0, g + s, 0))
    # blocks completed in this chunk: mean layer input -> the layer's LN, W_K, W_V (RoPE at the centre)
    xcat = jnp.concatenate([st["xbuf"], x.astype(jnp.float32)], axis=1)  # positions [s - k, s + T)
    nc = T // k + 1
    bidx = s // k + jnp.arange(nc, dtype=jnp.int32)
    complete = ((bidx + 1) * k <= s + nv) & ((bidx + 1) * k > s)
    rows = jnp.clip((bidx * k - (s - k))[:, None] + jnp.arange(k), 0, k + T - 1)  # [nc, k]
    xm = jnp.mean(xcat[:, rows], axis=2).astype(x.dtype)  # [B, nc, d]
    centre = (bidx * k).astype(jnp.float32) + (k - 1) / 2.0
    _, cK, cV = project(block, xm, jnp.broadcast_to(centre, (B, nc)), opts.rotary)
    where = jnp.where(complete, bidx, nbmax + 1)  # incomplete blocks: dropped
    CK = st["ck"].at[:, :, where].set(cK.astype(jnp.float32), mode="drop")
    CV = st["cv"].at[:, :, where].set(cV.astype(jnp.float32), mode="drop")
    qcat = jnp.concatenate([st["qbuf"], q.astype(jnp.float32)], axis=2)  # positions [s - a, s + T)
    # queries regrouped by window: window j0 + i holds positions [(j0 + i) w, (j0 + i + 1) w), of which the call
    # holds at most tq = min(w, T), contiguous: each window computes only the tq rows [r_i, r_i + tq) that cover
    # them (a decoding step one row, not w). An aligned call's rows start at its windows' borders (r_i = 0), so its
    # band is the g + tq keys before and at them: with T < w the keys past the call's last token, every one
    # masked, are not scored.
    j0 = s // w
    offset = s - j0 * w
    nwin = -(-T // w) if aligned else -(-(w - 1 + T) // w)
    tq = min(w, T)
    nband = g + (tq if aligned else w)
    r0 = jnp.clip(offset - w * jnp.arange(nwin, dtype=jnp.int32), 0, w - tq)  # [nwin]: each window's first row
    Qp = jax.lax.dynamic_update_slice(jnp.zeros((B, H, nwin * w, Dh), q.dtype), q, (0, 0, offset, 0))
    Qw = jax.vmap(lambda qi, r: jax.lax.dynamic_slice_in_dim(qi, r, tq, axis=2))(
        Qp.reshape(B, H, nwin, w, Dh).transpose(2, 0, 1, 3, 4), r0)  # [nwin, B, H, tq, Dh]
    logk = math.log(k) if opts.scale_correction else 0.0
    train = not deterministic

    def one_window(args):
        i, qw, r = args
        j = j0 + i
        t0 = j * w
        nb_j = jnp.maximum(0, (t0 - g) // k)
        # selection from the past anchors [t0 - a, t0) (recomputed only when the window starts here)
        a_idx = jnp.clip(t0 - s + jnp.arange(a), 0, a + T - 1)
        anchors = qcat[:, :, a_idx]
        wkey = None if k_sel is None else jax.random.fold_in(k_sel, j)
        sel_new, ell = lm_select(anchors, t0 - a + jnp.arange(a) >= 0, CK, nb_j, h, explore_prob=opts.explore_prob,
                                 deterministic=deterministic, key=wkey)
        started_before = t0 < s
        sel = jnp.where(started_before, st["sel"], sel_new)
        sel_valid = sel < nb_j
        selmask = jnp.zeros((B, nbmax), bool).at[jnp.arange(B)[:, None], sel].max(sel_valid)
        if train and opts.ste_gate:
            delta = jnp.where(started_before, 0.0, ste_delta(ell, selmask))
        else:
            delta = jnp.zeros((B, nbmax))
        delta_f = jnp.take_along_axis(delta, sel, axis=1)
        # keys: coarse blocks (old, unselected) | tokens of the selected blocks | the band [t0 - g, t0 + w) (its
        # first nband keys: those the rows [t0 + r, t0 + r + tq) can see)
        fpos = (sel[:, :, None] * k + jnp.arange(k)).reshape(B, h * k)
        fK = jnp.take_along_axis(Kc, (g + fpos)[:, None, :, None], axis=2)
        fV = jnp.take_along_axis(Vc, (g + fpos)[:, None, :, None], axis=2)
        bK = jax.lax.dynamic_slice_in_dim(Kc, t0, nband, axis=2)
        bV = jax.lax.dynamic_slice_in_dim(Vc, t0, nband, axis=2)
        upos = t0 - g + jnp.arange(nband)
        tpos = t0 + r + jnp.arange(tq)
        band = (upos[None, :] <= tpos[:, None]) & (upos[None, :] >= 0)  # [tq, nband]
        old = jnp.arange(nbmax) < nb_j
        cbias = jnp.where(old & ~selmask, logk + delta, NEG)  # [B, nbmax]
        fbias = jnp.where(jnp.repeat(sel_valid, k, axis=1), jnp.repeat(delta_f, k, axis=1), NEG)  # [B, h k]
        qf = qw.astype(jnp.float32) * Dh**-0.5
        logits = jnp.concatenate([
            jnp.einsum("bhqd,bhkd->bhqk", qf, CK) + cbias[:, None, None, :],
            jnp.einsum("bhqd,bhkd->bhqk", qf, fK) + fbias[:, None, None, :],
            jnp.where(band[None, None], jnp.einsum("bhqd,bhkd->bhqk", qf, bK), NEG),
        ], axis=-1)
        p = jax.nn.softmax(logits, axis=-1)
        out = (jnp.einsum("bhqk,bhkd->bhqd", p[..., :nbmax], CV)
               + jnp.einsum("bhqk,bhkd->bhqd", p[..., nbmax:nbmax + h * k], fV)
               + jnp.einsum("bhqk,bhkd->bhqd", p[..., nbmax + h * k:], bV))
        return out, sel

    if nwin == 1:
        outs, sels = jax.tree.map(lambda t: t[None], one_window((jnp.int32(0), Qw[0], r0[0])))
    else:
        outs, sels = jax.lax.map(jax.checkpoint(one_window), (jnp.arange(nwin, dtype=jnp.int32), Qw, r0))
    # token t (window position p = offset + t) is row (p // w) tq + p % w - r_{p // w} of the windows' rows
    wpos = offset + jnp.arange(T, dtype=jnp.int32)
    o = outs.transpose(1, 2, 0, 3, 4).reshape(B, H, nwin * tq, Dh)
    o = jnp.take(o, (wpos // w) * tq + wpos % w - r0[wpos // w], axis=2, mode="clip").astype(x.dtype)
    o = o.transpose(0, 2, 1, 3).reshape(B, T, H * Dh)
    y1 = x + dropout(block.out(o), block.dropout_rate, deterministic, k_attn)
    f = block.mlp(block.norm2(y1), deterministic=deterministic, key=k_mlp)
    y = y1 + dropout(f, block.dropout_rate, deterministic, k_res)
    last = (offset + nv - 1) // w
    if n_valid is None:
        xbuf, qbuf = xcat[:, T:T + k], qcat[:, :, T:T + a]
    else:
        Kc, Vc = Kc[:, :, :g + M + w], Vc[:, :, :g + M + w]
        xbuf = jax.lax.dynamic_slice_in_dim(xcat, n_valid, k, axis=1)
        qbuf = jax.lax.dynamic_slice_in_dim(qcat, n_valid, a, axis=2)
    new = {**st, "k": Kc, "v": Vc, "ck": CK, "cv": CV, "xbuf": xbuf, "qbuf": qbuf,
           "sel": jax.lax.dynamic_index_in_dim(sels, last, axis=0, keepdims=False), "length": s + nv}
    return y, new, {"sel": sels}


def lm_layer_packed(block, x, st, opts: LMOptions, segment_ids, max_documents: int, *, deterministic: bool, key,
                    aligned: bool = False):
    """:func:`lm_layer` on packed rows x [B, T, d] with ``segment_ids`` [B, T] (docs/methods/vcc.md §4.3): every
    document runs as a row of its own (:class:`DocumentLayout`), from the empty state, except the call's leading
    run of tokens that continues the document ``st`` summarizes (``base.continues_state`` of ``st['segment']``),
    which runs from ``st`` (its windows, blocks, anchors and positions counted from that document's first token,
    ``st['doc_length']`` tokens ago). Each document gets the layer's key (in training: the draws of the document
    alone from a state of the same capacity). ``aligned``: ``st`` is empty (the parallel pass), so every document
    starts at a window border (:func:`lm_layer`'s ``aligned``). Returns (y, the state of each row's last document,
    info {'sel' per slot})."""
    B, T, d = x.shape
    lay = document_layout(segment_ids, max_documents)
    D = lay.src.shape[1]
    first = continues_state(st["segment"], segment_ids)[:, 0]  # [B]: slot 0 continues the carried document
    per_row = {name: leaf for name, leaf in st.items() if name not in ("length", "segment", "doc_length")}
    carried = {**per_row, "length": jnp.where(first, st["doc_length"], 0)}  # [B] leaves
    empty = {name: jnp.zeros_like(leaf) for name, leaf in carried.items()}
    slots = jax.tree.map(lambda c, e: jnp.stack([jnp.where(first.reshape((B,) + (1,) * (c.ndim - 1)), c, e)]
                                                + [e] * (D - 1), axis=1), carried, empty)  # [B, D, ...]

    def one(xe, ste, n):  # one document: x [T, d], its state's leaves without the batch axis
        one_row = {name: (leaf if name == "length" else leaf[None]) for name, leaf in ste.items()}
        y, new, info = lm_layer(block, xe[None], one_row, opts, deterministic=deterministic, key=key, aligned=aligned,
                                n_valid=n)
        return y[0], {name: (leaf if name == "length" else leaf[0]) for name, leaf in new.items()}, info["sel"][:, 0]

    flat = lambda t: t.reshape((B * D,) + t.shape[2:])  # noqa: E731
    y, new, sels = jax.vmap(one)(flat(lay.to_docs(x)), jax.tree.map(flat, slots), flat(lay.lengths))
    new = jax.tree.map(lambda t: t.reshape((B, D) + t.shape[1:]), new)
    last = lay.doc[:, -1]  # each row's last document
    pick = lambda t: jnp.take_along_axis(t, last.reshape((B, 1) + (1,) * (t.ndim - 2)), axis=1)[:, 0]  # noqa: E731
    state = {**jax.tree.map(pick, {name: leaf for name, leaf in new.items() if name != "length"}),
             "length": st["length"] + T, "segment": segment_ids[:, -1], "doc_length": pick(new["length"])}
    return lay.from_docs(y.reshape(B, D, T, d)), state, {"sel": sels.reshape((B, D) + sels.shape[1:])}


class VCCDecoderStack(nnx.Module):
    """VCC-LM (§4.2, our causal extension): every block's attention reads the old history
    (before the window's local band) at two resolutions chosen by the window's past anchors; the
    FFN and projections run on every token as in a dense layer. Runs the backbone's own blocks
    (same parameter tree as dense) and carries one state per layer (:func:`lm_init_state`).

    Nothing crosses layers (the stack is a loop of independent :func:`lm_layer` calls), so the wrapper
    also runs **one layer** of a ``model.attention.pattern`` (capability ``per_layer``, DESIGN.md
    "Capabilities, not names"): :meth:`init_layer_state` and :meth:`layer` on that layer's block alone.
    ``takes_grouped_kv``: grouped-query blocks (k/v heads repeated, :func:`project`) and any rotary base."""

    per_layer = True
    takes_grouped_kv = True
    takes_segments = True  # packed rows: lm_layer_packed (each document from its own state)

    def __init__(self, cfg, *, rngs: nnx.Rngs | None = None):
        name = cfg.attention.name
        vc = attention.default_config(name)
        vc.update(cfg.attention.get(name) or {})
        if not issubclass(get_block(cfg.block), TransformerBlock):
            raise ConfigError(f"model.attention.name={name!r} wraps the pre-LN transformer block; "
                              f"model.block={cfg.block!r} is not one")
        if cfg.post_norm:
            raise ConfigError(f"model.attention.name={name!r}: VCC-LM (the causal stack) wraps pre-LN blocks; "
                              "model.post_norm=True applies to the encoder stack (model.kind='encoder') only")
        lc = vc.causal
        self.opts = LMOptions(window=lc.window, local=lc.local, block_size=lc.block_size, num_fine=lc.num_fine_blocks,
                              anchors=lc.anchors, rotary=cfg.positions == "rotary",
                              scale_correction=vc.scale_correction, ste_gate=vc.ste_gate,
                              explore_prob=vc.explore_prob)
        self.d_model = cfg.d_model
        self.max_documents = vc.max_documents

    def init_layer_state(self, block, batch_size: int, max_len: int | None = None):
        """One layer's empty state (:func:`lm_init_state`) for ``max_len`` tokens."""
        if max_len is None or max_len <= 0:
            raise ValueError("vcc: init_state needs max_len (the state's capacity in tokens)")
        return lm_init_state(block, self.opts, batch_size, max_len, self.d_model)

    def init_state(self, blocks, batch_size: int, max_len: int | None = None):
        return [self.init_layer_state(b, batch_size, max_len) for b in blocks]

    def layer(self, block, x, state=None, *, deterministic=True, key=None, return_info: bool = False,
              segment_ids=None):
        """One VCC-LM layer on x [B, T, d]: (y, new state), and its selection info with ``return_info``.
        ``state`` None: no prefix (the parallel pass over x, a state for T tokens built here). ``segment_ids``
        [B, T] int32: packed rows (:func:`lm_layer_packed`)."""
        aligned = state is None
        if aligned:
            state = self.init_layer_state(block, x.shape[0], x.shape[1])
        if segment_ids is not None:
            y, state, info = lm_layer_packed(block, x, state, self.opts, segment_ids, self.max_documents,
                                             deterministic=deterministic, key=key, aligned=aligned)
        else:
            y, state, info = lm_layer(block, x, state, self.opts, deterministic=deterministic, key=key,
                                      aligned=aligned)
        return (y, state, info) if return_info else (y, state)

    def __call__(self, blocks, x, states=None, *, positions, important=None, valid=None, deterministic=True,
                 key=None, aux: Aux | None = None, return_info: bool = False, segment_ids=None):
        if states is not None and any(st is None for st in states) and not all(st is None for st in states):
            raise ValueError("vcc: the stack takes every layer's state or none")
        states = [None] * len(blocks) if states is None else states
        keys = split_key(key, len(blocks))
        new_states, infos = [], []
        for block, st, kl in zip(blocks, states, keys):
            x, st, info = self.layer(block, x, st, deterministic=deterministic, key=kl, return_info=True,
                                     segment_ids=segment_ids)
            new_states.append(st)
            infos.append(info)
        return (x, new_states, infos) if return_info else (x, new_states)


__all__ = ["DocumentLayout", "LMOptions", "VCCDecoderStack", "VCCEncoderStack", "VCCState", "choose_blocks",
           "compression_matrices", "document_layout", "format_rows", "lm_init_state", "lm_layer", "lm_layer_packed",
           "lm_select", "materialize", "selection_logits", "ste_delta", "tokens_of", "vcc_layer"]
