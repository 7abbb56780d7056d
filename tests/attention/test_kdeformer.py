"""KDEformer (docs/methods/kdeformer.md §6, checks 1-11): the method's own properties. fp32, small sizes, seeded.

The laws every method meets (causality, streaming and decoding equal the full pass, finite gradients, ...) are
tests/attention/test_contract.py's; every implementation equals ``reference.py`` (outputs, gradients, final
state) by tests/attention/test_implementations.py. This file checks the estimator itself, the tiled form's own
pieces (the band's static pair count, the plans) and the settings that select an implementation.

The fidelity fixes' regression tests (the ref sampler past the int32 weight sum, causal ref unbiasedness, the band
route at 256 tokens, the gradients' documented bias) are tests/fidelity/test_kdeformer_fidelity.py's."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from longctx.attention import dispatch
from longctx.attention.base import CapacityError
from longctx.attention.dispatch import KernelUnsupportedError
from longctx.attention.kdeformer import common as kd
from longctx.attention.kdeformer import xla as kx
from longctx.errors import ConfigError
from tests.attention import kit
from tests.attention.kit import maxdiff, run
from tests.attention.kit import softmax_attention as dense

B, D = 2, 8  # kit's batch and head dim
SMALL = {"chunk_size": 8, "local_chunks": 2, "heavy_capacity": 4, "num_projs": 3, "num_samples": 8}
make = functools.partial(kit.build, "kdeformer")  # make(is_causal, **settings)


def qkv(L, seed=0, b=B, h=2, dv=None):  # the signature tests/fidelity/test_kdeformer_fidelity.py calls
    return kit.qkv(L, batch=b, heads=h, value_dim=dv, seed=seed)


def bopts(**kw):
    return kd.BidirOptions(**(dict(bucket_size=8, num_samples=8, num_projs=3, gray_order="inverse", sampling="ref",
                                   residual="sampled", power_iters=20, scale=D**-0.5) | kw))


def copts(**kw):
    return kd.CausalOptions(**(dict(chunk_size=8, local_chunks=2, heavy_capacity=4, num_projs=3, num_samples=8,
                                    sampling="uniform", residual="sampled", power_iters=20, scale=D**-0.5,
                                    tile_budget=1 << 22) | kw))


# jitted once per shape and options (the tests call these many times; eager dispatch ran op by op)
@functools.partial(jax.jit, static_argnums=5)
def causal_pieces(q, k, v, W, key_s, opts):
    """The full-pass tiles and plan (T a multiple of the chunk size)."""
    Bq, Hq, T, d = q.shape
    c = opts.chunk_size
    n_t = T // c
    hq, hk = kd.lsh_codes(q, W), kd.lsh_codes(k, W)
    q_t = jnp.moveaxis(q.reshape(Bq, Hq, n_t, c, d), 2, 0)
    hq_t = jnp.moveaxis(hq.reshape(Bq, Hq, n_t, c), 2, 0)
    ids = jnp.arange(n_t, dtype=jnp.int32)
    plan = kx.causal_plan(hq_t, ids, k, v, hk, T, key_s, opts)
    return q_t, ids, plan, hq, hk


bidir_plan = jax.jit(kx.bidir_plan, static_argnums=(5, 6))
bidir_apply = jax.jit(kx.bidir_apply, static_argnums=(4, 5))
causal_apply = jax.jit(kx.causal_apply, static_argnums=5)


def untile(x):
    n_t, Bq, Hq, c = x.shape[:4]
    return jnp.moveaxis(x, 0, 2).reshape((Bq, Hq, n_t * c) + x.shape[4:])


def untile_inv(x, c):
    """[B,H,N,...] -> [N/c,B,H,c,...] (the inverse of untile)."""
    return jnp.moveaxis(x.reshape(x.shape[:2] + (x.shape[2] // c, c) + x.shape[3:]), 2, 0)


# --------------------------------------------------------------------------- §6.1 Gray rank
@pytest.mark.parametrize("r", range(1, 11))
def test_gray_rank_is_a_bijection_with_one_bit_steps(r):
    z = jnp.arange(1 << r, dtype=jnp.int32)
    rank = np.asarray(kd.gray_rank(z, r, "inverse"))
    assert sorted(rank.tolist()) == list(range(1 << r))
    codes = np.argsort(rank)  # the code at each rank
    assert all(bin(int(x)).count("1") == 1 for x in codes[1:] ^ codes[:-1])
    # 'forward' reproduces the released table, the Gray sequence G(z) = z ^ (z >> 1) (r = 3: 0 1 3 2 6 7 5 4),
    # G(rank(z)) = z; it is another order than the paper's from r = 3 on (§2.3b: identical for r <= 2)
    forward = np.asarray(kd.gray_rank(z, r, "forward"))
    assert np.array_equal(forward, np.asarray(z ^ (z >> 1)))
    assert np.array_equal(np.asarray(kd.gray_rank(jnp.asarray(rank), r, "forward")), np.asarray(z))
    assert np.array_equal(forward, rank) == (r <= 2)


# --------------------------------------------------------------------------- §6.2 collision rate
@pytest.mark.parametrize("theta", [0.3, 1.0, 2.0])
def test_lsh_collision_rate_matches_angle_formula(theta):
    d, r, n = 16, 3, 20000
    rng = np.random.default_rng(0)
    x, o = rng.normal(size=(2, d))
    x /= np.linalg.norm(x)
    o -= o @ x * x
    o /= np.linalg.norm(o)
    y = 3.0 * (math.cos(theta) * x + math.sin(theta) * o)  # norm does not matter
    pts = jnp.asarray(np.stack([x, y]), jnp.float32)[None, None]  # [1,1,2,d]
    W = kd.draw_projections(jax.random.PRNGKey(1), n, 1, d, r)
    codes = np.asarray(kd.lsh_codes(jnp.broadcast_to(pts, (n, 1, 2, d)), W))[:, 0]
    rate = np.mean(codes[:, 0] == codes[:, 1])
    p = (1 - theta / math.pi) ** r
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(rate - p) < 4 * sd, (rate, p, sd)
    # a one-bit (r = 1) formula would be far outside the band
    assert abs(rate - (1 - theta / math.pi)) > 4 * sd


# --------------------------------------------------------------------------- §6.3 exact limits
@pytest.mark.parametrize("L", [64, pytest.param(45, marks=pytest.mark.slow)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_exact_limits(is_causal, L):
    """Dense attention: one block (causal: one chunk) holding every key, whatever m (every sample is masked);
    residual='exact' (every other key at weight 1); causal: one code whose capacity holds the whole prefix."""
    q, k, v = qkv(L)
    ref = dense(q, k, v, is_causal)
    if is_causal:
        exact = [{"causal": dict(SMALL, chunk_size=64)}, {"causal": dict(SMALL, num_projs=0, heavy_capacity=64)},
                 {"causal": dict(SMALL, residual="exact")}]
        approx = {"causal": SMALL}
    else:
        exact = [dict(bucket_size=-(-L // 8) * 8, num_samples=m) for m in (0, 8, 64)]
        exact.append(dict(bucket_size=8, residual="exact"))
        approx = dict(bucket_size=8, num_samples=8)
    for i, cfg in enumerate(exact):
        out, _ = run(make(is_causal, **cfg), q, k, v, deterministic=False, key=jax.random.PRNGKey(i))
        assert maxdiff(out, ref) < 1e-5, cfg
    assert maxdiff(kit.out(make(is_causal, **approx), q, k, v), ref) > 1e-2  # the approximation itself is not exact


def _value_and_grads(core, q, k, v, w, key):
    graphdef, st = nnx.split(core)

    def loss(q, k, v):
        o, _ = nnx.merge(graphdef, st)(q, k, v, deterministic=False, key=key)
        return jnp.sum(o * w), o

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)


@pytest.mark.parametrize("impl", ["band", pytest.param("pallas", marks=pytest.mark.slow)])  # pallas: interpret mode
def test_heavy_band_route_with_one_code_equals_the_reference(impl):
    """'band' scores exactly the heavy sets: with num_projs=0 (one code) every band is the b_h keys before the
    window and the tiles' spans overlap most; blocks of 8 give several tiles and pairs per tile; the XLA form
    (``band``) and the kernel (``pallas``). (num_projs=3: the shared law, tests/attention/test_implementations.py.)"""
    cc = dict(SMALL, num_projs=0)
    q, k, v = qkv(64, seed=47)
    key = jax.random.PRNGKey(48)
    w = jax.random.normal(jax.random.PRNGKey(49), v.shape)
    (_, out_r), grads_r = _value_and_grads(make(True, causal=cc, impl="reference"), q, k, v, w, key)
    (_, out_b), grads_b = _value_and_grads(make(True, causal=cc, impl=impl, heavy_band_block=8), q, k, v, w, key)
    assert maxdiff(out_r, out_b) < 1e-5
    for a, b_ in zip(grads_r, grads_b):
        assert maxdiff(a, b_) < 1e-5 * max(1.0, float(jnp.max(jnp.abs(a))))
    assert maxdiff(out_r, dense(q, k, v, True)) > 1e-2


@pytest.mark.slow  # interpret mode
def test_band_kernel_at_256_tokens_equals_the_xla_band():
    """``pallas`` at 256 tokens: 32 sorted-query tiles against 32 key blocks of 8 (heavy sets of 12 span block
    edges), 'ref' samples, a packed row of three documents too: equal to the XLA form of the same route in outputs
    and gradients."""
    cc = dict(SMALL, chunk_size=16, heavy_capacity=12, num_projs=2, num_samples=8, sampling="ref")
    q, k, v = qkv(256, seed=61, b=1)
    key = jax.random.PRNGKey(62)
    w = jax.random.normal(jax.random.PRNGKey(63), v.shape)
    seg = jnp.asarray(np.repeat([1, 2, 3], [100, 37, 119])[None], jnp.int32)
    for segment_ids in (None, seg):
        outs = []
        for impl in ("band", "pallas"):
            core = make(True, causal=cc, impl=impl, heavy_band_block=8, tile_budget=4096)
            graphdef, st = nnx.split(core)

            def loss(q, k, v, graphdef=graphdef, st=st, segment_ids=segment_ids):
                o, _ = nnx.merge(graphdef, st)(q, k, v, deterministic=False, key=key, segment_ids=segment_ids)
                return jnp.sum(o * w), o

            outs.append(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v))
        (_, out_x), grads_x = outs[0]
        (_, out_p), grads_p = outs[1]
        assert maxdiff(out_x, out_p) < 1e-5
        for a, b_ in zip(grads_x, grads_p):
            assert maxdiff(a, b_) < 1e-5 * max(1.0, float(jnp.max(jnp.abs(a))))


@pytest.mark.parametrize("codes", ["one", "two", "random", "skewed"])
def test_band_pairs_never_exceed_the_static_count(codes):
    """The (tile, block) pairs the bands need fit the static count of heavy_band for any code pattern."""
    N, c, bh, blk = 512, 16, 8, 16
    rng = np.random.default_rng(5)
    hk = {"one": np.zeros(N), "two": np.arange(N) % 2, "random": rng.integers(0, 64, N),
          "skewed": np.minimum(rng.geometric(0.3, N), 63)}[codes].astype(np.int32)
    hq = np.roll(hk, 3) if codes != "random" else rng.integers(0, 64, N).astype(np.int32)
    hk, hq = jnp.asarray(hk)[None, None], jnp.asarray(hq)[None, None]
    _, kappa_s, _ = kx.code_sort(hk, N)
    opts = copts(chunk_size=c, heavy_capacity=bh)
    L = kd.prefix_end(jnp.arange(N, dtype=jnp.int32) // c, opts)
    lo, hi = (x[0, 0] for x in kx.heavy_bounds(kappa_s, hq, L, bh))
    assert int(jnp.max(hi - lo)) == bh  # some rows have a full heavy set
    order = jnp.argsort(jnp.where(hi > lo, hi, kd.INT_MAX))
    lo_s, hi_s = lo[order], hi[order]
    b0, cnt, ends = kx.band_pairs(lo_s, hi_s, blk, blk, N)
    n_t = N // blk
    assert int(ends[-1]) <= -(-(N + n_t * bh) // blk) + 2 * n_t
    # every row's band lies in its tile's blocks
    t = jnp.arange(N) // blk
    ok = hi_s > lo_s
    assert bool(jnp.all(~ok | (lo_s >= b0[t] * blk)))
    assert bool(jnp.all(~ok | (hi_s <= (b0[t] + cnt[t]) * blk)))


# --------------------------------------------------------------------------- §6.4 partition
def test_bidirectional_partition_by_one_hot_values():
    """v = one-hot(j): the weight of key j in query i's output is exactly e^{s_ij}/D̃_i if j is in i's
    block, (count of j among the samples)·e^{s_ij}/(m p_j)/D̃_i otherwise; never both, never missing."""
    N, b, m = 48, 8, 16
    q, k, _ = qkv(N, seed=3, b=1, h=1)
    v = jnp.eye(N)[None, None]
    opts = bopts(bucket_size=b, num_samples=m)
    W = kd.draw_projections(jax.random.PRNGKey(5), 1, 1, D, 3)
    plan = bidir_plan(q, k, v, W, jax.random.PRNGKey(6), N, opts)
    out, lse = (np.asarray(x[0, 0], np.float64) for x in bidir_apply(q, k, v, plan, N, opts))
    s = np.asarray(q[0, 0] @ k[0, 0].T, np.float64) * opts.scale
    qblk = np.asarray(kd.inverse_permutation(plan["perm_q"]))[0, 0] // b
    kblk = np.asarray(plan["kblk"])[0, 0]
    idx, omega = np.asarray(plan["idx"])[0, 0], np.asarray(plan["omega"])[0, 0]
    want = np.zeros((N, N))
    for i in range(N):
        heavy = kblk == qblk[i]
        assert heavy.sum() == b  # equal blocks
        want[i, heavy] += np.exp(s[i, heavy] - lse[i])
        for j, w in zip(idx, omega):
            if not heavy[j]:
                want[i, j] += np.exp(s[i, j] + w - lse[i])
    np.testing.assert_allclose(out, want, atol=1e-5)
    np.testing.assert_allclose(out.sum(-1), 1.0, atol=1e-5)  # D̃ is the sum of exactly these terms
    # a sample drawn in a query's own block contributes nothing (not counted twice)
    assert any(kblk[j] == qblk[i] for i in range(N) for j in idx)


@functools.partial(jax.jit, static_argnums=(5, 6))
def _band_heavy(q, k, v, hq, hk, opts, block):
    """The full pass's heavy part by the 'band' route, as query tiles [n_t, ...] for causal_apply."""
    N, c = q.shape[2], opts.chunk_size
    order, kappa_s, _ = kx.code_sort(hk, N)
    lo, hi = kx.heavy_bounds(kappa_s, hq, kd.prefix_end(jnp.arange(N, dtype=jnp.int32) // c, opts),
                             opts.heavy_capacity)
    out, lse = kx.heavy_band(q, kx._take(k, order), kx._take(v, order), lo, hi, opts.scale, opts.heavy_capacity,
                             block, opts.tile_budget)
    return untile_inv(out, c), untile_inv(lse, c)


@pytest.mark.parametrize("heavy_impl", ["scores", "band", pytest.param("gather", marks=pytest.mark.slow)])
def test_causal_partition_and_heavy_sets_by_one_hot_values(heavy_impl):
    N, c, bh, m = 64, 8, 3, 8
    opts = copts(chunk_size=c, heavy_capacity=bh, num_projs=2, num_samples=m, heavy_impl=heavy_impl)
    q, k, _ = qkv(N, seed=4, b=1, h=1)
    v = jnp.eye(N)[None, None]
    W = kd.draw_projections(jax.random.PRNGKey(7), 1, 1, D, 2)
    q_t, ids, plan, hq, hk = causal_pieces(q, k, v, W, jax.random.PRNGKey(8), opts)
    heavy = _band_heavy(q, k, v, hq, hk, opts, 8) if heavy_impl == "band" else None
    out, lse = (np.asarray(untile(x)[0, 0], np.float64) for x in causal_apply(q_t, ids, k, v, plan, opts, heavy))
    s = np.asarray(q[0, 0] @ k[0, 0].T, np.float64) * opts.scale
    hq, hk = np.asarray(hq[0, 0]), np.asarray(hk[0, 0])
    sidx, omega = np.asarray(plan["sidx"])[:, 0, 0], np.asarray(plan["omega"])[:, 0, 0]
    want = np.zeros((N, N))
    n_heavy = 0
    for i in range(N):
        g = i // c
        L = max(0, (g - 1) * c)
        hv = set([j for j in range(L) if hk[j] == hq[i]][-bh:])  # the bh latest same-code keys before L
        n_heavy += len(hv)
        for j in list(range(L, i + 1)) + sorted(hv):
            want[i, j] += np.exp(s[i, j] - lse[i])
        if L > 0:
            for j, w in zip(sidx[g], omega[g]):
                assert 0 <= j < L
                if j not in hv:
                    want[i, j] += np.exp(s[i, j] + w - lse[i])
    assert n_heavy > 0
    np.testing.assert_allclose(out, want, atol=1e-5)
    np.testing.assert_allclose(out.sum(-1), 1.0, atol=1e-5)


# --------------------------------------------------------------------------- §6.5 fp64 reference
def test_bidirectional_equals_literal_reference_formula_in_fp64():
    N, b, m, dv = 64, 8, 24, 5
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(x, jnp.float64) for x in qkv(N, seed=9, b=1, h=1, dv=dv))
        opts = bopts(bucket_size=b, num_samples=m)
        W = kd.draw_projections(jax.random.PRNGKey(10), 1, 1, D, 3)
        plan = bidir_plan(q, k, v, W, jax.random.PRNGKey(11), N, opts)
        out, _ = bidir_apply(q, k, v, plan, N, opts)
        assert out.dtype == jnp.float64
        out = np.asarray(out[0, 0])
    Q, K, V = (np.asarray(x[0, 0], np.float64) for x in (q, k, v))
    Vt = np.concatenate([V, np.ones((N, 1))], axis=1)
    A = np.exp(Q @ K.T * opts.scale)
    qblk = np.asarray(kd.inverse_permutation(plan["perm_q"]))[0, 0] // b
    kblk = np.asarray(plan["kblk"])[0, 0]
    A_spar = A * (qblk[:, None] == kblk[None, :])
    A_res = A - A_spar
    idx = np.asarray(plan["idx"])[0, 0]
    p = np.exp(-np.asarray(plan["omega"], np.float64)[0, 0]) / m
    Pi = np.zeros((m, N))
    Pi[np.arange(m), idx] = 1.0 / np.sqrt(m * p)
    num = A_spar @ Vt + A_res @ Pi.T @ Pi @ Vt
    ref = num[:, :dv] / num[:, dv:]
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-10)


