"""dense on every platform (longctx/attention/dense/platform.py): cuDNN flash attention on GPUs, splash attention on
TPUs, chosen by the shared implementation rule (``dispatch.select`` with dense's per-platform order, ``dense.choose``).

* The reasons each kernel declares, and the rule: 'auto' takes the platform's kernel where it has none, else the
  XLA path with one log line naming why (a KV-cache step, fp32 inputs, ...); an explicit kernel where it cannot
  serve raises listing every reason; on the CPU 'auto' is exactly today's XLA program.
* The wiring on this CPU: the cuDNN call's layout, scale, causal flag and key lengths run through jax's XLA
  implementation of the same ``jax.nn.dot_product_attention`` call, and splash in Pallas interpret mode; values
  and gradients against dense's reference.
* ``jax.export`` lowering of ``impl='cudnn'`` for 'cuda' and ``impl='splash'`` for 'tpu', forward and backward.
  A CPU-only jaxlib has no cuDNN to ask its version of: ``jax.nn.dot_product_attention(implementation='cudnn')``
  calls ``check_cudnn_version()`` first, which raises "cuDNN is not detected" there. The version only gates
  device checks (compute capability 10.3, the different-value-dim form) and does not enter the lowered module,
  so the export tests stand in a stated cuDNN version for that probe (``fake_cudnn``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longctx import attention
from longctx.attention import dense, dispatch
from longctx.attention.dense import naive_attention, xla_cpu
from longctx.attention.dense import platform as dp
from longctx.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from kernel_test_base import assert_close, weighted_sum  # noqa: E402

BF16, F32, F16 = jnp.bfloat16, jnp.float32, jnp.float16
CUDNN_FWD, CUDNN_BWD = "__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"
LOGGER = "longctx.attention.dispatch"


def qkv(T, B=2, H=2, D=16, Dv=None, dtype=F32, seed=0):
    r = np.random.default_rng(seed)
    shapes = ((B, H, T, D), (B, H, T, D), (B, H, T, Dv or D))
    return tuple(jnp.asarray(r.standard_normal(s), dtype) for s in shapes)


def full(T):
    pos = jnp.arange(T, dtype=jnp.int32)
    return pos, pos, jnp.ones((T,), bool)


def log_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


# ------------------------------------------------------------------------------------------------ declared reasons
def test_cudnn_serves_bf16_and_fp16_full_passes_on_cuda():
    for dtype in (BF16, F16):
        for d in (64, 128):
            assert dp.cudnn_unsupported_reasons("cuda", dtype=dtype, head_dim=d, value_dim=d) == []


def test_cudnn_reasons_name_every_limit():
    r = dp.cudnn_unsupported_reasons("cuda", dtype=F32, head_dim=260, value_dim=32, kv_cache=True, capability=(8, 0))
    text = " | ".join(r)
    assert len(r) == 4
    for part in ("float32", "head_dim=260", "value_dim=32", "KV-cache"):
        assert part in text
    assert any("NVIDIA" in x for x in dp.cudnn_unsupported_reasons("tpu", dtype=BF16, head_dim=64))
    assert any("NVIDIA" in x for x in dp.cudnn_unsupported_reasons("cpu", dtype=BF16, head_dim=64))
    mixed = dp.cudnn_unsupported_reasons("cuda", dtype=BF16, k_dtype=F16, head_dim=64)
    assert any("differ" in x for x in mixed)


def test_cudnn_head_dim_limit_follows_the_device():
    assert dp.cudnn_unsupported_reasons("cuda", dtype=BF16, head_dim=72) == []  # any multiple of 8
    assert dp.cudnn_unsupported_reasons("cuda", dtype=BF16, head_dim=41) == []  # padded to 48
    assert dp.cudnn_unsupported_reasons("cuda", dtype=BF16, head_dim=256, capability=(9, 0)) == []  # Hopper
    assert any("up to 128" in x for x in dp.cudnn_unsupported_reasons("cuda", dtype=BF16, head_dim=256,
                                                                       capability=(8, 0)))
    assert dp.cudnn_unsupported_reasons("cuda", dtype=BF16, head_dim=127, capability=(8, 0)) == []  # padded: 128
    assert any("up to 128" in x for x in dp.cudnn_unsupported_reasons("cuda", dtype=BF16, head_dim=129,
                                                                       capability=(8, 0)))  # padded to 136
    # no capability given: the running GPU's; none visible (lowering from a CPU): jax checks against 128, so the
    # declaration does too
    on_hopper = jax.default_backend() == "gpu" and tuple(
        int(x) for x in jax.devices()[0].compute_capability.split("."))[:2] >= (9, 0)
    reasons = dp.cudnn_unsupported_reasons("cuda", dtype=BF16, head_dim=256)
    assert (reasons == []) if on_hopper else any("up to 128" in x for x in reasons)


MLA = dict(dtype=BF16, head_dim=128, value_dim=384)  # Transformer-VQ's exact layers: keys of 128, values of 384


def test_cudnn_value_chunks():
    """A value is padded to a multiple of 8 and split into the fewest chunks of at most 256 columns, as even as the
    granule of 8 allows; cuDNN's different-value-width form is needed where a chunk is not as wide as the padded key."""
    assert dp.cudnn_value_chunks(128) == (128,) and dp.cudnn_value_chunks(41) == (48,)
    assert dp.cudnn_value_chunks(384) == (192, 192) and dp.cudnn_value_chunks(1536) == (256,) * 6
    assert dp.cudnn_value_chunks(300) == (152, 152) and dp.cudnn_value_chunks(257) == (136, 128)
    for dv in range(1, 1100):
        w = dp.cudnn_value_chunks(dv)
        assert sum(w) == dp.cudnn_head_dim(dv) and all(x % 8 == 0 and 0 < x <= 256 for x in w), dv
        assert len(w) == -(-dp.cudnn_head_dim(dv) // 256) and max(w) - min(w) <= 8, dv
    assert not any(dp.cudnn_mla(d, dv) for d, dv in ((128, 128), (128, None), (41, 48), (48, 41), (256, 512)))
    assert all(dp.cudnn_mla(d, dv) for d, dv in ((128, 384), (128, 64), (64, 128), (128, 1536)))


def test_cudnn_takes_a_different_value_width_on_hopper():
    for dtype in (BF16, F16):
        for dv in (64, 384, 1536, 300, 41):
            assert dp.cudnn_unsupported_reasons("cuda", **{**MLA, "dtype": dtype, "value_dim": dv},
                                                capability=(9, 0)) == [], (dtype, dv)
    (line,) = dp.cudnn_unsupported_reasons("cuda", **MLA, capability=(8, 0))
    assert "value_dim=384 != head_dim=128" in line and "Hopper" in line and "8.0" in line and "\n" not in line
    # a value width that pads to the key's needs no different-value-width form, before Hopper too
    assert dp.cudnn_unsupported_reasons("cuda", dtype=BF16, head_dim=41, value_dim=48, capability=(8, 0)) == []
    (line,) = dp.cudnn_unsupported_reasons("cuda", **{**MLA, "dtype": F32}, capability=(9, 0))
    assert "float32" in line
    for kw, why in ((dict(window=16), "window=16"), (dict(sequence_slice=128), "sequence parallelism"),
                    (dict(segments=True), "_fix_seqlen_offsets")):
        (line,) = dp.cudnn_unsupported_reasons("cuda", **MLA, capability=(9, 0), **kw)
        assert why in line and "value_dim=384" in line, kw
    # no GPU visible (lowering from a CPU): no capability to check the form's against, as jax's own check
    if dp._cuda_capability() is None:
        (line,) = dp.cudnn_unsupported_reasons("cuda", **MLA)
        assert "Hopper" in line


def test_cudnn_different_value_width_and_the_cudnn_versions_it_needs(monkeypatch):
    hopper = dict(capability=(9, 0))
    monkeypatch.setattr(dp, "_cudnn_version", lambda: 90800)
    (line,) = dp.cudnn_unsupported_reasons("cuda", **MLA, **hopper)
    assert "90800 < 91000" in line
    assert dp.cudnn_unsupported_reasons("cuda", dtype=BF16, head_dim=128, value_dim=128, **hopper) == []
    # 9.11 and 9.12 have no backward for keys of (128, 192] with values of (64, 128], but for 192 with 128
    monkeypatch.setattr(dp, "_cudnn_version", lambda: 91100)
    assert dp.cudnn_unsupported_reasons("cuda", **MLA, **hopper) == []
    (line,) = dp.cudnn_unsupported_reasons("cuda", dtype=BF16, head_dim=160, value_dim=128, **hopper)
    assert "no backward" in line and "91100" in line
    assert dp.cudnn_unsupported_reasons("cuda", dtype=BF16, head_dim=192, value_dim=128, **hopper) == []
    monkeypatch.setattr(dp, "_cudnn_version", lambda: 91300)
    assert dp.cudnn_unsupported_reasons("cuda", dtype=BF16, head_dim=160, value_dim=128, **hopper) == []


def test_splash_reasons():
    assert dp.splash_unsupported_reasons("tpu", dtype=BF16, head_dim=128) == []
    assert dp.splash_unsupported_reasons("tpu", dtype=F32, head_dim=64, value_dim=256) == []
    r = dp.splash_unsupported_reasons("tpu", dtype=F16, head_dim=96, kv_cache=True)
    assert len(r) == 3 and "float16" in r[0] and "head_dim=96" in r[1] and "KV-cache" in r[2]
    assert any("TPU" in x for x in dp.splash_unsupported_reasons("cuda", dtype=BF16, head_dim=128))
    # interpret mode (CPU) computes any head size
    assert dp.splash_unsupported_reasons("interpret", dtype=F32, head_dim=8, value_dim=12) == []


# ------------------------------------------------------------------------------------------------ the rule
@pytest.fixture
def fresh_log(caplog):
    dispatch._logged.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        yield caplog


def test_auto_takes_cudnn_on_cuda_and_splash_on_tpu(fresh_log):
    assert dense.choose("auto", platform="cuda", dtype=BF16, head_dim=64).name == "cudnn"
    assert dense.choose("auto", platform="tpu", dtype=BF16, head_dim=128).name == "splash"
    assert dense.choose("auto", platform="tpu", dtype=F32, head_dim=64).name == "splash"
    assert log_lines(fresh_log) == []


@pytest.mark.parametrize("platform, kw, why", [
    ("cuda", dict(dtype=F32, head_dim=64), "float32"),
    ("cuda", dict(dtype=BF16, head_dim=64, kv_cache=True), "KV-cache"),
    ("cuda", dict(dtype=BF16, head_dim=264), "head_dim=264"),
    ("tpu", dict(dtype=BF16, head_dim=128, kv_cache=True), "KV-cache"),
    ("tpu", dict(dtype=BF16, head_dim=96), "head_dim=96"),
])
@pytest.mark.parametrize("large", [False, True])
def test_auto_falls_back_to_xla_with_one_line_naming_why(fresh_log, platform, kw, why, large):
    for _ in range(3):  # resolved at every trace: still one line
        c = dense.choose("auto", platform=platform, large=large, **kw)
    fallback = "blockwise" if large else "reference"
    assert c.name == fallback and any(why in r for r in c.reasons)
    lines = log_lines(fresh_log)
    assert len(lines) == 1 and why in lines[0] and f"uses {fallback}" in lines[0] and platform in lines[0]


def test_auto_on_cpu_is_xla_without_a_line(fresh_log):
    for kv_cache in (False, True):
        assert dense.choose("auto", platform="cpu", dtype=BF16, head_dim=64, kv_cache=kv_cache).name == "reference"
        c = dense.choose("auto", platform="cpu", dtype=BF16, head_dim=64, kv_cache=kv_cache, large=True)
        assert c.name == "xla_cpu" and c.reasons == ()
    assert log_lines(fresh_log) == []


def test_explicit_cudnn_where_unsupported_raises_listing_every_reason():
    for kv_cache in (False, True):
        with pytest.raises(dispatch.KernelUnsupportedError) as err:
            dense.choose("cudnn", platform="cuda", dtype=F32, head_dim=60, value_dim=32, kv_cache=kv_cache)
        for part in ("float32", "head_dim=60", "value_dim=32", "impl='auto'") + (("KV-cache",) if kv_cache else ()):
            assert part in str(err.value)
    with pytest.raises(dispatch.KernelUnsupportedError, match="NVIDIA"):
        dense.choose("cudnn", platform="cpu", dtype=BF16, head_dim=64)
    with pytest.raises(dispatch.KernelUnsupportedError, match="TPU"):
        dense.choose("splash", platform="cuda", dtype=BF16, head_dim=64)
    with pytest.raises(dispatch.KernelUnsupportedError, match="xla_cpu runs on cpu"):
        dense.choose("xla_cpu", platform="cuda", dtype=BF16, head_dim=64)


@pytest.mark.parametrize("impl, large, fallback", [("cudnn", False, "reference"), ("cudnn", True, "blockwise"),
                                                   ("cudnn,reference", True, "reference")])
def test_explicit_kernel_decodes_by_the_xla_path(fresh_log, impl, large, fallback):
    """A KV-cache step is the one form the kernels never compute: it takes XLA under an explicit impl too (the rest
    of a list, else the platform's XLA order), with one line."""
    c = dense.choose(impl, platform="cuda", dtype=BF16, head_dim=64, kv_cache=True, large=large)
    assert c.name == fallback
    lines = log_lines(fresh_log)
    assert len(lines) == 1 and "KV-cache" in lines[0] and fallback in lines[0]


def test_explicit_splash_on_cpu_is_interpret_mode_with_a_warning():
    with pytest.warns(UserWarning, match="interpret"):
        c = dense.choose("splash", platform="cpu", dtype=F32, head_dim=8)
    assert c.name == "splash" and c.interpret


@pytest.mark.parametrize("impl, name", [("reference", "reference"), ("blockwise", "blockwise")])
def test_xla_impls_stay_xla_everywhere(impl, name):
    for plat in ("cpu", "cuda", "tpu"):
        for kv_cache in (False, True):
            assert dense.choose(impl, platform=plat, dtype=BF16, head_dim=64, kv_cache=kv_cache).name == name


def test_config_accepts_the_kernels_and_bench_lists_them_on_their_platform(monkeypatch):
    for impl in ("cudnn", "splash"):
        cfg = attention.default_config("dense")
        cfg.impl = impl
        attention.validate("dense", cfg, causal=True)
    cfg = attention.default_config("dense")
    cfg.impl = "flash"
    with pytest.raises(ConfigError, match="cudnn"):
        attention.validate("dense", cfg, causal=True)
    # a CPU: the labels as before, the tiles by their CPU form (pinned: this file also runs on a GPU)
    assert dense.DenseAttention.bench_variants("cpu") == {"naive": {"impl": "reference"},
                                                          "blockwise": {"impl": "xla_cpu"}}
    variants = dense.DenseAttention.bench_variants("cuda")
    assert variants["cudnn"] == {"impl": "cudnn"} and variants["blockwise"] == {"impl": "blockwise"}


# ------------------------------------------------------------------------------------------------ CPU unchanged
@pytest.mark.parametrize("T, threshold", [(64, 4096 * 4096), (64, 16)])  # reference; the unrolled tiles
@pytest.mark.parametrize("full_pass", [True, False])
def test_auto_on_cpu_is_the_reference_or_xla_cpu_by_threshold(fresh_log, T, threshold, full_pass):
    q, k, v = qkv(T)
    pos = full(T)
    kw = dict(causal=True, block_q=16, block_k=16)

    def rule(q, k, v):  # blockwise past the threshold (on a CPU by XLA:CPU's ops), else the reference
        if T * T > threshold:
            return xla_cpu.attend(q, k, v, *pos, full_pass=full_pass, **kw)
        return naive_attention(q, k, v, *pos, causal=True)

    def now(q, k, v):
        return dense.attend(q, k, v, *pos, impl="auto", auto_threshold=threshold, full_pass=full_pass,
                            platform="cpu", **kw)  # the CPU's rule, wherever the suite runs

    assert str(jax.make_jaxpr(now)(q, k, v)) == str(jax.make_jaxpr(rule)(q, k, v))
    assert log_lines(fresh_log) == []


# ------------------------------------------------------------------------------------------------ the wiring, here
def naive_padded(q, k, v, lengths, causal):
    """dense's reference, one row at a time, keys from lengths[b] on masked."""
    T = q.shape[2]
    pos = jnp.arange(T, dtype=jnp.int32)
    rows = [naive_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], pos, pos, pos < int(lengths[b]), causal=causal)
            for b in range(q.shape[0])]
    return jnp.concatenate(rows, axis=0)


