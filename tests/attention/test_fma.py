"""Fast Multipole Attention: docs/methods/fma.md §6 checks 1-9 (7, Pallas == blocked, lives in
tests/kernels/test_fma_blocks.py). The shared laws (streamed == full, decoding, no future leak, capacity, axes)
run in tests/attention/test_contract.py; every implementation equals the reference (outputs, state, gradients)
at the contract case in tests/attention/test_implementations.py. Here: the paper's properties, the reference
against the production path (``impl='auto'``) on the method's options, and the names ``impl`` takes.

The fidelity fixes' regression tests (max_len's default, release_zero_slots, the truncated window's reach) are
tests/fidelity/test_fma_fidelity.py's."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from longctx import attention
from longctx.attention import dispatch
from longctx.attention import fma as F
from longctx.attention.base import CapacityError
from longctx.attention.fma import xla, xla_cpu
from longctx.attention.fma.reference import fma_packed_reference
from longctx.errors import ConfigError
from tests.attention import kit


# build and qkv keep the signatures tests/fidelity/test_fma_fidelity.py calls them with
def build(name="fma", causal=True, heads=2, d=8, dv=None, **cfg):
    """m=4, p=2, max_len=64 unless given; impl 'auto': the production path (xla_cpu on a CPU)."""
    return kit.build(name, causal, heads=heads, head_dim=d, value_dim=dv, **({"m": 4, "p": 2, "max_len": 64} | cfg))


def qkv(n, heads=2, d=8, dv=None, seed=0):
    return kit.qkv(n, batch=1, heads=heads, head_dim=d, value_dim=dv, seed=seed)


dense_reference = jax.jit(F.fma_dense_reference, static_argnums=4)  # jitted: eager runs op by op


def randomize_params(core, seed=1, scale=0.3):
    """'Trained-style' parameters: every downsampling weight random (not the init's structure)."""
    gd, params, rest = nnx.split(core, nnx.Param, ...)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return nnx.merge(gd, jax.tree.unflatten(tree, leaves), rest)


# ----------------------------------------------------------------------------- 1. partition
@pytest.mark.parametrize("n,m,L", [(64, 4, 3), (128, 8, 3), (96, 4, 4), (37, 4, 3), (256, 16, 3)])
@pytest.mark.parametrize("causal", [True, False])
def test_partition_covers_every_pair_exactly_once(n, m, L, causal):
    cnt = F.cover_count(n, m, L, causal)
    want = np.tril(np.ones((n, n), int)) if causal else np.ones((n, n), int)
    if -(-n // m) <= 2 ** (L + 1):  # the levels reach the whole row
        np.testing.assert_array_equal(cnt, want)
    np.testing.assert_array_equal(F.level_matrix(n, m, L, causal), F.level_matrix_parity(n, m, L, causal))


def test_paper_eq4_without_parent_condition_double_covers():
    """Paper eq. (4) as printed ({D_l in {2,3}}, no D_{l+1} <= 1) counts pairs twice: e.g. for an even level-1
    query group a, group a-3 is also in a level-2 partner (a = 4, groups of m = 4 tokens)."""
    cnt = F.cover_count(64, 4, 3, causal=True, parent_condition=False)
    assert cnt[4 * 4, 1 * 4] == 2


# ----------------------------------------------------------------------------- 2. exact limit, L = 0
@pytest.mark.parametrize("name", ["fma", "fma_linear"])
@pytest.mark.parametrize("causal", [True, False])
def test_no_coarse_levels_is_exact_attention(name, causal):
    core = randomize_params(build(name, causal, m=8, max_len=16))  # max_len = 2m -> L = 0
    assert core.opts.L == 0
    for n in (16, 11):
        q, k, v = qkv(n, seed=n)
        np.testing.assert_allclose(kit.out(core, q, k, v), kit.softmax_attention(q, k, v, causal), atol=2e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- 3. exact limit, structured
def piecewise(x, width):
    """Constant on every interval of `width` tokens (the interval's first value)."""
    n = x.shape[2]
    return jnp.repeat(x[:, :, ::width], width, axis=2)[:, :, :n]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("op", [{"downsample": "avgpool"}, {"downsample_init": "subinterval_mean"}])
def test_structured_input_is_exact_only_with_multiplicity(causal, op):
    n, m, p = 64, 4, 2
    q, k, v = qkv(n, seed=3)
    k, v = (piecewise(x, n // (4 * p)) for x in (k, v))  # K, V constant on every interval of n/(4p) tokens
    exact = kit.softmax_attention(q, k, v, causal)
    out = kit.out(build("fma", causal, m=m, p=p, max_len=n, **op), q, k, v)
    np.testing.assert_allclose(out, exact, atol=2e-5, rtol=2e-5)
    off = kit.out(build("fma", causal, m=m, p=p, max_len=n, multiplicity_weighting=False, **op), q, k, v)
    assert kit.maxdiff(off, exact) > 0.1, "the multiplicity guard: beta_l = 0 must be visibly wrong"


def test_fma_linear_joint_is_exact_on_piecewise_constant_qkv():
    n, p = 64, 2
    q, k, v = (piecewise(x, n // (4 * p)) for x in qkv(n, seed=4))
    out = kit.out(build("fma_linear", False, p=p, max_len=n, downsample="avgpool"), q, k, v)
    np.testing.assert_allclose(out, kit.softmax_attention(q, k, v, False), atol=2e-5, rtol=2e-5)
    per_level = build("fma_linear", False, p=p, max_len=n, downsample="avgpool", fma_linear_normalization="per_level")
    assert kit.maxdiff(kit.out(per_level, q, k, v), out) > 0.1  # eq. (11): the weights sum to L+1


# ----------------------------------------------------------------------------- 4. blocked == dense reference
# (n, m, p, causal); n = 1024 bidirectional with -m slow (causal by default)
SWEEP = [(64, 8, 2, True), (64, 8, 2, False), (256, 16, 4, True), (256, 16, 4, False), (1024, 64, 4, True)] + [
    pytest.param(*c, marks=pytest.mark.slow)
    for c in ((128, 8, 4, True), (128, 8, 4, False), (128, 4, 1, True), (128, 4, 1, False), (1024, 64, 4, False))]


# one B*H = 1 shape and one of several heads by default; the others with -m slow
@pytest.mark.parametrize("B,H,n,m,p,d", [(1, 1, 256, 16, 4, 8), (1, 4, 128, 16, 4, 32)] + [
    pytest.param(*c, marks=pytest.mark.slow) for c in ((1, 1, 128, 8, 2, 64), (2, 1, 64, 4, 2, 16))])
def test_level_summaries_under_jit_equal_the_einsum_form(B, H, n, m, p, d):
    """The fused summaries, jitted, equal the per-level einsum (regression: with B*H = 1 XLA:CPU once
    miscompiled the fused form's [BH, N, 1, m_l, d] product, off by O(10) under jit only)."""
    core = randomize_params(build("fma", True, heads=H, d=d, m=m, p=p, max_len=n))
    x = jax.random.normal(jax.random.key(3), (B, H, n, d))
    Lu = F.levels_used(n, core.opts)
    ds = core.ds_params()["k"]
    got = jax.jit(lambda x, ds: xla_cpu.all_level_summaries(x, ds, Lu, core.opts))(x, ds)
    for l, g in enumerate(got, start=1):
        want = xla.level_summaries(x, ds[l - 1], core.opts.m_l(l), core.opts)
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), atol=2e-5, rtol=2e-5, err_msg=f"level {l}")


def test_level_summaries_gradients_equal_the_einsum_form():
    """The fused summaries' written-out backward gives the gradients (input and kernels) of the per-level einsum."""
    core = randomize_params(build("fma", True, heads=2, d=8, m=4, p=2, max_len=128))
    x = jax.random.normal(jax.random.key(4), (1, 2, 96, 8))  # not a multiple of the top level's groups: padded
    Lu = F.levels_used(96, core.opts)
    assert Lu >= 2
    ds = core.ds_params()["k"]
    ws = [jax.random.normal(jax.random.key(10 + l),
                            xla.level_summaries(x, ds[l - 1], core.opts.m_l(l), core.opts).shape)
          for l in range(1, Lu + 1)]

    def grads(summaries):
        loss = lambda x, ds: sum(jnp.sum(y * w) for y, w in zip(summaries(x, ds, Lu, core.opts), ws))
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, ds)

    got, want = grads(xla_cpu.all_level_summaries), grads(xla.all_level_summaries)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("n,m,p,causal", SWEEP)
def test_blocked_equals_dense_reference(n, m, p, causal):
    q, k, v = qkv(n, heads=1, d=8, seed=n + m)
    for mult in (True, False):
        core = randomize_params(build("fma", causal, heads=1, m=m, p=p, max_len=n, multiplicity_weighting=mult))
        ref = dense_reference(q, k, v, core.ds_params(), core.opts)
        # fp32: the level summaries reduce up to n/2 products in another order than the reference's
        # einsum (at n = 1024 two of 8,192 outputs differ by 1.9e-5)
        np.testing.assert_allclose(kit.out(core, q, k, v), ref, atol=3e-5, rtol=1e-5, err_msg=f"multiplicity={mult}")


@pytest.mark.parametrize("name,cfg", [
    ("fma_linear", {}), ("fma_linear", {"fma_linear_normalization": "per_level"}),
    ("fma", {"downsample": "dense_conv", "share_downsample_across_heads": False}),
    ("fma", {"logit_budget": 2000}),  # query blocks in several lax.map groups
])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [64, pytest.param(45, marks=pytest.mark.slow)])
def test_blocked_equals_dense_reference_variants(name, cfg, causal, n):
    q, k, v = qkv(n, dv=6, seed=7)
    core = randomize_params(build(name, causal, dv=6, **cfg))
    ref = dense_reference(q, k, v, core.ds_params(), core.opts)
    np.testing.assert_allclose(kit.out(core, q, k, v), ref, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- packed rows (the reference)
@pytest.mark.parametrize("name,cfg", [  # the default suite: each method's default settings; -m slow: the variants
    ("fma", {}), ("fma_linear", {}),
    pytest.param("fma", {"downsample": "dense_conv", "share_downsample_across_heads": False,
                         "multiplicity_weighting": False}, marks=pytest.mark.slow),
    pytest.param("fma", {"downsample": "avgpool"}, marks=pytest.mark.slow),
    pytest.param("fma_linear", {"fma_linear_normalization": "per_level"}, marks=pytest.mark.slow),
    pytest.param("fma", {"release_zero_slots": True}, marks=pytest.mark.slow),
])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_reference_equals_each_document_alone(name, cfg, causal):
    """The dense reference of a packed row (documents of 3, 27 and 26 tokens: one under a fine block, one cut by
    every level's group grid) gives each document's output and q, k, v gradients run alone."""
    if cfg.get("release_zero_slots") and not causal:
        pytest.skip("the release is causal only")
    lengths = (3, 27, 26)
    n = sum(lengths)
    q, k, v = qkv(n, dv=6, seed=11)
    w = jax.random.normal(jax.random.PRNGKey(5), v.shape[:3] + (6,))
    core = randomize_params(build(name, causal, dv=6, **cfg))
    ds, opts = core.ds_params(), core.opts
    seg = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)

    def grads(f):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v) * w[..., :q.shape[2], :]),
                                          argnums=(0, 1, 2)))

    out = fma_packed_reference(q, k, v, ds, opts, seg)
    _, packed = grads(lambda q, k, v: fma_packed_reference(q, k, v, ds, opts, seg))(q, k, v)
    at = 0
    for n_d in lengths:
        part = [x[:, :, at:at + n_d] for x in (q, k, v)]
        want = F.fma_dense_reference(*part, ds, opts)
        np.testing.assert_allclose(out[:, :, at:at + n_d], want, atol=1e-5, rtol=1e-5, err_msg=f"document {n_d}")
        wd = w[:, :, at:at + n_d]
        alone = jax.grad(lambda q, k, v, wd=wd: jnp.sum(F.fma_dense_reference(q, k, v, ds, opts) * wd),
                         argnums=(0, 1, 2))(*part)
        for nm, g, r in zip("qkv", packed, alone):
            np.testing.assert_allclose(g[:, :, at:at + n_d], r, atol=1e-5, rtol=1e-5, err_msg=f"d{nm} {n_d}")
        at += n_d
    one = fma_packed_reference(q, k, v, ds, opts, jnp.zeros_like(seg))  # one document: the unpacked row
    np.testing.assert_allclose(one, F.fma_dense_reference(q, k, v, ds, opts), atol=1e-5, rtol=1e-5)


