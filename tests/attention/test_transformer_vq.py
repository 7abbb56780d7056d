"""Transformer-VQ: the checks 1-11 of docs/methods/transformer_vq.md §7 on the method's own functions (check 10's
multi-device part lives in test_transformer_vq_multidevice.py; check 12 in tests/kernels/test_vq_cache.py), its
options and the mapping of older execution settings. That every implementation equals the reference (outputs,
state, gradients) is tests/attention/test_implementations.py; causality, streaming, decoding and shapes are
tests/attention/test_contract.py."""

from __future__ import annotations

import collections
import warnings

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from longctx import attention
from longctx.attention import Aux, dispatch
from longctx.attention import transformer_vq as tvq
from longctx.attention.base import continues_state
from longctx.attention.transformer_vq import reference, xla, xla_cpu
from longctx.errors import ConfigError
from pallas_kernels import vq_cache_ref
from tests.attention import kit
from tests.attention.kit import FAST, maxdiff, qkv

# jitted entry points: eager lax.scan retraces (and recompiles) on every call, so tests call these.
PAR = jax.jit(tvq.causal_parallel, static_argnames=("L", "M", "reduction", "return_lse"), compiler_options=FAST)
STREAM = jax.jit(tvq.causal_stream, static_argnames=("L", "M"), compiler_options=FAST)
REF = jax.jit(reference.causal, static_argnames=("L", "M"), compiler_options=FAST)
REF_BI = jax.jit(reference.bidirectional, static_argnames=("L", "M", "band"), compiler_options=FAST)
ENC = jax.jit(tvq.encoder_parallel, static_argnames=("L", "M", "band"), compiler_options=FAST)
STVQ = jax.jit(tvq.stvq, compiler_options=FAST)
REDUCE = jax.jit(tvq.prefix_reduce, static_argnames=("reduction",), compiler_options=FAST)

# the linear forms' leading arguments: PAR(*x, state, L=L, M=M), QUAD(*x, M=M)
Args = collections.namedtuple("Args", "q_u bd k_hat z v C")


def QUAD(q_u, bd, k_hat, z, v, C, M):
    """The quadratic reference's output from the empty state (its L sets only which keys take gradients)."""
    B, H, _, Dk = q_u.shape
    return REF(q_u, bd, k_hat, z, v, C, tvq.empty_state(B, H, M, C.shape[1], Dk, v.shape[-1], q_u.dtype), L=M, M=M)[0]


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def make_inputs(seed=0, B=2, H=2, T=12, Dk=4, Dv=3, S=5, M=3, dtype=jnp.float64, signed=False, C=None, k=None):
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    normal = lambda i, *shape: jax.random.normal(ks[i], shape, dtype)
    return dict(q=normal(0, B, H, T, Dk), k=normal(1, B, H, T, Dk) if k is None else k, v=normal(2, B, H, T, Dv),
                C=normal(3, H, S, Dk) if C is None else C, u=0.3 * normal(4, H, Dk), vb=0.3 * normal(5, H, Dk),
                r=normal(6, (2 * M + 1) if signed else (M + 1), H, Dk))


def derived(d):
    q_u = d["q"] + d["u"][None, :, None]
    q_v = d["q"] + d["vb"][None, :, None]
    return q_u, q_v, tvq.band_scores(q_v, d["r"])


