"""KDEformer heavy-band Pallas kernel (``pallas_kernels/kde_band.py``, docs/methods/kdeformer.md §4.2) on the shared
kernel test base: the kernel's (out, lse) of a full causal pass's heavy part, through the implementation's wrapper
(``longctx.attention.kdeformer.pallas.heavy_band_kernel``: queries sorted by band end, the pair tables, the un-sort),
against the reference ``xla.heavy_band`` in interpret mode (fp32 and bf16, ragged lengths, rows with an empty heavy
set, a packed row's bands from each document's first key, several key blocks per tile); gradients in q and the
code-sorted keys and values, the log-sum-exp's included (the loss weighs it); the CUDA (Triton) lowering of forward
and backward through ``jax.export`` at N = M = 32768 (every Triton module verified) and a clear refusal of tiles
Triton cannot take; and the exported long program holds no float32 ``[pairs, block, block]`` logits array outside
the kernels (where the XLA form, exported alike, does)."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_test_base import KernelTestBase, verified_triton_modules  # noqa: I001

from longctx.attention.kdeformer import pallas as kp
from longctx.attention.kdeformer import xla as kx
from longctx.attention.kdeformer.common import NEG
from pallas_kernels import kde_band

TRITON = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


def band_inputs(N, d, dv, block, bh, codes, c, *, B=1, H=2, packed=False, dtype=jnp.float32, seed=0):
    """q [B,H,N,d], the code-sorted keys and values Ks, Vs [B,H,N,·] and each query's heavy slots lo, hi [B,H,N]
    of a full causal pass (xla.causal_forward's 'band' route: chunks of ``c``, local window 2 chunks, ``codes``
    distinct hash codes). ``packed``: documents of ragged lengths, every band counted from its document's first key
    (§4.6)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (B, H, N, d)).astype(dtype)
    k = jax.random.normal(ks[1], (B, H, N, d)).astype(dtype)
    v = jax.random.normal(ks[2], (B, H, N, dv)).astype(dtype)
    hk = jax.random.randint(ks[3], (B, H, N), 0, codes)
    hq = jax.random.randint(ks[4], (B, H, N), 0, codes)
    order, kappa_s, _ = kx.code_sort(hk, N)
    pos = jnp.arange(N, dtype=jnp.int32)
    if packed:
        cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, N), 3, replace=False))
        start = jnp.asarray(np.concatenate([[0], cuts])[np.searchsorted(cuts, np.arange(N), side="right")], jnp.int32)
        L = start + jnp.maximum(0, ((pos - start) // c - 1) * c)
        lo, hi = kx.heavy_bounds(kappa_s, hq, L, bh, start)
    else:
        lo, hi = kx.heavy_bounds(kappa_s, hq, jnp.maximum(0, (pos // c - 1) * c), bh)
    return (q, kx._take(k, order), kx._take(v, order), lo, hi)


def _finite(out, lse):
    """The compared outputs: out, the log-sum-exp of rows with a heavy set (0 elsewhere) and the empty rows (1.0):
    NEG itself would put every tolerance relative to it at 1e25."""
    has = lse > 0.5 * NEG
    return out, jnp.where(has, lse, 0.0), (~has).astype(jnp.float32)


class TestKDEBand(KernelTestBase):
    # N queries = keys, d / dv widths, block (tile rows = key block), bh heavy capacity, codes, chunk c
    SHAPES = {
        "ragged": dict(N=50, d=8, dv=6, block=8, bh=4, codes=4, c=8),
        "packed": dict(N=60, d=8, dv=8, block=8, bh=4, codes=3, c=8, packed=True),
        "blocks": dict(N=72, d=16, dv=16, block=16, bh=12, codes=2, c=8),  # tiles spanning several key blocks
        "export": dict(N=1000, d=64, dv=32, block=32, bh=16, codes=16, c=64),
        "long": dict(N=32768, d=64, dv=64, block=64, bh=64, codes=64, c=128),  # configs' causal defaults, r = 6
    }
    FORWARD_CASES = (("ragged", "float32"), ("ragged", "bfloat16"), ("packed", "float32"), ("blocks", "float32"),
                     ("packed", "bfloat16"))
    GRAD_CASES = (("ragged", "float32"), ("ragged", "bfloat16"), ("packed", "float32"), ("blocks", "float32"),
                  ("blocks", "bfloat16"))
    EXPORT_CASES = (("cuda", "long", "bfloat16"), ("cuda", "export", "float32"), ("cuda", "export", "bfloat16"),
                    ("cuda", "ragged", "float32"))  # block 8: refused on GPU
    EXPORT_PLATFORMS = ("cuda",)
    PAPER_SHAPES = ("long",)
    # bf16: the probabilities enter P V as bf16 and the kernel writes out in bf16 (the reference keeps it fp32)
    TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (2e-2, 2e-2)}
    GRAD_TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (3e-2, 3e-2)}
    DIFF_ARGNUMS = (0, 1, 2)  # q, the code-sorted keys and values

    def is_ragged(self, shape):
        return shape["N"] % shape["block"] != 0

    def make_inputs(self, shape, dtype):
        args = band_inputs(shape["N"], shape["d"], shape["dv"], shape["block"], shape["bh"], shape["codes"],
                           shape["c"], packed=shape.get("packed", False), dtype=dtype)
        return args, dict(scale=shape["d"] ** -0.5, bh=shape["bh"], block=shape["block"])

    def kernel(self, q, Ks, Vs, lo, hi, *, interpret, platform=None, scale, bh, block):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _finite(*kp.heavy_band_kernel(q, Ks, Vs, lo, hi, scale, bh, block, interpret=interpret,
                                                 platform=platform))

    def reference(self, q, Ks, Vs, lo, hi, *, scale, bh, block):
        return _finite(*kx.heavy_band(q, Ks, Vs, lo, hi, scale, bh, block, 1 << 22))

    def unsupported_reasons(self, platform, shape, dtype):
        return kde_band.unsupported_reasons(platform, block=shape["block"], d=shape["d"], dv=shape["dv"])

    def export_disabled_checks(self, platform):
        return TRITON


def test_cases_cover_what_they_claim():
    """The cases hold rows with an empty heavy set and with a full one, tiles that span several key blocks, a
    packed row's bands that differ from the unpacked ones, and the long shape's pairs many per tile."""
    t = TestKDEBand()
    for name in ("ragged", "packed", "blocks"):
        s = t.SHAPES[name]
        q, Ks, Vs, lo, hi = t.make_inputs(s, jnp.float32)[0]
        n = hi - lo
        assert int(jnp.sum(n <= 0)) > 0 and int(jnp.max(n)) == s["bh"], name
        _, Np, _, _ = kx.band_sizes(s["N"], s["N"], s["block"], s["bh"])
        _, lo_s, hi_s = kx.band_order(lo[0, 0], hi[0, 0], Np)
        _, cnt, _ = kx.band_pairs(lo_s, hi_s, s["block"], s["block"], s["N"])
        if name == "blocks":
            assert int(jnp.max(cnt)) >= 3
    s = t.SHAPES["packed"]
    packed = t.make_inputs(s, jnp.float32)[0]
    alone = band_inputs(s["N"], s["d"], s["dv"], s["block"], s["bh"], s["codes"], s["c"])
    assert int(jnp.sum(packed[3] != alone[3])) > 0


def test_gradients_reach_the_log_sum_exp():
    """The band's lse is merged with the other parts through their log-sum-exps: its cotangent alone (out
    unweighted) gives the kernel's dq, dk equal to the reference's, and they are not zero."""
    t = TestKDEBand()
    args, static = t.make_inputs(t.SHAPES["ragged"], jnp.float32)
    w = jnp.cos(jnp.arange(args[0].shape[2], dtype=jnp.float32))

    def grads(fn):
        return jax.jit(jax.grad(lambda q, k: jnp.sum(fn(q, k, *args[2:], **static)[1] * w), argnums=(0, 1)))(
            *args[:2])

    g_ref = grads(t.reference)
    g_ker = grads(lambda *a, **s: t.kernel(*a, interpret=True, **s))
    for a, b in zip(g_ref, g_ker):
        assert float(jnp.max(jnp.abs(a))) > 1e-2
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5, rtol=2e-5)


def _tensors(text: str):
    """(element count, dims, dtype) of every tensor type in an exported module's text (the kernels' own bodies are
    serialized Triton modules, not tensor types of the program)."""
    out = []
    for m in re.finditer(r"tensor<((?:\d+x)+)(f32|bf16|f16|i32|i1)>", text):
        dims = tuple(int(x) for x in m.group(1).rstrip("x").split("x"))
        out.append((int(np.prod(dims)), dims, m.group(2)))
    return out


def test_long_export_has_no_logits_array_outside_the_kernel():
    """Forward and gradient at N = M = 32768 (bf16, B·H = 2, block 64): the program's largest float32 array is
    O(N·d) (Δ's product, the float32 cotangents), none is a [..., block, block] logits array; the XLA form exported
    alike (the cuda tile budget batches every pair in one step) does hold them, so the check can fail."""
    t = TestKDEBand()
    s = t.SHAPES["long"]
    args, static = t.make_inputs(s, jnp.bfloat16)
    B, H, N, d = args[0].shape

    def exported(fn):
        def loss(q, k, v):
            out, lse = fn(q, k, v, *args[3:])
            return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(lse > 0.5 * NEG, lse, 0.0))

        return jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
                                 disabled_checks=TRITON)(*args[:3]).mlir_module()

    with verified_triton_modules() as triton:
        text = exported(lambda *a: kp.heavy_band_kernel(*a, static["scale"], s["bh"], s["block"], interpret=False,
                                                        platform="cuda"))
    assert text.count("xla.gpu.triton") >= 3  # forward, dq, dk/dv
    assert triton is None or (len(triton) >= 3 and not [e for _, e in triton if e])
    limit = B * H * N * max(s["d"], s["dv"])

    def logits(tensors):
        return [dims for n, dims, dt in tensors if dt == "f32" and (dims[-2:] == (s["block"],) * 2 or n > limit)]

    assert not logits(_tensors(text))
    xla_text = exported(lambda *a: kx.heavy_band(*a, static["scale"], s["bh"], s["block"],
                                                 kx.DEFAULTS["tile_budget"]["cuda"]))
    assert logits(_tensors(xla_text))


