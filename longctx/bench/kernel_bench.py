"""`longctx-bench kernels`: every Pallas kernel a method declares (``AttentionCore.kernel_benches``)
against the XLA path it must match, over sequence lengths: forward and forward+backward time, and how
far the kernel's output and gradients are from the XLA path's.

On a CPU the kernels run in Pallas interpret mode, so their times there say nothing about the
kernel's speed on its hardware: numbers for correctness only (the table's ``mode`` column says
which). On a GPU or TPU the kernel is compiled. Per (method, kernel, direction, length) cell:

* both cores are built from the same seed (same parameters) and get the same standard-normal q, k, v;
* shapes and timing default by platform as in ``longctx-bench attention`` (``common.SHAPE_DEFAULTS``): on a
  CPU batch 1, 4 heads of 64, float32, one call per timing sample; on a GPU / TPU batch 8, 8 heads of 64,
  bfloat16 and as many calls per sample as fill the target sample time of `common.time_auto`, so that launch cost
  vanishes; flags override;
* rate (on a GPU / TPU): FLOPs of the XLA path from XLA's cost analysis (a lower bound where it has loops,
  marked '≥') over each path's time, in TFLOP/s and as a fraction of the device's dense bf16 peak;
* time = median of ``--repeats`` samples after ``--warmup`` calls, each ended by ``block_until_ready``;
  forward: deterministic=True; forward+backward: gradient of sum(out * w) (w Gaussian) with respect
  to q, k, v and the core's parameters, deterministic=True, so both paths compute the same function;
* ``max_abs_diff_out``: max |out_kernel - out_xla|; ``max_rel_diff_grad``: over the gradient leaves,
  max |g_kernel - g_xla| / max |g_xla|;
* a cell whose time, extrapolated from the two longest measured lengths, would exceed
  ``--max_cell_s`` (warm-up + repeats) is skipped and says so; a kernel that cannot run a shape
  (``impl='pallas'`` raises with its reasons) is reported with the reason, and the run goes on;
* after each row, ``kernels.partial.json`` holds the rows so far (removed when the run completes), so a run
  stopped by a time limit (compiles on an accelerator can take minutes) keeps what it measured.
"""

from __future__ import annotations

import time
import warnings

import jax
import jax.numpy as jnp
from absl import flags

from longctx import attention
from longctx.attention import dispatch
from longctx.bench import common as C
from longctx.bench.attention_bench import _skip_reason_time
from longctx.bench.cores import CoreFns, build_core
from longctx.errors import ConfigError

PARTIAL = "kernels.partial.json"  # the rows so far, rewritten after each one (what a killed run leaves behind)
CPU_LENGTHS = "256,1k,4k"
ACCEL_LENGTHS = "8k,16k,32k,64k"
IMPLS = ("xla", "pallas")


def define_flags(fv) -> None:
    flags.DEFINE_string("lengths", None, f"comma list of sequence lengths (k = 1024); default {CPU_LENGTHS} on cpu "
                        f"(interpret mode), {ACCEL_LENGTHS} on a GPU or TPU", flag_values=fv)
    define_kernel_flags(fv)
    flags.DEFINE_bool("causal", False, "causal only (default: both directions)", flag_values=fv)
    flags.DEFINE_float("max_cell_s", 120.0, "skip a cell when its extrapolated time (warm-up + repeats) exceeds "
                       "this", flag_values=fv)


def define_kernel_flags(fv) -> None:
    """The flags of a kernel cell common to ``kernels`` and ``sweep``: methods, shape, dtype, direction and timing
    (shape defaults by platform: ``common.SHAPE_DEFAULTS``)."""
    flags.DEFINE_string("methods", "", "comma list of methods (default: every method that declares a kernel)",
                        flag_values=fv)
    flags.DEFINE_integer("batch", None, "default 1 on a CPU, 8 on a GPU / TPU", flag_values=fv)
    flags.DEFINE_integer("heads", None, "default 4 on a CPU, 8 on a GPU / TPU", flag_values=fv)
    flags.DEFINE_integer("head_dim", None, "default 64", flag_values=fv)
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "default float32 on a CPU, bfloat16 on a GPU / TPU",
                      flag_values=fv)
    flags.DEFINE_integer("calls_per_sample", None, "calls per timing sample (0: as many as fill about 50 ms); "
                         "default 1 on a CPU, 0 on a GPU / TPU", flag_values=fv)
    flags.DEFINE_bool("bidirectional", False, "bidirectional only (default: kernels: both directions, sweep: causal)",
                      flag_values=fv)
    flags.DEFINE_integer("repeats", 3, "timed samples per cell (sweep: per setting)", flag_values=fv)
    flags.DEFINE_integer("warmup", 1, "untimed calls per cell (sweep: per setting) after compiling", flag_values=fv)
    flags.DEFINE_bool("no_backward", False, "time the forward only", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "random seed of the inputs", flag_values=fv)


