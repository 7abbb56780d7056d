"""EVA's Phase B as Pallas Mosaic GPU kernels (pallas_kernels/eva_attend_mgpu.py) in Mosaic GPU's interpret mode on
a CPU (``interpret=InterpretGPUParams()``: simulated shared memory, TMA, barriers, wgmma): values (``o`` and
``lse``) against the pure-JAX reference ``eva_attend_ref.eva_attend_reference`` in float32 and bfloat16, causal
with and without window overlap, bidirectional with overlap and a per-head bias, without bias, the disjoint
partition, ragged lengths; the backward kernels' gradients in q, k, v, k̂, β and the bias against autodiff of the
reference; attention dropout by the shared hash mask; EVA with impl='mosaic_gpu' routing Phase B through them
(evaluation and training steps); bfloat16 reaching every wgmma; the refusals; and ``jax.export`` of forward and gradient for ``cuda``
(the Mosaic GPU lowering runs on a CPU host) at configs/wikitext103/eva_16l.py's shapes (window 128, chunk 8,
heads of 128, 512 tokens)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from kernel_test_base import assert_close, mosaic_gpu_mode, weighted_sum  # noqa: I001
from test_eva_attend import TestEVAAttend as _TritonTest  # not collected here: the alias does not match Test*
from test_fma_blocks_mgpu import _equations

from longctx import attention
from pallas_kernels import eva_attend_mgpu

H = 2
TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (1e-2, 1e-2)}
GRAD_TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (2e-2, 2e-2)}
# W window (interpret mode tiles: min(64, W)), P chunk size, L valid tokens, e_l/e_r window extensions, hb bias
# heads (0: none), B batch rows (H heads each)
SHAPES = {
    "causal_overlap": dict(L=90, W=32, P=4, d=16, dv=16, e_l=32, e_r=0, causal=True, hb=1),
    "causal_plain": dict(L=75, W=32, P=8, d=16, dv=32, e_l=0, e_r=0, causal=True, hb=1),
    "bidir_overlap": dict(L=83, W=32, P=2, d=16, dv=32, e_l=16, e_r=16, causal=False, hb=H),
    "causal_disjoint": dict(L=90, W=32, P=4, d=16, dv=16, e_l=32, e_r=0, causal=True, hb=0, disjoint=True),
    "bidir_plain": dict(L=64, W=32, P=4, d=16, dv=16, e_l=0, e_r=0, causal=False, hb=0),
    # attention dropout (the hash mask of pallas_kernels/hash_dropout.py at absolute indices)
    "causal_drop": dict(L=90, W=32, P=4, d=16, dv=16, e_l=32, e_r=0, causal=True, hb=1, rate=0.2),
    "bidir_drop": dict(L=83, W=32, P=2, d=16, dv=32, e_l=16, e_r=16, causal=False, hb=H, rate=0.3),
    # two 64-row tiles a window (W = 128), many chunk tiles (C = 24 at P = 8 would be one; P = 2 gives 3)
    "w128": dict(L=250, W=128, P=2, d=16, dv=16, e_l=0, e_r=0, causal=True, hb=1, B=1),
    # configs/wikitext103/eva_16l.py: window 128 without overlap, chunk 8, heads of 128, shared RPE, 512 tokens
    "wt103_paper": dict(L=512, W=128, P=8, d=128, dv=128, e_l=0, e_r=0, causal=True, hb=1, B=1),
    # packed rows laid out on the window grid (tests/kernels/test_eva_attend.py's _packed_segments: two rows of six
    # windows, documents with gaps between, one shorter than a chunk; causal: each row's first document continues a
    # carried one whose `base` chunks come first): causal with overlap and dropout, the disjoint partition, and
    # bidirectional with overlap, per-head bias and dropout
    "packed_causal_drop": dict(L=192, W=32, P=4, d=16, dv=16, e_l=32, e_r=0, causal=True, hb=1, rate=0.2,
                               packed=True, base=8),
    "packed_disjoint": dict(L=192, W=32, P=4, d=16, dv=16, e_l=32, e_r=0, causal=True, hb=0, disjoint=True,
                            packed=True, base=8),
    "packed_bidir_drop": dict(L=192, W=32, P=2, d=16, dv=32, e_l=16, e_r=16, causal=False, hb=H, rate=0.3,
                              packed=True),
    # packed rows at configs/wikitext103/eva_16l.py's shapes (two rows of 768 laid-out positions, 16 carried chunks
    # first, its training step's dropout)
    "packed_wt103": dict(L=768, W=128, P=8, d=128, dv=128, e_l=0, e_r=0, causal=True, hb=1, rate=0.1,
                         packed=True, base=16),
}
SLOW = pytest.mark.slow  # interpret mode: ~5-60 s a case; the default suite runs one forward, one gradient


def make_inputs(shape, dtype):
    """The Triton kernel test's operands (tests/kernels/test_eva_attend.py; its tile settings, which these kernels
    do not read, among the static arguments)."""
    return _TritonTest().make_inputs(shape, dtype)



def _kernel(args, static, interpret=None):
    return eva_attend_mgpu.eva_attend_mgpu(*args, **static, interpret=mosaic_gpu_mode(interpret, args[0].dtype))


def _reference(args, static):
    return _TritonTest().reference(*args, **static)


# packed rows (segment ids), values and gradients alike: fp32 and bf16, causal with dropout, disjoint, bidirectional
PACKED_CASES = [pytest.param((name, dt), marks=SLOW) for name, dt in (
    ("packed_causal_drop", "float32"), ("packed_causal_drop", "bfloat16"), ("packed_disjoint", "float32"),
    ("packed_bidir_drop", "float32"), ("packed_bidir_drop", "bfloat16"))]


@pytest.mark.parametrize("case", [
    ("causal_overlap", "float32"),
    pytest.param(("causal_overlap", "bfloat16"), marks=SLOW),
    pytest.param(("causal_plain", "float32"), marks=SLOW),
    pytest.param(("bidir_overlap", "float32"), marks=SLOW),
    pytest.param(("bidir_overlap", "bfloat16"), marks=SLOW),
    pytest.param(("causal_disjoint", "float32"), marks=SLOW),
    pytest.param(("bidir_plain", "bfloat16"), marks=SLOW),
    pytest.param(("w128", "float32"), marks=SLOW),
    pytest.param(("causal_drop", "bfloat16"), marks=SLOW),
    pytest.param(("bidir_drop", "float32"), marks=SLOW),
    *PACKED_CASES,
], ids=lambda c: f"{c[0]}-{c[1]}")
def test_forward_matches_reference(case):
    """o (compute dtype) and lse (f32) against the reference on the same operands, padded query rows included."""
    name, dt = case
    args, static = make_inputs(SHAPES[name], jnp.dtype(dt))
    o, lse = jax.jit(lambda a: _kernel(a, static))(args)
    ro, rl = _reference(args, static)
    assert o.dtype == jnp.dtype(dt) and lse.dtype == jnp.float32 and o.shape == ro.shape and lse.shape == rl.shape
    assert float(jnp.max(jnp.abs(ro.astype(jnp.float32)))) > 1e-1
    assert_close(ro.astype(jnp.float32), o.astype(jnp.float32), TOLERANCES[dt], f"{name}/{dt} o")
    assert_close(rl, lse, TOLERANCES[dt], f"{name}/{dt} lse")


def _grads(args, fn):
    """Gradients of a weighted sum of ``(o, lse)`` in q, k, v, k̂, β and (where given) the bias: the leaves."""
    return jax.tree.leaves(jax.jit(jax.grad(lambda a: weighted_sum(fn(a))))(args))


@pytest.mark.parametrize("case", [
    pytest.param(("causal_overlap", "float32"), marks=SLOW),
    pytest.param(("causal_plain", "bfloat16"), marks=SLOW),
    ("causal_drop", "bfloat16"),
    pytest.param(("causal_drop", "float32"), marks=SLOW),
    pytest.param(("bidir_drop", "float32"), marks=SLOW),
    pytest.param(("bidir_overlap", "float32"), marks=SLOW),
    pytest.param(("bidir_overlap", "bfloat16"), marks=SLOW),
    pytest.param(("causal_disjoint", "float32"), marks=SLOW),
    pytest.param(("w128", "float32"), marks=SLOW),
    *PACKED_CASES,
], ids=lambda c: f"{c[0]}-{c[1]}")
def test_gradient_matches_autodiff_of_reference(case):
    """The kernel VJP (dq pass; key side: dk, dv, the bias tiles, dk̂, dβ) against autodiff of the reference, both
    outputs' cotangents (o and lse) included."""
    name, dt = case
    args, static = make_inputs(SHAPES[name], jnp.dtype(dt))
    g_ker = _grads(args, lambda a: _kernel(a, static))
    g_ref = _grads(args, lambda a: _reference(a, static))
    for i, (r, g) in enumerate(zip(g_ref, g_ker)):
        assert g.dtype == r.dtype  # the operand's (the bias tiles are float32 here, cast inside the call)
        assert float(jnp.max(jnp.abs(r.astype(jnp.float32)))) > 1e-2, f"d/d(arg {i}) vanishes"
        assert_close(r.astype(jnp.float32), g.astype(jnp.float32), GRAD_TOLERANCES[dt], f"{name}/{dt} d/d(arg {i})")


