"""Short documents: ``data.packing='segments'`` against the default ``'document'`` rule, same model, same updates.

    .venv/bin/python scripts/packing_bench.py --corpus runs/packing/corpus --runs runs/packing --out results/packing

1. A corpus of short documents (:func:`make_corpus`): the built-in corpus's files (the Python standard library),
   each cut into pieces at seeded random points, one JSONL record per piece, in ``train.jsonl`` / ``valid.jsonl`` /
   ``test.jsonl`` (a file's pieces all go to the split the built-in corpus gives the file). Most pieces are short
   (``--short``, 64-900 bytes by default); a fraction ``--long_fraction`` of them is cut longer than a row
   (``--long``), since the ``document`` rule stops with an error when no document fills one row.
2. Two ``longctx-train`` runs of exact attention (``dense``) on it, identical except ``data.packing``: rows of
   ``--seq_len`` tokens (bytes), the model of ``configs/default.py`` made smaller (``--model``), ``--steps`` updates,
   both scored at the end by the periodic validation on the same validation tokens (the first ``--eval_tokens``
   of ``valid.jsonl``, documents whole, each from a fresh state: the protocol does not read ``data.packing``).
3. ``packing.json`` and ``packing.md`` in ``--out``: per rule, the share of the train tokens it trains on (the
   trainer's own start line), training tokens/s (median of the ``metrics.jsonl`` records after the first, which
   includes compilation), and validation loss and bits/byte after the same updates; the exact commands.
   ``longctx-bench report`` puts the ``.md`` in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RULES = ("document", "segments")
SPLIT_FILES = {"train": "train.jsonl", "valid": "valid.jsonl", "test": "test.jsonl"}
# the trainer's start line (longctx.data.batching.Batcher.summary): "... trains on 1,234 of 5,678 train tokens (21.73 %)"
TRAINS_ON = re.compile(r"trains on ([\d,]+) of ([\d,]+) train tokens \(([\d.]+) %\)")


# ----------------------------------------------------------------------------- the corpus
def piece_lengths(n: int, rng: np.random.Generator, *, short: tuple[int, int], long: tuple[int, int],
                  long_fraction: float) -> list[int]:
    """Lengths (bytes) that cut ``n`` bytes into pieces: each drawn uniformly in ``long`` (inclusive) with probability
    ``long_fraction``, else in ``short``; the last piece is what remains (it may be shorter than ``short[0]``)."""
    out, left = [], n
    while left > 0:
        lo, hi = long if rng.random() < long_fraction else short
        k = min(int(rng.integers(lo, hi + 1)), left)
        out.append(k)
        left -= k
    return out


def cut(data: bytes, lengths: list[int]) -> list[bytes]:
    """``data`` cut after each of ``lengths`` bytes, each cut moved forward to the next UTF-8 character start
    (so every piece decodes); the pieces concatenate to ``data``."""
    pieces, start, end = [], 0, 0
    for k in lengths:
        end = max(end, start) + k
        while end < len(data) and (data[end] & 0xC0) == 0x80:  # a continuation byte: not a character start
            end += 1
        if end > start:
            pieces.append(data[start:end])
        start = end
        if start >= len(data):
            break
    if start < len(data):
        pieces.append(data[start:])
    return pieces


def make_corpus(out: Path, *, seed: int = 0, max_bytes: int = 8_000_000, short: tuple[int, int] = (64, 900),
                long: tuple[int, int] = (1100, 4096), long_fraction: float = 0.1, root: Path | None = None) -> dict:
    """Write ``train.jsonl``, ``valid.jsonl`` and ``test.jsonl`` in ``out`` (``{"text": piece}`` per line) from the
    built-in corpus under ``root`` (default: this interpreter's standard library): files taken in a seeded order
    until ``max_bytes`` (0: all), each in the built-in corpus's split of that file, cut by :func:`piece_lengths`.
    Whitespace-only pieces are left out (``data.source=files`` skips them too). Returns per split: documents,
    bytes, and the documents and bytes of pieces shorter than ``long[0]``."""
    from longctx.data.builtin import BuiltinSource, split_of

    if not (0 < short[0] <= short[1] and 0 < long[0] <= long[1] and 0.0 <= long_fraction <= 1.0):
        raise ValueError(f"need 0 < lo <= hi for short={short} and long={long}, and long_fraction in [0, 1]")
    src = BuiltinSource(root=root)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(src._files))
    chosen, total = [], 0
    for i in order:
        if max_bytes and total >= max_bytes:
            break
        rel = src._files[i]
        chosen.append(rel)
        total += (src.root / rel).stat().st_size
    out.mkdir(parents=True, exist_ok=True)
    stats = {s: {"documents": 0, "bytes": 0, "short_documents": 0, "short_bytes": 0} for s in SPLIT_FILES}
    files = {s: (out / name).open("w", encoding="utf-8") for s, name in SPLIT_FILES.items()}
    try:
        for rel in sorted(chosen):  # corpus order: sorted paths; each file's cuts from its own seeded stream
            data = (src.root / rel).read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            frng = np.random.default_rng([seed, int(hashlib.sha256(rel.encode()).hexdigest()[:15], 16)])
            split = split_of(rel)
            for piece in cut(data, piece_lengths(len(data), frng, short=short, long=long,
                                                 long_fraction=long_fraction)):
                text = piece.decode("utf-8")
                if not text.strip():
                    continue
                files[split].write(json.dumps({"text": text}) + "\n")
                st = stats[split]
                st["documents"] += 1
                st["bytes"] += len(piece)
                if len(piece) < long[0]:
                    st["short_documents"] += 1
                    st["short_bytes"] += len(piece)
    finally:
        for f in files.values():
            f.close()
    return {"files": len(chosen), "seed": seed, "max_bytes": max_bytes, "short": list(short), "long": list(long),
            "long_fraction": long_fraction, "splits": stats}


# ----------------------------------------------------------------------------- the runs
def train_command(args, rule: str) -> list[str]:
    d_model, layers, heads, head_dim, d_ff = args.model
    return ["longctx-train", "--config", os.path.relpath(ROOT / "configs" / "default.py"), f"--workdir={Path(args.runs) / rule}", "--noprogress",
            "--config.data.source=files", f"--config.data.path={args.corpus}",
            f"--config.data.cache_dir={Path(args.runs) / 'cache'}", f"--config.data.packing={rule}",
            "--config.model.attention.name=dense", f"--config.model.d_model={d_model}",
            f"--config.model.num_layers={layers}", f"--config.model.num_heads={heads}",
            f"--config.model.head_dim={head_dim}", f"--config.model.d_ff={d_ff}",
            f"--config.train.seq_len={args.seq_len}", f"--config.train.batch_size={args.batch_size}",
            f"--config.train.steps={args.steps}", f"--config.train.warmup_steps={max(1, args.steps // 10)}",
            f"--config.train.log_every={args.log_every}", f"--config.train.eval_every={args.steps}",
            f"--config.train.ckpt_every={args.steps}", f"--config.train.eval_tokens={args.eval_tokens}",
            f"--config.train.seed={args.seed}"]


def run_rule(args, rule: str) -> dict:
    """Train one rule; its start line's counts, tokens/s and the final validation."""
    workdir = Path(args.runs) / rule
    if workdir.exists():
        if not args.overwrite:
            raise SystemExit(f"{workdir} exists (a run there would resume); remove it or pass --overwrite")
        shutil.rmtree(workdir)
    cmd = train_command(args, rule)
    exe = Path(sys.executable).parent / cmd[0]
    print("$ " + shlex.join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.run([str(exe) if exe.exists() else cmd[0], *cmd[1:]], capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"longctx-train ({rule}) failed with exit status {proc.returncode}")
    line = next((x for x in proc.stdout.splitlines() if "data: packing=" in x), "")
    m = TRAINS_ON.search(line)
    if not m:
        raise SystemExit(f"longctx-train ({rule}): no 'trains on ... train tokens' in its start line:\n{proc.stdout}")
    recs = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in recs if r["split"] == "train"]
    tps = [r["tokens_per_sec"] for r in train[1:] if "tokens_per_sec" in r]
    valid = [r for r in recs if r["split"] == "valid"]
    if not valid or valid[-1]["step"] != args.steps:
        raise SystemExit(f"longctx-train ({rule}): no validation at step {args.steps} in {workdir}/metrics.jsonl")
    return {"command": shlex.join(cmd), "data_line": line.split("data: ", 1)[1],
            "trained_tokens": int(m.group(1).replace(",", "")), "train_tokens": int(m.group(2).replace(",", "")),
            "trained_percent": float(m.group(3)), "tokens_per_s": statistics.median(tps) if tps else None,
            "tokens_per_s_records": len(tps), "final_train_loss": train[-1]["loss"], "steps": valid[-1]["step"],
            "valid_loss": valid[-1]["loss"], "valid_bits_per_byte": valid[-1]["bits_per_token"], "wall_s": wall}


# ----------------------------------------------------------------------------- the report
def markdown(res: dict) -> str:
    from longctx.bench import common as C

    a, corpus, runs = res["args"], res["corpus"], res["runs"]
    tr, va = corpus["splits"]["train"], corpus["splits"]["valid"]
    d_model, layers, heads, head_dim, d_ff = a["model"]
    parts = [
        f"`{res['command']}`\n",
        f"Corpus: {corpus['files']} files of the built-in corpus (seed {corpus['seed']}) cut into pieces of "
        f"{corpus['short'][0]}-{corpus['short'][1]} bytes, or with probability {corpus['long_fraction']:g} of "
        f"{corpus['long'][0]}-{corpus['long'][1]} bytes (the `document` rule needs documents of a full row); "
        f"train: {tr['documents']:,} documents, {tr['bytes']:,} bytes, {tr['short_documents']:,} of them "
        f"({tr['short_bytes']:,} bytes) shorter than {corpus['long'][0]} bytes; validation: {va['documents']:,} "
        f"documents, {va['bytes']:,} bytes.\n",
        f"Both runs: `dense`, {layers} layers, d_model {d_model}, {heads} heads of {head_dim}, d_ff {d_ff}, bytes, "
        f"rows of {a['seq_len']} tokens, batch {a['batch_size']}, {a['steps']} updates (seed {a['seed']}); validation "
        f"after the last update on the first {a['eval_tokens']:,} tokens of the validation documents (whole documents, "
        f"each from a fresh state: the same tokens and protocol for both rules). Trained on = the share of the train "
        f"tokens the rule can put in a row, from the trainer's start line; tokens/s = median of the metrics.jsonl "
        f"records after the first (this machine, shared: {res['machine'].get('nproc')} CPUs, load "
        f"{res['machine'].get('load_avg')} at the start).\n",
        C.md_table(["data.packing", "trained on", "train tokens", "train tokens/s", f"valid loss (nats) at {a['steps']}",
                    "valid bits/byte", "final train loss", "wall s"],
                   [[rule, f"{r['trained_percent']:.2f} %", f"{r['trained_tokens']:,} of {r['train_tokens']:,}",
                     r["tokens_per_s"], f"{r['valid_loss']:.4f}", f"{r['valid_bits_per_byte']:.4f}",
                     f"{r['final_train_loss']:.4f}", round(r["wall_s"])] for rule, r in runs.items()]),
    ]
    if set(RULES) <= set(runs):
        d, s = runs["document"], runs["segments"]
        diff = d["valid_bits_per_byte"] - s["valid_bits_per_byte"]
        better = "lower" if diff > 0 else "higher" if diff < 0 else "equal"
        parts.append(f"After {a['steps']} updates `segments` reaches a {better} validation loss than `document` "
                     f"({s['valid_bits_per_byte']:.4f} against {d['valid_bits_per_byte']:.4f} bits/byte: `document` "
                     f"minus `segments` = {diff:+.4f}). One seed and one short run: the run-to-run spread is not "
                     "measured here. "
                     "The train losses differ in what they average (`segments` has no target across a boundary "
                     "and its rows hold short documents), so only the validation columns compare the two.\n")
    parts.append("Commands:\n\n```bash\n" + "\n".join(r["command"] for r in runs.values()) + "\n```\n")
    return "\n".join(parts)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="runs/packing/corpus", help="folder the corpus is written to")
    p.add_argument("--runs", default="runs/packing", help="folder of the two workdirs (<runs>/<rule>) and token cache")
    p.add_argument("--out", default="results/packing", help="folder of packing.json and packing.md")
    p.add_argument("--overwrite", action="store_true", help="delete existing workdirs <runs>/<rule> first")
    p.add_argument("--corpus_only", action="store_true", help="write the corpus and stop")
    p.add_argument("--seed", type=int, default=0, help="the corpus's cuts and the training seed")
    p.add_argument("--max_bytes", type=int, default=8_000_000, help="bytes of source files to cut (0: all)")
    p.add_argument("--short", type=int, nargs=2, default=(64, 900), metavar=("LO", "HI"))
    p.add_argument("--long", type=int, nargs=2, default=(1100, 4096), metavar=("LO", "HI"))
    p.add_argument("--long_fraction", type=float, default=0.1)
    p.add_argument("--model", type=int, nargs=5, default=(128, 2, 2, 64, 512),
                   metavar=("D_MODEL", "LAYERS", "HEADS", "HEAD_DIM", "D_FF"))
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--log_every", type=int, default=25)
    p.add_argument("--eval_tokens", type=int, default=131072)
    args = p.parse_args(argv)
    if args.long[0] <= args.seq_len:
        p.error(f"--long {args.long[0]} must exceed --seq_len {args.seq_len} (rows hold seq_len + 1 tokens)")
    corpus = make_corpus(Path(args.corpus), seed=args.seed, max_bytes=args.max_bytes, short=tuple(args.short),
                         long=tuple(args.long), long_fraction=args.long_fraction)
    print(f"corpus in {args.corpus}: " + json.dumps(corpus["splits"]), flush=True)
    if args.corpus_only:
        return
    from longctx.bench import common as C

    res = {"command": shlex.join([".venv/bin/python", "scripts/packing_bench.py", *(argv or sys.argv[1:])]),
           "args": vars(args), "machine": C.machine_info(), "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "corpus": corpus, "runs": {}}
    for rule in RULES:
        res["runs"][rule] = run_rule(args, rule)
        r = res["runs"][rule]
        print(f"{rule}: trains on {r['trained_percent']:.2f} %, {r['tokens_per_s'] or 0:,.0f} tokens/s, valid "
              f"{r['valid_bits_per_byte']:.4f} bits/byte after {r['steps']} updates", flush=True)
    out = C.out_dir(args.out)
    C.write_json(out / "packing.json", res)
    (out / "packing.md").write_text(markdown(res))
    print(f"wrote {out / 'packing.json'} and {out / 'packing.md'}")


if __name__ == "__main__":
    main()