def test_ref_sampling_probabilities_are_the_law_of_the_draw():
    """p_j = π_u/N + (1-π_u) u_j/T (integer weights): empirical frequencies over many draws match."""
    N, m = 16, 200_000
    v = jax.random.normal(jax.random.PRNGKey(0), (1, 1, N, 4)) * jnp.arange(N)[None, None, :, None] / 4
    valid = jnp.ones((N,), bool)

    @jax.jit  # an eager call dispatches op by op
    def draw(v, key):
        u = kd.norm_weights(v, valid)
        lam = kd.power_lambda(kd.augmented_gram(v, valid[None, None]), 20)
        return kd.draw_samples(key, m, jnp.full((1, 1), N, jnp.int32), "ref", cum=kd.weight_prefix_sums(u), u=u,
                               lam=lam) + (lam,)

    idx, p, lam = draw(v, jax.random.PRNGKey(1))
    idx, p = np.asarray(idx[0, 0]), np.asarray(p[0, 0], np.float64)
    pj = np.zeros(N)
    pj[idx] = p
    assert abs(pj.sum() - 1.0) < 1e-5
    freq = np.bincount(idx, minlength=N) / m
    sd = np.sqrt(pj * (1 - pj) / m)
    assert np.max(np.abs(freq - pj) / sd) < 5
    # λ is ‖Ṽ‖²_op
    Vt = np.concatenate([np.asarray(v[0, 0]), np.ones((N, 1))], 1)
    assert abs(float(lam[0, 0]) - np.linalg.norm(Vt, 2) ** 2) < 1e-3 * np.linalg.norm(Vt, 2) ** 2


