"""`longctx-bench train`: for each registered method, train the full model (configs/default.py with
``model.attention.name`` set, or ``configs/builtin/<method>.py`` when it exists) for ``--steps``
steps with ``longctx.train.loop.train`` in a child process, and report

* training tokens/s: median of the run's metrics.jsonl ``tokens_per_sec`` records (the trainer leaves
  compilation out of them);
* peak memory: the child's peak RSS (sampled every 50 ms) and XLA's compiled memory analysis of the
  jitted train step;
* validation bits per byte: the final eval of the run (byte tokenizer: 1 token = 1 byte).

The runs go to ``--runs``/<method> (default ``runs/bench_train`` under the working directory). Each run
folder gets a marker file (``.longctx_bench_run``); a later ``longctx-bench train`` replaces only folders
that carry it and refuses, before running anything, when a ``<runs>/<method>`` folder exists without it.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from absl import flags

from longctx import config as config_lib
from longctx.bench import common as C
from longctx.bench import configs
from longctx.errors import ConfigError


def define_flags(fv) -> None:
    flags.DEFINE_string("methods", "", "comma list of methods (default: all registered)", flag_values=fv)
    flags.DEFINE_integer("steps", 200, "training steps per method", flag_values=fv)
    flags.DEFINE_integer("seq_len", 0, "context (train.seq_len); 0: the config's", flag_values=fv)
    flags.DEFINE_integer("batch_size", 0, "0: the config's", flag_values=fv)
    flags.DEFINE_integer("d_model", 0, "model size; 0: the config's", flag_values=fv)
    flags.DEFINE_integer("num_layers", 0, "0: the config's", flag_values=fv)
    flags.DEFINE_integer("eval_tokens", 32768, "tokens scored by the final validation", flag_values=fv)
    flags.DEFINE_string("runs", "runs/bench_train", "folder of the training runs, one sub-folder per method "
                        "(replaced on a rerun only if this command created it)", flag_values=fv)
    flags.DEFINE_bool("update", False, "merge into <out>/train.json: the rows of the methods run here replace "
                      "theirs, the rest stay", flag_values=fv)
    flags.DEFINE_bool("xla_mem", True, "XLA's memory analysis of the train step (one extra compile per method; "
                      "--noxla_mem skips it)", flag_values=fv)


MARKER = ".longctx_bench_run"  # in every run folder this command creates; only such folders are replaced


def _run_dirs(args) -> dict[str, Path]:
    methods = C.select_methods(C.parse_names(args.methods))
    return {m: Path(args.runs) / m for m in methods}


def validate(args) -> None:
    """Refuse (before anything runs) when a run folder exists that this command did not create."""
    root = Path(args.runs)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--runs {args.runs}: exists and is not a folder")
    for wd in _run_dirs(args).values():
        if wd.exists() and not (wd / MARKER).is_file():
            raise ConfigError(f"--runs {args.runs}: {wd} exists and was not created by longctx-bench train; "
                              "give another --runs folder (nothing was deleted)")


def run_config(method: str, args):
    cfg, src = configs.method_config(method)
    tc = cfg.train
    tc.steps = args.steps
    tc.eval_every = args.steps
    tc.ckpt_every = args.steps
    tc.log_every = max(1, args.steps // 10)
    tc.warmup_steps = max(1, min(tc.warmup_steps, args.steps // 10))
    tc.async_checkpoints = False
    tc.eval_tokens = args.eval_tokens
    if args.seq_len:
        tc.seq_len = args.seq_len
    if args.batch_size:
        tc.batch_size = args.batch_size
    if args.d_model:
        cfg.model.d_model = args.d_model
    if args.num_layers:
        cfg.model.num_layers = args.num_layers
    # rows inside one document for every method (like for like: a packed row runs each method's packed path),
    # whatever the default; --config.data.packing=... sets another rule
    cfg.data.packing = "document"
    cfg = configs.with_overrides(cfg, getattr(args, "overrides", []))

    config_lib.validate(cfg)
    return cfg, src


def read_metrics(workdir: Path) -> dict:
    recs = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in recs if r["split"] == "train"]
    valid = [r for r in recs if r["split"] == "valid"]
    tps = [r["tokens_per_sec"] for r in train if r.get("tokens_per_sec") is not None]  # none at the compiling step
    out = {"tokens_per_s": statistics.median(tps) if tps else None, "tokens_per_s_records": len(tps),
           "final_train_bits_per_token": train[-1]["bits_per_token"] if train else None}
    if valid:
        out["valid_bits_per_token"] = valid[-1]["bits_per_token"]
        out["valid_step"] = valid[-1]["step"]
    return out


def run(args) -> dict:
    out = C.out_dir(args.out)
    validate(args)
    dirs = _run_dirs(args)
    methods = list(dirs)
    res = {"header": C.header(args, "train"), "rows": []}
    bar = C.progress_bar(len(methods), "train", args.progress)
    for method in methods:
        bar.set_postfix_str(method)
        row = {"method": method}
        try:
            cfg, src = run_config(method, args)
        except ConfigError as e:
            row["status"] = f"not run: {e}"
            res["rows"].append(row)
            bar.update(1)
            continue
        m = cfg.model
        row.update({"config_file": src, "block": m.block, "d_model": m.d_model, "num_layers": m.num_layers,
                    "num_heads": m.num_heads, "head_dim": m.head_dim, "seq_len": cfg.train.seq_len,
                    "window": cfg.train.window or cfg.train.seq_len, "batch_size": cfg.train.batch_size,
                    "steps": cfg.train.steps, "tokenizer": cfg.data.tokenizer})
        wd = dirs[method]
        if wd.exists() and (wd / MARKER).is_file():  # a run folder this command created earlier
            shutil.rmtree(wd)
        wd.mkdir(parents=True)
        (wd / MARKER).write_text("created by longctx-bench train; replaced by the next run into this folder\n")
        (wd / "bench_config.json").write_text(cfg.to_json(indent=1))
        cmd = [sys.executable, "-m", "longctx.bench.train_worker", str(wd / "bench_config.json"), str(wd),
               str(wd / "bench_result.json")] + (["--xla_mem"] if args.xla_mem else [])
        t0 = time.time()
        with open(wd / "train.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            with C.RssSampler(pid=proc.pid, interval=0.05) as rss:
                rc = proc.wait()
        row["wall_s"] = time.time() - t0
        row["rss_peak_bytes"] = rss.peak
        if rc != 0:
            tail = (wd / "train.log").read_text().strip().splitlines()[-1:] or [""]
            row["status"] = f"error: exit {rc}: {tail[0][:200]} (see {wd / 'train.log'})"
        else:
            r = json.loads((wd / "bench_result.json").read_text())
            row["params"] = r["summary"].get("params")
            row["xla_train_step_mem"] = r.get("xla_train_step_mem")
            row["train_wall_s"] = r.get("train_wall_s")
            row.update(read_metrics(wd))
            if cfg.data.tokenizer == "bytes" and row.get("valid_bits_per_token") is not None:
                row["valid_bits_per_byte"] = row["valid_bits_per_token"]
            row["status"] = "ok"
        res["rows"].append(row)
        bar.update(1)
    bar.close()
    if getattr(args, "update", False):
        res = merge_rows(out / "train.json", res)
    C.write_json(out / "train.json", res)
    (out / "train.md").write_text(markdown(res))
    plots(res, out)
    return res


def merge_rows(path: Path, res: dict) -> dict:
    """``--update``: res's rows replace the rows of the same methods in the results at path (in their place;
    new methods go last); the header is this run's, with the earlier one under ``merged_into``."""
    if not path.exists():
        return res
    old = json.loads(path.read_text())
    new = {r["method"]: r for r in res["rows"]}
    rows = [new.pop(r["method"], r) for r in old["rows"]] + list(new.values())
    return dict(res, rows=rows, merged_into=dict(old["header"], merged_into=old.get("merged_into")))


