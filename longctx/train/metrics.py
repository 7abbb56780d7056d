"""Metrics sinks: JSONL, TensorBoard event files, a PNG loss plot, and the printed log line.

A train record holds loss, bits_per_token, grad_norm, lr (of the last update) and, measured after
the compiling step, tokens_per_sec and step_time (seconds per optimizer step); a valid record the
periodic evaluation's loss and bits_per_token."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


class MetricsWriter:
    def __init__(self, workdir: Path, *, resume_step: int = 0, tensorboard: bool = True, enabled: bool = True):
        """``enabled=False`` (every process but 0 of a multi-host job): write nothing."""
        self.enabled = enabled
        self.path = Path(workdir) / "metrics.jsonl"
        self.file, self.tb = None, None
        if not enabled:
            return
        if self.path.exists():  # drop records past the resumed step, so the curve stays one run
            keep = [line for line in self.path.read_text().splitlines() if (_parse(line) or {}).get("step", 1e18) <= resume_step]
            # written aside and renamed, so a kill (or a full disk) during the rewrite keeps the history
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, self.path)
        self.file = open(self.path, "a")
        self.tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(str(Path(workdir) / "tb"))
            except Exception:  # noqa: BLE001 -- a broken optional install (e.g. torch) must not stop training
                self.tb = None

    def write(self, step: int, split: str, values: dict) -> None:
        if not self.enabled:
            return
        rec = {"step": int(step), "split": split, **{k: float(v) for k, v in values.items()}}
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in values.items():
                if math.isfinite(float(v)):
                    self.tb.add_scalar(f"{split}/{k}", float(v), step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def _parse(line: str) -> dict | None:
    """One record, or None for a line cut short (a kill or a full disk while it was written)."""
    try:
        return json.loads(line) if line else None
    except json.JSONDecodeError:
        return None


def read_metrics(workdir: Path) -> list[dict]:
    path = Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [rec for rec in map(_parse, path.read_text().splitlines()) if rec is not None]


def plot_losses(workdir: Path, *, key: str = "bits_per_token") -> Path | None:
    """Train and valid curves of ``key`` against step, saved as loss.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(workdir)
    if not recs:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for split, style in (("train", "-"), ("valid", "o-")):
        pts = [(r["step"], r[key]) for r in recs if r["split"] == split and key in r]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, style, label=split, markersize=4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(key.replace("_", " "))
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(workdir) / "loss.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def log_line(step: int, total: int, rec: dict) -> str:
    """One printed line of a train record (``--noprogress``): step, loss, learning rate, speed."""
    parts = [f"step {step}/{total}", f"loss {rec['loss']:.4f} ({rec['bits_per_token']:.4f} bits/token)",
             f"lr {rec['lr']:.3g}"]
    if "tokens_per_sec" in rec:
        parts += [f"{rec['tokens_per_sec']:,.0f} tokens/s", f"{rec['step_time']:.3f} s/step"]
    return "  ".join(parts)