# --------------------------------------------------------------------------- §6.6 unbiased normaliser
def _zscores(est, exact):
    """est [T, ...] draws, exact [...] -> per-entry z and the z of their average (correlated rows)."""
    est, exact = np.asarray(est, np.float64), np.asarray(exact, np.float64)
    T = est.shape[0]
    sd = est.std(axis=0, ddof=1)
    z = (est.mean(0) - exact) / (sd / np.sqrt(T))
    agg = ((est - exact) / sd).reshape(T, -1).mean(-1)  # one statistic per draw
    z_agg = agg.mean() / (agg.std(ddof=1) / np.sqrt(T))
    return z, z_agg


@pytest.mark.parametrize("sampling", ["ref", "uniform"])
def test_bidirectional_normaliser_and_numerator_are_unbiased(sampling):
    N, b, m, T = 64, 8, 8, 4096
    q, k, v = qkv(N, seed=12, b=1, h=1, dv=3)
    v = v + 1.0
    opts = bopts(bucket_size=b, num_samples=m, sampling=sampling)
    W = kd.draw_projections(jax.random.PRNGKey(13), 1, 1, D, 3)

    def one(key, shift):
        plan = bidir_plan(q, k, v, W, key, N, opts)
        plan = dict(plan, omega=plan["omega"] + shift)
        out, lse = bidir_apply(q, k, v, plan, N, opts)
        Dt = jnp.exp(lse[0, 0])
        return Dt, Dt[:, None] * out[0, 0]

    draws = jax.jit(jax.vmap(one, in_axes=(0, None)))
    keys = jax.random.split(jax.random.PRNGKey(14), T)
    s = np.asarray(q[0, 0] @ k[0, 0].T, np.float64) * opts.scale
    Dx = np.exp(s).sum(-1)
    Nx = np.exp(s) @ np.asarray(v[0, 0], np.float64)
    Dt, Nt = draws(keys, 0.0)
    for est, ex in ((Dt, Dx), (Nt, Nx)):
        z, z_agg = _zscores(est, ex)
        assert np.max(np.abs(z)) < 6 and abs(z_agg) < 5, (np.max(np.abs(z)), z_agg)
    # power: weights 10% too large are detected by the same statistic
    Dt_bad, _ = draws(keys, math.log(1.1))
    assert np.max(np.abs(_zscores(Dt_bad, Dx)[0])) > 6


