"""Shared pieces of the benchmarks: method selection through the registry, inputs,
timing, XLA memory/cost analysis, RSS sampling, machine description, output files."""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import statistics
import subprocess
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from longctx import attention
from longctx.attention.dense.platform import fused_call_flops
from longctx.bench.configs import _checkout
from longctx.errors import ConfigError

MB = 1 << 20
GB = 1 << 30


# ----------------------------------------------------------------------------- argument helpers
def parse_ints(text: str | None) -> list[int]:
    if not text:
        return []
    out = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1
        if part.endswith("k"):
            part, mult = part[:-1], 1024
        out.append(int(float(part) * mult))
    return out


def parse_names(text: str | None) -> list[str] | None:
    if not text:
        return None
    return [p.strip() for p in str(text).split(",") if p.strip()]


def select_methods(requested: list[str] | None) -> list[str]:
    """Registered methods (registry order), filtered by ``--methods`` (a request may name a
    variant such as ``dense:naive``; the method part selects it here)."""
    names = list(attention.names())
    if not requested:
        return names
    bases = {r.split(":")[0] for r in requested}
    unknown = sorted(bases - set(names))
    if unknown:
        raise ConfigError(f"unknown method(s) {', '.join(unknown)}; registered: {', '.join(names)}")
    return [n for n in names if n in bases]


def variant_selected(requested: list[str] | None, method: str, label: str) -> bool:
    """``--methods dense`` keeps every dense variant; ``--methods dense:naive`` only that one."""
    if not requested:
        return True
    return method in requested or label in requested


def dtype_of(name: str):
    return {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
            "float16": jnp.float16, "fp16": jnp.float16}[name]


def directions(args) -> list[bool]:
    """[causal?] from --causal/--bidirectional (neither given: both)."""
    want_c, want_b = getattr(args, "causal", False), getattr(args, "bidirectional", False)
    if not want_c and not want_b:
        return [True, False]
    return ([True] if want_c else []) + ([False] if want_b else [])


def dir_name(causal: bool) -> str:
    return "causal" if causal else "bidirectional"


