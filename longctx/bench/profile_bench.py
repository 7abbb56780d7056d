"""`longctx-bench profile`: where one compiled call's time goes, by XLA op, op kind and source line.

    longctx-bench profile --out bench_out/profile --method eva --length 8k
    longctx-bench profile --out bench_out/profile_main --config configs/main.py --length 256 --batch 16
    longctx-bench profile --config configs/default.py --config.model.d_model=128 --length 1k

The target is an attention core (``--method``, a registered method or ``method:variant``; random q, k, v;
forward+backward of ``sum(out * w)`` as ``longctx-bench attention`` times it, or ``--forward_only``) or the
whole-model training step of a config (``--config``, as ``longctx-bench step`` builds it). It is compiled once;
after ``--warmup`` calls, ``--calls`` calls are timed with ``getrusage`` (wall, CPU seconds per wall second,
minor page faults) and then traced with ``jax.profiler``. Every trace event whose name is an instruction of the
compiled module is summed per call and joined to the module's text: the instruction's shape, its op kind
(XLA's name without the number: ``ynn_fusion``, ``dot``, ``copy_bitcast_fusion``, ...) and the innermost
frame of this repository in its source stack (a custom VJP's backward ops carry the frame of the call).

Written under ``--out``: ``profile.json``, ``profile.md`` (the tables), ``hlo.txt`` (the compiled module) and
``trace/`` (open it with TensorBoard's profile plugin or Perfetto). Reading a CPU trace: the per-op times are
thread time on the thread that ran the op; a library matmul's helper threads and the asynchronous work of
XLA's own ``dot`` ops are not all in the events, so compare kinds within one trace and check a single op
alone before trusting its absolute time. On a GPU the accelerator's kernel events are used (a fusion's kernel
is named after its instruction, ``fusion_5`` for ``fusion.5``); library GEMMs and Pallas kernels are not named
after an instruction and are listed apart, by kernel name. Times vary with the machine's load; profile an idle
machine.
"""

from __future__ import annotations

import collections
import glob
import re
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from absl import flags

from longctx import attention
from longctx.bench import common as C
from longctx.bench import step_bench
from longctx.bench.cores import CoreFns, build_core, variants
from longctx.bench.step_bench import _timed
from longctx.errors import ConfigError

# The folder that holds the ``longctx`` package (a checkout or site-packages): source lines of the
# compiled module are shown relative to it.
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def define_flags(fv) -> None:
    define_target_flags(fv)
    flags.DEFINE_integer("calls", 5, "calls timed, then traced", flag_values=fv)
    flags.DEFINE_integer("warmup", 2, "untimed calls after compiling", flag_values=fv)
    flags.DEFINE_integer("top", 25, "rows of the op and source-line tables in profile.md", flag_values=fv)


def define_target_flags(fv) -> None:
    """What is timed (an attention core or a config's training step) and its shapes: ``profile`` and ``ab``."""
    flags.DEFINE_string("method", None, "an attention core: a method (its default config) or method:variant (a "
                        "variant the attention bench times, e.g. dense:blockwise)", flag_values=fv)
    flags.DEFINE_string("config", None, "the whole-model training step of this config file instead", flag_values=fv)
    flags.DEFINE_string("length", "8k", "sequence length (k = 1024)", flag_values=fv)
    flags.DEFINE_integer("batch", 1, "batch (--config: train.batch_size)", flag_values=fv)
    flags.DEFINE_integer("window", 0, "--config: train.window, tokens per update with the state carried (0: the "
                         "whole row)", flag_values=fv)
    flags.DEFINE_integer("heads", 4, "attention heads (--method)", flag_values=fv)
    flags.DEFINE_integer("head_dim", 64, "head size (--method)", flag_values=fv)
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute dtype (--method)", flag_values=fv)
    flags.DEFINE_bool("bidirectional", False, "--method: the bidirectional core (default causal)", flag_values=fv)
    flags.DEFINE_bool("forward_only", False, "--method: the forward alone", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "random seed of the inputs", flag_values=fv)


