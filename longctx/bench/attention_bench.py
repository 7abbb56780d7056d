"""`longctx-bench attention`: forward and forward+backward time, memory, FLOP rate and
scaling exponent of every registered attention core (and exact attention in both its
naive and blockwise forms) over sequence lengths, causal and bidirectional.

Per (variant, direction, length) cell:
* the program is lowered and compiled first; XLA's compiled memory analysis
  (arguments + outputs + temporaries − aliased) is compared with ``--mem_budget_gb``
  and the cell is skipped (and says so) when it would exceed it;
* a cell is also skipped when the time extrapolated from the two largest measured
  lengths times (warm-up + repeats) exceeds ``--max_cell_s`` (so quadratic methods
  stop where they would take minutes per call);
* time = median of ``--repeats`` samples after ``--warmup`` calls; a sample is ``--calls_per_sample`` calls
  dispatched back to back, the last ended by ``block_until_ready``, divided by their number (on a CPU one
  call; on a GPU / TPU as many as fill the target sample time of `common.time_auto`, so that launch cost vanishes); inputs are
  standard-normal q, k, v (never all zeros);
* shapes: batch, heads, head_dim and dtype default to batch 1, 4 heads of 64, float32 on a CPU (as every
  earlier CPU result) and to a training-like batch 8, 8 heads of 64, bfloat16 (batch x heads = 64) on a GPU
  or TPU (``common.SHAPE_DEFAULTS``); the flags override either;
* rate: GFLOP/s (TFLOP/s on a GPU / TPU) from the analytic count (exact attention) and from XLA's cost
  analysis, and the fraction of the peak (``common.device_peak``: the device's dense bf16 peak on a GPU /
  TPU, the measured matmul rate on a CPU) of the analytic rate, else of XLA's (then a lower bound);
* forward: deterministic=True; forward+backward: gradient of sum(out * w) (w Gaussian)
  plus the core's auxiliary losses with respect to q, k, v and the core's parameters,
  deterministic=False with a key (the training path);
* peak RSS: the process's resident set sampled every 5 ms during the timed calls. The entry points
  keep freed host memory (longctx/host_memory.py), so it never falls: the largest of the run so far.
* each variant (and the PyTorch reference) runs in its own child process (``--noisolate``: all in this
  one): with freed memory kept, the heap a method leaves behind fragments the next one's, whose calls
  then grow the heap and fault in fresh pages part-way through its timed calls (docs/DESIGN.md, "Host memory").
  The peak RSS is then per variant.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import flags

from longctx import attention
from longctx.attention import Aux
from longctx.bench import common as C
from longctx.bench.capture import exact_method as _exact_method
from longctx.bench.cores import CoreFns, build_core, is_exact, variants
from longctx.errors import ConfigError

DEFAULT_LENGTHS = "1k,2k,4k,8k,16k,32k,64k,128k"
TORCH = "torch_sdpa"
PARTIAL = "attention.partial.json"  # rows so far and the cell being timed (kept by a run that is killed)


def define_flags(fv) -> None:
    flags.DEFINE_string("methods", "", "comma list of methods or variants (e.g. dense,eva or dense:naive); default: "
                        f"every registered method (+ {TORCH} when torch is importable)", flag_values=fv)
    flags.DEFINE_string("lengths", DEFAULT_LENGTHS, "comma list of sequence lengths (k = 1024)", flag_values=fv)
    flags.DEFINE_integer("batch", None, "default 1 on a CPU, 8 on a GPU / TPU", flag_values=fv)
    flags.DEFINE_integer("heads", None, "default 4 on a CPU, 8 on a GPU / TPU", flag_values=fv)
    flags.DEFINE_integer("head_dim", None, "default 64", flag_values=fv)
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                      "default float32 on a CPU, bfloat16 on a GPU / TPU", flag_values=fv)
    flags.DEFINE_integer("calls_per_sample", None, "calls per timing sample (0: as many as fill about 50 ms); "
                         "default 1 on a CPU, 0 on a GPU / TPU", flag_values=fv)
    flags.DEFINE_bool("causal", False, "causal only (default: both directions)", flag_values=fv)
    flags.DEFINE_bool("bidirectional", False, "bidirectional only (default: both directions)", flag_values=fv)
    flags.DEFINE_integer("repeats", 3, "timed samples per cell", flag_values=fv)
    flags.DEFINE_integer("warmup", 2, "untimed calls per cell after compiling (the second call of a new program "
                         "can still fault in fresh heap pages: docs/DESIGN.md, Host memory)", flag_values=fv)
    flags.DEFINE_float("mem_budget_gb", 16.0, "skip a cell whose estimated memory exceeds this (GB)", flag_values=fv)
    flags.DEFINE_float("max_cell_s", 120.0, "skip a cell when its extrapolated time (warm-up + repeats) exceeds "
                       "this", flag_values=fv)
    flags.DEFINE_bool("no_backward", False, "forward only", flag_values=fv)
    flags.DEFINE_integer("matmul_n", 4096, "size of the reference f32 matmul (0: skip)", flag_values=fv)
    flags.DEFINE_bool("no_torch", False, f"do not time {TORCH} even if torch is importable", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "random seed of the inputs", flag_values=fv)
    flags.DEFINE_bool("isolate", True, "each variant and direction in a child process of its own (--noisolate: "
                      "time every variant in this process); a child killed mid-run, e.g. by the out-of-memory "
                      "killer, keeps the rows it finished", flag_values=fv)
    flags.DEFINE_bool("update", False, "merge into --out's existing attention.json: the variants and directions "
                      "run here replace theirs, every other row is kept (to rerun one method without the others)",
                      flag_values=fv)
    flags.DEFINE_multi_string("group", [], "time a stack of layers instead of single cores: a comma list of "
                              "methods or variants, one a layer (e.g. eva,eva,eva,dense), repeatable; the all-exact "
                              "group of the same depth (dense,dense,dense,dense) is timed beside it. Writes "
                              "attention_group.{json,md}; see run_group", flag_values=fv)
    flags.DEFINE_bool("group_remat", False, "--group: rematerialise each layer in the backward (jax.checkpoint), so "
                      "the backward holds one layer's residuals at a time (as a model trained with remat)",
                      flag_values=fv)


def analytic_dense_flops(B, H, T, D, causal: bool) -> float:
    """4·B·H·T²·D (two T×T×D matmuls), halved when causal."""
    f = 4.0 * B * H * T * T * D
    return f / 2 if causal else f


def _torch():
    """(torch, torch.nn.functional, None), or (None, None, why) where torch cannot be imported."""
    try:
        import torch
        import torch.nn.functional as F

        return torch, F, None
    except Exception as e:
        return None, None, f"torch is not importable ({type(e).__name__}: {e})"


def run(args) -> dict:
    if getattr(args, "group", None):
        return run_group(args)
    out = C.out_dir(args.out)
    C.shape_defaults(args)
    lengths = C.parse_ints(args.lengths)
    requested = C.parse_names(args.methods)
    core_requested = [r for r in requested if r != TORCH] if requested else None
    methods = C.select_methods(core_requested) if (core_requested or not requested) else []
    dtype = C.dtype_of(args.dtype)
    budget = args.mem_budget_gb * C.GB
    torch, F, no_torch = (None, None, "--no_torch") if args.no_torch else _torch()
    with_torch = torch is not None and (not requested or TORCH in requested
                                        or any(is_exact(r.split(":")[0]) for r in core_requested or ()))
    torch_missing = TORCH in (requested or ()) and torch is None  # asked for by name: its skip is said

    cells = []  # (method, label, overrides)
    for m in methods:
        for label, ov in variants(m):
            if C.variant_selected(requested, m, label):
                cells.append((m, label, ov))
    if requested:  # in the order asked for (the exact baseline first, say, where a time limit may stop the run)
        cells.sort(key=lambda c: min(i for i, r in enumerate(requested) if r in (c[0], c[1])))
    dirs = C.directions(args)
    res = {"header": C.header(args, "attention"), "rows": [], "skipped_variants": [], "exponents": []}
    if args.matmul_n > 0:
        res["matmul"] = C.matmul_rate(args.matmul_n, repeats=max(1, min(args.repeats, 3)))
    n_total = len(dirs) * (len(cells) + (1 if with_torch else 0)) * len(lengths)
    bar = C.progress_bar(n_total, "attention", args.progress)
    ran = set()  # (variant, direction) pairs this run measured (or tried to)
    for causal in dirs if torch_missing else ():
        ran.add((TORCH, C.dir_name(causal)))
        res["skipped_variants"].append({"variant": TORCH, "direction": C.dir_name(causal), "reason": no_torch})
        bar.write(f"skip {TORCH} ({C.dir_name(causal)}): {no_torch}")

    def checkpoint(rows, current=None):  # what a killed run leaves behind (read by the parent of a child run)
        C.write_json(out / PARTIAL, {"rows": res["rows"] + rows, "skipped_variants": res["skipped_variants"],
                                     "current": current})

    if getattr(args, "isolate", False):
        labels = list(dict.fromkeys(label for _, label, _ in cells)) + ([TORCH] if with_torch else [])
        for label in labels:
            for causal in dirs:
                bar.set_postfix_str(f"{label} {C.dir_name(causal)}")
                child = _run_child(args, label, causal)
                res["rows"] += child["rows"]
                res["skipped_variants"] += child["skipped_variants"]
                ran.add((label, C.dir_name(causal)))
                checkpoint([])  # a run stopped later keeps the variants timed so far
                bar.update(len(lengths))
        dirs_run = []
    else:
        dirs_run = dirs

    for causal in dirs_run:
        dname = C.dir_name(causal)
        for method, label, ov in cells:
            ran.add((label, dname))
            try:
                core = build_core(method, ov, heads=args.heads, head_dim=args.head_dim, causal=causal, seed=args.seed)
            except ConfigError as e:
                res["skipped_variants"].append({"variant": label, "direction": dname, "reason": str(e)})
                bar.write(f"skip {label} ({dname}): {e}")
                bar.update(len(lengths))
                continue
            rows = _bench_core(core, method, label, causal, lengths, args, dtype, budget, bar, checkpoint)
            res["rows"] += rows
        if with_torch:
            ran.add((TORCH, dname))
            res["rows"] += _bench_torch(torch, F, causal, lengths, args, dtype, budget, bar, checkpoint)
    bar.close()
    (out / PARTIAL).unlink(missing_ok=True)
    if getattr(args, "update", False):
        res = merge_into_previous(out / "attention.json", res, ran)
    res["peak"] = C.device_peak(matmul=res.get("matmul"))
    add_peak_fractions(res["rows"], res["peak"].get("tflops"))
    res["exponents"] = []
    for dname in dict.fromkeys(r["direction"] for r in res["rows"]):
        for label in dict.fromkeys(r["variant"] for r in res["rows"] if r["direction"] == dname):
            rs = [r for r in res["rows"] if r["variant"] == label and r["direction"] == dname]
            e = {"variant": label, "direction": dname}
            for kind in ("fwd", "fwdbwd"):
                pts = [(r["length"], r[f"{kind}_s"]) for r in rs if r.get(f"{kind}_s")]
                e[f"{kind}_exponent"] = C.fit_exponent([p[0] for p in pts], [p[1] for p in pts])
                e[f"{kind}_lengths"] = sorted(p[0] for p in pts)[-3:]
            res["exponents"].append(e)
    C.write_json(out / "attention.json", res)
    (out / "attention.md").write_text(markdown(res))
    print(summary(res, out, plots(res, out)), flush=True)
    return res


def add_peak_fractions(rows: list[dict], peak_tflops: float | None) -> None:
    """``{kind}_peak_fraction`` of each timed row: its analytic FLOP rate over the peak (exact attention), else
    its method count's (:func:`method_flops`), else its XLA-counted rate (``{kind}_peak_fraction_lower_bound``
    where the count is a lower bound: loops counted once, kernels not counted)."""
    for r in rows:
        for kind in ("fwd", "fwdbwd"):
            rate = r.get(f"{kind}_analytic_gflops_per_s")
            lower = False
            if rate is None and r.get(f"{kind}_method_gflops_per_s"):
                rate = r[f"{kind}_method_gflops_per_s"]
                lower = bool(r.get(f"method_flops_{kind}_lower_bound"))
            elif rate is None:
                rate = r.get(f"{kind}_xla_gflops_per_s")
                lower = bool(r.get(f"{kind}_xla_flops_has_loops"))
            if rate and peak_tflops:
                r[f"{kind}_peak_fraction"] = rate / (peak_tflops * 1e3)
                r[f"{kind}_peak_fraction_lower_bound"] = lower


def method_flops(core, method: str, fargs: dict, seed: int = 0) -> dict:
    """The matrix-multiply FLOPs of one call of an efficient method, forward and forward+backward
    (``fargs``: the timed functions' arguments by kind), counted in its jaxpr (``common.jaxpr_matmul_flops``:
    scan bodies times their length, no elementwise work): the work the method's program does, where XLA's
    count misses loop trips and kernels. A program with a kernel (opaque to the count) is counted as the
    XLA implementation its kernels are benchmarked against computes it (:func:`common.portable_impl`), and ``method_flops_source`` says so;
    ``method_flops_{kind}_lower_bound``: loops of unknown trip count or kernels remained."""
    from flax import nnx

    out = {"method_flops_source": "the timed program"}
    fns = CoreFns(core)
    for kind in fargs:
        count = C.jaxpr_matmul_flops(fns.forward() if kind == "fwd" else fns.grads(), *fargs[kind])
        if count["opaque"]:
            cfg = core.cfg.copy_and_resolve_references()
            cfg.impl = C.portable_impl(method)
            twin = CoreFns(attention.build(method, cfg, num_heads=core.num_heads, head_dim=core.head_dim,
                                           value_dim=core.value_dim, causal=core.causal, rngs=nnx.Rngs(seed)))
            rest = fargs[kind][2:]
            count = C.jaxpr_matmul_flops(twin.forward() if kind == "fwd" else twin.grads(), twin.params, twin.rest,
                                         *rest)
            out["method_flops_source"] = "the portable XLA implementation (the timed one runs kernels)"
        out[f"method_flops_{kind}"] = count["flops"]
        out[f"method_flops_{kind}_lower_bound"] = bool(count["while_loops"] or count["opaque"])
    return out


def child_argv(args, label: str, out, causal: bool | None = None) -> list[str]:
    """The command line that times one variant (or the PyTorch reference) alone, with this run's settings
    (``causal``: in that direction only)."""
    argv = [sys.executable, "-m", "longctx.bench.cli", "attention", "--noisolate", "--noprogress",
            "--methods", label, "--out", str(out), "--matmul_n", "0"]
    for name in ("lengths", "batch", "heads", "head_dim", "dtype", "repeats", "warmup", "mem_budget_gb",
                 "max_cell_s", "seed", "calls_per_sample"):
        if getattr(args, name, None) is not None:
            argv += [f"--{name}", str(getattr(args, name))]
    flags = ("no_backward",) + (("causal", "bidirectional") if causal is None else ())
    for flag in flags:
        if getattr(args, flag):
            argv.append(f"--{flag}")
    if causal is not None:
        argv.append("--causal" if causal else "--bidirectional")
    if label != TORCH:  # an exact variant would otherwise bring the reference along
        argv.append("--no_torch")
    return argv


def _run_child(args, label: str, causal: bool) -> dict:
    """Rows and skipped variants of one variant in one direction, timed in a child process. A child that fails
    keeps the rows it finished (it writes them after every cell) and the cell it died in is reported as a
    skipped variant (exit status, last error line; -9 is a kill, usually the out-of-memory killer): the run
    goes on."""
    dname = C.dir_name(causal)
    with tempfile.TemporaryDirectory(prefix="longctx_attn_") as tmp:
        r = subprocess.run(child_argv(args, label, tmp, causal), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
        f, partial = Path(tmp) / "attention.json", Path(tmp) / PARTIAL
        if r.returncode == 0 and f.exists():
            child = json.loads(f.read_text())
            return {"rows": child["rows"], "skipped_variants": child.get("skipped_variants", [])}
        child = json.loads(partial.read_text()) if partial.exists() else {"rows": [], "skipped_variants": []}
    last = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
    cur = child.get("current") or {}
    where = f" during {cur['kind']} at T={C.fmt_len(cur['length'])}" if cur else ""
    kept = f"; the {len(child['rows'])} rows before it are kept" if child["rows"] else ""
    return {"rows": child["rows"], "skipped_variants": child.get("skipped_variants", []) + [{
        "variant": label, "direction": dname,
        "reason": f"child process exited with status {r.returncode}{where}{kept}: {last}"}]}


def merge_into_previous(path: Path, res: dict, ran: set) -> dict:
    """``--update``: res's rows and skips replace those of the same (variant, direction) in the results at path;
    the rest of path's are kept. The header is this run's, with the earlier run's under ``merged_into``."""
    if not path.exists():
        return res
    old = json.loads(path.read_text())
    rerun = {v for v, _ in ran}

    def keep(x):  # an older run's skip for a whole variant ("all" directions) goes when that variant is rerun
        return (x["variant"], x["direction"]) not in ran and not (x["direction"] == "all" and x["variant"] in rerun)

    out = dict(res)
    out["rows"] = [r for r in old["rows"] if keep(r)] + res["rows"]
    out["skipped_variants"] = [s for s in old.get("skipped_variants", []) if keep(s)] + res["skipped_variants"]
    out["merged_into"] = dict(old["header"], merged_into=old.get("merged_into"))  # a chain of updates
    if "matmul" not in out and "matmul" in old:
        out["matmul"] = old["matmul"]
    return out