PACKED_LENGTHS = (5, 1, 30, 4, 17, 7)  # m = 4: m + 1 (where it falls), 1, long, a block, m 2^2 + 1, m + 3 (aligned)


def _packed_seg(lengths, batch=1):
    rows = [lengths[i:] + lengths[:i] for i in range(batch)]
    return jnp.asarray(np.stack([np.repeat(np.arange(1, len(r) + 1), r) for r in rows]), jnp.int32)


@pytest.mark.parametrize("causal", [True, False])
def test_packed_layout_aligns_every_document_and_fits_its_bound(causal):
    """The layout of packed rows (packed.py): every document in order, contiguous; one of more than m + 1 tokens
    starts at a multiple of m 2^L_d, a shorter one spans at most two fine blocks; bidirectional, the next document
    starts past the top group of the one before; the layout is shorter than its static bound."""
    from longctx.attention.fma import packed

    opts = build("fma", causal).opts
    n = 64
    rng = np.random.default_rng(0)
    layout = jax.jit(lambda seg: packed.layout(seg, opts))
    for _ in range(20):
        lengths = [int(x) for x in rng.choice([1, 2, 4, 5, 6, 9, 13, 17, 33], size=8)]
        lengths = [x for i, x in enumerate(lengths) if sum(lengths[:i + 1]) < n]
        lengths.append(n - sum(lengths))
        dest, docs = layout(_packed_seg(tuple(lengths)))
        dest, docs = np.asarray(dest[0]), np.asarray(docs[0])
        assert dest[-1] < packed.layout_size(n, opts) and np.all(np.diff(dest) > 0)
        assert np.array_equal(docs[dest], np.repeat(np.arange(1, len(lengths) + 1), lengths))
        assert np.count_nonzero(docs) == n
        at, end = 0, 0
        for ln in lengths:
            d0, d1 = dest[at], dest[at + ln - 1]
            assert d1 - d0 == ln - 1, lengths
            Ld = F.options.levels_used(ln, opts)
            if ln > opts.m + 1:
                assert d0 % (opts.m << Ld) == 0, (lengths, ln)
            else:
                assert d1 // opts.m - d0 // opts.m <= 1, (lengths, ln)
            assert d0 >= end, lengths
            end = d1 + 1
            if not causal and Ld > 0:
                end = -(-end // (opts.m << (Ld - 1))) * (opts.m << (Ld - 1))
            at += ln


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("name,cfg,causal,impl", [
    *[(nm, {}, c, "xla_cpu") for nm in ("fma", "fma_linear") for c in (True, False)],
    *[pytest.param(nm, {}, True, "xla", marks=_SLOW) for nm in ("fma", "fma_linear")],
    *[pytest.param(nm, cfg, c, "xla_cpu", marks=_SLOW) for nm, cfg in (
        ("fma", {"multiplicity_weighting": False, "downsample": "dense_conv", "share_downsample_across_heads": False}),
        ("fma", {"downsample": "avgpool"}),
        ("fma_linear", {"fma_linear_normalization": "per_level"})) for c in (True, False)],
])
def test_blocked_packed_rows_equal_the_packed_reference(name, cfg, causal, impl):
    """The blocked paths of a packed row (documents laid out again, §2.7) equal the packed reference, outputs and
    q, k, v gradients, on documents of every kind: shorter than a fine block, of m + 1 tokens falling across a block
    boundary, aligned ones cut by every level's groups (two rows, the documents in another order in each)."""
    seg = _packed_seg(PACKED_LENGTHS, batch=2)
    n = seg.shape[1]
    q, k, v = (jnp.concatenate([x, y], 0) for x, y in zip(qkv(n, dv=6, seed=3), qkv(n, dv=6, seed=4)))
    w = jax.random.normal(jax.random.PRNGKey(7), v.shape)
    core = randomize_params(build(name, causal, dv=6, impl=impl, **cfg))
    ds, opts = core.ds_params(), core.opts

    def run(f):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2)))(q, k, v)

    out = jax.jit(lambda q, k, v: core(q, k, v, segment_ids=seg)[0])(q, k, v)
    want = jax.jit(lambda q, k, v: fma_packed_reference(q, k, v, ds, opts, seg))(q, k, v)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    _, got = run(lambda q, k, v: core(q, k, v, segment_ids=seg)[0])
    _, ref = run(lambda q, k, v: fma_packed_reference(q, k, v, ds, opts, seg))
    for nm, g, r in zip("qkv", got, ref):
        np.testing.assert_allclose(g, r, atol=2e-5, rtol=2e-5, err_msg=f"d{nm}")


