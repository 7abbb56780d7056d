"""EVA's Phase A as Pallas Mosaic GPU kernels (pallas_kernels/eva_chunks_mgpu.py) in Mosaic GPU's interpret mode on
a CPU (``interpret=InterpretGPUParams()``: simulated shared memory, TMA, barriers, wgmma): ``k̂`` and ``β`` against
the pure-JAX reference ``eva_chunks_ref.chunk_summaries`` in float32 and bfloat16 (the Triton kernel test's
operands: option variants, ragged lengths, with and without noise, a packed row's chunk members); the gradients
(the token-level backward kernel with the chunk-level VJP) in q, k, v, the parameters and the noise against
autodiff of the reference; bfloat16 reaching every wgmma; the refusals; and ``jax.export`` of forward and gradient
for ``cuda`` (the Mosaic GPU lowering runs on a CPU host) at configs/wikitext103/eva_16l.py's shapes (chunk 8,
heads of 128, 512 tokens), no Triton call in the module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from kernel_test_base import assert_close, mosaic_gpu_mode, weighted_sum  # noqa: I001
from test_eva_attend_mgpu import _export_count  # forward/gradient custom calls, no Triton
from test_eva_chunks import TestEVAChunkStats as _TritonTest  # not collected here: the alias does not match Test*
from test_fma_blocks_mgpu import _equations

from pallas_kernels import eva_chunks_mgpu, eva_chunks_ref

TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (2e-5, 2e-5)}  # the Triton kernel's: the reference's precision
# chunks straddling two token tiles under bfloat16: the weights cast relative to the first tile's running max, then
# rescaled (pallas_kernels/eva_chunks_mgpu.py's departures): a bfloat16 rounding, not the reference's
STRADDLE_BF16 = (2e-3, 2e-3)
GRAD_TOLERANCES = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2)}
SHAPES = dict(_TritonTest.SHAPES)
# chunks straddling two 64-token tiles (P = 6 does not divide 64) over two chunk tiles (C = 70 > 64)
SHAPES["straddle_70x6"] = dict(C=70, P=6, L=415, dv=16, noise=True)
SLOW = pytest.mark.slow  # interpret mode: ~10-20 s a case; the default suite runs one forward, one gradient


def make_inputs(name, dtype):
    return _TritonTest().make_inputs(SHAPES[name], dtype)



def _kernel(args, static, interpret=None):
    return eva_chunks_mgpu.eva_chunk_stats_mgpu(*args, **static,
                                               interpret=mosaic_gpu_mode(interpret, args[0].dtype))


def _reference(args, static):
    return eva_chunks_ref.chunk_summaries(*args, **static)


@pytest.mark.parametrize("case", [
    ("ragged_5x4_noise", "float32"),
    pytest.param(("ragged_5x4_noise", "bfloat16"), marks=SLOW),
    pytest.param(("noln_half_principled_16x8", "float32"), marks=SLOW),
    pytest.param(("identity_tiny_3x8", "float32"), marks=SLOW),
    pytest.param(("mu_none_5x4_dv8", "float32"), marks=SLOW),
    pytest.param(("straddle_70x6", "float32"), marks=SLOW),
    pytest.param(("straddle_70x6", "bfloat16"), marks=SLOW),
    pytest.param(("rows_5x4", "float32"), marks=SLOW),
    pytest.param(("rows_5x4", "bfloat16"), marks=SLOW),
], ids=lambda c: f"{c[0]}-{c[1]}")
def test_forward_matches_reference(case):
    """k̂ and β (f32) against the reference on the same operands."""
    name, dt = case
    args, static = make_inputs(name, jnp.dtype(dt))
    out = jax.jit(lambda a: _kernel(a, static))(args)
    ref = _reference(args, static)
    for o, r, what in zip(out, ref, ("k_hat", "beta")):
        assert o.dtype == jnp.float32 and o.shape == r.shape
        assert float(jnp.max(jnp.abs(r))) > 1e-1
        assert_close(r, o, STRADDLE_BF16 if name.startswith("straddle") and dt == "bfloat16" else TOLERANCES[dt],
                     f"{name}/{dt} {what}")


def _grads(args, fn):
    """Gradients of a weighted sum of ``(k̂, β)`` in q, k, v, the parameters and the noise: the leaves."""
    diff = (0, 1, 2, 4, 5)

    def loss(d):
        full = list(args)
        for i, x in zip(diff, d):
            full[i] = x
        return weighted_sum(fn(tuple(full)))

    return jax.tree.leaves(jax.jit(jax.grad(loss))(tuple(args[i] for i in diff)))


@pytest.mark.parametrize("case", [
    pytest.param(("ragged_5x4_noise", "float32"), marks=SLOW),
    ("ragged_5x4_noise", "bfloat16"),
    pytest.param(("noln_half_principled_16x8", "float32"), marks=SLOW),
    pytest.param(("noln_half_principled_16x8", "bfloat16"), marks=SLOW),
    pytest.param(("identity_tiny_3x8", "float32"), marks=SLOW),
    pytest.param(("mu_none_5x4_dv8", "float32"), marks=SLOW),
    pytest.param(("straddle_70x6", "float32"), marks=SLOW),
    pytest.param(("rows_5x4", "float32"), marks=SLOW),
    pytest.param(("rows_5x4", "bfloat16"), marks=SLOW),
], ids=lambda c: f"{c[0]}-{c[1]}")
def test_gradient_matches_autodiff_of_reference(case):
    """The kernel VJP (token-level backward kernel, chunk-level autodiff in XLA) against autodiff of the
    reference."""
    name, dt = case
    args, static = make_inputs(name, jnp.dtype(dt))
    g_ker = _grads(args, lambda a: _kernel(a, static))
    g_ref = _grads(args, lambda a: _reference(a, static))
    assert len(g_ker) == len(g_ref)
    for i, (r, g) in enumerate(zip(g_ref, g_ker)):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert_close(r.astype(jnp.float32), g.astype(jnp.float32), GRAD_TOLERANCES[dt], f"{name}/{dt} leaf {i}")
    # k and v always matter (q does not where µ = 0: adaptive_proj='none')
    assert all(float(jnp.max(jnp.abs(r.astype(jnp.float32)))) > 1e-2 for r in g_ref[1:3]), "k, v gradients ~0"


def test_unsupported_reasons():
    r = eva_chunks_mgpu.unsupported_reasons
    assert r("cuda", P=8, d=128, dv=128, dtype=jnp.bfloat16) == []
    assert r("cuda", P=6, d=64, dv=64, dtype=jnp.bfloat16, compute_capability="9.0") == []  # any chunk size
    assert r("interpret", P=4, d=16, dv=8, dtype=jnp.float32) == []
    assert any("Hopper" in x for x in r("cuda", P=8, d=128, dv=128, compute_capability=(8, 0)))
    assert any("multiples of 64" in x for x in r("cuda", P=8, d=16, dv=16))
    assert any("tf32" in x for x in r("cuda", P=8, d=128, dv=128, dtype=jnp.float32))
    assert any("cuda" in x for x in r("tpu", P=8, d=128, dv=128))
    args, static = make_inputs("ragged_5x4_noise", jnp.float32)
    with pytest.raises(ValueError, match="cannot run") as info:
        _kernel(args, static, interpret=False)
    assert "tf32" in str(info.value) and "multiples of 64" in str(info.value)


@pytest.mark.parametrize("name", ["wt103_paper", pytest.param("export_rows_16x8", marks=SLOW)])
def test_export_cuda(name):
    """``jax.export`` for cuda lowers the kernels through Pallas' Mosaic GPU lowering on this CPU host (no GPU
    compiles or runs them here; the lowering checks shared memory): the forward is one ``mosaic_gpu`` custom call,
    its gradient two (forward with residuals, token-level backward), no Triton; a packed row's chunk members too."""
    shape = SHAPES[name]
    if name != "wt103_paper":  # heads of 64, the smallest the cuda kernels take
        shape = dict(shape, d=64, dv=64)
    args, static = _TritonTest().make_inputs(shape, jnp.bfloat16)
    assert _export_count(lambda *a: _kernel(a, static, interpret=False), args) == 1

    def loss(q, k, v, p, n):
        return weighted_sum(_kernel((q, k, v, args[3], p, n), static, interpret=False))

    assert _export_count(jax.grad(loss, argnums=tuple(range(5))), args[:3] + args[4:]) == 2


def test_bf16_reaches_every_wgmma():
    """Forward and backward on bfloat16 operands: every wgmma takes bfloat16 operands into a float32 accumulator
    (tests/attention/test_compute_dtype.py reads ``dot_general`` and ``pallas_call``; a Mosaic GPU kernel traces to
    ``wgmma_ref`` products, read here)."""
    args, static = make_inputs("ragged_5x4_noise", jnp.bfloat16)

    def loss(q, k, v, p, n):
        return weighted_sum(_kernel((q, k, v, args[3], p, n), static))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(5))))(*args[:3], *args[4:]).jaxpr
    products = [e for e in _equations(jaxpr) if e.primitive.name == "wgmma_ref"]
    # forward: S q, S k (means), k̄ A_k, q̄ A_q, ω kᵀ, P v; backward: k ωᵀ, v dβᵀ, a·dℓᵀ ω, wᵀ dβ, kᵀ (a·dℓᵀ)
    assert len(products) == 6 + 5
    found = {tuple(str(x.aval.dtype) for x in e.invars[:3]) for e in products}
    assert found == {("float32", "bfloat16", "bfloat16")}, found
