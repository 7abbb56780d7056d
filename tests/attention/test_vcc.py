"""VCC (docs/methods/vcc.md §6, checks 1-9): the paper's own properties of the encoder stack and VCC-LM, the
core's implementations (chunked = reference: the shared law, tests/attention/test_implementations.py, runs on
bare q, k, v and cannot reach a core that needs its wrapper's key bias) and the settings that select them. fp32
unless stated, tiny shapes, seeded. The model-level contract laws (shapes, vmap, streamed = decoded = full, no
leak at eval, randomness from the key, finite gradients) run in tests/models/test_model_contract.py.

The fidelity fixes' regression tests (padding, rows without VIPs, VIP overflow, VCC-LM exploration) are
tests/fidelity/test_vcc_fidelity.py's."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx.attention import dispatch
from longctx.attention import vcc as vcc_core
from longctx.attention.base import CapacityError
from longctx.attention.vcc import stack as vs
from longctx.config import base_config
from longctx.errors import ConfigError
from longctx.models.decoder import build_model

B, V, D_MODEL = 2, 64, 16
NAME = "vcc"
LM = {"window": 8, "local": 8, "block_size": 4, "num_fine_blocks": 2, "anchors": 4}


def model_cfg(method=NAME, *, num_layers=3, positions="rotary", **vc):
    c = base_config().model
    c.kind, c.causal = "encoder", False
    c.vocab_size, c.d_model, c.num_layers, c.num_heads, c.head_dim, c.d_ff = V, D_MODEL, num_layers, 2, 8, 32
    c.positions, c.max_len = positions, 128  # max_len: the learned positions' table
    c.attention.name = method
    if method == NAME:
        c.attention[NAME] = {"num_vip": 8, "block_size": 4, "num_fine_blocks": 2, "num_dense_layers": 1,
                             "dense_segment_len": 64, "impl": "reference", **vc}
    return c


def lm_cfg(method=NAME, *, explore_prob=0.1, **causal):
    """The decoder of model_cfg's size, 2 layers; VCC-LM: LM updated with ``causal``."""
    c = model_cfg(method, num_layers=2)
    c.kind, c.causal = "decoder", True
    if method == NAME:
        c.attention[NAME] = {"causal": dict(LM, **causal), "explore_prob": explore_prob}
    return c


def build(method=NAME, *, post_norm=False, **kw):
    c = model_cfg(method, **kw)
    c.post_norm = post_norm  # BERT / RoBERTa blocks: x = LN1(x + A(x)); x = LN2(x + F(x)), a norm after the embeddings
    return build_model(c, seed=0)


def lm(method=NAME, **kw):
    return build_model(lm_cfg(method, **kw), seed=0)


def inputs(T, seed=0, rate=0.15):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.randint(k1, (B, T), 0, V - 1), jax.random.bernoulli(k2, rate, (B, T))


def backbone(model, tokens, imp=None, *, state=None, valid=None, deterministic=True, key=None, embedded=None):
    """The output before the final norm, the new states and the per-layer selection info (a dense model: its
    blocks' output only), from tokens or their embeddings ``embedded``."""
    s0 = 0 if state is None else state[0]["length"]
    pos = s0 + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    x = model.embed_tokens(tokens, pos) if embedded is None else embedded
    if model.stack is None:
        for block in model.blocks:
            x, _ = block(x, None, positions=pos)
        return x, None, None
    return model.stack(model.blocks, x, state, positions=pos, important=imp, valid=valid,
                       deterministic=deterministic, key=key, return_info=True)


# jitted: eager dispatch of the stack's many small ops cost most of this file's time. Inside a trace call backbone
# itself (nnx.jit cannot take an outer module there).
hidden = nnx.jit(backbone, static_argnames=("deterministic",))


@nnx.jit
def call(model, tokens, imp=None):
    """model(tokens, imp), jitted (a decoder's second argument is its state)."""
    return model(tokens, imp)


# jitted: an eager call dispatches op by op
format_rows = jax.jit(vs.format_rows, static_argnums=(4, 5))
materialize = jax.jit(vs.materialize)