@pytest.mark.parametrize("name", ["fma", pytest.param("fma_linear", marks=pytest.mark.slow)])
def test_packed_decoding_and_streaming_equal_the_packed_pass(name):
    """Causal packed rows through the carried state: token by token (decoding with segment ids, a new id starting
    afresh), and in three calls cut inside documents, equal the packed full pass; the state's ``segment`` is the
    last document's id."""
    seg = _packed_seg(PACKED_LENGTHS, batch=2)
    n = seg.shape[1]
    q, k, v = (jnp.concatenate([x, y], 0) for x, y in zip(qkv(n, dv=6, seed=3), qkv(n, dv=6, seed=4)))
    core = randomize_params(build(name, True, dv=6))
    full, last = jax.jit(lambda q, k, v: core(q, k, v, segment_ids=seg))(q, k, v)

    @jax.jit
    def decode(q, k, v):
        def step(st, t):
            x = [jax.lax.dynamic_slice_in_dim(a, t, 1, axis=2) for a in (q, k, v)]
            out, st = core(*x, st, segment_ids=jax.lax.dynamic_slice_in_dim(seg, t, 1, axis=1))
            return st, out[:, :, 0]
        st, outs = jax.lax.scan(step, core.init_state(2, 64), jnp.arange(n))
        return jnp.moveaxis(outs, 0, 2), st

    out, st = decode(q, k, v)
    np.testing.assert_allclose(out, full, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(st["segment"], seg[:, -1])
    for key in ("win_k", "ring_k", "acc_v"):
        for a, b in zip(jax.tree.leaves(st[key]), jax.tree.leaves(last[key])):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5, err_msg=key)

    @jax.jit
    def three(q, k, v):
        st, outs = core.init_state(2, 64), []
        for a, b in ((0, 9), (9, 40), (40, n)):
            out, st = core(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], st, segment_ids=seg[:, a:b])
            outs.append(out)
        return jnp.concatenate(outs, axis=2)

    np.testing.assert_allclose(three(q, k, v), full, atol=2e-5, rtol=2e-5)


