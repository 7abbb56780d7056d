"""Assemble BENCHMARKS.md from the JSON, markdown and PNG files in ``results/`` (``--out``), and nothing else.

    longctx-bench report --out results --output BENCHMARKS.md [--script scripts/bench_all.sh]

What ``results/`` holds (each written by the command quoted in the report's "Commands" section):

* ``attention``, ``decode``, ``quality``, ``train``, ``kernels`` ``.json/.md/.png``: ``longctx-bench <name>``;
* ``attention_*/attention.json``: further attention runs (e.g. one run of the fastest methods beside
  PyTorch's SDPA at 8k-32k);
* ``kernels_gpu/<method>/kernels.json``: ``longctx-bench kernels`` on a GPU;
* ``peer_eva/``, ``peer_eva_core/``, ``peer_tvq/``: ``scripts/peer_eva_release.py`` and
  ``scripts/peer_tvq_release.py`` (ours against the authors' releases);
* ``recall/``: ``scripts/recall_all.sh`` (``longctx-recall-report``);
* ``dropin/``: ``longctx-bench dropin`` (a method in every layer of a trained model, no training).
* ``packing/``: ``scripts/packing_bench.py`` (``data.packing='segments'`` against ``'document'`` on short documents).

The report opens with a summary (per method: forward+backward time at the longest length measured beside
PyTorch's SDPA, its speed against SDPA and against exact dense attention in the same run, and its
approximation error), then the hand-written "How to read this" (kept across regenerations: everything
between ``## How to read this`` and the next ``## `` heading), machine and provenance, the commands, and
the generated tables and plots. Every number comes from the JSON.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from absl import flags

from longctx import attention
from longctx.bench import attention_bench, kernel_bench
from longctx.bench import common as C
from longctx.bench.configs import _checkout
from longctx.errors import ConfigError

SECTIONS = ("attention", "decode", "quality", "train", "kernels")
READING = "## How to read this"
READING_MARKER = "<!-- How to read this: written by hand; `longctx-bench report` keeps it -->"
TORCH = "torch_sdpa"
TITLES = {"attention": "Attention cores: time, memory, FLOP rate (all methods, 1k-128k)",
          "decode": "Decoding: latency and state size",
          "quality": "Quality: relative error against exact attention",
          "train": "Training: throughput and bits/byte",
          "kernels": "Pallas kernels against their XLA paths (CPU, interpret mode)"}


def define_flags(fv) -> None:
    flags.DEFINE_string("out", "results", "folder of the JSON and PNG the report reads", flag_values=fv)
    flags.DEFINE_string("output", "BENCHMARKS.md", "the markdown file to write (default: ./BENCHMARKS.md)",
                        flag_values=fv)
    flags.DEFINE_string("script", "scripts/bench_all.sh", "the script whose commands the report quotes (looked up "
                        "in the working directory, then in the project's checkout; left out when neither has it)",
                        flag_values=fv)


def validate(args) -> None:
    out = Path(args.output)
    if out.is_dir():
        raise ConfigError(f"--output {args.output}: is a folder; give the markdown file to write")
    if not out.resolve().parent.is_dir():
        raise ConfigError(f"--output {args.output}: no folder {out.parent} to write it in")
    if not any((Path(args.out) / f"{s}.json").is_file() for s in SECTIONS) and not _extra_attention(Path(args.out)):
        raise ConfigError(f"--out {args.out}: no benchmark JSON ({', '.join(s + '.json' for s in SECTIONS)}) in it")


# ----------------------------------------------------------------------------- loading
def _read(f: Path):
    return json.loads(f.read_text()) if f.is_file() else None


def _load(out: Path) -> dict:
    return {name: r for name in SECTIONS if (r := _read(out / f"{name}.json")) is not None}


def _extra_attention(out: Path) -> list[tuple[str, dict]]:
    """(folder, result) of every ``results/attention_*/attention.json``."""
    return [(f.parent.name, json.loads(f.read_text())) for f in sorted(out.glob("attention_*/attention.json"))]


def _attention_runs(out: Path, res: dict) -> list[tuple[str, dict]]:
    """Every attention run in results, newest first: (path relative to results, result)."""
    runs = ([("attention.json", res["attention"])] if "attention" in res else []) + \
        [(f"{d}/attention.json", r) for d, r in _extra_attention(out)]
    return sorted(runs, key=lambda x: x[1]["header"].get("time", ""), reverse=True)


# ----------------------------------------------------------------------------- helpers
def _exact(method: str) -> bool:
    """A registered method that computes exact softmax attention (the reference rows)."""

    return method in attention.names() and bool(attention.get_class(method).exact)


def _registry_order() -> list[str]:
    return list(attention.names())


def _s(x) -> str:
    """Seconds as ms."""
    if x is None:
        return "–"
    return f"{1e3 * x:,.0f} ms" if x >= 0.01 else f"{1e3 * x:.3g} ms"


def _cpu(h: dict) -> str:
    m = h.get("machine", {})
    lscpu = m.get("lscpu", {})
    return (f"{lscpu.get('Model name', '?')}, {m.get('nproc', '?')} cores, {m.get('mem_total_gb', '?')} GiB, "
            f"jax {m.get('jax', '?')} ({m.get('jax_backend', '?')})")


# ----------------------------------------------------------------------------- summary
def _cell(run: dict, variant: str, L: int, key: str = "fwdbwd_s"):
    return next((r.get(key) for r in run["rows"] if r["variant"] == variant and r["direction"] == "causal"
                 and r["length"] == L and r.get(key)), None)


def _dense_ref(run: dict, L: int) -> str | None:
    """The fastest exact (non-torch) variant of the run at L, forward+backward causal."""
    cands = [(t, r["variant"]) for r in run["rows"] if r["method"] != TORCH and _exact(r["method"])
             and r["direction"] == "causal" and r["length"] == L and (t := r.get("fwdbwd_s"))]
    return min(cands)[1] if cands else None


def _error(quality: dict | None, method: str, variant: str):
    """(relative error, length, source) of the method's causal output at the longest length measured,
    preferring q/k/v captured from a trained model."""
    if not quality:
        return None
    for src in ("captured", "gaussian"):
        rs = [r for r in quality["rows"] if r["method"] == method and r["direction"] == "causal"
              and r["source"] == src and r.get("rel_err") is not None]
        if rs:
            pick = [r for r in rs if r["variant"] == variant] or rs
            r = max(pick, key=lambda r: r["length"])
            return r["rel_err"], r["length"], src
    return None


def _shape(runs) -> str:
    shapes = {(a.get("batch"), a.get("heads"), a.get("head_dim"), a.get("dtype"))
              for _, run in runs for a in [run["header"]["args"]]}
    return "; ".join(f"batch {b}, {h} heads of {d}, {t}" for b, h, d, t in sorted(shapes, key=str))


def summary_section(out: Path, res: dict) -> str:
    runs = _attention_runs(out, res)
    if not runs:
        return ""
    torch_L = [r["length"] for _, run in runs for r in run["rows"]
               if r["variant"] == TORCH and r["direction"] == "causal" and r.get("fwdbwd_s")]
    all_L = [r["length"] for _, run in runs for r in run["rows"] if r["direction"] == "causal" and r.get("fwdbwd_s")]
    if not all_L:
        return ""
    L = max(torch_L or all_L)
    order = {m: i for i, m in enumerate(_registry_order())}
    variants = {}
    for _, run in runs:
        for r in run["rows"]:
            if r["direction"] == "causal":
                variants.setdefault(r["variant"], r["method"])
    ordered = sorted(variants, key=lambda v: (v != TORCH, not _exact(variants[v]), order.get(variants[v], 99), v))
    rows, best = [], None
    for v in ordered:
        m = variants[v]
        hit = next(((path, run) for path, run in runs if _cell(run, v, L)), None)
        if hit is None:
            longest = max((r["length"] for _, run in runs for r in run["rows"]
                           if r["variant"] == v and r["direction"] == "causal" and r.get("fwdbwd_s")), default=None)
            rows.append([f"`{v}`", f"not measured at {C.fmt_len(L)}"
                         + (f" (longest: {C.fmt_len(longest)})" if longest else ""), "", "", "", "", ""])
            continue
        path, run = hit
        t, tf = _cell(run, v, L), _cell(run, v, L, "fwd_s")
        ts = _cell(run, TORCH, L)
        dref = _dense_ref(run, L)
        td = _cell(run, dref, L) if dref else None
        err = _error(res.get("quality"), m, v) if m != TORCH else None
        if m == TORCH or _exact(m):
            err_text = "exact"
        elif err:
            err_text = f"{err[0]:.2f} at {C.fmt_len(err[1])}" + ("" if err[2] == "captured" else f" ({err[2]} q/k/v)")
        else:
            err_text = "–"
        rows.append([f"`{v}`", _s(t), f"{ts / t:.2f}×" if ts else "–",
                     (f"{td / t:.2f}× `{dref}`" if td and v != dref else "–"), _s(tf), err_text,
                     f"`{path}`"])
        if m != TORCH and (best is None or t < best[1]):
            best = (v, t, ts, path)
    lines = [f"## Summary: causal attention at {C.fmt_len(L)}\n",
             f"Forward+backward time of one causal attention call at T = {C.fmt_len(L)} ({_shape(runs)}, "
             "the median of the run's repeats), its speed against PyTorch's fused SDPA and against the "
             "fastest exact XLA variant *measured in the same run* (higher is faster), and the approximation error: "
             "the relative error of the output against exact attention on q/k/v taken from layer 0 of a trained "
             "dense model, at the longest length of `longctx-bench quality` (training-free drop-in: learned parts "
             "replaced as the quality table says). Each row comes from the newest run in `results/` that measured "
             "it; rows of different runs (last column) were measured at different times, possibly on different "
             "machines (see Machine and provenance), so compare the ratios, not the times, across them.\n",
             C.md_table(["method", f"fwd+bwd at {C.fmt_len(L)}", "× SDPA speed", "× exact XLA speed",
                         f"forward at {C.fmt_len(L)}", "relative error (trained q/k/v)", "run"], rows)]
    if best:
        v, t, ts, path = best
        lines.append(f"\nFastest forward+backward at {C.fmt_len(L)}: `{v}` ({_s(t)}"
                     + (f", {ts / t:.2f}× the speed of PyTorch's SDPA in the same run" if ts else "")
                     + f"; `{path}`).")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- provenance
def machine_section(out: Path, res: dict) -> str:
    lines = ["## Machine and provenance\n",
             "Where and when each file in `results/` was measured (from the JSON headers):\n"]
    files = [(f"{name}.json", r) for name, r in res.items()] + \
        [(f"{d}/attention.json", r) for d, r in _extra_attention(out)] + \
        [(str(f.relative_to(out)), json.loads(f.read_text())) for f in sorted(out.glob("kernels_gpu/*/kernels.json"))]
    for path, r in files:
        h = r["header"]
        lines.append(f"- `{path}`: {h.get('time')}, git {h.get('git_sha') or '?'}, {_cpu(h)}, "
                     f"load average at start {h['machine'].get('load_avg')}")
        earlier = r.get("merged_into")
        while earlier:  # `--update` runs: their rows replaced some of an earlier run's
            lines.append(f"  (its rows replaced some of a run of {earlier.get('time')} at git "
                         f"{earlier.get('git_sha')}, whose other rows are kept)")
            earlier = earlier.get("merged_into")
    tvq = _read(out / "peer_tvq" / "peer_tvq_release.json")
    if tvq:
        lines.append(f"- `peer_tvq/peer_tvq_release.json`: {tvq.get('time')}, "
                     f"{_cpu({'machine': tvq.get('ours', {}).get('machine', {})})}")
    for d in ("peer_eva", "peer_eva_core"):
        pe = _read(out / d / "peer_eva.json")
        if pe:
            meta = pe.get("meta", {})
            lines.append(f"- `{d}/peer_eva.json`: torch {meta.get('torch')}, jax {meta.get('jax')} (no machine "
                         "header: the script records versions only)")
    mm = res.get("attention", {}).get("matmul")
    if mm:
        lines.append(f"- `attention.json`'s machine: f32 matmul {mm['n']}×{mm['n']}: jax {mm['jax_gflops']:.1f} "
                     f"GFLOP/s, numpy {mm['numpy_gflops']:.1f} GFLOP/s")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- generated numbers
def _crossovers(att: dict) -> list[str]:
    out = []
    rows = att["rows"]
    for dname in dict.fromkeys(r["direction"] for r in rows):
        rs = [r for r in rows if r["direction"] == dname]
        t = {(r["variant"], r["length"]): r.get("fwd_s") for r in rs}
        tb = {(r["variant"], r["length"]): r.get("fwdbwd_s") for r in rs}
        lengths = sorted({r["length"] for r in rs})
        variants = list(dict.fromkeys(r["variant"] for r in rs))
        exact = {r["variant"] for r in rs if r["method"] != TORCH and _exact(r["method"])}
        refs = [v for v in variants if v in exact]
        for v in variants:
            if v in exact or v == TORCH:
                continue
            for ref in refs:
                for kind, tab in (("forward", t), ("forward+backward", tb)):
                    both = [L for L in lengths if tab.get((v, L)) and tab.get((ref, L))]
                    if not both:
                        continue
                    faster = [L for L in both if tab[(v, L)] < tab[(ref, L)]]
                    cross = next((L for L in both if all(tab[(v, M)] < tab[(ref, M)] for M in both if M >= L)), None)
                    longest = both[-1]
                    ratio = tab[(ref, longest)] / tab[(v, longest)]
                    msg = (f"- {dname}, {kind}: `{v}` vs `{ref}`: "
                           + (f"faster from {C.fmt_len(cross)} on (measured {C.fmt_len(both[0])}–{C.fmt_len(longest)})"
                              if cross is not None else
                              f"no crossover within the measured lengths (faster at {len(faster)} of {len(both)})")
                           + f"; at {C.fmt_len(longest)} {ratio:.2f}× the speed of `{ref}`")
                    only = [L for L in lengths if tab.get((v, L)) and not tab.get((ref, L))]
                    if only:
                        msg += f"; `{ref}` not measured (skipped) at {', '.join(map(C.fmt_len, only))} where `{v}` ran"
                    out.append(msg + ".")
    return out


def _attention_numbers(att: dict) -> list[str]:
    lines = []
    for e in att["exponents"]:
        if e.get("fwd_exponent") is not None:
            lines.append(f"- `{e['variant']}` {e['direction']}: time ∝ T^{e['fwd_exponent']:.2f} forward "
                         f"({', '.join(map(C.fmt_len, e['fwd_lengths']))})"
                         + (f", T^{e['fwdbwd_exponent']:.2f} forward+backward "
                            f"({', '.join(map(C.fmt_len, e['fwdbwd_lengths']))})"
                            if e.get("fwdbwd_exponent") is not None else ""))
    for v in dict.fromkeys((r["variant"], r["direction"]) for r in att["rows"]):
        ok = [r["length"] for r in att["rows"] if (r["variant"], r["direction"]) == v and r.get("fwd_s")]
        if ok:
            lines.append(f"- `{v[0]}` {v[1]}: longest forward measured {C.fmt_len(max(ok))}")
    return lines + _crossovers(att) + _odd_cells(att)


def _odd_cells(att: dict) -> list[str]:
    """Cells whose forward alone was timed slower than the forward+backward of the same call: noise on a busy
    machine (remeasure them, e.g. ``longctx-bench attention --methods=<variant> --lengths=<T> --update``)."""
    return [f"- remeasure `{r['variant']}` {r['direction']} at {C.fmt_len(r['length'])}: forward "
            f"{r['fwd_s'] * 1e3:,.1f} ms timed slower than its forward+backward {r['fwdbwd_s'] * 1e3:,.1f} ms"
            for r in att["rows"] if r.get("fwd_s") and r.get("fwdbwd_s") and r["fwd_s"] > r["fwdbwd_s"]]


def numbers_section(res: dict, extra: list[tuple[str, dict]] = ()) -> str:
    lines = ["## Numbers (generated from the measurements)\n"]
    att = res.get("attention")
    if att:
        lines += ["### Attention (`attention.json`)\n", *_attention_numbers(att), ""]
    for d, r in extra:
        lines += [f"### Attention (`{d}/attention.json`)\n", *_attention_numbers(r), ""]
    q = res.get("quality")
    if q:
        lines.append("### Quality\n")
        groups = dict.fromkeys((r["variant"], r["direction"], r["source"]) for r in q["rows"])
        for g in groups:
            rs = sorted((r for r in q["rows"] if (r["variant"], r["direction"], r["source"]) == g
                         and r.get("rel_err") is not None), key=lambda r: r["length"])
            if not rs:
                st = next(r.get("status") for r in q["rows"] if (r["variant"], r["direction"], r["source"]) == g)
                lines.append(f"- `{g[0]}` {g[1]} {g[2]}: {st}")
                continue
            s = f"- `{g[0]}` {g[1]} {g[2]}: relative error {rs[0]['rel_err']:.3g} at {C.fmt_len(rs[0]['length'])}"
            if len(rs) > 1:
                s += f", {rs[-1]['rel_err']:.3g} at {C.fmt_len(rs[-1]['length'])}"
            if rs[-1].get("rel_err_mean") is not None:
                s += f" (randomized: {rs[-1]['rel_err_mean']:.3g} ± {rs[-1]['rel_err_std']:.2g} over seeds)"
            lines.append(s)
        lines.append("")
    d = res.get("decode")
    if d:
        lines.append("### Decoding\n")
        ok = [r for r in d["rows"] if r.get("status") == "ok"]
        dense = {r["position"]: r for r in ok if _exact(r["method"])}
        for m in dict.fromkeys(r["method"] for r in ok):
            rs = sorted((r for r in ok if r["method"] == m), key=lambda r: r["position"])
            last = rs[-1]
            s = (f"- `{m}`: {1e3 * last['per_token_s']:.3g} ms/token and {last['state_bytes'] / C.MB:.3g} MB state at "
                 f"position {C.fmt_len(last['position'])}; from {C.fmt_len(rs[0]['position'])}: "
                 f"{1e3 * rs[0]['per_token_s']:.3g} ms, {rs[0]['state_bytes'] / C.MB:.3g} MB")
            if not _exact(m) and last["position"] in dense:
                dr = dense[last["position"]]
                s += (f"; vs {dr['method']} at {C.fmt_len(last['position'])}: {dr['per_token_s'] / last['per_token_s']:.2f}× "
                      f"the speed, {last['state_bytes'] / dr['state_bytes']:.3g}× the state")
            lines.append(s)
        lines.append("")
    t = res.get("train")
    if t:
        lines.append("### Training\n")
        ok = [r for r in t["rows"] if r.get("status") == "ok"]
        dense = next((r for r in ok if _exact(r["method"])), None)
        for r in t["rows"]:
            if r.get("status") != "ok":
                lines.append(f"- `{r['method']}`: {r.get('status')}")
                continue
            bpb = r.get("valid_bits_per_byte", r.get("valid_bits_per_token"))
            s = f"- `{r['method']}`: {r['tokens_per_s']:,.0f} tokens/s, valid {bpb:.3f} bits/byte after {r['steps']} steps"
            if dense and r is not dense and dense.get("tokens_per_s"):
                dbpb = dense.get("valid_bits_per_byte", dense.get("valid_bits_per_token"))
                s += f" ({r['tokens_per_s'] / dense['tokens_per_s']:.2f}× {dense['method']} throughput, {bpb - dbpb:+.3f} bits/byte)"
            lines.append(s)
        lines.append("")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- other result folders
def _pngs(folder: Path, stem: str, rel: str) -> list[str]:
    return [f"\n![{p.stem}]({rel}/{p.name})\n" for p in sorted(folder.glob(f"{stem}*.png"))]


def _argv_text(meta: dict) -> str:
    argv = meta.get("argv") or []
    return " ".join(argv)


def extra_sections(out: Path, rel: str) -> list[str]:
    parts = []
    for d, r in _extra_attention(out):
        a = r["header"]["args"]
        parts.append(f"## Attention at {a.get('lengths')}: {a.get('methods') or 'all methods'} "
                     f"(`{d}/`, one run)\n")
        parts.append(f"`longctx-bench attention --out results/{d} --methods {a.get('methods')} --lengths "
                     f"{a.get('lengths')}" + (" --causal" if a.get("causal") else "")
                     + f" --repeats {a.get('repeats')} --warmup {a.get('warmup')} --max_cell_s {a.get('max_cell_s'):g}"
                     + " --matmul_n 0`\n")
        md = out / d / "attention.md"
        parts.append(md.read_text() if md.is_file() else attention_bench.markdown(r))
        parts += _pngs(out / d, "attention", f"{rel}/{d}")
        parts.append("")
    gpu = sorted(out.glob("kernels_gpu/*/kernels.json"))
    if gpu:
        parts.append("## Pallas kernels on a GPU (`kernels_gpu/`)\n")
        for f in gpu:
            r = json.loads(f.read_text())
            a = r["header"]["args"]
            devs = ", ".join(r["header"]["machine"].get("jax_devices") or [])
            parts.append(f"### `{f.parent.name}` ({devs}; `longctx-bench kernels --out results/kernels_gpu/"
                         f"{f.parent.name} --methods {a.get('methods')} --lengths {a.get('lengths')}"
                         + (" --causal" if a.get("causal") else "") + "`)\n")
            md = f.parent / "kernels.md"
            parts.append(md.read_text() if md.is_file() else kernel_bench.markdown(r))
    peers = [(d, f) for d, f in (("peer_eva", "peer_eva"), ("peer_eva_core", "peer_eva"), ("peer_tvq", "peer_tvq_release"))
             if (out / d / f"{f}.md").is_file()]
    if peers:
        parts.append("## Against the authors' releases (`peer_eva/`, `peer_eva_core/`, `peer_tvq/`)\n")
        titles = {"peer_eva": "EVA layer (projections + attention core) against the released PyTorch EVA, "
                              "forward and forward+backward, interleaved in one process",
                  "peer_eva_core": "EVA attention core alone (the four projections replaced by identities) against "
                                   "the released PyTorch EVA",
                  "peer_tvq": "Transformer-VQ: whole-model training step against the official JAX release"}
        for d, f in peers:
            r = _read(out / d / f"{f}.json") or {}
            cmd = _argv_text(r.get("meta", {})) or r.get("command", "")
            parts.append(f"### {titles[d]}\n")
            if cmd:
                parts.append(f"`.venv/bin/python {cmd}`\n")
            parts.append((out / d / f"{f}.md").read_text().strip() + "\n")
    drop = out / "dropin" / "dropin.md"  # longctx-bench dropin --out results/dropin (its own heading)
    if drop.is_file():
        parts.append(drop.read_text())
    parts += precision_section(out)
    packing = out / "packing" / "packing.md"  # scripts/packing_bench.py
    if packing.is_file():
        parts.append("## Short documents: packing (`packing/`)\n")
        parts.append("`data.packing='segments'` against the `'document'` rule, two otherwise identical runs "
                     "on a corpus of short documents (`bash scripts/bench_all.sh` step `packing`).\n")
        parts.append(packing.read_text().strip() + "\n")
    parts += compare_section(out, rel)
    recipes = out / "main_recipes" / "recipes.md"  # scripts/main_recipes.py
    if recipes.is_file():
        parts.append("## The main job's recipe (`main_recipes/`)\n")
        parts.append("The runs that choose `configs/main.py`, scored on the main job's test bytes (the first 262,144 "
                     "bytes of the test split, each file streamed whole) with the state carried across each file "
                     "(the headline protocol) and reset every N bytes (does the carried state help?), xz and gzip on "
                     "the same bytes. Each row: `.venv/bin/python -m longctx.evaluate --workdir RUN --max_bytes "
                     "262144`, then `.venv/bin/python scripts/main_recipes.py add NAME --workdir RUN --command "
                     "'...'`.\n")
        parts.append(recipes.read_text().strip() + "\n")
        ctx = out / "main_recipes" / "context"
        if (ctx / "test_context_compare.md").is_file():
            parts.append("### Does the context win? The main model against the exact-attention baseline\n")
            parts.append("The main model (a sliding window of 256 tokens, trained on rows of 256) scored with its "
                         "window and, with the same parameters, with every key (`dense`: the exact-attention baseline "
                         "past the length it was trained on), on the main job's test bytes with the state carried "
                         "across each file and reset every N bytes, and bits per byte by position in the file "
                         "(log-spaced bins, each with the tokens it scored). `.venv/bin/python -m longctx.evaluate "
                         "--workdir runs/main_fresh --also_as dense --max_bytes 262144 --out "
                         "results/main_recipes/context`.\n")
            parts.append((ctx / "test_context_compare.md").read_text().strip() + "\n")
            parts += _pngs(ctx, "test_context_compare", f"{rel}/main_recipes/context")
    parts += gpu_check_section(out)
    rec = out / "recall"
    if (rec / "recall.md").is_file():
        parts.append("## Recall by distance (`recall/`)\n")
        parts.append("Every causal method trained on the same generated associative-recall task "
                     "(`configs/recall/<method>.py`) and scored by `longctx-recall`; `bash scripts/recall_all.sh` "
                     "(with `LM_RUNS=...` for the passkey probe of language models trained on text).\n")
        parts.append((rec / "recall.md").read_text().strip().replace("## ", "### ", 1) + "\n")
        parts += _pngs(rec, "recall", f"{rel}/recall")
        if (rec / "seeds.md").is_file():
            parts.append((rec / "seeds.md").read_text().strip().replace("## ", "### ", 1) + "\n")
        for px in sorted(rec.glob("passkey_x*/recall.md")):
            parts.append(px.read_text().strip().replace("## ", "### ", 1) + "\n")
        grids = sorted(rec.glob("needle/*/needle_grid_*.md"))  # scripts/recall_all.sh's NEEDLE runs
        if grids:
            parts.append("### Needle grids: accuracy by row length and depth of the needle\n")
            parts.append("The recall-trained runs of exact attention, sliding-window attention and one efficient "
                         "method scored at several row lengths (`longctx-recall --lengths=256,512,1024 --bins=4`).\n")
        for md in grids:
            parts.append(md.read_text().strip() + "\n")
            parts += [f"\n![{png.stem}]({rel}/recall/needle/{md.parent.name}/{png.name})\n"
                      for png in sorted(md.parent.glob(md.stem + ".png"))]
    return parts


def compare_section(out: Path, rel: str) -> list[str]:
    """Which method to use (``compare/compare.md`` from ``longctx-bench compare``, rebuilt from whatever runs
    finished): its tables, needle grids and plots, the image paths made relative to this page."""
    md = out / "compare" / "compare.md"
    if not md.is_file():
        return []
    text = re.sub(r"\]\((?!https?:)([^)]+\.png)\)", lambda m: f"]({rel}/compare/{m.group(1)})", md.read_text())
    parts = ["## Which method: equal training cost (`compare/`)\n",
             "Every causal method trained at equal parameters and equal training FLOPs on the same corpus, several "
             "contexts and seeds (`bash scripts/bench_all.sh` step `compare`, or `longctx-bench compare --out "
             f"{rel}/compare`; `--plan` lists the runs and their estimated time).\n", text.strip() + "\n"]
    for other in sorted(out.glob("compare_*/compare.md")):  # the same comparison under other settings
        paras = other.read_text().split("\n\n")
        pick = [i for i, x in enumerate(paras) if x.startswith("Which method to pick")]
        parts.append(f"### The same comparison with other settings (`{other.parent.name}/`)\n")
        parts.append("\n\n".join([paras[0]] + (paras[pick[0]:pick[0] + 2] if pick else [])).strip()
                     + f"\n\nThe whole report: `{other.parent.name}/compare.md`.\n")
    return parts


def gpu_check_section(out: Path) -> list[str]:
    """The accelerator checks (``gpu/<date>-<device>.json`` from ``scripts/gpu_check.sh``): per report its steps'
    outcomes and the training steps, kernels and attention rows it measured; the whole report beside it."""
    reports = [(f, _read(f)) for f in sorted(out.glob("gpu/*.json"))]
    reports = [(f, r) for f, r in reports if r and not (r.get("env") or {}).get("smoke")]
    if not reports:
        return []
    parts = ["## Accelerator checks (`gpu/`)\n",
             "`bash scripts/gpu_check.sh` on a lent accelerator (the script's header says what each step runs and its "
             "limit; a step cut short by its limit keeps the rows it finished). Each report in full: "
             + ", ".join(f"`gpu/{f.with_suffix('.md').name}`" for f, _ in reports) + ".\n"]
    for f, r in reports:
        env, steps, tests = r.get("env") or {}, r.get("steps") or {}, r.get("tests") or {}
        parts.append(f"### {f.stem}: {env.get('device')}, jax {env.get('jax')}, commit {env.get('commit')}"
                     + (" (with uncommitted changes)" if env.get("dirty") else "") + "\n")
        parts.append("Steps: " + ", ".join(f"{k} {v.get('status')}" + (f" ({v['wall_s']} s)" if "wall_s" in v else "")
                                           for k, v in steps.items() if v.get("status") != "not run") + ".\n")
        if tests:
            parts.append(f"Compiled tests: {tests.get('tests', 0)} run, {tests.get('failures', 0)} failed, "
                         f"{tests.get('skipped', 0)} skipped"
                         + (" (counted from the log of a step stopped by its limit)" if tests.get("counted_from_log")
                            else "") + "".join(f"; failed: `{t}`" for t in tests.get("failed", [])) + ".\n")
        def ms(x):
            return None if x is None else 1e3 * x

        def lower(x, opaque):  # a kernel's FLOPs are not counted in the jaxpr: a lower bound
            return None if x is None else (f"≥{x:.3g}" if opaque else x)

        rows = [[d.get("config"), ", ".join(d.get("sets") or []),
                 f"{x.get('T')}" + (f" in windows of {x['window']}" if x.get("window") and x["window"] != x.get("T")
                                    else ""), x.get("batch_size"), x.get("tokens_per_s"),
                 lower((x.get("model_flops_per_token") or 0) / 1e6, x.get("forward_flops_opaque")),
                 lower(100 * x["mfu"] if x.get("mfu") is not None else None, x.get("forward_flops_opaque")),
                 x.get("compile_s"), (x.get("device_peak_bytes") or 0) / 2**20]
                for d in (r.get("steps_model") or {}).values() for x in (d or {}).get("rows", [])]
        if rows:
            parts.append("≥: a lower bound (the FLOPs inside a Pallas kernel are not counted).\n")
            parts.append(C.md_table(["training step", "overrides", "T", "batch", "tokens/s", "model MFLOP / token",
                                     "MFU %", "compile s", "device peak MiB"], rows))
        krows = [x for x in r.get("kernels") or [] if x.get("length")]
        if krows:
            parts.append(C.md_table(
                ["kernel", "T", "XLA fwd ms", "kernel fwd ms", "kernel / XLA fwd", "kernel / XLA fwd+bwd",
                 "max abs diff"],
                [[f"{x.get('method')}: {x.get('kernel')}", x.get("length"), ms(x.get("xla_fwd_s")),
                  ms(x.get("pallas_fwd_s")), x.get("fwd_kernel_over_xla"), x.get("fwdbwd_kernel_over_xla"),
                  x.get("max_abs_diff_out")] for x in krows]))
        arows = [x for name in ("attention", "attention_d128") for x in r.get(name) or []]
        if arows:
            exact = r.get("exact")
            ref = {(x.get("head_dim"), x.get("length")): x for x in arows if x.get("variant") == exact}

            def vs_exact(x, key, ref=ref):  # the method's time over exact attention's, same head dim and length
                e = ref.get((x.get("head_dim"), x.get("length")), {})
                return x[key] / e[key] if x.get(key) and e.get(key) else None

            def peak(x):  # ≥: a lower bound (XLA's count misses kernels and loop trips)
                pf = x.get("fwdbwd_peak_fraction")
                if x.get("fwdbwd_analytic_gflops_per_s"):
                    bound = False
                elif x.get("fwdbwd_method_gflops_per_s"):
                    bound = bool(x.get("method_flops_fwdbwd_lower_bound"))
                else:
                    bound = True
                return lower(None if pf is None else 100 * pf, bound)

            parts.append(f"Attention: time over `{exact}`'s at the same shape (below 1: faster than exact "
                         "attention); % of the device's bf16 peak from the analytic FLOPs (exact attention), else "
                         "the matrix-multiply FLOPs in the method's jaxpr (with kernels: its portable XLA "
                         "implementation's), else XLA's count of the program, a lower bound (≥: it leaves out the "
                         "work inside kernels and counts a loop's body once).\n")
            parts.append(C.md_table(["attention variant", "head dim", "T", "fwd ms", "fwd+bwd ms", "fwd / exact",
                                     "fwd+bwd / exact", "% of peak fwd+bwd", "status"],
                                    [[x.get("variant"), x.get("head_dim"), x.get("length"), ms(x.get("fwd_s")),
                                      ms(x.get("fwdbwd_s")), vs_exact(x, "fwd_s"), vs_exact(x, "fwdbwd_s"), peak(x),
                                      (x.get("fwd_status") or "")[:60]] for x in arows]))
    return parts


PRECISION_TOLERANCE = 0.02  # bf16's validation bits per byte within 2 % of fp32's


def precision_section(out: Path) -> list[str]:
    """bf16 against fp32: every built-in config trained the same number of steps in each ``model.dtype``
    (``precision/<dtype>/train.json`` from ``longctx-bench train --config.model.dtype=<dtype>``), validation bits
    per byte side by side."""
    runs = {dt: _read(out / "precision" / dt / "train.json") for dt in ("float32", "bfloat16")}
    if not all(runs.values()):
        return []
    rows = {dt: {r["method"]: r for r in res["rows"]} for dt, res in runs.items()}
    methods = [m for m in _registry_order() if m in rows["float32"] and m in rows["bfloat16"]]
    if not methods:
        return []
    f32, b16 = rows["float32"], rows["bfloat16"]
    steps = sorted({r.get("steps") for dt in rows for r in rows[dt].values()})
    table = ["| method | config | params | steps | fp32 valid bits/byte | bf16 valid bits/byte | bf16 vs fp32 | "
             f"within {PRECISION_TOLERANCE:.0%} | fp32 tokens/s | bf16 tokens/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    worst = 0.0
    for m in methods:
        a, b = f32[m], b16[m]
        va, vb = a.get("valid_bits_per_byte"), b.get("valid_bits_per_byte")
        if va is None or vb is None:
            miss = lambda x: "–" if x is None else f"{x:.4f}"  # noqa: E731
            table.append(f"| {m} | `{a.get('config_file')}` | {a.get('params', 0):,} | {a.get('steps')} | {miss(va)} | "
                         f"{miss(vb)} | – | – | {a.get('tokens_per_s') or 0:,.0f} | {b.get('tokens_per_s') or 0:,.0f} |")
            continue
        rel = vb / va - 1.0
        worst = max(worst, abs(rel))
        table.append(f"| {m} | `{a.get('config_file')}` | {a.get('params', 0):,} | {a.get('steps')} | {va:.4f} | "
                     f"{vb:.4f} | {rel:+.2%} | {'yes' if abs(rel) <= PRECISION_TOLERANCE else '**no**'} | "
                     f"{a.get('tokens_per_s', 0):,.0f} | {b.get('tokens_per_s', 0):,.0f} |")
    a = runs["bfloat16"].get("header", {}).get("args", {})
    argv = (f"longctx-bench train --steps {a.get('steps')} --eval_tokens {a.get('eval_tokens')} "
            + " ".join(f"--config.{kv}" for kv in a.get("overrides") or [])).strip() if a else ""
    return ["## Precision: bf16 against fp32 (`precision/`)\n",
            f"Every built-in config trained {', '.join(str(x) for x in steps)} steps with `model.dtype=float32` and "
            "with `model.dtype=bfloat16` (bf16 activations and matmul operands; fp32 master weights, optimizer "
            "state, softmax statistics, norms and losses), same seed and data; validation bits per byte of the final "
            "eval. `bash scripts/bench_all.sh` step `precision`"
            + (f" (`{argv}` for bf16)" if argv else "") + f". Largest difference: {worst:.2%}. The result is the "
            "bits per byte: tokens/s are XLA:CPU's (which emulates bf16 arithmetic) and say nothing of a GPU.\n",
            "\n".join(table) + "\n"] + precision_seeds(out, f32, b16)


def precision_seeds(out: Path, f32: dict, b16: dict) -> list[str]:
    """The methods trained again at other seeds (``precision/seed<k>/<dtype>/train.json``): per seed the two
    validation bits per byte, and the mean difference over every seed (seed 0 from the table above)."""
    per = {}  # method -> {seed: (fp32, bf16)}
    for m in f32:
        if f32[m].get("valid_bits_per_byte") and (b16.get(m) or {}).get("valid_bits_per_byte"):
            per.setdefault(m, {})[0] = (f32[m]["valid_bits_per_byte"], b16[m]["valid_bits_per_byte"])
    extra = set()
    for d in sorted(out.glob("precision/seed*")):
        a, b = _read(d / "float32" / "train.json"), _read(d / "bfloat16" / "train.json")
        if not (a and b and d.name[4:].isdigit()):
            continue
        rb = {r["method"]: r for r in b["rows"]}
        for r in a["rows"]:
            m = r["method"]
            va, vb = r.get("valid_bits_per_byte"), (rb.get(m) or {}).get("valid_bits_per_byte")
            if va and vb:
                per.setdefault(m, {})[int(d.name[4:])] = (va, vb)
                extra.add(m)
    if not extra:
        return []
    rows = ["| method | seed | fp32 valid bits/byte | bf16 valid bits/byte | bf16 vs fp32 |", "|---|---|---|---|---|"]
    for m in [m for m in _registry_order() if m in extra]:
        diffs = []
        for seed, (va, vb) in sorted(per[m].items()):
            diffs.append(vb / va - 1.0)
            rows.append(f"| {m} | {seed} | {va:.4f} | {vb:.4f} | {diffs[-1]:+.2%} |")
        lo, hi = min(v[0] for v in per[m].values()), max(v[0] for v in per[m].values())
        rows.append(f"| {m} | mean of {len(diffs)} | fp32 alone spans {lo:.4f}-{hi:.4f} ({hi / lo - 1:.2%}) | | "
                    f"**{sum(diffs) / len(diffs):+.2%}** |")
    return ["Methods trained again at other seeds (`PRECISION_SEED_METHODS`, default the one whose seed-0 "
            "difference was past the tolerance; `bash scripts/bench_all.sh` step `precision`):\n",
            "\n".join(rows) + "\n"]


# ----------------------------------------------------------------------------- hand-written part
def hand_written(text: str) -> str:
    """The "How to read this" section of an earlier report (heading included), or "" when absent or
    still only the marker."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.startswith(READING)), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    body = "".join(lines[start + 1:end]).strip()
    if not body or body == READING_MARKER:
        return ""
    return "".join(lines[start:end]).strip()