def test_causal_normaliser_is_unbiased():
    N, T = 64, 4096
    opts = copts(chunk_size=8, heavy_capacity=2, num_projs=2, num_samples=4)
    q, k, v = qkv(N, seed=15, b=1, h=1)
    W = kd.draw_projections(jax.random.PRNGKey(16), 1, 1, D, 2)

    def one(key):
        q_t, ids, plan, _, _ = causal_pieces(q, k, v, W, key, opts)
        _, lse = causal_apply(q_t, ids, k, v, plan, opts)
        return jnp.exp(untile(lse)[0, 0])

    Dt = jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(17), T))
    s = np.asarray(q[0, 0] @ k[0, 0].T, np.float64) * opts.scale
    Dx = np.sum(np.exp(s) * np.tri(N), axis=-1)
    z, z_agg = _zscores(Dt[:, 16:], Dx[16:])  # rows < 16 are exact (no prefix beyond the window)
    assert np.max(np.abs(z)) < 6 and abs(z_agg) < 5
    np.testing.assert_allclose(np.asarray(Dt[0, :16]), Dx[:16], rtol=1e-5)


def test_exp_kde_to_gaussian_kde_reduction_identity():
    """Eq. 7-8: Σ_i u_i e^{⟨x_i,y⟩} = n Z_u e^{‖y‖²/2} μ_{X'}([y;0]) with x'_i = [x_i; w_i] (O(n²) oracle)."""
    rng = np.random.default_rng(0)
    n, d = 50, 6
    X, Y = rng.normal(size=(n, d)) * 0.7, rng.normal(size=(7, d)) * 0.7
    u = rng.uniform(0.1, 2.0, size=n)
    lhs = np.exp(Y @ X.T) @ u
    Zu = np.sum(u * np.exp(0.5 * np.sum(X * X, 1)))
    w = np.sqrt(2 * np.log(Zu / (u * np.exp(0.5 * np.sum(X * X, 1)))))
    Xa = np.concatenate([X, w[:, None]], 1)
    Ya = np.concatenate([Y, np.zeros((7, 1))], 1)
    mu = np.mean(np.exp(-0.5 * np.sum((Ya[:, None] - Xa[None]) ** 2, -1)), -1)
    rhs = n * Zu * np.exp(0.5 * np.sum(Y * Y, 1)) * mu
    np.testing.assert_allclose(lhs, rhs, rtol=1e-10)


