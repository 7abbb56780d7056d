"""FMA multilevel-blocks forward as a Pallas Mosaic GPU kernel (pallas_kernels/fma_blocks_mgpu.py) in Mosaic GPU's
interpret mode on a CPU (``interpret=InterpretGPUParams()``: simulated shared memory, TMA, barriers, wgmma):
values against the pure-JAX reference ``fma_blocks_ref.attend_blocks`` (through the Triton kernel's layout helper
``fma_blocks._ref_blocks``) in float32 and bfloat16, causal and bidirectional, with and without packed coarse slots,
ragged lengths; the backward kernels' gradients (q, k, v and the summaries the slots index) against
autodiff of the reference; packed rows (the document of every query, key and coarse slot, ``docs``: values and
gradients against the reference given them); the refusals; and ``jax.export`` of forward and gradient for
``cuda`` (the Mosaic GPU lowering runs on a CPU host) at configs/enwik8/fma.py's shapes (m 64 and 128, heads of 64,
24 packed slots)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from kernel_test_base import assert_close, mosaic_gpu_mode, weighted_sum  # noqa: I001
from test_fma_blocks import TestFMABlocks as _TritonTest  # not collected here: the alias does not match Test*
from test_fma_blocks import packed_docs

from pallas_kernels import fma_blocks, fma_blocks_mgpu

BH = 1
TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (1e-2, 1e-2)}
GRAD_TOLERANCES = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2)}
SHAPES = {
    "causal_ragged": dict(n=192, m=64, d=64, dv=64, C=24, R=40, causal=True, n_valid=181),
    "bidir_ragged": dict(n=192, m=64, d=64, dv=128, C=70, R=80, causal=False, n_valid=170),
    "fine_only_bidir": dict(n=192, m=64, d=64, dv=64, C=0, R=0, causal=False, n_valid=150),
    "m128_causal": dict(n=256, m=128, d=64, dv=64, C=24, R=40, causal=True, n_valid=250),
    "enwik8_paper": dict(n=1024, m=64, d=64, dv=64, C=24, R=112, causal=True, n_valid=1024),
    "enwik8_n2048": dict(n=2048, m=128, d=64, dv=64, C=24, R=112, causal=True, n_valid=2048),
}


def make_inputs(shape, dtype, bh=BH):
    """The Triton kernel test's operands (tests/kernels/test_fma_blocks.py: random slot tables, a block with every
    slot masked, masked slots repeating rows), the first ``bh`` rows."""
    args, _ = _TritonTest().make_inputs(shape, dtype)
    return tuple(None if x is None else (x if i >= 5 else x[:bh]) for i, x in enumerate(args))



def _kernel(args, shape, interpret=None, docs=None):
    return fma_blocks_mgpu.fma_blocks_mgpu(*args, m=shape["m"], causal=shape["causal"], n_valid=shape["n_valid"],
                                           interpret=mosaic_gpu_mode(interpret, args[0].dtype), docs=docs)


def _reference(args, shape, docs=None):
    return fma_blocks._ref_blocks(*args, shape["m"], shape["causal"], shape["n_valid"], 1 << 24, docs=docs)


SLOW = pytest.mark.slow  # the default suite: each direction, dtype and tile once (interpret mode: ~10-20 s a case)


@pytest.mark.parametrize("case", [
    ("causal_ragged", "float32"),
    pytest.param(("causal_ragged", "bfloat16"), marks=SLOW),
    ("bidir_ragged", "bfloat16"),
    pytest.param(("fine_only_bidir", "float32"), marks=SLOW),
    pytest.param(("bidir_ragged", "float32"), marks=SLOW),
    ("m128_causal", "bfloat16"),
], ids=lambda c: f"{c[0]}-{c[1]}")
def test_forward_matches_reference(case):
    """Interpret mode vs the reference on the same operands (bf16 operands: the reference's products take them as
    bf16 too, P cast down before P V), the padded query rows included."""
    name, dt = case
    shape = SHAPES[name]
    args = make_inputs(shape, jnp.dtype(dt))
    out = _kernel(args, shape)
    ref = _reference(args, shape)
    assert out.dtype == jnp.dtype(dt) and out.shape == ref.shape
    assert float(jnp.max(jnp.abs(ref))) > 1e-2
    assert_close(ref, out.astype(jnp.float32), TOLERANCES[dt], f"{name}/{dt}")


def _grads(args, fn):
    """Gradients of a weighted sum of ``fn(args)`` in q, k, v and, with coarse slots, the summaries kall, vall."""
    n_diff = 3 if args[3] is None else 5

    def loss(*diff):
        return weighted_sum(fn(diff + args[n_diff:]))

    return jax.jit(jax.grad(loss, argnums=tuple(range(n_diff))))(*args[:n_diff])


@pytest.mark.parametrize("case", [
    pytest.param(("causal_ragged", "float32"), marks=SLOW),
    ("causal_ragged", "bfloat16"),
    ("fine_only_bidir", "float32"),
    pytest.param(("bidir_ragged", "float32"), marks=pytest.mark.slow),
    pytest.param(("bidir_ragged", "bfloat16"), marks=pytest.mark.slow),
], ids=lambda c: f"{c[0]}-{c[1]}")
def test_gradient_matches_autodiff_of_reference(case):
    """The kernel VJP (dq with the slot gradients, dk/dv: Mosaic GPU kernels) vs autodiff of the reference, the
    slot gradients reaching kall / vall through the gather's transpose."""
    name, dt = case
    shape = SHAPES[name]
    args = make_inputs(shape, jnp.dtype(dt))
    g_ker = _grads(args, lambda a: _kernel(a, shape))
    g_ref = _grads(args, lambda a: _reference(a, shape))
    for i, (r, g) in enumerate(zip(g_ref, g_ker)):
        assert g.dtype == jnp.dtype(dt)
        assert_close(r, g.astype(jnp.float32), GRAD_TOLERANCES[dt], f"{name}/{dt} d/d(arg {i})")
    assert all(float(jnp.max(jnp.abs(r))) > 1e-3 for r in g_ref)