def kernel_cells(requested: list[str] | None, platform: str | None = None
                 ) -> list[tuple[str, str, attention.base.KernelBench]]:
    """(method, kernel, KernelBench) of every registered method's declared kernels timed on ``platform`` (None:
    the default backend as a kernel platform, ``dispatch.current_platform``: 'cuda', not JAX's 'gpu'), in the order
    ``--methods`` names them (a run stopped by a time limit has timed the first); unknown names are an error, a
    requested method that declares none is reported by the caller."""
    methods = C.select_methods(requested)
    if requested:
        order = [r.split(":")[0] for r in requested]
        methods = sorted(methods, key=order.index)
    plat = platform or dispatch.current_platform()
    return [(m, kname, kb) for m in methods for kname, kb in attention.get_class(m).kernel_benches().items()
            if kb.platforms is None or plat in kb.platforms]


def _fns(core):
    """(params, rest, jitted forward, jitted deterministic gradient of sum(out * w)) of one core."""
    fns = CoreFns(core)
    fwd = fns.forward()

    def loss(params, q, k, v, rest, w):
        return jnp.sum(fwd(params, rest, q, k, v).astype(jnp.float32) * w)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    return fns.params, fns.rest, jax.jit(fwd), jax.jit(lambda p, r, q, k, v, w: grad(p, q, k, v, r, w))


def _max_abs(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def _max_rel(ga, gb) -> float:
    worst = 0.0
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
        worst = max(worst, _max_abs(a, b) / max(scale, 1e-30))
    return worst


def _error(e: Exception) -> str:
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:240]}"


def _bench_cell(method, kname, kb, causal, lengths, args, dtype, bar, checkpoint=lambda rows: None, peak=None):
    """``peak``: None (no rates: a CPU, interpret mode), else the device's peak TFLOP/s (0: unknown device,
    rates without fractions)."""
    dname = C.dir_name(causal)
    cores = {}
    for impl in IMPLS:
        try:
            cores[impl] = _fns(build_core(method, getattr(kb, impl), heads=args.heads, head_dim=args.head_dim,
                                          causal=causal, seed=args.seed))
        except ConfigError as e:
            bar.update(len(lengths))
            return [{"method": method, "kernel": kname, "direction": dname, "status": _error(e)}]
    B, H, D = args.batch, args.heads, args.head_dim
    hist = {(impl, kind): ([], []) for impl in IMPLS for kind in ("fwd", "fwdbwd")}
    n_calls = args.warmup + args.repeats
    kinds = ("fwd",) if args.no_backward else ("fwd", "fwdbwd")
    rows = []
    for T in lengths:
        bar.set_postfix_str(f"{method}/{kname} {dname} T={C.fmt_len(T)}")
        row = {"method": method, "kernel": kname, "direction": dname, "length": T, "batch": B, "heads": H,
               "head_dim": D, "dtype": args.dtype, "platform": jax.default_backend(),
               "mode": "interpret" if jax.default_backend() == "cpu" else "compiled"}
        q, k, v = C.random_qkv(args.seed + T, B, H, T, D, dtype)
        w = jax.random.normal(jax.random.key(args.seed + 7), (B, H, T, D), jnp.float32)
        results = {}
        for kind in kinds:
            for impl in IMPLS:
                params, rest, fwd, grad = cores[impl]
                fn, fargs = (fwd, (params, rest, q, k, v)) if kind == "fwd" else (grad, (params, rest, q, k, v, w))
                status = _skip_reason_time(*hist[(impl, kind)], T, n_calls, args.max_cell_s)
                if status is None:
                    try:
                        t0 = time.perf_counter()
                        results[(impl, kind)] = C.block(fn(*fargs))
                        row[f"{impl}_{kind}_first_call_s"] = time.perf_counter() - t0
                        t = C.time_auto(fn, *fargs, repeats=args.repeats, warmup=max(0, args.warmup - 1),
                                        calls=getattr(args, "calls_per_sample", 1) or 0)
                        row[f"{impl}_{kind}_s"] = t["median_s"]
                        row[f"{impl}_{kind}_times"] = t
                        hist[(impl, kind)][0].append(T)
                        hist[(impl, kind)][1].append(t["median_s"])
                        status = "ok"
                    except Exception as e:  # noqa: BLE001 -- a failing cell is reported, the run goes on
                        status = _error(e)
                row[f"{impl}_{kind}_status"] = status
            if row.get(f"xla_{kind}_s") and row.get(f"pallas_{kind}_s"):
                row[f"{kind}_kernel_over_xla"] = row[f"pallas_{kind}_s"] / row[f"xla_{kind}_s"]
            if peak is not None and row.get(f"xla_{kind}_s"):  # the work both paths do, counted on the XLA path
                # the matrix multiplies in its jaxpr (a scan body times its length; XLA's own count takes a
                # loop's body once, so it was a lower bound)
                params, rest, fwd, grad = cores["xla"]
                fl = C.jaxpr_matmul_flops(fwd if kind == "fwd" else grad,
                                          *((params, rest, q, k, v) if kind == "fwd" else (params, rest, q, k, v, w)))
                row[f"{kind}_xla_flops"] = fl["flops"]
                row[f"{kind}_xla_flops_has_loops"] = bool(fl["while_loops"] or fl["opaque"])
                for impl in IMPLS:
                    if fl["flops"] and row.get(f"{impl}_{kind}_s"):
                        tf = fl["flops"] / row[f"{impl}_{kind}_s"] / 1e12
                        row[f"{impl}_{kind}_tflops"] = tf
                        row[f"{impl}_{kind}_peak_fraction"] = tf / peak if peak else None
        sts = [v for key, v in row.items() if key.endswith("_status")]
        row["status"] = "ok" if all(x == "ok" for x in sts) else "; ".join(dict.fromkeys(x for x in sts if x != "ok"))
        if ("xla", "fwd") in results and ("pallas", "fwd") in results:
            row["max_abs_diff_out"] = _max_abs(results[("pallas", "fwd")], results[("xla", "fwd")])
        if ("xla", "fwdbwd") in results and ("pallas", "fwdbwd") in results:
            row["max_rel_diff_grad"] = _max_rel(results[("pallas", "fwdbwd")], results[("xla", "fwdbwd")])
        rows.append(row)
        checkpoint(rows)
        bar.update(1)
    return rows