# --------------------------------------------------------------------------- §6.7 error vs samples
@pytest.mark.slow
def test_error_decreases_like_inverse_sqrt_samples():
    N, d, dv, b, n_keys = 1024, 16, 16, 32, 8
    q, k, v = kit.qkv(N, batch=1, heads=1, head_dim=d, value_dim=dv, seed=20, scale=math.sqrt(2.0), value_scale=1.0)
    v = 1.0 + v
    ref = np.asarray(dense(q, k, v, False)[0, 0], np.float64)
    ref_norm = np.linalg.norm(ref, 2)

    @functools.partial(jax.jit, static_argnums=1)
    def f(key, opts):
        kw, ksamp = jax.random.split(key)
        return kx.bidir_forward(q, k, v, kd.draw_projections(kw, 1, 1, d, 7), ksamp, opts)[0, 0]

    errs = []
    for m in (32, 128, 512, 2048):
        opts = bopts(bucket_size=b, num_samples=m, scale=d**-0.5, num_projs=7)
        e = [np.linalg.norm(np.asarray(f(jax.random.PRNGKey(100 + s), opts), np.float64) - ref, 2) / ref_norm
             for s in range(n_keys)]
        errs.append(float(np.mean(e)))
    assert all(a > b_ for a, b_ in zip(errs, errs[1:])), errs
    ratios = [b_ / a for a, b_ in zip(errs, errs[1:])]
    assert all(0.3 <= r <= 0.8 for r in ratios), (errs, ratios)


# --------------------------------------------------------------------------- §6.9 decoding state
def test_reference_with_a_state_equals_its_full_pass():
    """The reference attends to the state's cache: a path no shared law runs (the contract streams the case's
    default implementation; tests/attention/test_implementations.py compares full passes)."""
    core = make(True, causal=SMALL, impl="reference")
    q, k, v = qkv(64, seed=27)
    key = jax.random.PRNGKey(28)
    full, full_state = run(core, q, k, v, deterministic=False, key=key)
    state, outs = core.init_state(B, 64), []
    for a, b in ((0, 13), (13, 14), (14, 64)):
        o, state = run(core, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], state, deterministic=False, key=key)
        outs.append(o)
    assert maxdiff(jnp.concatenate(outs, 2), full) <= 2e-5
    for name in ("k", "v", "codes", "proj", "length"):
        assert bool(jnp.array_equal(state[name], full_state[name])), name


@pytest.mark.slow
def test_capacity_overflow_raises_eagerly_and_under_jit():
    core = make(True, causal=SMALL)
    q, k, v = qkv(24, seed=29)
    state = core.init_state(B, 16)
    with pytest.raises(CapacityError, match="holds 16 tokens"):
        core(q, k, v, state)
    with pytest.raises(CapacityError, match="holds 16 tokens"):
        run(core, q, k, v, state)  # more new tokens than the capacity: found at trace time
    _, state = run(core, q[:, :, :8], k[:, :, :8], v[:, :, :8], state)
    with pytest.raises(Exception, match="holds 16 tokens but 20"):  # 8 + 12 > 16: found at run time
        jax.block_until_ready(run(core, q[:, :, 8:20], k[:, :, 8:20], v[:, :, 8:20], state))


# --------------------------------------------------------------------------- §6.10 gradients
@pytest.mark.slow
def test_gradients_with_the_plan_frozen_pass_check_grads():
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(x, jnp.float64) for x in qkv(32, seed=32, b=1, h=1))
        W = kd.draw_projections(jax.random.PRNGKey(33), 1, 1, D, 3)
        o = bopts(bucket_size=8, num_samples=8)
        plan = bidir_plan(q, k, v, W, jax.random.PRNGKey(34), 32, o)
        check = functools.partial(check_grads, order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
        check(jax.jit(lambda q, k, v: bidir_apply(q, k, v, plan, 32, o)[0]), (q, k, v))
        co = copts()
        q_t, ids, cplan, _, _ = causal_pieces(q, k, v, W, jax.random.PRNGKey(35), co)
        check(jax.jit(lambda q_t, k, v: causal_apply(q_t, ids, k, v, cplan, co)[0]), (q_t, k, v))


@pytest.mark.parametrize("sampling", [pytest.param("ref", marks=pytest.mark.slow), "uniform"])
def test_gradient_does_not_flow_through_the_plan(sampling):
    """The full forward's gradient equals that of `apply` with the plan held fixed: p (which depends
    on v for 'ref'), the permutations and the samples are stop_gradient."""
    N = 48
    q, k, v = qkv(N, seed=36, b=1, h=1)
    W = kd.draw_projections(jax.random.PRNGKey(37), 1, 1, D, 3)
    o = bopts(bucket_size=8, num_samples=8, sampling=sampling)
    key = jax.random.PRNGKey(38)
    w = jax.random.normal(jax.random.PRNGKey(39), (1, 1, N, D))
    plan = bidir_plan(q, k, v, W, key, N, o)
    g_full = jax.jit(jax.grad(lambda q, k, v: jnp.sum(kx.bidir_forward(q, k, v, W, key, o) * w),
                              argnums=(0, 1, 2)))(q, k, v)
    g_plan = jax.jit(jax.grad(lambda q, k, v: jnp.sum(bidir_apply(q, k, v, plan, N, o)[0] * w),
                              argnums=(0, 1, 2)))(q, k, v)
    for a, b_ in zip(g_full, g_plan):
        assert maxdiff(a, b_) < 1e-6
    # the plan's own outputs carry no gradient
    jac = jax.jit(jax.jacrev(lambda v: bidir_plan(q, k, v, W, key, N, o)["omega"]))(v)
    assert float(jnp.max(jnp.abs(jac))) == 0.0


# --------------------------------------------------------------------------- §6.11 determinism / jit
@pytest.mark.parametrize("is_causal", [True, False])
def test_keys_determinism_and_no_recompilation(is_causal):
    core = make(is_causal, causal=SMALL, bucket_size=8, num_samples=8, num_projs=3)
    q, k, v = qkv(64, seed=40)
    traces = []

    @jax.jit
    def f(q, k, v, key):
        traces.append(1)
        return core(q, k, v, deterministic=False, key=key)[0]

    f(q, k, v, jax.random.PRNGKey(1)), f(q, k, v, jax.random.PRNGKey(2))
    assert len(traces) == 1
    with pytest.raises(ValueError, match="needs a PRNG"):
        core(q, k, v, deterministic=False)


def test_padded_keys_get_zero_weight_and_zero_gradient():
    N, Np = 45, 48
    o = bopts(bucket_size=8, num_samples=8)
    q, k, v = qkv(Np, seed=41, b=1, h=1)
    W = kd.draw_projections(jax.random.PRNGKey(42), 1, 1, D, 3)
    key = jax.random.PRNGKey(43)
    pad = jnp.arange(Np) >= N

    def f(q, k, v):
        plan = bidir_plan(q, k, v, W, key, N, o)
        return bidir_apply(q, k, v, plan, N, o)[0][:, :, :N]

    junk = lambda x: jnp.where(pad[None, None, :, None], 1e3, x)
    assert maxdiff(f(q, junk(k), junk(v)), f(q, k, v)) == 0.0
    gk, gv = jax.jit(jax.grad(lambda k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1)))(k, v)
    assert float(jnp.max(jnp.abs(gk[:, :, N:]))) == 0.0 and float(jnp.max(jnp.abs(gv[:, :, N:]))) == 0.0


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize("bad", [{"bucket_size": 0}, {"gray_order": "up"}, {"sampling": "paper_mc"},
                                 {"causal": {"chunk_size": 0}}, {"causal": {"local_chunks": 0}},
                                 {"causal": {"sampling": "ref2"}}, {"num_projs": 40}, {"impl": "triton"},
                                 {"impl": "xla_cpu"}, {"heavy_impl": "reference"}, {"tile_budget": -1},
                                 {"heavy_band_block": -1}, {"heavy_scores_max_len": -1}])
