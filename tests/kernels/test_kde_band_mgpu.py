"""KDEformer heavy band as Pallas Mosaic GPU kernels (``pallas_kernels/kde_band_mgpu.py``) in Mosaic GPU's interpret
mode on a CPU (``InterpretGPUParams``: simulated shared memory, TMA, barriers, wgmma), on the Triton kernel's test
(tests/kernels/test_kde_band.py: its shapes, input builders and reference, through the implementation's wrapper
``heavy_band_kernel`` with the Mosaic GPU entry): values of out and lse against ``xla.heavy_band`` (fp32, bf16;
ragged lengths, rows with an empty heavy set, tiles with no key block, key blocks with no pair, padded rows, a
packed row's bands), gradients in q, k, v through out and lse, the log-sum-exp's cotangent alone, the same operands
against the Triton kernel's Pallas interpret mode; the refusals; ``jax.export`` of forward and gradient for
``cuda`` (Pallas' Mosaic GPU lowering runs on a CPU host; no GPU compiled or ran them) at N = 32768 with no Triton
call and no float32 logits array outside the kernels; bf16 into every wgmma."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_test_base import DTYPES, _assert_refused, weighted_sum  # noqa: I001
from test_fma_blocks_mgpu import _equations
from test_kde_band import TestKDEBand as _TritonTest  # not collected here: the alias does not match Test*
from test_kde_band import _finite, _tensors

from longctx.attention.kdeformer import pallas as kp
from longctx.attention.kdeformer import xla as kx
from longctx.attention.kdeformer.common import NEG
from pallas_kernels import kde_band, kde_band_mgpu


def _heavy(*args, scale, bh, block, interpret, platform=None):
    """``xla.heavy_band``'s contract by the Mosaic GPU kernels (the ``mosaic_gpu`` implementation's band
    function)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kp.heavy_band_kernel(*args, scale, bh, block, interpret=interpret, platform=platform,
                                    band_kernel=kde_band_mgpu.kde_band_mgpu)


class TestKDEBandMgpu(_TritonTest):
    # the Triton test's shapes, plus a mid-length one at the GPU tile (block 64, heads of 64)
    SHAPES = {**_TritonTest.SHAPES, "mid": dict(N=4000, d=64, dv=64, block=64, bh=32, codes=16, c=64)}
    # export: 'long' (N = M = 32768, the configs' causal defaults) and 'mid' lower; 'export' (block 32, dv 32) and
    # 'ragged' (block 8, float32) are refused on cuda with their reasons
    EXPORT_CASES = (("cuda", "long", "bfloat16"), ("cuda", "mid", "bfloat16"), ("cuda", "export", "bfloat16"),
                    ("cuda", "ragged", "float32"))

    def kernel(self, q, Ks, Vs, lo, hi, *, interpret, platform=None, scale, bh, block):
        return _finite(*_heavy(q, Ks, Vs, lo, hi, scale=scale, bh=bh, block=block, interpret=interpret,
                               platform=platform))

    def unsupported_reasons(self, platform, shape, dtype):
        return kde_band_mgpu.unsupported_reasons(platform, block=shape["block"], d=shape["d"], dv=shape["dv"],
                                                 dtype=dtype)

    def test_export_lowering(self, export_case):
        """Forward and gradient lower for cuda through the Mosaic GPU lowering: one ``mosaic_gpu`` custom call
        forward, three with the gradient (forward, dq, dk/dv), no Triton; refused shapes raise naming the
        reasons."""
        platform, shape_name, dtype_name = export_case
        shape = self.SHAPES[shape_name]
        args, static = self.make_inputs(shape, DTYPES[dtype_name])
        fwd = lambda *a: self.kernel(*a, interpret=False, platform=platform, **static)  # noqa: E731
        reasons = self.unsupported_reasons(platform, shape, DTYPES[dtype_name])
        if reasons:
            _assert_refused(reasons, lambda: jax.export.export(jax.jit(fwd), platforms=[platform])(*args))
            return
        text = jax.export.export(jax.jit(fwd), platforms=[platform])(*args).mlir_module()
        assert text.count("@mosaic_gpu") == 1 and "triton" not in text

        def loss(q, k, v):
            return weighted_sum(fwd(q, k, v, *args[3:]))

        text_b = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=[platform])(
            *args[:3]).mlir_module()
        assert text_b.count("@mosaic_gpu") == 3 and "triton" not in text_b


def test_cases_cover_what_they_claim():
    """The default cases hold rows with an empty heavy set, padded rows (Np > N), tiles with no key block
    (``cnt = 0``: the pipeline's traced grid of zero steps) and key blocks that no pair touches (dk/dv's)."""
    t = TestKDEBandMgpu()
    for name in ("ragged", "packed", "blocks"):
        s = t.SHAPES[name]
        q, Ks, Vs, lo, hi = t.make_inputs(s, jnp.float32)[0]
        _, Np, _, _ = kx.band_sizes(s["N"], s["N"], s["block"], s["bh"])
        _, lo_s, hi_s, _, cnt, _, ps, pe = kp.band_plan(lo[0, 0], hi[0, 0], s["block"], s["bh"], s["N"])
        assert Np > s["N"] and int(jnp.sum(hi_s <= lo_s)) > Np - s["N"], name
        assert int(jnp.min(cnt)) == 0 and int(jnp.max(cnt)) >= 2, name
        assert int(jnp.sum(pe == ps)) >= 1, name