# ----------------------------------------------------------------------------- the compiled module's text
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) ([\w\-]+)\((.*)$")


def _stack_tables(text: str):
    """(files, functions, locations, frames) from the module text's stack-frame tables (empty when absent).
    A frame's ``parent_frame_id`` as printed is the parent's printed id + 1 (0 and 1: no parent)."""
    sections, cur = collections.defaultdict(list), None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            cur = line
            continue
        if cur and re.match(r"^\d+ ", line):
            sections[cur].append(line)
        else:
            cur = None
    strings = lambda rows: {int(r.split(" ", 1)[0]): r.split(" ", 1)[1].strip('"') for r in rows}  # noqa: E731
    locs = {}
    for r in sections["FileLocations"]:
        m = re.match(r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", r)
        if m:
            locs[int(m[1])] = (int(m[2]), int(m[3]), int(m[4]))
    frames = {}
    for r in sections["StackFrames"]:
        m = re.match(r"(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", r)
        if m:
            frames[int(m[1])] = (int(m[2]), int(m[3]) - 1)
    return strings(sections["FileNames"]), strings(sections["FunctionNames"]), locs, frames


def source_of(frame_id, tables, root: Path = SOURCE_ROOT) -> str | None:
    """'path:line (function)' of the innermost frame under ``root`` (else the innermost frame) of a stack."""
    files, funcs, locs, frames = tables
    first, fid, seen = None, frame_id, set()
    while fid in frames and fid not in seen:
        seen.add(fid)
        loc, parent = frames[fid]
        if loc in locs:
            fn, fu, line = locs[loc]
            path = files.get(fn, "?")
            shown = f"{_rel(path, root)}:{line} ({funcs.get(fu, '?')})"
            first = first or shown
            if Path(path).is_absolute() and Path(path).resolve().is_relative_to(root) and "site-packages" not in path:
                return shown
        fid = parent
    return first


def _rel(path: str, root: Path) -> str:
    p = Path(path)
    try:
        return str(p.resolve().relative_to(root)) if p.is_absolute() else path
    except ValueError:
        return path


def slow_reduce(body: list[str]) -> bool:
    """Whether a fused computation (its lines) reduces the product of two different operands into a result that
    keeps a dimension of size 1 (``f32[1,4,8192]`` from ``[1,4,8192,64]``): as a YNNPACK fusion, XLA:CPU (jax
    0.10.2) runs that far slower than the same sum written as a dot, whose reduce folds the size-1 dimensions
    away (the XLA:CPU helpers; docs/DESIGN.md, "XLA:CPU slow paths"; measure one with this command's
    ``--method`` on the core that holds it)."""
    ops = {m[1]: m for m in map(_INSTR.match, body) if m}
    operands = lambda m: re.findall(r"%([\w.\-]+)", m[4].split("), ")[0])  # noqa: E731
    for m in ops.values():
        dims = re.match(r"\w+\[([\d,]*)\]", m[2])
        if m[3] != "reduce" or not dims or "1" not in dims[1].split(","):
            continue
        src = ops.get(operands(m)[0]) if operands(m) else None
        if src is not None and src[3] == "multiply" and len(set(operands(src))) == 2:
            return True
    return False


def row_dot(line: str, shapes: dict) -> bool:
    """Whether an unfused ``dot`` instruction contracts the second-to-last axis of its left operand (the rows of a
    ``[.., rows, d]`` array: ``dk = dsᵀ q`` as autodiff writes it): XLA:CPU (jax 0.10.2) does not give that form to
    YNNPACK and runs it as a generic dot at a lower rate than YNNPACK's plain product (the rewrites the CPU
    implementations use: docs/DESIGN.md, "XLA:CPU slow paths")."""
    im = _INSTR.match(line)
    if not im or im[3] != "dot":
        return False
    lhs = re.findall(r"%([\w.\-]+)", im[4].split("), ")[0])
    contracting = re.search(r"lhs_contracting_dims=\{(\d+)\}", line)
    dims = re.match(r"\w+\[([\d,]*)\]", shapes.get(lhs[0], "")) if lhs else None
    if not (contracting and dims):
        return False
    rank = len([d for d in dims[1].split(",") if d])
    return rank >= 2 and int(contracting[1]) == rank - 2


def hlo_index(text: str, root: Path = SOURCE_ROOT) -> dict:
    """name -> {shape, opcode, root, op_name, source, slow_path} for every instruction of the module text; a fusion
    without metadata of its own takes its fused computation's root's, else that of the last fused instruction with
    a source frame. ``slow_path``: False, or why the op may be one of XLA:CPU's slow paths: 'row sum' (a YNNPACK
    fusion :func:`slow_reduce` flags) or 'row dot' (:func:`row_dot`)."""
    tables = _stack_tables(text)
    comps, cur, instrs = {}, None, {}
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%([\w.\-]+) ", line)
        if m and line.rstrip().endswith("{"):
            cur = comps.setdefault(m[1], [])
            continue
        if cur is not None:
            cur.append(line)
            if line == "}":
                cur = None
        im = _INSTR.match(line)
        if im:
            instrs[im[1]] = line
    roots = {name: next((ln for ln in body if ln.lstrip().startswith("ROOT ")), "") for name, body in comps.items()}
    # the metadata of a fused computation: its root's, else the last of its instructions that has a stack frame
    metas = {name: roots[name] if "stack_frame_id" in roots[name]
             else next((ln for ln in reversed(body) if "stack_frame_id" in ln), roots[name])
             for name, body in comps.items()}
    shapes = {name: _INSTR.match(line)[2] for name, line in instrs.items()}
    out, sources = {}, {}  # sources: frame id -> its line (one walk per frame)
    for name, line in instrs.items():
        im = _INSTR.match(line)
        called = re.search(r"calls=%([\w.\-]+)", line)
        root_line = roots.get(called[1], "") if called else ""
        meta = line if "metadata=" in line else (metas.get(called[1], "") if called else "")
        frame = re.search(r"stack_frame_id=(\d+)", meta)
        op_name = re.search(r'op_name="([^"]*)"', meta)
        root_op = _INSTR.match(root_line)
        if frame and int(frame[1]) not in sources:
            sources[int(frame[1])] = source_of(int(frame[1]), tables, root)
        out[name] = {"shape": im[2], "opcode": im[3], "root": root_op[3] if root_op else None,
                     "op_name": op_name[1] if op_name else "",
                     "source": (sources[int(frame[1])] if frame else None) or NO_SOURCE,
                     "slow_path": ("row sum" if called and "__ynn_fusion" in line and slow_reduce(comps.get(called[1], []))
                                   else "row dot" if row_dot(line, shapes) else False),
                     "operands": re.findall(r"%([\w.\-]+)", im[4].split("), ")[0])}
    direct = {name: rec["source"] for name, rec in out.items() if rec["source"] != NO_SOURCE}
    for rec in out.values():  # an op without a frame (XLA made it): the source of its first operand that has one
        src = next((direct[o] for o in rec.pop("operands") if o in direct), None)
        if rec["source"] == NO_SOURCE and src:
            rec["source"] = f"{src} (an operand's)"
    return out


NO_SOURCE = "(no source: an op XLA made)"


def op_kind(name: str, root: str | None = None) -> str:
    """XLA's instruction name without its number, and a fusion's root op: 'ynn_fusion [dot]'."""
    kind = re.sub(r"\.\d+$", "", name)
    return f"{kind} [{root}]" if root else kind


# ----------------------------------------------------------------------------- the target
def _core_target(args, T: int):
    method, _, variant = args.method.partition(":")
    options = dict(variants(method))  # a bare method name: its default config (e.g. dense's impl='auto')
    label = args.method
    if variant and label not in options:
        raise ConfigError(f"--method={args.method!r}: {method} offers {', '.join(options)}")
    core = build_core(method, options[label] if variant else None, heads=args.heads, head_dim=args.head_dim,
                      causal=not args.bidirectional, seed=args.seed)
    fns = CoreFns(core)
    q, k, v = C.random_qkv(args.seed + T, args.batch, args.heads, T, args.head_dim, C.dtype_of(args.dtype),
                           core.value_dim)
    if args.forward_only:
        fn, call = fns.forward(), (fns.params, fns.rest, q, k, v)
    else:
        w = jax.random.normal(jax.random.key(args.seed + 7), (args.batch, args.heads, T, core.value_dim), jnp.float32)
        fn, call = fns.grads(), (fns.params, fns.rest, q, k, v, w, jax.random.key(args.seed + 11))
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*call).compile()
    what = f"`{label}` {'bidirectional' if args.bidirectional else 'causal'} " \
           f"{'forward' if args.forward_only else 'forward+backward'}, batch {args.batch}, {args.heads} heads of " \
           f"{args.head_dim}, {args.dtype}, T = {C.fmt_len(T)}"
    return compiled, call, time.perf_counter() - t0, what


def _step_target(args, T: int):
    base = step_bench.base_config(args)
    cfg = step_bench.length_config(base, T, SimpleNamespace(batch_size=args.batch, window=args.window, vocab_size=256))
    if cfg.model.kind != "decoder":
        raise ConfigError(f"longctx-bench profile --config profiles decoder training steps; {args.config} has "
                          f"model.kind={cfg.model.kind!r} (profile its attention core with --method instead)")
    t0 = time.perf_counter()
    compiled, call, _, _ = step_bench.build_step(cfg, seed=args.seed)
    sets = "".join(f" --config.{s}" for s in args.overrides)
    return compiled, call, time.perf_counter() - t0, \
        f"training step of `{step_bench._shown(args.config)}`{sets}, batch {args.batch}, T = {C.fmt_len(T)}" + \
        (f", updates of {args.window} tokens" if args.window else "")


# ----------------------------------------------------------------------------- run
def _usage(compiled, call, n: int) -> dict:
    """Wall time, CPU seconds per wall second and minor page faults of n calls (``longctx-bench step``'s timer)."""

    runs = [_timed(compiled, call) for _ in range(n)]
    return {"wall_ms_median": 1e3 * statistics.median(r["s"] for r in runs), "wall_ms_all": [1e3 * r["s"] for r in runs],
            "cpu_per_wall": sum(r["cpu_s"] for r in runs) / sum(r["s"] for r in runs),
            "minor_faults_per_call": sum(r["minflt"] for r in runs) / n}


def _trace(compiled, call, n: int, trace_dir: Path) -> dict:
    """Duration (ns, summed over the n calls) and count of the op events, by event name; ``device``: whether they
    come from an accelerator's planes."""
    with jax.profiler.trace(str(trace_dir)):
        for _ in range(n):
            C.block(compiled(*call))
    files = sorted(glob.glob(str(trace_dir / "**" / "*.xplane.pb"), recursive=True))
    if not files:
        raise RuntimeError(f"jax.profiler wrote no .xplane.pb under {trace_dir}")
    data = jax.profiler.ProfileData.from_file(files[-1])
    dur, cnt = collections.Counter(), collections.Counter()
    lines, device = _op_lines(data.planes)
    for line in lines:
        for ev in line.events:
            dur[ev.name] += ev.duration_ns
            cnt[ev.name] += 1
    return {"duration_ns": dur, "count": cnt, "device": device}


def instruction_of(event: str, index: dict) -> str | None:
    """The module instruction an event stands for, by name: a CPU thunk's event is named as the instruction, a
    GPU kernel after it with '_' for '.' ('fusion_5' for 'fusion.5'). Events are not matched by their ``hlo_op``
    stat: on a CPU the events around an op carry it too (they would count it twice), and on a GPU inside a CUDA
    graph it names the whole command buffer."""
    for name in (event, re.sub(r"_(\d+)$", r".\1", event)):
        if name in index:
            return name
    return None


def _op_lines(planes) -> tuple[list, bool]:
    """(lines, on an accelerator) of the trace lines whose events are the ops: an accelerator's planes where there
    are any (its 'XLA Ops' line where the trace has one; the host's launch events would count each op twice), else
    the host's."""
    planes = list(planes)
    device = [p for p in planes if p.name.startswith("/device:")]
    if not device:
        return [line for p in planes for line in p.lines], False
    lines = []
    for p in device:
        ops = [line for line in p.lines if line.name == "XLA Ops"]
        lines += ops or list(p.lines)
    return lines, True


def summarize(events: dict, index: dict, n: int) -> dict:
    """Per-call ms by instruction, op kind and source line, from the trace events matched to the module; on an
    accelerator also the kernels no instruction names (library GEMMs, Pallas kernels), as ``unmatched``."""
    per, counts, unmatched = collections.Counter(), collections.Counter(), collections.Counter()
    for event, ns in events["duration_ns"].items():
        name = instruction_of(event, index)
        if name is None:
            unmatched[event] += ns / n / 1e6
            continue
        per[name] += ns / n / 1e6
        counts[name] += events["count"][event] / n
    ops = sorted(({"name": k, "ms": ms, "count": counts[k], **index[k]} for k, ms in per.items()), key=lambda o: -o["ms"])
    by = lambda key: sorted(  # noqa: E731
        ({key: k, "ms": sum(o["ms"] for o in g), "ops": len(g)} for k, g in _groups(ops, key).items()),
        key=lambda r: -r["ms"])
    extra = [{"event": k, "ms": ms} for k, ms in unmatched.most_common()] if events.get("device") else []
    return {"total_ms": sum(o["ms"] for o in ops) + sum(r["ms"] for r in extra), "ops": ops, "kinds": by("kind"),
            "sources": by("source"), "unmatched": extra}


def _groups(ops, key):
    g = collections.defaultdict(list)
    for o in ops:
        g[op_kind(o["name"], o["root"]) if key == "kind" else o[key]].append(o)
    return g


def validate(args) -> None:
    """``--method`` names a registered method or one of its benchmarked variants."""
    if not args.method:
        return

    method, _, variant = args.method.partition(":")
    if method not in attention.names():
        raise ConfigError(f"--method={args.method!r}: unknown method; registered: {', '.join(attention.names())}")
    options = [label for label, _ in variants(method)]
    if variant and args.method not in options:
        raise ConfigError(f"--method={args.method!r}: {method} offers {', '.join(options)}")


def run(args) -> dict:
    if bool(args.method) == bool(args.config):
        raise ConfigError("longctx-bench profile: give exactly one of --method (an attention core) or --config "
                          "(a training step)")
    if args.calls <= 0 or args.warmup < 0 or args.batch <= 0:
        raise ConfigError("--calls and --batch must be positive, --warmup >= 0")
    lengths = C.parse_ints(args.length)
    if len(lengths) != 1:
        raise ConfigError(f"--length={args.length!r}: give one length, e.g. 8k")
    T = lengths[0]
    out = C.out_dir(args.out)
    compiled, call, compile_s, what = (_core_target if args.method else _step_target)(args, T)
    text = compiled.as_text()
    (out / "hlo.txt").write_text(text)
    for _ in range(args.warmup):
        C.block(compiled(*call))
    usage = _usage(compiled, call, args.calls)
    summary = summarize(_trace(compiled, call, args.calls, out / "trace"), hlo_index(text), args.calls)
    res = {"header": C.header(args, "profile"), "target": what, "length": T, "compile_s": compile_s,
           "xla_mem": C.memory_stats(compiled), "xla_flops": C.xla_flops(compiled)["flops"], **usage,
           "traced_op_ms_per_call": summary["total_ms"], "kinds": summary["kinds"], "sources": summary["sources"],
           "ops": summary["ops"], "unmatched": summary["unmatched"],
           "slow_path_ms": sum(o["ms"] for o in summary["ops"] if o.get("slow_path"))}
    C.write_json(out / "profile.json", res)
    (out / "profile.md").write_text(markdown(res, args.top))
    print(markdown(res, args.top))
    return res


def markdown(res: dict, top: int = 25) -> str:
    mem = res["xla_mem"]
    fl = res["xla_flops"]
    lines = [
        f"Profile of the {res['target']} (`longctx-bench profile`, {res['header']['time']}, git "
        f"{res['header']['git_sha']}).", "",
        f"Wall {res['wall_ms_median']:.1f} ms per call (median of {len(res['wall_ms_all'])}); "
        f"{res['cpu_per_wall']:.2f} CPU seconds per wall second; {res['minor_faults_per_call']:.0f} minor page faults "
        f"per call; compile {res['compile_s']:.1f} s; XLA temporaries {mem.get('temp', 0) / 1e6:,.0f} MB"
        + (f"; XLA flops {fl / 1e9:,.2f} G" if fl else "") + ". Traced op time "
        f"{res['traced_op_ms_per_call']:.1f} ms per call (the ops the trace records: thread time on a CPU, kernel time "
        "on an accelerator, summed over threads and streams; a CPU op's event can include its wait for helper "
        "threads, and see `longctx/bench/profile_bench.py` for what a CPU trace leaves out).", "",
        "### By op kind", "",
        C.md_table(["kind", "ms per call", "ops"], [[r["kind"], f"{r['ms']:.2f}", r["ops"]] for r in res["kinds"][:top]]),
        "", "### By source line (innermost frame in this repository)", "",
        C.md_table(["source", "ms per call", "ops"],
                   [[f"`{r['source']}`", f"{r['ms']:.2f}", r["ops"]] for r in res["sources"][:top]]),
        *([f"### Kernels no instruction names (library GEMMs, Pallas kernels; {sum(r['ms'] for r in res['unmatched']):.2f} "
           "ms per call)", "", C.md_table(["kernel", "ms per call"],
                                          [[f"`{r['event'][:90]}`", f"{r['ms']:.3f}"] for r in res["unmatched"][:top]]),
           ""] if res.get("unmatched") else []),
        *_slow_section(res, top),
        "", f"### The {top} costliest ops", "",
        C.md_table(["op", "shape", "ms per call", "source", "op_name"],
                   [[f"`{o['name']}`", f"`{o['shape']}`", f"{o['ms']:.2f}", f"`{o['source']}`",
                     f"`{o['op_name'][-70:]}`"] for o in res["ops"][:top]]),
        "",
    ]
    return "\n".join(lines)


def _slow_section(res: dict, top: int) -> list[str]:
    slow = [o for o in res["ops"] if o.get("slow_path")]
    if not slow:
        return []
    return ["", f"### Possible XLA:CPU slow paths ({len(slow)} ops, {res['slow_path_ms']:.2f} ms per call)", "",
            "'row sum': a YNNPACK fusion that reduces the product of two operands into a result that keeps a dimension "
            "of size 1 (batch 1, one head); XLA:CPU can run these many times slower than the same sum as a dot. Rewrites, "
            "same arithmetic (the CPU implementations' helpers, docs/DESIGN.md \"XLA:CPU slow paths\"): the row sum "
            "written as a dot, a normalisation whose gradient is written as a dot, `longctx.layout.rows_apply` (a row "
            "norm over flattened rows). 'row dot': a dot that contracts the rows of its left operand (`dk = dsᵀ q` as "
            "autodiff writes it), which XLA:CPU runs as a generic dot at a lower rate than YNNPACK's; rewrites: the "
            "product with an explicitly transposed operand (a hand-written backward) or einsums that put the "
            "contracted axis last (autodiff). Measure before and after (next to large score passes a flagged op can be "
            "cheap, and a rewrite can cost more).", "",
            C.md_table(["op", "why", "shape", "ms per call", "source"],
                       [[f"`{o['name']}`", o["slow_path"], f"`{o['shape']}`", f"{o['ms']:.2f}", f"`{o['source']}`"]
                        for o in slow[:top]])]