# ----------------------------------------------------------------------------- inputs
def random_qkv(seed: int, B: int, H: int, T: int, D: int, dtype=jnp.float32, Dv: int | None = None):
    """Gaussian q, k, v [B, H, T, D] (standard normal: never all zeros)."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, H, T, D), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, H, T, D), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, H, T, Dv or D), jnp.float32).astype(dtype)
    return q, k, v


def tree_bytes(tree) -> int:
    return int(sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
                   if hasattr(x, "shape") and hasattr(x, "dtype")))


# ----------------------------------------------------------------------------- timing
def block(x):
    return jax.block_until_ready(x)


def time_calls(fn, *args, repeats: int, warmup: int = 1, calls: int = 1) -> dict:
    """Median wall time of one call of ``fn(*args)`` over ``repeats`` samples after ``warmup`` calls. A sample
    is ``calls`` calls dispatched back to back, the last one ended by ``block_until_ready``, divided by
    ``calls``: with enough of them the device never waits for the host, so the per-call launch cost vanishes
    from the time (on an accelerator; on a CPU one call per sample)."""
    for _ in range(warmup):
        block(fn(*args))
    calls = max(1, int(calls))
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        block(out)
        times.append((time.perf_counter() - t0) / calls)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "n": len(times),
            "calls_per_sample": calls, "all_s": times}


# The shapes and dtype `longctx-bench attention` and `kernels` default to: on a CPU what every earlier CPU
# result used (so they stay comparable); on a GPU / TPU a training-like occupancy (batch x heads = 64) in bf16,
# and several calls per timing sample (0: as many as fill about 50 ms) so that launch cost vanishes.
SHAPE_DEFAULTS = {
    "cpu": {"batch": 1, "heads": 4, "head_dim": 64, "dtype": "float32", "calls_per_sample": 1},
    "accelerator": {"batch": 8, "heads": 8, "head_dim": 64, "dtype": "bfloat16", "calls_per_sample": 0},
}


def shape_defaults(args, platform: str | None = None) -> dict:
    """Fill every of batch / heads / head_dim / dtype / calls_per_sample that ``args`` leaves None with the
    default of ``platform`` (default jax's backend; any non-'cpu' name is an accelerator); returns what was
    filled. A flag given on the command line always wins."""
    table = SHAPE_DEFAULTS["accelerator" if accelerator(platform) else "cpu"]
    filled = {}
    for k, v in table.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
            filled[k] = v
    return filled


def time_auto(fn, *args, repeats: int, warmup: int, calls: int) -> dict:
    """:func:`time_calls` with ``calls`` per sample; ``calls=0``: after the warm-up, :func:`calls_for`."""
    if calls:
        return time_calls(fn, *args, repeats=repeats, warmup=warmup, calls=calls)
    for _ in range(warmup):
        block(fn(*args))
    return time_calls(fn, *args, repeats=repeats, warmup=0, calls=calls_for(fn, *args))


def calls_for(fn, *args, target_s: float = 0.05, max_calls: int = 200) -> int:
    """Calls per timing sample so that one sample lasts about ``target_s``: ceil(target_s / one call's time),
    the call timed once more after whatever warm-up the caller did (1 where a call already takes that long)."""
    t0 = time.perf_counter()
    block(fn(*args))
    one = time.perf_counter() - t0
    return int(min(max_calls, max(1, math.ceil(target_s / max(one, 1e-7)))))


def fit_exponent(lengths, times, last: int = 3) -> float | None:
    """Least-squares slope of log(time) vs log(length) over the largest ``last`` measured lengths."""
    pts = sorted((L, t) for L, t in zip(lengths, times) if t is not None and t > 0)[-last:]
    if len(pts) < 2:
        return None
    x = np.log([p[0] for p in pts])
    y = np.log([p[1] for p in pts])
    return float(np.polyfit(x, y, 1)[0])


def predict_time(lengths, times, target: int, default_exponent: float = 2.0) -> float | None:
    """Extrapolate the time at ``target`` from the two largest measured points (slope >= 1),
    or from one point with ``default_exponent``."""
    pts = sorted((L, t) for L, t in zip(lengths, times) if t is not None and t > 0)
    if not pts:
        return None
    if len(pts) >= 2:
        (l0, t0), (l1, t1) = pts[-2], pts[-1]
        e = max(1.0, math.log(t1 / t0) / math.log(l1 / l0)) if l1 != l0 and t0 > 0 else default_exponent
    else:
        (l1, t1), e = pts[-1], default_exponent
    return t1 * (target / l1) ** e


# ----------------------------------------------------------------------------- XLA analysis
def memory_stats(compiled) -> dict:
    """Bytes from XLA's compiled memory analysis; ``total`` = arguments + outputs + temporaries − aliased."""
    try:
        m = compiled.memory_analysis()
    except Exception as e:  # some backends do not implement it
        return {"error": f"{type(e).__name__}: {e}"}
    if m is None:
        return {"error": "memory_analysis() returned None"}
    d = {k: int(getattr(m, k + "_size_in_bytes", 0) or 0) for k in ("argument", "output", "temp", "alias", "generated_code")}
    d["total"] = d["argument"] + d["output"] + d["temp"] - d["alias"]
    return d


def xla_flops(compiled) -> dict:
    """Flops from ``compiled.cost_analysis()`` ('flops' key of XLA's HloCostAnalysis). XLA counts a
    while-loop body once, not times its trip count (scan, lax.map, fori_loop), and does not count the work
    inside a custom call (a Pallas kernel, cuDNN's attention), so for programs with either the number is a
    lower bound: ``has_loops`` says so (the name is older than the custom calls)."""
    out = {"counter": "jax compiled.cost_analysis()['flops'] (XLA HloCostAnalysis)", "flops": None}
    try:
        ca = compiled.cost_analysis()
        if isinstance(ca, (list, tuple)):
            ca = ca[0] if ca else {}
        if ca and "flops" in ca:
            out["flops"] = float(ca["flops"])
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    try:
        text = compiled.as_text()
        out["has_loops"] = "while(" in text or "custom-call(" in text
    except Exception:
        out["has_loops"] = None
    return out


# ----------------------------------------------------------------------------- memory sampling
def ru_maxrss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) * (1 if platform.system() == "Darwin" else 1024)


class RssSampler:
    """Peak resident set size of a process (default: this one), sampled every ``interval`` s
    by a background thread while the ``with`` block runs."""

    def __init__(self, pid: int | None = None, interval: float = 0.005):
        import psutil

        self.proc = psutil.Process(pid or os.getpid())
        self.interval = interval
        self.peak = 0
        self.start = 0
        self._stop = threading.Event()
        self._thread = None

    def _rss(self) -> int:
        try:
            rss = self.proc.memory_info().rss
            for ch in self.proc.children(recursive=True) if self.proc.pid != os.getpid() else ():
                rss += ch.memory_info().rss
            return rss
        except Exception:
            return 0

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            self._stop.wait(self.interval)

    def __enter__(self):
        self.start = self._rss()
        self.peak = self.start
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    def as_dict(self) -> dict:
        return {"rss_start_bytes": int(self.start), "rss_peak_bytes": int(self.peak)}


# ----------------------------------------------------------------------------- machine
def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict:
    import psutil

    lscpu = _run(["lscpu"])
    fields = {}
    for line in lscpu.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            fields[k.strip()] = v.strip()
    keep = ("Architecture", "Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)",
            "L1d cache", "L2 cache", "L3 cache", "Flags")
    info = {
        "lscpu": {k: fields[k] for k in keep if k in fields and k != "Flags"},
        "avx512": "avx512f" in fields.get("Flags", ""),
        "nproc": (_run(["nproc"]).strip() or str(os.cpu_count())),
        "mem_total_gb": round(psutil.virtual_memory().total / GB, 1),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    try:
        import flax

        info["flax"] = flax.__version__
    except ImportError:
        pass
    info["numpy"] = np.__version__
    return info


def matmul_rate(n: int = 4096, repeats: int = 3) -> dict:
    """This machine's measured f32 matmul rate (2 n^3 flops per product) on two n x n standard-normal f32
    matrices, ``repeats`` calls after one warm-up: jax.jit(jnp.matmul) (``jax_gflops``: the median call;
    ``jax_best_gflops``: the fastest) and numpy's BLAS (``numpy_gflops``, ``numpy_best_gflops``)."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    t = time_calls(mm, a, b, repeats=repeats)
    flops = 2.0 * n**3
    an, bn = np.asarray(a), np.asarray(b)
    an @ bn
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        an @ bn
        times.append(time.perf_counter() - t0)
    tn = statistics.median(times)
    return {"n": n, "flops": flops, "repeats": max(1, repeats), "jax_s": t["median_s"],
            "jax_gflops": flops / t["median_s"] / 1e9, "jax_best_gflops": flops / t["min_s"] / 1e9,
            "numpy_s": tn, "numpy_gflops": flops / tn / 1e9, "numpy_best_gflops": flops / min(times) / 1e9}


# ----------------------------------------------------------------------------- device peaks and memory
# Dense bf16 matmul peak of each accelerator (vendor data sheets: tensor cores / MXUs without sparsity), in
# TFLOP/s, matched in order against jax's ``device.device_kind``; the first pattern that matches decides
# (None: a kind the table knows it does not cover). An unlisted device gets no peak, hence no MFU.
DEVICE_PEAK_BF16_TFLOPS = (
    (r"H100.*(PCIE|NVL)", None),  # the PCIe and NVL boards have lower clocks than the SXM part listed below
    (r"H100", 989.0),  # H100 SXM
    (r"H200", 989.0),
    (r"GH200", 989.0),
    (r"A100", 312.0),
    (r"TPU V4", 275.0),
    (r"TPU V5 ?LITE|TPU V5E", 197.0),
    (r"TPU V5P|TPU V5$", 459.0),
    (r"TPU V6 ?LITE|TPU V6E|TRILLIUM", 918.0),
)


def accelerator(platform: str | None = None) -> bool:
    """The platform ('cpu', 'gpu', 'cuda', 'rocm', 'tpu'; default jax's backend) is a GPU or TPU."""
    return (platform or jax.default_backend()) != "cpu"


def device_peak(platform: str | None = None, device_kind: str | None = None,
                matmul: dict | None = None) -> dict:
    """The peak FLOP rate MFU is measured against: ``{'tflops', 'source', 'reason'}``.

    * cpu: this machine's measured f32 matmul rate (``matmul``: the :func:`matmul_rate` of the run; the
      fastest call of jax's and numpy's, a peak being the best the machine shows, not its typical rate under
      other load); none measured (``--matmul_n 0``): no peak, with the reason.
    * gpu / tpu: the device kind's dense bf16 peak from :data:`DEVICE_PEAK_BF16_TFLOPS`; a kind not in the
      table: no peak, with the reason."""
    import re

    platform = platform or jax.default_backend()
    if not accelerator(platform):
        if not matmul or not matmul.get("jax_gflops"):
            return {"tflops": None, "source": None,
                    "reason": "no measured matmul rate on this CPU (--matmul_n 0): MFU not reported"}
        best = max(matmul.get("jax_best_gflops") or matmul["jax_gflops"], matmul.get("numpy_best_gflops") or 0.0)
        return {"tflops": best / 1e3,
                "source": f"measured f32 matmul rate of this CPU: the fastest of {matmul.get('repeats', 3)} calls "
                          f"(after one warm-up) of jax.jit(jnp.matmul) and of numpy on {matmul['n']}x{matmul['n']} "
                          "f32, whichever is higher",
                "reason": None}
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    for pat, tf in DEVICE_PEAK_BF16_TFLOPS:
        if re.search(pat, device_kind.upper()):
            if tf is None:
                break
            return {"tflops": tf, "source": f"dense bf16 peak of {device_kind} (data sheet, "
                                            "longctx/bench/common.py DEVICE_PEAK_BF16_TFLOPS)", "reason": None}
    return {"tflops": None, "source": None,
            "reason": f"device kind {device_kind!r} is not in the bf16 peak table: MFU not reported"}


def device_memory() -> dict:
    """The first device's own allocator statistics (``device.memory_stats()``: peak bytes in use so far in this
    process, bytes in use, the limit) where jax exposes them; on a CPU it does not (``reason`` says so)."""
    try:
        st = jax.devices()[0].memory_stats()
    except Exception as e:  # noqa: BLE001 -- some backends raise instead of returning None
        st, err = None, f"{type(e).__name__}: {e}"
    else:
        err = None
    if not st:
        return {"peak_bytes_in_use": None,
                "reason": f"not available on {jax.default_backend()} (device.memory_stats() "
                          + (f"raised {err})" if err else "returned None)")}
    return {k: int(st[k]) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit") if k in st}


# ----------------------------------------------------------------------------- FLOPs counted in a jaxpr
def _prod(xs) -> int:
    return int(np.prod([int(x) for x in xs], dtype=np.float64)) if len(xs) else 1


def _eqn_matmul_flops(eqn) -> float:
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        a = eqn.invars[0].aval
        return 2.0 * _prod(eqn.outvars[0].aval.shape) * _prod([a.shape[i] for i in lc])
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        dn = eqn.params["dimension_numbers"]
        out_features = rhs.shape[dn.rhs_spec[0]] if dn is not None else rhs.shape[0]
        return 2.0 * _prod(eqn.outvars[0].aval.shape) * _prod(rhs.shape) / max(1, out_features)
    return 0.0


def jaxpr_matmul_flops(fn, *args) -> dict:
    """Matrix-multiply FLOPs of ``fn(*args)`` counted in its jaxpr: 2·M·N·K per ``dot_general`` and per
    convolution output element 2·(kernel size), a ``scan`` body times its length, a ``cond`` its most expensive
    branch, a ``shard_map`` body (per-device shapes) times the devices of the axes it makes manual, every other
    nested jaxpr (jit, remat, custom derivatives) once. A fused attention call (cuDNN, splash: a jit the kernel
    module tags, ``longctx.attention.dense.platform.fused_call_flops``) counts its analytic 4·B·H·Tq·Tk·D, halved
    for causal, in place of its opaque custom call. Elementwise work is not counted (the MFU convention).
    ``while_loops``: loops of unknown trip count, counted once (the number is then a lower bound); ``opaque``:
    primitives whose work is not visible (untagged Pallas or custom calls); ``fused_calls``: the tagged fused
    attention calls counted analytically."""
    from jax.extend import core as jcore

    stats = {"while_loops": 0, "opaque": set(), "fused_calls": 0}

    def count(jaxpr) -> float:
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        total = 0.0
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            total += _eqn_matmul_flops(eqn)
            fused = fused_call_flops(eqn.params.get("name", ""), [v.aval for v in eqn.invars]) \
                if name in ("jit", "pjit") else None
            if fused is not None:
                stats["fused_calls"] += 1
                total += fused
            elif name == "scan":
                total += eqn.params["length"] * count(eqn.params["jaxpr"])
            elif name == "while":
                stats["while_loops"] += 1
                total += count(eqn.params["body_jaxpr"]) + count(eqn.params["cond_jaxpr"])
            elif name == "cond":
                total += max((count(b) for b in eqn.params["branches"]), default=0.0)
            elif name == "shard_map":
                mesh, manual = eqn.params["mesh"], eqn.params.get("newly_manual_axes", ())
                total += _prod([mesh.shape[a] for a in manual]) * count(eqn.params["jaxpr"])
            elif "pallas" in name or name in ("custom_call", "ffi_call"):
                stats["opaque"].add(name)
            else:
                for v in eqn.params.values():
                    for sub in (v if isinstance(v, (list, tuple)) else (v,)):
                        if isinstance(sub, (jcore.Jaxpr, jcore.ClosedJaxpr)):
                            total += count(sub)
        return total

    flops = count(jax.make_jaxpr(fn)(*args))
    return {"flops": flops, "while_loops": stats["while_loops"], "opaque": sorted(stats["opaque"]),
            "fused_calls": stats["fused_calls"]}


# ----------------------------------------------------------------------------- outputs
def out_dir(path) -> Path:
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    return p


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.bool_,)):
        return bool(x)
    return x


def write_json(path: Path, payload: dict) -> None:
    Path(path).write_text(json.dumps(_jsonable(payload), indent=1, allow_nan=False) + "\n")


def md_table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        if v is None:
            return "–"
        if isinstance(v, float):
            if v == 0:
                return "0"
            if abs(v) >= 1000:
                return f"{v:,.0f}"
            if abs(v) >= 10:
                return f"{v:.1f}"
            if abs(v) >= 0.01:
                return f"{v:.3g}"
            return f"{v:.2e}"
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def fmt_len(T: int) -> str:
    return f"{T // 1024}k" if T >= 1024 and T % 1024 == 0 else str(T)


def new_figure(ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.2), squeeze=False)
    return fig, axes[0]


def save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True)


