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

from longctx.protocols import score_mlm_split, score_split

LN2 = math.log(2.0)


def evaluate_split(runner, data, ecfg, *, progress=True, desc="eval", compressors=False) -> tuple[dict, np.ndarray]:
    """Evaluate ``runner`` (a :class:`longctx.runtime.Runner`) on a prepared split. An encoder is
    scored on masked tokens under one fixed, seeded masking of the split (loss, accuracy)."""
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
    ``eval.split``), print the result and write ``eval/<split>_step<N>.json`` and its plot."""
    from longctx.runtime import Runner

    overrides = dict(overrides or {})
    if split is not None:
        overrides["eval.split"] = split
    runner = Runner.from_workdir(workdir, step=step, overrides=overrides)
    ecfg = runner.cfg.eval
    split = ecfg.split
    data = runner.load_split(split, progress=progress)
    res, curve = evaluate_split(runner, data, ecfg, progress=progress, desc=f"eval {split}", compressors=True)
    res.update({"split": split, "step": runner.step, "workdir": str(workdir)})
    out_dir = Path(workdir) / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{split}_step{runner.step}"
    (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=1))
    plot_position_curve(curve, out_dir / f"{stem}_loss_vs_position.png", title=f"{split}, step {runner.step}")
    print(format_eval(res))
    print(f"wrote {out_dir / (stem + '.json')} and {stem}_loss_vs_position.png")
    return res


def format_eval(res: dict) -> str:
    p = res["protocol"]
    what = res.get("scored", "tokens")
    lines = [f"{res.get('split', '?')} @ step {res.get('step', '?')}: {res['tokens_scored']:,} {what} scored ({p})"]
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


def plot_position_curve(curve: np.ndarray, path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(curve)
    bucket = max(1, n // 64)
    xs = np.arange(0, n - n % bucket or n, bucket)
    ys = [curve[x : x + bucket].mean() / LN2 for x in xs]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs + 1, ys, ".-")
    ax.set_xlabel("position in context (tokens)")
    ax.set_ylabel("mean loss (bits per token)")
    ax.set_xscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    from longctx import cli

    return cli.eval_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