def test_bad_config_raises(bad):
    with pytest.raises(ConfigError):
        make(True, **bad)


def test_the_band_kernel_is_causal_only():
    """``pallas`` (the band kernel) is a causal implementation: a bidirectional core refuses the name."""
    make(True, impl="pallas")
    with pytest.raises(ConfigError, match="pallas"):
        make(False, impl="pallas")


def test_bidirectional_core_takes_no_state():
    with pytest.raises(ValueError, match="no prefix state"):
        make(False).init_state(1, 8)


# --------------------------------------------------------------------------- implementations
@pytest.mark.parametrize("is_causal,cfg,platform,cache_len,full_pass,want", [
    (True, {}, "cpu", 64, True, "scores"),  # 'auto': the CPU route for the cache length
    (True, {}, "cpu", 2048, True, "band"),
    (True, {}, "cpu", 2048, False, "gather"),
    (True, {}, "cuda", 64, True, "xla"),
    (True, {"heavy_impl": "band"}, "cpu", 64, True, "scores"),  # heavy_impl is xla's route, not a selection
    (True, {"impl": "xla", "heavy_impl": "band"}, "cpu", 64, True, "xla"),
    (True, {"impl": "reference"}, "cuda", 64, True, "reference"),
    (True, {"impl": "band,xla"}, "cuda", 64, True, "xla"),
    (False, {}, "cpu", 0, True, "xla_cpu"),
    (False, {}, "cuda", 0, True, "xla"),
    (False, {"heavy_impl": "band"}, "cpu", 0, True, "xla_cpu"),
])
def test_execution_settings_select_implementations(is_causal, cfg, platform, cache_len, full_pass, want):
    core = make(is_causal, causal=SMALL, platform=platform, **cfg)
    assert core.implementation_for(jnp.float32, cache_len=cache_len, full_pass=full_pass) == want


@pytest.mark.parametrize("head_dim,cfg,platform,cache_len,full_pass,want", [
    (64, {}, "cuda", 4096, True, "pallas"),  # a full pass whose route is 'band': the kernel
    (64, {}, "cuda", 2048, True, "xla"),  # 'scores' up to heavy_scores_max_len (cuda 2048)
    (64, {}, "cuda", 4096, False, "xla"),  # a call with a state gathers
    (64, {"heavy_scores_max_len": 77}, "cuda", 128, True, "pallas"),  # the written knob sets where 'band' starts
    (8, {}, "cuda", 4096, True, "xla"),  # heads of 8: not a Triton block shape (the kernel's reasons)
    (64, {"heavy_band_block": 8}, "cuda", 4096, True, "xla"),  # a tile below Triton's 16 rows
    (64, {}, "tpu", 4096, True, "xla"),  # not written for TPU
    (64, {}, "cpu", 4096, True, "band"),  # 'auto' never takes a kernel on a CPU
    (8, {"impl": "pallas"}, "cpu", 64, True, "pallas"),  # named: interpret mode
])
def test_auto_takes_the_band_kernel_on_cuda_for_band_passes(head_dim, cfg, platform, cache_len, full_pass, want,
                                                            monkeypatch):
    """On a GPU before Hopper (compute capability 8.0): on Hopper the Triton kernel steps aside
    (test_hopper_path.py)."""
    monkeypatch.setattr(dispatch, "cuda_compute_capability", lambda: "8.0")
    core = make(True, causal=SMALL, platform=platform, head_dim=head_dim, **cfg)
    assert core.implementation_for(jnp.bfloat16, cache_len=cache_len, full_pass=full_pass) == want


def test_the_band_kernel_runs_its_platforms_knobs(monkeypatch):
    """``pallas`` built for cuda (before Hopper, where 'auto' takes it) carries the cuda defaults it declares beside
    itself (pallas.DEFAULTS: the XLA parts' as xla's, the kernel's tile 64)."""
    monkeypatch.setattr(dispatch, "cuda_compute_capability", lambda: "8.0")
    from longctx.attention.kdeformer import pallas as kp

    core = make(True, causal=SMALL, platform="cuda", head_dim=64)
    name, runner, opts = runner_for(core, jnp.bfloat16, cache_len=1 << 15)
    assert name == "pallas"
    assert (runner.tile_budget, runner.heavy_scores_max_len, runner.heavy_band_block) == tuple(
        kp.DEFAULTS[key]["cuda"] for key in KNOBS) == (1 << 29, 2048, 64)
    assert opts.band_block == 64