@pytest.mark.parametrize("case", [
    ("causal_ragged", "float32"),
    pytest.param(("bidir_ragged", "bfloat16"), marks=SLOW),
    pytest.param(("fine_only_bidir", "float32"), marks=SLOW),
], ids=lambda c: f"{c[0]}-{c[1]}")
def test_packed_rows_match_reference(case):
    """Packed rows (docs/methods/fma.md §2.7): with the document of every query, key and slot, the kernels' output
    and gradients (q, k, v, the summaries) equal the reference given the same documents, which change the output."""
    name, dt = case
    shape = SHAPES[name]
    args = make_inputs(shape, jnp.dtype(dt), bh=2)
    docs = packed_docs(shape["n"], shape["m"], shape["C"], 2, seed=5)
    up = tuple(None if x is None else (x.astype(jnp.float32) if i < 5 else x) for i, x in enumerate(args))
    out = jax.jit(lambda a: _kernel(a, shape, docs=docs))(args)
    ref = _reference(up, shape, docs)
    assert float(jnp.max(jnp.abs(ref - _reference(up, shape)))) > 0.1  # the documents matter
    assert_close(ref, out.astype(jnp.float32), TOLERANCES[dt], f"packed {name}/{dt}")
    g_ker = _grads(args, lambda a: _kernel(a, shape, docs=docs))
    g_ref = _grads(up, lambda a: _reference(a, shape, docs))
    for i, (r, g) in enumerate(zip(g_ref, g_ker)):
        assert g.dtype == jnp.dtype(dt)
        assert_close(r, g.astype(jnp.float32), GRAD_TOLERANCES[dt], f"packed {name}/{dt} d/d(arg {i})")


def test_unsupported_reasons():
    r = fma_blocks_mgpu.unsupported_reasons
    assert r("cuda", m=64, d=64, dv=64, dtype=jnp.bfloat16) == []
    assert r("cuda", m=128, d=64, dv=64, dtype=jnp.bfloat16, compute_capability="9.0") == []
    assert any("shared memory" in x for x in r("cuda", m=64, d=256, dv=256, dtype=jnp.bfloat16))
    assert any("registers" in x for x in r("cuda", m=128, d=64, dv=128, dtype=jnp.bfloat16))
    # shared memory: the dq kernel's coarse phase at heads of 128 fits with one slot tile in flight, not two
    assert r("cuda", m=64, d=128, dv=128, dtype=jnp.bfloat16, coarse_slots=24) == []
    assert any("shared memory" in x for x in r("cuda", m=64, d=128, dv=128, dtype=jnp.bfloat16, coarse_slots=70))
    assert r("interpret", m=8, d=8, dv=8, dtype=jnp.float32) == []
    assert any("Hopper" in x for x in r("cuda", m=64, d=64, dv=64, compute_capability=(8, 0)))
    assert any("64-row" in x for x in r("cuda", m=32, d=64, dv=64))
    assert any("multiples of 64" in x for x in r("cuda", m=64, d=48, dv=64))
    assert any("tf32" in x for x in r("cuda", m=64, d=64, dv=64, dtype=jnp.float32))
    assert any("cuda" in x for x in r("tpu", m=64, d=64, dv=64))
    assert any("FMA-linear" in x for x in r("interpret", m=64, d=64, dv=64, coarse_kind="stats"))
    assert any("dropout" in x for x in r("cuda", m=64, d=64, dv=64, dropout=0.1))


