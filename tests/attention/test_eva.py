"""EVA (docs/methods/eva.md §6). fp32, small sizes; RPE and dropout off unless stated.

A stream in pieces in training mode (ω per chunk, dropout by absolute position) and with the exact chunk
log-sum-exp equals the full pass: the contract's laws on the case "overlap_lse_dropout" (test_contract.py)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx import attention
from longctx.attention import dispatch, eva
from longctx.attention.eva import xla_cpu
from longctx.errors import ConfigError
from pallas_kernels import eva_attend, eva_attend_ref
from tests.attention import kit
from tests.attention.kit import maxdiff, out, run, softmax_attention

B, H, D = 2, 2, 16  # kit's batch and heads
make = functools.partial(kit.build, "eva", head_dim=D)
qkv = functools.partial(kit.qkv, head_dim=D)
TRAIN = dict(deterministic=False, key=jax.random.PRNGKey(4))


# §6.1; a ragged bidirectional row with -m slow (its padded chunks: test_ragged_bidirectional_padding_masked)
@pytest.mark.parametrize("causal,L", [(True, 64), (False, 64), (True, 45),
                                      pytest.param(False, 45, marks=pytest.mark.slow)])
def test_full_window_disjoint_is_exact_and_full_partition_differs(causal, L):
    q, k, v = qkv(L)
    ref = softmax_attention(q, k, v, causal)
    chunking = dict(chunk_size=8) if causal else dict(num_chunks=8)
    exact = make(causal, window_size=64, partition="disjoint", use_rpe=False, **chunking)
    assert maxdiff(out(exact, q, k, v), ref) < 1e-5
    full = make(causal, window_size=64, partition="full", use_rpe=False, **chunking)
    assert maxdiff(out(full, q, k, v), ref) > 1e-3  # released setting double counts earlier chunks


# §6.2: causal with the block {n}, bidirectional with no local block
@pytest.mark.parametrize("causal,L,base", [(True, 20, dict(window_size=1, chunk_size=1)),
                                           (False, 32, dict(window_size=0, num_chunks=32))])
def test_one_token_per_chunk(causal, L, base):
    q, k, v = qkv(L)
    ref = softmax_attention(q, k, v, causal)
    identity = make(causal, chunk_rep="identity", use_rpe=False, **base)
    assert maxdiff(out(identity, q, k, v), ref) < 1e-5
    assert maxdiff(out(make(causal, chunk_logit="exact_lse", use_rpe=False, **base), q, k, v), ref) < 1e-5
    # learned Linear+LN representative with eq. 16 is not exact (LN fixes the norm of k̂)
    assert maxdiff(out(make(causal, use_rpe=False, **base), q, k, v), ref) > 1e-2
    # any ω gives β_c = v_c when P = 1: training mode with a key is still exact
    assert maxdiff(run(identity, q, k, v, deterministic=False, key=jax.random.PRNGKey(5))[0], ref) < 1e-5


# §6.3
@pytest.mark.parametrize("overlap", [False, True])
def test_exact_control_variate_estimator(overlap):
    """exact_lse + disjoint, random ω: Σ_E π_m v_m + Σ_c (Σ_{P_c} π_m) β_c(ω) (eq. 13)."""
    L, W, P = 45, 16, 4
    q, k, v = qkv(L, seed=1)
    core = make(window_size=W, chunk_size=P, partition="disjoint", chunk_logit="exact_lse", use_rpe=False,
                overlap_window=overlap)
    key = jax.random.PRNGKey(7)
    got = run(core, q, k, v, deterministic=False, key=key)[0]
    # independent brute force with β from the same Phase A and the same noise rule
    L_pad, C = 48, 12

    @jax.jit
    def brute_force(q, k, v, params):
        ch = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, L_pad - L), (0, 0))).reshape(B, H, C, P, D)  # noqa: E731
        noise = eva.chunk_noise(jax.random.split(key)[0], jnp.arange(C), B, H, D)
        valid = (jnp.arange(L_pad) < L).reshape(C, P)
        _, beta = eva.chunk_summaries(ch(q), ch(k), ch(v), valid, params, noise, core.opts, D**-0.5)
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest") * D**-0.5
        n, m = np.arange(L)[:, None], np.arange(L)[None, :]
        pi = jax.nn.softmax(jnp.where(m <= n, s, -jnp.inf), axis=-1)
        lo = np.maximum((n // W) * W - (W if overlap else 0), 0)
        in_e = (m >= lo) & (m <= n)
        local = jnp.einsum("bhqk,bhkd->bhqd", jnp.where(in_e, pi, 0.0), v, precision="highest")
        onehot = jnp.asarray((m // P)[0][:, None] == np.arange(C)[None, :], jnp.float32)  # [L, C]
        mass = jnp.einsum("bhqk,kc->bhqc", jnp.where(in_e, 0.0, pi), onehot, precision="highest")
        return local + jnp.einsum("bhqc,bhcd->bhqd", mass, beta, precision="highest")

    assert maxdiff(got, brute_force(q, k, v, core.chunk_params())) < 1e-5
    # the chunk part is really used (not an exact-attention fallback): differs from softmax
    assert maxdiff(got, softmax_attention(q, k, v, True)) > 1e-3


# §6.4
def test_beta_equal_norm_keys_and_omega_equal_query():
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(2), 3)
    P = 8
    k = jax.random.normal(kk, (B, H, 3, P, D))
    k = 2.0 * k / jnp.linalg.norm(k, axis=-1, keepdims=True)  # equal norms
    v = jax.random.normal(kv, (B, H, 3, P, D))
    qn = jax.random.normal(kq, (B, H, 3, D))
    s = D**-0.5
    beta_fn = jax.jit(eva.chunk_beta, static_argnums=(4, 5))

    def beta_and_softmax_average(k):
        w = jax.nn.softmax(s * jnp.einsum("bhcd,bhcpd->bhcp", qn, k), axis=-1)
        return beta_fn(qn, k, v, jnp.ones((3, P), bool), s, "released"), jnp.einsum("bhcp,bhcpd->bhcd", w, v)

    assert maxdiff(*beta_and_softmax_average(k)) < 1e-5
    # unequal norms: the -½‖k‖² term no longer cancels
    assert maxdiff(*beta_and_softmax_average(k * jnp.linspace(0.5, 2.0, P)[:, None])) > 1e-3


# §6.5
def test_rfa_limit_no_local_one_chunk():
    q, k, v = qkv(32, seed=3)
    key = jax.random.PRNGKey(11)
    core = make(False, window_size=0, num_chunks=1, use_rpe=False, chunk_rep="identity")
    got = run(core, q, k, v, deterministic=False, key=key)[0]
    assert maxdiff(got, jnp.broadcast_to(got[:, :, :1], got.shape)) < 1e-5  # query-independent
    # independent single-sample positive-random-feature RFA with the same ω and released scaling
    eps = jax.random.normal(jax.random.fold_in(jax.random.split(key)[0], 0), (B, H, D))
    omega = 0.5 * (q.mean(2) + k.mean(2)) + eps  # bidirectional µ = ½(q̂ + k̂), identity representative
    s = D**-0.5
    log_xi = lambda x: s * (jnp.einsum("bhld,bhd->bhl", x, omega) - 0.5 * jnp.sum(x * x, -1))  # noqa: E731
    w = jnp.exp(log_xi(q)[..., :, None] + log_xi(k)[..., None, :])  # ξ(q,ω) ξ(k_m,ω)
    rfa = jnp.einsum("bhnm,bhmd->bhnd", w, v) / jnp.sum(w, -1, keepdims=True)
    assert maxdiff(got, rfa) < 1e-5
    # learned representative: still one query-independent β
    learned = out(make(False, window_size=0, num_chunks=1, use_rpe=False), q, k, v)
    assert maxdiff(learned, jnp.broadcast_to(learned[:, :, :1], learned.shape)) < 1e-5


def test_positive_random_feature_is_unbiased():
    kx, ky, kw = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (D,))
    y = jax.random.normal(ky, (D,))
    x, y = 0.6 * x / jnp.linalg.norm(x), 0.5 * y / jnp.linalg.norm(y)
    omega = jax.random.normal(kw, (400_000, D))
    feat = jax.jit(lambda x, w: eva.rf_log_feature(x[None, :], w, 1.0, "released"))
    est = jnp.mean(jnp.exp(feat(x, omega) + feat(y, omega)))
    assert abs(float(est) / float(jnp.exp(x @ y)) - 1.0) < 0.01


# §6.6
def test_prefix_forward_equals_prefix_of_full():
    """Released self-test: forward on a prefix == prefix of the full forward
    (eval mode for all lengths; train mode with a fixed key for two of them)."""
    P, W = 4, 16
    core = make(overlap_window=True, window_size=W, chunk_size=P)
    q, k, v = qkv(45, seed=5)
    full, full_train = out(core, q, k, v), run(core, q, k, v, **TRAIN)[0]
    for n in (1, P - 1, P, P + 1, W - 1, W, W + 1, 37):  # spec §6.6(b): around a chunk and a window border
        assert maxdiff(out(core, q[:, :, :n], k[:, :, :n], v[:, :, :n]), full[:, :, :n]) < 1e-5, n
    for n in (P + 1, 37):
        pre = run(core, q[:, :, :n], k[:, :, :n], v[:, :, :n], **TRAIN)[0]
        assert maxdiff(pre, full_train[:, :, :n]) < 1e-5, n


# §6.7
@pytest.mark.parametrize("overlap,train", [pytest.param(False, False, marks=pytest.mark.slow), (True, True)])
def test_token_by_token_decoding_equals_full(overlap, train):
    """Prefill t0 tokens, then decode one token at a time to T (T not a multiple of W or P)."""
    T, W, P = 27, 8, 4
    core = make(window_size=W, chunk_size=P, overlap_window=overlap)
    kw = TRAIN if train else {}
    q, k, v = qkv(T, seed=7)
    full = run(core, q, k, v, **kw)[0]
    for t0 in (0, W + 3) if train else (0, 1, P, W, W + 3):
        state, outs, a = core.init_state(B, T), [], 0
        for n in ([t0] if t0 else []) + [1] * (T - t0):
            o, state = run(core, q[:, :, a:a + n], k[:, :, a:a + n], v[:, :, a:a + n], state, **kw)
            outs.append(o)
            a += n
        assert maxdiff(jnp.concatenate(outs, 2), full) < 1e-5, t0


def test_a_training_call_needs_the_key():
    q, k, v = qkv(30, seed=9)
    with pytest.raises(ValueError, match="key"):
        make(window_size=16, chunk_size=4, attn_dropout=0.3)(q, k, v, deterministic=False)


def test_state_returned_by_full_pass_continues_and_capacity_error():
    core = make(window_size=16, chunk_size=4)
    q, k, v = qkv(32, seed=8)
    full = out(core, q, k, v)
    o1, state = run(core, q[:, :, :20], k[:, :, :20], v[:, :, :20])  # L_pad = 32 -> room for 32 tokens
    o2, state = run(core, q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], state)
    assert maxdiff(jnp.concatenate([o1, o2], 2), full) < 1e-5
    with pytest.raises(ValueError, match="max_len"):  # eager: capacity checked before any work
        core(q[:, :, :4], k[:, :, :4], v[:, :, :4], state)


# §6.8
@pytest.mark.parametrize("causal,cfg,L,scale,dtype,train", [
    (True, dict(window_size=16, chunk_size=4), 45, 1.0, jnp.float32, True),  # padded length
    (True, dict(window_size=16, chunk_size=4, overlap_window=True), 13, 30.0, jnp.bfloat16, False),  # 1st block
    (False, dict(window_size=16, num_chunks=8, overlap_window=True), 17, 30.0, jnp.bfloat16, True),  # pad chunks
    (False, dict(window_size=16, num_chunks=4), 37, 1.0, jnp.float32, False)])
@pytest.mark.slow
def test_gradients_finite(causal, cfg, L, scale, dtype, train):
    core = make(causal, **cfg)
    q, k, v = (x.astype(dtype) for x in qkv(L, seed=10, scale=scale))
    key = jax.random.PRNGKey(0) if train else None

    @nnx.jit
    @functools.partial(nnx.grad, argnums=(0, 1, 2, 3))
    def grads(core, q, k, v):
        o = core(q, k, v, deterministic=not train, key=key)[0]
        return jnp.sum(o.astype(jnp.float32) * jnp.cos(jnp.arange(o.size).reshape(o.shape)))

    gp, gq, gk, gv = grads(core, q, k, v)
    for g in jax.tree.leaves(gp) + [gq, gk, gv]:
        assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32))))
    if scale == 1.0:  # chunks visible, softmax not saturated: A_q and LN_q act via ω -> β
        assert float(jnp.abs(gp.q_w[...]).max()) > 0
        assert float(jnp.abs(gp.q_ln_scale[...]).max()) > 0


def test_ragged_bidirectional_padding_masked():
    """L=17, no local block, C=16 -> L_pad=32, P=2: chunk 8 is half padding (divisor P, §9.11),
    chunks 9..15 are all padding and must be masked [ours]; independent eq.-16 computation."""
    L, C, P = 17, 16, 2
    q, k, v = qkv(L, seed=11)
    got = out(make(False, window_size=0, num_chunks=C, use_rpe=False, chunk_rep="identity"), q, k, v)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 1), (0, 0))).reshape(B, H, 9, P, D)  # noqa: E731
    qc, kc, vc = pad(q), pad(k), pad(v)
    valid = (jnp.arange(18) < L).reshape(9, P)
    s = D**-0.5
    omega = 0.5 * (qc.sum(3) + kc.sum(3)) / P
    ell = s * (jnp.einsum("bhcpd,bhcd->bhcp", kc, omega) - 0.5 * jnp.sum(kc * kc, -1))
    beta = jnp.einsum("bhcp,bhcpd->bhcd", jax.nn.softmax(jnp.where(valid, ell, -jnp.inf), -1), vc)
    logits = s * jnp.einsum("bhnd,bhcd->bhnc", q, kc.sum(3) / P)
    assert maxdiff(got, jnp.einsum("bhnc,bhcd->bhnd", jax.nn.softmax(logits, -1), beta)) < 1e-5


def test_rpe_buckets_and_bias_used():
    bucket = jax.jit(eva.t5_bucket, static_argnums=(1, 2, 3))
    b = bucket(jnp.arange(0, -200, -1), 64, 128, True)
    assert list(np.asarray(b[:32])) == list(range(32))
    assert int(b.max()) == 63 and bool(jnp.all(jnp.diff(b) >= 0))
    bb = bucket(jnp.array([-3, 0, 3, 100]), 64, 128, False)
    assert list(np.asarray(bb[:3])) == [3, 0, 35] and int(bb[3]) <= 63
    # numpy deltas (the tiles' static offsets) give the same buckets, computed while tracing
    dd = np.arange(-20000, 20001)
    for nb, md, causal in [(64, 128, True), (64, 128, False), (33, 1000, True), (16, 37, False)]:
        want = np.asarray(bucket(jnp.asarray(dd), nb, md, causal))
        got = eva.t5_bucket(dd, nb, md, causal)
        assert isinstance(got, np.ndarray) and np.array_equal(got, want)
    q, k, v = qkv(40)
    cfg = dict(window_size=16, chunk_size=4)
    assert maxdiff(out(make(**cfg), q, k, v), out(make(use_rpe=False, **cfg), q, k, v)) > 1e-3


def test_config_validation():
    cls = attention.get_class("eva")
    cls.validate_config(cls.default_config(), causal=True)
    for causal, bad, msg in [
        (True, dict(num_chunks=8), "num_chunks"),
        (True, dict(window_size=12, chunk_size=8), "multiple"),
        (False, dict(window_size=16, num_chunks=3), "divide"),
        (True, dict(partition="half"), "partition"),
        (True, dict(adaptive_proj="none"), "bidirectional"),
        (True, dict(impl="cuda"), "impl"),
    ]:
        cfg = cls.default_config()
        cfg.update(bad)
        with pytest.raises(ConfigError, match=msg):
            attention.validate("eva", cfg, causal=causal)


@pytest.mark.slow
def test_long_forward_65k():
    L = 65_536
    core = make(heads=1, window_size=128, chunk_size=32)
    q, k, v = qkv(L, batch=1, heads=1)
    full = out(core, q, k, v)
    assert full.shape == (1, 1, L, 16) and bool(jnp.all(jnp.isfinite(full)))
    # prefix consistency at the end of a short prefix (no leak at long range either)
    assert maxdiff(full[:, :, :300], out(core, q[:, :, :300], k[:, :, :300], v[:, :, :300])) < 1e-5


@pytest.mark.parametrize("n_tiles,tile,P,g", [(1, 8, 4, 8), (5, 8, 4, 8), (64, 128, 8, 8), (13, 6, 4, 8), (3, 4, 8, 8),
                                             (256, 128, 8, 32), (160, 8, 4, 20)])
def test_tile_groups_cover_every_visible_chunk(n_tiles, tile, P, g):
    """The causal skip passes each group of query tiles every chunk its queries can see (c < n // P) and,
    with several groups, strictly fewer than all chunks to the early ones; bidirectional passes all."""
    C = -(-n_tiles * tile // P)
    groups = eva.tile_groups(n_tiles, tile, P, C, causal=True, groups=g)
    assert len(groups) == min(g, n_tiles)
    assert groups[0][0] == 0 and groups[-1][1] == n_tiles
    assert all(a[1] == b[0] for a, b in zip(groups[:-1], groups[1:]))  # contiguous, no gaps
    for _lo, hi, nc in groups:
        last_query = hi * tile - 1
        assert 1 <= nc <= C and nc >= min(C, last_query // P)
    if len(groups) > 2:
        assert groups[0][2] < C
    assert eva.tile_groups(n_tiles, tile, P, C, causal=False) == [(0, n_tiles, C)]


_BIASES = [(0, 0), (1, 3), (H, 3), (H, 1)]  # no bias, one shared bias (causal T5), one per head; per tile or shared
_KEEPS = [(False, False), (True, False), (True, True)]


# each bias layout and each keep / halves setting once by default; the whole grid with -m slow
@pytest.mark.parametrize("hb,nb,keep,halves", [
    (*b, *kh) if i % len(_KEEPS) == j else pytest.param(*b, *kh, marks=pytest.mark.slow)
    for i, b in enumerate(_BIASES) for j, kh in enumerate(_KEEPS)])
def test_tile_softmax_backward_matches_autodiff(hb, nb, keep, halves):
    """xla_cpu: the written-out backward of tile_softmax (keys-major, from the saved log-sum-exp; or, ``keep``, from the
    forward's kept weights, with ``halves`` in two row blocks) against autodiff of the same forward over whole
    tiles, with masked entries and an empty row in both parts."""
    N, Tq, Tk, C, dv = 3, 8, 8 if halves else 12, 5, 6
    ks = jax.random.split(jax.random.PRNGKey(3), 8)
    q = jax.random.normal(ks[0], (B, H, N, Tq, D))
    k = jax.random.normal(ks[1], (B, H, N, Tk, D))
    v = jax.random.normal(ks[2], (B, H, N, Tk, dv))
    k_hat = jax.random.normal(ks[3], (B, H, C, D))
    beta = jax.random.normal(ks[4], (B, H, C, dv))
    bias = None if hb == 0 else jax.random.normal(ks[5], (nb, hb, Tq, Tk))
    lmask = jax.random.bernoulli(ks[6], 0.6, (N, Tq, Tk)).at[0, 0].set(False)
    if halves:  # the first half of the rows sees none of the second half of the keys
        lmask = lmask.at[:, :Tq // 2, Tq // 2:].set(False)
    cmask = jax.random.bernoulli(ks[7], 0.5, (N, Tq, C)).at[0, 0].set(False)  # row (0, 0): nothing visible
    w = jax.random.normal(jax.random.PRNGKey(9), (B, H, N, Tq, dv))
    args = (q, k, v, k_hat, beta, bias)

    cmask_t = jnp.moveaxis(cmask, -1, 0).reshape(C, N * Tq)
    ours = lambda *a: xla_cpu.tile_softmax(*a, lmask, cmask, cmask_t, 0.3, keep, halves)  # noqa: E731
    ref = lambda *a: xla_cpu._joint_softmax(*a, lmask, cmask, 0.3)[0]  # noqa: E731

    n = 6 if hb else 5

    def out_and_grads(f, jit):
        def loss(*a):
            o = f(*a)
            return jnp.sum(o * w), o
        vg = jax.value_and_grad(loss, argnums=tuple(range(n)), has_aux=True)
        (_, o), grads = (jax.jit(vg) if jit else vg)(*args)
        return o, grads

    # ours jitted (an eager call dispatches op by op); the autodiff oracle eager: jitted at XLA:CPU's optimization
    # level 0 (tests/conftest.py) its bias gradient has NaN entries
    (got_out, got), (want_out, want) = out_and_grads(ours, True), out_and_grads(ref, False)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(got_out[0, 0, 0, 0]).max()) == 0.0
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("keep", [False, True])
def test_tile_softmax_cotangents_in_primal_dtypes(keep):
    """xla_cpu, a bf16 model: eva_forward computes in fp32, while the relative-position bias comes from the bf16 table. The
    written-out backward returns each cotangent in its primal's dtype (the bias's in bf16), so autodiff of what
    made the operands accepts it (it refused an fp32 bias cotangent)."""
    N, T, C = 2, 8, 3
    ks = jax.random.split(jax.random.PRNGKey(4), 6)
    q, k, v = (jax.random.normal(kk, (B, H, N, T, D)) for kk in ks[:3])
    k_hat, beta = (jax.random.normal(kk, (B, H, C, D)) for kk in ks[3:5])
    table = jax.random.normal(ks[5], (16,)).astype(jnp.bfloat16)
    idx = jnp.abs(jnp.arange(T)[None, :] - jnp.arange(T)[:, None])
    lmask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (N, T, T))
    cmask = jnp.ones((N, T, C), bool)
    cmask_t = jnp.ones((C, N * T), bool)

    def loss(q, k, v, k_hat, beta, table):
        bias = (0.5 * table[idx])[None, None]
        o = xla_cpu.tile_softmax(q, k, v, k_hat, beta, bias, lmask, cmask, cmask_t, 0.3, keep, False)
        return jnp.sum(o.astype(jnp.float32))

    # jitted: an eager grad dispatches op by op
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(q, k, v, k_hat, beta, table)
    assert [g.dtype for g in grads] == [jnp.float32] * 5 + [jnp.bfloat16]
    assert all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in grads)


def _value_and_grads(core, q, k, v, w, **kw):
    """(sum(out * w), grads w.r.t. every parameter, q, k, v) of the core, jitted."""
    gd, st = nnx.split(core)

    def loss(st, q, k, v):
        return jnp.sum(nnx.merge(gd, st)(q, k, v, **kw)[0] * w)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(st, q, k, v)


def _assert_same(got, want, value_atol=1e-5):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=value_atol)
    for g, r in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):  # fp32 noise grows with a leaf's scale
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5 + 1e-6 * float(np.max(np.abs(r))))


@pytest.mark.parametrize("causal,overlap", [(True, False), pytest.param(False, True, marks=pytest.mark.slow)])
def test_kept_weights_same_gradients_as_recomputed(causal, overlap):
    """xla_cpu: a full pass within keep_budget keeps its attention weights for the backward; with a negative
    keep_budget it recomputes them: the same outputs and gradients (inputs and every parameter, RPE table included), and the
    budget really switches the path (the kept backward redoes none of the softmax's exp passes)."""
    q, k, v = qkv(32, seed=8)  # 4 tiles of 8, each its own tile group
    w = jax.random.normal(jax.random.PRNGKey(9), q.shape)

    def build(budget):
        return make(causal, window_size=8, chunk_size=4, overlap_window=overlap, use_rpe=True, keep_budget=budget,
                    impl="xla_cpu")

    def exps(core):  # exp equations in the traced forward and backward
        gd, st = nnx.split(core)
        f = jax.grad(lambda st: jnp.sum(nnx.merge(gd, st)(q, k, v)[0] * w))
        return str(jax.make_jaxpr(f)(st)).count(" exp ")

    _assert_same(_value_and_grads(build(1 << 28), q, k, v, w), _value_and_grads(build(-1), q, k, v, w))
    assert exps(build(1 << 28)) < exps(build(-1))
    assert exps(build(0)) == exps(build(1 << 28))  # 0: xla_cpu's CPU default (2^28), which keeps them here


@pytest.mark.slow  # the split itself: test_tile_groups_cover_every_visible_chunk, without a long pass
def test_many_tile_groups_same_as_autodiff():
    """A pass long enough for more than 8 causal tile groups (128 tiles of 8: 16 groups) gives through xla_cpu,
    kept and recomputed, the outputs and gradients of the autodiff tiles (xla)."""
    q, k, v = qkv(1024, seed=10, batch=1)
    w = jax.random.normal(jax.random.PRNGKey(11), q.shape)
    n_tiles = 1024 // 8
    assert len(eva.tile_groups(n_tiles, 8, 4, 256, True, min(32, max(8, n_tiles // 8)))) == 16

    def grads(impl, budget=-1):
        core = make(window_size=8, chunk_size=4, use_rpe=True, keep_budget=budget, impl=impl)
        return _value_and_grads(core, q, k, v, w)

    plain = grads("xla")
    for got in (grads("xla_cpu", 1 << 28), grads("xla_cpu", -1)):
        _assert_same(got, plain)


@pytest.mark.parametrize("causal,dropout", [pytest.param(True, 0.0, marks=pytest.mark.slow), (True, 0.2),
                                            pytest.param(False, 0.2, marks=pytest.mark.slow)])
def test_training_mode_same_across_implementations(causal, dropout, monkeypatch):
    """deterministic=False with one key: the ω sample of every chunk and the attention-dropout draws are the
    same in every implementation (common.py's draws; the Phase B kernel draws the same hash mask inside its forward
    and backward kernels), so outputs and gradients equal the reference's (the shared law,
    tests/attention/test_implementations.py, runs deterministic)."""
    chunking = dict(chunk_size=4) if causal else dict(num_chunks=4)
    q, k, v = qkv(21, seed=12)  # 6 chunks of 4 (the last with padding), 3 local blocks
    w = jax.random.normal(jax.random.PRNGKey(13), q.shape)
    train = dict(deterministic=False, key=jax.random.PRNGKey(14))
    rates = []
    real = eva_attend.eva_attend
    monkeypatch.setattr(eva_attend, "eva_attend", lambda *a, **kw: rates.append(kw["dropout_rate"]) or real(*a, **kw))

    def grads(impl):
        core = make(causal, window_size=8, overlap_window=not causal, attn_dropout=dropout, impl=impl, **chunking)
        return _value_and_grads(core, q, k, v, w, **train)

    want = grads("reference")
    for impl in ("xla", "xla_cpu", "pallas"):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*interpret mode.*")
            _assert_same(grads(impl), want)
    assert rates == [dropout]  # the training step ran Phase B in the kernel, with its dropout
    if dropout:  # the draws matter: another key, another result
        core = make(causal, window_size=8, attn_dropout=dropout, impl="reference", **chunking)
        a, b = (run(core, q, k, v, deterministic=False, key=jax.random.PRNGKey(s))[0] for s in (14, 15))
        assert maxdiff(a, b) > 1e-3


def test_impl_names_and_earlier_values():
    """impl takes each implementation's name, an ordered list or 'auto'; the values accepted before the
    implementations were named keep their meaning: 'xla' = the XLA tiles (no kernel), 'pallas' = the kernels
    (interpret mode on a CPU), 'auto' = on a CPU today's tuned tiles (xla_cpu), 'xla,pallas' = the XLA tiles."""
    cls = attention.get_class("eva")
    assert [i.name for i in cls.implementations()] == ["reference", "xla", "xla_cpu", "mosaic_gpu", "pallas"]
    for impl in ("auto", "xla", "pallas", "xla,pallas", "pallas,xla", "reference", "xla_cpu"):
        cfg = cls.default_config()
        cfg.impl = impl
        attention.validate("eva", cfg, causal=True)
    want = {"xla": "xla", "xla,pallas": "xla", "pallas": "pallas", "reference": "reference", "xla_cpu": "xla_cpu"}
    if dispatch.current_platform() == "cpu":
        want["auto"] = "xla_cpu"
    for impl, name in want.items():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*interpret mode.*")
            core = make(window_size=8, chunk_size=4, impl=impl)
            runner, choice = core.runner(**core.call_shapes(48, streaming=False))
        assert choice.name == name and choice.use_kernel == (name == "pallas"), impl
        assert type(runner) is dispatch.by_name(core.implementations())[name].code, impl


@pytest.mark.parametrize("causal,disjoint", [(True, False), (True, True), (False, False), (False, True)])
def test_chunk_mask_keys_major_is_the_transpose(causal, disjoint):
    """The keys-major chunk mask tile_softmax's backward reads is built in that orientation; it must equal the
    transpose of the query-major one for every rule (causal visibility, disjoint windows, invalid chunks)."""
    q_pos, ids = jnp.arange(3, 40), jnp.arange(10)
    valid = ids < 8
    kw = dict(P=4, W=8, e_l=4, e_r=0 if causal else 4, causal=causal, disjoint=disjoint)
    qm = eva_attend_ref.chunk_mask(q_pos, ids, valid, **kw)
    km = eva_attend_ref.chunk_mask(q_pos, ids, valid, keys_major=True, **kw)
    assert km.shape == (10, 37) and bool(qm.any()) and not bool(qm.all())
    np.testing.assert_array_equal(km, qm.T)


@pytest.mark.parametrize("causal,overlap", [(True, False), pytest.param(True, True, marks=pytest.mark.slow),
                                            pytest.param(False, False, marks=pytest.mark.slow)])
def test_small_logit_budget_same_outputs_and_gradients(causal, overlap):
    """A logit budget small enough that every tile group runs as a lax.map over batches of tiles gives the outputs
    and gradients of the one-call path (tiles as reshapes without overlap, gathered with one)."""
    q, k, v = qkv(160, seed=6)
    w = jax.random.normal(jax.random.PRNGKey(7), q.shape)

    def grads(budget):
        core = make(causal, window_size=8, chunk_size=4, overlap_window=overlap, logit_budget=budget)
        return _value_and_grads(core, q, k, v, w)

    _assert_same(grads(B * H * 8 * 30), grads(1 << 25), value_atol=0)


def test_execution_knobs_take_the_platform_of_the_call(monkeypatch):
    """logit_budget and keep_budget default to dispatch.PLATFORM_DEFAULT and are resolved at call time for the
    platform the selection ran on (the implementation's declared value: a GPU never runs the XLA:CPU budget); a
    written value runs as written; a negative keep_budget (always recompute) stays negative."""
    from longctx.attention.eva import xla as eva_xla

    assert attention.default_config("eva").logit_budget == dispatch.PLATFORM_DEFAULT
    assert attention.default_config("eva").keep_budget == dispatch.PLATFORM_DEFAULT
    seen = []
    real = eva_xla.eva_forward
    monkeypatch.setattr(eva_xla, "eva_forward", lambda *a, **k: seen.append(a[7]) or real(*a, **k))
    q, k, v = qkv(16)

    def opts(platform, **cfg):
        core = make(window_size=8, chunk_size=4, platform=platform, **cfg)
        jax.eval_shape(lambda q, k, v: core(q, k, v)[0], q, k, v)  # traced only
        return seen[-1]

    for platform, want in (("cpu", 1 << 25), ("cuda", 1 << 28), ("tpu", 1 << 27)):
        assert opts(platform, impl="xla").logit_budget == want, platform
    assert opts("cuda", impl="xla", logit_budget=12345).logit_budget == 12345
    o = opts("cpu", impl="xla_cpu")  # xla_cpu runs xla.eva_forward with its ops
    assert (o.logit_budget, o.keep_budget) == (1 << 25, 1 << 28)
    assert opts("cpu", impl="xla_cpu", keep_budget=-1).keep_budget == -1


def test_kernel_tiles_are_execution_settings(monkeypatch):
    """pallas: Phase B's tiles and warps are execution settings that default to the kernel's plan on every platform
    (eva_attend.PLAN) and reach the kernel as written (a sweep sets them); other implementations take none."""
    seen = []
    real = eva_attend.eva_attend
    monkeypatch.setattr(eva_attend, "eva_attend", lambda *a, **k: seen.append(k) or real(*a, **k))
    q, k, v = qkv(16)
    keys = ("query_tile", "key_tile", "chunk_tile", "num_warps")

    def tiles(**cfg):
        core = make(window_size=8, chunk_size=4, impl="pallas", **cfg)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*interpret mode.*")
            jax.eval_shape(lambda q, k, v: core(q, k, v)[0], q, k, v)  # traced only
        return tuple(seen[-1][key] for key in keys)

    assert all(attention.default_config("eva")[key] == dispatch.PLATFORM_DEFAULT for key in keys)
    assert tiles() == (None, None, None, None)  # the plan's
    assert tiles(query_tile=4, key_tile=2, chunk_tile=32, num_warps=8) == (4, 2, 32, 8)
    with pytest.raises(ConfigError, match="chunk_tile"):
        make(window_size=8, chunk_size=4, impl="pallas", chunk_tile=24)
    with pytest.raises(ConfigError, match="query_tile"):
        make(window_size=8, chunk_size=4, impl="pallas", query_tile=3)


# packed rows (docs/methods/eva.md, "Packed rows"): the options the packed law's configuration leaves out
@pytest.mark.parametrize("causal,cfg", [
    (True, dict(overlap_window=True, chunk_logit="exact_lse", attn_dropout=0.3, partition="disjoint")),
    pytest.param(False, dict(overlap_window=True, attn_dropout=0.3), marks=pytest.mark.slow),
])
def test_packed_row_equals_its_documents_alone_in_training_mode(causal, cfg):
    """Documents of 5, 13 and 9 tokens (cut mid-block and mid-chunk) in one row: outputs with the ω draws, dropout,
    the overlapping window and (causal) the exact chunk log-sum-exp and the disjoint partition equal each document's
    own call with the same key; so do the tiles (``xla``, ``xla_cpu``: the documents laid out again on the block
    grid), which equal the reference's packed form."""
    core = make(causal, window_size=8, chunk_size=4, **cfg)
    lengths = (5, 13, 9)
    q, k, v = qkv(sum(lengths), seed=11, head_dim=D)
    seg = jnp.asarray(np.repeat(np.arange(1, 4), lengths)[None].repeat(B, 0), jnp.int32)
    packed = nnx.jit(lambda c, q, k, v, s: c(q, k, v, segment_ids=s, **TRAIN)[0])(core, q, k, v, seg)
    a = 0
    for n in lengths:
        alone = run(core, q[:, :, a:a + n], k[:, :, a:a + n], v[:, :, a:a + n], **TRAIN)[0]
        assert maxdiff(packed[:, :, a:a + n], alone) < 1e-5, (a, n)
        a += n
    assert maxdiff(packed, run(core, q, k, v, **TRAIN)[0]) > 1e-2  # the documents do see each other unpacked
    want = make(causal, window_size=8, chunk_size=4, impl="reference", **cfg)(q, k, v, segment_ids=seg, **TRAIN)[0]
    for name in ("xla", "xla_cpu"):
        named = make(causal, window_size=8, chunk_size=4, impl=name, **cfg)
        assert maxdiff(named(q, k, v, segment_ids=seg, **TRAIN)[0], want) < 1e-5, name


def _packed_rows(lengths, seed=11):
    """q, k, v and segment ids [B, T] of rows holding documents of ``lengths`` (row b rotated by b)."""
    rows = [lengths[b:] + lengths[:b] for b in range(B)]
    q, k, v = qkv(sum(lengths), seed=seed, head_dim=D)
    seg = jnp.asarray(np.stack([np.repeat(np.arange(1, len(r) + 1), r) for r in rows]), jnp.int32)
    return rows, q, k, v, seg


PACKED_TRAIN = dict(window_size=8, chunk_size=4, overlap_window=True, chunk_logit="exact_lse", attn_dropout=0.3,
                    partition="disjoint")


def _in_two_calls(core, q, k, v, seg, cut):
    """The packed row (training mode) as tokens [:cut] from the empty state, then the rest from the state they left."""
    T = seg.shape[1]

    @nnx.jit
    def both(c, q, k, v, seg):
        first, st = c(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], c.init_state(B, T), segment_ids=seg[:, :cut],
                      **TRAIN)
        second, _ = c(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], st, segment_ids=seg[:, cut:], **TRAIN)
        return jnp.concatenate([first, second], axis=2)

    return both(core, q, k, v, seg)


@pytest.mark.parametrize("causal", [True, False])
def test_packed_layout_fits_its_static_bound(causal):
    """The tiles' layout (longctx/attention/eva/packed.py) of rows of worst-case lengths for each rule (documents
    of P tokens after one of 1, filling a block but for one, longer than a block by one, shorter than P) stays
    inside its static size, puts every document of P tokens or more on the chunk grid and every one of a block or
    less inside one block, and the tiles equal the reference on such a row (outputs and the returned state)."""
    from longctx.attention.eva import packed

    W, P = 8, 4
    rows = [(1, 7) * 3 + (9, 1, 4), (1, 5) * 6 + (2,), (3,) * 12 + (2,), (1,) * 38]
    T = 38
    assert all(sum(r) == T for r in rows)
    seg = jnp.asarray(np.stack([np.repeat(np.arange(1, len(r) + 1), r) for r in rows]), jnp.int32)
    lay = np.asarray(packed.document_layout(seg, W, P, causal=causal))
    size = packed.layout_size(T, W, P, causal=causal)
    assert lay.max() < size
    for b, r in enumerate(rows):
        a = 0
        for n in r:
            first, last = lay[b, a], lay[b, a + n - 1]
            assert last - first == n - 1  # contiguous
            if n > W:
                assert first % W == 0
            else:
                assert first // W == last // W
            if n >= P or not causal:
                assert first % P == 0
            a += n
    assert np.all(np.diff(lay, axis=1) > 0)
    cfg = dict(window_size=W, chunk_size=P, overlap_window=True)
    q, k, v = qkv(T, seed=5, batch=len(rows))
    want, want_state = make(causal, impl="reference", **cfg)(q, k, v, segment_ids=seg)
    got, state = make(causal, impl="xla", **cfg)(q, k, v, segment_ids=seg)
    assert maxdiff(got, want) < 1e-5
    for name in (want_state or {}):
        assert maxdiff(state[name].astype(jnp.float32), want_state[name].astype(jnp.float32)) < 1e-5, name


@pytest.mark.parametrize("impl", ["reference", "xla", "xla_cpu"])
def test_packed_calls_carry_the_state_of_their_last_document(impl):
    """A packed row fed in two calls cut inside a chunk of a document equals the packed row in one call, in training
    mode with the overlapping window, the exact chunk log-sum-exp, dropout and the disjoint partition; the state a
    packed call returns is its last document's alone (its id, its length, its ring, its unfinished chunk and its
    finished chunks)."""
    core = make(**PACKED_TRAIN, impl=impl)
    rows, q, k, v, seg = _packed_rows((5, 13, 9))
    T = seg.shape[1]
    whole = nnx.jit(lambda c, q, k, v, s: c(q, k, v, segment_ids=s, **TRAIN)[0])(core, q, k, v, seg)
    assert maxdiff(_in_two_calls(core, q, k, v, seg, 7), whole) < 1e-5
    # deterministic: a batch of one draws other noise than row b of two
    _, state = nnx.jit(lambda c, q, k, v, s: c(q, k, v, segment_ids=s))(core, q, k, v, seg)
    np.testing.assert_array_equal(state["segment"], [3, 3])
    for b, r in enumerate(rows):  # the last document alone: the same state where a full pass's is defined
        n = r[-1]
        _, alone = run(core, q[b:b + 1, :, T - n:], k[b:b + 1, :, T - n:], v[b:b + 1, :, T - n:])
        assert int(state["doc_len"][b]) == n
        for name in ("win_k", "win_v", "cur_q", "cur_k", "cur_v"):
            assert maxdiff(state[name][b:b + 1], alone[name]) == 0.0, (b, name)
        for name in ("mem_khat", "mem_beta", "mem_kraw"):  # its finished chunks
            assert maxdiff(state[name][b:b + 1, :, :n // 4], alone[name][:, :, :n // 4]) < 1e-5, (b, name)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_packed_rows_decoded_token_by_token_and_cut_anywhere(impl):
    """Decoding with segment ids (one token a call, a new id starting a fresh document) and two calls cut at a chunk
    border or at a document border equal the packed row in one call (training mode, as above)."""
    core = make(**PACKED_TRAIN, impl=impl)
    _, q, k, v, seg = _packed_rows((5, 13, 9))
    whole = nnx.jit(lambda c, q, k, v, s: c(q, k, v, segment_ids=s, **TRAIN)[0])(core, q, k, v, seg)
    for cut in (12, 18):  # row 1: a chunk border of its first document; row 0: a document border
        assert maxdiff(_in_two_calls(core, q, k, v, seg, cut), whole) < 1e-5, cut
    decoded, st = _decoded(core, q, k, v, seg)
    assert maxdiff(decoded, whole) < 1e-5
    assert [int(x) for x in st["doc_len"]] == [9, 5]


def _decoded(core, q, k, v, seg):
    """The packed row (training mode) decoded one token a call with its segment ids: (outputs, the last state)."""
    step = nnx.jit(lambda c, q, k, v, s, st: c(q, k, v, st, segment_ids=s, **TRAIN))
    st, outs = core.init_state(B, seg.shape[1]), []
    for t in range(seg.shape[1]):
        o, st = step(core, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], seg[:, t:t + 1], st)
        outs.append(o)
    return jnp.concatenate(outs, axis=2), st


def test_packed_rows_refused_where_not_served():
    """A bidirectional num_chunks layer and a slice from a sequence origin (composed states: a document crossing a
    slice would restart its chunk grid there) refuse packed rows in one line."""
    q, k, v = qkv(12, seed=3, head_dim=D)
    seg = jnp.ones((B, 12), jnp.int32)
    core = make(window_size=8, chunk_size=4)
    with pytest.raises(ConfigError, match="^eva: packed rows cannot run sequence-parallel by composed states") as err:
        core(q, k, v, core.sequence_origin(B, 24, jnp.asarray(12, jnp.int32)), segment_ids=seg)
    assert "\n" not in str(err.value)
    core(q, k, v, core.sequence_origin(B, 24, jnp.asarray(12, jnp.int32)))  # without segment ids it composes
    with pytest.raises(ConfigError, match="^eva: packed rows need a fixed chunk_size"):
        make(False, window_size=8, num_chunks=4)(q, k, v, segment_ids=seg)


def test_auto_takes_the_kernels_for_packed_rows_where_they_serve(monkeypatch):
    """'auto' on a GPU before Hopper (compute capability 8.0, where the Triton kernels serve) chooses the kernels
    for a packed row as for an unpacked one, from the empty state and after a carried one (the kernels run the
    layout: packed.py), and the tiles where the kernels' limits refuse the call; the limits see the layout's chunks
    (and the state's)."""
    monkeypatch.setattr(dispatch, "cuda_compute_capability", lambda: "8.0")
    cls = attention.get_class("eva")
    core = make(window_size=16, chunk_size=4)
    for state in (None, core.init_state(B, 64)):
        shapes = core.call_shapes(40, streaming=state is not None, segments=True, state=state)
        assert shapes["C"] >= 2 * 40 // 4 + (0 if state is None else 16)  # the layout's chunks, the state's too
        assert dispatch.select("auto", cls.implementations(), method="eva", platform="cuda", **shapes).name == "pallas"
    small = make(window_size=8, chunk_size=4)  # a window the GPU blocks refuse (< 16): the tiles
    shapes = small.call_shapes(40, streaming=False, segments=True)
    assert dispatch.select("auto", cls.implementations(), method="eva", platform="cuda", **shapes).name == "xla"


PACKED_KERNELS = dict(window_size=8, chunk_size=4, overlap_window=True, attn_dropout=0.3, impl="pallas")


@pytest.mark.slow  # both kernels in interpret mode
@pytest.mark.parametrize("causal,cfg", [(True, dict(partition="disjoint")), (False, {})])
def test_packed_rows_in_the_kernels_equal_the_reference_in_training_mode(causal, cfg):
    """impl='pallas' on packed rows in training mode (ω draws, dropout, the overlapping window; causal: the disjoint
    partition) equals the reference's packed form, outputs and q, k, v gradients: the kernels run the tiles' layout
    with each document's own chunk ids (noise) and dropout counters."""
    rows, q, k, v, seg = _packed_rows((5, 13, 9))
    w = jnp.cos(jnp.arange(v.size, dtype=jnp.float32).reshape(v.shape))

    def grads(impl):
        core = make(causal, **{**PACKED_KERNELS, **cfg, "impl": impl})
        loss = lambda q, k, v: jnp.sum(core(q, k, v, segment_ids=seg, **TRAIN)[0] * w)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*interpret mode.*")
        (got, got_g), (want, want_g) = grads("pallas"), grads("reference")
    assert abs(float(got - want)) < 1e-4 * (1 + abs(float(want)))
    for a, b in zip(got_g, want_g):
        assert maxdiff(a, b) < 1e-5


@pytest.mark.slow  # both kernels in interpret mode
def test_packed_rows_in_the_kernels_decoded_and_cut_carry_the_state():
    """impl='pallas' on a packed row in training mode: two calls cut inside a chunk, and decoding one token a call
    with segment ids, equal the packed row in one call; the state the kernels' call returns is the tiles'."""
    cfg = {**PACKED_KERNELS, "partition": "disjoint"}
    core = make(**cfg)
    _, q, k, v, seg = _packed_rows((5, 13, 9))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*interpret mode.*")
        whole = nnx.jit(lambda c, q, k, v, s: c(q, k, v, segment_ids=s, **TRAIN)[0])(core, q, k, v, seg)
        assert maxdiff(_in_two_calls(core, q, k, v, seg, 7), whole) < 1e-5
        assert maxdiff(_decoded(core, q, k, v, seg)[0], whole) < 1e-5
        _, state = nnx.jit(lambda c, q, k, v, s: c(q, k, v, segment_ids=s))(core, q, k, v, seg)
    _, want = make(**{**cfg, "impl": "xla"})(q, k, v, segment_ids=seg)
    for name in want:
        assert maxdiff(state[name].astype(jnp.float32), want[name].astype(jnp.float32)) < 1e-5, name
