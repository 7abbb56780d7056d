"""The Mosaic GPU form of the Transformer-VQ compressive VQ-cache kernel (pallas_kernels/vq_cache_mgpu.py: a
``plgpu.kernel`` forward, the Triton form's backward kernels) on the shared kernel test base, in Mosaic GPU's
interpret mode on a CPU (``InterpretGPUParams``: simulated shared memory, TMA, barriers, wgmma; the Triton backward
in Pallas interpret mode): values, final state and gradients against the §2.6 serial reference and its autodiff
(ragged T, carried state, M < L, several query tiles per block, several code chunks, one and several value-width
slices, float32 and bfloat16); the band-bias table the kernel reads; the refusals; ``jax.export`` for cuda at the
enwik8 config's shapes (L = M = S = 512, Dk = 128, Dv = 1536: the Mosaic GPU lowering runs on this CPU host), and
bfloat16 reaching every wgmma.

Interpret mode takes 10-110 s a case here (on two shared cores): the default suite runs two of them
(:meth:`TestVQCacheMosaicGPU.default_cases`), ``-m slow`` the rest."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_test_base import weighted_sum  # noqa: I001
from test_fma_blocks_mgpu import _equations  # every equation of a jaxpr, kernel bodies included
from test_vq_cache import VQCacheKernelCases, make_vq_inputs

from pallas_kernels import vq_cache_mgpu, vq_cache_ref

# small tiles (interpret mode takes any tile dividing L): L = 32 in two query tiles of 16, S = 24 (or 20) padded to
# two code chunks of 16, Dk = 16, Dv = 32 in two value-width slices of 16 (or one of 32)
TINY = dict(L=32, S=24, Dk=16, Dv=32, block_q=16, block_v=16, state_dtype="input")
ENWIK8 = dict(T=1024, L=512, M=512, S=512, Dk=128, Dv=1536, warm=0, state_dtype="input")  # configs/enwik8
DEFAULT = {("forward", ("cuda_tiles_ragged", "bfloat16")), ("grad", ("cuda_tiles_ragged", "bfloat16"))}


class TestVQCacheMosaicGPU(VQCacheKernelCases):
    SHAPES = {
        "ragged_fresh": dict(TINY, T=80, M=32, warm=0),  # empty cache and band: fully masked code chunks
        "short_band_ragged": dict(TINY, T=75, M=21, S=20, warm=53),  # carried cache, partly valid band
        "one_slice_carried": dict(TINY, T=64, M=32, warm=45, block_v=32),  # one value-width slice
        # the cuda tiles (64 rows, Dv = 128 in two value slices of 64) in interpret mode: two query tiles a block,
        # M < L (tile pairs wholly outside the band), two code chunks, a carried cache
        "cuda_tiles_ragged": dict(T=200, L=128, M=80, S=100, Dk=64, Dv=128, block_v=64, warm=90,
                                  state_dtype="input"),
    }
    FORWARD_CASES = (("short_band_ragged", "float32"), ("ragged_fresh", "bfloat16"), ("ragged_fresh", "float32"),
                     ("short_band_ragged", "bfloat16"), ("one_slice_carried", "float32"),
                     ("one_slice_carried", "bfloat16"), ("cuda_tiles_ragged", "bfloat16"))
    GRAD_CASES = (("cuda_tiles_ragged", "bfloat16"), ("short_band_ragged", "bfloat16"),
                  ("short_band_ragged", "float32"), ("ragged_fresh", "float32"), ("one_slice_carried", "bfloat16"))
    EXPORT_PLATFORMS = ()  # cuda's lowering is tested below (a Mosaic GPU custom call, not the base's markers)
    # bf16 storage rounds μ̄, the probabilities (P·V, P·μ̄ operands) and dO to bf16 (about 2^-9 relative); the
    # reference is fp32 throughout (given the same bf16 codebook the layer passes). fp32 matches to fp32 rounding.
    TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (2e-3, 2e-3)}

    def default_cases(self, kind, cases):
        return {c for c in cases if (kind, c) in DEFAULT}

    def make_inputs(self, shape, dtype):
        """The shared inputs, the codebook in the compute dtype (the layer passes it so; the kernel's products
        take one operand dtype)."""
        args, static = make_vq_inputs(shape, dtype)
        args = args[:5] + (args[5].astype(dtype),) + args[6:]
        return args, static

    def kernel(self, q_u, bd, k_hat, z, v, C, *st, interpret, platform="cuda", L, M, block_q=None, block_v=None):
        return vq_cache_mgpu.vq_cache_attention(q_u, bd, k_hat, z, v, C, self._state(*st), L=L, M=M,
                                                interpret=interpret, block=block_q, block_v=block_v)

    def reference(self, q_u, bd, k_hat, z, v, C, *st, L, M, **_):
        return vq_cache_ref.vq_cache_attention_reference(q_u, bd, k_hat, z, v, C, self._state(*st), L=L, M=M)


def test_band_table_holds_the_skewed_band():
    """``SK[i, E - base + b] = bd[i, base + a - b]`` (``a = i mod t``) for every tile distance ``base`` (a multiple
    of t) and in-band distance, 0 elsewhere (the spare box included): the box the kernel reads is the band bias of
    that tile pair."""
    t, M, RL = 4, 6, 12
    bd = jnp.asarray(np.random.default_rng(0).standard_normal((2, RL, M + 1)), jnp.float32)
    sk = np.asarray(vq_cache_mgpu.band_table(bd, M=M, t=t))
    E = vq_cache_mgpu.band_width(M, t)
    assert E == 8 and sk.shape == (2, RL, E + 2 * t)
    bd = np.asarray(bd)
    seen = np.zeros(sk.shape, bool)
    for i in range(RL):
        a = i % t
        for base in range(0, E + 1, t):
            for b in range(t):
                d = base + a - b
                expect = bd[:, i, d] if 0 <= d <= M else 0.0
                np.testing.assert_array_equal(sk[:, i, E - base + b], expect)
                seen[:, i, E - base + b] |= 0 <= d <= M
    assert not np.any(sk[~seen])  # nothing outside the band


def test_unsupported_reasons():
    r = vq_cache_mgpu.unsupported_reasons
    paper = dict(L=512, M=512, S=512, Dk=128)
    assert r("cuda", **paper, Dv=1536, dtype=jnp.bfloat16, compute_capability="9.0") == []
    assert r("cuda", **paper, Dv=4096, dtype=jnp.bfloat16) == []
    assert r("interpret", L=32, M=21, S=20, Dk=16, Dv=32, dtype=jnp.float32, block=16) == []
    assert any("Hopper" in x for x in r("cuda", **paper, Dv=1536, dtype=jnp.bfloat16, compute_capability=(8, 0)))
    assert any("tf32" in x for x in r("cuda", **paper, Dv=1536, dtype=jnp.float32))
    assert any("multiple of 64" in x for x in r("cuda", L=96, M=96, S=64, Dk=128, Dv=128, dtype=jnp.bfloat16))
    assert any("key dim" in x for x in r("cuda", L=64, M=64, S=64, Dk=48, Dv=128, dtype=jnp.bfloat16))
    assert any("value dim" in x for x in r("cuda", L=64, M=64, S=64, Dk=64, Dv=96, dtype=jnp.bfloat16))
    assert any("not tpu" in x for x in r("tpu", **paper, Dv=1536, dtype=jnp.bfloat16))
    assert any("mem_len" in x for x in r("interpret", L=32, M=40, S=20, Dk=16, Dv=32, block=16))
    assert any("must divide" in x for x in r("interpret", L=32, M=32, S=20, Dk=16, Dv=32, block=12))
    assert vq_cache_mgpu.value_slice(1536) == 256 and vq_cache_mgpu.value_slice(64) == 64
    assert vq_cache_mgpu.value_slice(320) == 64 and vq_cache_mgpu.value_slice(256, vq_cache_mgpu.TV_BACKWARD) == 128


def test_smem_estimate():
    """The shared-memory estimate per kernel: every kernel of the paper's shapes within an SM; the backward's dP pass
    at the forward's 256-wide slices would not be (why the backward takes slices of at most 128); the forward's
    estimate at Dk = 128, tv = 256 counts the query tile, P and the two-slot ring of the key pipeline."""
    est = vq_cache_mgpu.smem_bytes(128, 256)
    assert max(est.values()) <= vq_cache_mgpu.SMEM_LIMIT_BYTES
    assert est["fwd"] == 64 * 128 * 2 + 64 * 64 * 2 + 2 * ((128 * 64 + 64 * 256) * 2 + 64 * 64 * 4 + 64 * 4)
    wide = vq_cache_mgpu.smem_bytes(128, 256, tv_b=256)
    assert wide["dq"] > vq_cache_mgpu.SMEM_LIMIT_BYTES and wide["dkv"] > vq_cache_mgpu.SMEM_LIMIT_BYTES
    assert any("shared memory" in x for x in vq_cache_mgpu.unsupported_reasons(
        "cuda", L=512, M=512, S=512, Dk=256, Dv=1536, dtype=jnp.bfloat16))


def test_compiled_refusal_names_reasons():
    """Compiled (not interpret): float32 operands and a block length off the 64-row tiles raise with reasons."""
    shape = dict(T=96, L=96, M=96, S=64, Dk=64, Dv=64, warm=0)
    args, _ = make_vq_inputs(shape, jnp.float32)
    st = TestVQCacheMosaicGPU._state(*args[6:])
    with pytest.raises(ValueError, match="cannot run") as info:
        vq_cache_mgpu.vq_cache_attention(*args[:6], st, L=96, M=96, interpret=False)
    assert "tf32" in str(info.value) and "multiple of 64" in str(info.value)


def _export(shape):
    """(forward, gradient) of the kernel on bf16 inputs of ``shape`` exported for cuda: their MLIR texts."""
    args, _ = make_vq_inputs(shape, jnp.bfloat16)
    args = args[:5] + (args[5].astype(jnp.bfloat16),) + args[6:]

    def forward(*a):
        return vq_cache_mgpu.vq_cache_attention(*a[:6], TestVQCacheMosaicGPU._state(*a[6:]), L=shape["L"],
                                                M=shape["M"], interpret=False)[0]

    diff = (0, 1, 2, 4, 8, 9, 10)

    def loss(*d):
        full = list(args)
        for i, x in zip(diff, d):
            full[i] = x
        return weighted_sum(forward(*full))

    exp = jax.export.export(jax.jit(forward), platforms=["cuda"])(*args)
    exp_b = jax.export.export(jax.jit(jax.grad(loss, argnums=tuple(range(len(diff))))), platforms=["cuda"])(
        *(args[i] for i in diff))
    return exp.mlir_module(), exp_b.mlir_module()


def test_export_cuda_enwik8():
    """``jax.export`` for cuda at the enwik8 config's shapes (bf16): the forward is one ``mosaic_gpu`` custom call
    (the Mosaic GPU lowering runs on this CPU host and checks each kernel's shared memory against the device's
    limit; no GPU compiles or runs it), its gradient adds the three backward kernels; no ``[.., L, 2L]`` or
    ``[.., 2L, 2L]`` array in either program."""
    text, text_b = _export(ENWIK8)
    assert text.count("@mosaic_gpu") == 1 and "triton" not in text
    assert text_b.count("@mosaic_gpu") == 4 and "triton" not in text_b  # forward, dq, dk/dv, dμ̄
    assert not re.search(r"x512x1024x|x1024x1024x", text + text_b)


@pytest.mark.slow
def test_export_cuda_pg19():
    """PG-19's value width (Dv = 4096: 16 forward slices of 256, 32 backward slices of 128) lowers as well."""
    text, text_b = _export(dict(ENWIK8, Dv=4096))
    assert text.count("@mosaic_gpu") == 1 and text_b.count("@mosaic_gpu") == 4


