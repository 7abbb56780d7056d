"""Platform-dependent benchmark defaults, the device peak table, the jaxpr FLOP counter and the step's MFU,
tested on the CPU with fake platform names (no accelerator needed)."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from longctx.bench import cli
from longctx.bench import common as C


def _ns(**kw):
    base = dict(batch=None, heads=None, head_dim=None, dtype=None, calls_per_sample=None)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("platform", ["cuda", "gpu", "tpu", "rocm"])
def test_accelerator_defaults_are_training_scale_bf16(platform):
    args = _ns()
    C.shape_defaults(args, platform)
    assert args.batch * args.heads >= 64 and args.head_dim == 64 and args.dtype == "bfloat16"
    assert args.calls_per_sample == 0  # as many calls per sample as fill about 50 ms


def test_cpu_defaults_stay_as_before_and_flags_win():
    args = _ns()
    C.shape_defaults(args, "cpu")
    assert (args.batch, args.heads, args.head_dim, args.dtype, args.calls_per_sample) == (1, 4, 64, "float32", 1)
    args = _ns(batch=2, dtype="float32", calls_per_sample=3)
    filled = C.shape_defaults(args, "cuda")
    assert (args.batch, args.dtype, args.calls_per_sample, args.heads) == (2, "float32", 3, 8)
    assert set(filled) == {"heads", "head_dim"}


def test_parsed_flags_leave_the_platform_defaults_unset():
    for cmd in ("attention", "kernels"):
        args = cli.parse_args([cmd, "--heads", "2"])
        assert args.heads == 2 and args.batch is None and args.dtype is None and args.calls_per_sample is None


@pytest.mark.parametrize("kind,tflops", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0),
                                         ("NVIDIA A100-SXM4-80GB", 312.0), ("TPU v4", 275.0),
                                         ("TPU v5 lite", 197.0), ("TPU v5p", 459.0), ("TPU v6 lite", 918.0)])
def test_device_peak_table(kind, tflops):
    assert C.device_peak("gpu" if "NVIDIA" in kind else "tpu", kind)["tflops"] == tflops


def test_unknown_device_has_no_peak_and_says_why():
    for kind in ("NVIDIA H100 PCIe", "NVIDIA GeForce RTX 4090"):
        pk = C.device_peak("gpu", kind)
        assert pk["tflops"] is None and kind in pk["reason"] and "MFU not reported" in pk["reason"]
    assert C.device_peak("cpu")["tflops"] is None and "--matmul_n 0" in C.device_peak("cpu")["reason"]
    mm = {"n": 64, "repeats": 3, "jax_gflops": 10.0, "jax_best_gflops": 12.0, "numpy_best_gflops": 15.0}
    pk = C.device_peak("cpu", matmul=mm)
    assert pk["tflops"] == pytest.approx(0.015) and "64x64" in pk["source"]


def test_device_memory_on_cpu_says_not_available():
    m = C.device_memory()
    assert m["peak_bytes_in_use"] is None and "not available on cpu" in m["reason"]


def test_jaxpr_matmul_flops_counts_scan_trips_and_cond_branches():
    a, b = jnp.ones((4, 8)), jnp.ones((8, 8))
    scan = lambda a, b: jax.lax.scan(lambda c, _: (c @ b, None), a, None, length=5)[0]
    assert C.jaxpr_matmul_flops(scan, a, b)["flops"] == 5 * 2 * 4 * 8 * 8
    cond = lambda p, a, b: jax.lax.cond(p, lambda: (a @ b) @ b, lambda: a)
    assert C.jaxpr_matmul_flops(cond, True, a, b)["flops"] == 2 * 2 * 4 * 8 * 8
    loop = lambda a, b: jax.lax.while_loop(lambda c: c[0, 0] < 10, lambda c: c @ b, a)
    out = C.jaxpr_matmul_flops(loop, a, b)
    assert out["while_loops"] == 1 and out["flops"] == 2 * 4 * 8 * 8


def test_xla_flops_is_a_lower_bound_with_a_loop_or_a_custom_call():
    x = jnp.eye(8) + 0.1
    count = lambda f: C.xla_flops(jax.jit(f).lower(x).compile())  # noqa: E731
    assert count(lambda a: a @ a) == dict(count(lambda a: a @ a), flops=2 * 8**3, has_loops=False)
    assert count(lambda a: jax.lax.fori_loop(0, 3, lambda i, b: b @ a, a))["has_loops"]
    assert count(lambda a: jnp.linalg.eigh(a)[0])["has_loops"]  # LAPACK's custom call on a CPU, as a kernel's


def test_method_flops_count_a_kernel_program_as_its_portable_implementation():
    from longctx.bench.attention_bench import add_peak_fractions, method_flops
    from longctx.bench.cores import CoreFns, build_core

    q, k, v = C.random_qkv(0, 1, 2, 128, 32, jnp.float32)
    kernel, portable = (CoreFns(build_core("eva", {"impl": impl}, heads=2, head_dim=32, causal=True))
                        for impl in ("pallas", "xla"))
    assert C.jaxpr_matmul_flops(kernel.forward(), kernel.params, kernel.rest, q, k, v)["opaque"]  # hidden work
    got = method_flops(build_core("eva", {"impl": "pallas"}, heads=2, head_dim=32, causal=True), "eva",
                       {"fwd": (kernel.params, kernel.rest, q, k, v)})
    want = C.jaxpr_matmul_flops(portable.forward(), portable.params, portable.rest, q, k, v)["flops"]
    assert got["method_flops_fwd"] == want > 0 and not got["method_flops_fwd_lower_bound"]
    assert "portable" in got["method_flops_source"]
    row = {"fwd_method_gflops_per_s": 50.0, "fwd_xla_gflops_per_s": 5.0, "method_flops_fwd_lower_bound": False}
    add_peak_fractions([row], 0.1)  # a peak of 100 GFLOP/s: the method's count decides, not XLA's
    assert row["fwd_peak_fraction"] == 0.5 and not row["fwd_peak_fraction_lower_bound"]


def test_time_calls_divides_a_sample_by_its_calls():
    t = C.time_calls(jax.jit(lambda x: x + 1), jnp.ones(4), repeats=2, warmup=1, calls=7)
    assert t["calls_per_sample"] == 7 and t["n"] == 2 and t["median_s"] > 0
    t = C.time_auto(jax.jit(lambda x: x + 1), jnp.ones(4), repeats=1, warmup=1, calls=0)
    assert t["calls_per_sample"] >= 1


def test_step_reports_model_flops_and_mfu(tmp_path):
    sets = [f"--config.{s}" for s in ["model.d_model=32", "model.num_layers=1", "model.num_heads=2",
                                      "model.head_dim=16", "model.d_ff=64"]]
    res = cli.main(["step", "--out", str(tmp_path), "--noprogress", "--lengths", "64", "--batch_size", "2",
                    "--repeats", "1", "--warmup", "0", "--matmul_n", "256", *sets])
    assert res == 0
    import json

    r = json.loads((tmp_path / "step.json").read_text())
    row = r["rows"][0]
    assert r["peak"]["tflops"] > 0 and "matmul" in r["peak"]["source"]
    # 3 x forward: at least the 6N of the parameter matmuls other than the embedding lookup
    assert row["model_flops_per_token"] > 0.5 * row["params_6n_flops_per_token"]
    assert row["mfu"] == pytest.approx(row["model_flops_per_token"] * row["tokens_per_s"]
                                       / (r["peak"]["tflops"] * 1e12))
    assert row["compile_s"] > 0 and row["device_peak_bytes"] is None and "not available" in row["device_mem"]["reason"]
    md = (tmp_path / "step.md").read_text()
    assert "MFU" in md and "3 x forward matmuls" in md and "measured f32 matmul rate" in md


def test_step_counts_a_model_with_kernels_as_its_portable_implementation():
    from longctx.bench import configs
    from longctx.bench import step_bench as S
    from longctx.models.decoder import build_model
    from longctx.train.step import split_model

    args = SimpleNamespace(batch_size=1, window=None, vocab_size=None)

    def cfg(impl):
        base = configs.with_overrides(configs.load_config_file("configs/enwik8/fma.py:tiny"),
                                      [f"execution.attention.fma.impl={impl}"])
        return S.length_config(base, 64, args)

    def count(c):
        return S.forward_matmul_flops(c, *split_model(build_model(c.model, seed=0, execution=c.execution)))

    kernel, portable = count(cfg("pallas")), count(cfg("xla"))
    assert kernel["opaque"] and not portable["opaque"]  # the kernel hides its matmuls from the count
    twin = S.portable_matmul_flops(cfg("pallas"))
    assert twin["flops"] == portable["flops"] > kernel["flops"] and "fma: impl='xla'" in twin["counted_as"]


def test_step_without_a_peak_reports_no_mfu_and_why(tmp_path):
    sets = [f"--config.{s}" for s in ["model.d_model=32", "model.num_layers=1", "model.num_heads=2",
                                      "model.head_dim=16", "model.d_ff=64"]]
    assert cli.main(["step", "--out", str(tmp_path), "--noprogress", "--lengths", "32", "--repeats", "1",
                     "--warmup", "0", "--matmul_n", "0", *sets]) == 0
    md = (tmp_path / "step.md").read_text()
    assert "MFU not reported (no measured matmul rate" in md


def test_attention_markdown_on_an_accelerator_shows_tflops_and_peak_fraction():
    from longctx.bench import attention_bench as ab

    rows = [{"variant": "dense:cudnn", "direction": "causal", "length": 8192, "fwd_s": 1e-3, "fwdbwd_s": 3e-3,
             "fwd_status": "ok", "fwdbwd_status": "ok", "fwd_analytic_gflops_per_s": 400_000.0,
             "fwdbwd_analytic_gflops_per_s": 450_000.0}]
    ab.add_peak_fractions(rows, 989.0)
    assert rows[0]["fwdbwd_peak_fraction"] == pytest.approx(450 / 989)
    res = {"header": {"args": {"batch": 8, "heads": 8, "head_dim": 64, "dtype": "bfloat16", "repeats": 3,
                               "warmup": 1, "mem_budget_gb": 60, "max_cell_s": 20, "calls_per_sample": 0},
                      "machine": {"jax_backend": "gpu"}},
           "rows": rows, "skipped_variants": [], "exponents": [],
           "peak": C.device_peak("gpu", "NVIDIA H100 80GB HBM3")}
    md = ab.markdown(res)
    assert "TFLOP/s fwd+bwd (model)" in md and "% of peak fwd+bwd" in md and "989 TFLOP/s" in md
    assert "| 450.0 |" in md and "45.5" in md and "as many calls as fill about 50 ms" in md


def test_attention_flags_a_forward_slower_than_its_forward_backward_and_names_its_files(tmp_path):
    """A forward timed slower than the forward+backward that contains it is flagged in the table and in what
    the run prints at its end, with the paths written."""
    from longctx.bench import attention_bench as ab

    rows = [{"variant": "dense:blockwise", "direction": "causal", "length": 256, "fwd_s": 47.3e-3, "fwdbwd_s": 19.2e-3,
             "fwd_status": "ok", "fwdbwd_status": "ok"},
            {"variant": "eva", "direction": "causal", "length": 256, "fwd_s": 1e-3, "fwdbwd_s": 3e-3,
             "fwd_status": "ok", "fwdbwd_status": "ok"}]
    assert ab._status(rows[0]).startswith("ok; check: fwd slower than fwd+bwd") and ab._status(rows[1]) == "ok"
    text = ab.summary({"rows": rows, "skipped_variants": []}, tmp_path, ["attention_time_causal.png"])
    assert "| dense:blockwise | causal | 256 | 47.3 | 19.2 | ok; check: fwd slower than fwd+bwd" in text
    assert text.splitlines()[-1] == (f"wrote {tmp_path / 'attention.json'}, {tmp_path / 'attention.md'}, "
                                     f"{tmp_path / 'attention_time_causal.png'}")


def test_attention_plots_at_one_length_are_bars(tmp_path, monkeypatch):
    """One length measured: each variant is a bar (a line over lengths would be a column of dots)."""
    from longctx.bench import attention_bench as ab

    calls = []
    monkeypatch.setattr(ab, "_bars", lambda ax, labels, values, unit, title: calls.append((labels, values, title)))
    rows = [{"variant": v, "direction": "causal", "length": 8192, "fwd_s": t, "fwdbwd_s": 3 * t, "fwd_status": "ok",
             "fwdbwd_status": "ok", "fwd_rss_peak_bytes": 1e8} for v, t in (("dense:blockwise", 0.2), ("eva", 0.05))]
    assert ab.plots({"rows": rows}, tmp_path) == ["attention_time_causal.png", "attention_memory_causal.png"]
    assert calls[0] == (["dense:blockwise", "eva"], [200.0, 50.0], "forward, causal, T = 8k")
    assert len(calls) == 4 and all((tmp_path / f).exists() for f in ("attention_time_causal.png",))