def test_unsupported_reasons():
    r = eva_attend_mgpu.unsupported_reasons
    ok = dict(W=128, d=128, dv=128, dtype=jnp.bfloat16)
    assert r("cuda", **ok) == [] and r("cuda", **ok, compute_capability="9.0") == []
    assert r("interpret", W=8, d=8, dv=8, dtype=jnp.float32) == []
    # interpret mode tiles by min(64, W): a window above 64 must be a multiple of it (refused here, not in the kernel)
    assert r("interpret", W=128, d=8, dv=8) == [] and any("multiple of 64" in x for x in r("interpret", W=96, d=8, dv=8))
    assert any("Hopper" in x for x in r("cuda", **ok, compute_capability=(8, 0)))
    assert any("multiple of 64" in x for x in r("cuda", **dict(ok, W=32)))
    assert any("multiples of 64" in x for x in r("cuda", **dict(ok, d=48)))
    assert any("tf32" in x for x in r("cuda", **dict(ok, dtype=jnp.float32)))
    assert any("cuda" in x for x in r("tpu", **ok))
    assert r("cuda", **ok, segments=True) == []  # packed rows are served (the document operands)
    assert any("exact_lse" in x for x in r("cuda", **ok, chunk_logit="exact_lse"))


def test_compiled_refusal_names_reasons():
    """Compiled (not interpret): float32 operands and a 32-token window are refused with their reasons."""
    args, static = make_inputs(SHAPES["causal_plain"], jnp.float32)
    with pytest.raises(ValueError, match="cannot run") as info:
        _kernel(args, static, interpret=False)
    assert "tf32" in str(info.value) and "multiple of 64" in str(info.value)