def define_qkv_flags(fv, *, note: str = "") -> None:
    """``--batch``, ``--heads`` and ``--head_dim`` of fixed defaults (1, 4, 64): the q/k/v shape of ``decode`` and
    ``quality`` (``note``: where the head flags apply)."""
    flags.DEFINE_integer("batch", 1, "batch", flag_values=fv)
    flags.DEFINE_integer("heads", 4, "attention heads" + note, flag_values=fv)
    flags.DEFINE_integer("head_dim", 64, "head size" + note, flag_values=fv)


def header(args, command: str) -> dict:
    """Run description stored at the top of every JSON output."""

    root = _checkout()
    return {
        "command": command,
        "args": {k: v for k, v in vars(args).items() if not callable(v)},
        "machine": machine_info(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "git_sha": _run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"]).strip() if root else "",
    }


def portable_impl(name: str) -> str | None:
    """The XLA implementation that method ``name``'s Pallas kernels are benchmarked against (the ``impl`` of its
    ``kernel_benches`` ``xla`` entries): the portable program whose jaxpr the FLOP counts read where the timed
    program runs kernels. None: the method declares no kernel."""
    impls = sorted({b.xla["impl"] for b in attention.get_class(name).kernel_benches().values() if "impl" in b.xla})
    return impls[0] if impls else None