# ----------------------------------------------------------------------------- 1. no compression = dense
@pytest.mark.parametrize("make", [build, lm], ids=["encoder", "lm"])
def test_parameter_tree_is_the_dense_models(make):
    pd, pv = nnx.state(make("dense"), nnx.Param), nnx.state(make(), nnx.Param)
    assert jax.tree.structure(pd) == jax.tree.structure(pv)
    for a, b in zip(jax.tree.leaves(pd), jax.tree.leaves(pv)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("positions", ["rotary", pytest.param("learned", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["all_blocks_fine", pytest.param("block_size_1", marks=pytest.mark.slow)])
@pytest.mark.parametrize("post_norm", [False, True], ids=["pre_norm", "post_norm"])
def test_no_compression_equals_dense(kind, positions, post_norm):
    """post_norm: BERT's / RoBERTa's blocks (an imported encoder; the stack's update is the block's output less its
    input), a norm after the embeddings."""
    vc = {"num_fine_blocks": 8} if kind == "all_blocks_fine" else {"block_size": 1, "num_fine_blocks": 3}
    dense, vcc = build("dense", positions=positions, post_norm=post_norm), build(positions=positions,
                                                                                 post_norm=post_norm, **vc)
    assert all(b.post_norm == post_norm for b in vcc.blocks)
    tokens, imp = inputs(40)
    want, _ = call(dense, tokens, imp)
    got, _ = call(vcc, tokens, imp)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    # training mode (exploration, straight-through gate): the forward value is still dense's
    got_t = hidden(vcc, tokens, imp, deterministic=False, key=jax.random.key(3))[0]
    np.testing.assert_allclose(np.asarray(got_t), np.asarray(hidden(dense, tokens)[0]), atol=1e-5, rtol=1e-5)
    # and compression does change it (the test can fail)
    lossy = build(positions=positions, num_fine_blocks=1, post_norm=post_norm)
    assert float(jnp.max(jnp.abs(call(lossy, tokens, imp)[0] - want))) > 1e-3


def test_segment_local_dense_layers_are_dense_per_segment():
    T, seg = 48, 16
    vcc = build(positions="none", num_dense_layers=3, dense_segment_len=seg)
    dense = build("dense", positions="none")
    tokens, imp = inputs(T)
    got = hidden(vcc, tokens, imp)[0]
    want = jnp.concatenate([hidden(dense, tokens[:, a:a + seg])[0] for a in range(0, T, seg)], axis=1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    assert float(jnp.max(jnp.abs(hidden(dense, tokens)[0] - want))) > 1e-3  # segments really are cut


# ----------------------------------------------------------------------------- 2. dense-matrix reference
@nnx.jit
def gamma_reference(block, Y, bias):
    """γ_D(Y) = A + F of the pre-LN block with a per-key logit bias, written out from its weights; for a
    post-norm block the update LN2(x1 + F(x1)) - Y, x1 = LN1(Y + A) (its output less its input)."""
    R = Y.shape[0]
    H, Dh = block.num_heads, block.head_dim
    qkv = block.qkv(Y[None] if block.post_norm else block.norm1(Y[None]))[0].reshape(R, 3, H, Dh)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    s = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(Dh) + bias[None, None, :]
    a = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, -1), v).reshape(R, H * Dh)
    A = block.out(a[None])[0]
    if block.post_norm:
        x1 = block.norm1((Y + A)[None])
        return block.norm2(x1 + block.mlp(x1, deterministic=True))[0] - Y
    F = block.mlp(block.norm2((Y + A)[None]), deterministic=True)[0]
    return A + F


@pytest.mark.parametrize("post_norm", [False, True], ids=["pre_norm", "post_norm"])
def test_dense_matrix_reference(post_norm):
    T, n_p, k, h = 64, 8, 4, 3
    nb = (T - n_p) // k
    model = build(num_layers=1, num_dense_layers=0, num_vip=n_p, block_size=k, num_fine_blocks=h, positions="none",
                  post_norm=post_norm)
    tokens, imp = inputs(T, seed=4)
    x = model.embed_tokens(tokens, jnp.arange(T))
    got, _, infos = hidden(model, tokens, imp, embedded=x)
    st, _ = format_rows(x, imp, jnp.ones((B, T), bool), jnp.broadcast_to(jnp.arange(T), (B, T)), n_p, k)
    for b in range(B):
        fine = np.asarray(infos[0]["fine_idx"][b])
        S_c, S_dag, D = vs.compression_matrices(fine, nb, k)
        perm = np.asarray(st.perm[b])
        X = np.asarray(x[b])[perm]
        P, C = X[:n_p], X[n_p:]
        SX = np.concatenate([P, S_c @ C])
        bias = np.concatenate([np.zeros(n_p), np.log(D)])
        U = np.asarray(gamma_reference(model.blocks[0], jnp.asarray(SX, jnp.float32), jnp.asarray(bias, jnp.float32)))
        X_new = X + np.concatenate([U[:n_p], S_dag @ U[n_p:]])
        np.testing.assert_allclose(np.asarray(got[b]), X_new[np.argsort(perm)], atol=1e-5, rtol=1e-5)
        assert len(set(fine.tolist())) == h


# ----------------------------------------------------------------------------- 3. compression algebra
def test_compression_algebra():
    nb, k = 6, 4
    rng = np.random.default_rng(0)
    fine = rng.choice(nb, size=2, replace=False)
    S, S_dag, D = vs.compression_matrices(fine, nb, k)
    assert S.shape == (nb - 2 + 2 * k, nb * k)
    np.testing.assert_allclose(S @ S_dag, np.eye(S.shape[0]), atol=1e-12)
    np.testing.assert_allclose(S_dag, S.T * D[None, :], atol=1e-12)
    assert ((S_dag == 0) | (S_dag == 1)).all() and (S_dag.sum(1) == 1).all()  # one-hot rows
    Pr = S_dag @ S
    np.testing.assert_allclose(Pr, Pr.T, atol=1e-12)
    np.testing.assert_allclose(Pr @ Pr, Pr, atol=1e-12)
    # exp(P (S C)^T) D S == exp(<P_i, mean of the segment containing j>)  (MRA's "exp of the mean logit")
    Pv, C = rng.normal(size=(3, 5)), rng.normal(size=(nb * k, 5))
    lhs = np.exp(Pv @ (S @ C).T) * D[None, :] @ S
    seg_mean = S_dag @ (S @ C)  # each token -> its segment's mean
    np.testing.assert_allclose(lhs, np.exp(Pv @ seg_mean.T), rtol=1e-10)


def test_format_materialize_round_trip_and_block_update_reaches_every_token():
    T, n_p, k = 40, 8, 4
    x = jax.random.normal(jax.random.key(0), (B, T, D_MODEL))
    vip = jax.random.bernoulli(jax.random.key(1), 0.2, (B, T))
    valid = jnp.ones((B, T), bool).at[1, -6:].set(False)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    st, _ = format_rows(x, vip, valid, pos, n_p, k)
    np.testing.assert_allclose(np.asarray(materialize(st)), np.asarray(x * valid[..., None]), atol=1e-6)
    # an update of block b's mean reaches all k of its tokens (and nothing else)
    u = jax.random.normal(jax.random.key(2), (D_MODEL,))
    st2 = vs.VCCState(**{**st.__dict__, "coarse": st.coarse.at[0, 3].add(u)})
    moved = np.asarray(materialize(st2) - materialize(st))[0]
    members = np.asarray(st.perm[0, n_p + 3 * k: n_p + 4 * k])
    np.testing.assert_allclose(moved[members], np.broadcast_to(np.asarray(u), (k, D_MODEL)), atol=1e-6)
    assert np.abs(np.delete(moved, members, axis=0)).max() == 0.0


# ----------------------------------------------------------------------------- 4. T(C) consistency
def test_tree_consistency_after_every_layer():
    T, n_p, k = 40, 8, 4
    model = build(num_layers=4, num_dense_layers=1)
    tokens, imp = inputs(T, seed=2)
    valid = jnp.ones((B, T), bool).at[1, -10:].set(False)  # two whole blocks of row 1 are padding
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    x = model.embed_tokens(tokens, jnp.arange(T))
    x = nnx.jit(lambda b, x: vs.segment_local_layer(b, x, pos, valid, 64, rotary=True, deterministic=True, key=None))(
        model.blocks[0], x)
    st, _ = format_rows(x, imp, valid, pos, n_p, k)
    kw = model.stack.layer_kwargs(True, model.stack.num_fine)
    layer = nnx.jit(lambda block, s: vs.vcc_layer(block, s, key=None, **kw))  # one program, 3 layers
    for i in range(1, 4):
        st, info = layer(model.blocks[i], st)
        toks = jax.jit(vs.tokens_of)(st)
        bv = np.asarray(st.block_valid)
        mean = np.asarray(jax.jit(vs.masked_mean, static_argnums=2)(toks, st.tok_valid, 2))
        np.testing.assert_allclose(np.asarray(st.coarse)[bv], mean[bv], atol=1e-5)
        tv = np.asarray(st.tok_valid)[..., None]
        np.testing.assert_allclose(np.asarray(st.diff) * tv,
                                   (np.asarray(st.coarse)[:, :, None] - np.asarray(toks)) * tv, atol=1e-5)
        np.testing.assert_allclose((np.asarray(st.diff) * tv).sum(2)[bv], 0.0, atol=1e-5)
        # the incremental update equals rebuilding T(C) from the materialized tokens
        rebuilt, _ = format_rows(materialize(st), imp, valid, pos, n_p, k)
        np.testing.assert_allclose(np.asarray(rebuilt.coarse)[bv], np.asarray(st.coarse)[bv], atol=1e-5)
        np.testing.assert_allclose(np.asarray(rebuilt.diff) * tv, np.asarray(st.diff) * tv, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(rebuilt.P), np.asarray(st.P) * np.asarray(st.vip_valid)[..., None])
        assert not np.asarray(info["sel"])[~bv].any(), "an all-padding block was selected at eval"


# ----------------------------------------------------------------------------- 5. selection
def _numpy_selection(qv, kc, imp, block_valid):
    """log(mean over heads and VIP slots of softmax(kc qv / sqrt(D)) over the valid blocks + 1e-5), -1e30 at
    padding blocks; a slot that holds no VIP adds 0 but counts in the mean."""
    qv, kc = np.asarray(qv, np.float64), np.asarray(kc, np.float64)
    _, H, n_p, D = qv.shape
    s = np.where(block_valid[:, None, None], np.einsum("bhid,bhjd->bhij", qv, kc) / math.sqrt(D), -1e9)
    p = np.exp(s - s.max(-1, keepdims=True))
    pbar = (p / p.sum(-1, keepdims=True) * imp[:, None, :, None]).sum((1, 2)) / (H * n_p)
    return np.where(block_valid, np.log(pbar + 1e-5), -1e30)


def test_selection_matches_numpy_and_ignores_non_vip_slots():
    ks = jax.random.split(jax.random.key(0), 3)
    qv = jax.random.normal(ks[0], (B, 2, 6, 8)) * 2
    kc = jax.random.normal(ks[1], (B, 2, 7, 8)) * 2
    imp = np.array([[1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 1, 1]], bool)
    bv = np.ones((B, 7), bool)
    bv[1, 5:] = False
    ell = vs.selection_logits(qv, kc, jnp.asarray(imp), jnp.asarray(bv))
    np.testing.assert_allclose(np.asarray(ell), _numpy_selection(qv, kc, imp, bv), rtol=1e-5, atol=1e-5)
    qv2 = jnp.where(jnp.asarray(imp)[:, None, :, None], qv, 5.0 * jax.random.normal(ks[2], qv.shape))
    np.testing.assert_array_equal(np.asarray(vs.selection_logits(qv2, kc, jnp.asarray(imp), jnp.asarray(bv))),
                                  np.asarray(ell))
    fine = vs.choose_blocks(ell, 5, explore_prob=0.1, deterministic=True, key=None)
    assert set(np.asarray(fine[1]).tolist()) == {0, 1, 2, 3, 4}  # padding blocks never beat valid ones
    np.testing.assert_array_equal(np.asarray(fine[0]), np.argsort(-np.asarray(ell[0]), kind="stable")[:5])


def test_exploration_is_uniform_and_has_the_configured_rate():
    nb, h, N = 8, 2, 4000
    ell = jnp.broadcast_to(jnp.linspace(0.0, -3.0, nb), (N, nb))
    fine = vs.choose_blocks(ell, h, explore_prob=1.0, deterministic=False, key=jax.random.key(0))
    counts = np.bincount(np.asarray(fine).ravel(), minlength=nb)
    expected = N * h / nb
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 24.3, (chi2, counts)  # chi^2(7 dof) 0.999 quantile
    fine = vs.choose_blocks(ell, h, explore_prob=0.3, deterministic=False, key=jax.random.key(1))
    moved = np.any(np.sort(np.asarray(fine), 1) != np.array([0, 1]), axis=1).mean()
    rate = 0.3 * (1 - 1 / math.comb(nb, h))
    assert abs(moved - rate) < 4 * math.sqrt(rate * (1 - rate) / N), moved
    top = vs.choose_blocks(ell, h, explore_prob=0.3, deterministic=True, key=jax.random.key(1))
    assert (np.sort(np.asarray(top), 1) == [0, 1]).all()


@pytest.mark.parametrize("post_norm", [False, True], ids=["pre_norm", "post_norm"])
def test_straight_through_gate_changes_gradients_not_values(post_norm):
    T = 40
    tokens, imp = inputs(T, seed=5)
    outs, grads = {}, {}
    for ste in (True, False):
        model = build(num_layers=2, num_dense_layers=0, ste_gate=ste, explore_prob=0.1, post_norm=post_norm)
        outs[ste] = hidden(model, tokens, imp, deterministic=False, key=jax.random.key(9))[0]
        x = model.embed_tokens(tokens, jnp.arange(T))
        st, _ = format_rows(x, imp, jnp.ones((B, T), bool), jnp.broadcast_to(jnp.arange(T), (B, T)), 8, 4)
        kw = dict(model.stack.layer_kwargs(False, model.stack.num_fine), explore_prob=0.0)

        def loss(probe, st=st, model=model, kw=kw):
            new, _ = vs.vcc_layer(model.blocks[0], st, key=jax.random.key(1), probe=probe, **kw)
            return jnp.sum(vs.materialize(new) ** 2)

        grads[ste] = jax.jit(jax.grad(loss))(jnp.zeros((B, 8)))
    np.testing.assert_array_equal(np.asarray(outs[True]), np.asarray(outs[False]))
    assert float(jnp.max(jnp.abs(grads[True]))) > 1e-6, "no gradient reaches the selection logits with the gate"
    assert float(jnp.max(jnp.abs(grads[False]))) == 0.0


def test_eval_is_deterministic_and_training_explores():
    model = build(explore_prob=0.5)
    tokens, imp = inputs(40, seed=6)
    a, _, ia = hidden(model, tokens, imp)
    b, _, ib = hidden(model, tokens, imp, key=jax.random.key(1))  # deterministic ignores the key
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    sels = [np.asarray(hidden(model, tokens, imp, deterministic=False, key=jax.random.key(s))[2][0]
                       ["fine_idx"]) for s in range(6)]
    assert any((np.sort(s, 1) != np.sort(np.asarray(ia[0]["fine_idx"]), 1)).any() for s in sels)


# ----------------------------------------------------------------------------- 6. format
def test_format_vip_order_underflow_and_overflow():
    T, n_p, k = 24, 4, 4
    x = jax.random.normal(jax.random.key(0), (B, T, 3))
    vip = np.zeros((B, T), bool)
    vip[0, [3, 9, 17]] = True  # fewer than n_p
    vip[1, [1, 2, 5, 11, 20, 23]] = True  # more than n_p
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    st, overflow = format_rows(x, jnp.asarray(vip), jnp.ones((B, T), bool), pos, n_p, k)
    perm = np.asarray(st.perm)
    assert perm[0, :4].tolist() == [3, 9, 17, 0]  # VIP in order, then the earliest other token
    assert np.asarray(st.imp)[0].tolist() == [True, True, True, False]
    assert perm[1, :4].tolist() == [1, 2, 5, 11] and np.asarray(st.imp)[1].all()
    assert sorted(perm[1, 4:].tolist()) == sorted(set(range(T)) - {1, 2, 5, 11})  # surplus VIPs compressed
    assert np.asarray(overflow).tolist() == [0, 2]
    np.testing.assert_allclose(np.asarray(materialize(st)), np.asarray(x), atol=1e-6)
    model = build(num_vip=n_p)
    _, aux = call(model, jax.random.randint(jax.random.key(1), (B, T), 0, V - 1), jnp.asarray(vip))
    assert int(aux["metrics"]["stack/vip_overflow"]) == 2


@pytest.mark.slow
def test_rows_of_any_length_and_short_rows_have_nothing_to_compress():
    model = build()
    for T in (9, 23, 41):  # (T = 1 and a row 3 tokens shorter than the case's: the model contract)
        tokens, imp = inputs(T, seed=T)
        out, _ = model(tokens, imp)
        assert out.shape == (B, T, V) and bool(jnp.all(jnp.isfinite(out)))
    tokens, imp = inputs(14, seed=1)  # 8 VIP slots + 2 blocks <= 2 fine blocks: exact
    np.testing.assert_allclose(np.asarray(model(tokens, imp)[0]), np.asarray(build("dense")(tokens, imp)[0]), atol=1e-5)


# ----------------------------------------------------------------------------- 8. gradients
@pytest.mark.slow  # the default configuration's finite gradients (fp32, bf16): tests/models/test_model_contract.py
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["padding", "no_vip", "all_fine", "one_fine"])
def test_gradients_are_finite(variant, dtype):
    T = 40
    h = {"all_fine": 8, "one_fine": 1}.get(variant, 2)
    model = build(num_fine_blocks=h)
    tokens, imp = inputs(T, seed=7)
    if variant == "no_vip":
        imp = jnp.zeros_like(imp)
    valid = jnp.ones((B, T), bool).at[0, -13:].set(False) if variant == "padding" else None
    gd, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.tree.map(lambda p: p.astype(dtype), params)

    def loss(p):
        m = nnx.merge(gd, p, rest)
        y = backbone(m, tokens, imp, valid=valid, deterministic=False, key=jax.random.key(0))[0]
        return jnp.mean(y.astype(jnp.float32) ** 2)

    grads = jax.jit(jax.grad(loss))(params)
    leaves = [g.astype(jnp.float32) for g in jax.tree.leaves(grads)]
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert max(float(jnp.max(jnp.abs(g))) for g in leaves) > 0.0


def test_gradient_reaches_a_token_of_an_unselected_block():
    T, n_p, k = 40, 8, 4
    model = build(num_layers=1, num_dense_layers=0)
    tokens, imp = inputs(T, seed=8)
    x = model.embed_tokens(tokens, jnp.arange(T))
    infos = hidden(model, tokens, imp, embedded=x)[2]
    st, _ = format_rows(x, imp, jnp.ones((B, T), bool), jnp.broadcast_to(jnp.arange(T), (B, T)), n_p, k)
    unselected = [b for b in range(8) if b not in np.asarray(infos[0]["fine_idx"][0]).tolist()][0]
    tok = int(st.perm[0, n_p + unselected * k + 1])
    vip_rows = np.asarray(st.perm[0, :n_p])[np.asarray(st.imp[0])]

    def loss(x):  # the loss reads only the VIP outputs of row 0
        return jnp.sum(backbone(model, tokens, imp, embedded=x)[0][0, vip_rows] ** 2)

    g = jax.jit(jax.grad(loss))(x)
    assert float(jnp.max(jnp.abs(g[0, tok]))) > 1e-6


# ----------------------------------------------------------------------------- 9. one compilation per shape
def test_one_compilation_per_shape():
    model = build()
    gd, state = nnx.split(model)
    traces = []

    @jax.jit
    def fwd(state, tokens, imp):
        traces.append(1)
        return nnx.merge(gd, state)(tokens, imp)[0]

    for seed, rate in ((0, 0.05), (1, 0.3), (2, 0.6)):  # different VIP counts (under- and overflow)
        jax.block_until_ready(fwd(state, *inputs(40, seed=seed, rate=rate)))
    assert len(traces) == 1


# ----------------------------------------------------------------------------- config
def test_config_refusals():
    gau = model_cfg()
    gau.block = "gau"
    post_lm = lm_cfg()
    post_lm.post_norm = True  # post-norm blocks: the encoder stack only
    for c, match in ((lm_cfg(block_size=3), "must divide window"), (model_cfg(levels=(16, 1)), "levels"),
                     (gau, "pre-LN"), (post_lm, "VCC-LM .* wraps pre-LN blocks"),
                     (model_cfg(num_dense_layers=5), "num_dense_layers"),
                     (model_cfg(impl="blockwise"), "unknown 'blockwise'")):
        with pytest.raises(ConfigError, match=match):
            build_model(c)


def test_the_core_refuses_to_run_without_its_wrapper():
    model = build()
    q = jnp.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError, match="stack wrapper"):
        model.blocks[0].core(q, q, q)
    with pytest.raises(ValueError, match="stack wrapper"):
        model.blocks[0](jnp.zeros((1, 4, D_MODEL)), None, positions=jnp.arange(4))