def test_packed_rows_refusals():
    """The release's reproduction refuses packed rows in one line naming segment ids (the kernels serve them:
    tests/attention/test_packed_law.py, tests/kernels/test_fma_blocks*.py)."""
    q, k, v = qkv(16)
    with pytest.raises(ConfigError, match="segment ids"):
        build("fma", True, release_zero_slots=True)(q, k, v, segment_ids=jnp.ones((1, 16), jnp.int32))


# ----------------------------------------------------------------------------- 5. the paper's causal leak
@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="the paper's causal FMA-linear summarises queries "
                   "over their whole group: future tokens change past outputs (§2.5); kept as a regression test")
def test_paper_leaky_fma_linear_leaks():
    """The no-leak law (tests/attention/test_contract.py's) by perturbation and by Jacobian at t0, expected to fail."""
    core = randomize_params(build("fma_linear", True, causal_query_summary="paper_leaky", allow_paper_leaky=True))
    n, t0 = 56, 40
    q, k, v = qkv(n, seed=5)
    qp, kp, vp = (a.at[:, :, t0 + 1:].set(3.0 * b[:, :, t0 + 1:]) for a, b in zip((q, k, v), qkv(n, seed=6)))
    same = bool(jnp.all(kit.out(core, qp, kp, vp)[:, :, :t0 + 1] == kit.out(core, q, k, v)[:, :, :t0 + 1]))
    jac = jax.jit(jax.jacrev(lambda a, b, c: core(a, b, c)[0][0, 0, t0], argnums=(0, 1, 2)))(q, k, v)
    assert same and all(float(jnp.max(jnp.abs(g[:, :, :, t0 + 1:]))) == 0.0 for g in jac)


