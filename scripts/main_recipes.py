"""The experiments that choose the main job's recipe, one row each: what was trained, with which command, and how it
scores on the main job's test bytes with the state carried across each file and reset every N bytes.

    .venv/bin/python -m longctx.evaluate --workdir runs/X --max_bytes 262144        # the run's context table
    .venv/bin/python scripts/main_recipes.py add NAME --workdir runs/X --command "longctx-train ..." [--note "..."]
    .venv/bin/python scripts/main_recipes.py table                                  # results/main_recipes/recipes.md

``add`` reads the run's saved config (``config.json``), its newest context table of the test split
(``eval/test_step<N>_context.json``, written by ``python -m longctx.evaluate``; it must have scored the first 262,144
bytes: ``--max_bytes 262144``, the main job's test bytes whatever the tokenizer) and its ``metrics.jsonl`` (training
time: the logged step times times the steps between records; tokens/s: the median of the records after the first,
which includes compilation), and writes ``results/main_recipes/NAME.json``. ``table`` writes ``recipes.md`` from
every row there (``longctx-bench report`` puts it in BENCHMARKS.md). The command is the one given; the other
columns come from the files. Training times are those of the machine the run had, shared or not (``--note`` says).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "main_recipes"
BYTES = 262144  # the main job's test bytes (README's main-job table)


def _train_time(metrics: Path) -> tuple[float, float | None]:
    """(seconds of training, median tokens/s) from a run's ``metrics.jsonl`` train records."""
    recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    train = [r for r in recs if r.get("split") == "train" and "step_time" in r]
    seconds, last = 0.0, 0
    for r in train:
        seconds += (r["step"] - last) * r["step_time"]
        last = r["step"]
    rates = [r["tokens_per_sec"] for r in train[1:] if r.get("tokens_per_sec")]
    return seconds, (statistics.median(rates) if rates else None)


def record(name: str, workdir: Path, command: str, note: str = "") -> dict:
    cfg = json.loads((workdir / "config.json").read_text())
    tables = sorted((workdir / "eval").glob("test_step*_context.json"),
                    key=lambda p: int(p.name.split("_step")[1].split("_")[0]))
    if not tables:
        sys.exit(f"error: {workdir}/eval has no test context table; run python -m longctx.evaluate --workdir "
                 f"{workdir} --max_bytes {BYTES}")
    ctx = json.loads(tables[-1].read_text())
    rows = ctx["rows"]
    if any(r["bytes_scored"] != BYTES for r in rows):
        sys.exit(f"error: {tables[-1]} scored {rows[0]['bytes_scored']:,} bytes; the recipes compare the first "
                 f"{BYTES:,} (--max_bytes {BYTES})")
    m, t, d = cfg["model"], cfg["train"], cfg["data"]
    seconds, rate = _train_time(workdir / "metrics.jsonl")
    att = m["attention"]
    return {
        "name": name, "command": command, "note": note, "workdir": str(workdir), "step": ctx["step"],
        "tokenizer": d["tokenizer"], "vocab_size": m["vocab_size"], "packing": d["packing"],
        "model": {"attention": "/".join(att.get("pattern") or []) or att["name"], "block": m.get("block"),
                  "d_model": m["d_model"], "num_layers": m["num_layers"]},
        "train": {k: t[k] for k in ("steps", "batch_size", "seq_len", "window", "lr")},
        "train_seconds": seconds, "tokens_per_s": rate,
        "carried": rows[0]["bits_per_byte"],
        "resets": {str(r["row_bytes"]): r["bits_per_byte"] for r in rows[1:]},
        "compressors": ctx["compressors_bits_per_byte"],
    }


def table(rows: list[dict]) -> str:
    resets = sorted({k for r in rows for k in r["resets"]}, key=int)
    head = (["recipe", "tokenizer", "model", "updates x batch x window (rows)", "lr", "train min", "tokens/s",
             f"test bits/byte, state carried ({BYTES:,} bytes)"]
            + [f"reset every {int(k):,} bytes" for k in resets] + ["xz -9e / gzip -9", "command"])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: r["carried"]):
        mo, tr = r["model"], r["train"]
        cells = [r["name"] + (f" ({r['note']})" if r["note"] else ""),
                 r["tokenizer"] + (f" {r['vocab_size']:,}" if r["tokenizer"] != "bytes" else ""),
                 f"{mo['attention']} {mo['block']} d{mo['d_model']} x{mo['num_layers']}",
                 f"{tr['steps']:,} x {tr['batch_size']} x {tr['window']} ({tr['seq_len']:,})", f"{tr['lr']:g}",
                 f"{r['train_seconds'] / 60:.1f}", f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "–",
                 f"**{r['carried']:.4f}**"]
        cells += [f"{r['resets'][k]:.4f}" if k in r["resets"] else "–" for k in resets]
        cells += [f"{r['compressors'].get('xz-9e', float('nan')):.4f} / {r['compressors'].get('gzip-9', float('nan')):.4f}",
                  f"`{r['command']}`"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add", help="record one run")
    a.add_argument("name")
    a.add_argument("--workdir", required=True, type=Path)
    a.add_argument("--command", required=True, help="the command that trained it")
    a.add_argument("--note", default="")
    sub.add_parser("table", help="write recipes.md from the recorded rows")
    args = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    if args.cmd == "add":
        row = record(args.name, args.workdir, args.command, args.note)
        (OUT / f"{args.name}.json").write_text(json.dumps(row, indent=1) + "\n")
    rows = [json.loads(f.read_text()) for f in sorted(OUT.glob("*.json"))]
    text = table(rows) if rows else "(no recipe recorded)\n"
    (OUT / "recipes.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