# --------------------------------------------------------------------------- per-platform execution defaults
KNOBS = ("tile_budget", "heavy_scores_max_len", "heavy_band_block")


def runner_for(core, dtype, **shapes):
    """The runner a call with ``shapes`` runs (the base class's selection and build), and the options it computes
    with (its fields put into the core's options)."""
    runner, choice = core.runner(**core.selection_shapes(dtype, **shapes))
    return choice.name, runner, kx.with_knobs(core.causal_opts, runner)


@pytest.mark.parametrize("platform,cache_len,want", [("cuda", 64, "xla"), ("tpu", 4096, "xla"), ("cpu", 64, "scores"),
                                                     ("cpu", 2048, "band")])
def test_the_selection_runs_the_platforms_knobs(platform, cache_len, want):
    """The config leaves the knobs at PLATFORM_DEFAULT; the selection on ``platform`` picks the implementation and
    its runner carries that platform's values (and so do the options it computes with): a GPU never runs with the
    CPU's tile budget."""
    core = make(True, causal=SMALL, platform=platform)
    assert all(core.cfg[key] == dispatch.PLATFORM_DEFAULT for key in KNOBS)
    name, runner, opts = runner_for(core, jnp.bfloat16, cache_len=cache_len)
    assert name == want
    decl = dispatch.by_name(core.implementations(causal=True))[name]
    assert set(decl.defaults) == set(KNOBS) & {f.name for f in dataclasses.fields(runner)}
    for key in decl.defaults:
        assert getattr(runner, key) == kx.DEFAULTS[key][platform], (key, platform)
    assert opts.tile_budget == runner.tile_budget == kx.DEFAULTS["tile_budget"][platform]
    assert opts.heavy_scores_max_len == runner.heavy_scores_max_len
    if platform == "cpu":
        assert opts.tile_budget == 1 << 22 and opts.heavy_scores_max_len == 1024  # the CPU's values of before
        if "heavy_band_block" in decl.defaults:  # 'band' ('scores' reads no block)
            assert runner.heavy_band_block == opts.band_block == 64
    else:
        assert opts.tile_budget > kx.DEFAULTS["tile_budget"]["cpu"]  # not the CPU budget
        assert (opts.tile_budget, opts.heavy_scores_max_len, opts.band_block) == tuple(
            kx.DEFAULTS[key][platform] for key in KNOBS)


def test_written_knobs_run_as_written_on_every_platform():
    def core(platform):
        return make(True, causal=SMALL, tile_budget=12345, heavy_scores_max_len=77, heavy_band_block=16,
                    platform=platform)

    for platform, cache_len in (("cuda", 64), ("cpu", 64), ("cpu", 2048)):
        _, _, opts = runner_for(core(platform), jnp.float32, cache_len=cache_len)
        assert (opts.tile_budget, opts.heavy_scores_max_len) == (12345, 77)
    assert runner_for(core("cuda"), jnp.float32, cache_len=2048)[2].band_block == 16
    # heavy_scores_max_len written: the CPU's 'auto' takes 'band' past 77 keys, not past the CPU default's 1024
    assert core("cpu").implementation_for(jnp.float32, cache_len=128) == "band"


def test_the_core_options_leave_the_knobs_to_the_runner():
    """The core's own options hold no execution knob (each is the runner's field): a tiled form given them without a
    runner's knobs refuses, so no knob reaches the code except through the runner built for the platform."""
    core = make(True, causal=SMALL, tile_budget=12345)
    opts = core.causal_opts
    assert (opts.tile_budget, opts.heavy_scores_max_len, opts.band_block) == (dispatch.PLATFORM_DEFAULT,) * 3
    q, k, v = qkv(64, seed=7)
    W = kd.draw_projections(jax.random.PRNGKey(8), B, 2, D, 3)
    with pytest.raises(ValueError, match="tile_budget, heavy_scores_max_len left at dispatch.PLATFORM_DEFAULT"):
        kx.causal(q, k, v, W, jax.random.PRNGKey(9), opts)
    _, runner, with_runner = runner_for(core, jnp.float32, cache_len=64)
    assert with_runner.tile_budget == runner.tile_budget == 12345


def test_the_tiled_code_refuses_unresolved_knobs():
    q, k, v = qkv(64, seed=7)
    W = kd.draw_projections(jax.random.PRNGKey(8), B, 2, D, 3)
    with pytest.raises(ValueError, match="tile_budget left at dispatch.PLATFORM_DEFAULT"):
        kx.causal(q, k, v, W, jax.random.PRNGKey(9), copts(tile_budget=dispatch.PLATFORM_DEFAULT))


def _serial_steps(jaxpr):
    """The lax.map / scan steps of the tiled pass (scans of the query tiles and the band's pairs; not the binary
    searches' few steps inside jnp.searchsorted, whose scans have no jvp/transpose in their name stack)."""
    steps = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan" and "jvp" in str(eqn.source_info.name_stack):
            steps += eqn.params["length"]
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    steps += _serial_steps(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    steps += _serial_steps(sub)
    return steps


@pytest.mark.parametrize("platform,most", [("cuda", 4), ("cpu", None)])
def test_a_32k_causal_pass_on_gpu_settings_is_a_few_serial_steps(platform, most, monkeypatch):
    """Traced, not run: the 'auto' causal training call at 32k tokens, B8 H8 d64 bf16 (forward and backward). With
    the GPU defaults the query tiles and the band's (tile, block) pairs take a few fused steps; the CPU budget
    (2^22 logits) takes hundreds (256 tile steps and 128 pair steps each way)."""
    core = kit.build("kdeformer", True, heads=8, head_dim=64, platform=platform)
    gd, st = nnx.split(core)

    def loss(q, k, v):
        out, _ = nnx.merge(gd, st)(q, k, v, deterministic=False, key=jax.random.PRNGKey(1))
        return jnp.sum(out.astype(jnp.float32))

    x = jax.ShapeDtypeStruct((8, 8, 32768, 64), jnp.bfloat16)
    steps = _serial_steps(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, x, x).jaxpr)
    if most is None:
        assert steps == 2 * (256 + 128)
    else:
        assert 0 < steps <= most, steps