def run(args) -> dict:
    out = C.out_dir(args.out)
    C.shape_defaults(args)
    requested = C.parse_names(args.methods)
    cells = kernel_cells(requested)
    if requested:
        none = [m for m in requested if m not in {c[0] for c in cells}]
        if none:
            raise ConfigError(f"longctx-bench kernels: {', '.join(none)} declare(s) no Pallas kernel; methods with "
                              f"kernels: {', '.join(dict.fromkeys(c[0] for c in kernel_cells(None)))}")
    default = CPU_LENGTHS if jax.default_backend() == "cpu" else ACCEL_LENGTHS
    lengths = C.parse_ints(args.lengths or default)
    dtype = C.dtype_of(args.dtype)
    dirs = C.directions(args)
    todo = [(m, kn, kb, c) for m, kn, kb in cells for c in dirs if C.dir_name(c) in kb.directions]
    res = {"header": C.header(args, "kernels"), "rows": []}
    if C.accelerator():
        res["peak"] = C.device_peak()
    peak = (res["peak"].get("tflops") or 0.0) if "peak" in res else None
    bar = C.progress_bar(len(todo) * len(lengths), "kernels", args.progress)
    with warnings.catch_warnings():  # interpret mode is recorded per row; one warning per trace is noise
        warnings.filterwarnings("ignore", message=".*interpret mode.*")
        for method, kname, kb, causal in todo:
            res["rows"] += _bench_cell(method, kname, kb, causal, lengths, args, dtype, bar,
                                       lambda rows: C.write_json(out / PARTIAL, {**res, "rows": res["rows"] + rows}),
                                       peak=peak)
    bar.close()
    (out / PARTIAL).unlink(missing_ok=True)
    C.write_json(out / "kernels.json", res)
    (out / "kernels.md").write_text(markdown(res))
    plots(res, out)
    return res


def _ms(x):
    return None if x is None else 1e3 * x