def test_gradients_reach_the_log_sum_exp():
    """The lse cotangent alone (out unweighted): the kernels' dq, dk, dv equal the reference's, dq and dk not
    zero."""
    t = TestKDEBandMgpu()
    args, static = t.make_inputs(t.SHAPES["ragged"], jnp.float32)
    w = jnp.cos(jnp.arange(args[0].shape[2], dtype=jnp.float32))

    def grads(fn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, *args[3:], **static)[1] * w),
                                argnums=(0, 1, 2)))(*args[:3])

    g_ref = grads(t.reference)
    g_ker = grads(lambda *a, **s: t.kernel(*a, interpret=True, **s))
    for i, (a, b) in enumerate(zip(g_ref, g_ker)):
        assert i == 2 or float(jnp.max(jnp.abs(a))) > 1e-2
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5, rtol=2e-5)


def _plan_operands(shape, dtype, bh_rows: int = 2):
    """The kernel operands (``kde_band.kde_band``'s) of a shape's first ``bh_rows`` (batch, head) rows."""
    t = TestKDEBandMgpu()
    args, static = t.make_inputs(shape, dtype)
    q, Ks, Vs, lo, hi = args
    B, H, N, d = q.shape
    block, M = shape["block"], Ks.shape[2]
    _, Np, Mb, _ = kx.band_sizes(N, M, block, shape["bh"])
    plan = jax.vmap(jax.vmap(lambda a, b: kp.band_plan(a, b, block, shape["bh"], M)))(lo, hi)
    qord, lo_s, hi_s, b0, cnt, ptile, pstart, pend = plan
    flat = lambda x: x.reshape((B * H,) + x.shape[2:])[:bh_rows]  # noqa: E731
    col = lambda x: flat(x)[..., None]  # noqa: E731
    q_s = jnp.pad(kx._take(q, qord), ((0, 0), (0, 0), (0, Np - N), (0, 0)))
    pad = ((0, 0), (0, 0), (0, Mb * block - M), (0, 0))
    ops = (flat(q_s), flat(jnp.pad(Ks, pad)), flat(jnp.pad(Vs, pad)), col(lo_s), col(hi_s), col(b0), col(cnt),
           flat(ptile), col(pstart), col(pend))
    return ops, dict(scale=static["scale"], block=block)


@pytest.mark.parametrize("name", ["blocks", pytest.param("packed", marks=pytest.mark.slow)])
def test_matches_the_triton_kernel(name):
    """On the same kernel operands (fp32), the Mosaic GPU entry's (o, lse) and its gradients in q, k, v through
    o and lse (``dlse`` honoured) equal the Triton kernel's in Pallas interpret mode: the same contract."""
    ops, static = _plan_operands(TestKDEBandMgpu.SHAPES[name], jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs = {
            "mgpu": lambda *a: kde_band_mgpu.kde_band_mgpu(*a, **static, interpret=True),
            "triton": lambda *a: kde_band.kde_band(*a, **static, interpret=True),
        }

        def value_and_grads(fn):
            def loss(q, k, v):
                o, lse = fn(q, k, v, *ops[3:])
                return weighted_sum((o, jnp.where(lse > 0.5 * NEG, lse, 0.0))), (o, lse)

            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*ops[:3])

        (_, (o_m, l_m)), g_m = value_and_grads(runs["mgpu"])
        (_, (o_t, l_t)), g_t = value_and_grads(runs["triton"])
    assert o_m.shape == o_t.shape and l_m.shape == l_t.shape == ops[3].shape
    np.testing.assert_allclose(np.asarray(o_m), np.asarray(o_t), atol=1e-5, rtol=1e-5)
    assert np.array_equal(np.asarray(l_m) <= 0.5 * NEG, np.asarray(l_t) <= 0.5 * NEG)
    np.testing.assert_allclose(np.asarray(l_m), np.asarray(l_t), atol=1e-5, rtol=1e-5)
    for a, b in zip(g_t, g_m):
        assert float(jnp.max(jnp.abs(a))) > 1e-2
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-5)