def check_values_and_grads(fn, ref, args, tol, gtol):
    out, out_ref = jax.jit(fn)(*args), jax.jit(ref)(*args)
    assert_close(out_ref, out, tol, "output")
    assert float(jnp.max(jnp.abs(out_ref.astype(F32)))) > 1e-2
    loss = lambda f: lambda *a: weighted_sum(f(*a))  # noqa: E731
    g = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(*args)
    g_ref = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(*args)
    for name, a, b in zip("qkv", g_ref, g):
        assert_close(a, b, gtol, f"d/d{name}")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded,D", [(False, 16), (True, 16), (False, 41)])
def test_cudnn_call_on_the_xla_implementation_matches_naive(causal, padded, D):
    """The cuDNN path's own call (layout, scale, causal flag, key lengths, a head dim zero-padded to a multiple of
    8) on jax's XLA implementation."""
    T = 48
    lengths = np.asarray([T, 29] if padded else [T, T], np.int32)
    args = qkv(T, D=D)

    def fn(q, k, v):
        return dp.cudnn_attention(q, k, v, causal=causal, kv_lengths=lengths if padded else None,
                                  implementation="xla")

    def ref(q, k, v):
        out = naive_padded(q, k, v, lengths, causal)
        if padded and not causal:  # a query's row past its row's length is padding too: compare real rows
            return out * (jnp.arange(T) < lengths[:, None])[:, None, :, None]
        return out

    def fn_rows(q, k, v):
        out = fn(q, k, v)
        return out * (jnp.arange(T) < lengths[:, None])[:, None, :, None] if padded and not causal else out

    check_values_and_grads(fn_rows, ref, args, (2e-5, 2e-5), (2e-5, 2e-5))