def np_reference(q_u, q_v, k, v, r, M, causal=True, valid=None):
    """Softmax attention with the local XL bias in float64 NumPy: an oracle that shares no code with the library."""
    q_u, q_v, k, v, r = (np.asarray(x, np.float64) for x in (q_u, q_v, k, v, r))
    T = q_u.shape[2]
    d = np.arange(T)[:, None] - np.arange(T)  # i - j
    row = d if causal else d + M  # the row of r that biases (i, j): d in 0..M (causal) or -M..M
    band = (row >= 0) & (row <= (M if causal else 2 * M))
    bias = np.einsum("bhid,ijhd->bhij", q_v, r[np.where(band, row, 0)])
    s = np.einsum("bhid,bhjd->bhij", q_u, k) + np.where(band, bias, 0.0)
    seen = (d >= 0) | (not causal)  # the keys each query sees
    if valid is not None:
        seen = seen & np.asarray(valid)
    s = np.where(seen, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def empty(d, M):
    B, H, _, Dk = d["q"].shape
    return tvq.empty_state(B, H, M, d["C"].shape[1], Dk, d["v"].shape[-1], d["q"].dtype)


def quantized(d):
    q_u, _, bd = derived(d)
    k_hat, z, _, _ = STVQ(d["k"], d["C"])
    return Args(q_u, bd, k_hat, z, d["v"], d["C"])


def small_core(causal=True, **over):
    core = kit.build("transformer_vq", causal, codebook_size=8, block_len=4, **over)
    core.W_R[...] = jax.random.normal(jax.random.PRNGKey(7), core.W_R[...].shape)  # make the bias matter
    core.u[...] = 0.2 * jax.random.normal(jax.random.PRNGKey(8), core.u[...].shape)
    core.v[...] = 0.2 * jax.random.normal(jax.random.PRNGKey(9), core.v[...].shape)
    # a codebook on the scale of normalized keys (norm Dk^1/4), so several codes are used
    core.c_sum[...] = 1.4 * jax.random.normal(jax.random.PRNGKey(10), core.c_sum[...].shape) * 8 ** -0.25
    return core


@nnx.jit  # eager dispatch runs op by op
def jcall(core, q, k, v, state=None, mask=None):
    """``core(q, k, v, state, aux=..., mask=mask)``: the output, the new state and the call's aux outputs."""
    aux = Aux()
    out, new = core(q, k, v, state, aux=aux, mask=mask)
    return out, new, aux.as_dict()


# ---------------------------------------------------------------------- check 1: lossless codebook
@pytest.mark.parametrize("dtype,atol", [(jnp.float64, 1e-10), pytest.param(jnp.float32, 1e-5, marks=pytest.mark.slow)])
def test_lossless_codebook_equals_dense(x64, dtype, atol):
    B, H, T, Dk, M = 2, 2, 12, 4, 3
    protos = jax.random.normal(jax.random.PRNGKey(3), (H, 7, Dk), dtype)
    idx = jax.random.randint(jax.random.PRNGKey(4), (B, H, T), 0, 7)
    k = jax.vmap(lambda p, i: p[i], in_axes=(0, 1), out_axes=1)(protos, idx)
    filler = 100.0 + jax.random.normal(jax.random.PRNGKey(5), (H, 9, Dk), dtype)
    C = jnp.concatenate([filler[:, :4], protos, filler[:, 4:]], axis=1)  # codes 4..10 are the prototypes
    d = make_inputs(T=T, M=M, dtype=dtype, C=C, k=k)
    x = quantized(d)
    assert jnp.array_equal(x.k_hat, k) and jnp.all(x.z == idx + 4)
    want = np_reference(*derived(d)[:2], k, d["v"], d["r"], M)  # raw (unquantized) keys
    for L, red in ((4, "serial"), (3, "matmul"), (6, "assoc")):
        assert maxdiff(PAR(*x, empty(d, M), L=L, M=M, reduction=red)[0], want) < atol, (L, red)
    assert maxdiff(STREAM(*x, empty(d, M), L=2, M=M)[0], want) < atol


def test_quadratic_reference_matches_loops(x64):
    d = make_inputs(M=3)
    x = quantized(d)
    assert maxdiff(QUAD(*x, M=3), np_reference(*derived(d)[:2], x.k_hat, d["v"], d["r"], 3)) < 1e-12


# ---------------------------------------------------------------------- check 2: linear == quadratic
# one block of one token, M = L, M < L, one block of the whole row (each reduction among them); every pair with
# -m slow. M = L = 3 (serial) catches a lag-1 cache (block n-1 folded in), which would double count block n-1.
FAST_PAIRS = [(1, 1), (3, 3), (4, 2), (12, 4)]


@pytest.mark.parametrize("dtype,pairs", [("float64", FAST_PAIRS), ("float32", FAST_PAIRS[1:3]),
                                         ("bfloat16", FAST_PAIRS[1:3]),
                                         pytest.param("float64", None, marks=pytest.mark.slow)])
def test_linear_equals_quadratic(x64, dtype, pairs):
    T = 12
    pairs = pairs or [(L, M) for L in divisors(T) for M in divisors(T) if M <= L]
    d64 = make_inputs(T=T, M=T)
    d = {k: v.astype(dtype) for k, v in d64.items()}  # rounded inputs
    d64 = {k: v.astype(jnp.float64) for k, v in d.items()}
    for L, M in pairs:
        dd, ref_in = ({k: (v[: M + 1] if k == "r" else v) for k, v in x.items()} for x in (d, d64))
        ref = QUAD(*quantized(ref_in), M=M)
        red = ("serial", "matmul", "assoc")[(L + M) % 3]  # reductions cycle; check 9 compares them all
        o, _ = PAR(*quantized(dd), empty(dd, M), L=L, M=M, reduction=red)
        if dtype == "float64":
            assert maxdiff(o, ref) < 1e-10, (L, M, red)
        elif dtype == "float32":
            np.testing.assert_allclose(np.asarray(o), np.asarray(ref), rtol=1e-5, atol=1e-6)
        else:
            rel = maxdiff(o.astype(jnp.bfloat16), ref) / float(jnp.max(jnp.abs(ref)))
            assert rel < 2e-2, (L, M, red, rel)


@pytest.mark.slow
def test_ragged_length_and_carried_state(x64):
    d = make_inputs(T=10, M=3)
    x = quantized(d)
    ref = QUAD(*x, M=3)
    for L in (3, 4, 7, 16):
        o, st = PAR(*x, empty(d, 3), L=L, M=3)
        assert o.shape == d["v"].shape and maxdiff(o, ref) < 1e-10, L
        assert int(st["pos"]) == 10 and float(st["agg_n"].sum()) == 2 * 2 * 7  # B*H*(T-M) tokens in agg


# ---------------------------------------------------------------------- check 3: streaming == quadratic
# incl. L = 1, M > L, M > T; every pair of divisors of 48 with -m slow
@pytest.mark.parametrize("T,sweeps", [(12, [((1, 5), (4, 15)), ((3,), (1,))]),
                                      pytest.param(48, [(divisors(48), divisors(48))], marks=pytest.mark.slow)],
                         ids=["T12", "T48"])
def test_stream_equals_quadratic(x64, T, sweeps):
    for Ls, Ms in sweeps:
        d = make_inputs(T=T, M=max(Ms))
        for M in Ms:
            x = quantized(dict(d, r=d["r"][: M + 1]))
            ref = QUAD(*x, M=M)
            for L in Ls:
                o, st = STREAM(*x, empty(d, M), L=L, M=M)
                assert maxdiff(o, ref) < 1e-10 and int(st["pos"]) == T, (L, M)


# ---------------------------------------------------------------------- check 5: block-size invariance
def test_block_size_invariance(x64):
    d = make_inputs(T=12, M=2)
    x = quantized(d)
    outs = [PAR(*x, empty(d, 2), L=L, M=2)[0] for L in (2, 5, 12)]
    outs += [STREAM(*x, empty(d, 2), L=L, M=2)[0] for L in (1, 7)]
    for o in outs[1:]:
        assert maxdiff(o, outs[0]) < 1e-10


# ---------------------------------------------------------------------- check 6: cache carry
def _assert_states_close(a, b, atol):
    assert int(a["pos"]) == int(b["pos"]) and jnp.array_equal(a["band_z"], b["band_z"])
    for name in ("band_k", "band_v", "agg_mu", "agg_n"):
        assert maxdiff(a[name], b[name]) < atol, name


def test_cache_carry_pure_functions(x64):
    L = M = 3
    d = make_inputs(T=12, M=M)
    x = quantized(d)
    full, st_full = PAR(*x, empty(d, M), L=L, M=M)
    # the first `cut` tokens from the empty state, the rest from its final state; streaming splits anywhere (with
    # any chunk lengths), and its final state equals the parallel one
    for fn, cut, L1, L2 in ((PAR, 3, L, L), (PAR, 9, L, L), (STREAM, 5, 2, 4)):
        o1, s1 = fn(*(a[:, :, :cut] for a in x[:5]), x.C, empty(d, M), L=L1, M=M)
        o2, s2 = fn(*(a[:, :, cut:] for a in x[:5]), x.C, s1, L=L2, M=M)
        assert maxdiff(jnp.concatenate([o1, o2], 2), full) < 1e-10, cut
        _assert_states_close(s2, st_full, 1e-10)


def test_gau_stack_carry_and_decode():
    from longctx.models.blocks import get_block

    cfg = ml_collections.ConfigDict(dict(
        d_model=16, num_heads=1, head_dim=8, d_ff=32, norm="rmsnorm", positions="none", dropout=0.0, causal=True,
        gau_expansion=2.0, gau_layerdrop=0.0, dtype="float32", param_dtype="float32",
        attention=dict(name="transformer_vq", transformer_vq=dict(codebook_size=8, block_len=4))))
    blocks = [get_block("gau")(cfg, layer_index=i, rngs=nnx.Rngs(i)) for i in range(2)]
    for b in blocks:
        b.core.W_R[...] = jax.random.normal(jax.random.PRNGKey(3), b.core.W_R[...].shape)
    assert blocks[0].value_dim == 32 and blocks[0].core.rel_dim == 16 and not blocks[0].core.cfg.qk_norm
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 11, 16))

    @nnx.jit
    def run(blocks, x, states):
        new = []
        for b, s in zip(blocks, states):
            x, s = b(x, s, positions=None, aux=Aux())
            new.append(s)
        return x, new

    full, st_full = run(blocks, x, [None, None])
    for cuts in ([0, 4, 11], range(12)):  # two chunks; token by token
        st, outs = [None, None], []
        for a, b in zip(cuts[:-1], cuts[1:]):
            y, st = run(blocks, x[:, a:b], st)
            outs.append(y)
        assert maxdiff(jnp.concatenate(outs, 1), full) < 2e-5, cuts
        for s1, s2 in zip(st, st_full):
            _assert_states_close(s1, s2, 2e-5)


# ---------------------------------------------------------------------- check 7: STVQ
@pytest.mark.parametrize("stvq", [reference.stvq, xla.stvq, xla_cpu.stvq], ids=["reference", "xla", "xla_cpu"])
def test_stvq_forward_jacobian_and_commit_grad(x64, stvq):
    d = make_inputs(B=1, H=2, T=3, Dk=4, S=6)
    k, C = d["k"], d["C"]
    k_hat, z, err2, c_z = stvq(k, C)
    dist = jnp.sum((k[..., None, :] - C[None, :, None]) ** 2, -1)
    assert jnp.array_equal(z, jnp.argmin(dist, -1))
    assert maxdiff(k_hat, c_z) < 1e-12 and maxdiff(err2, jnp.min(dist, -1)) < 1e-10
    jac = jax.jit(jax.jacfwd(lambda kk: stvq(kk, C)[0]), compiler_options=FAST)(k)
    assert maxdiff(jac.reshape(k.size, k.size), jnp.eye(k.size)) == 0.0
    beta = 1e-4
    B, T = k.shape[0], k.shape[2]
    g_k, g_C = jax.jit(jax.grad(lambda kk, cc: beta * tvq.commit_loss(kk, stvq(kk, cc)[3]), argnums=(0, 1)),
                       compiler_options=FAST)(k, C)
    assert maxdiff(g_k, 2 * beta * (k - c_z) / (B * T)) < 1e-15
    assert float(jnp.abs(g_C).max()) == 0.0
    # ties go to the lowest index
    C2 = jnp.concatenate([C[:, :1], C[:, :1], C[:, 1:]], axis=1)
    assert int(stvq(C[None, :, :1], C2)[1].max()) == 0


