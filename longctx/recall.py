"""``longctx-recall``: does a trained model use its context? Accuracy (exact match of the answer
tokens) and answer loss as a function of distance, on a generated recall task
(:mod:`longctx.data.synthetic`), with a plot; ``longctx-recall-report`` tabulates several runs.

    longctx-recall --workdir runs/recall/dense                     # its own task, at its training length
    longctx-recall --workdir runs/default --task=passkey --length=1024   # zero-shot probe of a text LM
    longctx-recall-report --runs=runs/recall/dense,runs/recall/eva --out=bench_out/recall

A run trained on a recall task is scored on that task's fixed evaluation rows (``data.synthetic``
settings of the run, overridable with ``--config.data.synthetic.*``); any byte-level decoder can be
probed on any task (``--task``), e.g. the passkey task on a language model trained on text, at rows
up to several times its training length (``--length``). Rows longer than ``eval.window`` run in
windows with the model's state carried, so each method reads the context through its own state; a
method whose state has a static capacity that the row exceeds is reported as such (status
``capacity``), never truncated silently.

Writes ``WORKDIR/recall/<task>_len<L>_step<N>.json`` and ``..._by_distance.png``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import ml_collections

from longctx.attention.base import CapacityError
from longctx.bench.capture import exact_method
from longctx.config import attention_label
from longctx.data import sources
from longctx.errors import ConfigError, WorkdirError, capacity_message
from longctx.evaluate import write_json_atomic
from longctx.protocols import score_answers
from longctx.runtime import Runner
from longctx.train.step import jit_forward, make_scored_forward

LN2 = math.log(2.0)
RUNNER_OVERRIDES = ("eval.", "data.path", "data.cache_dir")  # the rest of --config.* must be data.synthetic.*


def recall_run(workdir, *, task: str | None = None, length: int | None = None, rows: int | None = None,
               bins: int | None = None, step: int | None = None, overrides: dict | None = None,
               progress: bool = True, write: bool = True, out: str | Path | None = None) -> dict:
    """Score ``workdir``'s newest valid checkpoint (or ``step``) on a generated task; print and
    write the result. ``overrides``: ``--config.*`` values (``eval.*``, ``data.path``,
    ``data.cache_dir`` for the run; ``data.synthetic.*`` for the task). ``out``: the folder for the
    JSON and the plot (default ``WORKDIR/recall``)."""

    overrides = dict(overrides or {})
    syn_over = {k: v for k, v in overrides.items() if k.startswith("data.synthetic.")}
    run_over = {k: v for k, v in overrides.items() if k not in syn_over}
    for k in run_over:
        if not k.startswith(RUNNER_OVERRIDES):
            raise ConfigError(f"--config.{k}: longctx-recall takes --config.eval.*, --config.data.synthetic.*, "
                              "--config.data.path and --config.data.cache_dir")
    runner = Runner.from_workdir(workdir, step=step, overrides=run_over)
    cfg = runner.cfg
    if runner.is_encoder:
        raise ConfigError("longctx-recall scores causal models; this run is an encoder (model.kind='encoder')")
    if cfg.data.tokenizer != "bytes":
        raise ConfigError(f"the recall tasks are byte-level; this run's tokenizer is {cfg.data.tokenizer!r}")
    trained_on = cfg.data.source if sources.is_generated(cfg.data.source) else None
    task = task or trained_on or "passkey"
    if not sources.is_generated(task):
        allowed = [n for n in sources.names() if sources.is_generated(n)]
        raise ConfigError(f"--task={task!r} is not a generated recall task; allowed: {', '.join(allowed)}")
    dcfg = ml_collections.ConfigDict(cfg.data.to_dict())
    if cfg.data.source != "builtin":  # the passkey filler is the built-in corpus, not this run's data.path
        dcfg.path = ""
    dcfg.source = task
    dcfg.synthetic.distance = (0, 0)  # evaluation: every distance that fits, unless asked
    for k, v in syn_over.items():
        dcfg.synthetic[k.split(".", 2)[2]] = tuple(v) if isinstance(v, list) else v
    syn = dcfg.synthetic
    source = sources.build(dcfg)
    for flag, value in (("length", length), ("rows", rows), ("bins", bins)):
        if value is not None and value <= 0:
            raise ConfigError(f"--{flag}={value} must be a positive integer")
    # default: the rows the run was trained on (packed: one example of data.synthetic.example_len inputs)
    L = int((source.example_len or cfg.train.seq_len) if length is None else length)
    n_rows, n_bins = int(syn.eval_rows if rows is None else rows), int(syn.bins if bins is None else bins)
    if L <= 0 or n_rows <= 0 or n_bins <= 0:
        raise ConfigError("--length, --rows and --bins must be positive integers")
    source.check(L) if not source.controls_distance else source.distance_range(L)
    eval_set, edges = source.eval_rows(row_len=L, n_rows=n_rows, bins=n_bins, split=cfg.eval.split,
                                       seed=syn.eval_seed, distance=tuple(syn.distance))
    fwd = jit_forward(make_scored_forward(runner.graphdef))

    def init_state(b, n):
        try:
            return runner.init_state(b, n)
        except ValueError as e:  # a state that cannot be built for n tokens (e.g. levels built for fewer)
            raise CapacityError(str(e)) from e

    method = cfg.model.attention.name
    head = {"task": task, "options": source.options(), "trained_on": trained_on, "length": L,
            "train_seq_len": int(cfg.train.seq_len), **({"train_example_len": source.example_len}
                                                        if source.example_len else {}),
            "attention": method, "stack": attention_label(cfg.model),
            "block": cfg.model.block,
            "step": runner.step, "workdir": str(workdir), "split": cfg.eval.split}
    try:
        res = score_answers(lambda p, i, t, s: fwd(*p, i, t, s), runner.params, eval_set, edges,
                            window=cfg.eval.window, batch_size=cfg.eval.batch_size, init_state=init_state,
                            progress=progress, desc=f"recall {task} L={L}")
        res = {**head, "status": "ok", **res}
    except Exception as e:  # noqa: BLE001 -- only a capacity refusal is a result; anything else re-raises
        msg = capacity_message(e)
        if msg is None:
            raise
        res = {**head, "status": "capacity", "message": msg}
    print(format_recall(res), flush=True)  # the result first: a failed write below cannot lose it
    if write:
        out_dir = Path(out) if out else Path(workdir) / "recall"
        stem = f"{task}_len{L}_step{int(runner.step)}"
        plot, plotted = out_dir / f"{stem}_by_distance.png", False
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(out_dir / f"{stem}.json", res)
            if res["status"] == "ok":
                plotted = plot_by_distance({f"{method} ({cfg.model.block})": res}, plot,
                                           title=f"{task}, rows of {L} tokens (trained at {cfg.train.seq_len}), "
                                                 f"step {runner.step}")
        except OSError as e:
            raise WorkdirError(f"the result above could not be written to {out_dir} ({e.strerror or e}); "
                               "free space or fix the folder (or give --out) and run again") from None
        res["json"] = str(out_dir / f"{stem}.json")
        print(f"wrote {res['json']}" + (f" and {plot}" if plotted else ""), flush=True)
    return res


def format_recall(res: dict) -> str:
    trained = (f"examples of {res['train_example_len']} packed in rows of {res['train_seq_len']}"
               if res.get("train_example_len") else res["train_seq_len"])
    head = (f"{res['task']} {res['options']} @ step {res['step']}, rows of {res['length']} tokens "
            f"(trained at {trained}{', on ' + res['trained_on'] if res['trained_on'] else ', on text'}), "
            f"attention={res.get('stack', res['attention'])}")
    if res["status"] != "ok":
        return (f"{head}\n  not measured: the method's state has a static capacity that rows of {res['length']} "
                f"tokens exceed ({res['message']}). Evaluate shorter rows (--length) or build the state larger "
                "(the method's capacity setting) and retrain if its parameters depend on it.")
    lines = [head, f"  {res['answers']:,} answers ({res['tokens_scored']:,} tokens) in {res['protocol']['rows']} rows: "
                   f"accuracy {res['accuracy']:.4f}{_chance(res)}, answer loss {res['bits_per_token']:.4f} bits/token",
             "  distance          answers  accuracy  loss (bits/token)"]
    for b in res["by_distance"]:
        acc = "-" if b["accuracy"] is None else f"{b['accuracy']:.3f}"
        loss = "-" if b["loss_nats_per_token"] is None else f"{b['loss_nats_per_token'] / LN2:.3f}"
        lines.append(f"  {b['lo']:>6} - {b['hi']:<7}  {b['answers']:>7}  {acc:>8}  {loss:>8}")
    return "\n".join(lines)


def chance(res: dict) -> tuple[float, str] | None:
    """(the accuracy of a uniform guess of each answer, what is guessed) for a result's task and options."""
    o = res.get("options", {})
    if "num_values" in o:  # mqar: one value token
        return 1.0 / o["num_values"], f"1 of {o['num_values']} values"
    if "passkey_len" in o:
        return 10.0 ** -o["passkey_len"], f"{o['passkey_len']} digits"
    if "copy_len" in o:
        return float(o["copy_vocab"]) ** -o["copy_len"], f"{o['copy_len']} ids of {o['copy_vocab']}"
    return None


