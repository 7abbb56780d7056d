"""The one implementation-selection rule (longctx/attention/dispatch.py): 'auto' takes a kernel with no reasons,
else XLA with one log line naming why; 'pallas' where unsupported raises listing the reasons; on CPU 'pallas'
is interpret mode with a warning. Both methods with kernels use it."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

from longctx.attention import dispatch
from pallas_kernels import eva_chunks, vq_cache

PAPER = dict(L=512, M=512, S=512, Dk=128)


def fake_reasons(platform, *, n):
    if platform == "interpret":
        return [] if n > 0 else ["n must be positive"]
    return [] if platform == "tpu" and n <= 4 else [f"n={n} too big on {platform}"]


def test_xla_is_always_xla():
    c = dispatch.resolve("xla", method="m", kernel="k", reasons_fn=fake_reasons, platform="tpu", n=1)
    assert not c.use_kernel


def test_auto_takes_the_kernel_where_supported():
    c = dispatch.resolve("auto", method="m", kernel="k", reasons_fn=fake_reasons, platform="tpu", n=2)
    assert c.use_kernel and not c.interpret and c.platform == "tpu"


def test_auto_falls_back_with_one_log_line_naming_why(caplog):
    dispatch._logged.clear()
    with caplog.at_level(logging.INFO, logger="longctx.attention.dispatch"):
        for _ in range(3):  # resolved again at every trace: still one line
            c = dispatch.resolve("auto", method="m", kernel="k", reasons_fn=fake_reasons, platform="tpu", n=9)
    assert not c.use_kernel and c.reasons == ("n=9 too big on tpu",)
    lines = [r.getMessage() for r in caplog.records if r.name == "longctx.attention.dispatch"]
    assert len(lines) == 1 and "n=9 too big on tpu" in lines[0] and "uses xla" in lines[0]


def test_auto_on_cpu_is_xla_with_a_reason(caplog):
    dispatch._logged.clear()
    with caplog.at_level(logging.INFO, logger="longctx.attention.dispatch"):
        c = dispatch.resolve("auto", method="m", kernel="k", reasons_fn=fake_reasons, platform="cpu", n=1)
    assert not c.use_kernel and "interpret" in c.reasons[0]
    assert len(caplog.records) == 1


def test_pallas_where_unsupported_raises_listing_every_reason():
    with pytest.raises(dispatch.KernelUnsupportedError, match="n=9 too big on cuda") as err:
        dispatch.resolve("pallas", method="m", kernel="k", reasons_fn=fake_reasons, platform="cuda", n=9,
                         extra_reasons=["method says no"])
    assert "method says no" in str(err.value)


def test_pallas_on_cpu_is_interpret_mode_with_a_warning():
    with pytest.warns(UserWarning, match="interpret"):
        c = dispatch.resolve("pallas", method="m", kernel="k", reasons_fn=fake_reasons, platform="cpu", n=100)
    assert c.use_kernel and c.interpret
    with pytest.raises(dispatch.KernelUnsupportedError, match="n must be positive"):
        dispatch.resolve("pallas", method="m", kernel="k", reasons_fn=fake_reasons, platform="cpu", n=0)


def test_unknown_impl_is_an_error():
    with pytest.raises(ValueError, match="allowed"):
        dispatch.resolve("triton", method="m", kernel="k", reasons_fn=fake_reasons, n=1)


# -- the real kernels' declarations through the resolver ---------------------------------------------------------
@pytest.mark.parametrize("Dv", [1536, 4096])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vq_cache_auto_takes_the_kernel_on_tpu_at_paper_shapes(Dv, dtype):
    c = dispatch.resolve("auto", method="transformer_vq", kernel="vq_cache", reasons_fn=vq_cache.unsupported_reasons,
                         platform="tpu", Dv=Dv, dtype=dtype, **PAPER)
    assert c.use_kernel


def test_vq_cache_refuses_beyond_its_vmem_budget_with_the_number():
    kw = dict(PAPER, S=4096, Dv=4096, dtype=jnp.float32)
    c = dispatch.resolve("auto", method="transformer_vq", kernel="vq_cache", reasons_fn=vq_cache.unsupported_reasons,
                         platform="tpu", **kw)
    assert not c.use_kernel and "MiB" in c.reasons[0]
    with pytest.raises(dispatch.KernelUnsupportedError, match=r"VMEM estimate \d+\.\d MiB"):
        dispatch.resolve("pallas", method="transformer_vq", kernel="vq_cache", platform="tpu",
                         reasons_fn=vq_cache.unsupported_reasons, **kw)
    c = dispatch.resolve("auto", method="transformer_vq", kernel="vq_cache", reasons_fn=vq_cache.unsupported_reasons,
                         platform="cuda", Dv=1536, dtype=jnp.float32, **PAPER)
    assert c.use_kernel  # the GPU (Pallas-Triton) form, pallas_kernels/vq_cache_gpu.py
    c = dispatch.resolve("auto", method="transformer_vq", kernel="vq_cache", reasons_fn=vq_cache.unsupported_reasons,
                         platform="rocm", Dv=1536, dtype=jnp.float32, **PAPER)
    assert not c.use_kernel and "no rocm lowering" in c.reasons[0]


def test_eva_chunks_declarations():
    c = dispatch.resolve("auto", method="eva", kernel="eva_chunk_stats", reasons_fn=eva_chunks.unsupported_reasons,
                         platform="cuda", P=8, d=64, dv=64)
    assert c.use_kernel
    c = dispatch.resolve("auto", method="eva", kernel="eva_chunk_stats", reasons_fn=eva_chunks.unsupported_reasons,
                         platform="cuda", P=6, d=64, dv=64)
    assert not c.use_kernel and "power-of-two" in c.reasons[0]


def test_methods_use_the_resolver(monkeypatch):
    """transformer_vq and eva ask dispatch.resolve (no rule of their own): with impl='pallas' where the kernel
    refuses, the method raises the resolver's error."""
    from flax import nnx

    from longctx import attention

    seen = []
    real = dispatch.resolve

    def spy(impl, **kw):
        seen.append(kw["kernel"])
        return real(impl, **kw)

    monkeypatch.setattr(dispatch, "resolve", spy)
    core = attention.build("transformer_vq", {"impl": "auto", "codebook_size": 8, "block_len": 4}, num_heads=1,
                           head_dim=8, causal=True, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 1, 8, 8))
    graphdef, state = nnx.split(core)
    jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, x, x)[0])(state, x)  # the resolver is asked while tracing
    core = attention.build("eva", {"impl": "auto", "window_size": 8, "chunk_size": 4}, num_heads=1, head_dim=8,
                           causal=True, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(core)
    jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, x, x)[0])(state, x)
    assert seen == ["vq_cache", "eva_chunk_stats", "eva_attend"]
