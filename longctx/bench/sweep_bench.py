"""`longctx-bench sweep`: the execution knobs of each Pallas kernel tried on this device, and the fastest setting
proposed as the platform's default.

A kernel's knobs are the per-platform defaults its implementation declares (``Implementation.defaults``: tiles,
warps, stages, budgets). For each method that declares a kernel (``AttentionCore.kernel_benches``), one cell
(direction, length, shapes as in ``longctx-bench kernels``) is timed, forward+backward by default:

* first with every knob at the platform's declared default (the baseline);
* then one knob at a time (coordinate descent, in the declared order), each tried at half and twice its current
  best value (integers only, at least 1; a value the kernel refuses is a row with the refusal, not a failure), the
  others held at their best so far; a knob keeps the value that was fastest;
* the defaults are timed again at the end (the first setting timed pays for what a process warms once; the
  baseline is the faster of the two), and the knobs the descent moved are the proposal when they beat it by more
  than 3 %: ``sweep.md`` shows them as the ``defaults`` entry to declare for this platform, with the time against
  the baseline.

Every timed setting is a row of ``sweep.json`` (written after each one, so a run stopped by a time limit keeps what
it measured). On a CPU the kernels run in interpret mode: the rows check that every setting computes (the
``max_abs_diff_out`` column compares each setting's output with the baseline's), their times say nothing.
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
from longctx.bench.cores import build_core
from longctx.bench.kernel_bench import _error, _fns, define_kernel_flags, kernel_cells
from longctx.errors import ConfigError

CPU_LENGTH = "256"
MIN_GAIN = 1.03  # a setting is proposed only when it beats the declared defaults by more than 3 %
ACCEL_LENGTH = "32k"


def define_flags(fv) -> None:
    flags.DEFINE_string("length", None, f"sequence length (k = 1024); default {CPU_LENGTH} on cpu (interpret "
                        f"mode), {ACCEL_LENGTH} on a GPU or TPU", flag_values=fv)
    define_kernel_flags(fv)
    flags.DEFINE_integer("max_settings", 24, "at most this many settings timed per kernel", flag_values=fv)


def knobs(method: str, impl_name: str, platform: str) -> dict[str, int]:
    """The integer knobs the implementation ``impl_name`` of ``method`` declares, at their ``platform`` defaults."""
    impls = dispatch.by_name(attention.get_class(method).implementations(causal=True))
    impl = impls[impl_name]
    out = {}
    for key in impl.defaults:
        value = impl.setting(key, dispatch.PLATFORM_DEFAULT, platform)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[key] = value
    return out


def neighbours(value: int) -> list[int]:
    """The values tried around ``value``: half and twice it (at least 1)."""
    return [v for v in (value // 2, value * 2) if v >= 1 and v != value]


def _time_setting(method, kb, settings, args, dtype, causal, inputs):
    """(seconds, output, status) of the kernel with ``settings`` on top of its bench config."""
    try:
        core = build_core(method, {**kb.pallas, **settings}, heads=args.heads, head_dim=args.head_dim, causal=causal,
                          seed=args.seed)
        params, rest, fwd, grad = _fns(core)
        q, k, v, w = inputs
        fn, fargs = (fwd, (params, rest, q, k, v)) if args.no_backward else (grad, (params, rest, q, k, v, w))
        out = C.block(fwd(params, rest, q, k, v))
        C.block(fn(*fargs))
        t = C.time_auto(fn, *fargs, repeats=args.repeats, warmup=max(0, args.warmup - 1),
                        calls=getattr(args, "calls_per_sample", 1) or 0)
        return t["median_s"], out, "ok"
    except (ConfigError, dispatch.KernelUnsupportedError) as e:
        return None, None, f"refused: {str(e).splitlines()[0][:240]}"
    except Exception as e:  # noqa: BLE001 -- a failing setting is a row, the sweep goes on
        return None, None, _error(e)


def sweep_kernel(method, kname, kb, args, dtype, causal, platform, checkpoint=lambda rows: None) -> dict:
    """The rows of one kernel's sweep and its proposal."""
    impl_name = str(kb.pallas.get("impl", "pallas"))
    base = knobs(method, impl_name, platform)
    T, B, H, D = args.length_value, args.batch, args.heads, args.head_dim
    q, k, v = C.random_qkv(args.seed + T, B, H, T, D, dtype)
    w = jax.random.normal(jax.random.key(args.seed + 7), (B, H, T, D), jnp.float32)
    inputs = (q, k, v, w)
    rows: list[dict] = []
    out0 = None

    def measure(settings, knob):
        nonlocal out0
        t0 = time.perf_counter()
        sec, out, status = _time_setting(method, kb, settings, args, dtype, causal, inputs)
        row = {"method": method, "kernel": kname, "impl": impl_name, "knob": knob, "settings": dict(settings),
               "seconds": sec, "status": status, "wall_s": time.perf_counter() - t0}
        if out is not None:
            if out0 is None:
                out0 = out
            else:
                row["max_abs_diff_out"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - out0.astype(jnp.float32))))
        rows.append(row)
        checkpoint(rows)
        return sec

    best = dict(base)
    best_s = measure(best, None)
    baseline_s = best_s
    for key in base:
        for value in neighbours(best[key]):
            if len(rows) >= args.max_settings:
                break
            trial = {**best, key: value}
            sec = measure(trial, key)
            if sec is not None and (best_s is None or sec < best_s):
                best, best_s = trial, sec
    if best != base:  # the defaults again, last: the first setting timed pays for what is warmed once per process
        again = measure(base, "(defaults, again)")
        if again is not None and (baseline_s is None or again < baseline_s):
            baseline_s = again
        if baseline_s is not None and best_s is not None and best_s > baseline_s / MIN_GAIN:
            best, best_s = dict(base), baseline_s  # within the noise: keep the declared defaults
    moved = {key: best[key] for key in base if best[key] != base[key]}
    return {"method": method, "kernel": kname, "impl": impl_name, "platform": platform, "defaults": base,
            "best": best, "best_s": best_s, "baseline_s": baseline_s, "proposal": moved, "rows": rows}