def _chance(res: dict) -> str:
    """`` (chance 0.0625: 1 of 16 values)``."""
    c = chance(res)
    return f" (chance {c[0]:.4g}: {c[1]})" if c else ""


def _matplotlib():
    try:
        import matplotlib
    except ImportError:  # plotting is optional: the JSON and the table carry the numbers
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_by_distance(results: dict, path: Path, *, title: str) -> bool:
    """Accuracy and answer loss against distance, one line per labelled result. False when
    matplotlib is not installed (nothing written)."""
    plt = _matplotlib()
    if plt is None:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    top = 0.0
    for label, res in results.items():
        bins = [b for b in res["by_distance"] if b["answers"]]
        xs = [(b["lo"] + b["hi"]) / 2 for b in bins]
        ax1.plot(xs, [b["accuracy"] for b in bins], ".-", label=label)
        ax2.plot(xs, [b["loss_nats_per_token"] / LN2 for b in bins], ".-", label=label)
        top = max([top, *(b["loss_nats_per_token"] / LN2 for b in bins)])
    guess = chance(next(iter(results.values()), {}))
    if guess:
        ax1.axhline(guess[0], color="gray", ls="--", lw=1, label=f"chance ({guess[1]})")
    ax1.set_ylabel("accuracy (exact match of the answer)")
    ax1.set_ylim(-0.02, 1.02)
    ax2.set_ylabel("answer loss (bits per token)")
    ax2.set_ylim(0, max(top * 1.1, 0.5))  # from zero: a few hundredths of a bit stay flat
    for ax in (ax1, ax2):
        ax.set_xlabel("distance to the recalled token (tokens)")
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------
# several runs: one table and one plot