@pytest.mark.parametrize("D, Dv, form", [(16, 24, "causal"), (16, 300, "padded"), (16, 8, "bidirectional"),
                                         (41, 7, "window"), (16, 40, "offset")])
def test_cudnn_call_with_a_value_width_of_its_own_matches_naive(D, Dv, form):
    """A value width other than the key's, padded on its own and in chunks of at most 256 columns (300: two of
    152), on jax's XLA implementation (the different-value-width call's CPU stand-in: q, k, v padded to one
    width), causal, with key lengths, bidirectional, a sliding window, a query offset (a sequence-parallel slice's
    mask); values and gradients against the reference."""
    T = 48
    lengths = np.asarray([T, 29], np.int32)
    args = qkv(T, D=D, Dv=Dv)
    causal = form != "bidirectional"
    kw = dict(kv_lengths=lengths if form == "padded" else None, window=12 if form == "window" else 0,
              q_offset=16 if form == "offset" else None)
    pos = full(T)

    def fn(q, k, v):
        if form == "offset":  # the queries are rows 16 .. 47 of the keys' row
            q = q[:, :, 16:]
        return dp.cudnn_attention(q, k, v, causal=causal, implementation="xla", **kw)

    def ref(q, k, v):
        if form == "padded":
            return naive_padded(q, k, v, lengths, causal)
        if form == "offset":
            return naive_attention(q, k, v, *pos, causal=True)[:, :, 16:]
        return naive_attention(q, k, v, *pos, causal=causal, window=kw["window"])

    check_values_and_grads(fn, ref, args, (2e-5, 2e-5), (2e-5, 2e-5))