def markdown(res: dict) -> str:
    a = res["header"]["args"]
    rows = res["rows"]
    modes = sorted({r["mode"] for r in rows if "mode" in r})
    calls = a.get("calls_per_sample")
    lines = [f"Shapes: batch {a['batch']}, heads {a['heads']}, head_dim {a['head_dim']}, dtype {a['dtype']}; "
             f"median of {a['repeats']} "
             + ("runs" if calls in (None, 1) else
                "samples of " + (f"{calls} calls" if calls else "as many calls as fill about 50 ms"))
             + f" after {a['warmup']} warm-up; platform "
             f"{res['header']['machine'].get('jax_backend')}.\n"]
    if "interpret" in modes:
        lines.append("**Interpret mode (cpu): the kernel times below measure Pallas's interpreter, not the kernel "
                     "on its hardware. They are here for correctness (the difference columns) only.**\n")
    headers = ["method", "kernel", "direction", "T", "mode", "XLA fwd ms", "kernel fwd ms", "kernel/XLA fwd",
               "XLA fwd+bwd ms", "kernel fwd+bwd ms", "kernel/XLA fwd+bwd", "max abs Δout", "max rel Δgrad",
               "status"]
    table = []
    for r in rows:
        if "length" not in r:
            table.append([r["method"], r["kernel"], r["direction"]] + [None] * 10 + [r["status"]])
            continue
        table.append([r["method"], r["kernel"], r["direction"], C.fmt_len(r["length"]), r["mode"],
                      _ms(r.get("xla_fwd_s")), _ms(r.get("pallas_fwd_s")), r.get("fwd_kernel_over_xla"),
                      _ms(r.get("xla_fwdbwd_s")), _ms(r.get("pallas_fwdbwd_s")), r.get("fwdbwd_kernel_over_xla"),
                      r.get("max_abs_diff_out"), r.get("max_rel_diff_grad"), r["status"]])
    lines.append(C.md_table(headers, table))
    if "peak" in res:
        pk = res["peak"]
        lines.append("\nRates (the matrix-multiply FLOPs in the XLA path's jaxpr, a scan body times its length; "
                     "'≥': it has loops of unknown trip count, a lower bound), "
                     + (f"peak {pk['tflops']:g} TFLOP/s ({pk['source']}):" if pk.get("tflops") else
                        f"no % of peak ({pk.get('reason')}):") + "\n")

        def pct(x):
            return None if x is None else 100 * x

        rates = []
        for r in rows:
            if "length" not in r:
                continue
            for kind in ("fwd", "fwdbwd"):
                if r.get(f"{kind}_xla_flops"):
                    lb = "≥" if r.get(f"{kind}_xla_flops_has_loops") else ""
                    rates.append([r["method"], r["kernel"], r["direction"], C.fmt_len(r["length"]),
                                  "forward" if kind == "fwd" else "forward+backward",
                                  *(f"{lb}{v:.3g}" if v is not None else None for v in (
                                      r.get(f"xla_{kind}_tflops"), r.get(f"pallas_{kind}_tflops"),
                                      pct(r.get(f"xla_{kind}_peak_fraction")),
                                      pct(r.get(f"pallas_{kind}_peak_fraction"))))])
        lines.append(C.md_table(["method", "kernel", "direction", "T", "pass", "XLA TFLOP/s", "kernel TFLOP/s",
                                 "XLA % of peak", "kernel % of peak"], rates))
    lines.append("\nkernel/XLA < 1: the kernel is faster. Forward+backward: gradient of sum(out·w) with respect to "
                 "q, k, v and the parameters, deterministic.\n")
    return "\n".join(lines)


def plots(res: dict, out) -> None:
    series = dict.fromkeys((r["method"], r["kernel"], r["direction"]) for r in res["rows"] if "length" in r)
    if not series:
        return
    kind = "fwdbwd" if any(r.get("xla_fwdbwd_s") for r in res["rows"]) else "fwd"
    fig, (ax,) = C.new_figure(1)
    for m, kn, d in series:
        rs = sorted((r for r in res["rows"] if (r["method"], r["kernel"], r["direction"]) == (m, kn, d)
                     and "length" in r), key=lambda r: r["length"])
        for impl, style in (("xla", "-o"), ("pallas", "--s")):
            pts = [(r["length"], r[f"{impl}_{kind}_s"]) for r in rs if r.get(f"{impl}_{kind}_s")]
            if pts:
                ax.plot([p[0] for p in pts], [1e3 * p[1] for p in pts], style,
                        label=f"{m}/{kn} {d} {'kernel' if impl == 'pallas' else 'XLA'}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel(f"{'forward+backward' if kind == 'fwdbwd' else 'forward'} time (ms)")
    modes = sorted({r["mode"] for r in res["rows"] if "mode" in r})
    ax.set_title(f"Pallas kernels vs XLA ({', '.join(modes)})")
    ax.legend(fontsize=7)
    C.save_figure(fig, out / "kernels.png")
