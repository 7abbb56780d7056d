"""Dry-run plans of the flagship launches on one node of 8 GPUs (docs/scaling.md, "Flagship configs on one node").

Each flagship config has a ``:node8`` variant (mesh, micro-batches, remat policy, dtype, scan_layers) whose
module docstring states the launch. This script runs, one after the other, each in its own process,

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/longctx-train --config=<cfg>:node8 --dry_run

(8 simulated devices: the compiled step's per-device memory is what one GPU of the node would hold), parses
the report of ``longctx/train/dry_run.py`` and writes ``results/flagship/plans.json`` and
``results/flagship/plans.md`` (the table of docs/scaling.md, each row's exact command, the machine and jax version).

    .venv/bin/python scripts/flagship_plans.py                       # all, ~15-30 min on a loaded 2-core CPU
    .venv/bin/python scripts/flagship_plans.py --only enwik8/transformer_vq   # one row, merged into the files
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "flagship"
BUDGET_GIB = 70.0  # per-device peak allowed on an 80 GB GPU (headroom for the runtime, NCCL, fragmentation)
DEVICES = 8
GiB = 1 << 30
MiB = 1 << 20

# name -> the launch's config (a file and its node variant)
FLAGSHIP = {
    "enwik8/transformer_vq": "configs/enwik8/transformer_vq.py:node8",
    "pg19/transformer_vq": "configs/pg19/transformer_vq.py:node8",
    "wikitext103/eva_16l": "configs/wikitext103/eva_16l.py:node8",
    "wikitext103/eva_32l": "configs/wikitext103/eva_32l.py:node8",
    "enwik8/fma": "configs/enwik8/fma.py:node8",
    "enwik8/dense": "configs/enwik8/dense.py:node8",
    "pg19/dense": "configs/pg19/dense.py:node8",
    "wikitext103/dense": "configs/wikitext103/dense.py:node8",
}


def command(spec: str) -> str:
    """The documented command of a row (also what each config's docstring states)."""
    return (f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES} .venv/bin/longctx-train "
            f"--config={spec} --dry_run")


def settings(spec: str) -> dict:
    """The launch knobs of a config variant, for the table."""
    import importlib

    path, _, variant = spec.partition(":")
    mod = importlib.import_module(path[:-3].replace("/", "."))
    c = mod.get_config(variant or None)
    mesh = {k: int(c.mesh[k]) for k in ("data", "fsdp", "tensor", "sequence") if k == "data" or int(c.mesh[k]) > 1}
    return {"mesh": mesh, "mesh_rules": c.mesh.rules, "microbatches": int(c.train.microbatches),
            "remat": c.model.remat_policy if c.model.remat else "off", "dtype": c.model.dtype,
            "param_dtype": c.model.param_dtype, "scan_layers": c.model.scan_layers,
            "loss_chunk": int(c.model.loss_chunk), "batch_size": int(c.train.batch_size),
            "seq_len": int(c.train.seq_len), "window": int(c.train.window or c.train.seq_len)}


def _num(pattern: str, text: str, cast=float):
    m = re.search(pattern, text, re.M)
    if not m:
        raise ValueError(f"no match for {pattern!r} in the dry-run report:\n{text}")
    return cast(m.group(1).replace(",", ""))


def parse_report(text: str) -> dict:
    """The numbers of ``dry_run.report`` (MiB to one decimal)."""
    return {
        "parameters": _num(r"dry run: ([\d,]+) parameters", text, int),
        "devices": _num(r"parameters on (\d+) device", text, int),
        "mesh_line": re.search(r"mesh (.*)$", text, re.M).group(1),
        "argument_mib": _num(r"^\s*arguments\s+([\d.]+) MiB", text),
        "temp_mib": _num(r"^\s*temporaries\s+([\d.]+) MiB", text),
        "output_mib": _num(r"^\s*outputs\s+([\d.]+) MiB", text),
        "alias_mib": _num(r"\(([\d.]+) MiB aliased", text),
        "peak_mib": _num(r"^\s*peak \(est\.\)\s+([\d.]+) MiB", text),
        "tokens_per_update": _num(r"tokens per update: ([\d,]+)", text, int),
        "compile_s": _num(r"compile ([\d.]+) s", text),
        "flops_per_token": _num(r"training FLOPs per token \(3 x forward matmuls\): ([\d.e+-]+)", text),
        # the layers as the plan compiled them (model.scan_layers resolved by validate: 'on' | 'off')
        **({"scan_layers": m.group(1)} if (m := re.search(r"model\.scan_layers='(\w+)'", text)) else {}),
    }