@pytest.mark.parametrize("T, Dv, dtype, causal", [(200, None, "float32", True), (200, None, "float32", False),
                                                  (128, 24, "float32", True), (136, None, "bfloat16", False)])
def test_splash_in_interpret_mode_matches_naive(T, Dv, dtype, causal):
    """Whole and padded blocks (200, 136: bidirectionally, segment ids mask the padding), a value dim of its own,
    bf16. (The layer's KV-cache steps by XLA against its splash full passes: the contract suite's 'splash' case.)"""
    dt = jnp.dtype(dtype)
    args = qkv(T, D=16, Dv=Dv, dtype=dt)
    pos = full(T)
    tol = (2e-5, 2e-5) if dtype == "float32" else (2e-2, 2e-2)
    check_values_and_grads(lambda q, k, v: dp.splash_attention(q, k, v, causal=causal, interpret=True),
                           lambda q, k, v: naive_attention(q, k, v, *pos, causal=causal), args, tol, tol)


ON_DEVICE = dp.PLATFORM_KERNEL.get(dispatch.current_platform())


@pytest.mark.skipif(ON_DEVICE is None, reason="needs a GPU (cuDNN) or a TPU (splash) to run compiled")
@pytest.mark.parametrize("causal", [True, False])
def test_platform_kernel_compiled_matches_naive(causal):
    """On the device: dense's 'auto' takes the platform's kernel for bf16 and agrees with the naive path."""
    T = 512
    args = qkv(T, D=64, dtype=BF16)
    pos = full(T)
    assert dense.choose("auto", platform=dispatch.current_platform(), dtype=BF16, head_dim=64).name == ON_DEVICE

    def fn(q, k, v):
        return dense.attend(q, k, v, *pos, causal=causal, impl=ON_DEVICE, block_q=128, block_k=128,
                            auto_threshold=1, full_pass=True, platform=dispatch.current_platform())

    check_values_and_grads(fn, lambda q, k, v: naive_attention(q, k, v, *pos, causal=causal), args,
                           (2e-2, 2e-2), (5e-2, 5e-2))


# ------------------------------------------------------------------------------------------------ export
@pytest.fixture
def fake_cudnn(monkeypatch):
    """The cuDNN version probe answered for a CPU-only jaxlib (see the module docstring)."""
    from jax._src.cudnn import fused_attention_stablehlo as fas

    monkeypatch.setattr(fas, "check_cudnn_version", lambda: 90800)


def export(fn, platform, args, disabled=()):
    return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=list(disabled))(*args)