# ----------------------------------------------------------------------------- implementations of the core
def test_auto_takes_chunked_with_the_platforms_query_chunk():
    """impl='auto' takes chunked on every platform; a query_chunk of 0 runs with the platform's default
    (xla.QUERY_CHUNK), a written one as written; the reference only when named."""
    from longctx.attention.vcc import xla as vcc_xla

    for plat in ("cpu", "cuda", "tpu"):
        assert vcc_core.choose("auto", platform=plat).name == "chunked"
    assert vcc_core.choose("reference", platform="cpu").name == "reference"
    chunked = dispatch.by_name(vcc_core.implementations())["chunked"]
    assert chunked.setting("query_chunk", 0, "cpu") == vcc_xla.QUERY_CHUNK["cpu"]
    assert chunked.setting("query_chunk", 0, "cuda") == vcc_xla.QUERY_CHUNK["cuda"] > vcc_xla.QUERY_CHUNK["cpu"]
    assert chunked.setting("query_chunk", 512, "cuda") == 512
    # rows that fit one chunk: the reference's float32 operations exactly
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (jax.random.normal(kk, (1, 2, 24, 8)) for kk in ks[:3])
    bias = jax.random.normal(ks[3], (1, 24))
    want = vcc_core.attend(q, k, v, bias, impl="reference", platform="cpu")
    assert np.array_equal(vcc_core.attend(q, k, v, bias, impl="chunked", platform="cpu"), want)


