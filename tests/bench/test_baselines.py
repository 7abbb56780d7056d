"""Benchmark-only baselines of the quality benchmark (Performer FAVOR+, Reformer-style LSH)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longctx.attention.dense import naive_attention
from longctx.bench import baselines as bl


def _qkv(N, seed=0, d=16):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return tuple(jax.random.normal(kk, (1, 2, N, d)) for kk in ks)


def _exact(q, k, v):
    N = q.shape[2]
    pos = jnp.arange(N)
    return naive_attention(q, k, v, pos, pos, jnp.ones((N,), bool), causal=False)


def test_orthogonal_features_blocks_are_orthogonal():
    w = np.asarray(bl.orthogonal_features(jax.random.PRNGKey(0), 24, 16), np.float64)
    assert w.shape == (24, 16)
    g = w[:16] @ w[:16].T
    np.testing.assert_allclose(g - np.diag(np.diag(g)), 0.0, atol=1e-4)


@pytest.mark.slow
def test_performer_error_shrinks_with_features():
    q, k, v = _qkv(64)
    q, k, v = 0.5 * q, 0.5 * k, 1.0 + v  # mean-one values: ‖Att‖_op is not tiny
    ref = _exact(q, k, v)
    errs = [np.mean([bl.op_rel_err(bl.performer(q, k, v, jax.random.PRNGKey(s), F), ref) for s in range(4)])
            for F in (16, 256, 4096)]
    assert errs[0] > errs[1] > errs[2], errs
    assert errs[2] < 0.05, errs


def test_reformer_lsh_two_chunks_with_look_back_is_exact():
    q, k, v = _qkv(64, seed=1)
    out = bl.reformer_lsh(q, k, v, jax.random.PRNGKey(0), chunk=32, n_hashes=2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(_exact(q, k, v)), atol=1e-5)
    small = bl.reformer_lsh(q, k, v, jax.random.PRNGKey(0), chunk=8, n_hashes=2)
    assert bl.op_rel_err(small, _exact(q, k, v)) > 1e-3


def test_make_and_op_rel_err():
    q, k, v = _qkv(32, seed=2)
    ref = _exact(q, k, v)
    assert bl.op_rel_err(ref, ref) == 0.0
    for name in bl.BASELINES:
        out = bl.make(name, 16)(q, k, v, jax.random.PRNGKey(3))
        assert out.shape == ref.shape and bool(jnp.all(jnp.isfinite(out)))
        assert bl.describe(name, 16)