def _export_count(fn, args):
    text = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    assert "triton" not in text
    return text.count("@mosaic_gpu")


@pytest.mark.parametrize("name", ["wt103_paper", pytest.param("bidir_wt103", marks=SLOW),
                                  pytest.param("wt103_train", marks=SLOW),
                                  pytest.param("packed_wt103", marks=SLOW), "packed_eval",
                                  pytest.param("packed_bidir_eval", marks=SLOW)])
def test_export_cuda(name):
    """``jax.export`` for cuda lowers the kernels through Pallas' Mosaic GPU lowering on this CPU host (no GPU
    compiles or runs them here; the lowering checks shared memory): the forward is one ``mosaic_gpu`` custom call,
    its gradient three (forward, dq, key side), no Triton; a packed row's too (its document operands), with and
    without dropout (without, the documents' own positions are unused: loading them anyway left Mosaic GPU's layout
    inference without a solution)."""
    shape = SHAPES["packed_wt103" if name.startswith("packed") else "wt103_paper"]
    if name == "packed_eval":  # an evaluation (and a training step without attention dropout): no dropout
        shape = dict(shape, rate=0.0)
    if name == "packed_bidir_eval":
        shape = dict(shape, rate=0.0, causal=False, e_l=64, e_r=64)
    if name == "bidir_wt103":  # bidirectional with overlap (three key blocks a window) and a per-head bias
        shape = dict(shape, causal=False, e_l=64, e_r=64, hb=H)
    if name == "wt103_train":  # the config's training step: attention dropout 0.1
        shape = dict(shape, rate=0.1)
    args, static = make_inputs(shape, jnp.bfloat16)
    assert _export_count(lambda *a: _kernel(a, static, interpret=False), args) == 1

    def loss(*diff):
        return weighted_sum(_kernel(diff, static, interpret=False))

    assert _export_count(jax.grad(loss, argnums=tuple(range(6))), args) == 3


