"""EVA chunk-statistics Pallas kernel (docs/methods/eva.md §8.2) on the shared kernel test base: interpret-mode forward
against the jnp Phase A reference (option variants, ragged lengths, with and without noise, fp32 and bf16),
TPU / CUDA lowering through jax.export (at WikiText-103's chunk 8 and heads of 128 too, and a clear refusal for
non-power-of-two sizes on GPU), and the method running the kernel with impl='pallas'. Gradients: the backward
kernel (token level) with the chunk-level VJP against autodiff of the reference (option variants, fp32 and bf16,
ragged)."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from kernel_test_base import KernelTestBase  # noqa: I001

from longctx import attention
from pallas_kernels import eva_chunks, eva_chunks_ref

B, H, D = 2, 2, 16


class TestEVAChunkStats(KernelTestBase):
    SHAPES = {
        "ragged_5x4_noise": dict(C=5, P=4, L=18, dv=D, noise=True),
        "noln_half_principled_16x8": dict(C=16, P=8, L=128, dv=D, noise=False,
                                          opts=dict(adaptive_proj="no-ln", mu_mode="half", rf_scale="principled")),
        "identity_tiny_3x8": dict(C=3, P=8, L=5, dv=D, noise=True, opts=dict(chunk_rep="identity")),
        "mu_none_5x4_dv8": dict(C=5, P=4, L=18, dv=8, noise=True, opts=dict(adaptive_proj="none")),
        "export_16x8": dict(C=16, P=8, L=120, dv=D, noise=True),
        "export_p6": dict(C=4, P=6, L=20, dv=D, noise=True),
        # configs/wikitext103/eva_16l.py: chunks of 8, heads of 128, 512-token rows (C = 64)
        "wt103_paper": dict(C=64, P=8, L=512, d=128, dv=128, noise=True),
        # a packed row's chunks (EVA's packed.py layout): members per batch row ([B, 1, C, P]), a chunk cut short by
        # its document's end or holding no document at all
        "rows_5x4": dict(C=5, P=4, L=20, dv=D, noise=True, rows=True),
        "export_rows_16x8": dict(C=16, P=8, L=128, dv=D, noise=True, rows=True),
    }
    FORWARD_CASES = (("ragged_5x4_noise", "float32"), ("noln_half_principled_16x8", "float32"),
                     ("identity_tiny_3x8", "float32"), ("mu_none_5x4_dv8", "float32"),
                     ("ragged_5x4_noise", "bfloat16"), ("rows_5x4", "float32"), ("rows_5x4", "bfloat16"))
    GRAD_CASES = (("ragged_5x4_noise", "float32"), ("noln_half_principled_16x8", "float32"),
                  ("identity_tiny_3x8", "float32"), ("mu_none_5x4_dv8", "float32"), ("ragged_5x4_noise", "bfloat16"),
                  ("noln_half_principled_16x8", "bfloat16"), ("rows_5x4", "float32"), ("rows_5x4", "bfloat16"))
    EXPORT_CASES = (("tpu", "export_16x8", "float32"), ("cuda", "export_16x8", "float32"),
                    ("tpu", "export_p6", "float32"), ("cuda", "export_p6", "float32"),
                    ("tpu", "wt103_paper", "float32"), ("cuda", "wt103_paper", "float32"),
                    ("tpu", "wt103_paper", "bfloat16"), ("cuda", "wt103_paper", "bfloat16"),
                    ("tpu", "export_rows_16x8", "float32"), ("cuda", "export_rows_16x8", "float32"))
    PAPER_SHAPES = ("wt103_paper",)
    # the kernel follows the reference's precision (bf16 operands, fp32 accumulation, fp32 softmax and LayerNorm)
    TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (2e-5, 2e-5)}
    DIFF_ARGNUMS = (0, 1, 2, 4, 5)
    KERNEL_BACKWARD = True  # the token-level backward kernel; the chunk-level half by autodiff (module docstring)

    def is_ragged(self, shape):  # padding tokens in the last chunk, or chunks not filling the kernel's group
        return shape["L"] % shape["P"] != 0 or shape["C"] % eva_chunks.GROUP != 0

    def make_inputs(self, shape, dtype):
        C, P, L, dv, d = shape["C"], shape["P"], shape["L"], shape["dv"], shape.get("d", D)
        core = attention.build("eva", dict(window_size=16, chunk_size=P if 16 % P == 0 else 4), num_heads=H,
                               head_dim=d, causal=True, rngs=nnx.Rngs(0))
        ks = jax.random.split(jax.random.PRNGKey(C * P + L), 6)
        q, k = (jax.random.normal(kk, (B, H, C, P, d)) for kk in ks[:2])
        v = jax.random.normal(ks[2], (B, H, C, P, dv))
        valid = (jnp.arange(C * P) < L).reshape(C, P)
        if shape.get("rows"):  # each row's chunk members: a prefix of each chunk (none for some), per batch row
            count = jax.random.randint(ks[5], (B, 1, C, 1), 0, P + 1)
            valid = valid & (jnp.arange(P) < count)
        q, k, v = (jnp.where(valid[..., None], x, 0.0).astype(dtype) for x in (q, k, v))  # padding rows zero
        noise = jax.random.normal(ks[3], (B, H, C, d)) if shape["noise"] else None
        # non-trivial LN affine / biases so every parameter path is exercised
        params = {n: p + 0.1 * jax.random.normal(jax.random.fold_in(ks[4], i), p.shape)
                  for i, (n, p) in enumerate(sorted(core.chunk_params().items()))}
        opts = dataclasses.replace(core.opts, **shape.get("opts", {}))
        return (q, k, v, valid, params, noise), dict(opts=opts, scale=d**-0.5)

    def kernel(self, q, k, v, valid, params, noise, *, interpret, platform=None, opts, scale):
        return eva_chunks.eva_chunk_stats(q, k, v, valid, params, noise, opts, scale, interpret=interpret,
                                          platform=platform)

    def reference(self, q, k, v, valid, params, noise, *, opts, scale):
        # the inputs as given: the reference defines the precision under bf16 too (products in the compute dtype
        # with fp32 accumulation), which the kernel must follow
        return eva_chunks_ref.chunk_summaries(q, k, v, valid, params, noise, opts, scale)

    def unsupported_reasons(self, platform, shape, dtype):
        return eva_chunks.unsupported_reasons(platform, P=shape["P"], d=shape.get("d", D), dv=shape["dv"], dtype=dtype)

    def export_disabled_checks(self, platform):
        # Triton custom calls carry no serialization-compatibility guarantee; lowering is what we check.
        return [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")] if platform == "cuda" else []


def test_unsupported_sizes_name_their_reasons():
    assert any("power-of-two" in r for r in eva_chunks.unsupported_reasons("cuda", P=6, d=16, dv=16))
    assert eva_chunks.unsupported_reasons("tpu", P=6, d=16, dv=16) == []  # Mosaic takes full-dim blocks
    assert any("no rocm lowering" in r for r in eva_chunks.unsupported_reasons("rocm", P=8, d=16, dv=16))
    assert any("VMEM" in r for r in eva_chunks.unsupported_reasons("tpu", P=1024, d=128, dv=128))
    # GPU register estimate: chunks of 8 with heads of 64 take 4 warps, heads of 128 (WikiText-103) 8; chunks of 16
    # with heads of 128 exceed it even at 8 warps
    assert eva_chunks.gpu_warps(P=8, d=64, dv=64) == (4, 176.0)
    assert eva_chunks.gpu_warps(P=8, d=128, dv=128) == (8, 152.0)
    # the backward kernel holds one more [G, T] tile
    assert eva_chunks.gpu_warps(P=8, d=64, dv=64, backward=True) == (4, 192.0)
    assert eva_chunks.gpu_warps(P=8, d=128, dv=128, backward=True) == (8, 160.0)
    assert eva_chunks.unsupported_reasons("cuda", P=8, d=128, dv=128) == []
    assert any("register estimate" in r for r in eva_chunks.unsupported_reasons("cuda", P=16, d=128, dv=128))
    with pytest.raises(ValueError, match="power-of-two"):
        eva_chunks.check_supported(6, 16, 16, "cuda")
    args, static = TestEVAChunkStats().make_inputs(TestEVAChunkStats.SHAPES["ragged_5x4_noise"], jnp.float32)
    with pytest.raises(ValueError, match="interpret"):
        TestEVAChunkStats().kernel(*args, interpret=False, platform="cpu", **static)


def test_core_impl_pallas_on_cpu_warns_and_matches_xla():
    cfg = dict(window_size=8, chunk_size=4)
    mk = lambda impl: attention.build("eva", dict(cfg, impl=impl), num_heads=H, head_dim=D, causal=True,  # noqa: E731
                                      rngs=nnx.Rngs(0))
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    q, k, v = (jax.random.normal(kk, (B, H, 21, D)) for kk in ks)
    key = jax.random.PRNGKey(2)
    xla = mk("xla")
    ref = jax.jit(lambda q, k, v: xla(q, k, v, deterministic=False, key=key)[0])(q, k, v)  # eager: op by op
    core = mk("pallas")
    call = jax.jit(lambda q, k, v, s: core(q, k, v, s, deterministic=False, key=key))  # warns while tracing

    def interpret_warning():  # only CPU runs the kernel in interpret mode; an accelerator compiles it, silently
        if jax.default_backend() == "cpu":
            return pytest.warns(UserWarning, match="interpret")
        return contextlib.nullcontext()

    with interpret_warning():
        out, state = call(q[:, :, :13], k[:, :, :13], v[:, :, :13], core.init_state(B, 21))
    with interpret_warning():
        out2, _ = call(q[:, :, 13:], k[:, :, 13:], v[:, :, 13:], state)
    assert float(jnp.max(jnp.abs(jnp.concatenate([out, out2], 2) - ref))) < 1e-5
