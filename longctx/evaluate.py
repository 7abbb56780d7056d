"""``longctx-eval``: score a trained run on a split under the protocol of its config
(:mod:`longctx.protocols`), print the result and write JSON and a loss-versus-position plot
to ``WORKDIR/eval/``.

    longctx-eval --workdir runs/vq --split test --config.eval.protocol=sliding --config.eval.context=512
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from longctx import attention
from longctx import config as config_lib
from longctx.data import masking, sources
from longctx.errors import ConfigError, LongctxError, WorkdirError
from longctx.protocols import byte_lengths, score_mlm_split, score_split
from longctx.runtime import WINDOW_SWAP, Runner

LN2 = math.log(2.0)


def evaluate_split(runner, data, ecfg, *, progress=True, desc="eval", compressors=False,
                   row_bytes: int = 0) -> tuple[dict, tuple]:
    """Evaluate ``runner`` (a :class:`longctx.runtime.Runner`) on a prepared split: (result, (loss sum, token
    count, bytes or None) per position in the context). An encoder is scored on masked tokens under one fixed,
    seeded masking of the split (loss, accuracy). ``row_bytes`` > 0: a decoder's state is reset at each document
    start and every ``row_bytes`` bytes (:func:`longctx.protocols.byte_cut_jobs`)."""
    if runner.is_encoder:
        cfg = runner.cfg
        res, (sums, counts) = score_mlm_split(
            runner.forward, runner.params, data, ecfg, cfg.mlm, context=ecfg.context, mask_id=cfg.mlm.mask_id,
            replacement=masking.replacement_vocab(runner.tokenizer), one_token_per_byte=runner.tokenizer_is_bytes,
            progress=progress, desc=desc)
        return res, (sums, counts, None)
    return score_split(runner.forward, runner.params, data, ecfg, init_state=runner.init_state,
                       one_token_per_byte=runner.tokenizer_is_bytes, tokenizer=getattr(runner, "tokenizer", None),
                       word_count=runner.word_count(data), progress=progress, desc=desc, compressors=compressors,
                       row_bytes=row_bytes)


def evaluate_run(workdir, *, split: str | None = None, step: int | None = None, overrides: dict | None = None,
                 progress: bool = True) -> dict:
    """Restore ``workdir``'s newest valid checkpoint (or ``step``), score ``split`` (default:
    ``eval.split``), print the result and write ``eval/<split>_step<N>_<protocol>.json`` and its plot (see
    :func:`protocol_tag`)."""

    overrides = config_lib.one_budget(overrides)
    if split is not None:
        overrides["eval.split"] = split
    runner = Runner.from_workdir(workdir, step=step, overrides=overrides)

    if sources.is_generated(runner.cfg.data.source):
        raise ConfigError(f"this run was trained on the generated recall task {runner.cfg.data.source!r}, which has "
                          f"no text split to score; use longctx-recall --workdir {workdir}")
    ecfg = runner.cfg.eval
    split = ecfg.split
    data = runner.load_split(split, progress=progress)
    res, (sums, counts, nbytes) = evaluate_split(runner, data, ecfg, progress=progress, desc=f"eval {split}",
                                                 compressors=True)
    res.update({"split": split, "step": runner.step, "workdir": str(workdir),
                "by_position": position_bins(sums, counts, byte_counts=nbytes),
                "position_unit": position_unit(runner, ecfg)})
    if "word_perplexity" in res:  # where the word count comes from: the dataset's official one, or a diagnostic
        kind = data.manifest.get("source", {}).get("word_counts_kind")
        res["word_count_kind"] = kind.get(split) if isinstance(kind, dict) else kind
    print(format_eval(res), flush=True)  # the result first: a failed write below cannot lose it
    out_dir = Path(workdir) / "eval"
    stem = f"{split}_step{int(runner.step)}_{protocol_tag(runner.cfg)}"  # another protocol never overwrites it
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out_dir / f"{stem}.json", res)
        plot_position_curve(res["by_position"], out_dir / f"{stem}_loss_vs_position.png",
                            title=f"{split}, step {runner.step}", unit=res["position_unit"])
    except OSError as e:
        raise WorkdirError(f"the result above could not be written to {out_dir} ({e.strerror or e}); "
                           "free space or fix the folder and run again") from None
    print(f"wrote {out_dir / (stem + '.json')} and {stem}_loss_vs_position.png")
    return res


def protocol_tag(cfg) -> str:
    """The evaluation protocol of a resolved config in a file name: ``sliding-c512-s128``,
    ``stream-w256-document256``, ``masked-c256-bert``, with ``-n<max_tokens>`` / ``-b<max_bytes>`` when the split
    is cut short (and a sliding window's reset when it is not per document)."""
    e = cfg.eval
    if cfg.model.kind == "encoder":
        tag = f"masked-c{e.context}-{cfg.mlm.masking}"
    elif e.protocol == "sliding":
        tag = f"sliding-c{e.context}-s{e.stride}" + ("" if e.reset == "document" else f"-{e.reset}")
    else:
        tag = f"stream-w{e.window}-{e.reset}" + (f"{e.row_len}" if e.reset != "never" and e.row_len > 0 else "")
    return tag + (f"-n{e.max_tokens}" if e.max_tokens else "") + (f"-b{e.max_bytes}" if e.max_bytes else "")


def write_json_atomic(path: Path, obj) -> None:
    """Write ``obj`` as JSON to a temporary file next to ``path``, then rename it over ``path``:
    ``path`` holds either the old content or the whole new one, never a part."""
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def format_eval(res: dict) -> str:
    p = res["protocol"]
    what = res.get("scored", "tokens")
    how = ", ".join(f"{k} {v}" for k, v in p.items() if k != "mode")
    lines = [f"{res.get('split', '?')} @ step {res.get('step', '?')}: {res['tokens_scored']:,} {what} scored, "
             f"{p.get('mode', '?')} ({how})"]
    if "bits_per_byte" in res:
        lines.append(f"  bits per {'masked ' if what == 'masked tokens' else ''}byte   {res['bits_per_byte']:.4f}")
    lines.append(f"  bits per token  {res['bits_per_token']:.4f}   token perplexity {res['token_perplexity']:.3f}")
    if "accuracy" in res:
        lines.append(f"  accuracy        {res['accuracy']:.4f}  (argmax at the masked positions)")
    if "word_perplexity" in res:
        kind = res.get("word_count_kind") or ""
        lines.append(f"  word perplexity {res['word_perplexity']:.3f}  ({res['word_count']:,} words, "
                     f"{res['tokens_per_word']:.3f} tokens/word"
                     + ("" if not kind or kind.startswith("official") else f"; word count: {kind}") + ")")
    if "bytes_in_split" in res:
        lines.append(f"  bytes scored    {res['bytes_scored']:,} of {res['bytes_in_split']:,} (not scored: the "
                     f"{res['bytes_in_split'] - res['bytes_scored']:,} bytes of each document's first token)")
    elif "bytes_scored" in res:
        lines.append(f"  bytes scored    {res['bytes_scored']:,}: {res.get('budget', 'part of the split')}")
    for name, bpb in res.get("compressors_bits_per_byte", {}).items():
        lines.append(f"  {name:<8} {bpb:.4f} bits per byte on the same bytes")
    return "\n".join(lines)


def position_bins(sums: np.ndarray, counts: np.ndarray, n_bins: int = 24, *,
                  byte_counts: np.ndarray | None = None) -> list[dict]:
    """Loss by position in the context (positions from 1) in about ``n_bins`` log-spaced bins, each with its
    scored tokens: ``[{"lo", "hi" (inclusive), "tokens", "bits_per_token"}]``; empty bins are left out. With
    ``byte_counts`` (the bytes scored at each position: a lossless tokenizer's) each bin also has ``bytes`` and
    ``bits_per_byte``."""
    n = len(sums)
    edges = np.unique(np.geomspace(1, n + 1, n_bins + 1).astype(int))
    edges[0], edges[-1] = 1, n + 1
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        c = int(counts[lo - 1 : hi - 1].sum())
        if c:
            s = float(sums[lo - 1 : hi - 1].sum())
            out.append({"lo": int(lo), "hi": int(hi - 1), "tokens": c, "bits_per_token": s / c / LN2})
            if byte_counts is not None:
                nb = int(byte_counts[lo - 1 : hi - 1].sum())
                out[-1].update({"bytes": nb, "bits_per_byte": s / max(nb, 1) / LN2})
    return out


def position_unit(runner, ecfg) -> str:
    """What a position counts: tokens, or bytes for a lossless tokenizer other than bytes (score_split), and
    from where: the file's start for the stream protocol with no reset inside a document."""
    lossless = byte_lengths(runner.tokenizer) is not None
    unit = "bytes" if lossless or runner.tokenizer_is_bytes else "tokens"
    in_file = (not runner.is_encoder and ecfg.protocol == "stream" and ecfg.reset == "document"
               and ecfg.row_len < 0)
    return f"{unit} from the {'file' if in_file else 'context'}'s start"


def plot_position_curve(bins: list[dict], path: Path, *, title: str, unit: str = "tokens") -> None:
    """Mean loss per log-spaced position bin (each bin a horizontal segment over its positions) above the tokens
    each bin scored; bits per byte where the bins have them."""
    plot_position_curves({"": bins}, path, title=title, unit=unit)


def plot_position_curves(curves: dict, path: Path, *, title: str, unit: str = "tokens") -> None:
    """:func:`plot_position_curve` for several runs on one figure: ``{label: bins}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_byte = all("bits_per_byte" in b for bins in curves.values() for b in bins)
    what = "bits_per_byte" if per_byte else "bits_per_token"
    fig, (ax, ax_n) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, gridspec_kw={"height_ratios": (3, 1)})
    for i, (label, bins) in enumerate(curves.items()):
        lo, hi = np.array([b["lo"] for b in bins]), np.array([b["hi"] for b in bins]) + 1
        ys = [b[what] for b in bins]
        ax.hlines(ys, lo, hi, lw=2, color=f"C{i}", label=label or None)
        ax.plot(np.sqrt(lo * hi), ys, ".", color=f"C{i}")
        if len(curves) == 1:
            ax_n.bar(lo, [b["tokens"] for b in bins], width=hi - lo, align="edge", color="C7")
        else:
            ax_n.step(lo, [b["tokens"] for b in bins], where="post", color=f"C{i}")
    ax.set_ylabel(f"mean loss ({what.replace('_', ' ')})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend(fontsize=8)
    ax_n.set_xscale("log")
    ax_n.set_ylabel("tokens scored")
    ax_n.set_xlabel(f"position ({unit}; log-spaced bins)")
    ax_n.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)



# ----------------------------------------------------------------------------------------------
# the context evidence: carried state against resets every N bytes, and loss by position in the file

CONTEXT_RESETS = (256, 1024, 4096)  # bytes


def context_table(workdir, *, split: str = "test", resets=CONTEXT_RESETS, step: int | None = None,
                  overrides: dict | None = None, progress: bool = True, as_method: str | None = None) -> dict:
    """Score ``split`` of a decoder run with the state carried across each file (the stream protocol,
    ``eval.reset='document'``, ``eval.row_len=-1``) and with it reset every N bytes inside each file for N in
    ``resets`` (:func:`longctx.protocols.byte_cut_jobs`: exact byte cuts, so a BPE run and a byte run reset at
    the same bytes); the carried scoring's loss by position in the file (bytes) comes with it. Needs a lossless
    tokenizer (bits per byte). Writes ``eval/<split>_step<N>_context.json``, a markdown table beside it and the
    position plot; returns the result. ``as_method``: score a dense run over its sliding window or a sliding-window
    run with every key (``dense`` / ``swa``: the same parameters; ``..._context_as_<method>.json``)."""
    over = {**config_lib.one_budget(overrides), "eval.split": split, "eval.protocol": "stream", "eval.reset": "document",
            "eval.row_len": -1, **({"model.attention.name": as_method} if as_method else {})}
    runner = Runner.from_workdir(workdir, step=step, overrides=over)
    if runner.is_encoder or sources.is_generated(runner.cfg.data.source):
        raise ConfigError(f"{workdir}: the context table scores a decoder on a text split; this run is "
                          f"{'an encoder' if runner.is_encoder else 'a generated recall task'}")
    ecfg = runner.cfg.eval
    data = runner.load_split(split, progress=progress)
    if byte_lengths(runner.tokenizer) is None:
        raise ConfigError(f"{workdir}: data.tokenizer={runner.cfg.data.tokenizer!r} does not keep bytes, so it has no "
                          "bits per byte and no reset every N bytes; use bytes or bpe")
    carried, (sums, counts, nbytes) = evaluate_split(runner, data, ecfg, progress=progress, desc=f"{split} carried",
                                                     compressors=True)
    rows = [{"reset": "never inside a file", "row_bytes": None, **_row(carried)}]
    for n in resets:
        res, _ = evaluate_split(runner, data, ecfg, progress=progress, desc=f"{split} reset {n}", row_bytes=int(n))
        rows.append({"reset": f"every {n} bytes", "row_bytes": int(n), **_row(res)})
    att = runner.cfg.model.attention
    method = ",".join(att.pattern) if att.pattern else att.name
    for name in dict.fromkeys(method.split(",")):
        if attention.get_class(name).sliding_window:
            method += f", window {att[name].window}"
    out = {"workdir": str(workdir), "label": f"{workdir} ({method})", "method": method, "split": split,
           "step": runner.step, "tokenizer": runner.cfg.data.tokenizer, "window": ecfg.window, "rows": rows, "bytes_in_split": carried.get("bytes_in_split"),
           **({"budget": carried["budget"]} if "budget" in carried else {}),
           "compressors_bits_per_byte": carried.get("compressors_bits_per_byte", {}),
           "by_position": position_bins(sums, counts, byte_counts=nbytes), "position_unit": "bytes from the file's start"}
    print(format_context([out]), flush=True)
    out_dir = Path(workdir) / "eval"
    stem = f"{split}_step{int(runner.step)}_context" + (f"_as_{as_method}" if as_method else "")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out_dir / f"{stem}.json", out)
        (out_dir / f"{stem}.md").write_text(format_context([out]) + "\n")
        plot_position_curves({"": out["by_position"]}, out_dir / f"{stem}_bpb_vs_position.png",
                             title=f"{split}, step {runner.step}: state carried across each file",
                             unit=out["position_unit"])
    except OSError as e:
        raise WorkdirError(f"the table above could not be written to {out_dir} ({e.strerror or e}); "
                           "free space or fix the folder and run again") from None
    print(f"wrote {out_dir / (stem + '.json')}, {stem}.md and {stem}_bpb_vs_position.png")
    return out


def _row(res: dict) -> dict:
    return {k: res[k] for k in ("bits_per_byte", "bits_per_token", "tokens_scored", "bytes_scored", "seconds")}


def format_context(results: list[dict]) -> str:
    """One markdown table: each run's bits per byte carried across the file and with resets, with the change
    from carried."""
    lines = ["| run | tokenizer | state | bits per byte | vs carried | bits per token | tokens scored | bytes scored |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = r["rows"][0]["bits_per_byte"]
        for row in r["rows"]:
            delta = "" if row["row_bytes"] is None else f"{row['bits_per_byte'] - base:+.4f}"
            lines.append(f"| {r.get('label', r['workdir'])}, step {r['step']} | {r['tokenizer']} | {row['reset']} | "
                         f"{row['bits_per_byte']:.4f} | {delta} | {row['bits_per_token']:.4f} | "
                         f"{row['tokens_scored']:,} | {row['bytes_scored']:,} |")
    for r in results:
        comp = ", ".join(f"{k} {v:.4f}" for k, v in r["compressors_bits_per_byte"].items())
        n, scored = r["bytes_in_split"], r["rows"][0]["bytes_scored"]
        size = (f"{n:,} bytes, {n - scored:,} not scored (each file's first token)" if n is not None
                else f"{scored:,} bytes scored, {r.get('budget', 'part of the split')}")
        lines.append(f"\n{r.get('label', r['workdir'])}: {r['split']} split, {size}; on the scored bytes: {comp}")
    return "\n".join(lines)


def context_main(argv=None) -> int:
    """``python -m longctx.evaluate --workdir A [--workdir B ...]``: :func:`context_table` for each run, then
    one table and one bits-per-byte-by-position plot of all of them (``--out``)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m longctx.evaluate", description=context_table.__doc__.split("\n\n")[0])
    p.add_argument("--workdir", action="append", required=True, help="a trained decoder run (repeat for several)")
    p.add_argument("--split", default="test", choices=("train", "valid", "test"))
    p.add_argument("--resets", default=",".join(map(str, CONTEXT_RESETS)), help="bytes between resets, comma-separated")
    p.add_argument("--max_tokens", type=int, default=0, help="score only the first N scored tokens (0: the run's budget)")
    p.add_argument("--max_bytes", type=int, default=0,
                   help="score only the tokens within the first N scored bytes, the same bytes whatever the tokenizer "
                        "(0: the run's budget)")
    p.add_argument("--out", default="", help="folder for the combined table and plot (default: the first run's eval/)")
    p.add_argument("--also_as", choices=WINDOW_SWAP, default=None,
                   help="score each dense or swa run a second time as this method (the same parameters: a dense run "
                        "over a sliding window of its trained length; a sliding-window run with every key)")
    p.add_argument("--noprogress", action="store_true")
    a = p.parse_args(argv)
    resets = tuple(int(x) for x in a.resets.split(",") if x.strip())
    over = {key: n for key, n in (("eval.max_tokens", a.max_tokens), ("eval.max_bytes", a.max_bytes)) if n}
    try:
        results = []
        for wd in a.workdir:
            results.append(context_table(wd, split=a.split, resets=resets, overrides=over, progress=not a.noprogress))
            if a.also_as:
                results.append(context_table(wd, split=a.split, resets=resets, overrides=over,
                                             progress=not a.noprogress, as_method=a.also_as))
    except LongctxError as e:  # one line, as the console scripts print it
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(results) > 1:
        out = Path(a.out or Path(a.workdir[0]) / "eval")
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{a.split}_context_compare.md").write_text(format_context(results) + "\n")
        plot_position_curves({f"{r.get('label', r['workdir'])} ({r['tokenizer']})": r["by_position"] for r in results},
                             out / f"{a.split}_context_compare_bpb_vs_position.png",
                             title=f"{a.split}: bits per byte by position in the file", unit="bytes from the file's start")
        print(format_context(results))
        print(f"wrote {out / (a.split + '_context_compare.md')} and {a.split}_context_compare_bpb_vs_position.png")
    return 0


if __name__ == "__main__":
    sys.exit(context_main())