def test_bf16_reaches_every_wgmma():
    """Forward and backward on bfloat16 operands: every wgmma takes bfloat16 operands into a float32 accumulator
    (tests/attention/test_compute_dtype.py reads ``dot_general`` and ``pallas_call``; a Mosaic GPU kernel traces to
    ``wgmma_ref`` products, read here)."""
    args, static = make_inputs(SHAPES["causal_overlap"], jnp.bfloat16)

    def loss(*diff):
        return weighted_sum(_kernel(diff, static))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(6))))(*args).jaxpr
    products = [e for e in _equations(jaxpr) if e.primitive.name == "wgmma_ref"]
    # forward: S, P V (local, chunk); dq: S, dP, dS k (local, chunk); key side, key and chunk programs: Sᵀ, dPᵀ,
    # dSᵀ q, Pᵀ dO
    assert len(products) == 4 + 6 + 8
    found = {tuple(str(x.aval.dtype) for x in e.invars[:3]) for e in products}
    assert found == {("float32", "bfloat16", "bfloat16")}, found


@SLOW
def test_method_routes_phase_b_through_the_kernels_with_dropout(monkeypatch):
    """impl='mosaic_gpu' runs a full pass's Phase B in these kernels (counted), equal to impl='xla', and a training
    step with attention dropout too, with the XLA tiles' mask (same key, same result)."""
    calls = []
    real = eva_attend_mgpu.eva_attend_mgpu
    monkeypatch.setattr(eva_attend_mgpu, "eva_attend_mgpu",
                        lambda *a, **k: calls.append(k["dropout_rate"]) or real(*a, **k))
    cfg = {"window_size": 16, "chunk_size": 4, "attn_dropout": 0.1}
    build = lambda impl: attention.build("eva", {**cfg, "impl": impl}, num_heads=2, head_dim=16,  # noqa: E731
                                         causal=True, rngs=nnx.Rngs(0))
    xla, mgpu = build("xla"), build("mosaic_gpu")
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (1, 2, 37, 16)) for i in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = jax.jit(lambda q, k, v: mgpu(q, k, v)[0])(q, k, v)
        assert calls == [0.0]
        np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(lambda q, k, v: xla(q, k, v)[0])(q, k, v)),
                                   atol=2e-5)
        drop = jax.jit(lambda core, q, k, v: core(q, k, v, deterministic=False, key=jax.random.PRNGKey(5))[0],
                       static_argnums=0)
        a = drop(mgpu, q, k, v)
        assert calls == [0.0, 0.1]
        np.testing.assert_allclose(np.asarray(a), np.asarray(drop(xla, q, k, v)), atol=2e-5)
        assert float(jnp.max(jnp.abs(a - out))) > 1e-2  # dropout changed the output
