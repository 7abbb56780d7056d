"""Transformer-VQ compressive VQ-cache Pallas kernels (docs/methods/transformer_vq.md §9) on the shared kernel test base:
forward, final state and the Pallas backward kernels against autodiff of the jnp §2.6 serial reference (ragged T,
carried state, M < L, Dv tiles, fp32 and bf16), TPU lowering (CUDA runs the GPU form, tested in
test_vq_cache_gpu.py; its lowering of these shapes is checked here too), the VMEM budget at the paper's shapes, the
method running the kernel with impl='pallas', and packed rows (segment ids) through the TPU form: its document
arrays, its equality with the packed one-shot XLA form (output and gradients) and its lowering for tpu (and the GPU
form's for cuda). :func:`make_vq_inputs` is shared with test_vq_cache_gpu.py."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_test_base import KernelTestBase  # noqa: I001

from pallas_kernels import vq_cache, vq_cache_ref

B, H = 1, 2


def make_vq_inputs(shape, dtype):
    """(args, static) for the kernel tests: q_u, bd, k̂ = C[z], z, v, C and the six state leaves (pos, band_z,
    band_k, band_v, agg_mu, agg_n). ``shape``: T, L, M, S, Dk, Dv, warm (tokens already folded into the carried
    state by the reference), block_v; optional ``state_dtype='input'`` casts the state's floats to ``dtype`` (by
    default the state is fp32). Every other key of ``shape`` starting with ``block_`` is passed on as static."""
    dims = tuple(shape[k] for k in ("T", "L", "M", "S", "Dk", "Dv", "warm"))
    q_u, bd, k_hat, z, v, C, *st = _vq_inputs_f32(*dims)
    if shape["warm"] > shape["M"]:  # a populated carried state: non-empty cache
        assert float(np.sum(st[-1])) > 0
    cast = lambda x: x.astype(dtype)  # noqa: E731  (NumPy casts: no XLA compile per array)
    q_u, bd, k_hat, v = map(cast, (q_u, bd, k_hat, v))
    if shape.get("state_dtype") == "input":
        st[2:] = map(cast, st[2:])  # band_k, band_v, agg_mu, agg_n
    args = (q_u, bd, k_hat, z, v, C, *st)
    return args, dict(L=shape["L"], M=shape["M"], **{k: x for k, x in shape.items() if k.startswith("block_")})


@functools.lru_cache(maxsize=None)
def _vq_inputs_f32(T, L, M, S, Dk, Dv, warm):
    """The fp32 inputs of one shape as NumPy arrays (NumPy's generator: no XLA compile per random array), kept per
    shape; the warm state comes from the jitted reference."""
    rng = np.random.default_rng(T + 7 * M + S)
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    C = normal(H, S, Dk)
    z = rng.integers(0, S, (B, H, T), dtype=np.int32)
    q_u, bd, v = normal(B, H, T, Dk), normal(B, H, T, M + 1), normal(B, H, T, Dv)
    k_hat = C[np.arange(H)[None, :, None], z]  # C[h, z[b, h, t]]
    st = (np.zeros((), np.int32), np.zeros((B, H, M), np.int32), np.zeros((B, H, M, Dk), np.float32),
          np.zeros((B, H, M, Dv), np.float32), np.zeros((B, H, S, Dv), np.float32), np.zeros((B, H, S), np.float32))
    if warm:  # a populated carried state: a valid band (and a non-empty cache when warm > M)
        zw = rng.integers(0, S, (B, H, warm), dtype=np.int32)
        kw = C[np.arange(H)[None, :, None], zw]
        st = tuple(np.asarray(x) for x in _warm_state(L, M, normal(B, H, warm, Dk), normal(B, H, warm, M + 1), kw,
                                                       zw, normal(B, H, warm, Dv), C, *st))
    return (q_u, bd, k_hat, z, v, C) + st


@functools.partial(jax.jit, static_argnums=(0, 1))
def _warm_state(L, M, q_u, bd, k_hat, z, v, C, pos, band_z, band_k, band_v, agg_mu, agg_n):
    state = {"pos": pos, "band_z": band_z, "band_k": band_k, "band_v": band_v, "agg_mu": agg_mu, "agg_n": agg_n}
    _, new = vq_cache_ref.causal_parallel(q_u, bd, k_hat, z, v, C, state, L=L, M=M)
    return tuple(new[k] for k in ("pos", "band_z", "band_k", "band_v", "agg_mu", "agg_n"))


class VQCacheKernelCases(KernelTestBase):
    """What both forms of the kernel (TPU: this file; GPU: test_vq_cache_gpu.py) share: inputs, the final
    state, the differentiated arguments and the gradient tolerances."""

    # gradients w.r.t. bf16 inputs are bf16 (reference and kernel alike): one bf16 ulp of room
    GRAD_TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (8e-3, 8e-3)}
    # q_u, bd, k̂, v, band_k, band_v, agg_mu (no gradient to the codebook, the codes or the counts: §9)
    DIFF_ARGNUMS = (0, 1, 2, 4, 8, 9, 10)
    KERNEL_BACKWARD = True

    PAPER_SHAPES = ("enwik8_paper", "pg19_paper")

    @staticmethod
    def STATE(out):
        return out[1]

    def is_ragged(self, shape):  # the last block of L tokens is partial
        return shape["T"] % shape["L"] != 0

    def make_inputs(self, shape, dtype):
        return make_vq_inputs(shape, dtype)

    @staticmethod
    def _state(pos, band_z, band_k, band_v, agg_mu, agg_n):
        return {"pos": pos, "band_z": band_z, "band_k": band_k, "band_v": band_v, "agg_mu": agg_mu, "agg_n": agg_n}


class TestVQCache(VQCacheKernelCases):
    # L = 8, S = 6, Dk = 8, Dv = 16 with Dv tiles of 8 (two tiles) unless stated; warm = tokens already in the state
    SHAPES = {
        "ragged_fresh": dict(T=20, L=8, M=8, S=6, Dk=8, Dv=16, warm=0, block_v=8),
        "carried_kernel_state": dict(T=16, L=8, M=8, S=6, Dk=8, Dv=16, warm=11, block_v=8),  # T % L == 0, M == L
        "short_band_ragged": dict(T=21, L=8, M=5, S=6, Dk=8, Dv=16, warm=13, block_v=16),
        "tpu_blocks": dict(T=256, L=128, M=128, S=128, Dk=128, Dv=256, warm=0, block_v=128),
        "tpu_ragged_short_band": dict(T=200, L=128, M=64, S=256, Dk=128, Dv=128, warm=0, block_v=128),
        "enwik8_paper": dict(T=1024, L=512, M=512, S=512, Dk=128, Dv=1536, warm=0, block_v=None),
        "pg19_paper": dict(T=1024, L=512, M=512, S=512, Dk=128, Dv=4096, warm=0, block_v=None),
    }
    FORWARD_CASES = (("ragged_fresh", "float32"), ("carried_kernel_state", "float32"),
                     ("short_band_ragged", "float32"), ("carried_kernel_state", "bfloat16"),
                     ("short_band_ragged", "bfloat16"))
    GRAD_CASES = (("carried_kernel_state", "float32"), ("short_band_ragged", "float32"),
                  ("carried_kernel_state", "bfloat16"), ("short_band_ragged", "bfloat16"))
    # ("cuda", ...) lowers the GPU form (pallas_kernels/vq_cache_gpu.py) through this module's entry point
    EXPORT_CASES = (("tpu", "tpu_blocks", "float32"), ("tpu", "tpu_ragged_short_band", "bfloat16"),
                    ("tpu", "enwik8_paper", "float32"), ("tpu", "enwik8_paper", "bfloat16"),
                    ("tpu", "pg19_paper", "float32"), ("tpu", "pg19_paper", "bfloat16"),
                    ("cuda", "tpu_blocks", "float32"))
    EXPORT_PLATFORMS = ("tpu",)  # 'cuda' at the paper's shapes: test_vq_cache_gpu.py
    # bf16 inputs are exact in the fp32 reference; the kernel computes in fp32 (bf16 q·k̂ and one-hot MXU
    # operands, fp32 accumulation), so bf16 needs only a little more room than fp32.
    TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (1e-4, 1e-4)}

    def kernel(self, q_u, bd, k_hat, z, v, C, *st, interpret, platform=None, L, M, block_v):
        return vq_cache.vq_cache_attention(q_u, bd, k_hat, z, v, C, self._state(*st), L=L, M=M,
                                           interpret=interpret, platform=platform, block_v=block_v)

    def reference(self, q_u, bd, k_hat, z, v, C, *st, L, M, block_v):
        return vq_cache.vq_cache_attention_reference(q_u, bd, k_hat, z, v, C, self._state(*st), L=L, M=M)

    def unsupported_reasons(self, platform, shape, dtype):
        return vq_cache.unsupported_reasons(platform, L=shape["L"], M=shape["M"], S=shape["S"], Dk=shape["Dk"],
                                            Dv=shape["Dv"], dtype=dtype)

    def export_disabled_checks(self, platform):
        return [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")] if platform == "cuda" else []


# -- VMEM budget at the paper's shapes (Transformer-VQ enwik8: Dv = 1536; PG-19: Dv = 4096; L = S = 512, Dk = 128)
@pytest.mark.parametrize("Dv", [1536, 4096])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vmem_fits_at_paper_shapes_by_tiling_dv(Dv, dtype):
    tv, need = vq_cache.choose_block_v(L=512, S=512, Dk=128, Dv=Dv, in_dtype=dtype)
    assert tv is not None and Dv % tv == 0 and tv % 128 == 0
    assert need <= vq_cache.VMEM_LIMIT_BYTES
    assert vq_cache.unsupported_reasons("tpu", L=512, M=512, S=512, Dk=128, Dv=Dv, dtype=dtype) == []
    # a packed row's kernels (document arrays; pass 1's extra key block, value tile and (L, L) scratch) fit too
    assert vq_cache.unsupported_reasons("tpu", L=512, M=512, S=512, Dk=128, Dv=Dv, dtype=dtype, packed=True) == []
    assert vq_cache.vmem_bytes("bwd1", L=512, S=512, Dk=128, Dv=Dv, tv=tv, in_dtype=dtype, packed=True) > \
        vq_cache.vmem_bytes("bwd1", L=512, S=512, Dk=128, Dv=Dv, tv=tv, in_dtype=dtype)
    # without Dv tiling (one Dv-wide block) the forward + backward kernels would not fit: the tiling makes them fit
    untiled = max(vq_cache.vmem_bytes(k, L=512, S=512, Dk=128, Dv=Dv, tv=Dv, in_dtype=dtype)
                  for k in ("fwd", "bwd1", "bwd2"))
    assert untiled > vq_cache.VMEM_LIMIT_BYTES


def test_vmem_estimate_counts_the_block_specs():
    """The estimate is 2 × (in + out blocks) + scratch + temporaries; one more Dv tile column costs what the
    (L, tv) and (S, tv) blocks and the [S, Dv] scratch say."""
    kw = dict(L=512, S=512, Dk=128, Dv=1024)
    a = vq_cache.vmem_bytes("fwd", tv=256, **kw)
    b = vq_cache.vmem_bytes("fwd", tv=512, **kw)
    # v_prev, v_pres, mu0 (in) and o, mu_fin (out) grow by 256 columns each, double-buffered; acc temp too
    per = 4 * 256
    assert b - a == 2 * (2 * 512 * per + 512 * per + 512 * per + 512 * per) + 512 * per


def test_refusals_name_their_reasons():
    r = vq_cache.unsupported_reasons("tpu", L=512, M=512, S=4096, Dk=128, Dv=4096, dtype=jnp.float32)
    assert len(r) == 1 and "VMEM estimate" in r[0] and "MiB" in r[0] and "S=4096" in r[0]
    assert any("no rocm lowering" in s for s in vq_cache.unsupported_reasons("rocm", L=8, M=8, S=6, Dk=8, Dv=8))
    # 'cuda' answers with the GPU form's reasons (Triton tiles), no longer a missing lowering
    assert any("block_len % 16" in s for s in vq_cache.unsupported_reasons("cuda", L=8, M=8, S=6, Dk=8, Dv=8))
    assert any("mem_len <= block_len" in s for s in vq_cache.unsupported_reasons("interpret", L=4, M=8, S=6, Dk=8,
                                                                                Dv=8))
    assert any("float64" in s for s in vq_cache.unsupported_reasons("interpret", L=8, M=8, S=6, Dk=8, Dv=8,
                                                                     dtype=jnp.float64))
    args, static = TestVQCache().make_inputs(TestVQCache.SHAPES["ragged_fresh"], jnp.float32)
    with pytest.raises(ValueError, match="interpret"):
        TestVQCache().kernel(*args, interpret=False, platform="cpu", **static)


def test_core_impl_pallas_equals_xla_with_a_warning():
    """transformer_vq with impl='pallas' runs this kernel (interpret mode on CPU, with a warning) and gives the
    output of its XLA block-parallel implementation (impl='parallel'), carried state included."""
    from flax import nnx

    from longctx import attention

    def build(impl):
        cfg = attention.default_config("transformer_vq")
        cfg.update({"impl": impl, "codebook_size": 16, "block_len": 16})  # 16: a GPU compiles it too
        return attention.build("transformer_vq", cfg, num_heads=2, head_dim=16, causal=True, rngs=nnx.Rngs(0))

    ks = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(kk, (1, 2, 20, 16)) for kk in ks)
    def jitted(core):  # an eager call (interpret mode above all) dispatches op by op
        return jax.jit(lambda q, k, v: core(q, k, v))

    ref, ref_state = jitted(build("parallel"))(q, k, v)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, state = jitted(build("pallas"))(q, k, v)  # warns while tracing
    # CPU runs the kernel in interpret mode and says so; an accelerator compiles it
    assert any("interpret" in str(w.message) for w in caught) == (jax.default_backend() == "cpu")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=1e-5)


# -- packed rows (segment ids): the TPU form restarts the cache it folds at documents (xla.kernel_documents)
# T = 22, L = 4: documents open mid-block and at a block edge, one spans exactly a block, the fold restarts with
# another document's cache in it, and the dk̂ windows reach two row blocks back
PACKED_ROWS = ([5, 10, 7], [12, 4, 6])


def _packed_call(M: int, carried: bool):
    """(q_u, bd, k̂, v, band_k, band_v, agg_mu), the codes, codebook and segment ids, and the rest of the carried
    state with ``seen`` and ``continues`` (row 0 continues a carried document of 7 tokens where ``carried``)."""
    from longctx.attention.base import continues_state
    from longctx.attention.transformer_vq import xla

    B, Dk, Dv, S, T = 2, 8, 8, 5, 22
    seg = jnp.asarray(np.stack([np.repeat(np.arange(1, 4), r) for r in PACKED_ROWS]), jnp.int32)
    rng = np.random.default_rng(11 + M)
    n = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32))  # noqa: E731
    C = n(H, S, Dk)
    k_hat, z, _, _ = xla.stvq(n(B, H, T, Dk), C)
    band_k, band_z, _, _ = xla.stvq(n(B, H, M, Dk), C)  # the band's keys are its codes' codewords
    diff = (n(B, H, T, Dk), 0.3 * n(B, H, T, M + 1), k_hat, n(B, H, T, Dv), band_k, n(B, H, M, Dv), n(B, H, S, Dv))
    rest = {"pos": jnp.int32(7), "band_z": band_z, "agg_n": jnp.asarray(rng.integers(0, 3, (B, H, S)), jnp.float32)}
    doc = jnp.array([1, 0] if carried else [0, 0], jnp.int32)
    seen = jnp.where(doc > 0, 7, 0).astype(jnp.int32)
    return diff, (z, C, seg), (rest, seen, continues_state(doc, seg))


def test_kernel_documents_restart_the_cache_at_documents():
    """``xla.kernel_documents`` on row 0 of :data:`PACKED_ROWS` (documents at 0, 5, 15; L = 4, M = 3), continuing a
    carried document of 7 tokens: which queries read their block's cache (block n: its first token's document began
    before row block n-1, or is the carried one), which folds continue the running cache (extended block 0 is the
    band), the band's valid slots and the windows' starts (extended positions)."""
    from longctx.attention.transformer_vq import xla

    seg = jnp.asarray(np.repeat(np.arange(1, 4), PACKED_ROWS[0])[None], jnp.int32)
    docs = jax.jit(functools.partial(xla.kernel_documents, L=4, M=3))  # one compile, not op-by-op dispatch
    d = docs(jnp.array([7]), jnp.arange(22)[None] < 5, segment_ids=seg)
    qdocs, kdocs = np.asarray(d["qdocs"][0]), np.asarray(d["kdocs"][0])
    assert qdocs.shape == (24, 3) and kdocs.shape == (7, 3, 4) and bool(d["first"][0])
    assert qdocs[:, 0].tolist() == [0] * 5 + [5] * 10 + [15] * 9  # the padding joins the last document
    assert qdocs[:, 1].tolist() == [1] * 5 + [0] * 7 + [1] * 3 + [0] * 5 + [1] * 4
    assert kdocs[:, 2, 0].tolist() == [1, 1, 0, 1, 0, 1, 1] and bool(np.all(kdocs[:, 2] == kdocs[:, 2, :1]))
    assert kdocs[0, 0].tolist() == [-1, 0, 0, 0] and kdocs[0, 1].tolist() == [0, 1, 1, 1]  # the band: 3 valid slots
    assert kdocs[2, 1].tolist() == [0, 1, 1, 1]  # row block 1's fold takes its last document's keys
    assert kdocs[6, 0].tolist() == [15, 15, -1, -1] and kdocs[6, 1].tolist() == [1, 1, 0, 0]  # padding keys
    assert qdocs[[3, 4, 8, 9, 14, 19], 2].tolist() == [0, 4, 5, 9, 13, 19]


@pytest.mark.slow
@pytest.mark.parametrize("M,carried,block_v,dtype", [(3, False, 4, jnp.float32), (4, True, 8, jnp.float32),
                                                     (3, True, 4, jnp.bfloat16)])
def test_packed_rows_equal_the_packed_xla_form(M, carried, block_v, dtype):
    """A packed row through the TPU form in interpret mode (``packed``: ``xla.kernel_documents``' arrays) equals the
    packed one-shot XLA form (``xla.causal_packed``, every document on its own grid): the output and the gradients
    of q_u, the band scores, k̂ and v, and of the carried band and cache means where row 0 continues the carried
    document (two Dv tiles, or one)."""
    from longctx.attention.transformer_vq import xla

    (z, C, seg), (rest, seen, cont) = _packed_call(M, carried)[1:]
    diff = _packed_call(M, carried)[0]
    assert bool(cont[0, 0]) == carried and not bool(cont[1, 0])
    w = jnp.asarray(np.random.default_rng(5).standard_normal(diff[0].shape[:3] + (8,), dtype=np.float32))

    def loss(kernel, q_u, bd, k_hat, v, band_k, band_v, agg_mu):
        state = {**rest, "band_k": band_k, "band_v": band_v, "agg_mu": agg_mu}
        if kernel:
            packed = xla.kernel_documents(seen, cont, L=4, M=M, segment_ids=seg)
            o, new = vq_cache.vq_cache_attention(q_u, bd, k_hat, z, v, C.astype(dtype), state, L=4, M=M,
                                                 interpret=True, platform="tpu", block_v=block_v, packed=packed)
            assert new is None  # the caller forms a packed row's state
        else:
            o = xla.causal_packed(q_u, bd, k_hat, z, v, C, L=4, M=M, segment_ids=seg, state=state, seen=seen,
                                  continues=cont)
        return jnp.sum(o.astype(jnp.float32) * w), o

    def run(kernel, cast):
        args = tuple(x.astype(cast) if i != 1 and i != 6 else x for i, x in enumerate(diff))
        f = jax.value_and_grad(functools.partial(loss, kernel), argnums=tuple(range(7)), has_aux=True)
        (_, o), g = jax.jit(f)(*args)
        return (o,) + tuple(g)

    got, want = run(True, dtype), run(False, jnp.float32)
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    names = ("o", "dq_u", "dbd", "dk_hat", "dv", "dband_k", "dband_v", "dagg_mu")
    for name, a, b in zip(names, got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = float(np.abs(b).max())
        if name in names[5:] and not carried:  # no document continues the state: nothing reaches it
            assert scale == 0 and float(np.abs(a).max()) == 0, name
            continue
        assert scale > 0 and float(np.abs(a - b).max()) <= tol * max(scale, 1.0), name


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_packed_row_lowers(platform):
    """A packed row (two documents a row, one opening mid-block; row 0 continuing a carried one) lowers with
    ``jax.export`` for TPU (the TPU form with ``xla.kernel_documents``' arrays: three Mosaic kernels) and CUDA (the GPU
    form with ``xla.kernel_packed``'s), forward and gradient, with the kernels in the module."""
    from kernel_test_base import verified_triton_modules

    from longctx.attention.base import continues_state
    from longctx.attention.transformer_vq import xla

    shape = TestVQCache.SHAPES["tpu_blocks"]
    args, static = make_vq_inputs({**shape, "warm": 140}, jnp.float32)
    L, M, S = static["L"], static["M"], shape["S"]
    seg = jnp.asarray(np.stack([np.repeat([1, 2], r) for r in ([100, 156], [128, 128])]), jnp.int32)
    seen, cont = jnp.array([140, 0], jnp.int32), continues_state(jnp.array([1, 0], jnp.int32), seg)
    assert vq_cache.unsupported_reasons(platform, L=L, M=M, S=S, Dk=shape["Dk"], Dv=shape["Dv"], packed=True) == []

    def fwd(q_u, bd, k_hat, v, *rest):
        z, C, st = rest[0], rest[1], TestVQCache._state(*rest[2:])
        st = {k: jnp.concatenate([x, x]) if k != "pos" else x for k, x in st.items()}  # B = 2 rows
        if platform == "tpu":
            packed = xla.kernel_documents(seen, cont, L=L, M=M, segment_ids=seg)
        else:
            packed = xla.kernel_packed(z, v, st, seen, cont, L=L, M=M, S=S, segment_ids=seg)
        return vq_cache.vq_cache_attention(q_u, bd, k_hat, z, v, C, st, L=L, M=M, platform=platform,
                                           block_v=static["block_v"], packed=packed)[0]

    two = lambda x: jnp.concatenate([x, x])  # noqa: E731
    q_u, bd, k_hat, z, v, C, *st = args
    diff, rest = (two(q_u), two(bd), two(k_hat), two(v)), (two(z), C, *st)
    disabled = TestVQCache().export_disabled_checks(platform)
    marker = "tpu_custom_call" if platform == "tpu" else "triton"
    with verified_triton_modules() as triton:
        exp = jax.export.export(jax.jit(fwd), platforms=[platform], disabled_checks=disabled)(*diff, *rest)
        grad = jax.grad(lambda *d: jnp.sum(jnp.sin(fwd(*d, *rest))), argnums=(0, 1, 2, 3))
        exp_b = jax.export.export(jax.jit(grad), platforms=[platform], disabled_checks=disabled)(*diff)
    n_fwd = exp.mlir_module().count(marker)
    assert n_fwd > 0 and exp_b.mlir_module().count(marker) > n_fwd
    if platform == "cuda" and triton is not None:
        assert triton and not [name for name, err in triton if err]
