"""Assemble BENCHMARKS.md from the JSON outputs of `longctx-bench` (``--out``): machine,
commands, tables, plots and a "numbers" section generated only from the measurements.
Interpretation is left to a human: the report emits ``<!-- reading: to be written by hand -->``. Regenerating
over an existing file keeps what a human wrote there: the notes between the opening line and ``## Machine``
and everything from ``## Reading`` on (see :func:`hand_written`).

    longctx-bench report --out bench_out [--output BENCHMARKS.md] [--script scripts/bench_all.sh]
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from longctx.bench import common as C
from longctx.bench.configs import REPO

SECTIONS = ("attention", "decode", "quality", "train", "kernels")
READING_MARKER = "<!-- reading: to be written by hand -->"


def add_args(p):
    p.add_argument("--output", default=str(REPO / "BENCHMARKS.md"), help="the markdown file to write")
    p.add_argument("--script", default=str(REPO / "scripts" / "bench_all.sh"), help="the commands to quote")


def _load(out: Path) -> dict:
    res = {}
    for name in SECTIONS:
        f = out / f"{name}.json"
        if f.exists():
            res[name] = json.loads(f.read_text())
    return res


def machine_section(res: dict) -> str:
    first = next(iter(res.values()))["header"]
    m = first["machine"]
    lines = ["## Machine\n"]
    for k, v in m.get("lscpu", {}).items():
        lines.append(f"- {k}: {v}")
    lines += [f"- nproc: {m.get('nproc')}", f"- memory: {m.get('mem_total_gb')} GiB",
              f"- AVX-512: {'yes' if m.get('avx512') else 'no'}",
              f"- software: Python {m.get('python')}, jax {m.get('jax')} ({m.get('jax_backend')}), "
              f"flax {m.get('flax')}, numpy {m.get('numpy')}; {m.get('platform')}",
              f"- XLA_FLAGS: `{m.get('xla_flags') or '(none)'}`"]
    for name, r in res.items():
        h = r["header"]
        lines.append(f"- `{name}`: run {h.get('time')} at git {h.get('git_sha')}, load average at start "
                     f"{h['machine'].get('load_avg')}")
        earlier = r.get("merged_into")
        while earlier:  # `--update` runs: their rows replaced some of an earlier run's
            lines.append(f"  (rows of this run replaced some of a run of {earlier.get('time')} at git "
                         f"{earlier.get('git_sha')}, whose other rows are kept)")
            earlier = earlier.get("merged_into")
    mm = res.get("attention", {}).get("matmul")
    if mm:
        lines.append(f"- measured f32 matmul {mm['n']}×{mm['n']}: jax {mm['jax_gflops']:.1f} GFLOP/s, "
                     f"numpy {mm['numpy_gflops']:.1f} GFLOP/s")
    return "\n".join(lines) + "\n"


def _exact(method: str) -> bool:
    """A registered method that computes exact softmax attention (the reference rows)."""
    from longctx import attention

    return method in attention.names() and bool(attention.get_class(method).exact)


def _crossovers(att: dict) -> list[str]:
    out = []
    rows = att["rows"]
    for dname in dict.fromkeys(r["direction"] for r in rows):
        rs = [r for r in rows if r["direction"] == dname]
        t = {(r["variant"], r["length"]): r.get("fwd_s") for r in rs}
        tb = {(r["variant"], r["length"]): r.get("fwdbwd_s") for r in rs}
        lengths = sorted({r["length"] for r in rs})
        variants = list(dict.fromkeys(r["variant"] for r in rs))
        exact = {r["variant"] for r in rs if r["method"] != "torch_sdpa" and _exact(r["method"])}
        refs = [v for v in variants if v in exact]
        for v in variants:
            if v in exact or v == "torch_sdpa":
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


def numbers_section(res: dict) -> str:
    lines = ["## Numbers (generated from the measurements)\n"]
    att = res.get("attention")
    if att:
        lines.append("### Attention\n")
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
        lines += _crossovers(att)
        lines.append("")
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


def hand_written(text: str) -> tuple[str, str]:
    """The parts of an earlier report a human wrote: (notes between the generated opening line and
    ``## Machine``, the section from ``## Reading`` to the end). Either is "" when absent or when the
    reading is still only the marker."""
    head, tail = "", ""
    lines = text.splitlines(keepends=True)
    machine = next((i for i, ln in enumerate(lines) if ln.startswith("## Machine")), None)
    opening = next((i for i, ln in enumerate(lines) if ln.startswith("Generated by `longctx-bench report`")), None)
    if machine is not None and opening is not None and opening < machine:
        head = "".join(lines[opening + 1:machine]).strip()
    reading = next((i for i, ln in enumerate(lines) if ln.startswith("## Reading")), None)
    if reading is not None:
        body = "".join(lines[reading + 1:]).strip()
        if body and body != READING_MARKER:
            tail = "".join(lines[reading:]).strip()
    return head, tail


def build(out: Path, output: Path, script: Path) -> str:
    res = _load(out)
    if not res:
        raise SystemExit(f"no benchmark JSON ({', '.join(s + '.json' for s in SECTIONS)}) in {out}")
    rel = os.path.relpath(out, output.parent)
    parts = ["# Benchmarks\n",
             "Generated by `longctx-bench report` from the JSON in "
             f"`{rel}/`; every number below was measured by the commands in the next section.\n"]
    head, tail = hand_written(output.read_text()) if output.exists() else ("", "")
    if head:
        parts.append(head + "\n")
    parts.append(machine_section(res))
    if script.exists():
        parts.append(f"## Commands\n\n`{os.path.relpath(script, output.parent)}`:\n\n```bash\n"
                     + script.read_text().strip() + "\n```\n")
    titles = {"attention": "Attention cores: time, memory, FLOP rate", "decode": "Decoding: latency and state size",
              "quality": "Quality: relative error against exact attention", "train": "Training: throughput and bits/byte",
              "kernels": "Pallas kernels against their XLA paths"}
    for name in SECTIONS:
        if name not in res:
            continue
        parts.append(f"## {titles[name]}\n")
        md = out / f"{name}.md"
        if md.exists():
            parts.append(md.read_text())
        for png in sorted(out.glob(f"{name}*.png")):
            parts.append(f"\n![{png.stem}]({rel}/{png.name})\n")
        parts.append("")
    parts.append(numbers_section(res))
    parts.append((tail or "## Reading\n\n" + READING_MARKER) + "\n")
    text = "\n".join(parts)
    output.write_text(text)
    return text


def run(args):
    text = build(Path(args.out), Path(args.output), Path(args.script))
    print(f"wrote {args.output} ({len(text.splitlines())} lines)")
    return text