def _skip_reason_time(prev_L, prev_t, T, n_calls, limit):
    pred = C.predict_time(prev_L, prev_t, T)
    if pred is not None and pred * n_calls > limit:
        return f"skipped: predicted {pred:.1f} s/call × {n_calls} calls > --max_cell_s {limit:g}"
    return None


def _bench_core(core, method, label, causal, lengths, args, dtype, budget, bar, checkpoint=None):
    fns = CoreFns(core)
    fwd, grads = fns.forward(), fns.grads()
    B, H, D = args.batch, args.heads, args.head_dim
    Dv = core.value_dim
    dname = C.dir_name(causal)
    rows = []
    hist = {"fwd": ([], []), "fwdbwd": ([], [])}
    blocked = {"fwd": None, "fwdbwd": None}  # a budget skip carries over to longer lengths
    n_calls = args.warmup + args.repeats
    for T in lengths:
        bar.set_postfix_str(f"{label} {dname} T={C.fmt_len(T)}")
        row = {"method": method, "variant": label, "direction": dname, "length": T, "batch": B, "heads": H,
               "head_dim": D, "dtype": args.dtype}
        if is_exact(method):
            row["analytic_flops_fwd"] = analytic_dense_flops(B, H, T, D, causal)
            row["analytic_flops_fwdbwd"] = 3.5 * row["analytic_flops_fwd"]
        q, k, v = C.random_qkv(args.seed + T, B, H, T, D, dtype, Dv)
        w = jax.random.normal(jax.random.key(args.seed + 7), (B, H, T, Dv), jnp.float32)
        key = jax.random.key(args.seed + 11)
        kinds = [("fwd", fwd, (fns.params, fns.rest, q, k, v))]
        if not args.no_backward:
            kinds.append(("fwdbwd", grads, (fns.params, fns.rest, q, k, v, w, key)))
        if not is_exact(method):
            try:
                row.update(method_flops(core, method, {kind: fargs for kind, _, fargs in kinds}, args.seed))
            except Exception as e:  # noqa: BLE001 -- a count that cannot be made leaves the XLA count
                row["method_flops_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        for kind, fn, fargs in kinds:
            status = blocked[kind] or _skip_reason_time(*hist[kind], T, n_calls, args.max_cell_s)
            if status is None:
                if checkpoint:
                    checkpoint(rows, {"variant": label, "direction": dname, "length": T, "kind": kind})
                try:
                    t0 = time.perf_counter()
                    compiled = jax.jit(fn).lower(*fargs).compile()
                    row[f"{kind}_compile_s"] = time.perf_counter() - t0
                    mem = C.memory_stats(compiled)
                    row[f"{kind}_xla_mem"] = mem
                    if mem.get("total", 0) > budget:
                        status = (f"skipped: XLA estimate {mem['total'] / C.GB:.1f} GB > --mem_budget_gb "
                                  f"{args.mem_budget_gb:g}")
                        blocked[kind] = f"skipped: over the memory budget at {C.fmt_len(T)} or shorter"
                    else:
                        fl = C.xla_flops(compiled)
                        row[f"{kind}_xla_flops"] = fl["flops"]
                        row[f"{kind}_xla_flops_has_loops"] = fl.get("has_loops")
                        with C.RssSampler() as rss:
                            t = C.time_auto(compiled, *fargs, repeats=args.repeats, warmup=args.warmup,
                                            calls=getattr(args, "calls_per_sample", 1) or 0)
                        row[f"{kind}_s"] = t["median_s"]
                        row[f"{kind}_times"] = t
                        row[f"{kind}_rss_peak_bytes"] = rss.peak
                        row[f"{kind}_rss_start_bytes"] = rss.start
                        if fl["flops"]:
                            row[f"{kind}_xla_gflops_per_s"] = fl["flops"] / t["median_s"] / 1e9
                        if row.get(f"analytic_flops_{kind}"):
                            row[f"{kind}_analytic_gflops_per_s"] = row[f"analytic_flops_{kind}"] / t["median_s"] / 1e9
                        if row.get(f"method_flops_{kind}"):
                            row[f"{kind}_method_gflops_per_s"] = row[f"method_flops_{kind}"] / t["median_s"] / 1e9
                        hist[kind][0].append(T)
                        hist[kind][1].append(t["median_s"])
                        status = "ok"
                    del compiled
                except Exception as e:  # noqa: BLE001 -- a failing cell is reported, the run goes on
                    status = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            row[f"{kind}_status"] = status
        row["ru_maxrss_bytes"] = C.ru_maxrss_bytes()
        rows.append(row)
        if checkpoint:
            checkpoint(rows)
        bar.update(1)
    return rows


def _bench_torch(torch, F, causal, lengths, args, dtype, budget, bar, checkpoint=None):
    """torch.nn.functional.scaled_dot_product_attention on the same shapes (external reference)."""
    import numpy as np

    B, H, D = args.batch, args.heads, args.head_dim
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    dname = C.dir_name(causal)
    rows = []
    hist = {"fwd": ([], []), "fwdbwd": ([], [])}
    n_calls = args.warmup + args.repeats
    for T in lengths:
        bar.set_postfix_str(f"{TORCH} {dname} T={C.fmt_len(T)}")
        row = {"method": TORCH, "variant": TORCH, "direction": dname, "length": T, "batch": B, "heads": H,
               "head_dim": D, "dtype": args.dtype, "torch_version": torch.__version__,
               "torch_threads": torch.get_num_threads(),
               "analytic_flops_fwd": analytic_dense_flops(B, H, T, D, causal)}
        row["analytic_flops_fwdbwd"] = 3.5 * row["analytic_flops_fwd"]
        q, k, v = (torch.from_numpy(np.array(x, np.float32)).to(tdt) for x in C.random_qkv(args.seed + T, B, H, T, D))
        w = torch.randn(B, H, T, D, dtype=tdt)
        # inputs, output and (fwd+bwd) gradients; SDPA's CPU kernel is blockwise (no T×T buffer)
        est = {"fwd": 4 * B * H * T * D * q.element_size(), "fwdbwd": 10 * B * H * T * D * q.element_size()}

        def f_fwd(q=q, k=k, v=v):
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def f_bwd(q=q, k=k, v=v, w=w):
            qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
            o.backward(w)
            return qq.grad

        for kind, fn in (("fwd", f_fwd), ("fwdbwd", f_bwd)):
            if kind == "fwdbwd" and args.no_backward:
                continue
            status = _skip_reason_time(*hist[kind], T, n_calls, args.max_cell_s)
            if status is None and est[kind] > budget:
                status = f"skipped: estimate {est[kind] / C.GB:.1f} GB > --mem_budget_gb {args.mem_budget_gb:g}"
            if status is None:
                if checkpoint:
                    checkpoint(rows, {"variant": TORCH, "direction": dname, "length": T, "kind": kind})
                try:
                    for _ in range(args.warmup):
                        fn()
                    times = []
                    with C.RssSampler() as rss:
                        for _ in range(max(1, args.repeats)):
                            t0 = time.perf_counter()
                            fn()
                            times.append(time.perf_counter() - t0)
                    med = float(np.median(times))
                    row[f"{kind}_s"] = med
                    row[f"{kind}_times"] = {"median_s": med, "min_s": min(times), "max_s": max(times), "n": len(times)}
                    row[f"{kind}_rss_peak_bytes"] = rss.peak
                    row[f"{kind}_rss_start_bytes"] = rss.start
                    row[f"{kind}_analytic_gflops_per_s"] = row[f"analytic_flops_{kind}"] / med / 1e9
                    hist[kind][0].append(T)
                    hist[kind][1].append(med)
                    status = "ok"
                except Exception as e:  # noqa: BLE001
                    status = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            row[f"{kind}_status"] = status
        rows.append(row)
        if checkpoint:
            checkpoint(rows)
        bar.update(1)
    return rows


# ----------------------------------------------------------------------------- outputs
def _ms(x):
    return None if x is None else 1e3 * x


def _mb(x):
    return None if x is None else x / C.MB


def _pct(r, kind):
    f = r.get(f"{kind}_peak_fraction")
    if f is None:
        return None
    return f"≥{100 * f:.3g}" if r.get(f"{kind}_peak_fraction_lower_bound") else 100 * f


def _status(r: dict) -> str:
    """A row's status cell: ok, or what failed; a forward timed slower than its forward+backward (which contains
    it) is flagged, as a measurement to repeat."""
    st = [r.get("fwd_status")] + ([r.get("fwdbwd_status")] if "fwdbwd_status" in r else [])
    status = "ok" if all(s == "ok" for s in st) else "; ".join(
        f"{k}: {s}" for k, s in zip(("fwd", "fwd+bwd"), st) if s != "ok")
    if r.get("fwd_s") and r.get("fwdbwd_s") and r["fwd_s"] > r["fwdbwd_s"]:
        status += "; check: fwd slower than fwd+bwd (noise? remeasure)"
    return status


def summary(res: dict, out, files: list[str]) -> str:
    """What a run prints at its end: each cell's times and status, then the files it wrote."""
    rows = [[r["variant"], r["direction"], C.fmt_len(r["length"]), _ms(r.get("fwd_s")), _ms(r.get("fwdbwd_s")),
             _status(r)] for r in res["rows"]]
    skipped = [f"not run: {s['variant']} {s['direction']}: {s['reason']}" for s in res["skipped_variants"]]
    wrote = ", ".join(str(Path(out) / f) for f in ["attention.json", "attention.md", *(files or [])])
    return "\n".join([C.md_table(["variant", "direction", "T", "fwd ms", "fwd+bwd ms", "status"], rows), *skipped,
                      f"wrote {wrote}"])


def markdown(res: dict) -> str:
    a = res["header"]["args"]
    accel = (res["header"].get("machine") or {}).get("jax_backend", "cpu") != "cpu"
    unit, scale = ("TFLOP/s", 1e-3) if accel else ("GFLOP/s", 1.0)
    calls = a.get("calls_per_sample")
    parts = [f"Shapes: batch {a['batch']}, heads {a['heads']}, head_dim {a['head_dim']}, dtype {a['dtype']}; "
             f"median of {a['repeats']} "
             + ("runs" if calls in (None, 1) else
                "samples of " + (f"{calls} calls" if calls else "as many calls as fill about 50 ms"))
             + f" after {a['warmup']} warm-up; memory budget {a['mem_budget_gb']:g} GB; "
             f"cells predicted to take > {a['max_cell_s']:g} s are skipped.\n"]
    peak = res.get("peak") or {}
    parts.append(f"\nPeak for % of peak: {peak['tflops'] * 1e3 * scale:,.4g} {unit}, {peak['source']}; % of peak = the "
                 "analytic rate over it, else XLA's ('≥': a lower bound).\n" if peak.get("tflops")
                 else f"\nNo % of peak: {peak['reason']}.\n" if peak.get("reason") else "")
    mm = res.get("matmul")
    if mm:
        parts.append(f"\nMeasured f32 matmul rate ({mm['n']}×{mm['n']}): jax.jit(jnp.matmul) "
                     f"**{mm['jax_gflops']:.1f} GFLOP/s**, numpy **{mm['numpy_gflops']:.1f} GFLOP/s**.\n")
    for s in res["skipped_variants"]:
        parts.append(f"\n- `{s['variant']}` {s['direction']}: not run — {s['reason']}")
    if res["skipped_variants"]:
        parts.append("\n")
    headers = ["variant", "T", "fwd ms", "fwd+bwd ms", "XLA mem fwd MB", "XLA mem fwd+bwd MB", "peak RSS MB",
               f"{unit} fwd (model)", f"{unit} fwd (XLA)", f"{unit} fwd+bwd (model)", f"{unit} fwd+bwd (XLA)",
               "% of peak fwd", "% of peak fwd+bwd", "status"]

    def sc(x):
        return None if x is None else x * scale
    for dname in dict.fromkeys(r["direction"] for r in res["rows"]):
        rows = []
        for r in (r for r in res["rows"] if r["direction"] == dname):
            status = _status(r)
            xf = sc(r.get("fwd_xla_gflops_per_s"))
            xb = sc(r.get("fwdbwd_xla_gflops_per_s"))
            rss = max([x for x in (r.get("fwd_rss_peak_bytes"), r.get("fwdbwd_rss_peak_bytes")) if x] or [0]) or None
            rows.append([
                r["variant"], C.fmt_len(r["length"]), _ms(r.get("fwd_s")), _ms(r.get("fwdbwd_s")),
                _mb((r.get("fwd_xla_mem") or {}).get("total")), _mb((r.get("fwdbwd_xla_mem") or {}).get("total")),
                _mb(rss), sc(r.get("fwd_analytic_gflops_per_s") or r.get("fwd_method_gflops_per_s")),
                (f"≥{xf:.3g}" if r.get("fwd_xla_flops_has_loops") else xf) if xf else None,
                sc(r.get("fwdbwd_analytic_gflops_per_s") or r.get("fwdbwd_method_gflops_per_s")),
                (f"≥{xb:.3g}" if r.get("fwdbwd_xla_flops_has_loops") else xb) if xb else None,
                _pct(r, "fwd"), _pct(r, "fwdbwd"), status,
            ])
        parts.append(f"\n### {dname}\n\n" + C.md_table(headers, rows))
    parts.append(f"\n{unit} (model): exact attention's analytic count 4·B·H·T²·D (÷2 causal) forward, ×3.5 forward+backward "
                 "(backward = 2.5× forward, recomputation not counted); an efficient method's: the matrix-multiply "
                 "FLOPs in its jaxpr (a scan body times its length; a program with kernels counted as the "
                 "method's portable XLA implementation computes it). " + unit + " (XLA): flops from "
                 "`compiled.cost_analysis()` (XLA HloCostAnalysis) / time; '≥' marks programs with while loops, "
                 "whose bodies XLA counts once, or with kernels (custom calls), whose work it does not count, so "
                 "the count is a lower bound. XLA mem = arguments + outputs + "
                 "temporaries − aliased from `compiled.memory_analysis()`; peak RSS = the whole process "
                 "(includes the JAX runtime and inputs), sampled every 5 ms during the timed calls; the entry "
                 "points keep freed host memory in the process (longctx/host_memory.py), so it is the largest "
                 + ("RSS of the variant's own process so far (each variant runs in a child process of its own)"
                    if a.get("isolate") else "RSS of the run so far") + ", an upper bound for the cell.\n")
    ex = [[e["variant"], e["direction"], e.get("fwd_exponent"), ", ".join(map(C.fmt_len, e.get("fwd_lengths", []))),
           e.get("fwdbwd_exponent"), ", ".join(map(C.fmt_len, e.get("fwdbwd_lengths", [])))] for e in res["exponents"]]
    parts.append("\n### Scaling exponent (log-log least squares of time vs length, largest 3 measured lengths)\n\n")
    parts.append(C.md_table(["variant", "direction", "fwd exponent", "fwd lengths", "fwd+bwd exponent",
                             "fwd+bwd lengths"], ex))
    return "".join(parts)


def _bars(ax, labels: list[str], values: list, unit: str, title: str) -> None:
    """One length measured: each variant's value as a bar (a line plot over lengths would be a column of dots)."""
    shown = [(lab, v) for lab, v in zip(labels, values) if v]
    ax.barh([lab for lab, _ in shown], [v for _, v in shown], color="C0")
    for i, (_, v) in enumerate(shown):
        ax.annotate(f" {v:.3g}", (v, i), va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)


def plots(res: dict, out) -> list[str]:
    files = []
    for dname in dict.fromkeys(r["direction"] for r in res["rows"]):
        rs = [r for r in res["rows"] if r["direction"] == dname]
        labels = list(dict.fromkeys(r["variant"] for r in rs))
        one = len({r["length"] for r in rs}) == 1 and C.fmt_len(rs[0]["length"])
        fig, axes = C.new_figure(2)
        for ax, kind, title in ((axes[0], "fwd_s", "forward"), (axes[1], "fwdbwd_s", "forward+backward")):
            if one:
                _bars(ax, labels, [next((1e3 * r[kind] for r in rs if r["variant"] == lab and r.get(kind)), None)
                                   for lab in labels], "ms (median)", f"{title}, {dname}, T = {one}")
                continue
            for lab in labels:
                pts = sorted((r["length"], r[kind]) for r in rs if r["variant"] == lab and r.get(kind))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=lab)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length")
            ax.set_ylabel("seconds (median)")
            ax.set_title(f"{title}, {dname}")
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        path = out / f"attention_time_{dname}.png"
        C.save_figure(fig, path)
        files.append(path.name)
        fig, axes = C.new_figure(2)
        for ax, kind, title in ((axes[0], "xla", "XLA compiled memory (fwd+bwd, else fwd)"),
                                (axes[1], "rss", "peak process RSS")):
            bars = []
            for lab in labels:
                pts = []
                for r in rs:
                    if r["variant"] != lab:
                        continue
                    if kind == "xla":
                        m = (r.get("fwdbwd_xla_mem") or r.get("fwd_xla_mem") or {}).get("total")
                        ok = r.get("fwdbwd_status") == "ok" or r.get("fwd_status") == "ok"
                        val = m if ok else None
                    else:
                        val = max([x for x in (r.get("fwd_rss_peak_bytes"), r.get("fwdbwd_rss_peak_bytes")) if x] or [0])
                    if val:
                        pts.append((r["length"], val / C.MB))
                if pts and one:
                    bars.append((lab, pts[0][1]))
                elif pts:
                    ax.plot([p[0] for p in sorted(pts)], [p[1] for p in sorted(pts)], "o-", label=lab)
            if one:
                _bars(ax, [b[0] for b in bars], [b[1] for b in bars], "MB", f"{title}, {dname}, T = {one}")
                continue
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length")
            ax.set_ylabel("MB")
            ax.set_title(f"{title}, {dname}")
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        path = out / f"attention_memory_{dname}.png"
        C.save_figure(fig, path)
        files.append(path.name)
    return files