def markdown(res: dict) -> str:
    a = res["header"]["args"]
    parts = [f"{a['steps']} steps per method; tokens/s = median of the metrics.jsonl records after the first "
             "(the first includes compilation); peak RSS = the training process; validation bits/byte from the "
             f"final eval ({a['eval_tokens']} tokens).\n\n"]
    rows = []
    for r in res["rows"]:
        xm = (r.get("xla_train_step_mem") or {}).get("total")
        rows.append([r["method"], r.get("config_file"), r.get("block"), r.get("params"), r.get("seq_len"),
                     r.get("batch_size"), r.get("tokens_per_s"), r["rss_peak_bytes"] / C.MB if r.get("rss_peak_bytes")
                     else None, xm / C.MB if xm else None, r.get("valid_bits_per_byte", r.get("valid_bits_per_token")),
                     r.get("status")])
    parts.append(C.md_table(["method", "config", "block", "params", "context", "batch", "train tokens/s",
                             "peak RSS MB", "XLA train-step MB", "valid bits/byte", "status"], rows))
    return "".join(parts)


def plots(res: dict, out):
    rs = [r for r in res["rows"] if r.get("status") == "ok"]
    fig, axes = C.new_figure(3)
    names = [r["method"] for r in rs]
    for ax, key, title, scale in ((axes[0], "tokens_per_s", "train tokens/s", 1.0),
                                  (axes[1], "rss_peak_bytes", "peak RSS (MB)", 1 / C.MB),
                                  (axes[2], "valid_bits_per_token", "validation bits/byte", 1.0)):
        vals = [(r.get(key) or 0) * scale for r in rs]
        ax.bar(names, vals, color=[f"C{i}" for i in range(len(names))])
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
        ax.grid(True, axis="y", alpha=0.3)
    C.save_figure(fig, out / "train.png")