def test_core_reports_commit_and_stats():
    core = small_core()
    q, k, v = qkv(8, seed=1)
    mask = jnp.ones((2, 8), bool).at[1, 5:].set(False)
    _, _, aux = jcall(core, q, k, v, mask=mask)
    kn = 8 ** -0.25 * tvq.rms_normalize(k)
    c_z = tvq.stvq(kn, core.codebook())[3]
    per_tok = jnp.sum((kn - c_z) ** 2, axis=(1, 3))
    assert maxdiff(aux["losses"]["commit"], 1e-4 * jnp.sum(per_tok * mask) / jnp.sum(mask)) < 1e-9
    st = aux["stats"]["codebook"]
    assert float(st["count"].sum()) == 2 * 13  # heads * unmasked tokens
    assert maxdiff(st["sum"].sum(1), jnp.einsum("bhtd,bt->hd", kn, mask.astype(jnp.float32))) < 1e-4


# ---------------------------------------------------------------------- check 8: gradients
# M < L (the shared law runs M = L) and tiles of 2 query rows; the portable forms and XLA:CPU's
@pytest.mark.parametrize("form,L,M", [("parallel", 4, 2), ("blocks", 4, 2), ("cpu_parallel", 4, 2),
                                      ("cpu_blocks", 4, 2), ("stream", 3, 3)])
def test_gradients_match_reference(x64, form, L, M):
    """Check 8: the gradients of the linear forms equal the reference's (keys outside the two local blocks
    through their stop-gradient codeword, §2.7)."""
    mod = xla_cpu if form.startswith("cpu_") else xla
    d = make_inputs(T=12, M=M, Dv=3)
    g = jax.random.normal(jax.random.PRNGKey(11), d["v"].shape, jnp.float64)
    w = jax.random.normal(jax.random.PRNGKey(12), d["v"].shape, jnp.float64)

    def loss(q, k, v, u, vb, r, G, which):
        dd = dict(d, q=q, v=v, u=u, vb=vb, r=r)
        q_u, q_v, bd = derived(dd)
        k_hat, z, _, _ = tvq.stvq(k, d["C"])
        if which == "ref":
            o = reference.causal(q_u, bd, k_hat, z, v, d["C"], empty(d, M), L=L, M=M)[0]
        elif form.endswith("blocks"):  # tiles of 2 query rows: the tile loop and its offsets
            o = mod.causal_blocks(q_u, q_v, r, k_hat, z, v, d["C"], empty(d, M), L=L, M=M, q_tile=2)[0]
        elif form.endswith("parallel"):
            o = mod.causal_parallel(q_u, bd, k_hat, z, v, d["C"], empty(d, M), L=L, M=M)[0]
        else:
            o = mod.causal_stream(q_u, bd, k_hat, z, v, d["C"], empty(d, M), L=L, M=M)[0]
        return jnp.sum(jnp.sin(o * G) * w)

    args = (d["q"], d["k"], d["v"], d["u"], d["vb"], d["r"], g)
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(7))), static_argnums=7, compiler_options=FAST)
    for name, a, b in zip(("q", "k", "v", "u", "v'", "r", "G"), grad(*args, "lin"), grad(*args, "ref")):
        assert maxdiff(a, b) < 1e-10, name
        assert float(jnp.abs(b).max()) > 0, name