__all__ = ["define_flags", "analytic_dense_flops", "markdown", "plots", "run"]


# ----------------------------------------------------------------------------------------------
# --group: a stack of layers (a hybrid pattern's group) against the all-exact stack of the same depth



def validate(args) -> None:
    """``--group``'s checks (one line each): known methods or variants, at least one layer, causal or
    bidirectional, not both."""

    for g in getattr(args, "group", None) or ():
        names = [n.strip() for n in g.split(",")]
        if not g.strip() or not all(names):
            raise ConfigError(f"--group {g!r}: give a comma list of methods, one a layer, e.g. eva,eva,eva,dense")
        for n in names:
            if n.split(":")[0] not in attention.names():
                raise ConfigError(f"--group {g!r}: unknown method {n.split(':')[0]!r}; known: "
                                  f"{', '.join(attention.names())}")
    if getattr(args, "group", None) and args.causal and args.bidirectional:
        raise ConfigError("--group: give --causal or --bidirectional, not both (default: causal)")


def _group_layer(name: str) -> tuple[str, dict]:
    """(method, config overrides) of one layer: a bench variant label (``dense:blockwise``, ``fma``), else the
    method's default config (what a model's layer of that method runs, e.g. ``dense``: its platform default)."""
    method = name.split(":")[0]
    for label, ov in variants(method):
        if label == name:
            return method, ov
    if ":" in name:
        raise ConfigError(f"--group: {name!r} is not a variant of {method}; known: "
                          f"{', '.join(label for label, _ in variants(method))}")
    return method, {}


