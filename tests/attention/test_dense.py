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
from tests.attention.kit import build, np_softmax_attention, out, qkv

TILED = ("blockwise", "xla_cpu")


@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_numpy_softmax(causal):
    q, k, v = qkv(37)
    got = out(build("dense", causal, impl="reference"), q, k, v)
    np.testing.assert_allclose(np.asarray(got), np_softmax_attention(q, k, v, causal), atol=2e-5, rtol=1e-4)


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
    q, k, v = qkv(T, seed=7, value_dim=6)
    ref, tiles = (build("dense", causal, value_dim=6, impl=i, block_q=bq, block_k=bk) for i in ("reference", impl))

    def out_and_grads(c):  # jitted: an eager call dispatches op by op
        def loss(*a):
            o = c(*a)[0]
            return jnp.sum(jnp.sin(o)), o
        (_, o), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return o, g

    (out_ref, g_ref), (got, g) = out_and_grads(ref), out_and_grads(tiles)
    np.testing.assert_allclose(np.asarray(got), np.asarray(out_ref), atol=2e-6)
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
    c = build("dense", impl=impl, block_q=8, block_k=8)
    call = lambda q, k, v, state=None: c(q, k, v, state)[0]  # noqa: E731
    assert _structure(call, *qkv(32)) == "unrolled"
    assert _structure(call, *qkv(30)) == "loop"
    assert _structure(call, *qkv(8), c.init_state(2, 64)) == "loop"
    pos = jnp.arange(32)
    ops = {"blockwise": xla.PLAIN, "xla_cpu": xla_cpu.CPU}[impl]
    few = lambda q, k, v: xla.tiled(q, k, v, pos, pos, pos >= 0, causal=True, block_q=8, block_k=8,  # noqa: E731
                                    full_pass=True, ops=ops, max_unrolled=3)
    assert _structure(few, *qkv(32)) == "loop"
    assert dense.self_blocks_apply(64, 512, 256) and not dense.self_blocks_apply(1000, 512, 256)
    assert not dense.self_blocks_apply(4096, 8, 8) and dense.MAX_UNROLLED_BLOCKS == 32


def _primitives(jaxpr, inside_loop=False, found=None):
    """(primitive name, inside a scan/while) for every equation of ``jaxpr`` and its sub-jaxprs."""
    found = [] if found is None else found
    for e in jaxpr.eqns:
        found.append((e.primitive.name, inside_loop))
        loop = inside_loop or e.primitive.name in ("scan", "while")
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    _primitives(sub.jaxpr, loop, found)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    _primitives(sub, loop, found)
    return found


@pytest.mark.parametrize("full_pass,T", [(True, 32), (True, 30), (False, 30)])
def test_portable_tiles_have_no_branch_inside_their_loops(full_pass, T):
    """blockwise (GPU, TPU) computes every visited key block under its mask: no ``cond`` in its loops, forward or
    backward, where xla_cpu skips a key block in the future with one."""
    q, k, v = qkv(T)
    pos = jnp.arange(T) + (0 if full_pass else 5)

    def grad_of(mod):
        f = lambda q, k, v: mod.attend(q, k, v, pos, pos, pos >= 0, causal=True, block_q=8, block_k=8,  # noqa: E731
                                       full_pass=full_pass)
        return jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2)))(q, k, v).jaxpr

    portable = _primitives(grad_of(xla))
    assert ("scan", False) in portable and not any(name == "cond" for name, _ in portable)
    assert (("cond", True) in _primitives(grad_of(xla_cpu))) == (not full_pass or T % 8 != 0)


@pytest.mark.parametrize("full_pass", [True, False])
def test_auto_and_named_values_pick_their_implementations(full_pass):
    """On a CPU, 'auto' takes the reference up to auto_threshold scores and xla_cpu past it; 'blockwise' (the
    portable tiles) gives xla_cpu's forward bit for bit (the same ops on the forward; the backward differs only in
    rounding)."""
    shapes = dict(dtype=jnp.float32, head_dim=8, kv_cache=not full_pass, platform="cpu")
    assert dense.choose("auto", large=False, **shapes).name == "reference"
    assert dense.choose("auto", large=True, **shapes).name == "xla_cpu"
    assert dense.choose("blockwise", **shapes).name == "blockwise"
    assert dense.choose("cudnn,blockwise", **shapes).name == "blockwise"
    T = 30
    q, k, v = qkv(T, seed=2)
    state = None if full_pass else build("dense").init_state(2, T + 6)

    def run(impl):
        return np.asarray(out(build("dense", impl=impl, block_q=8, block_k=8), q, k, v, state))

    np.testing.assert_array_equal(run("blockwise"), run("xla_cpu"))


def test_config_takes_names_lists_and_old_values_and_rejects_unknown():
    for impl in ("auto", "reference", "blockwise", "xla_cpu", "cudnn", "splash", "cudnn,blockwise"):
        build("dense", impl=impl)
    assert "dense" in attention.names()
    with pytest.raises(Exception, match="allowed"):
        attention.build("nope", None, num_heads=1, head_dim=4, causal=True, rngs=nnx.Rngs(0))
    for bad in ("fast", "naive", "auto,blockwise"):
        with pytest.raises(Exception, match="impl"):
            build("dense", impl=bad)