def _results(workdir) -> list[dict]:
    """Every recall result of a run, newest first (``recall/*.json``; ``workdir`` may also be a folder of results
    itself, ``longctx-recall --out``)."""
    wd = Path(workdir)
    folder = wd / "recall" if (wd / "recall").is_dir() else wd if not (wd / "config.json").exists() else None
    files = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime) if folder else []
    out = []
    for p in reversed(files):
        res = json.loads(p.read_text())
        if isinstance(res, dict) and "task" in res and "status" in res:
            out.append(res)
    return out


def newest_result(workdir, task: str | None = None, length: int | None = None) -> dict | None:
    """The newest recall result of a run (:func:`_results`), optionally for one task / row length."""
    for res in _results(workdir):
        if (task is None or res["task"] == task) and (length is None or res["length"] == length):
            return res
    return None


def run_summary(workdir) -> dict:
    """Parameter count, steps and training time of a run (from its metrics and config)."""
    wd = Path(workdir)
    out = {}
    cfg = json.loads((wd / "config.json").read_text()) if (wd / "config.json").exists() else {}
    if cfg:
        out["seq_len"] = cfg["train"]["seq_len"]
        out["steps"] = cfg["train"]["steps"]
        out["batch_size"] = cfg["train"]["batch_size"]
    timing = wd / "recall_train_seconds.txt"
    if timing.exists():
        out["train_seconds"] = float(timing.read_text().split()[0])
    log = wd / "train.log"
    if log.exists():
        for line in log.read_text().splitlines():
            if line.startswith("model: ") and " parameters" in line:
                out["params"] = int(line.split()[1].replace(",", ""))
    pattern = cfg["model"]["attention"]["pattern"] if cfg else None
    if pattern:
        out["pattern"] = list(pattern)
    return out