def export_fwd_bwd(impl, platform, causal, args, disabled=()):
    T = args[0].shape[2]
    pos = full(T)

    def fwd(q, k, v):
        return dense.attend(q, k, v, *pos, causal=causal, impl=impl, block_q=64, block_k=64,
                            auto_threshold=4096 * 4096, full_pass=True, platform=platform)

    g = jax.grad(lambda *a: weighted_sum(fwd(*a)), argnums=(0, 1, 2))
    return export(fwd, platform, args, disabled).mlir_module(), export(g, platform, args, disabled).mlir_module()


CUDNN_CHECKS = [jax.export.DisabledSafetyCheck.custom_call(n) for n in (CUDNN_FWD, CUDNN_BWD)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("impl", ["cudnn", "auto"])
def test_cudnn_lowers_for_cuda(fake_cudnn, causal, impl):
    fwd, bwd = export_fwd_bwd(impl, "cuda", causal, qkv(256, D=64, dtype=BF16), CUDNN_CHECKS)
    assert f"@{CUDNN_FWD}(" in fwd and f"@{CUDNN_BWD}(" not in fwd
    assert f"@{CUDNN_FWD}(" in bwd and f"@{CUDNN_BWD}(" in bwd
    masks = set(re.findall(r'mask_type\\22: \\22(\w+)', fwd))
    assert masks == {"CAUSAL" if causal else "NO_MASK"}
    assert "fmha_scale\\22: 1.250000e-01" in fwd or "fmha_scale\\22: 0.125" in fwd  # 64 ** -0.5


def test_cudnn_pads_an_odd_head_dim_for_cuda(fake_cudnn):
    """WikiText-103's heads of 41: the cuDNN call sees 48 columns and the true scale 41 ** -0.5."""
    fwd, bwd = export_fwd_bwd("auto", "cuda", True, qkv(256, D=41, dtype=BF16), CUDNN_CHECKS)
    assert f"@{CUDNN_FWD}(" in fwd and f"@{CUDNN_BWD}(" in bwd
    assert re.search(r"tensor<2x256x\d+x48xbf16>", fwd), "q, k, v reach cuDNN padded to 48 columns"
    assert re.search(r"fmha_scale\\22: 0?\.15617", fwd), "the scale of the true head dim"


CUDNN_BIAS_CHECKS = CUDNN_CHECKS + [jax.export.DisabledSafetyCheck.custom_call(n) for n in
                                    ("__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")]


@pytest.mark.parametrize("causal, padded, offset, window", [(True, False, False, 0), (False, True, False, 0),
                                                            (True, True, False, 0), (False, False, True, 0),
                                                            (True, False, False, 16)])
def test_cudnn_mla_call_lowers_as_the_public_entry(fake_cudnn, causal, padded, offset, window):
    """The different-value-width call (jax's private entry given what the public entry would give it) lowers, for
    a value as wide as the key, to the module the public entry lowers to, forward and gradient: the same mask
    type, query and key lengths, sliding window and mask."""
    B, T, H, D = 2, 256, 2, 64
    q = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, H, D)), BF16)
    n = jnp.asarray([T, 200], jnp.int32)
    mask = (jnp.arange(T)[None, :] <= 64 + jnp.arange(T)[:, None])[None, None] if offset else None

    def lowered(call, grad):
        def attn(q, k, v, n):
            return call(q, k, v, mask=mask, causal=causal, scale=D ** -0.5, kv_lengths=n if padded else None,
                        window=window, implementation="cudnn")

        fn = jax.grad(lambda *a: weighted_sum(attn(*a)), argnums=(0, 1, 2)) if grad else attn
        text = export(fn, "cuda", (q, q, q, n), CUDNN_BIAS_CHECKS).mlir_module()
        return [re.sub(r"\s*loc\(.*\)$", "", x) for x in text.splitlines() if not x.startswith("#loc")]

    for grad in (False, True):
        public = lowered(dp._cudnn_call, grad)
        assert any("__cudnn$" in x for x in public)
        assert lowered(dp._cudnn_mla_call, grad) == public, grad


@pytest.fixture
def fake_hopper_mla(fake_hopper, monkeypatch):
    """``fake_hopper`` with the version probe answered 9.10, the first cuDNN jax's different-value-width check
    takes (the version gates that check only and does not enter the lowered module)."""
    from jax._src.cudnn import fused_attention_stablehlo as fas

    monkeypatch.setattr(fas, "check_cudnn_version", lambda: dp.CUDNN_MLA_CUDNN)


def cudnn_operands(mod: str, target: str) -> list[str]:
    """The operand types of each call of ``target`` in a lowered module's text."""
    return [x.rsplit(" : (", 1)[1].split(")")[0] for x in mod.splitlines() if f"@{target}(" in x]


@pytest.mark.parametrize("impl", ["cudnn", "auto"])
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_lowers_a_different_value_width_for_hopper(fake_hopper_mla, impl, causal):
    """Keys of 128 and values of 384 (Transformer-VQ's exact layers), bf16, lowered for a Hopper GPU: the forward is
    two calls of cuDNN's different-value-width form, one per chunk of 192 value columns, and the gradient adds one
    backward call per chunk (dq, dk of 128 columns, dv of 192)."""
    B, H, T = 2, 2, 256
    assert dense.choose(impl, platform="cuda", **MLA).name == "cudnn"
    fwd, bwd = export_fwd_bwd(impl, "cuda", causal, qkv(T, B=B, H=H, D=128, Dv=384, dtype=BF16), CUDNN_CHECKS)
    qk, vc = f"tensor<{B}x{T}x{H}x128xbf16>", f"tensor<{B}x{T}x{H}x192xbf16>"
    for mod in (fwd, bwd):
        assert cudnn_operands(mod, CUDNN_FWD) == [f"{qk}, {qk}, {vc}"] * 2
        assert set(re.findall(r'mask_type\\22: \\22(\w+)', mod)) == {"CAUSAL" if causal else "NO_MASK"}
    assert cudnn_operands(fwd, CUDNN_BWD) == []
    stats = f"tensor<{B}x{H}x{T}xf32>"
    assert cudnn_operands(bwd, CUDNN_BWD) == [f"{qk}, {qk}, {vc}, {stats}, {vc}, {vc}"] * 2


