"""Transformer-VQ compressive VQ-cache Pallas kernels (docs/methods/transformer_vq.md §9) on the shared kernel test base:
forward, final state and the Pallas backward kernels against autodiff of the jnp §2.6 serial reference (ragged T,
carried state, M < L, Dv tiles, fp32 and bf16), TPU lowering (CUDA runs the GPU form, tested in
test_vq_cache_gpu.py; its lowering of these shapes is checked here too), the VMEM budget at the paper's shapes, and
the method running the kernel with impl='pallas'. :func:`make_vq_inputs` is shared with test_vq_cache_gpu.py."""

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