def test_unsupported_reasons_and_tiles():
    assert kde_band.unsupported_reasons("cuda", block=64, d=64, dv=64) == []
    assert kde_band.unsupported_reasons("interpret", block=8, d=8, dv=6) == []
    assert any("16 rows" in r for r in kde_band.unsupported_reasons("cuda", block=8, d=64, dv=64))
    assert any("powers of two" in r for r in kde_band.unsupported_reasons("cuda", block=64, d=48, dv=64))
    assert any("not tpu" in r for r in kde_band.unsupported_reasons("tpu", block=128, d=128, dv=128))
    assert kde_band.gpu_tiles(64) == (4, 2) and kde_band.gpu_tiles(128) == (8, 2)


def test_outputs_in_the_compute_dtype():
    """bf16 operands: the kernel writes out and every gradient in bf16, lse in fp32."""
    t = TestKDEBand()
    args, static = t.make_inputs(t.SHAPES["ragged"], jnp.bfloat16)
    f = lambda *a: kp.heavy_band_kernel(*a, static["scale"], static["bh"], static["block"], interpret=True,  # noqa: E731
                                        platform=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, lse = jax.eval_shape(f, *args)
        grads = jax.eval_shape(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, *args[3:])[0].astype(jnp.float32)),
                                        argnums=(0, 1, 2)), *args[:3])
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 3