def _find_script(script: str) -> Path | None:
    p = Path(script)
    if p.is_file():
        return p

    co = _checkout()
    if not p.is_absolute() and co is not None and (co / p).is_file():
        return co / p
    return None


def build(out: Path, output: Path, script: Path | str | None) -> str:
    res = _load(out)
    extra = _extra_attention(out)
    if not res and not extra:
        raise ConfigError(f"no benchmark JSON ({', '.join(s + '.json' for s in SECTIONS)}) in {out}")
    rel = os.path.relpath(out, output.resolve().parent)
    parts = ["# Benchmarks\n",
             f"Generated by `longctx-bench report` from the files in `{rel}/` (regenerate them and this page with "
             "`bash scripts/bench_all.sh`; this page alone with "
             f"`longctx-bench report --out {os.path.relpath(out)} --output {os.path.relpath(output)}`). Every number "
             "below comes from those files.\n"]
    summary = summary_section(out, res)
    if summary:
        parts.append(summary)
    reading = hand_written(output.read_text()) if output.is_file() else ""
    parts.append((reading or f"{READING}\n\n{READING_MARKER}") + "\n")
    parts.append(machine_section(out, res))
    sp = _find_script(str(script)) if script else None
    if sp is not None:
        parts.append(f"## Commands\n\n`scripts/{sp.name}` regenerates every file in `{rel}/` and then this page:\n\n"
                     "```bash\n" + sp.read_text().strip() + "\n```\n")
    for name in SECTIONS:
        if name not in res:
            continue
        parts.append(f"## {TITLES[name]}\n")
        md = out / f"{name}.md"
        if md.is_file():
            parts.append(md.read_text())
        parts += _pngs(out, name, rel)
        parts.append("")
    parts += extra_sections(out, rel)
    parts.append(numbers_section(res, extra))
    text = "\n".join(parts).rstrip() + "\n"
    output.write_text(text)
    return text


def run(args):
    text = build(Path(args.out), Path(args.output), args.script)
    print(f"wrote {args.output} ({len(text.splitlines())} lines)")
    return text
