"""Exact attention's own properties: the reference against a float64 NumPy softmax, the tiles' two structures
(the unrolled full pass, the position-general loop) against the reference in value and gradient at shapes the
shared law does not reach, which structure a call takes, the portable loop without a branch inside it, the
implementation ``auto`` and old configuration values pick, and a 65k forward.

Contract laws (streaming, decoding, causality, capacity, dtypes) run in tests/attention/test_contract.py, and
every implementation equals the reference at the contract case in tests/attention/test_implementations.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx import attention
from longctx.attention import dense
from longctx.attention.dense import xla, xla_cpu

TILED = ("blockwise", "xla_cpu")


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


def core(causal=True, value_dim=None, **cfg):
    c = attention.default_config("dense")
    c.update(cfg)
    return attention.build("dense", c, num_heads=2, head_dim=8, value_dim=value_dim, causal=causal, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_numpy_softmax(causal):
    q, k, v = rand_qkv(37)
    c = core(causal, impl="reference")
    out = jax.jit(lambda *a: c(*a)[0])(q, k, v)
    ref = np_softmax_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-4)


# (T, block_q, block_k): the unrolled full pass with query blocks equal to, twice and half the key blocks and a single
# block; the position-general loop for lengths the blocks do not tile (a partial last block, a row shorter than one)
STRUCTURES = [(32, 8, 8), (32, 16, 8), (32, 8, 16), (32, 32, 32), (37, 16, 8), (5, 16, 8)]


# every structure in each implementation, causal (the masked structure) by default but for equal blocks of 8, which
# the shared law (tests/attention/test_implementations.py: both tiled implementations at blocks of 8 and T = 40, both
# directions) runs by default; bidirectional at one tiled and one ragged structure by default; all with -m slow
@pytest.mark.parametrize("impl", TILED)
@pytest.mark.parametrize("causal,T,bq,bk", [
    (True, *s) if s != STRUCTURES[0] else pytest.param(True, *s, marks=pytest.mark.slow) for s in STRUCTURES] + [
    (False, *s) if s in (STRUCTURES[1], STRUCTURES[4]) else pytest.param(False, *s, marks=pytest.mark.slow)
    for s in STRUCTURES])
def test_tiles_equal_the_reference_in_every_structure(impl, causal, T, bq, bk):
    q, k, v = rand_qkv(T, seed=7, Dv=6)
    ref, tiles = (core(causal, value_dim=6, impl=i, block_q=bq, block_k=bk) for i in ("reference", impl))

    def out_and_grads(c):  # jitted: an eager call dispatches op by op
        def loss(*a):
            out = c(*a)[0]
            return jnp.sum(jnp.sin(out)), out
        (_, out), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return out, g

    (out_ref, g_ref), (out, g) = out_and_grads(ref), out_and_grads(tiles)
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), atol=2e-6)
    for a, b in zip(g_ref, g):
        assert np.all(np.isfinite(np.asarray(b)))
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def _structure(fn, *args) -> str:
    """'unrolled' or 'loop': the custom VJP a traced call goes through."""
    eqns = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "custom_vjp_call"]
    assert len(eqns) == 1
    return "unrolled" if "_self_blocks_bwd" in str(eqns[0].params["bwd"]) else "loop"


@pytest.mark.parametrize("impl", TILED)
def test_full_passes_take_the_unrolled_tiles_only_when_they_apply(impl):
    """A cache-free call of a length that whole blocks tile takes the unrolled structure; a length they do not tile,
    a call with a state and one with more query blocks than ``max_unrolled`` take the position-general loop."""
    c = core(True, impl=impl, block_q=8, block_k=8)
    call = lambda q, k, v, state=None: c(q, k, v, state)[0]  # noqa: E731
    assert _structure(call, *rand_qkv(32)) == "unrolled"
    assert _structure(call, *rand_qkv(30)) == "loop"
    assert _structure(call, *rand_qkv(8), c.init_state(2, 64)) == "loop"
    pos = jnp.arange(32)
    ops = {"blockwise": xla.PLAIN, "xla_cpu": xla_cpu.CPU}[impl]
    few = lambda q, k, v: xla.tiled(q, k, v, pos, pos, pos >= 0, causal=True, block_q=8, block_k=8,  # noqa: E731
                                    full_pass=True, ops=ops, max_unrolled=3)
    assert _structure(few, *rand_qkv(32)) == "loop"
    assert dense.self_blocks_apply(64, 512, 256) and not dense.self_blocks_apply(1000, 512, 256)
    assert not dense.self_blocks_apply(4096, 8, 8) and dense.MAX_UNROLLED_BLOCKS == 32


def _primitives(jaxpr, inside_loop=False, out=None):
    """(primitive name, inside a scan/while) for every equation of ``jaxpr`` and its sub-jaxprs."""
    out = [] if out is None else out
    for e in jaxpr.eqns:
        out.append((e.primitive.name, inside_loop))
        loop = inside_loop or e.primitive.name in ("scan", "while")
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    _primitives(sub.jaxpr, loop, out)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    _primitives(sub, loop, out)
    return out


@pytest.mark.parametrize("full_pass,T", [(True, 32), (True, 30), (False, 30)])
def test_portable_tiles_have_no_branch_inside_their_loops(full_pass, T):
    """blockwise (GPU, TPU) computes every visited key block under its mask: no ``cond`` in its loops, forward or
    backward, where xla_cpu skips a key block in the future with one."""
    q, k, v = rand_qkv(T)
    pos = jnp.arange(T) + (0 if full_pass else 5)

    def grad_of(mod):
        f = lambda q, k, v: mod.attend(q, k, v, pos, pos, pos >= 0, causal=True, block_q=8, block_k=8,  # noqa: E731
                                       full_pass=full_pass)
        return jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2)))(q, k, v).jaxpr

    portable = _primitives(grad_of(xla))
    assert ("scan", False) in portable and not any(name == "cond" for name, _ in portable)
    assert (("cond", True) in _primitives(grad_of(xla_cpu))) == (not full_pass or T % 8 != 0)


@pytest.mark.parametrize("full_pass", [True, False])
def test_auto_and_old_values_pick_their_implementations(full_pass):
    """On a CPU, 'auto' takes the reference up to auto_threshold scores and xla_cpu past it; the old value 'naive' is
    the reference; the old 'blockwise' (the tiles, on a CPU then with XLA:CPU's ops) gives today's xla_cpu forward
    bit for bit (the same ops on the forward; the backward differs only in rounding)."""
    shapes = dict(dtype=jnp.float32, head_dim=8, kv_cache=not full_pass, platform="cpu")
    assert dense.choose("auto", large=False, **shapes).name == "reference"
    assert dense.choose("auto", large=True, **shapes).name == "xla_cpu"
    assert dense.choose("naive", **shapes).name == "reference"
    assert dense.choose("blockwise", **shapes).name == "blockwise"
    assert dense.choose("cudnn,blockwise", **shapes).name == "blockwise"
    T = 30
    q, k, v = rand_qkv(T, seed=2)
    state = None if full_pass else core(True).init_state(2, T + 6)
    def run(impl):  # jitted: an eager call dispatches op by op
        c = core(True, impl=impl, block_q=8, block_k=8)
        return np.asarray(jax.jit(lambda *a: c(*a)[0])(q, k, v, state))

    np.testing.assert_array_equal(run("naive"), run("reference"))
    np.testing.assert_array_equal(run("blockwise"), run("xla_cpu"))


def test_config_takes_names_lists_and_old_values_and_rejects_unknown():
    for impl in ("auto", "reference", "naive", "blockwise", "xla_cpu", "cudnn", "splash", "cudnn,blockwise"):
        core(impl=impl)
    assert "dense" in attention.names()
    with pytest.raises(Exception, match="allowed"):
        attention.build("nope", None, num_heads=1, head_dim=4, causal=True, rngs=nnx.Rngs(0))
    for bad in ("fast", "auto,blockwise"):
        with pytest.raises(Exception, match="impl"):
            core(impl=bad)


@pytest.mark.slow
def test_tiles_run_65536_token_forward():
    T = 65536
    q, k, v = rand_qkv(T, B=1, H=1, D=16, seed=1)
    c = core(True, impl="xla_cpu", block_q=1024, block_k=1024)
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