def test_bf16_reaches_every_wgmma():
    """Forward and backward on bfloat16 inputs: every wgmma (the kernels' matmuls) takes bfloat16 operands into a
    float32 accumulator. (tests/attention/test_compute_dtype.py reads ``dot_general`` and ``pallas_call``; a Mosaic
    GPU kernel traces to ``wgmma_ref`` products, read here.)"""
    case = TestVQCacheMosaicGPU()
    args, static = case.make_inputs(case.SHAPES["short_band_ragged"], jnp.bfloat16)
    diff = (0, 1, 2, 4, 8, 9, 10)

    def loss(*d):
        full = list(args)
        for i, x in zip(diff, d):
            full[i] = x
        return weighted_sum(case.kernel(*full, interpret=True, **static))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(len(diff)))))(*(args[i] for i in diff)).jaxpr
    products = [e for e in _equations(jaxpr) if e.primitive.name == "wgmma_ref"]
    # forward: S and P·W for the codes, the previous and the present block (6); dq: S, dP, dS·k per key group (9);
    # dk/dv: Sᵀ, dPᵀ, dSᵀ·q, then Sᵀ, Pᵀ·dO (5); dμ̄: Sᵀ, Pᵀ·dO (2)
    assert len(products) == 6 + 9 + 5 + 2
    found = {tuple(str(v.aval.dtype) for v in e.invars[:3]) for e in products}
    assert found == {("float32", "bfloat16", "bfloat16")}, found
