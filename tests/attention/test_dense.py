"""Exact attention: naive and blockwise paths against a NumPy softmax reference,
streaming, token-by-token decoding, causality, gradients and a 65k forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx import attention
from longctx.attention import dense
from longctx.attention.dense import blockwise_attention, naive_attention, self_blockwise_attention


def np_softmax_attention(q, k, v, causal):
    s = np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        T = q.shape[2]
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bhkd->bhqd", p, v)


def rand_qkv(T, B=2, H=2, D=8, Dv=None, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(ks[0], (B, H, T, D)),
        jax.random.normal(ks[1], (B, H, T, D)),
        jax.random.normal(ks[2], (B, H, T, Dv or D)),
    )


def core(causal=True, **cfg):
    c = attention.default_config("dense")
    c.update(cfg)
    return attention.build("dense", c, num_heads=2, head_dim=8, causal=causal, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("impl,T", [("naive", 37), ("blockwise", 37), ("blockwise", 64), ("blockwise", 5)])
def test_matches_numpy_reference(causal, impl, T):
    q, k, v = rand_qkv(T)
    out, _ = core(causal, impl=impl, block_q=16, block_k=8)(q, k, v)
    ref = np_softmax_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-4)


def test_registry_lists_dense_and_rejects_unknown():
    assert "dense" in attention.names()
    with pytest.raises(attention.ConfigError if hasattr(attention, "ConfigError") else Exception, match="allowed"):
        attention.build("nope", None, num_heads=1, head_dim=4, causal=True, rngs=nnx.Rngs(0))
    with pytest.raises(Exception, match="impl"):
        core(impl="fast")


@pytest.mark.parametrize(
    "impl,splits",
    [("naive", [0, 5, 6, 20, 37]), ("naive", list(range(38))), ("blockwise", [0, 5, 6, 20, 37]), ("blockwise", [0, 37])],
)
def test_streamed_chunks_equal_full(impl, splits):
    T = 37
    q, k, v = rand_qkv(T)
    c = core(True, impl=impl, block_q=8, block_k=8)
    full, _ = c(q, k, v)
    state = c.init_state(2, T)
    outs = []
    for a, b in zip(splits[:-1], splits[1:]):
        o, state = c(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], state)
        outs.append(o)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 2)), np.asarray(full), atol=1e-5)
    assert int(state["length"]) == T


def test_token_by_token_decoding_under_jit_equals_full():
    T = 24
    q, k, v = rand_qkv(T, seed=3)
    c = core(True)
    full, _ = c(q, k, v)
    step = nnx.jit(lambda m, q, k, v, s: m(q, k, v, s))
    state = c.init_state(2, T)
    outs = []
    for t in range(T):
        o, state = step(c, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        outs.append(o)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 2)), np.asarray(full), atol=1e-5)


@pytest.mark.parametrize("impl", ["naive", "blockwise"])
def test_no_future_leak(impl):
    T, t = 20, 9
    q, k, v = rand_qkv(T, B=1, H=1)
    c = core(True, impl=impl, block_q=4, block_k=4)
    base, _ = c(q, k, v)
    k2 = k.at[:, :, t + 1 :].add(5.0)
    v2 = v.at[:, :, t + 1 :].add(5.0)
    pert, _ = c(q, k2, v2)
    np.testing.assert_array_equal(np.asarray(base[:, :, : t + 1]), np.asarray(pert[:, :, : t + 1]))
    assert not np.allclose(np.asarray(base[:, :, t + 1 :]), np.asarray(pert[:, :, t + 1 :]))

    def f(vv):
        return c(q, k, vv)[0][0, 0, :, 0]

    jac = np.asarray(jax.jacrev(f)(v))[:, 0, 0, :, 0]  # [T_out, T_in] (reverse mode: blockwise has a custom VJP)
    assert np.all(np.triu(jac, 1) == 0)
    assert np.all(np.abs(np.diag(jac)) > 0)


def test_blockwise_gradients_equal_naive_and_finite():
    T = 29
    q, k, v = rand_qkv(T, seed=5)
    pos = jnp.arange(T)
    valid = jnp.ones((T,), bool)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v)))

    naive = lambda q, k, v: naive_attention(q, k, v, pos, pos, valid, causal=True)
    block = lambda q, k, v: blockwise_attention(q, k, v, pos, pos, valid, causal=True, block_q=8, block_k=8)
    g1 = jax.jit(jax.grad(lambda *a: loss(naive, *a), argnums=(0, 1, 2)))(q, k, v)
    g2 = jax.jit(jax.grad(lambda *a: loss(block, *a), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g1, g2):
        assert np.all(np.isfinite(np.asarray(b)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("bq,bk", [(8, 8), (16, 8), (8, 16), (32, 32)])
def test_self_blocks_equal_naive_with_gradients(causal, bq, bk):
    """The unrolled full-pass path (blocks wholly visible, blocks the diagonal crosses, a single block): output and
    gradients equal the naive path's, in both directions and for block_q above, below and equal to block_k."""
    T = 32
    q, k, v = rand_qkv(T, seed=7, Dv=6)
    pos, valid = jnp.arange(T), jnp.ones((T,), bool)
    naive = lambda q, k, v: naive_attention(q, k, v, pos, pos, valid, causal=causal)  # noqa: E731
    blocks = lambda q, k, v: self_blockwise_attention(q, k, v, causal=causal, block_q=bq, block_k=bk)  # noqa: E731
    np.testing.assert_allclose(np.asarray(blocks(q, k, v)), np.asarray(naive(q, k, v)), atol=2e-6)
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)))  # noqa: E731
    g1 = jax.jit(jax.grad(loss(naive), argnums=(0, 1, 2)))(q, k, v)
    g2 = jax.jit(jax.grad(loss(blocks), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_full_passes_take_the_self_blocks_only_when_they_apply(monkeypatch):
    """A cache-free call of a length that whole blocks tile takes the unrolled path; a length they do not tile, a
    call with a state and one with more than MAX_UNROLLED_BLOCKS query blocks take the position-general loop."""
    taken = []
    real = dense.self_blockwise_attention
    monkeypatch.setattr(dense, "self_blockwise_attention", lambda *a, **kw: taken.append(a[0].shape[2]) or real(*a, **kw))
    c = core(True, impl="blockwise", block_q=8, block_k=8)
    for T in (32, 30):
        c(*rand_qkv(T))
    c(*rand_qkv(8), state=c.init_state(2, 64))
    monkeypatch.setattr(dense, "MAX_UNROLLED_BLOCKS", 3)
    c(*rand_qkv(32))
    assert taken == [32]
    assert dense.self_blocks_apply(64, 512, 256) and not dense.self_blocks_apply(1000, 512, 256)


@pytest.mark.slow
def test_blockwise_runs_65536_token_forward():
    T = 65536
    q, k, v = rand_qkv(T, B=1, H=1, D=16, seed=1)
    c = core(True, impl="blockwise", block_q=1024, block_k=1024)
    out = jax.jit(lambda q, k, v: c(q, k, v)[0])(q, k, v)
    out = np.asarray(out)
    assert out.shape == (1, 1, T, 16) and np.all(np.isfinite(out))
    # spot-check rows against the exact reference on their prefix
    for t in (0, 1000, T - 1):
        ref = np_softmax_attention(
            np.asarray(q[:, :, t : t + 1], np.float64), np.asarray(k[:, :, : t + 1], np.float64),
            np.asarray(v[:, :, : t + 1], np.float64), causal=False,
        )
        np.testing.assert_allclose(out[:, :, t : t + 1], ref, atol=2e-5)
