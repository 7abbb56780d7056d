"""SIGTERM mid-run writes a checkpoint; rerunning resumes and reproduces the
losses of an uninterrupted run exactly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import tiny_config


def write_cfg(path: Path, cfg) -> Path:
    path.write_text(
        "import ml_collections\n"
        f"def get_config():\n    return ml_collections.ConfigDict({cfg.to_dict()!r})\n"
    )
    return path


def run(cfg_file, workdir, *extra, wait=True):
    cmd = [sys.executable, "-c", "from longctx.cli import train_main; train_main()", f"--config={cfg_file}",
           f"--workdir={workdir}", "--progress=false", *extra]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def train_losses(workdir):
    recs = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r["split"] == "train"}


def test_sigterm_then_resume_matches_uninterrupted(tiny_corpus, tmp_path):
    steps = 60
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=steps, ckpt_every=1000, eval_every=1000)
    cfg_file = write_cfg(tmp_path / "cfg.py", cfg)

    ref = run(cfg_file, tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_losses = train_losses(tmp_path / "ref")
    assert sorted(ref_losses) == list(range(1, steps + 1))

    proc = run(cfg_file, tmp_path / "run", wait=False)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 10:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "checkpoint saved" in out
    stopped_at = max(train_losses(tmp_path / "run"))
    assert 10 <= stopped_at < steps, stopped_at
    assert (tmp_path / "run" / "checkpoints" / str(stopped_at)).exists()

    again = run(cfg_file, tmp_path / "run")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from the checkpoint at step {stopped_at}" in again.stdout
    resumed = train_losses(tmp_path / "run")
    assert sorted(resumed) == list(range(1, steps + 1))
    after = [s for s in range(stopped_at + 1, steps + 1)]
    np.testing.assert_allclose([resumed[s] for s in after], [ref_losses[s] for s in after], rtol=1e-6)


@pytest.mark.slow
def test_nonfinite_loss_stops_with_the_step(tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=8, lr=1e30, warmup_steps=0, grad_clip=0.0)
    r = run(write_cfg(tmp_path / "cfg.py", cfg), tmp_path / "w")
    assert r.returncode == 2
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and "non-finite values at step" in line[0], r.stderr[-2000:]


def test_a_signal_during_validation_stops_it_with_the_checkpoint_saved(tiny_corpus, tmp_path, monkeypatch):
    """A signal that arrives during a validation stops it at the next forward call (a long validation no longer
    holds the stop back); the step's checkpoint was written before the validation began, so the stop loses nothing
    and records no partial validation; rerunning finishes the run and says its last validation."""
    from longctx.train import tasks
    from longctx.train.loop import train

    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=4, eval_every=2, ckpt_every=2)
    cfg.eval.row_len, cfg.eval.window, cfg.train.eval_tokens = -1, 16, 4096  # streams of several windows
    real = tasks.LanguageModel.evaluate
    calls = []

    def evaluate(self, state, stop=None):
        calls.append(stop)
        os.kill(os.getpid(), signal.SIGINT)  # the StopFlag's handler sets the flag; the validation sees it
        return real(self, state, stop=stop)

    monkeypatch.setattr(tasks.LanguageModel, "evaluate", evaluate)
    work = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train(cfg, work, progress=False)
    assert e.value.code == 128 + signal.SIGINT and len(calls) == 1 and calls[0] is not None
    assert sorted(int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit()) == [2]
    recs = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in recs if r["split"] == "valid"]

    monkeypatch.undo()
    summary = train(cfg, work, progress=False)  # resumes at step 2, validates, finishes
    assert summary["step"] == 4 and summary["last_valid_bits_per_token"] is not None
    again = train(cfg, work, progress=False)  # nothing left to train: the run's last validation, not None
    assert again["last_valid_bits_per_token"] == summary["last_valid_bits_per_token"]


def test_a_resume_may_change_how_rows_are_packed_and_says_so():
    """``data.packing`` may change on resume (attention transfer trains on rows inside one document, the
    fine-tuning after it packs them; an import saves 'auto' before any corpus is read): the note names a change
    between two resolved rules, not the resolution of 'auto'; any other data key is still refused."""
    from longctx.config import base_config, validate
    from longctx.train.loop import check_resume_config, resume_changes

    cfg = validate(base_config())
    cfg.data.packing = "segments"
    saved = json.loads(cfg.to_json())
    for was, note in (("auto", None), ("segments", None), ("document", "data.packing 'document' -> 'segments'")):
        saved["data"]["packing"] = was
        check_resume_config(saved, cfg)
        line = resume_changes(saved, cfg, 10)
        assert (line is None) if note is None else (note in line), (was, line)
    saved["data"]["tokenizer"] = "words"
    with pytest.raises(Exception, match="different data config"):
        check_resume_config(saved, cfg)


def test_lowering_train_steps_below_the_checkpoint_is_refused_before_anything_is_written(tiny_corpus, tmp_path):
    """A finished run of 8 steps rerun with train.steps=4: one line, the saved config unchanged; the same config
    reruns (done) and a larger train.steps continues."""
    from longctx.errors import ConfigError
    from longctx.train.loop import train

    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=8, eval_every=100, ckpt_every=8)
    train(cfg, tmp_path / "run", progress=False)
    before = (tmp_path / "run" / "config.json").read_text()
    fewer = tiny_config(tiny_corpus, tmp_path / "cache", steps=4, eval_every=100, ckpt_every=8)
    with pytest.raises(ConfigError, match=r"at step 8, past train.steps=4 \(it trained for 8\): raise train.steps"):
        train(fewer, tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "config.json").read_text() == before
    train(cfg, tmp_path / "run", progress=False)