# (21, 4, 3, 2): ragged T, a band shorter than the block, two tiles per block; the others run under -m slow
# backward from the forward's kept weights by default, recomputed with -m slow
@pytest.mark.parametrize("keep", [True, pytest.param(False, marks=pytest.mark.slow)])
@pytest.mark.parametrize("T,L,M,q_tile", [(21, 4, 3, 2), pytest.param(5, 4, 4, 4, marks=pytest.mark.slow),
                                          pytest.param(16, 8, 8, 4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mod", [xla_cpu, pytest.param(xla, marks=pytest.mark.slow)], ids=["xla_cpu", "xla"])
def test_blocks_equal_parallel_with_carried_state(x64, T, L, M, q_tile, keep, mod):
    """causal_blocks (tiled scan, FlashAttention-style backward) == causal_parallel (serial): output, new state and
    the gradients of both with respect to the inputs and the carried state (its counts ``agg_n`` too: they reach the
    output through the cache's log counts), for ragged T and pos > 0 (the shared law differentiates the empty state's
    calls only)."""
    keep_budget = 1 << 30 if keep else -1  # causal_blocks keeps at most this many scores (-1: never)
    d = make_inputs(T=T, M=M, S=6, Dv=3)
    B, H, _, Dk = d["q"].shape
    ks = jax.random.split(jax.random.PRNGKey(3), 5)
    st = dict(empty(d, M), pos=jnp.asarray(2 * L + 1, jnp.int32),
              band_k=jax.random.normal(ks[0], (B, H, M, Dk)), band_v=jax.random.normal(ks[1], (B, H, M, 3)),
              band_z=jax.random.randint(ks[2], (B, H, M), 0, 6),
              agg_mu=jax.random.normal(ks[3], (B, H, 6, 3)),
              agg_n=jax.random.randint(ks[4], (B, H, 6), 0, 3).astype(jnp.float64))
    w = jax.random.normal(jax.random.PRNGKey(12), d["v"].shape, jnp.float64)
    q_u, q_v, bd = derived(d)
    k_hat, z, _, _ = tvq.stvq(d["k"], d["C"])

    def run(which, q_u, q_v, r, k_hat, v, band_v, agg_mu, agg_n):
        s = dict(st, band_v=band_v, agg_mu=agg_mu, agg_n=agg_n)
        if which == "blocks":
            o, ns = mod.causal_blocks(q_u, q_v, r, k_hat, z, v, d["C"], s, L=L, M=M, q_tile=q_tile,
                                      keep_budget=keep_budget)
        else:
            o, ns = tvq.causal_parallel(q_u, tvq.band_scores(q_v, r), k_hat, z, v, d["C"], s, L=L, M=M)
        return jnp.sum(o * w) + jnp.sum(jnp.sin(ns["agg_mu"])) + jnp.sum(ns["band_v"] ** 2), (o, ns)

    f = jax.jit(jax.value_and_grad(run, argnums=tuple(range(1, 9)), has_aux=True), static_argnums=0,
                compiler_options=FAST)
    args = (q_u, q_v, d["r"], k_hat, d["v"], st["band_v"], st["agg_mu"], st["agg_n"])
    (_, (o1, n1)), g1 = f("blocks", *args)
    (_, (o2, n2)), g2 = f("parallel", *args)
    assert maxdiff(o1, o2) < 1e-12
    for key in n1:
        assert maxdiff(n1[key], n2[key]) < 1e-12, key
    for name, a, b in zip(("q_u", "q_v", "r", "k_hat", "v", "band_v", "agg_mu", "agg_n"), g1, g2):
        assert maxdiff(a, b) < 1e-11, name
        assert float(jnp.abs(b).max()) > 0, name


def test_far_key_gradient_is_absent(x64):
    """The §2.7 caveat (docs/methods/transformer_vq.md): keys older than the two local blocks get no score gradient
    in the linear form."""
    L = M = 3
    d = make_inputs(T=12, M=M)
    q_u, _, bd = derived(d)

    def f(k):
        k_hat, z, _, _ = tvq.stvq(k, d["C"])
        return tvq.causal_parallel(q_u, bd, k_hat, z, d["v"], d["C"], empty(d, M), L=L, M=M)[0][:, :, 11].sum()

    gk = jax.jit(jax.grad(f), compiler_options=FAST)(d["k"])
    assert float(jnp.abs(gk[:, :, :6]).max()) == 0.0 and float(jnp.abs(gk[:, :, 6:]).max()) > 0.0


# ---------------------------------------------------------------------- check 9: stable form == U/L form
def test_stable_form_equals_ul_form(x64):
    """Every stable (running-mean) reduction equals the raw-sum form in fp64: the prefix merge, and the whole
    linear form (serial vs sum)."""
    key = jax.random.split(jax.random.PRNGKey(0), 2)
    n = jnp.floor(jax.random.uniform(key[0], (2, 2, 7, 5), jnp.float64, 0, 4))
    mu = jax.random.normal(key[1], (2, 2, 7, 5, 3), jnp.float64)
    mu = jnp.where(n[..., None] > 0, mu, 0.0)  # as code_summary produces (empty codes have mean 0)
    ref = REDUCE(mu, n, reduction="sum")
    for red in ("serial", "matmul", "assoc"):
        out = REDUCE(mu, n, reduction=red)
        assert maxdiff(out[0], ref[0]) < 1e-12 and maxdiff(out[1], ref[1]) == 0.0, red
    d = make_inputs(T=12, M=2)
    x = quantized(d)
    a = PAR(*x, empty(d, 2), L=2, M=2, reduction="serial")[0]
    b = PAR(*x, empty(d, 2), L=2, M=2, reduction="sum")[0]
    assert maxdiff(a, b) < 1e-12


def test_stable_reduction_with_bf16_values(x64):
    """bf16 values with large counts (N up to ~38k >> 256): our policy (mu, N in fp32) stays at fp64
    accuracy for every stable reduction; storing the state in bf16 (the release's activation dtype)
    does not (bf16 counts are inexact above 256; docs/methods/transformer_vq.md §10.3).

    Departure: one would also expect the raw-sum ("sum") form to degrade in bf16; on XLA:CPU the bf16
    cumsum is accumulated wide, so we could not reproduce that and do not assert it."""
    R, S, Dv = 64, 4, 8
    key = jax.random.split(jax.random.PRNGKey(0), 2)
    n = jnp.round(jax.random.uniform(key[0], (1, 1, R, S), minval=200, maxval=600))
    mu = (100.0 + jax.random.normal(key[1], (1, 1, R, S, Dv))).astype(jnp.bfloat16)
    ref_mu, ref_n = REDUCE(mu.astype(jnp.float64), n.astype(jnp.float64), reduction="sum")
    for red in ("serial", "assoc", "matmul"):
        m, nn = REDUCE(mu.astype(jnp.float32), n.astype(jnp.float32), reduction=red)
        assert maxdiff(m, ref_mu) / 100.0 < 1e-5 and maxdiff(nn, ref_n) == 0.0, red
    m16, _ = REDUCE(mu, n.astype(jnp.bfloat16), reduction="serial")
    assert maxdiff(m16, ref_mu) / 100.0 > 1e-3


# ---------------------------------------------------------------------- check 10: EMA (single device)
def test_ema_update_closed_form_and_masking():
    core = small_core()
    c_sum0, c_count0 = core.c_sum[...], core.c_count[...]
    q, k, v = qkv(12, seed=1)
    mask = jnp.ones((2, 12), bool).at[0, 9:].set(False)
    # a window of three blocks processed in three calls: summed stats == one call on the window
    aux_w, st = Aux(), None
    for a in (0, 4, 8):
        _, st, aux = jcall(core, q[:, :, a:a + 4], k[:, :, a:a + 4], v[:, :, a:a + 4], st, mask[:, a:a + 4])
        aux_w.add_stats("codebook", aux["stats"]["codebook"])
    stats = jcall(core, q, k, v, mask=mask)[2]["stats"]
    for name in ("count", "sum"):
        assert maxdiff(aux_w.stats["codebook"][name], stats["codebook"][name]) < 1e-5
    kn = np.asarray(8 ** -0.25 * tvq.rms_normalize(k), np.float64)
    Cb = np.asarray(core.codebook(), np.float64)
    code = np.argmin(((kn[..., None, :] - Cb[:, None]) ** 2).sum(-1), -1)  # [b, h, t]: the nearest codeword
    onehot = (code[..., None] == np.arange(8)) * np.asarray(mask)[:, None, :, None]  # masked tokens count 0
    cnt, tot = onehot.sum((0, 2)), np.einsum("bhts,bhtd->hsd", onehot, kn)
    core.apply_stats(stats)
    g = 0.99
    np.testing.assert_allclose(core.c_count[...], g * np.asarray(c_count0) + (1 - g) * cnt, rtol=1e-6)
    np.testing.assert_allclose(core.c_sum[...], g * np.asarray(c_sum0) + (1 - g) * tot, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(core.codebook(), core.c_sum[...] / np.maximum(core.c_count[...], 0.01)[..., None],
                               rtol=1e-6)
    # a code that is never used decays; below 0.01 counts the clamp kicks in
    cs, cc = tvq.ema_update(jnp.ones((1, 1, 2)), jnp.full((1, 1), 0.005), {"sum": jnp.zeros((1, 1, 2)),
                                                                            "count": jnp.zeros((1, 1))}, 0.99)
    assert maxdiff(tvq.codebook_from_stats(cs, cc), 0.99 / 0.01 * jnp.ones((1, 1, 2))) < 1e-5


# ---------------------------------------------------------------------- check 11: encoder
# a band shorter than the block, a ragged row, one block by default; M = L (the shared law's band, whose encoders
# tests/attention/test_implementations.py compares with the reference) and blocks of 2 with -m slow
@pytest.mark.parametrize("T,L,M", [pytest.param(12, 3, 3, marks=pytest.mark.slow), (12, 4, 2), (10, 3, 2), (12, 12, 5),
                                   pytest.param(14, 2, 1, marks=pytest.mark.slow)])
def test_encoder_equals_dense_bidirectional(x64, T, L, M):
    d = make_inputs(T=T, M=M, signed=True)
    x = quantized(d)
    q_u, q_v, _ = derived(d)
    # with the band; without (Thm 3.5: no band, no bias); padded keys are excluded
    for band, valid in ((True, None), (False, None), (True, np.arange(T) < T - 3)):
        r = d["r"] if band else 0 * d["r"]
        want = np_reference(q_u, q_v, x.k_hat, d["v"], r, M, causal=False, valid=valid)
        assert maxdiff(ENC(*x, L=L, M=M, band=band, valid=valid), want) < 1e-10, (band, valid is not None)
        if valid is None:
            assert maxdiff(REF_BI(q_u, x.bd, x.k_hat, d["v"], L=L, M=M, band=band), want) < 1e-10, band


def test_encoder_core_has_no_state():
    core = small_core(causal=False, mem_len=2)
    with pytest.raises(ValueError):
        core.init_state(2)


# ---------------------------------------------------------------------- config validation, long forward
@pytest.mark.parametrize("over,causal", [
    (dict(reduction="cumsum"), True), (dict(mem_len=8, impl="blocks"), True), (dict(mem_len=8), False),
    (dict(gamma=1.0), True), (dict(impl="pallas", reduction="matmul"), True), (dict(impl="xla"), True),
    (dict(impl="blocks", reduction="matmul"), True), (dict(impl="parallel", mem_len=8), True),
    (dict(impl="pallas"), False), (dict(impl="blocks"), False), (dict(impl="naive"), True)])
def test_config_validation(over, causal):
    cfg = attention.default_config("transformer_vq")
    cfg.update(dict(block_len=4, **over))
    with pytest.raises(ConfigError):
        attention.validate("transformer_vq", cfg, causal=causal)


def test_form_is_an_unknown_key():
    """The causal forms are implementations (``impl='parallel' | 'blocks' | 'stream'``): a ``form`` setting is
    refused like any unknown key, in one line."""
    cfg = attention.default_config("transformer_vq")
    cfg.update(dict(form="blocks"))
    with pytest.raises(ConfigError, match=r"attention[.]form: unknown key; allowed keys: .*impl") as e:
        attention.validate("transformer_vq", cfg, causal=True)
    assert "\n" not in str(e.value)


def test_odd_derived_rel_dim_names_where_it_comes_from():
    """rel_dim=0 takes num_heads x head_dim: an odd product is refused naming both, not as a rel_dim the user set."""
    cfg = attention.default_config("transformer_vq")
    cfg.update(dict(codebook_size=8, block_len=8))
    with pytest.raises(ConfigError, match=r"rel_dim=0 takes num_heads x head_dim = 3 x 5 = 15") as e:
        attention.build("transformer_vq", cfg, num_heads=3, head_dim=5, causal=True, rngs=nnx.Rngs(0))
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_long_forward_65536():  # ~5 s on CPU
    core = kit.build("transformer_vq", heads=1, head_dim=32, codebook_size=64, block_len=128)
    q, k, v = qkv(65536, batch=1, heads=1, head_dim=32, seed=1)
    o, st = jax.jit(lambda q, k, v: core(q, k, v))(q, k, v)
    assert o.shape == (1, 1, 65536, 32) and bool(jnp.all(jnp.isfinite(o)))
    assert int(st["pos"]) == 65536 and float(st["agg_n"].sum()) == 65536 - 128


# (config, platform, T) -> the implementation it selects: impl='auto' by the declared ranks and preferences (the
# kernel, then the form the size rule gives the call), a named implementation whatever the call's size, a list the
# first that serves. Shapes the TPU kernel takes (B = H = 2, S = L = Dk = 128): the platform default of
# tiled_min_scores (xla.DEFAULTS: 2^23 on a CPU, 2^26 on a GPU / TPU) is reached from T = 5462 on a CPU and from
# T = 43691 on an accelerator
BIG = 1 << 16
SELECTED = [
    (dict(), "cpu", 2, "xla_cpu"), (dict(), "cpu", BIG, "xla_cpu"),
    (dict(), "cuda", 2, "stream"), (dict(), "rocm", 256, "parallel"), (dict(), "rocm", BIG, "blocks"),
    (dict(), "tpu", 2, "stream"), (dict(), "tpu", 256, "pallas"),
    (dict(reduction="matmul"), "tpu", BIG, "parallel"),  # the kernel computes the serial reduction
    (dict(tiled_min_scores=1), "tpu", 256, "pallas"), (dict(tiled_min_scores=1), "rocm", 256, "blocks"),
    (dict(impl="parallel"), "tpu", BIG, "parallel"), (dict(impl="blocks"), "tpu", 2, "blocks"),
    (dict(impl="stream"), "tpu", 256, "stream"), (dict(impl="pallas"), "tpu", 256, "pallas"),
    (dict(impl="pallas"), "tpu", 2, "pallas"), (dict(impl="pallas,stream"), "rocm", 256, "stream"),
    (dict(impl="reference"), "tpu", 256, "reference"), (dict(impl="blocks"), "cpu", 2, "blocks"),
]


def _kernel_sized(causal=True, platform=None, **over):
    return kit.build("transformer_vq", causal, head_dim=128, codebook_size=128, block_len=128, platform=platform,
                     **over)


@pytest.mark.parametrize("over,platform,T,name", SELECTED)
def test_settings_select_implementations(over, platform, T, name):
    core = _kernel_sized(platform=platform, **over)
    assert core.implementation_for(B=2, T=T, dtype=jnp.float32).name == name


@pytest.mark.parametrize("over", [dict(), dict(impl="auto"), dict(reduction="matmul")])
def test_bidirectional_settings_select_the_encoder(over):
    for platform, name in (("cpu", "xla_cpu"), ("cuda", "encoder")):
        core = _kernel_sized(causal=False, platform=platform, **over)
        assert core.implementation_for(B=2, T=12, dtype=jnp.float32).name == name


def test_size_rule_picks_tiles_by_call_size():
    """The size rule takes the tiled form only for calls with >= tiled_min_scores score entries (an execution
    setting) and the serial reduction, else the one-shot block-parallel form, and the streaming form for calls
    shorter than a block or a band longer than one; the tiled and one-shot forms give the same output."""
    core = small_core()
    shape = dict(B=2, H=2, S=8, L=4, M=4, min_scores=1 << 23)
    assert xla.form_for(T=12, **shape) == "parallel"  # B*H*T*(S+2L) = 2*2*12*16 entries: below the threshold
    assert xla.form_for(T=(1 << 23) // 64, **shape) == "blocks"
    assert xla.form_for(T=(1 << 23) // 64, reduction="matmul", **shape) == "parallel"
    assert xla.form_for(T=3, **shape) == "stream"
    assert xla.form_for(T=12, **dict(shape, M=5)) == "stream"
    q, k, v = qkv(12, seed=1)
    # jitted (the form is picked at trace time; an eager call compiles op by op)
    assert maxdiff(kit.out(core, q, k, v), kit.out(small_core(tiled_min_scores=1), q, k, v)) < 1e-5


def test_numeric_knobs_run_with_the_platform_value():
    """keep_budget, tiled_min_scores and search_chunk left at 0 take the value the implementation that reads them
    declares for the call's platform (a GPU never runs the XLA:CPU tuning); a written value runs everywhere."""
    from longctx.attention import dispatch

    core = _kernel_sized()
    shape = dict(B=2, H=2, S=128, L=128, M=128)
    T = (1 << 23) // (2 * 2 * 384) + 128  # just past the CPU threshold, far below the accelerators'
    assert xla.preferred_form("cpu", T=T, **shape) == "blocks"
    assert xla.preferred_form("cuda", T=T, **shape) == "parallel"
    assert xla.preferred_form("cuda", T=T, tiled_min_scores=1 << 23, **shape) == "blocks"
    assert _kernel_sized(platform="rocm").implementation_for(B=2, T=T, dtype=jnp.float32).name == "parallel"
    impls = dispatch.by_name(core.implementations())
    assert impls["blocks"].settings(core.cfg, "cuda") == {"search_chunk": 2048, "keep_budget": -1,
                                                          "tiled_min_scores": 1 << 26}
    assert impls["xla_cpu"].settings(core.cfg, "cpu") == {"search_chunk": 512, "keep_budget": 1 << 26,
                                                          "tiled_min_scores": 1 << 23, "reduction": "serial"}
    assert impls["parallel"].settings(_kernel_sized(reduction="assoc").cfg, "cuda") == {"search_chunk": 2048,
                                                                                       "reduction": "assoc"}
    assert impls["pallas"].settings(core.cfg, "cuda") == {"search_chunk": 2048}
    assert impls["pallas"].settings(_kernel_sized(search_chunk=64).cfg, "cuda") == {"search_chunk": 64}
    # the knobs reach the code as the runner's fields, the platform's values
    build = lambda name, cfg, platform: impls[name].code.build(impls[name], cfg, platform)  # noqa: E731
    assert build("blocks", core.cfg, "cuda") == xla.Blocks(search_chunk=2048, keep_budget=-1, tiled_min_scores=1 << 26)
    assert build("xla_cpu", core.cfg, "cpu") == xla_cpu.XlaCpu(search_chunk=512, keep_budget=1 << 26,
                                                               tiled_min_scores=1 << 23, reduction="serial")
    assert build("parallel", _kernel_sized(reduction="assoc").cfg, "tpu") == xla.Parallel(search_chunk=2048,
                                                                                         reduction="assoc")
    assert build("pallas", core.cfg, "interpret").search_chunk == 512  # a kernel on a CPU: the CPU's value


def test_first_argmax_matches_lax_argmax_ties_low_and_stays_in_range():
    first_argmax = xla_cpu.first_argmax
    g = jnp.round(jax.random.normal(jax.random.PRNGKey(0), (3, 50, 17)) * 2.0)  # rounded: many ties
    np.testing.assert_array_equal(first_argmax(g), jax.lax.argmax(g, 2, jnp.int32))
    assert int(first_argmax(jnp.array([1.0, 3.0, 3.0, 0.0]))) == 1
    assert 0 <= int(first_argmax(jnp.array([[0.0, jnp.nan, 1.0]]))[0]) <= 2  # a NaN row stays in range


def test_code_sums_scatter_and_onehot_forms_agree():
    """Per-code sums as the reference's one-hot matmul and as XLA:CPU's scatter-add: values and gradients, with
    invalid entries excluded."""
    S = 7
    z = jax.random.randint(jax.random.PRNGKey(1), (2, 3, 4, 16), 0, S)
    v = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 4, 16, 5))
    w = jax.random.bernoulli(jax.random.PRNGKey(3), 0.7, (4, 16))
    a, b = xla_cpu.code_sums(z, v, w, S), vq_cache_ref.code_sums(z, v, w, S)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
    ga = jax.grad(lambda v: jnp.sum(xla_cpu.code_sums(z, v, w, S)[0] ** 2))(v)
    gb = jax.grad(lambda v: jnp.sum(vq_cache_ref.code_sums(z, v, w, S)[0] ** 2))(v)
    np.testing.assert_allclose(ga, gb, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- packed rows (§2.8)
PACKED = (3, 10, 7)  # a document shorter than the block of 4, two cut mid-block


@nnx.jit
def train_call(core, q, k, v, w, key, seg, mask):
    """A training call (``deterministic=False``, ``key``; ``seg``: segment ids or None): the output, the q, k, v
    gradients of <out, w> and the aux outputs."""
    def loss(q, k, v):
        aux = Aux()
        out, _ = core(q, k, v, aux=aux, mask=mask, deterministic=False, key=key,
                      **({} if seg is None else {"segment_ids": seg}))
        return jnp.sum(out * w), (out, aux.as_dict())

    (_, (out, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads, aux


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_packed_row_equals_its_documents_alone_in_training_mode(causal):
    """Documents of 3, 10 and 7 tokens in one row (a band of 2 < L = 4), in training mode (sinusoid dropout, the
    same key), with a token mask across a boundary: outputs and q, k, v gradients equal each document's own call
    (which 'auto' runs through XLA:CPU's linear forms), the packed call's codebook statistics are its documents'
    summed and its commit loss their token-weighted mean; 'auto' takes the XLA:CPU implementation's linear packed
    forms."""
    core = small_core(causal, mem_len=2, p_dropsin=0.3)
    T = sum(PACKED)
    q, k, v = qkv(T, seed=5)
    w = jax.random.normal(jax.random.PRNGKey(6), v.shape)
    seg = jnp.asarray(np.repeat(np.arange(1, 4), PACKED)[None].repeat(2, 0), jnp.int32)
    mask = jnp.ones((2, T), bool).at[1, 2:6].set(False)
    key = jax.random.PRNGKey(4)
    want = "xla_cpu"
    assert core.implementation_for(B=2, T=T, dtype=jnp.float32, segments=True).name == want
    out, grads, aux = train_call(core, q, k, v, w, key, seg, mask)
    count, sums, commit, a = 0.0, 0.0, 0.0, 0
    for n in PACKED:
        part = lambda x, a=a, n=n: x[..., a:a + n, :] if x.ndim == 4 else x[:, a:a + n]  # noqa: E731
        o, g, alone = train_call(core, *map(part, (q, k, v, w)), key, None, part(mask))
        assert maxdiff(part(out), o) < 1e-5, (a, n)
        for name, gp, ga in zip("qkv", grads, g):
            assert maxdiff(part(gp), ga) < 1e-5, (name, a, n)
        count = count + alone["stats"]["codebook"]["count"]
        sums = sums + alone["stats"]["codebook"]["sum"]
        commit = commit + alone["losses"]["commit"] * jnp.sum(part(mask))
        a += n
    st = aux["stats"]["codebook"]
    np.testing.assert_array_equal(st["count"], count)  # counts: integers in float32, exact
    assert float(st["count"].sum()) == 2 * float(mask.sum())  # heads x unmasked tokens
    assert maxdiff(st["sum"], sums) < 1e-5
    assert maxdiff(aux["losses"]["commit"], commit / jnp.sum(mask)) < 1e-9
    assert maxdiff(out, train_call(core, q, k, v, w, key, None, mask)[0]) > 1e-2  # unpacked they see each other


def test_packed_rows_served_by_the_kernel_and_the_linear_forms(monkeypatch):
    """The kernel serves a packed row in both forms (named on a CPU it runs its TPU form in interpret mode and equals
    the one-shot packed form); 'auto' takes the kernel for a packed row on a GPU or TPU where it takes it for an
    unpacked one (a block or more: the cache is serial whatever the reduction), elsewhere the linear packed
    forms where they serve (a large call the tiled one, a smaller one the one-shot one; the encoder too), the quadratic
    reference on a CPU only (a band longer than a block), the streaming form for a packed decoding step on a GPU;
    a packed causal call returns the state of its last document under its id. A GPU before Hopper (compute
    capability 8.0): on Hopper the Mosaic GPU kernels take a bfloat16 packed row, a float32 one the linear forms."""
    monkeypatch.setattr(dispatch, "cuda_compute_capability", lambda: "9.0")
    hop = _kernel_sized(platform="cuda")
    assert hop.implementation_for(T=1 << 16, **dict(B=2, dtype=jnp.bfloat16, segments=True)).name == "mosaic_gpu"
    assert hop.implementation_for(T=1 << 16, **dict(B=2, dtype=jnp.float32, segments=True)).name == "blocks"
    monkeypatch.setattr(dispatch, "cuda_compute_capability", lambda: "8.0")
    q, k, v = qkv(12, seed=3)
    seg = jnp.asarray([[1] * 5 + [2] * 7] * 2, jnp.int32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*interpret mode.*")
        got = jax.jit(lambda q, k, v: small_core(impl="pallas")(q, k, v, segment_ids=seg)[0])(q, k, v)
    want = small_core(impl="parallel")(q, k, v, segment_ids=seg)[0]
    assert maxdiff(got, want) < 1e-5
    packed = dict(B=2, dtype=jnp.float32, segments=True)
    for over in (dict(), dict(reduction="matmul")):
        for T in (1 << 16, 1 << 12, 128):
            for platform in ("cuda", "tpu"):
                assert _kernel_sized(platform=platform, **over).implementation_for(T=T, **packed).name == "pallas"
        # where the kernel has no lowering, the linear packed forms
        assert _kernel_sized(platform="rocm", **over).implementation_for(T=1 << 16, **packed).name == "blocks"
        assert _kernel_sized(platform="rocm", **over).implementation_for(T=1 << 12, **packed).name == "parallel"
    assert _kernel_sized(platform="cuda").implementation_for(T=64, **packed).name == "stream"  # shorter than a block
    with pytest.raises(dispatch.KernelUnsupportedError, match="mem_len <= block_len"):  # not the quadratic stream
        _kernel_sized(platform="cuda", mem_len=256).implementation_for(T=1 << 12, **packed)
    assert _kernel_sized(platform="cuda").implementation_for(T=1, carried=True, **packed).name == "stream"
    assert small_core(mem_len=6).implementation_for(T=12, **packed).name == "reference"
    assert _kernel_sized(causal=False, platform="cuda").implementation_for(T=256, **packed).name == "encoder"
    assert small_core(False).implementation_for(T=12, **packed).name == "xla_cpu"
    assert small_core().implementation_for(T=12, **packed).name == "xla_cpu"  # 'auto' on a CPU
    for name in ("reference", "parallel", "blocks", "stream", "xla_cpu"):
        new = jcall_packed(small_core(impl=name), q, k, v, seg)[1]
        np.testing.assert_array_equal(new["segment"], [2, 2])
        np.testing.assert_array_equal(new["seen"], [7, 7])
        assert int(new["pos"]) == 12


# the packed rows the carried-state checks feed in pieces: documents of 3, 9 (cut mid-block and inside the band of
# M = 2), 1 and 7 tokens; the second row's last document comes back under its first one's id (a new document)
CARRY_ROWS = ((1,) * 3 + (2,) * 9 + (3,) + (4,) * 7, (5,) * 6 + (6,) * 2 + (7,) * 11 + (5,))


@pytest.mark.parametrize("name,mem_len,cuts", [
    ("reference", 2, (5, 13)),
    ("parallel", 2, (5, 13)),
    ("parallel", 4, (4, 8, 16)),
    ("stream", 2, (3, 5, 6)),
    ("blocks", 2, (5, 13)),
    pytest.param("blocks", 4, (2, 8, 16), marks=pytest.mark.slow),  # a piece shorter than the block
    ("xla_cpu", 2, (2, 5, 13)),  # the short form (a call shorter than the block) and the one-shot one
    pytest.param("stream", 6, (7, 12), marks=pytest.mark.slow),  # a band longer than the block
    pytest.param("reference", 6, (1, 12), marks=pytest.mark.slow),
])
def test_packed_rows_fed_in_pieces_equal_one_call(name, mem_len, cuts):
    """A packed row fed in pieces, each from the state the previous one left (cuts inside documents, at a document's
    first token and inside a one-token document), gives the one-call packed outputs (the reference's) and ends in
    the state of the same last document as the one call: its band, cache, ``seen`` and ``segment``."""
    seg = jnp.asarray(CARRY_ROWS, jnp.int32)
    T = seg.shape[1]
    q, k, v = qkv(T, seed=11)
    core = small_core(impl=name, mem_len=mem_len)
    want, want_state = jcall_packed(small_core(impl="reference", mem_len=mem_len), q, k, v, seg)
    state, outs = core.init_state(2), []
    for a, b in zip((0,) + cuts, cuts + (T,)):
        o, state = jcall_packed_from(core, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], seg[:, a:b], state)
        outs.append(o)
    assert maxdiff(jnp.concatenate(outs, axis=2), want) < 2e-5
    for key in ("segment", "seen", "agg_n"):
        np.testing.assert_array_equal(state[key], want_state[key], err_msg=key)
    valid = (want_state["seen"][:, None] - mem_len + jnp.arange(mem_len) >= 0)[:, None, :, None]
    for key in ("band_k", "band_v"):  # the band's slots of the last document (the others are never read)
        assert maxdiff(jnp.where(valid, state[key], 0), jnp.where(valid, want_state[key], 0)) < 2e-5, key
    assert maxdiff(state["agg_mu"], want_state["agg_mu"]) < 2e-5


@pytest.mark.parametrize("impl", ["stream", pytest.param("auto", marks=pytest.mark.slow)])
def test_packed_decoding_equals_the_packed_call(impl):
    """Decoding with segment ids (one token a call, from the carried state; the first call of each row without a
    state, a document's first token starting afresh whatever its id) gives the packed call's outputs."""
    seg = jnp.asarray(CARRY_ROWS, jnp.int32)
    T = seg.shape[1]
    q, k, v = qkv(T, seed=12)
    core = small_core(impl=impl, mem_len=2)
    want = jcall_packed(small_core(impl="reference", mem_len=2), q, k, v, seg)[0]
    state, outs = core.init_state(2), []
    for t in range(T):
        o, state = jcall_packed_from(core, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], seg[:, t:t + 1],
                                     state)
        outs.append(o)
    assert maxdiff(jnp.concatenate(outs, axis=2), want) < 2e-5


def test_packed_states_compose_as_one_call():
    """Sequence parallelism's composition of packed states: the state of a packed row's first part composed with
    that of its second part run from the origin is the one call's (a row cut inside a document that spans the whole
    second part, a row whose second part opens new documents)."""
    seg = jnp.asarray([(1,) * 5 + (2,) * 15, (1,) * 5 + (2,) * 7 + (3,) * 8], jnp.int32)
    q, k, v = qkv(20, seed=14)
    core = small_core(mem_len=2)
    want = jcall_packed(core, q, k, v, seg)[1]
    a = jcall_packed(core, q[:, :, :8], k[:, :, :8], v[:, :, :8], seg[:, :8])[1]
    b = jcall_packed_from(core, q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], seg[:, 8:], core.sequence_origin(2, 20, 8))[1]
    got = core.compose_states(a, b)
    for key in ("pos", "segment", "seen", "agg_n", "band_z"):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    for key in ("agg_mu", "band_k", "band_v"):
        assert maxdiff(got[key], want[key]) < 1e-5, key


def test_calls_without_segment_ids_carry_one_document():
    """A call without segment ids keeps its state's document id and adds its length to ``seen``; its outputs and
    the forms' state are those of a state without the document counters (``empty_state``)."""
    q, k, v = qkv(12, seed=13)
    core = small_core()
    o, st = jcall(core, q, k, v)[:2]
    np.testing.assert_array_equal(st["segment"], [0, 0])
    np.testing.assert_array_equal(st["seen"], [12, 12])
    bare = {name: x for name, x in core.init_state(2).items() if name not in tvq.DOCUMENT}
    o2, st2 = jcall(core, q, k, v, bare)[:2]
    np.testing.assert_array_equal(o, o2)
    for name in st:
        np.testing.assert_array_equal(st[name], st2[name])


def _packed_forms_agree(L, M, causal, band=True):
    """The linear packed form of a direction (xla.causal_packed, xla.encoder_packed) and the packed quadratic
    reference in value and gradient (q, k_hat, v) in float64, for documents shorter than, equal to and many blocks
    longer than the block, cut anywhere on the row's grid (two rows, different layouts)."""
    d = make_inputs(seed=2, T=29, M=M, signed=not causal)
    q_u, _, bd = derived(d)
    k_hat, z, _, _ = STVQ(d["k"], d["C"])
    rows = ((1, 11, 2, 2, 13), (13, 1, L, 11, 4 - L))
    seg = jnp.asarray(np.stack([np.repeat(np.arange(1, 6), r) for r in rows]), jnp.int32)
    w = jax.random.normal(jax.random.PRNGKey(3), d["v"].shape, d["v"].dtype)

    def grads(fn):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2)))(
            q_u, k_hat, d["v"])

    want = grads(lambda q, k, v: reference.packed(q, bd, k, v, L=L, M=M, causal=causal, band=band, segment_ids=seg))
    if causal:
        got = grads(lambda q, k, v: xla.causal_packed(q, bd, k, z, v, d["C"], L=L, M=M, segment_ids=seg))
    else:
        got = grads(lambda q, k, v: xla.encoder_packed(q, bd, k, z, v, d["C"], L=L, M=M, band=band, segment_ids=seg))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert maxdiff(a, b) < 1e-10


@pytest.mark.parametrize("L,M", [(4, 2), pytest.param(3, 3, marks=pytest.mark.slow), (2, 1)])
def test_packed_parallel_form_equals_packed_reference(x64, L, M):
    """The linear packed form (xla.causal_packed) equals the packed quadratic reference (:func:`_packed_forms_agree`)."""
    _packed_forms_agree(L, M, causal=True)


@pytest.mark.parametrize("L,M,band", [(4, 2, True), pytest.param(3, 3, True, marks=pytest.mark.slow), (2, 1, True),
                                       (4, 2, False)])
def test_packed_encoder_form_equals_packed_reference(x64, L, M, band):
    """The linear packed encoder (xla.encoder_packed: each document's blocks n-1..n+1 exact, its prefix and suffix
    through the code summaries) equals the packed quadratic reference, with the band and without it (Thm 3.5)."""
    _packed_forms_agree(L, M, causal=False, band=band)


@nnx.jit
def jcall_packed(core, q, k, v, seg):
    return core(q, k, v, segment_ids=seg)


@nnx.jit
def jcall_packed_from(core, q, k, v, seg, state):
    return core(q, k, v, state, segment_ids=seg)


@pytest.mark.parametrize("L,M,carried", [(4, 2, True), (2, 1, False), pytest.param(3, 3, True, marks=pytest.mark.slow),
                                         pytest.param(4, 2, False, marks=pytest.mark.slow)])
def test_packed_tiled_form_equals_packed_one_shot_form(x64, L, M, carried):
    """The tiled packed form (xla.causal_packed_blocks: one row block a step, rematerialized; XLA:CPU's products)
    equals the one-shot packed form (xla.causal_packed, itself the packed reference's equal) in value and in the
    gradients of q_u, q_v, r, k_hat, v and, ``carried``, the carried cache means and band values, from a carried
    state whose document the first row's leading run continues (the second row's starts afresh)."""
    d = make_inputs(seed=2, T=29, M=M, S=6)
    q_u, q_v, _ = derived(d)
    k_hat, z, _, _ = STVQ(d["k"], d["C"])
    rows = ((1, 11, 2, 2, 13), (13, 1, L, 11, 4 - L))
    seg = jnp.asarray(np.stack([np.repeat(np.arange(1, 6), r) for r in rows]), jnp.int32)
    w = jax.random.normal(jax.random.PRNGKey(3), d["v"].shape, d["v"].dtype)
    B, H, _, Dk = d["q"].shape
    ks = jax.random.split(jax.random.PRNGKey(4), 5)
    st = dict(empty(d, M), pos=jnp.asarray(L + 1, jnp.int32), band_k=jax.random.normal(ks[0], (B, H, M, Dk)),
              band_z=jax.random.randint(ks[2], (B, H, M), 0, 6),
              agg_n=jax.random.randint(ks[4], (B, H, 6), 0, 3).astype(jnp.float64))
    seen = jnp.asarray([M + 1, 0], jnp.int32)
    packed = dict(L=L, M=M, segment_ids=seg)
    if carried:
        packed.update(seen=seen, continues=continues_state(jnp.asarray([1, 7], jnp.int32), seg))

    def run(tiled, q_u, q_v, r, k, v, band_v, agg_mu):
        s = dict(st, band_v=band_v, agg_mu=agg_mu) if carried else None
        if tiled:
            o = xla.causal_packed_blocks(q_u, q_v, r, k, z, v, d["C"], ops=xla_cpu.OPS, state=s, **packed)
        else:
            o = xla.causal_packed(q_u, tvq.band_scores(q_v, r), k, z, v, d["C"], state=s, **packed)
        return jnp.sum(o * w), o

    f = jax.jit(jax.value_and_grad(run, argnums=tuple(range(1, 8)), has_aux=True), static_argnums=0,
                compiler_options=FAST)
    args = (q_u, q_v, d["r"], k_hat, d["v"], jax.random.normal(ks[1], (B, H, M, 3)),
            jax.random.normal(ks[3], (B, H, 6, 3)))
    (_, o1), g1 = f(True, *args)
    (_, o2), g2 = f(False, *args)
    assert maxdiff(o1, o2) < 1e-12
    for name, a, b in zip(("q_u", "q_v", "r", "k_hat", "v", "band_v", "agg_mu"), g1, g2):
        assert maxdiff(a, b) < 1e-11, name
        if carried or name not in ("band_v", "agg_mu"):
            assert float(jnp.abs(b).max()) > 0, name


def _largest_value(jaxpr) -> int:
    """The most elements of any value a jaxpr (its sub-jaxprs included: scan bodies, remat, custom rules) makes."""
    from test_compute_dtype import _sub_jaxprs

    most = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            most = max(most, int(np.prod(getattr(var.aval, "shape", ()))))
        for p in eqn.params.values():
            for sub in _sub_jaxprs(p):
                most = max(most, _largest_value(sub))
    return most


def test_packed_tiled_form_holds_no_row_by_block_array():
    """The tiled packed form's forward and backward (traced, not run; with a carried state) make no value larger than
    the unpacked tiled form's largest (xla.causal_blocks, recomputing, at the same size: the per-code sums' one-hot
    [T, S]), so none of T * L elements (a [T, M+1] band tensor, a [T, 3L] window; S < L here)."""
    T, L, S, Dk, Dv = 4096, 128, 32, 8, 8
    x = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    zs = jax.ShapeDtypeStruct((1, 1, T), jnp.int32)
    st = {"pos": jax.ShapeDtypeStruct((), jnp.int32), "band_k": x(1, 1, L, Dk), "band_v": x(1, 1, L, Dv),
          "band_z": jax.ShapeDtypeStruct((1, 1, L), jnp.int32), "agg_mu": x(1, 1, S, Dv), "agg_n": x(1, 1, S)}
    seg = jnp.asarray(np.repeat([1, 2, 3], [100, 3000, T - 3100])[None], jnp.int32)

    def packed(q_u, q_v, r, k, z, v, C, state):
        return xla.causal_packed_blocks(q_u, q_v, r, k, z, v, C, L=L, M=L, segment_ids=seg, state=state,
                                        seen=jnp.asarray([7], jnp.int32), continues=seg == 1)

    def unpacked(q_u, q_v, r, k, z, v, C, state):
        return xla.causal_blocks(q_u, q_v, r, k, z, v, C, state, L=L, M=L, keep_budget=-1)[0]

    def largest(fn):
        loss = lambda *a: jnp.sum(fn(*a))  # noqa: E731
        grad = jax.grad(loss, argnums=(0, 1, 2, 3, 5))
        return _largest_value(jax.make_jaxpr(grad)(x(1, 1, T, Dk), x(1, 1, T, Dk), x(L + 1, 1, Dk), x(1, 1, T, Dk),
                                                   zs, x(1, 1, T, Dv), x(1, S, Dk), st).jaxpr)

    got, unpacked_most = largest(packed), largest(unpacked)
    assert got <= unpacked_most < T * L // 2, (got, unpacked_most)


@pytest.mark.parametrize("impl", ["blocks", pytest.param("parallel", marks=pytest.mark.slow)])
def test_packed_forms_take_the_compute_dtype(impl):
    """A bfloat16 packed row (with a carried state) takes bfloat16 into every matmul of its forward and backward
    (the shared reader of tests/attention/test_compute_dtype.py over the jaxpr): float32 only in the declared
    statistics."""
    from test_compute_dtype import defects

    Dk, Dv, T = 8, 12, 21
    core = small_core(impl=impl, mem_len=2, value_dim=Dv)
    seg = jnp.asarray(np.repeat([1, 2, 3], [3, 11, 7])[None].repeat(2, 0), jnp.int32)
    graphdef, params, rest = nnx.split(core, nnx.Param, ...)
    state = dict(core.init_state(2), segment=jnp.asarray([1, 4], jnp.int32), seen=jnp.asarray([5, 1], jnp.int32))

    def loss(params, q, k, v):
        out, _ = nnx.merge(graphdef, params, rest)(q, k, v, state, segment_ids=seg)
        return jnp.sum(out.astype(jnp.float32))

    q = jnp.ones((2, 2, T, Dk), jnp.bfloat16)
    v = jnp.ones((2, 2, T, Dv), jnp.bfloat16)
    found = defects(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(params, q, q, v).jaxpr, {Dk, Dv})
    assert not found, "float32 matmul operands:\n  " + "\n  ".join(found[:8])


class _GpuFormInInterpretMode:
    """A ``pallas`` core whose calls run the kernel's GPU form in interpret mode (the selection's platform is the
    CPU's, whose kernel is the TPU form): prepare, the ``pallas`` runner with ``platform='cuda'``, finish."""

    def __init__(self, core):
        self.core = core

    def init_state(self, *args, **kwargs):
        return self.core.init_state(*args, **kwargs)

    def __call__(self, q, k, v, state=None, **extra):
        import dataclasses

        core = self.core
        call, shapes = core.prepare(q, k, v, state, deterministic=True, key=None, **extra)
        runner, choice = core.runner(**{**shapes, "segments": False})  # the CPU's selection, with no segment ids
        assert choice.name == "pallas"
        return core.finish(call, runner(core, dataclasses.replace(call, platform="cuda", interpret=True)))


@pytest.mark.slow
def test_packed_law_through_the_gpu_kernel_in_interpret_mode():
    """The packed-row law (tests/attention/test_packed_law.py: outputs and q, k, v gradients of each document alone,
    fp32 and bf16, and the row fed in two calls carrying the state) for ``pallas`` running its GPU form, the form
    that serves packed rows, through the layer (``xla.kernel_packed``, ``state.packed_final_state``)."""
    from tests.attention.test_implementations import _build, _case
    from tests.attention.test_packed_law import _check_packed

    cls = attention.get_class("transformer_vq")
    impl = dispatch.by_name(cls.implementations(causal=True))["pallas"]
    case = _case(cls, "causal")
    core = _build("transformer_vq", "causal", impl, case)
    assert core.M <= core.L < case.length  # documents open mid-block and span blocks: the kernel's packed path
    _check_packed(_GpuFormInInterpretMode(core), case, "transformer_vq causal pallas (GPU form)", True)