def group_fns(layers: list[str], *, heads: int, head_dim: int, causal: bool, seed: int, remat: bool = False):
    """(params, rest, forward, grads) of a stack of cores. Layer 1 reads its own standard-normal q, k, v; layer
    i > 1 reads its own q, k, v plus the previous layer's output (a residual stream without the per-layer
    projections, so the layers run one after another and keep unit-scale inputs). forward: the last layer's
    output, deterministic; grads: gradient of sum(last output * w) plus every core's auxiliary losses with respect
    to every core's parameters and every layer's q, k, v, deterministic=False with a key (the training path).
    ``remat``: each layer's core is rematerialised in the backward (``jax.checkpoint``, as a model trained with
    remat runs it), so the backward holds one layer's residuals at a time instead of every layer's."""

    fns = []
    for i, name in enumerate(layers):
        method, ov = _group_layer(name)
        fns.append(CoreFns(build_core(method, ov, heads=heads, head_dim=head_dim, causal=causal, seed=seed + i)))
    params = [f.params for f in fns]
    rest = [f.rest for f in fns]

    def one(i, deterministic, p, r, q, k, v, key):
        aux = Aux()
        kw = {} if deterministic else {"key": key}
        x, _ = fns[i].merge(p, r)(q, k, v, deterministic=deterministic, aux=aux, **kw)
        return x, dict(aux.losses)

    layer = jax.checkpoint(one, static_argnums=(0, 1)) if remat else one

    def stack(params, rest, qkvs, deterministic, key):
        x, losses = None, []
        for i, (p, r, (q, k, v)) in enumerate(zip(params, rest, qkvs)):
            if x is not None:
                q, k, v = q + x.astype(q.dtype), k + x.astype(k.dtype), v + x.astype(v.dtype)
            x, aux = layer(i, deterministic, p, r, q, k, v, None if deterministic else jax.random.fold_in(key, i))
            losses += list(aux.values())
        return x, losses

    def forward(params, rest, qkvs):
        return stack(params, rest, qkvs, True, None)[0]

    def loss(params, qkvs, rest, w, key):
        x, losses = stack(params, rest, qkvs, False, key)
        total = jnp.sum(x.astype(jnp.float32) * w)
        for val in losses:
            total = total + val
        return total

    g = jax.grad(loss, argnums=(0, 1))

    def grads(params, rest, qkvs, w, key):
        return g(params, qkvs, rest, w, key)

    return params, rest, forward, grads


