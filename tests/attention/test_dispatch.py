"""The one implementation-selection rule (longctx/attention/dispatch.py: select): 'auto' takes the platform's
first implementation with no reasons, with one log line naming why the ones before it were skipped; a named
implementation that refuses raises listing the reasons; on CPU a named Pallas kernel is interpret mode with a
warning, and 'auto' never takes it there. Every method selects through it."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import pytest

from longctx.attention import dispatch
from pallas_kernels import eva_chunks, vq_cache

PAPER = dict(L=512, M=512, S=512, Dk=128)


def fake_reasons(platform, *, n, **_):
    if platform == "interpret":
        return [] if n > 0 else ["n must be positive"]
    return [] if platform == "tpu" and n <= 4 else [f"n={n} too big on {platform}"]


def two_way(reasons_fn, extra=()):
    """A kernel ``pallas`` (GPU/TPU) before a portable ``xla``."""
    return (dispatch.Implementation("pallas", platforms=("tpu", "cuda", "rocm"), kernel=True,
                                    reasons=lambda plat, **s: list(extra) + list(reasons_fn(plat, **s)),
                                    auto={"tpu": 0, "cuda": 0, "rocm": 0, "cpu": 0}),
            dispatch.Implementation("xla", auto={p: 1 for p in dispatch.ALL_PLATFORMS}))


def pick(impl, reasons_fn=fake_reasons, extra=(), **kw):
    return dispatch.select(impl, two_way(reasons_fn, extra), method=kw.pop("method", "m"), **kw)


def test_xla_is_always_xla():
    c = pick("xla", platform="tpu", n=1)
    assert not c.use_kernel and c.name == "xla"


def test_auto_takes_the_kernel_where_supported():
    c = pick("auto", platform="tpu", n=2)
    assert c.use_kernel and not c.interpret and c.platform == "tpu" and c.name == "pallas"


def test_auto_falls_back_with_one_log_line_naming_why(caplog):
    dispatch._logged.clear()
    with caplog.at_level(logging.INFO, logger="longctx.attention.dispatch"):
        for _ in range(3):  # selected again at every trace: still one line
            c = pick("auto", platform="tpu", n=9)
    assert not c.use_kernel and c.reasons == ("n=9 too big on tpu",)
    lines = [r.getMessage() for r in caplog.records if r.name == "longctx.attention.dispatch"]
    assert len(lines) == 1 and "n=9 too big on tpu" in lines[0] and "uses xla" in lines[0]


def test_auto_on_cpu_never_takes_a_kernel():
    c = pick("auto", platform="cpu", n=1)
    assert not c.use_kernel and c.name == "xla"
    assert dispatch.auto_order(two_way(fake_reasons), "cpu") == ("xla",)


def test_auto_order_comes_from_the_declarations_by_rank_and_preference():
    impls = (dispatch.Implementation("reference"),  # never tried by 'auto'
             dispatch.Implementation("slow", auto={"cpu": 2, "cuda": 0}),
             dispatch.Implementation("tiles", auto={"cpu": 1}, prefer=lambda plat, *, n, **_: n > 8),
             dispatch.Implementation("kernel", kernel=True, auto={"cpu": 0, "cuda": 1}))
    assert dispatch.auto_order(impls, "cpu", n=16) == ("tiles", "slow")  # no kernel on a CPU
    assert dispatch.auto_order(impls, "cpu", n=4) == ("slow",)  # tiles not preferred for short rows
    assert dispatch.auto_order(impls, "cuda", n=16) == ("slow", "kernel")
    assert dispatch.select("auto", impls, method="m", platform="cpu", n=16).name == "tiles"
    assert dispatch.select("tiles", impls, method="m", platform="cpu", n=4).name == "tiles"  # named: no preference
    with pytest.raises(dispatch.KernelUnsupportedError, match="no implementation declared for tpu"):
        dispatch.select("auto", impls, method="m", platform="tpu", n=4)


def test_declared_collects_each_modules_implementations(tmp_path, monkeypatch):
    pkg = tmp_path / "fakemethod"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, impl in (("b_impl", "second"), ("a_impl", "first")):
        (pkg / f"{name}.py").write_text("from longctx.attention.dispatch import Implementation\n"
                                        f"IMPLEMENTATIONS = (Implementation({impl!r}),)\n")
    (pkg / "helpers.py").write_text("X = 1\n")  # no declarations: skipped
    monkeypatch.syspath_prepend(str(tmp_path))
    ref = dispatch.Implementation("reference")
    assert [i.name for i in dispatch.declared("fakemethod", first=(ref,))] == ["reference", "first", "second"]
    with pytest.raises(ValueError, match="declared twice: reference"):
        dispatch.declared("fakemethod", first=(ref, ref))


def test_a_named_kernel_where_unsupported_raises_listing_every_reason():
    with pytest.raises(dispatch.KernelUnsupportedError, match="n=9 too big on cuda") as err:
        pick("pallas", extra=["method says no"], platform="cuda", n=9)
    assert "method says no" in str(err.value)
    c = pick("pallas,xla", platform="cuda", n=9)  # a list falls through to the next name
    assert c.name == "xla" and "n=9 too big on cuda" in c.reasons


def test_pallas_on_cpu_is_interpret_mode_with_a_warning():
    with pytest.warns(UserWarning, match="interpret"):
        c = pick("pallas", platform="cpu", n=100)
    assert c.use_kernel and c.interpret
    with pytest.raises(dispatch.KernelUnsupportedError, match="n must be positive"):
        pick("pallas", platform="cpu", n=0)


def test_unknown_impl_is_an_error():
    with pytest.raises(ValueError, match="allowed"):
        pick("triton", platform="cpu", n=1)
    with pytest.raises(ValueError, match="stands alone"):
        pick("auto,xla", platform="cpu", n=1)


# -- the real kernels' declarations through the rule ---------------------------------------------------------------
@pytest.mark.parametrize("Dv", [1536, 4096])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vq_cache_auto_takes_the_kernel_on_tpu_at_paper_shapes(Dv, dtype):
    c = pick("auto", vq_cache.unsupported_reasons, method="transformer_vq", platform="tpu", Dv=Dv, dtype=dtype,
             **PAPER)
    assert c.use_kernel


def test_vq_cache_refuses_beyond_its_vmem_budget_with_the_number():
    kw = dict(PAPER, S=4096, Dv=4096, dtype=jnp.float32)
    c = pick("auto", vq_cache.unsupported_reasons, platform="tpu", **kw)
    assert not c.use_kernel and "MiB" in c.reasons[0]
    with pytest.raises(dispatch.KernelUnsupportedError, match=r"VMEM estimate \d+\.\d MiB"):
        pick("pallas", vq_cache.unsupported_reasons, platform="tpu", **kw)
    c = pick("auto", vq_cache.unsupported_reasons, platform="cuda", Dv=1536, dtype=jnp.float32, **PAPER)
    assert c.use_kernel  # the GPU (Pallas-Triton) form, pallas_kernels/vq_cache_gpu.py
    c = pick("auto", vq_cache.unsupported_reasons, platform="rocm", Dv=1536, dtype=jnp.float32, **PAPER)
    assert not c.use_kernel and "no rocm lowering" in c.reasons[0]


def test_eva_chunks_declarations():
    c = pick("auto", eva_chunks.unsupported_reasons, platform="cuda", P=8, d=64, dv=64)
    assert c.use_kernel
    c = pick("auto", eva_chunks.unsupported_reasons, platform="cuda", P=6, d=64, dv=64)
    assert not c.use_kernel and "power-of-two" in c.reasons[0]