def test_paper_leaky_is_rejected_in_causal_configs_and_cannot_decode():
    with pytest.raises(ConfigError, match="paper_leaky"):
        build("fma_linear", True, causal_query_summary="paper_leaky")
    build("fma_linear", False, causal_query_summary="paper_leaky")  # bidirectional: the literal rows, fine
    core = build("fma_linear", True, causal_query_summary="paper_leaky", allow_paper_leaky=True)
    with pytest.raises(ValueError, match="paper_leaky"):
        core.init_state(1, 64)


# ----------------------------------------------------------------------------- 6. gradients
@pytest.mark.parametrize("name", ["fma", "fma_linear"])
@pytest.mark.parametrize("causal", [True, False])
def test_every_downsampling_parameter_gets_a_finite_gradient(name, causal):
    """With large logits: early blocks have fully masked coarse segments, yet every level's conv weights get a
    finite, nonzero gradient. (That every gradient, parameters included, is finite in fp32 and bf16 with logits
    x30 is the shared law, tests/attention/test_contract.py, at both methods' contract case.)"""
    gd, params, rest = nnx.split(build(name, causal), nnx.Param, ...)
    q, k, v = qkv(48, seed=8)
    q = q * 30
    loss = lambda params, q, k, v: jnp.sum(nnx.merge(gd, params, rest)(q, k, v)[0] ** 2)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(params, q, k, v)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(grads[0]))