def _groups(args) -> list[list[str]]:
    """The stacks to time: the all-exact stack of each depth first (the reference), then the others as given."""
    groups = [[n.strip() for n in g.split(",")] for g in args.group]
    exact = _exact_method()
    refs = [[exact] * depth for depth in dict.fromkeys(len(g) for g in groups)]
    return refs + [g for g in groups if g not in refs]


def group_command(args) -> list[str]:
    """The command line that repeats this ``--group`` run (its resolved shapes and timing settings)."""
    argv = ["longctx-bench", "attention"]
    for g in args.group:
        argv += ["--group", g]
    argv += ["--lengths", args.lengths, "--bidirectional" if args.bidirectional else "--causal"]
    for name in ("batch", "heads", "head_dim", "dtype", "repeats", "warmup", "calls_per_sample", "seed"):
        if getattr(args, name, None) is not None:
            argv += [f"--{name}", str(getattr(args, name))]
    for flag in ("no_backward", "group_remat"):
        if getattr(args, flag, False):
            argv.append(f"--{flag}")
    return argv


def run_group(args) -> dict:
    """``--group``: forward and forward+backward time of each stack (:func:`group_fns`) at each length, in this
    process, and its ratio to the all-exact stack of the same depth. Writes ``attention_group.json`` and
    ``attention_group.md`` into ``--out``."""
    out = C.out_dir(args.out)
    C.shape_defaults(args)
    lengths = C.parse_ints(args.lengths)
    dtype = C.dtype_of(args.dtype)
    causal = not args.bidirectional
    dname = C.dir_name(causal)
    B, H, D = args.batch, args.heads, args.head_dim
    budget = args.mem_budget_gb * C.GB
    groups = _groups(args)
    header = dict(C.header(args, "attention --group"), argv=group_command(args),
                  inputs="layer 1: its own standard-normal q, k, v; layer i > 1: its own q, k, v + the previous "
                         "layer's output (no per-layer projections)" + (
                             "; each layer rematerialised in the backward (--group_remat)" if args.group_remat else ""))
    res = {"header": header, "rows": []}
    bar = C.progress_bar(len(groups) * len(lengths), "attention --group", args.progress)
    for layers in groups:
        label = ",".join(layers)
        try:
            params, rest, fwd, grads = group_fns(layers, heads=H, head_dim=D, causal=causal, seed=args.seed,
                                                 remat=args.group_remat)
        except ConfigError as e:
            for T in lengths:
                res["rows"].append({"group": label, "layers": layers, "direction": dname, "length": T,
                                    "fwd_status": f"error: {e}", "fwdbwd_status": f"error: {e}"})
            bar.update(len(lengths))
            continue
        for T in lengths:
            bar.set_postfix_str(f"{label} T={C.fmt_len(T)}")
            row = {"group": label, "layers": layers, "direction": dname, "length": T, "batch": B, "heads": H,
                   "head_dim": D, "dtype": args.dtype}
            qkvs = [C.random_qkv(args.seed + T + 1000 * i, B, H, T, D, dtype) for i in range(len(layers))]
            w = jax.random.normal(jax.random.key(args.seed + 7), (B, H, T, D), jnp.float32)
            kinds = [("fwd", fwd, (params, rest, qkvs))]
            if not args.no_backward:
                kinds.append(("fwdbwd", grads, (params, rest, qkvs, w, jax.random.key(args.seed + 11))))
            for kind, fn, fargs in kinds:
                try:
                    compiled = jax.jit(fn).lower(*fargs).compile()
                    mem = C.memory_stats(compiled)
                    row[f"{kind}_xla_mem"] = mem
                    if mem.get("total", 0) > budget:
                        row[f"{kind}_status"] = (f"skipped: XLA estimate {mem['total'] / C.GB:.1f} GB > "
                                                 f"--mem_budget_gb {args.mem_budget_gb:g}")
                        continue
                    t = C.time_auto(compiled, *fargs, repeats=args.repeats, warmup=args.warmup,
                                    calls=getattr(args, "calls_per_sample", 1) or 0)
                    row[f"{kind}_s"] = t["median_s"]
                    row[f"{kind}_times"] = t
                    row[f"{kind}_status"] = "ok"
                    del compiled
                except Exception as e:  # noqa: BLE001 -- a failing cell is reported, the run goes on
                    row[f"{kind}_status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            res["rows"].append(row)
            C.write_json(out / "attention_group.partial.json", res)
            bar.update(1)
    bar.close()
    (out / "attention_group.partial.json").unlink(missing_ok=True)
    add_group_ratios(res["rows"])
    C.write_json(out / "attention_group.json", res)
    (out / "attention_group.md").write_text(group_markdown(res))
    return res


def add_group_ratios(rows: list[dict]) -> None:
    """``{kind}_vs_exact``: a stack's time over the all-exact stack's of the same depth, length and direction."""
    ref = {(len(r["layers"]), r["length"], r["direction"]): r for r in rows if set(r["layers"]) == {_exact_method()}}
    for r in rows:
        base = ref.get((len(r["layers"]), r["length"], r["direction"]))
        for kind in ("fwd", "fwdbwd"):
            if base and r.get(f"{kind}_s") and base.get(f"{kind}_s"):
                r[f"{kind}_vs_exact"] = r[f"{kind}_s"] / base[f"{kind}_s"]


def group_markdown(res: dict) -> str:
    h = res["header"]
    rows = res["rows"]
    first = rows[0] if rows else {}
    lines = [f"## Attention time of a stack of layers ({first.get('direction', '')}, batch {first.get('batch')}, "
             f"{first.get('heads')} heads of {first.get('head_dim')}, {first.get('dtype')})", "",
             f"Command: `{' '.join(h.get('argv', []))}`", "",
             f"Inputs: {h.get('inputs', '')}. Time = median over the timed calls of one jitted program running "
             "every layer's core; `vs exact` = the stack's time over the all-exact stack's of the same depth.", ""]
    body = []
    for r in rows:
        cells = [f"`{r['group']}`", C.fmt_len(r["length"])]
        for kind in ("fwd", "fwdbwd"):
            cells.append(_ms(r[f"{kind}_s"]) if r.get(f"{kind}_s") else r.get(f"{kind}_status", "-"))
            cells.append(f"{r[f'{kind}_vs_exact']:.2f}" if r.get(f"{kind}_vs_exact") else "-")
        body.append(cells)
    lines.append(C.md_table(["layers", "T", "forward ms", "vs exact", "forward+backward ms", "vs exact"], body))
    return "\n".join(lines) + "\n"