@pytest.mark.slow
def test_tiles_run_65536_token_forward():
    T = 65536
    q, k, v = qkv(T, batch=1, heads=1, head_dim=16, seed=1)
    got = np.asarray(out(build("dense", heads=1, head_dim=16, impl="xla_cpu", block_q=1024, block_k=1024), q, k, v))
    assert got.shape == (1, 1, T, 16) and np.all(np.isfinite(got))
    # spot-check rows against the exact reference on their prefix
    for t in (0, 1000, T - 1):
        ref = np_softmax_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], causal=False)
        np.testing.assert_allclose(got[:, :, t:t + 1], ref, atol=2e-5)


# a document is a maximal run of equal ids (longctx.attention.base.document_starts): an id that comes back after
# another document starts a new one, which never sees the first
RETURNING = [[1, 1, 2, 1, 1, 1, 3, 3, 1, 1, 2, 2, 2, 1, 1, 1], [5] * 4 + [6] * 4 + [5] * 8]


def _runs(row) -> list[slice]:
    """Each maximal run of equal ids of one row, read with a plain loop."""
    starts = [i for i in range(len(row)) if i == 0 or row[i] != row[i - 1]]
    return [slice(a, b) for a, b in zip(starts, starts[1:] + [len(row)])]


def _documents_alone(q, k, v, rows, causal):
    """Every run of every row attended alone (the reference, no segment ids), put back in its place."""
    o = jnp.zeros(v.shape, v.dtype)
    for b, row in enumerate(rows):
        for sl in _runs(row):
            n = sl.stop - sl.start
            pos = jnp.arange(n, dtype=jnp.int32)
            o = o.at[b:b + 1, :, sl].set(dense.naive_attention(q[b:b + 1, :, sl], k[b:b + 1, :, sl], v[b:b + 1, :, sl],
                                                               pos, pos, jnp.ones((n,), bool), causal=causal))
    return o


@pytest.mark.parametrize("impl", ("reference", *TILED))
@pytest.mark.parametrize("causal", [True, False])
def test_a_returning_id_starts_a_new_document(impl, causal):
    """Values and gradients of a packed row whose ids come back equal its maximal runs attended alone, and the
    reference mask itself says so (the last token of [1, 1, 2, 1] sees only itself)."""
    from longctx.attention.dense.reference import segments_mask

    seen = np.asarray(segments_mask(*(jnp.asarray([[1, 1, 2, 1]], jnp.int32),) * 2))[0, 0]
    np.testing.assert_array_equal(seen[3], [False, False, False, True])
    seg = jnp.asarray(RETURNING, jnp.int32)
    q, k, v = qkv(seg.shape[1], seed=3)
    core = build("dense", causal, impl=impl, block_q=4, block_k=4)

    def loss(f):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2)))(q, k, v)

    want, g_want = loss(lambda *a: _documents_alone(*a, RETURNING, causal))
    got, g = loss(lambda *a: core(*a, segment_ids=seg)[0])
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for a, b in zip(g_want, g):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


@pytest.mark.parametrize("impl", ("reference", "blockwise"))
def test_a_returning_id_across_a_kv_cache_is_a_new_document(impl):
    """A call whose first id equals an earlier document's, not the cache's last one: a new document (as
    ``base.continues_state`` rules); a call continuing the cache's last document sees its cached keys."""
    first, second = [1, 1, 2, 2, 1, 1, 3, 3], [3, 3, 1, 1, 2, 2, 2, 2]  # 3 continues; 1 and 2 come back: new
    rows = [first + second]
    q, k, v = qkv(16, seed=5, batch=1)
    core = build("dense", True, impl=impl, block_q=4, block_k=4)
    seg = jnp.asarray(rows, jnp.int32)
    o1, state = core(q[:, :, :8], k[:, :, :8], v[:, :, :8], core.init_state(1, 16), segment_ids=seg[:, :8])
    o2, _ = core(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], state, segment_ids=seg[:, 8:])
    want = _documents_alone(q, k, v, rows, True)
    np.testing.assert_allclose(np.asarray(jnp.concatenate([o1, o2], axis=2)), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_splash_takes_a_returning_id_as_a_new_document(causal):
    """The TPU kernel (Pallas interpret mode) numbers the documents before its ``SegmentIds``: a returning id is a
    new document there too. (cuDNN's packed layout reads the maximal runs itself: test_dense_platform.py.)"""
    from longctx.attention.dense import platform as dp

    seg = jnp.asarray(RETURNING, jnp.int32)
    q, k, v = qkv(seg.shape[1], seed=4)
    got = dp.splash_attention(q, k, v, causal=causal, interpret=True, segment_ids=seg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_documents_alone(q, k, v, RETURNING, causal)), atol=1e-5)
