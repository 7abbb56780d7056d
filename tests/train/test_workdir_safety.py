"""Training that neither crashes nor collides: --noprogress with a validation before any log
line, the workdir lock (one training per workdir, stale locks taken over), and
``train.on_nonfinite=skip`` counting its skipped updates and stopping after a run of them."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from longctx import cli
from longctx.errors import NonFiniteError, WorkdirError
from longctx.train.lock import LOCK_NAME, WorkdirLock
from longctx.train.loop import SkipCounter, train
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[2]


def write_cfg(path: Path, cfg) -> Path:
    path.write_text("import ml_collections\n"
                    f"def get_config():\n    return ml_collections.ConfigDict({cfg.to_dict()!r})\n")
    return path


@pytest.mark.slow
def test_noprogress_with_a_validation_before_any_log_line(tiny_corpus, tmp_path, capsys):
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=4, warmup_steps=1, log_every=1000, eval_every=2,
                      ckpt_every=1000)
    wd = tmp_path / "w"
    assert cli.train_main(["longctx-train", f"--config={write_cfg(tmp_path / 'c.py', cfg)}", f"--workdir={wd}",
                           "--noprogress"]) == 0
    recs = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["split"] == "valid"] == [2, 4]
    assert not (wd / LOCK_NAME).exists()  # released at the end


def test_a_second_training_on_a_locked_workdir_refuses(tiny_corpus, tmp_path):
    wd = tmp_path / "w"
    wd.mkdir()
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=2, warmup_steps=1)
    with WorkdirLock(wd):  # another training holds the workdir
        with pytest.raises(WorkdirError, match=r"another training \(process \d+ on .*\) is running in"):
            train(cfg, wd, progress=False)
        assert json.loads((wd / LOCK_NAME).read_text())["pid"] == os.getpid()  # untouched
    assert not (wd / LOCK_NAME).exists()


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    warnings = []
    lock = WorkdirLock(tmp_path, warn=warnings.append).acquire()
    try:
        assert len(warnings) == 1 and "stale lock" in warnings[0] and str(pid) in warnings[0]
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_live_pid_on_this_host_is_never_taken_over(tmp_path):
    """A file system that ignores flock: the pid of a live process still holds the lock."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": live.pid, "host": socket.gethostname()}))
        with pytest.raises(WorkdirError, match=f"process {live.pid} on"):
            WorkdirLock(tmp_path).acquire()
    finally:
        live.kill()
        live.wait()


def test_workdir_that_is_a_file_is_one_line(tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=2, warmup_steps=1)
    (tmp_path / "f").write_text("x")
    with pytest.raises(WorkdirError, match="is not a folder"):
        train(cfg, tmp_path / "f", progress=False)
    with pytest.raises(WorkdirError, match="cannot create --workdir .*Not a directory"):
        train(cfg, tmp_path / "f" / "w", progress=False)


def _unwritable_root() -> Path | None:
    """A folder in which even root cannot create anything (a read-only or pseudo file system), if any."""
    for root in (Path("/sys"), Path("/proc/sys")):
        try:
            (root / "longctx_probe").mkdir()
        except OSError:
            return root
        (root / "longctx_probe").rmdir()
    return None


def test_workdir_on_a_read_only_file_system_is_one_line(tiny_corpus, tmp_path):
    """(The tests run as root, so a chmod'ed folder would still be writable: a read-only mount stands in.)"""
    root = _unwritable_root()
    if root is None:
        pytest.skip("no read-only file system to write into here")
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=2, warmup_steps=1)
    with pytest.raises(WorkdirError, match="cannot create --workdir .*choose a writable folder"):
        train(cfg, root / "longctx_w", progress=False)


def _cmd(cfg_file, wd):
    return [sys.executable, "-c", "from longctx.cli import train_main; train_main()", f"--config={cfg_file}",
            f"--workdir={wd}", "--noprogress"]


@pytest.mark.slow
def test_two_trainings_on_one_workdir(tiny_corpus, tmp_path):
    """The second refuses in one line (exit 2); the first finishes untouched."""
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=40, warmup_steps=2, eval_every=20, ckpt_every=10)
    cfg_file = write_cfg(tmp_path / "c.py", cfg)
    wd = tmp_path / "w"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen(_cmd(cfg_file, wd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 300
    while not (wd / LOCK_NAME).exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, first.communicate()
    second = subprocess.run(_cmd(cfg_file, wd), capture_output=True, text=True, env=env, timeout=300)
    out, err = first.communicate(timeout=600)
    assert second.returncode == 2, second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: another training") and "Traceback" not in second.stderr
    assert first.returncode == 0, err[-2000:]
    assert "done: step 40" in out
    recs = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["split"] == "train"] == list(range(1, 41))  # no point twice
    assert sorted(int(p.name) for p in (wd / "checkpoints").iterdir() if p.name.isdigit()) == [20, 30, 40]
    assert not (wd / LOCK_NAME).exists()


def test_skip_counter_warns_counts_and_stops_after_a_run():
    warnings = []
    c = SkipCounter(3, warn=warnings.append)
    ok, bad = np.array([True]), np.array([False])
    c.update(1, {"loss_finite": ok, "grad_finite": ok}, None)
    c.update(2, {"loss_finite": bad, "grad_finite": ok}, None)
    c.update(3, {"loss_finite": ok, "grad_finite": bad}, None)
    c.update(4, {"loss_finite": ok, "grad_finite": ok}, None)
    assert (c.total, c.in_row, len(warnings)) == (2, 0, 1)
    c.update(5, {"loss_finite": bad, "grad_finite": bad}, 4)
    c.update(6, {"loss_finite": bad, "grad_finite": bad}, 4)
    with pytest.raises(NonFiniteError, match=r"3 updates in a row .*max_skipped_in_row=3.*step 4 holds"):
        c.update(7, {"loss_finite": bad, "grad_finite": bad}, 4)
    assert len(warnings) == 2


@pytest.mark.slow
def test_skip_stops_a_run_that_skips_every_update(tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=8, warmup_steps=1, lr=1e30, on_nonfinite="skip",
                      max_skipped_in_row=3, log_every=100, eval_every=100, ckpt_every=100)
    with pytest.raises(NonFiniteError, match="in a row were non-finite and skipped"):
        train(cfg, tmp_path / "w", progress=False)
