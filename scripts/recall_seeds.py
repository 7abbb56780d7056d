"""Seed spread of the recall benchmark: dense and every hybrid stack (configs/recall/hybrid_<method>.py) trained
with further ``train.seed`` values beside the table's seed 0, and results/recall/seeds.md written from them.

    .venv/bin/python scripts/recall_seeds.py                 # trains what is missing (2-3 min a run when idle)
    .venv/bin/python scripts/recall_seeds.py --no_train      # the table from the runs that exist

Seed 0 is the recall table's row (results/recall/recall.json, ``runs/recall/<run>``); seeds 1.. train into
``--runs``/<run>_s<seed>. A run's accuracy is its final validation (step 300: the evaluation rows are the same
for every seed, ``data.synthetic.eval_seed``), which equals ``longctx-recall``'s overall accuracy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def final_accuracy(metrics: Path) -> float | None:
    acc = None
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("split") == "valid" and "accuracy" in rec:
                acc = rec["accuracy"]
    return acc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3", help="seeds trained beside the table's seed 0")
    ap.add_argument("--runs", default="runs/recall_seeds", help="folder of the extra seeds' runs")
    ap.add_argument("--table", default="results/recall/recall.json", help="the recall table (seed 0)")
    ap.add_argument("--out", default="results/recall/seeds.md")
    ap.add_argument("--no_train", action="store_true", help="only write the table from existing runs")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    names = ["dense"] + sorted(p.stem for p in (ROOT / "configs/recall").glob("hybrid_*.py"))
    table = json.loads((ROOT / args.table).read_text())
    acc: dict[str, list[float | None]] = {}
    for name in names:
        row = next((r["accuracy"] for k, r in table.items() if Path(k).name == name), None)
        acc[name] = [row]
        for s in seeds:
            wd = Path(args.runs) / f"{name}_s{s}"
            if final_accuracy(wd / "metrics.jsonl") is None and not args.no_train:
                print(f"== {name} seed {s}", flush=True)
                subprocess.run([sys.executable, "-c", "import sys; from longctx.cli import train_main; "
                                "sys.exit(train_main())", f"--config=configs/recall/{name}.py",
                                f"--config.train.seed={s}", f"--workdir={wd}", "--noprogress"], check=True, cwd=ROOT)
            acc[name].append(final_accuracy(wd / "metrics.jsonl"))
    missing = [f"{n} seed {([0] + seeds)[i]}" for n, r in acc.items() for i, a in enumerate(r) if a is None]
    if missing:
        print("error: no accuracy for " + ", ".join(missing), file=sys.stderr)
        return 2
    dense = acc["dense"]
    dm = statistics.mean(dense)
    cols = " | ".join(f"seed {s}" for s in [0] + seeds)
    lines = [
        "## Seed spread of the recall benchmark: dense and the hybrid stacks", "",
        "The recall table (`recall.md`) is one training seed per row (`train.seed = 0`). Here dense and every hybrid",
        "(`configs/recall/hybrid_<method>.py`) were also trained with `train.seed` " + ", ".join(map(str, seeds))
        + " (the seed sets the",
        "initialisation and the generated training rows; the evaluation rows are the same for every run,",
        "`data.synthetic.eval_seed`). Accuracy: overall answer accuracy of the final validation (step 300), which",
        "equals `longctx-recall`'s overall accuracy. Seed 0 is the table's row. `.venv/bin/python scripts/recall_seeds.py`",
        "trains the missing runs and rewrites this file.", "",
        f"| run | {cols} | mean | sd | min-max | mean / dense mean | per-seed ratio to dense (min-max) |",
        "|---|" + "---|" * (len(seeds) + 1) + "---|---|---|---|---|",
    ]
    for name, r in acc.items():
        m, sd = statistics.mean(r), statistics.stdev(r)
        ratios = [a / b for a, b in zip(r, dense)]
        lines.append(f"| {name} | " + " | ".join(f"{a:.3f}" for a in r)
                     + f" | {m:.3f} | {sd:.3f} | {min(r):.3f}-{max(r):.3f} | {m / dm:.2f} | "
                       f"{min(ratios):.2f}-{max(ratios):.2f} |")
    lines += ["", "`mean / dense mean`: the run's mean over the seeds over dense's; `per-seed ratio`: the run's accuracy "
              "over dense's at the same seed."]
    out = ROOT / args.out
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