@pytest.mark.parametrize("name,causal", [("fma", True), pytest.param("fma", False, marks=pytest.mark.slow),
                                         pytest.param("fma_linear", True, marks=pytest.mark.slow),
                                         pytest.param("fma_linear", False, marks=pytest.mark.slow)])
def test_gradients_match_finite_differences_f64(name, causal):
    with jax.enable_x64(True):
        core = randomize_params(build(name, causal, heads=1, d=4, m=2, p=1, max_len=16))
        ds = jax.tree.map(lambda x: x.astype(jnp.float64), core.ds_params())
        q, k, v = (x.astype(jnp.float64) for x in qkv(13, heads=1, d=4, seed=9))
        # the production path on a CPU (its written-out backward of the summaries)
        f = jax.jit(lambda q, k, v, ds: xla_cpu.forward(q, k, v, ds, core.opts))
        assert f(q, k, v, ds).dtype == jnp.float64
        check_grads(f, (q, k, v, ds), order=1, modes=["rev"], eps=1e-6, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- 8. the state
def test_state_is_bounded_and_past_max_len_needs_truncation():
    core = build("fma", True)
    # O(m d + p d L): nothing grows with the context
    assert max(x.size for x in jax.tree.leaves(core.init_state(1, 64))) <= 2 * 4 * 2 * 8
    q, k, v = qkv(72, seed=11)
    with pytest.raises(ValueError, match="max_len"):
        core(q, k, v)
    with pytest.raises(ValueError, match="max_len"):
        core.init_state(1, 128)
    _, st = jax.jit(core)(q[:, :, :60], k[:, :, :60], v[:, :, :60])  # jitted: an eager call runs op by op
    with pytest.raises(CapacityError):
        core(q[:, :, 60:], k[:, :, 60:], v[:, :, 60:], st)


@pytest.mark.slow
def test_truncated_window_streams_past_max_len():
    core = randomize_params(build("fma", True, allow_truncated_window=True))
    n = 150
    q, k, v = qkv(n, seed=12)
    full = kit.out(core, q, k, v)
    np.testing.assert_allclose(full, dense_reference(q, k, v, core.ds_params(), core.opts), atol=1e-5, rtol=1e-5)
    state, outs = core.init_state(1, 10**6), []
    for a in range(0, n, 17):
        o, state = kit.run(core, q[:, :, a:a + 17], k[:, :, a:a + 17], v[:, :, a:a + 17], state)
        outs.append(o)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=2), full, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- 9. shapes and params