def row_label(res: dict | None, summ: dict, workdir) -> str:
    """A table row's name: the method, ``hybrid_<method>`` for a stack whose layers run different methods
    (``model.attention.pattern``), the folder's name when there is no result."""
    if res is None:
        return Path(str(workdir)).name
    return f"hybrid_{res['attention']}" if len(set(summ.get("pattern") or ())) > 1 else res["attention"]


def _comparison(named: dict[str, dict], reference: str | None = None) -> str:
    """Pure vs hybrid vs ``reference`` (default: the registry's exact method) overall accuracy, one line per
    method that has a hybrid row."""
    if reference is None:
        reference = exact_method()
    ref = named.get(reference)
    methods = [n[len("hybrid_"):] for n in named if n.startswith("hybrid_")]
    if not methods or ref is None:
        return ""
    lines = [f"Pure vs hybrid (the same depth with one exact layer) vs {reference} ({reference}: "
             f"{ref['accuracy']:.3f}), overall accuracy:\n",
             f"| method | pure | hybrid | {reference} | hybrid / {reference} |", "|---|---|---|---|---|"]
    for m in sorted(methods):
        pure, hyb = named.get(m), named[f"hybrid_{m}"]
        cells = [m, f"{pure['accuracy']:.3f}" if pure else "-", f"{hyb['accuracy']:.3f}", f"{ref['accuracy']:.3f}",
                 f"{hyb['accuracy'] / ref['accuracy']:.2f}" if ref["accuracy"] else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _merged_rows(out: Path, workdirs: list[str]) -> list[tuple[str, dict, dict]]:
    """The rows of ``OUT/recall.json`` that ``workdirs`` do not replace (``--merge``), each with the run summary
    it was written with (``"run"``; empty for a file written before the summaries were kept)."""
    path = out / "recall.json"
    if not path.exists():
        raise ConfigError(f"--merge: {path} does not exist; run the report without --merge first")
    old = json.loads(path.read_text())
    keep = {str(Path(w)) for w in workdirs}
    return [(wd, res, dict(res.get("run", {}))) for wd, res in old.items()
            if res is not None and str(Path(wd)) not in keep]


def report(workdirs: list[str], out: str | Path, *, task: str | None = None, length: int | None = None,
           title: str = "", merge: bool = False) -> str:
    """Write ``OUT/recall.md`` (a markdown table: accuracy per distance bin, overall accuracy and answer
    loss per run; with hybrid rows, a pure / hybrid / dense comparison) and ``OUT/recall.png`` from the runs'
    newest recall results. ``merge``: keep the rows already in ``OUT/recall.json`` (those of runs not given
    again), so new runs join a table whose runs are gone. Returns the table."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    missing = [wd for wd in workdirs if not Path(wd).is_dir()]
    if missing:
        raise ConfigError(f"--runs: no such folder {missing[0]!r}" + (f" (and {len(missing) - 1} more)"
                                                                       if len(missing) > 1 else ""))
    rows = _merged_rows(out, workdirs) if merge else []
    for wd in workdirs:
        res = newest_result(wd, task, length)
        if res is None:
            held = sorted({f"{r['task']} at {r['length']}" for r in _results(wd)})
            print(f"warning: {wd}: no recall result" + (f" for task={task}" if task else "")
                  + (f" at length {length}" if length else "") + "; it holds "
                  + (", ".join(held) if held else "none (run longctx-recall on it first)"), file=sys.stderr)
        rows.append((wd, res, run_summary(wd)))
    # each method's pure row, then its hybrid row; runs without a result last
    rows.sort(key=lambda r: (r[1] is None, r[1]["attention"] if r[1] else "", len(set(r[2].get("pattern") or ())) > 1))
    results = {row_label(res, summ, wd): res for wd, res, summ in rows if res and res["status"] == "ok"}
    ok = [r for _, r, _ in rows if r and r["status"] == "ok"]
    if not ok and not rows:
        raise ConfigError("no runs given (--runs=DIR,DIR,...)")
    edges = [(b["lo"], b["hi"]) for b in ok[0]["by_distance"]] if ok else []
    head = ["method", "block", "params", "steps", "train s", "accuracy", "answer loss (bits)"]
    head += [f"d {lo}-{hi}" for lo, hi in edges]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for wd, res, summ in rows:
        name = row_label(res, summ, wd)
        cells = [name, res["block"] if res else "-", f"{summ.get('params', 0):,}" if "params" in summ else "-",
                 str(summ.get("steps", "-")), f"{summ['train_seconds']:.0f}" if "train_seconds" in summ else "-"]
        if res is None:
            cells += ["no result"] + ["-"] * (1 + len(edges))
        elif res["status"] != "ok":
            cells += [f"capacity: {res['message'][:80]}"] + ["-"] * (1 + len(edges))
        else:
            by = {(b["lo"], b["hi"]): b for b in res["by_distance"]}
            cells += [f"{res['accuracy']:.3f}", f"{res['bits_per_token']:.3f}"]
            cells += ["-" if by.get(e, {}).get("accuracy") is None else f"{by[e]['accuracy']:.2f}" for e in edges]
        lines.append("| " + " | ".join(cells) + " |")
    first = ok[0] if ok else None
    desc = ""
    if first:
        desc = (f"Task `{first['task']}` {first['options']}, rows of {first['length']} tokens, "
                f"{first['protocol']['rows']} evaluation rows ({first['split']} stream), {first['answers']:,} answers "
                "per method; accuracy = exact match of every answer token (argmax given the true prefix); "
                "columns `d lo-hi`: accuracy of the answers whose distance to the recalled token is in that range.\n\n")
    if any(n.startswith("hybrid_") for n in results):
        desc += ("`hybrid_<method>`: the same depth with one layer exact (the layer pattern of "
                 "configs/recall/hybrid_<method>.py, `model.attention.pattern`).\n\n")
    table = desc + "\n".join(lines) + "\n"
    comparison = _comparison(results)
    if comparison:
        table += "\n" + comparison
    (out / "recall.md").write_text((f"## {title}\n\n" if title else "") + table)
    (out / "recall.json").write_text(json.dumps(
        {str(wd): (dict(res, run=summ) if res else res) for wd, res, summ in rows}, indent=1))
    if results:
        plot_by_distance(results, out / "recall.png",
                         title=title or f"{first['task']}, rows of {first['length']} tokens")
    print(table)
    return table



def needle_grid(workdir, lengths, *, task: str | None = None, rows: int | None = None, bins: int | None = None,
                step: int | None = None, overrides: dict | None = None, progress: bool = True,
                out: str | Path | None = None) -> dict:
    """The needle-in-a-haystack layout of long-context suites: accuracy by context length (``lengths``) x depth of
    the needle in the context (``bins`` equal bins of the answer's distance, read as depth = 1 - distance/length:
    0 % the start of the row, 100 % next to the question). Each length is one :func:`recall_run` (printed); the grid
    is written as JSON, a markdown table and a heat map (``needle_grid_<task>_step<step>.*`` under ``out``, default
    ``WORKDIR/recall``)."""

    lengths = [int(L) for L in lengths]
    if not lengths or any(L <= 0 for L in lengths):
        raise ConfigError(f"--lengths={','.join(map(str, lengths))}: positive row lengths, comma-separated")
    results = [recall_run(workdir, task=task, length=L, rows=rows, bins=bins, step=step, overrides=overrides,
                          progress=progress, write=False) for L in sorted(lengths)]
    first = results[0]
    grid = []
    for res in results:
        cells = []
        if res["status"] == "ok":
            for b in reversed(res["by_distance"]):  # the farthest needle first: depth 0 % leftmost
                L = res["length"]
                loss = b["loss_nats_per_token"]  # None for a bin without answers
                cells.append({"depth_lo": max(0.0, 1 - (b["hi"] - 1) / L), "depth_hi": min(1.0, 1 - b["lo"] / L),
                              "accuracy": b["accuracy"], "answers": b["answers"],
                              "loss_bits": None if loss is None else loss / LN2})
        grid.append({"length": res["length"], "status": res["status"], "message": res.get("message"),
                     "cells": cells})
    c = chance(first)
    out_json = {"task": first["task"], "options": first.get("options"), "attention": first["stack"],
                "block": first["block"], "step": first["step"], "train_seq_len": first["train_seq_len"],
                "chance": c[0] if c else None, "grid": grid}
    ncol = max((len(g["cells"]) for g in grid), default=0)
    head = ["length"] + [f"depth {i}/{ncol}" for i in range(1, ncol + 1)]
    lines = [f"Needle grid: `{first['task']}`, {first['stack']} ({first['block']}) at step {first['step']}, "
             f"trained on rows of {first['train_seq_len']} tokens; accuracy by row length and depth of the needle "
             f"(columns: equal bins of depth from the start of the row to the question)"
             + (f"; chance {c[0]:.4g}" if c else "") + ".", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in grid:
        if g["status"] != "ok":
            lines.append(f"| {g['length']} | {g['status']}: {(g['message'] or '')[:80]} |" + " - |" * (ncol - 1))
            continue
        lines.append(f"| {g['length']} | " + " | ".join(
            "-" if x["accuracy"] is None else f"{x['accuracy']:.2f}" for x in g["cells"]) + " |")
    # the answer loss shows what accuracy cannot where every cell is at chance (a model that half-knows the answer)
    lines += ["", "Answer loss (bits per answer token) by the same cells:", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [f"| {g['length']} | " + " | ".join("-" if x["loss_bits"] is None else f"{x['loss_bits']:.2f}"
                                                 for x in g["cells"]) + " |" for g in grid if g["status"] == "ok"]
    table = "\n".join(lines)
    print(table, flush=True)
    out_dir = Path(out) if out else Path(workdir) / "recall"
    stem = out_dir / f"needle_grid_{first['task']}_step{int(first['step'])}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(stem.with_suffix(".json"), out_json)
        stem.with_suffix(".md").write_text(table + "\n")
        plotted = _plot_grid(grid, stem.with_suffix(".png"), chance_level=c[0] if c else None,
                             title=f"{first['task']}: {first['stack']} ({first['block']}), step {first['step']}")
    except OSError as e:
        raise WorkdirError(f"the grid above could not be written to {out_dir} ({e.strerror or e}); free space or "
                           "fix the folder (or give --out) and run again") from None
    print(f"wrote {stem}.json, {stem}.md" + (f" and {stem}.png" if plotted else ""), flush=True)
    return {**out_json, "json": str(stem.with_suffix(".json"))}


def _plot_grid(grid, path: Path, *, chance_level, title: str) -> bool:
    plt = _matplotlib()
    ok = [g for g in grid if g["status"] == "ok" and g["cells"]]
    if plt is None or not ok:
        return False
    import numpy as np

    ncol = max(len(g["cells"]) for g in ok)
    acc = np.full((len(grid), ncol), np.nan)
    for i, g in enumerate(grid):
        for j, x in enumerate(g["cells"]):
            acc[i, j] = np.nan if x["accuracy"] is None else x["accuracy"]
    fig, ax = plt.subplots(figsize=(1.2 * ncol + 3, 0.6 * len(grid) + 2))
    im = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    for i in range(acc.shape[0]):
        for j in range(acc.shape[1]):
            if not np.isnan(acc[i, j]):
                ax.text(j, i, f"{acc[i, j]:.2f}", ha="center", va="center",
                        color="white" if acc[i, j] < 0.5 else "black", fontsize=8)
    ax.set_yticks(range(len(grid)), [str(g["length"]) for g in grid])
    ax.set_xticks(range(ncol), [f"{round(100 * (j + 0.5) / ncol)} %" for j in range(ncol)])
    ax.set_xlabel("depth of the needle (0 %: the start of the row; 100 %: next to the question)")
    ax.set_ylabel("row length (tokens)")
    ax.set_title(title + (f"; chance {chance_level:.3g}" if chance_level is not None else ""), fontsize=9)
    fig.colorbar(im, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