def test_a_cpu_route_named_off_a_cpu_raises():
    with pytest.raises(KernelUnsupportedError, match="band runs on cpu"):
        make(True, causal=SMALL, impl="band", platform="cuda").implementation_for(jnp.float32, cache_len=64)


# --------------------------------------------------------------------------- §4.6 packed rows
# (the law, every implementation, fp32 and bf16, gradients and two calls: tests/attention/test_packed_law.py)
LENGTHS = ((5, 27, 16), (16, 5, 27))  # two rows of three documents (48 tokens), one shorter than a block


def packed_ids(rows=LENGTHS):
    return jnp.asarray(np.stack([np.repeat(np.arange(1, len(r) + 1), r) for r in rows]), jnp.int32)


def alone(core, rows, q, k, v, key):
    """Every document of ``rows`` run alone (the rows' documents of one length together), in the packed layout."""
    out = jnp.zeros_like(v)
    starts = [np.concatenate([[0], np.cumsum(r)[:-1]]) for r in rows]
    for n in sorted(set(rows[0])):
        at = [int(s[list(r).index(n)]) for r, s in zip(rows, starts)]
        take = lambda x, n=n, at=at: jnp.stack([x[b, :, a:a + n] for b, a in enumerate(at)])  # noqa: E731
        o = run(core, take(q), take(k), take(v), deterministic=False, key=key)[0]
        for b, a in enumerate(at):
            out = out.at[b, :, a:a + n].set(o[b])
    return out


@nnx.jit
def run_packed(core, q, k, v, seg, key, state=None):
    return core(q, k, v, state, deterministic=False, key=key, segment_ids=seg)


@pytest.mark.parametrize("sampling", [pytest.param("ref", marks=pytest.mark.slow), "uniform"])
def test_packed_bidirectional_draws_are_each_documents_own(sampling):
    """Every token's samples are the columns its document draws alone (shifted to the document's first token):
    the same indices, and log-weights equal up to the rounding of λ (§4.6)."""
    opts = bopts(sampling=sampling)
    _, _, v = qkv(48, seed=31, dv=6)
    v = v * jnp.linspace(0.2, 3.0, 48)[:, None]  # norms that differ, so 'ref' is not uniform
    seg = packed_ids()
    start, n = kd.document_lengths(seg)
    key = jax.random.PRNGKey(32)
    idx, omega = jax.jit(kd.packed_bidir_samples, static_argnums=4)(key, v, start, n, opts)
    for b, row in enumerate(LENGTHS):
        s = 0
        for length in row:
            one = jax.jit(kd.bidir_samples, static_argnums=(2, 3))(key, v[:, :, s:s + length], length, opts)
            for t in (s, s + length - 1):  # the document's first and last tokens draw the same columns
                np.testing.assert_array_equal(np.asarray(idx[b, :, t]), np.asarray(one[0][b]) + s)
                np.testing.assert_allclose(np.asarray(omega[b, :, t]), np.asarray(one[1][b]), rtol=1e-5)
            s += length


@pytest.mark.parametrize("causal,settings", [
    pytest.param(True, {"causal": dict(SMALL, sampling="ref"), "impl": "reference"}, marks=pytest.mark.slow),
    (False, {"bucket_size": 8, "num_samples": 8, "num_projs": 3, "sampling": "uniform", "impl": "reference"}),
])
def test_packed_reference_equals_documents_alone_in_the_other_samplers(causal, settings):
    """The law's cases sample causally 'uniform' and bidirectionally 'ref'; here the other sampler of each direction:
    packed rows equal their documents alone (with a random key: every draw the document's own)."""
    core = make(causal, **settings)
    q, k, v = qkv(48, seed=33)
    key = jax.random.PRNGKey(34)
    got = run_packed(core, q, k, v, packed_ids(), key)[0]
    assert maxdiff(got, alone(core, LENGTHS, q, k, v, key)) <= 2e-5


@pytest.mark.parametrize("impl,sampling", [("reference", "uniform"), ("gather", "uniform"),
                                           pytest.param("gather", "ref", marks=pytest.mark.slow)])
def test_packed_decoding_restarts_at_every_new_id(impl, sampling):
    """Decoding a packed row token by token (T = 1 calls with segment ids through the state) equals its full
    packed pass: a new id starts a fresh document, the carried one continues (§4.6)."""
    core = make(True, causal=dict(SMALL, sampling=sampling), impl=impl)
    q, k, v = qkv(48, seed=35)
    seg, key = packed_ids(), jax.random.PRNGKey(36)
    full, full_state = run_packed(core, q, k, v, seg, key)
    state, outs = core.init_state(B, 48), []
    step = nnx.jit(lambda core, q, k, v, s, st: core(q, k, v, st, deterministic=False, key=key, segment_ids=s))
    for t in range(48):
        o, state = step(core, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], seg[:, t:t + 1], state)
        outs.append(o)
    assert maxdiff(jnp.concatenate(outs, 2), full) <= 2e-5
    np.testing.assert_array_equal(np.asarray(state["segment"]), np.asarray(seg[:, -1]))
    np.testing.assert_array_equal(np.asarray(state["start"]), [48 - 16, 48 - 27])  # the last documents' starts
    for name in ("segment", "start", "length"):
        np.testing.assert_array_equal(np.asarray(state[name]), np.asarray(full_state[name]), err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gather", "band"])
def test_packed_tiled_causal_ref_sampler_equals_documents_alone(impl):
    """The tiled causal forms' 'ref' sampler on a packed row (one draw per document chunk with a prefix, its λ from
    the row grid's chunk Grams): each document as alone, 48 tokens with documents longer than the local window."""
    core = make(True, causal=dict(SMALL, sampling="ref"), impl=impl, heavy_band_block=8)
    q, k, v = qkv(48, seed=37)
    key = jax.random.PRNGKey(38)
    got = run_packed(core, q, k, v, packed_ids(), key)[0]
    assert maxdiff(got, alone(core, LENGTHS, q, k, v, key)) <= 2e-5