def run(args) -> dict:
    out = C.out_dir(args.out)
    C.shape_defaults(args)
    args.length_value = C.parse_ints(args.length or (CPU_LENGTH if jax.default_backend() == "cpu" else ACCEL_LENGTH))[0]
    requested = C.parse_names(args.methods)
    cells = kernel_cells(requested)
    causal = not args.bidirectional
    cells = [c for c in cells if C.dir_name(causal) in c[2].directions]
    if not cells:
        raise ConfigError("longctx-bench sweep: no kernel of the requested methods serves the "
                          f"{C.dir_name(causal)} direction")
    platform = dispatch.current_platform()
    dtype = C.dtype_of(args.dtype)
    res = {"header": C.header(args, "sweep"), "platform": platform, "length": args.length_value, "kernels": []}
    bar = C.progress_bar(len(cells), "sweep", args.progress)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*interpret mode.*")
        for method, kname, kb in cells:
            bar.set_postfix_str(f"{method}/{kname}")
            done = res["kernels"]
            res["kernels"] = done + [sweep_kernel(
                method, kname, kb, args, dtype, causal, platform,
                lambda rows, m=method, k=kname, done=done: C.write_json(out / "sweep.json", {
                    **res, "kernels": done + [{"method": m, "kernel": k, "rows": rows}]}))]
            C.write_json(out / "sweep.json", res)
            bar.update(1)
    bar.close()
    C.write_json(out / "sweep.json", res)
    (out / "sweep.md").write_text(markdown(res))
    return res


def _ms(x):
    return "–" if x is None else f"{1e3 * x:.3g}"


def markdown(res: dict) -> str:
    """Per kernel: the proposal (the ``defaults`` entry to declare for the platform), then every timed setting."""
    plat = res.get("platform", "?")
    lines = [f"# Kernel knob sweep on {plat}, T={C.fmt_len(res.get('length', 0))}", ""]
    if plat == "cpu":
        lines += ["On a CPU the kernels run in interpret mode: every setting is checked to compute, the times say "
                  "nothing about a kernel's speed.", ""]
    for kern in res.get("kernels", []):
        lines.append(f"## {kern['method']} / {kern['kernel']} ({kern.get('impl', '?')})")
        lines.append("")
        if kern.get("best_s") is None:
            lines.append("no setting ran; see the rows")
        elif kern.get("proposal"):
            gain = kern["baseline_s"] / kern["best_s"] if kern.get("baseline_s") else None
            entry = ", ".join(f"{k!r}: {{{plat!r}: {v}}}" for k, v in kern["proposal"].items())
            lines.append(f"proposed `defaults` for {plat}: `{{{entry}}}` ({_ms(kern['best_s'])} ms against "
                         f"{_ms(kern.get('baseline_s'))} ms at the declared defaults"
                         + (f", {gain:.2f}x" if gain else "") + ")")
        else:
            lines.append(f"the declared defaults are the fastest setting tried ({_ms(kern['best_s'])} ms)")
        lines.append("")
        rows = [[r.get("knob") or "(defaults)", ", ".join(f"{k}={v}" for k, v in r["settings"].items()),
                 _ms(r.get("seconds")), r.get("max_abs_diff_out", "–"), r["status"]] for r in kern.get("rows", [])]
        lines.append(C.md_table(["knob tried", "settings", "ms", "max |Δout| vs defaults", "status"], rows))
        lines.append("")
    return "\n".join(lines)