def scan_layers_value(value) -> str:
    """``model.scan_layers`` as the table shows it: 'on' | 'off' (| 'auto'); a plan written before the setting took
    those names holds a bool (True: the layers scanned, which 'on' names now)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def run_one(name: str, spec: str) -> dict:
    cmd = command(spec)
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}"}
    exe = str(Path(sys.executable).parent / "longctx-train")
    t0 = time.perf_counter()
    r = subprocess.run([exe, f"--config={spec}", "--dry_run"], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        return {"name": name, "config": spec, "command": cmd, "error": (r.stderr or r.stdout)[-3000:], "wall_s": wall}
    row = {"name": name, "config": spec, "command": cmd, **settings(spec), **parse_report(r.stdout),
           "wall_s": wall, "report": r.stdout.strip()}
    row["args_temps_gib"] = (row["argument_mib"] + row["temp_mib"]) * MiB / GiB
    row["peak_gib"] = row["peak_mib"] * MiB / GiB
    row["fits"] = row["peak_gib"] <= BUDGET_GIB
    return row


def _mesh(row) -> str:
    s = " x ".join(f"{k} {v}" for k, v in row["mesh"].items())
    return s + (f" (rules `{row['mesh_rules']}`)" if row.get("mesh_rules") else "")


def markdown(rows: list[dict], meta: dict, *, table_only: bool = False) -> str:
    lines = [] if table_only else [
        f"Dry-run plans of the flagship launches on one node of {DEVICES} GPUs of 80 GB (budget "
        f"{BUDGET_GIB:.0f} GiB per device), {DEVICES} simulated devices; regenerate with "
        "`.venv/bin/python scripts/flagship_plans.py` (results/flagship/plans.json holds every number).",
        "",
    ]
    lines += [
        "| config | parameters | tokens per update | devices | launch | per-device args + temps | peak (est.) "
        "| training FLOPs per token | compile |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| `{r['config']}` | error: see plans.json | | | | | | | |")
            continue
        launch = (f"{_mesh(r)}; micro-batches {r['microbatches']}; remat {r['remat']}; {r['dtype']} "
                  f"({r['param_dtype']} weights); scan_layers {scan_layers_value(r['scan_layers'])}"
                  + (f"; loss_chunk {r['loss_chunk']}" if r["loss_chunk"] else ""))
        lines.append(
            f"| `{r['config']}` | {r['parameters'] / 1e6:.1f}M | {r['tokens_per_update']:,} "
            f"({r['batch_size']} x {r['window']}) | {r['devices']} | {launch} | "
            f"{r['argument_mib'] / 1024:.2f} + {r['temp_mib'] / 1024:.2f} GiB | {r['peak_gib']:.2f} GiB"
            f"{'' if r['fits'] else ' (over budget)'} | {r['flops_per_token']:.3g} | {r['compile_s']:.0f} s |")
    if table_only:
        return "\n".join(lines + ["", f"Planned on {meta['machine']} with jax {meta['jax']}, {meta['date']}; "
                                   "each row's command is in results/flagship/plans.md."]) + "\n"
    lines += ["", "Commands (one per row, as run):", ""]
    lines += [f"    {r['command']}" for r in rows]
    lines += ["", f"Planned on {meta['machine']} with jax {meta['jax']} (jaxlib {meta['jaxlib']}), "
              f"{meta['date']}. Tokens per update: rows x window (a window carrying state is one update). "
              "FLOPs per token: 3 x the forward matmul FLOPs of one row's loss, counted in its jaxpr "
              "(scanned layers times their count). Peak = arguments + temporaries + outputs not aliased to "
              "donated inputs (XLA memory analysis of the compiled train step)."]
    return "\n".join(lines) + "\n"


DOC_START, DOC_END = "<!-- flagship-plans:start -->", "<!-- flagship-plans:end -->"


def update_doc(rows: list[dict], meta: dict, path: Path = ROOT / "docs" / "scaling.md") -> bool:
    """Replace the table between docs/scaling.md's flagship markers; False when the markers are missing."""
    text = path.read_text()
    if DOC_START not in text or DOC_END not in text:
        return False
    head, rest = text.split(DOC_START, 1)
    _, tail = rest.split(DOC_END, 1)
    path.write_text(head + DOC_START + "\n" + markdown(rows, meta, table_only=True) + DOC_END + tail)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=sorted(FLAGSHIP), help="run this config only (repeatable)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--no-doc", action="store_true", help="leave docs/scaling.md's table as it is")
    ap.add_argument("--render", action="store_true", help="run nothing: rewrite plans.md and docs/scaling.md's table "
                    "from plans.json")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    old = {}
    if (out / "plans.json").exists():
        old = {r["name"]: r for r in json.loads((out / "plans.json").read_text())["rows"]}
    names = [] if args.render else (args.only or list(FLAGSHIP))
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name}: {command(FLAGSHIP[name])}", flush=True)
        row = run_one(name, FLAGSHIP[name])
        old[name] = row
        if "error" in row:
            print(f"    error after {row['wall_s']:.0f} s:\n{row['error']}", flush=True)
        else:
            print(f"    peak {row['peak_gib']:.2f} GiB per device ({'fits' if row['fits'] else 'OVER'} "
                  f"{BUDGET_GIB:.0f} GiB), args+temps {row['args_temps_gib']:.2f} GiB, "
                  f"{row['flops_per_token']:.3g} FLOPs/token, compile {row['compile_s']:.0f} s, "
                  f"wall {row['wall_s']:.0f} s", flush=True)
    import jax
    import jaxlib

    meta = json.loads((out / "plans.json").read_text())["meta"] if args.render else {"machine": f"{platform.system()} {platform.machine()} host, {os.cpu_count()} CPUs", "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"), "budget_gib": BUDGET_GIB}
    rows = [old[n] for n in FLAGSHIP if n in old]
    for r in rows:  # a plan written when model.scan_layers was a bool: the same setting under its current name
        if "scan_layers" in r:
            r["scan_layers"] = scan_layers_value(r["scan_layers"])
    (out / "plans.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / "plans.md").write_text(markdown(rows, meta))
    print(f"wrote {out / 'plans.json'} and {out / 'plans.md'}")
    if not args.no_doc and out.resolve() == OUT.resolve() and update_doc(rows, meta):
        print("updated the flagship table in docs/scaling.md")
    bad = [r["name"] for r in rows if "error" in r or not r.get("fits")]
    if bad:
        print(f"not within {BUDGET_GIB:.0f} GiB per device (or failed): {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
