"""Metrics sinks: JSONL, TensorBoard event files, a PNG loss plot, and the printed log line.

A train record holds loss, bits_per_token, grad_norm, lr (of the last update) and, measured after
the compiling step, tokens_per_sec and step_time (seconds per optimizer step); a valid record the
periodic evaluation's loss and bits_per_token.

Both logs stay in step with the checkpoints: each record is written and flushed as it is made (so
everything up to a checkpoint is on disk before that checkpoint can commit), and a run resumed at
step ``s`` keeps only the records up to ``s``: ``metrics.jsonl`` is rewritten without the later ones,
and each run segment writes a new TensorBoard event file that opens with a session-start event at
step ``s + 1`` -- TensorBoard's purge mechanism (``purge_step``): on reading it, TensorBoard drops
every event of the earlier files at or after that step, so the points the killed segment logged
past its last checkpoint are shown once, as the resumed segment logs them again.
:func:`read_tensorboard` reads the scalars back that way."""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from pathlib import Path

from longctx.train import tfevents

TB_DIR = "tb"


class _EventFile:
    """One TensorBoard event file written synchronously (longctx.train.tfevents: no background queue, so a flush
    means the events are in the file)."""

    def __init__(self, logdir: Path, purge_step: int):
        logdir.mkdir(parents=True, exist_ok=True)
        # TensorBoard reads a folder's event files in name order: the time, then a sequence number
        # past every earlier segment's, so a restart within the same second still sorts after it
        seq = 1 + max((int(p.name.rsplit(".", 1)[-1]) for p in logdir.glob("events.out.tfevents.*")
                       if p.name.rsplit(".", 1)[-1].isdigit()), default=0)
        self.path = logdir / f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{seq:06d}"
        self._f = open(self.path, "ab")
        self._f.write(tfevents.frame(tfevents.encode_event(wall_time=time.time(), step=purge_step,
                                                           file_version="brain.Event:2")))
        # a session start at step s: TensorBoard drops the events of earlier runs at steps >= s
        self._f.write(tfevents.frame(tfevents.encode_event(wall_time=time.time(), step=purge_step,
                                                           session_status=tfevents.SESSION_START)))
        self._f.flush()

    def scalars(self, step: int, values: dict) -> None:
        self._f.write(tfevents.frame(tfevents.encode_event(wall_time=time.time(), step=int(step), scalars=values)))
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class MetricsWriter:
    def __init__(self, workdir: Path, *, resume_step: int = 0, tensorboard: bool = True, enabled: bool = True,
                 warn=None):
        """``enabled=False`` (every process but 0 of a multi-host job): write nothing."""
        self.enabled = enabled
        self.path = Path(workdir) / "metrics.jsonl"
        self.file, self.tb = None, None
        if not enabled:
            return
        if self.path.exists():  # drop records past the resumed step, so the curve stays one run
            lines = self.path.read_text().splitlines()
            recs = [_parse(line) for line in lines]
            keep = [line for line, rec in zip(lines, recs) if rec is not None and rec["step"] <= resume_step]
            # a line cut short at the end is a kill during a write; any other line that is not a
            # record (not JSON, or JSON but not a record object) is reported, then dropped like it
            odd = sum(rec is None and line.strip() != "" for line, rec in zip(lines[:-1], recs[:-1]))
            if odd:
                (warn or (lambda m: print(m, file=sys.stderr, flush=True)))(
                    f"warning: dropped {odd} line(s) of {self.path} that are not metrics records")
            # written aside and renamed, so a kill (or a full disk) during the rewrite keeps the history
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, self.path)
        self.file = open(self.path, "a")
        if tensorboard:
            try:
                self.tb = _EventFile(Path(workdir) / TB_DIR, purge_step=resume_step + 1)
            except OSError as e:  # e.g. WORKDIR/tb is a file: train on, with the JSONL log
                (warn or (lambda m: print(m, file=sys.stderr, flush=True)))(
                    f"warning: no TensorBoard log ({e.strerror or e} in {Path(workdir) / TB_DIR}); metrics.jsonl "
                    "has every record")
                self.tb = None

    def write(self, step: int, split: str, values: dict) -> None:
        if not self.enabled:
            return
        rec = {"step": int(step), "split": split, **{k: float(v) for k, v in values.items()}}
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.tb is not None:
            self.tb.scalars(step, {f"{split}/{k}": float(v) for k, v in values.items() if math.isfinite(float(v))})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def _parse(line: str) -> dict | None:
    """One record, or None for a line that is not one: cut short (a kill or a full disk while it was
    written), not JSON, or JSON but not a record object (an integer ``step`` and a ``split`` name)."""
    try:
        rec = json.loads(line) if line else None
    except json.JSONDecodeError:
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("split"), str):
        return None
    step = rec.get("step")
    return rec if isinstance(step, int) and not isinstance(step, bool) else None


def read_metrics(workdir: Path) -> list[dict]:
    path = Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [rec for rec in map(_parse, path.read_text().splitlines()) if rec is not None]


def read_tensorboard(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of a TensorBoard folder as TensorBoard shows them: ``{tag: [(step, value), ...]}`` in
    the order written, the event files read in name order, and a session-start event at step ``s``
    dropping every earlier event at step >= ``s`` (TensorBoard's purge of orphaned data)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(logdir).glob("*tfevents*")):
        for raw in tfevents.records(path.read_bytes()):
            ev = tfevents.decode_event(raw)
            if ev.get("session_status") == tfevents.SESSION_START:
                out = {tag: [p for p in pts if p[0] < ev["step"]] for tag, pts in out.items()}
            for tag, value in ev.get("scalars", []):
                out.setdefault(tag, []).append((int(ev["step"]), float(value)))
    return out


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