def test_unsupported_reasons():
    r = kde_band_mgpu.unsupported_reasons
    assert r("cuda", block=64, d=64, dv=64, dtype=jnp.bfloat16) == []
    assert r("cuda", block=64, d=128, dv=128, dtype=jnp.float16, compute_capability="9.0") == []
    assert r("cuda", block=64, d=64, dv=64, compute_capability=None) == []  # unknown: served
    assert r("interpret", block=8, d=8, dv=6, dtype=jnp.float32) == []
    assert any("Hopper" in x for x in r("cuda", block=64, d=64, dv=64, compute_capability=(8, 0)))
    assert any("Hopper" in x for x in r("cuda", block=64, d=64, dv=64, compute_capability="10.0"))
    assert any("64-row" in x for x in r("cuda", block=32, d=64, dv=64))
    assert any("multiples of 64" in x for x in r("cuda", block=64, d=48, dv=64))
    assert any("registers" in x for x in r("cuda", block=128, d=64, dv=64))
    assert any("registers" in x for x in r("cuda", block=64, d=256, dv=256))
    assert any("tf32" in x for x in r("cuda", block=64, d=64, dv=64, dtype=jnp.float32))
    assert any("not tpu" in x for x in r("tpu", block=64, d=64, dv=64))
    assert all("\n" not in x for x in r("cuda", block=8, d=8, dv=6, dtype=jnp.float32, compute_capability="8.0"))
    # the estimate is below the lowering's shared-memory limit at every served head shape
    assert all(kde_band_mgpu.smem_bytes(64, d, dv) <= kde_band_mgpu.SMEM_LIMIT_BYTES
               for d in (64, 128) for dv in (64, 128))


def test_compiled_refusal_names_reasons():
    """The kernel entry itself, compiled for cuda: float32 operands and an 8-row block refused with reasons."""
    ops, static = _plan_operands(TestKDEBandMgpu.SHAPES["ragged"], jnp.float32, bh_rows=1)
    with pytest.raises(ValueError, match="kde_band_mgpu") as info:
        jax.export.export(jax.jit(lambda *a: kde_band_mgpu.kde_band_mgpu(*a, **static, platform="cuda")),
                          platforms=["cuda"])(*ops)
    assert "tf32" in str(info.value) and "64-row" in str(info.value) and "multiples of 64" in str(info.value)


def test_long_export_has_no_logits_array_outside_the_kernel():
    """Forward and gradient at N = M = 32768 (bf16, B·H = 2, block 64) for cuda: the Mosaic GPU calls, no Triton
    call, and no float32 [..., block, block] logits array (nor any float32 array beyond O(N·d)) in the program."""
    t = TestKDEBandMgpu()
    s = t.SHAPES["long"]
    args, static = t.make_inputs(s, jnp.bfloat16)
    B, H, N, d = args[0].shape

    def loss(q, k, v):
        out, lse = _heavy(q, k, v, *args[3:], scale=static["scale"], bh=s["bh"], block=s["block"], interpret=False,
                          platform="cuda")
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(lse > 0.5 * NEG, lse, 0.0))

    text = jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), platforms=["cuda"])(
        *args[:3]).mlir_module()
    assert text.count("@mosaic_gpu") == 3 and "xla.gpu.triton" not in text
    limit = B * H * N * max(s["d"], s["dv"])
    assert not [dims for n, dims, dt in _tensors(text)
                if dt == "f32" and (dims[-2:] == (s["block"],) * 2 or n > limit)]


def test_bf16_reaches_every_wgmma():
    """Forward and backward on bfloat16 operands: every wgmma takes bfloat16 operands into a float32 accumulator
    (forward: S, P V; dq: S, dP, dS k; dk/dv: Sᵀ, dPᵀ, dSᵀ q, Pᵀ dO)."""
    t = TestKDEBandMgpu()
    args, static = t.make_inputs(t.SHAPES["blocks"], jnp.bfloat16)

    def loss(q, k, v):
        return weighted_sum(t.kernel(q, k, v, *args[3:], interpret=True, **static))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args[:3]).jaxpr
    products = [e for e in _equations(jaxpr) if e.primitive.name == "wgmma_ref"]
    assert len(products) == 2 + 3 + 4
    found = {tuple(str(x.aval.dtype) for x in e.invars[:3]) for e in products}
    assert found == {("float32", "bfloat16", "bfloat16")}, found


def test_outputs_in_the_compute_dtype():
    """bf16 operands: out and every gradient in bf16, lse in fp32."""
    t = TestKDEBandMgpu()
    args, static = t.make_inputs(t.SHAPES["ragged"], jnp.bfloat16)
    f = lambda *a: _heavy(*a, scale=static["scale"], bh=static["bh"], block=static["block"], interpret=True)  # noqa: E731
    out, lse = jax.eval_shape(f, *args)
    grads = jax.eval_shape(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, *args[3:])[0].astype(jnp.float32)),
                                    argnums=(0, 1, 2)), *args[:3])
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 3


def test_no_triton_import():
    """Importing the kernel module (a fresh interpreter) loads neither Pallas' Triton backend nor the Triton
    kernel's module."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys, pallas_kernels.kde_band_mgpu; "
            "print(sorted(m for m in sys.modules if m.endswith('pallas.triton') or m == 'pallas_kernels.kde_band'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout
