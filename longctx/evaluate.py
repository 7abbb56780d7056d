"""``longctx-eval``: score a trained run on a split under the protocol of its config
(:mod:`longctx.protocols`), print the result and write JSON and a loss-versus-position plot
to ``WORKDIR/eval/``.

    longctx-eval --workdir runs/vq --split test --config.eval.protocol=sliding --config.eval.context=512
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from longctx.data import sources
from longctx.errors import ConfigError, WorkdirError
from longctx.protocols import score_mlm_split, score_split
from longctx.runtime import Runner

LN2 = math.log(2.0)


def evaluate_split(runner, data, ecfg, *, progress=True, desc="eval", compressors=False) -> tuple[dict, tuple]:
    """Evaluate ``runner`` (a :class:`longctx.runtime.Runner`) on a prepared split: (result, (loss sum, token
    count) per position in the context). An encoder is scored on masked tokens under one fixed, seeded masking of
    the split (loss, accuracy)."""
    if runner.is_encoder:
        cfg = runner.cfg
        return score_mlm_split(runner.forward, runner.params, data, ecfg, cfg.mlm, context=ecfg.context,
                               mask_id=cfg.mlm.mask_id, one_token_per_byte=runner.tokenizer_is_bytes,
                               progress=progress, desc=desc)
    return score_split(runner.forward, runner.params, data, ecfg, init_state=runner.init_state,
                       one_token_per_byte=runner.tokenizer_is_bytes, word_count=runner.word_count(data),
                       progress=progress, desc=desc, compressors=compressors)


def evaluate_run(workdir, *, split: str | None = None, step: int | None = None, overrides: dict | None = None,
                 progress: bool = True) -> dict:
    """Restore ``workdir``'s newest valid checkpoint (or ``step``), score ``split`` (default:
    ``eval.split``), print the result and write ``eval/<split>_step<N>_<protocol>.json`` and its plot (see
    :func:`protocol_tag`)."""

    overrides = dict(overrides or {})
    if split is not None:
        overrides["eval.split"] = split
    runner = Runner.from_workdir(workdir, step=step, overrides=overrides)

    if sources.is_generated(runner.cfg.data.source):
        raise ConfigError(f"this run was trained on the generated recall task {runner.cfg.data.source!r}, which has "
                          f"no text split to score; use longctx-recall --workdir {workdir}")
    ecfg = runner.cfg.eval
    split = ecfg.split
    data = runner.load_split(split, progress=progress)
    res, (sums, counts) = evaluate_split(runner, data, ecfg, progress=progress, desc=f"eval {split}", compressors=True)
    res.update({"split": split, "step": runner.step, "workdir": str(workdir), "by_position": position_bins(sums, counts)})
    print(format_eval(res), flush=True)  # the result first: a failed write below cannot lose it
    out_dir = Path(workdir) / "eval"
    stem = f"{split}_step{int(runner.step)}_{protocol_tag(runner.cfg)}"  # another protocol never overwrites it
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out_dir / f"{stem}.json", res)
        plot_position_curve(res["by_position"], out_dir / f"{stem}_loss_vs_position.png",
                            title=f"{split}, step {runner.step}")
    except OSError as e:
        raise WorkdirError(f"the result above could not be written to {out_dir} ({e.strerror or e}); "
                           "free space or fix the folder and run again") from None
    print(f"wrote {out_dir / (stem + '.json')} and {stem}_loss_vs_position.png")
    return res


def protocol_tag(cfg) -> str:
    """The evaluation protocol of a resolved config in a file name: ``sliding-c512-s128``,
    ``stream-w256-document256``, ``masked-c256-bert``, with ``-n<max_tokens>`` when the split is cut
    short (and a sliding window's reset when it is not per document)."""
    e = cfg.eval
    if cfg.model.kind == "encoder":
        tag = f"masked-c{e.context}-{cfg.mlm.masking}"
    elif e.protocol == "sliding":
        tag = f"sliding-c{e.context}-s{e.stride}" + ("" if e.reset == "document" else f"-{e.reset}")
    else:
        tag = f"stream-w{e.window}-{e.reset}" + (f"{e.row_len}" if e.reset != "never" and e.row_len > 0 else "")
    return tag + (f"-n{e.max_tokens}" if e.max_tokens else "")


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
        lines.append(f"  word perplexity {res['word_perplexity']:.3f}  ({res['word_count']:,} words, {res['tokens_per_word']:.3f} tokens/word)")
    for name, bpb in res.get("compressors_bits_per_byte", {}).items():
        lines.append(f"  {name:<8} {bpb:.4f} bits per byte on the same bytes")
    return "\n".join(lines)


def position_bins(sums: np.ndarray, counts: np.ndarray, n_bins: int = 24) -> list[dict]:
    """Loss by position in the context (positions from 1) in about ``n_bins`` log-spaced bins, each with its
    scored tokens: ``[{"lo", "hi" (inclusive), "tokens", "bits_per_token"}]``; empty bins are left out."""
    n = len(sums)
    edges = np.unique(np.geomspace(1, n + 1, n_bins + 1).astype(int))
    edges[0], edges[-1] = 1, n + 1
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        c = int(counts[lo - 1 : hi - 1].sum())
        if c:
            out.append({"lo": int(lo), "hi": int(hi - 1), "tokens": c,
                        "bits_per_token": float(sums[lo - 1 : hi - 1].sum()) / c / LN2})
    return out


def plot_position_curve(bins: list[dict], path: Path, *, title: str) -> None:
    """Mean loss per log-spaced position bin (each bin a horizontal segment over its positions) above the tokens
    each bin scored."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_n) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, gridspec_kw={"height_ratios": (3, 1)})
    lo, hi = np.array([b["lo"] for b in bins]), np.array([b["hi"] for b in bins]) + 1
    ys = [b["bits_per_token"] for b in bins]
    ax.hlines(ys, lo, hi, lw=2)
    ax.plot(np.sqrt(lo * hi), ys, ".", color="C0")
    ax.set_ylabel("mean loss (bits per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax_n.bar(lo, [b["tokens"] for b in bins], width=hi - lo, align="edge", color="C7")
    ax_n.set_xscale("log")
    ax_n.set_ylabel("tokens scored")
    ax_n.set_xlabel("position in context (tokens; log-spaced bins)")
    ax_n.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