def test_cudnn_key_lengths_lower_as_a_padding_mask(fake_cudnn):
    q, k, v = qkv(256, D=64, dtype=BF16)
    lengths = jnp.asarray([256, 200], jnp.int32)
    mod = export(lambda q, k, v, n: dp.cudnn_attention(q, k, v, causal=True, kv_lengths=n), "cuda",
                 (q, k, v, lengths), CUDNN_CHECKS).mlir_module()
    assert set(re.findall(r'mask_type\\22: \\22(\w+)', mod)) == {"PADDING_CAUSAL"}


def test_auto_lowers_fp32_and_decode_steps_without_cudnn_for_cuda(fake_cudnn):
    fwd, bwd = export_fwd_bwd("auto", "cuda", True, qkv(128, D=64, dtype=F32))
    assert "__cudnn$" not in fwd and "__cudnn$" not in bwd
    q, k, v = qkv(128, D=64, dtype=BF16)
    pos = full(128)
    mod = export(lambda q, k, v: dense.attend(q, k, v, *pos, causal=True, impl="cudnn", block_q=64, block_k=64,
                                              auto_threshold=1, full_pass=False, platform="cuda"),
                 "cuda", (q, k, v)).mlir_module()
    assert "__cudnn$" not in mod


def test_cudnn_refuses_fp32_when_lowering_for_cuda():
    with pytest.raises(dispatch.KernelUnsupportedError, match="float32"):
        export_fwd_bwd("cudnn", "cuda", True, qkv(128, D=64, dtype=F32))


@pytest.mark.parametrize("causal", [True, False])
def test_splash_lowers_for_tpu(causal):
    # 640 tokens: two 512-token blocks with the second padded (a segment-id mask when bidirectional)
    fwd, bwd = export_fwd_bwd("splash", "tpu", causal, qkv(640, B=1, D=128, dtype=BF16))
    n_fwd = fwd.count("tpu_custom_call")
    assert n_fwd >= 1 and bwd.count("tpu_custom_call") > n_fwd


def test_splash_refuses_a_head_dim_tpu_blocks_cannot_take():
    with pytest.raises(dispatch.KernelUnsupportedError, match="head_dim=96"):
        export_fwd_bwd("splash", "tpu", True, qkv(256, B=1, D=96, dtype=BF16))


# ------------------------------------------------------------------------------------------------ packed rows
# rows of 16 tokens: documents of 5, 1, 7, 3, one document, every token its own document (M = T documents: the
# bound itself), and 1 + 15
PACKED_ROWS = [[1] * 5 + [2] + [3] * 7 + [4] * 3, [7] * 16, list(range(1, 17)), [4] + [2] * 15]
# an id that comes back after another starts a new document (longctx.attention.base.document_starts)
RETURNING_ID = [1] * 5 + [2] + [1] * 7 + [3] * 3


def documents(row) -> list[tuple[int, int]]:
    """(start, length) of each document of one row of segment ids, read with a plain loop."""
    out = []
    for i, s in enumerate(row):
        if i and s == row[i - 1]:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def test_cudnn_packed_layout_matches_a_numpy_reading():
    """The packed layout computed from segment ids (traced) against a loop's reading of the rows, and what jax's
    packed entry hands cuDNN from it (its ``_fix_seqlen_offsets``: the B*M sequences flattened, token offsets times
    the token stride): every document of every row once, in order, then empty sequences."""
    from jax._src.cudnn import fused_attention_stablehlo as fas

    rows = PACKED_ROWS + [RETURNING_ID]
    seg = jnp.asarray(rows, jnp.int32)
    B, T = seg.shape
    lengths, offsets = jax.jit(dp.cudnn_packed_layout)(seg)
    assert lengths.shape == (B, T) and offsets.shape == (B, T + 1)
    want_len, want_off = np.full((B, T), -1), np.full((B, T + 1), -1)
    for b, row in enumerate(rows):
        docs = documents(row)
        want_off[b, :len(docs)] = [s for s, _ in docs]
        want_len[b, :len(docs)] = [n for _, n in docs]
    np.testing.assert_array_equal(lengths, want_len)
    np.testing.assert_array_equal(offsets, want_off)
    H, D = 3, 8
    x = jnp.zeros((B, T, H, D), BF16)  # jax's packed layout is [B, T, H, D]
    q_len, _, q_off, _ = fas._fix_seqlen_offsets(lengths, lengths, offsets, offsets, x, x)
    flat = [(b * T + s, n) for b, row in enumerate(rows) for s, n in documents(row)]
    S = len(flat)
    np.testing.assert_array_equal(np.ravel(q_len)[:S], [n for _, n in flat])
    assert not np.ravel(q_len)[S:].any()
    np.testing.assert_array_equal(np.ravel(q_off)[:S], [o * H * D for o, _ in flat])
    assert (np.ravel(q_off)[S:] == B * T * H * D).all()  # the end of the last sequence, and the empty ones


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_packed_sequences_attend_as_the_packed_reference(causal):
    """cuDNN's packed semantics read on the CPU: each of the layout's sequences (tokens offsets[m] ..
    offsets[m] + lengths[m] of its row) attended alone (the reference, causal from its first token) gives, token for
    token, the reference over the packed row with its segment ids. (That cuDNN computes these sequences is what
    the compiled test below shows on a lent Hopper GPU.)"""
    seg = jnp.asarray(PACKED_ROWS, jnp.int32)
    B, T = seg.shape
    q, k, v = qkv(T, B=B)
    lengths, offsets = dp.cudnn_packed_layout(seg)
    out = np.zeros(q.shape, np.float32)
    for b in range(B):
        for m in range(T):
            if int(lengths[b, m]) < 0:
                continue
            sl = slice(int(offsets[b, m]), int(offsets[b, m]) + int(lengths[b, m]))
            pos = full(sl.stop - sl.start)
            out[b:b + 1, :, sl] = naive_attention(q[b:b + 1, :, sl], k[b:b + 1, :, sl], v[b:b + 1, :, sl], *pos,
                                                  causal=causal)
    pos = full(T)
    ref = naive_attention(q, k, v, *pos, causal=causal, q_segment_ids=seg, k_segment_ids=seg)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_cudnn_packed_api_and_the_jax_versions_it_needs(monkeypatch):
    assert dp.cudnn_packed_api() is not None  # the installed jax has it (0.7.0 or later)
    monkeypatch.setattr(dp, "_jax_version", lambda: (0, 6, 2))
    assert dp.cudnn_packed_api() is None
    (line,) = [r for r in dp.cudnn_unsupported_reasons("cuda", dtype=BF16, head_dim=64, capability=(9, 0),
                                                       segments=True)]
    assert "no cuDNN packed layout" in line and "jax >= 0.7.0" in line and "\n" not in line