_SHARDED = """
import sys, warnings
sys.path.insert(0, "tests/kernels")
import jax, jax.numpy as jnp, ml_collections
from test_kde_band import band_inputs
from longctx.attention.kdeformer import pallas as kp, xla as kx
from longctx.train import sharding
warnings.simplefilter("ignore")
args = band_inputs(40, 8, 8, 8, 4, 3, 8, B=2, H=2)
ker = lambda *a: kp.heavy_band_kernel(*a, 0.3, 4, 8, interpret=True, platform=None)
ref = lambda *a: kx.heavy_band(*a, 0.3, 4, 8, 1 << 22)
loss = lambda f: lambda q, k, v: sum(jnp.sum(x * jnp.cos(jnp.arange(x.size).reshape(x.shape))) for x in
                                     (f(q, k, v, *args[3:])[0], jnp.where(f(q, k, v, *args[3:])[1] > -1e29,
                                                                          f(q, k, v, *args[3:])[1], 0.0)))
want = jax.jit(jax.value_and_grad(loss(ref), argnums=(0, 1, 2)))(*args[:3])
mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(zip(sharding.AXES, (2, 1, 2, 1)))), jax.devices()[:4])
put = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "tensor"))
args = tuple(jax.device_put(x, put) for x in args)
print("SHARD", "shard_map" in str(jax.make_jaxpr(ker)(*args)))
got = jax.jit(jax.value_and_grad(loss(ker), argnums=(0, 1, 2)))(*args[:3])
print("ERR", max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got))))
"""


@pytest.mark.slow  # a subprocess on 4 simulated devices
def test_kernel_per_shard_equals_one_device():
    """On a data x tensor mesh the kernel (a call XLA's partitioner cannot split) runs in a shard_map over the rows
    and heads; its value and gradients equal the reference's on one device."""
    import os
    import subprocess
    import sys

    from conftest import xla_flags

    env = {**os.environ, "XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _SHARDED], capture_output=True, text=True, timeout=600, env=env,
                       cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(x.split(" ", 1) for x in r.stdout.splitlines() if x.startswith(("SHARD", "ERR")))
    assert lines["SHARD"] == "True"
    assert float(lines["ERR"]) < 1e-4, lines