@pytest.mark.parametrize("name", ["enwik8_paper", pytest.param("enwik8_n2048", marks=SLOW)])
def test_export_cuda(name):
    """``jax.export`` for cuda lowers the kernels through Pallas' Mosaic GPU lowering on this CPU host (no GPU
    compiles or runs them here): the forward is one ``mosaic_gpu`` custom call, its gradient three (forward, dq,
    dk/dv), no Triton."""
    shape = SHAPES[name]
    args = make_inputs(shape, jnp.bfloat16, bh=2)
    exp = jax.export.export(jax.jit(lambda *a: _kernel(a, shape, interpret=False)), platforms=["cuda"])(*args)
    text = exp.mlir_module()
    assert text.count("@mosaic_gpu") == 1 and "triton" not in text

    def loss(*diff):
        return weighted_sum(_kernel(diff + args[5:], shape, interpret=False))

    exp_b = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))), platforms=["cuda"])(*args[:5])
    text_b = exp_b.mlir_module()
    assert text_b.count("@mosaic_gpu") == 3 and "triton" not in text_b


def test_export_cuda_packed():
    """Packed rows lower for cuda as well (the documents as the kernels' extra operands): forward and gradient."""
    shape = SHAPES["enwik8_paper"]
    args = make_inputs(shape, jnp.bfloat16, bh=2)
    docs = packed_docs(shape["n"], shape["m"], shape["C"], 2)

    def loss(*diff):
        return weighted_sum(_kernel(diff + args[5:], shape, interpret=False, docs=docs))

    exp = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))), platforms=["cuda"])(*args[:5])
    assert exp.mlir_module().count("@mosaic_gpu") == 3


def test_compiled_refusal_names_reasons():
    """Compiled (not interpret), float32 operands and a 32-row block are refused with their reasons."""
    shape = dict(SHAPES["fine_only_bidir"], m=32)
    args = make_inputs(shape, jnp.float32)
    with pytest.raises(ValueError, match="cannot run") as info:
        jax.export.export(jax.jit(lambda *a: _kernel(a, shape, interpret=False)), platforms=["cuda"])(*args)
    assert "tf32" in str(info.value) and "64-row" in str(info.value)


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs its equations hold (kernel bodies, loops, custom rules)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_bf16_reaches_every_wgmma():
    """Forward and backward on bfloat16 operands: every wgmma (the kernels' matmuls) takes bfloat16 operands into a
    float32 accumulator. (tests/attention/test_compute_dtype.py reads ``dot_general`` and ``pallas_call``; a
    Mosaic GPU kernel traces to ``mpmd_map`` with ``wgmma_ref`` products, so this reads them here.)"""
    shape = SHAPES["bidir_ragged"]
    args = make_inputs(shape, jnp.bfloat16)

    def loss(*diff):
        return weighted_sum(_kernel(diff + args[5:], shape))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args[:5]).jaxpr
    products = [e for e in _equations(jaxpr) if e.primitive.name == "wgmma_ref"]
    # forward: S and P V (fine, coarse); dq: S, dP, dS k (fine), S, dP, Sᵀ, dPᵀ, Pᵀ dO, dSᵀ q, dS k (coarse);
    # dk/dv: Sᵀ, dPᵀ, dSᵀ q, Pᵀ dO
    assert len(products) == 4 + 3 + 7 + 4
    found = {(str(e.invars[0].aval.dtype), str(e.invars[1].aval.dtype), str(e.invars[2].aval.dtype))
             for e in products}
    assert found == {("float32", "bfloat16", "bfloat16")}, found