def test_cudnn_packed_reasons():
    hopper = dict(dtype=BF16, head_dim=64, capability=(9, 0), segments=True)
    assert dp.cudnn_unsupported_reasons("cuda", **hopper) == []
    for kw, why in ((dict(capability=(8, 0)), "Hopper"), (dict(large=True), "auto_threshold"),
                    (dict(window=16), "window=16"), (dict(sequence_slice=128), "sequence parallelism")):
        (line,) = dp.cudnn_unsupported_reasons("cuda", **{**hopper, **kw})
        assert why in line and "packed" in line
    # no GPU visible (lowering from a CPU): no capability to check the packed layout's against
    if dp._cuda_capability() is None:
        assert any("Hopper" in x for x in dp.cudnn_unsupported_reasons("cuda", dtype=BF16, head_dim=64,
                                                                        segments=True))


@pytest.fixture
def fake_hopper(fake_cudnn, monkeypatch):
    """A CPU-only jaxlib lowering for a Hopper GPU: the packed layout's capability probes (jax's and the
    declaration's) answered with 9.0; the version probe as in ``fake_cudnn``."""
    from jax._src.cudnn import fused_attention_stablehlo as fas

    monkeypatch.setattr(fas, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(dp, "_cuda_capability", lambda: (9, 0))


def test_auto_takes_cudnn_for_a_packed_row_where_it_serves_it(fake_hopper, fresh_log):
    kw = dict(platform="cuda", dtype=BF16, head_dim=64, segments=True)
    assert dense.choose("auto", **kw).name == "cudnn"
    assert dense.choose("cudnn", **kw).name == "cudnn"
    c = dense.choose("auto", large=True, **kw)
    assert c.name == "blockwise" and any("auto_threshold" in r for r in c.reasons)
    assert len(log_lines(fresh_log)) == 1


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("impl", ["cudnn", "auto"])
def test_cudnn_packed_rows_lower_for_cuda(fake_hopper, causal, impl):
    """Forward and gradient with segment ids lower to cuDNN's packed call: lengths and offsets as its operands
    4-7, M = T sequences per row (``max_seg_per_batch``), their statistics [B*T, H, T] fp32 in the gradient."""
    B, H, T = 2, 2, 256
    q, k, v = qkv(T, B=B, H=H, D=64, dtype=BF16)
    seg = jnp.asarray(np.repeat([[1, 2, 3, 4], [5, 5, 6, 7]], T // 4, axis=1), jnp.int32)
    pos = full(T)

    def fwd(q, k, v, seg):
        return dense.attend(q, k, v, *pos, causal=causal, impl=impl, block_q=64, block_k=64,
                            auto_threshold=4096 * 4096, full_pass=True, platform="cuda", q_segment_ids=seg,
                            k_segment_ids=seg)

    g = jax.grad(lambda *a: weighted_sum(fwd(*a)), argnums=(0, 1, 2))
    for fn, backward in ((fwd, False), (g, True)):
        mod = export(fn, "cuda", (q, k, v, seg), CUDNN_CHECKS).mlir_module()
        calls = re.findall(rf"@{re.escape(CUDNN_FWD)}\(([^)]*)\)", mod)
        assert len(calls) == 1 and len(calls[0].split(",")) == 7, calls  # q, k, v, 2 lengths, 2 offsets
        assert (f"@{CUDNN_BWD}(" in mod) == backward
        assert set(re.findall(r"max_seg_per_batch\\22: (\d+)", mod)) == {str(T)}
        assert set(re.findall(r'mask_type\\22: \\22(\w+)', mod)) == {"CAUSAL" if causal else "NO_MASK"}
        if backward:
            assert f"tensor<{B * T}x{H}x{T}xf32>" in mod  # the statistics of B*M sequences


@pytest.mark.skipif(dispatch.current_platform() != "cuda", reason="needs an NVIDIA GPU (cuDNN) to run compiled")
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_packed_rows_compiled_equal_each_document_alone(causal):
    """On a GPU: 'cudnn' over packed rows (every document of PACKED_ROWS, 1 to 16 tokens, twice over in a row of
    32) gives each document's output and q/k/v gradients as that document attended alone (the reference, fp32, on
    the same bf16 inputs)."""
    why = dp.cudnn_unsupported_reasons("cuda", dtype=BF16, head_dim=64, segments=True)
    if why:
        pytest.skip("; ".join(why))
    rows = [r + [x + 100 for x in r] for r in PACKED_ROWS + [RETURNING_ID]]
    seg = jnp.asarray(rows, jnp.int32)
    B, T = seg.shape
    args = qkv(T, B=B, H=2, D=64, dtype=BF16)
    pos = full(T)
    docs = [(b, s, n) for b, row in enumerate(rows) for s, n in documents(row)]

    def fn(q, k, v):
        return dense.attend(q, k, v, *pos, causal=causal, impl="cudnn", block_q=64, block_k=64,
                            auto_threshold=4096 * 4096, full_pass=True, platform="cuda", q_segment_ids=seg,
                            k_segment_ids=seg)

    def alone(q, k, v):
        out = jnp.zeros(q.shape, F32)
        for b, s, n in docs:
            x = [a[b:b + 1, :, s:s + n].astype(F32) for a in (q, k, v)]
            out = out.at[b:b + 1, :, s:s + n].set(naive_attention(*x, *full(n), causal=causal))
        return out

    check_values_and_grads(fn, alone, args, (2e-2, 2e-2), (5e-2, 5e-2))


@pytest.mark.skipif(dispatch.current_platform() != "cuda", reason="needs an NVIDIA GPU (cuDNN) to run compiled")
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_value_width_compiled_matches_the_reference(causal):
    """On a GPU: keys of 128 and values of 384 (two chunks of 192 through cuDNN's different-value-width form), bf16:
    'cudnn' gives the reference's output and q/k/v gradients (the reference, fp32, on the same bf16 inputs).
    Skipped, with the declaration's reasons, where it refuses the form (before Hopper, cuDNN before 9.10)."""
    why = dp.cudnn_unsupported_reasons("cuda", **MLA)
    if why:
        pytest.skip("; ".join(why))
    T = 512
    args = qkv(T, D=128, Dv=384, dtype=BF16)
    pos = full(T)

    def fn(q, k, v):
        return dense.attend(q, k, v, *pos, causal=causal, impl="cudnn", block_q=128, block_k=128,
                            auto_threshold=4096 * 4096, full_pass=True, platform="cuda")

    def ref(q, k, v):
        return naive_attention(*(x.astype(F32) for x in (q, k, v)), *pos, causal=causal)

    check_values_and_grads(fn, ref, args, (2e-2, 2e-2), (5e-2, 5e-2))


# ------------------------------------------------------------------------------------------------ sequence parallelism
def test_kernels_under_sequence_parallelism_refuse_slices_they_cannot_tile(fresh_log):
    """A row split over mesh.sequence: splash needs whole 128-token blocks per device, cuDNN's bias-masked causal
    form an even slice; 'auto' then takes the XLA path with one line, a kernel named alone raises."""
    assert dense.choose("auto", platform="tpu", dtype=BF16, head_dim=128, sequence_slice=256).name == "splash"
    assert dense.choose("auto", platform="cuda", dtype=BF16, head_dim=64, sequence_slice=255, causal=False).name \
        == "cudnn"
    for plat, n, why in (("tpu", 200, "128"), ("cuda", 255, "even")):
        c = dense.choose("auto", platform=plat, dtype=BF16, head_dim=128, large=True, sequence_slice=n)
        assert c.name == "blockwise" and any("sequence parallelism" in r and why in r for r in c.reasons)
        with pytest.raises(dispatch.KernelUnsupportedError, match="sequence parallelism"):
            dense.choose(dp.PLATFORM_KERNEL[plat], platform=plat, dtype=BF16, head_dim=128, sequence_slice=n)
    lines = log_lines(fresh_log)
    assert len(lines) == 2 and all("sequence parallelism" in x for x in lines)


def test_no_sequence_mesh_outside_a_split_call():
    assert dp.active_sequence_mesh(64) is None
    mesh = jax.sharding.AbstractMesh((1, 4), ("data", "sequence"))
    with dp.sequence_mesh(mesh):
        assert dp.active_sequence_mesh(64) is mesh
        assert dp.active_sequence_mesh(66) is None  # the partitioner does not split a row 4 does not divide
    assert dp.active_sequence_mesh(64) is None


# ------------------------------------------------------------------------------------------------ FLOPs
@pytest.mark.parametrize("causal", [True, False])
def test_fused_calls_count_their_analytic_flops(fake_cudnn, causal):
    """The cuDNN call (traced for cuda) and splash (interpret mode) are opaque to a jaxpr's dot_generals: the
    counter takes 4·B·H·T²·D (halved causal) from the tagged call, as attention_bench's analytic count."""
    from longctx.bench import common as C
    from longctx.bench.attention_bench import analytic_dense_flops

    B, H, T, D = 2, 2, 256, 64
    args = qkv(T, B=B, H=H, D=D, dtype=BF16)
    pos = full(T)
    for impl, plat in (("cudnn", "cuda"), ("splash", "cpu")):
        fn = functools.partial(dense.attend, q_pos=pos[0], k_pos=pos[1], k_valid=pos[2], causal=causal, impl=impl,
                               block_q=64, block_k=64, auto_threshold=1, full_pass=True, platform=plat)
        with pytest.warns(UserWarning, match="interpret") if impl == "splash" else contextlib.nullcontext():
            res = C.jaxpr_matmul_flops(fn, *args)
        assert res["fused_calls"] == 1 and res["opaque"] == [], (impl, res)
        assert res["flops"] == analytic_dense_flops(B, H, T, D, causal), impl
    # the XLA path is still counted from its dot_generals (the whole masked T x T)
    res = C.jaxpr_matmul_flops(lambda q, k, v: naive_attention(q, k, v, *pos, causal=causal), *args)
    assert res["fused_calls"] == 0 and res["flops"] == analytic_dense_flops(B, H, T, D, False)