@pytest.mark.parametrize("name", ["fma", pytest.param("fma_linear", marks=pytest.mark.slow)])
def test_parameter_shapes(name):
    """The downsampling parameters' shapes and count (the output's shape: the shared law,
    tests/attention/test_contract.py, at the contract case's d = 8, dv = 6)."""
    d, dv, m, p, n = 8, 6, 4, 2, 64
    core = build(name, True, d=d, dv=dv, m=m, p=p, max_len=n)
    L = int(math.log2(n // m)) - 1
    assert core.opts.L == L == 3
    flat = {"/".join(map(str, k)): v[...].shape for k, v in nnx.to_flat_state(nnx.state(core, nnx.Param))}
    want = {}
    for nm, f in (("k", d), ("v", dv)) + ((("q", d),) if name == "fma_linear" else ()):
        for l in range(1, L + 1):
            want[f"ds_{nm}_{l}/kernel"] = (m << (l - 1), f, p)
            want[f"ds_{nm}_{l}/bias"] = (f, p)
    assert flat == want
    # §3 count for K and V: 2 p d (n/2 - m) + 2 L p d (d = dv)
    sq = build("fma", True, d=d, dv=d, m=m, p=p, max_len=n)
    count = sum(x.size for x in jax.tree.leaves(nnx.state(sq, nnx.Param)))
    assert count == 2 * p * d * (n // 2 - m) + 2 * L * p * d
    assert build(name, True, d=d, dv=dv, downsample="avgpool").ds_params()["k"] == [None] * L


def test_spec_parameter_count_example():
    """§3 of docs/methods/fma.md: n=1024, m=64, p=4, d=64 -> 230,912 downsampling parameters per layer."""
    core = build("fma", True, heads=12, d=64, m=64, p=4, max_len=1024)
    assert sum(x.size for x in jax.tree.leaves(nnx.state(core, nnx.Param))) == 230_912


def test_config_errors():
    for bad, match in (({"p": 3}, "divide"), ({"max_len": 96}, "power of two"), ({"num_levels": 2}, "truncat"),
                       ({"downsample": "fft"}, "downsample"), ({"impl": "pallas", "attn_dropout": 0.1}, "dropout"),
                       ({"blocks_per_program": 3}, "blocks_per_program")):
        with pytest.raises(ConfigError, match=match):
            build("fma", True, **bad)


@pytest.mark.slow
def test_131k_forward_compiles_under_4gb():
    """The blocked path's compiled 131,072-token forward (B=1, 4 heads of 64, defaults m=64 p=4) needs < 4 GB
    of temporaries + arguments (XLA's memory analysis of the compiled program; nothing is run)."""
    gd, params, rest = nnx.split(kit.build("fma", True, heads=4, head_dim=64, max_len=131072), nnx.Param, ...)
    shape = jax.ShapeDtypeStruct((1, 4, 131072, 64), jnp.float32)
    f = lambda params, q, k, v: nnx.merge(gd, params, rest)(q, k, v)[0]
    mem = jax.jit(f).lower(params, shape, shape, shape).compile().memory_analysis()
    total = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    assert total < 4 * 2**30, total


# ----------------------------------------------------------------------------- implementations by name
def _pick(cls, impl, platform, d=8, dropout=0.0):
    return dispatch.select(impl, cls.implementations(), method=cls.name, platform=platform,
                           m=64, d=d, dv=d, coarse_kind="stats" if cls.linear else "packed", dropout=dropout).name


def test_impl_names_old_and_new():
    """The values configs saved before the named implementations hold keep their meaning ('xla' the blocked XLA
    path, 'pallas' the kernel, 'auto' the platform's choice); 'auto' on a CPU is the CPU form."""
    fma, lin = attention.get_class("fma"), attention.get_class("fma_linear")
    assert [i.name for i in fma.implementations()] == ["reference", "xla", "xla_cpu", "mosaic_gpu", "pallas"]
    assert [i.name for i in lin.implementations()] == ["reference", "xla", "xla_cpu"]
    for cls in (fma, lin):
        assert _pick(cls, "xla", "cpu") == _pick(cls, "xla", "cuda") == "xla"
        assert _pick(cls, "auto", "cpu") == "xla_cpu"
        assert _pick(cls, "reference", "cpu") == "reference"
    # a cuda GPU with no device to ask counts as Hopper (the Mosaic GPU kernels; the Triton one steps aside there)
    assert _pick(fma, "auto", "cuda", d=64) == "mosaic_gpu" and _pick(fma, "auto", "tpu", d=64) == "pallas"
    assert _pick(fma, "auto", "cuda", d=8) == "xla"  # the kernel's head-dim limit on GPU
    assert _pick(fma, "auto", "cuda", d=64, dropout=0.1) == "xla"  # a training call with dropout
    assert _pick(lin, "auto", "cuda", d=64) == "xla"
    with pytest.raises(dispatch.KernelUnsupportedError, match="dropout"):
        _pick(fma, "reference", "cpu", dropout=0.1)
    with pytest.raises(ConfigError, match="pallas"):
        build("fma_linear", True, impl="pallas")
    # an old config (impl='xla') builds and evaluates as the production path does, to rounding
    q, k, v = qkv(45, seed=13)
    old = kit.out(randomize_params(build("fma", True, impl="xla")), q, k, v)
    np.testing.assert_allclose(old, kit.out(randomize_params(build("fma", True)), q, k, v), atol=2e-6, rtol=2e-6)


def test_execution_knobs_resolve_for_the_platform_of_the_call(monkeypatch):
    """logit_budget, the kernel's GPU tiles and its blocks per program default to 0 (dispatch.PLATFORM_DEFAULT) and resolve at each call for
    the platform the selection ran on: a GPU call never runs with the XLA:CPU budget; a written value runs as written
    on every platform."""
    from longctx.attention.fma import pallas

    cfg = attention.default_config("fma")
    assert cfg.logit_budget == cfg.kernel_warps_per_64_rows == cfg.kernel_stages == dispatch.PLATFORM_DEFAULT
    core = build("fma", True, impl="xla", platform="cpu")

    def runner(core):  # the runner a deterministic call of ``core`` runs (AttentionCore.__call__'s selection)
        return core.runner(**core._shapes(False))[0]

    assert runner(core).logit_budget == xla.LOGIT_BUDGET["cpu"]
    lin = runner(build("fma_linear", True, platform="cpu"))
    assert type(lin) is xla_cpu.XlaCpu and lin.logit_budget == 1 << 24
    gpu, written = (build("fma", True, impl="xla", platform="cuda", **kw) for kw in ({}, {"logit_budget": 5000}))
    assert runner(gpu).logit_budget == xla.LOGIT_BUDGET["cuda"] != xla.LOGIT_BUDGET["cpu"]
    assert runner(written).logit_budget == 5000
    # the kernel's tiles on cuda: the rule (4 warps per 64 query rows, 2 stages), or as written
    impl = {i.name: i for i in attention.get_class("fma").implementations()}["pallas"]
    bpp = pallas.TILES["blocks_per_program"]
    assert cfg.blocks_per_program == dispatch.PLATFORM_DEFAULT

    def tiles(platform, m):
        return impl.code.build(impl, cfg, platform).tiles(m)

    assert tiles("cuda", 64) == {"num_warps": 4, "num_stages": 2, "blocks_per_program": bpp["cuda"]}
    assert tiles("cuda", 128) == {"num_warps": 8, "num_stages": 2, "blocks_per_program": bpp["cuda"]}
    assert tiles("tpu", 64)["blocks_per_program"] == bpp["tpu"]
    assert tiles("interpret", 64)["blocks_per_program"] == bpp["cpu"]
    assert impl.code.build(impl, cfg, "cuda").logit_budget == xla.LOGIT_BUDGET["cuda"]
    cfg.update({"kernel_warps_per_64_rows": 2, "kernel_stages": 3, "blocks_per_program": 8})
    assert tiles("cuda", 128) == {"num_warps": 4, "num_stages": 3, "blocks_per_program": 8}