# ============================================================================= VCC-LM (§4.2, §6.7)
# every old block refined, or blocks of one token: exact everywhere; the defaults: exact in the windows whose old
# history holds no complete block (t0 - g < k), compressed after
@pytest.mark.parametrize("kind", ["all_old_blocks_fine", pytest.param("block_size_1", marks=pytest.mark.slow),
                                  "default"])
def test_lm_equals_dense_where_nothing_is_compressed(kind):
    T, w, g, k = 64, 8, 8, 4
    kw = {"all_old_blocks_fine": {"num_fine_blocks": (T - w - g) // k}, "block_size_1": {"block_size": 1},
          "default": {}}[kind]
    exact = T if kw else w + g + k
    tokens, _ = inputs(T, seed=1 if kw else 2)
    model = lm(**kw)
    want, got = call(lm("dense"), tokens)[0], call(model, tokens)[0]
    y = hidden(model, tokens, deterministic=False, key=jax.random.key(2))[0]  # training mode too
    for out in (got, model.logits(model.norm(y))):
        np.testing.assert_allclose(np.asarray(out[:, :exact]), np.asarray(want[:, :exact]), atol=1e-5, rtol=1e-5)
    if not kw:
        assert float(jnp.max(jnp.abs(got[:, exact:] - want[:, exact:]))) > 1e-3


@pytest.mark.slow  # token-by-token decoding: one compiled step per token
def test_lm_decoding_selects_the_blocks_of_the_parallel_pass():
    """Each window's fine blocks, chosen while decoding at its first token, are those of the parallel pass
    (outputs streamed = decoded = full: the model contract)."""
    T, w = 64, 8
    model = lm()
    tokens, _ = inputs(T, seed=3)
    infos = hidden(model, tokens)[2]
    step = jax.jit(lambda t, s: backbone(model, t, state=s)[:2])
    state = model.init_state(B, T)["layers"]
    for t in range(T):
        _, state = step(tokens[:, t:t + 1], state)
        if t % w == 0:
            for layer in range(2):
                np.testing.assert_array_equal(np.asarray(state[layer]["sel"]),
                                              np.asarray(infos[layer]["sel"][t // w]),
                                              err_msg=f"selection of window {t // w}, layer {layer}")


@pytest.mark.slow  # the model contract checks no leak at eval; this is training mode (exploration, gate)
def test_lm_no_future_leak_in_training_mode():
    T, t_star = 64, 45
    model = lm(explore_prob=0.5)
    tokens, _ = inputs(T, seed=4)
    key = jax.random.key(5)
    y = hidden(model, tokens, deterministic=False, key=key)[0]
    pert = tokens.at[:, t_star].set((tokens[:, t_star] + 9) % (V - 1))
    y2 = hidden(model, pert, deterministic=False, key=key)[0]
    np.testing.assert_array_equal(np.asarray(y[:, :t_star]), np.asarray(y2[:, :t_star]))
    assert float(jnp.max(jnp.abs(y[:, t_star:] - y2[:, t_star:]))) > 1e-4
    x = model.embed_tokens(tokens, jnp.arange(T))
    for t in (20, 41, 62):
        _, vjp = jax.vjp(lambda x, t=t: backbone(model, tokens, deterministic=False, key=key, embedded=x)[0][:, t], x)
        (g,) = vjp(jax.random.normal(jax.random.key(t), (B, D_MODEL)))
        assert float(jnp.max(jnp.abs(g[:, t + 1:]))) == 0.0, f"d y[{t}] / d x[> {t}] is not zero"
        assert float(jnp.max(jnp.abs(g[:, :4]))) > 0.0


def _numpy_lm_selection(anchors, valid, ck, nb_j):
    """log(mean over heads and valid anchors of softmax(ck anchors / sqrt(D)) over the nb_j old blocks + 1e-5),
    -1e30 at the others."""
    anchors, ck = np.asarray(anchors, np.float64), np.asarray(ck, np.float64)
    _, H, _, D = anchors.shape
    s = np.einsum("bhid,bhjd->bhij", anchors, ck[:, :, :nb_j]) / math.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    pbar = (p / p.sum(-1, keepdims=True) * valid[:, None]).sum((1, 2))
    out = np.full((ck.shape[0], ck.shape[2]), -1e30)
    out[:, :nb_j] = np.log(pbar / (H * max(valid.sum(), 1)) + 1e-5)
    return out


def test_lm_selection_matches_numpy():
    ks = jax.random.split(jax.random.key(0), 2)
    anchors = 2 * jax.random.normal(ks[0], (B, 2, 4, 8))
    ck = 2 * jax.random.normal(ks[1], (B, 2, 10, 8))
    valid = np.array([False, True, True, True])
    sel, ell = vs.lm_select(anchors, jnp.asarray(valid), ck, 6, 3, explore_prob=0.1, deterministic=True, key=None)
    want = _numpy_lm_selection(anchors, valid, ck, 6)
    np.testing.assert_allclose(np.asarray(ell), want, rtol=1e-5, atol=1e-5)
    for b in range(B):
        assert sorted(np.asarray(sel[b]).tolist()) == sorted(np.argsort(-want[b], kind="stable")[:3].tolist())
        assert (np.asarray(sel[b]) < 6).all()  # only old blocks


def test_lm_capacity_is_never_exceeded_silently():
    model = lm()
    tokens, _ = inputs(24, seed=6)
    with pytest.raises(CapacityError):
        model(tokens, model.init_state(B, 16))
    step = jax.jit(lambda t, s: model(t, s)[:2])
    _, state = step(tokens[:, :12], model.init_state(B, 16))
    with pytest.raises(Exception, match="CapacityError|holds 16 tokens"):
        jax.block_until_ready(step(tokens[:, 12:], state))


# ----------------------------------------------------------------------------- packed rows (§4.3)
def test_document_layout_puts_each_document_in_its_own_slot_and_back():
    """Each document's tokens open its slot in order (padding after them); gathering back is the identity."""
    rows = ((3, 6, 1), (10, 0, 0))
    seg = jnp.asarray(np.stack([np.repeat(np.arange(1, 4), r) for r in rows]), jnp.int32)
    lay = vs.document_layout(seg, 4)
    a = jnp.arange(20).reshape(2, 10) * 10
    slots = np.asarray(lay.to_docs(a))
    assert np.asarray(lay.lengths).tolist() == [[3, 6, 1, 0], [10, 0, 0, 0]]
    in_doc = np.asarray(lay.in_doc)
    assert slots[0, 1][in_doc[0, 1]].tolist() == [30, 40, 50, 60, 70, 80]
    assert slots[1, 0].tolist() == list(range(100, 200, 10)) and not in_doc[1, 1:].any()
    np.testing.assert_array_equal(np.asarray(lay.from_docs(lay.to_docs(a[..., None])))[..., 0], np.asarray(a))
    assert np.asarray(vs.document_layout(jnp.asarray([[1, 2, 1]]), 4).lengths).tolist() == [[1, 1, 1]]  # a run, not an id
    with pytest.raises(CapacityError, match="3 documents"):
        vs.document_layout(seg, 2)


def test_lm_layer_on_a_padded_chunk_leaves_the_state_of_its_real_tokens():
    """``n_valid``: the first n tokens of a padded chunk give the outputs and the state of those n tokens fed alone
    (the cache past the state's length is never read)."""
    model = lm()
    block, opts = model.blocks[0], model.stack.opts
    x = jax.random.normal(jax.random.key(2), (B, 20, D_MODEL))
    layer = jax.jit(lambda x, st, n=None, aligned=False: vs.lm_layer(block, x, st, opts, deterministic=True,
                                                                     key=None, aligned=aligned, n_valid=n)[:2],
                    static_argnames="aligned")
    _, st = layer(x[:, :9], vs.lm_init_state(block, opts, B, 24, D_MODEL), aligned=True)
    want_y, want = layer(x[:, 9:15], st)
    got_y, got = layer(x[:, 9:20], st, jnp.int32(6))
    np.testing.assert_allclose(np.asarray(got_y[:, :6]), np.asarray(want_y), atol=1e-6, rtol=1e-6)
    upto = opts.local + 15  # cache slots of the 15 tokens fed
    for name in want:
        w, g = np.asarray(want[name]), np.asarray(got[name])
        if name in ("k", "v"):
            w, g = w[:, :, :upto], g[:, :, :upto]
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-6, err_msg=name)
