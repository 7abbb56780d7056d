"""A real multi-process job on this machine: 2 ``longctx-train`` processes x 4 simulated CPU devices,
joined by JAX's distributed runtime on 127.0.0.1 (``longctx.train.launch_local``, which
``scripts/multiprocess_local.sh`` wraps), one (data 2, fsdp 4) mesh over the 8 devices. It trains
what a single process with 8 devices trains: the same loss history and the same final parameters
and optimizer state (read back in this single process through the eval/sample restore path).
Only process 0 writes metrics, TensorBoard and plots; each process reads its half of every batch.

The slow test kills one process (SIGKILL) mid-run: the other stops by itself within the heartbeat
timeout with the runtime's line saying another task died, and the same launch resumes from the last
committed checkpoint and ends where the uninterrupted single-process run ends. The time from the
kill to the other process's exit is printed (run with ``-s``). Another slow test kills one process
while a checkpoint save is in progress (its part written into orbax's temporary folder, not yet
committed): the partial folder is never taken for a checkpoint, and the relaunch resumes from the
previous one, removes the partial one and ends where the uninterrupted run ends.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from longctx.train import launch_local
from tests.conftest import tiny_config, write_corpus, xla_flags
from tests.train.test_resume import write_cfg

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT = 3


def _config(root: Path, steps: int, ckpt_every: int) -> Path:
    corpus = root / "corpus"
    if not corpus.exists():
        write_corpus(corpus)
    c = tiny_config(corpus, root / "cache", batch_size=8, steps=steps, ckpt_every=ckpt_every, eval_every=steps)
    c.mesh.data, c.mesh.fsdp = 2, 4
    return write_cfg(root / f"cfg_{steps}.py", c)


def _base_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "LONGCTX_DIST", "SLURM_", "TPU_"))}
    return {**env, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "LONGCTX_DISTRIBUTED": "",
            "JAX_COMPILATION_CACHE_DIR": "none"}


def _args(cfg: Path, wd: Path) -> list[str]:
    return [f"--config={cfg}", f"--workdir={wd}", "--progress=false", "--config.train.compilation_cache_dir=none"]


def _single_start(cfg: Path, wd: Path) -> subprocess.Popen:
    """The single-process 8-device run of ``cfg`` (the reference), started."""
    # the suite's XLA flags, as launch_local keeps them for the job's processes
    env = {**_base_env(), "XLA_FLAGS": xla_flags(8)}
    return subprocess.Popen([sys.executable, "-c", launch_local.TRAIN, *_args(cfg, wd)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _single(cfg: Path, wd: Path) -> None:
    proc = _single_start(cfg, wd)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]


def _launch(cfg: Path, wd: Path, logdir: Path, *, code: str = launch_local.TRAIN, env=None) -> list[subprocess.Popen]:
    return launch_local.start(2, _args(cfg, wd), devices=4, logdir=logdir, base_env={**_base_env(), **(env or {})},
                              heartbeat=HEARTBEAT, init_timeout=60, cwd=ROOT, code=code)


def _run(cfg: Path, wd: Path, logdir: Path) -> None:
    procs = _launch(cfg, wd, logdir)
    status = launch_local.supervise(procs, grace=HEARTBEAT + 10, timeout=300)
    logs = "\n".join((logdir / f"process_{i}.log").read_text()[-2000:] for i in range(2))
    assert status == 0, logs


def _records(wd: Path) -> list[dict]:
    return [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]


def _restore_final(wd: Path):
    """Final params, non-gradient state and optimizer state, read back in this (single) process."""
    from longctx.runtime import Runner
    from longctx.train import checkpoint
    from longctx.train.optim import make_optimizer

    runner = Runner.from_workdir(wd)
    opt_target = jax.eval_shape(make_optimizer(runner.cfg.train).init, runner.params[0])
    tree, _ = checkpoint.restore(checkpoint.manager(wd, create=False), {"opt_state": opt_target},
                                 step=runner.step, partial=True)
    return runner.step, jax.tree.leaves((runner.params[:2], tree["opt_state"]))


def _same_run(ref: Path, run: Path, steps: int, *, atol: float = 1e-6) -> None:
    step_ref, leaves_ref = _restore_final(ref)
    step_run, leaves_run = _restore_final(run)
    assert step_ref == step_run == steps
    assert len(leaves_ref) == len(leaves_run) > 0
    for a, b in zip(leaves_ref, leaves_run, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=atol)
    for split in ("train", "valid"):
        r = {x["step"]: x["loss"] for x in _records(ref) if x["split"] == split}
        g = [(x["step"], x["loss"]) for x in _records(run) if x["split"] == split]
        assert [s for s, _ in g] == sorted(r), split  # each step once
        np.testing.assert_allclose([v for _, v in g], [r[s] for s, _ in g], rtol=1e-5)


def _trained_past(wd: Path, step: int) -> bool:
    """Whether the job has logged a training step after ``step``."""
    return (wd / "metrics.jsonl").exists() and any(r["step"] > step and r["split"] == "train" for r in _records(wd))


def _wait_for(procs, ready, what: str, limit: float = 240) -> None:
    """Wait until ``ready()``; fail if the job ends or ``limit`` seconds pass first (``what``: the event that
    follows)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if ready():
            return
        assert all(p.poll() is None for p in procs), f"the job ended before {what}"
        time.sleep(0.05)
    pytest.fail(f"the job did not reach {what}")


def _only_primary_wrote(wd: Path, logdir: Path) -> None:
    assert len(list((wd / "tb").glob("events.out.tfevents.*"))) >= 1
    assert (wd / "loss.png").exists() and (wd / "config.json").exists()
    log1 = (logdir / "process_1.log").read_text()
    assert not re.search(r"^step \d+/", log1, re.M)  # process 1 prints no log records


def test_two_processes_train_what_one_process_trains(tmp_path):
    steps = 4
    cfg = _config(tmp_path, steps=steps, ckpt_every=2)
    ref = _single_start(cfg, tmp_path / "ref")  # the reference runs beside the job
    try:
        _run(cfg, tmp_path / "run", tmp_path / "logs")
    finally:
        _, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err[-3000:]
    _same_run(tmp_path / "ref", tmp_path / "run", steps)
    _only_primary_wrote(tmp_path / "run", tmp_path / "logs")
    assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]


@pytest.mark.slow
def test_a_killed_process_stops_the_job_and_the_relaunch_resumes(tmp_path):
    steps, every = 12, 4
    cfg = _config(tmp_path, steps=steps, ckpt_every=every)
    _single(cfg, tmp_path / "ref")
    wd = tmp_path / "run"
    procs = _launch(cfg, wd, tmp_path / "logs1")
    try:
        _wait_for(procs, lambda: (wd / "checkpoints" / str(every)).is_dir() and _trained_past(wd, every + 1),
                  "the kill")  # the checkpoint at `every` committed and a step past it logged
        procs[1].send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        while procs[0].poll() is None and time.monotonic() - t_kill < 60:
            time.sleep(0.02)
        waited = time.monotonic() - t_kill
    finally:
        launch_local.stop(procs, grace=0)
    assert procs[0].returncode not in (None, 0)
    log0 = (tmp_path / "logs1" / "process_0.log").read_text()
    line = next(x for x in log0.splitlines() if "Terminating process" in x or "another task died" in x)
    print(f"\nkill of process 1 -> process 0 exited (status {procs[0].returncode}) after {waited:.2f} s "
          f"(heartbeat timeout {HEARTBEAT} s): {line[:400]}")
    assert waited < HEARTBEAT + 20
    assert "another task died" in line
    done = max(r["step"] for r in _records(wd) if r["split"] == "train")
    assert every < done < steps
    _run(cfg, wd, tmp_path / "logs2")
    log0 = (tmp_path / "logs2" / "process_0.log").read_text()
    resumed = int(log0.split("resuming from the checkpoint at step ")[1].split()[0])
    assert resumed >= every and resumed % every == 0
    _same_run(tmp_path / "ref", wd, steps)
    _only_primary_wrote(wd, tmp_path / "logs2")


def test_a_signal_to_one_process_stops_every_process_at_the_same_step_with_the_checkpoint(tmp_path):
    """SIGTERM to process 0 only (a preemption notice reaches the processes at different steps): every process
    stops after the same step (``loop.agreed_signal``) and the job's checkpoint of it is saved; a process that
    stopped alone would wait in the save's collectives while the other trained on."""
    steps = 400
    cfg = _config(tmp_path, steps=steps, ckpt_every=steps)
    wd = tmp_path / "run"
    procs = _launch(cfg, wd, tmp_path / "logs1")
    try:
        _wait_for(procs, lambda: _trained_past(wd, 1), "the signal")  # a few steps trained and logged
        procs[0].send_signal(signal.SIGTERM)
        t_sig = time.monotonic()
        while any(p.poll() is None for p in procs) and time.monotonic() - t_sig < 90:
            time.sleep(0.05)
    finally:
        launch_local.stop(procs, grace=0)
    logs = [(tmp_path / "logs1" / f"process_{i}.log").read_text() for i in range(2)]
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, [x[-1500:] for x in logs]
    stopped = [int(re.search(r"stopped by signal 15 at step (\d+)", x).group(1)) for x in logs]
    assert stopped[0] == stopped[1] < steps
    assert (wd / "checkpoints" / str(stopped[0])).is_dir()


# longctx-train with a test-only pause: process 1 stops inside the save of checkpoint HANG_AT_STEP after
# writing its part into orbax's temporary directory, before the barrier after which process 0 commits
# it by renaming that directory to <step>, and writes HANG_MARKER; the test then kills it. Only the
# orbax barrier function is wrapped, in this command; the trainer is the production one.
HANG_TRAIN = """
import os, sys, time
from pathlib import Path
from orbax.checkpoint._src.multihost import multihost
from longctx.train import checkpoint
from longctx.cli import train_main

at, marker = int(os.environ["HANG_AT_STEP"]), Path(os.environ["HANG_MARKER"])
saving = []
_save, _sync = checkpoint.save, multihost.sync_global_processes

def save(mngr, step, *args, **kwargs):
    saving.append(step)
    return _save(mngr, step, *args, **kwargs)

def sync(name, *args, **kwargs):
    if os.environ["JAX_PROCESS_ID"] == "1" and saving[-1:] == [at] and name.endswith("Checkpointer:save"):
        marker.write_text(name)
        time.sleep(600)
    return _sync(name, *args, **kwargs)

checkpoint.save, multihost.sync_global_processes = save, sync
sys.exit(train_main())
"""


def _listing(wd: Path) -> dict[str, list[str]]:
    """Each entry of the checkpoints folder: its files (relative paths)."""
    root = wd / "checkpoints"
    return {d.name: sorted(str(f.relative_to(d)) for f in d.rglob("*") if f.is_file())
            for d in sorted(root.iterdir()) if d.is_dir()}


@pytest.mark.slow
def test_a_process_killed_during_a_checkpoint_save_leaves_the_previous_one(tmp_path):
    steps, every = 8, 4
    cfg = _config(tmp_path, steps=steps, ckpt_every=every)
    ref = _single_start(cfg, tmp_path / "ref")  # the reference runs beside the job
    wd, marker = tmp_path / "run", tmp_path / "hanging"
    procs = _launch(cfg, wd, tmp_path / "logs1", code=HANG_TRAIN,
                    env={"HANG_AT_STEP": str(2 * every), "HANG_MARKER": str(marker)})
    try:
        t0 = time.monotonic()
        while not marker.exists():
            assert all(p.poll() is None for p in procs), "the job ended before the save of step 8"
            assert time.monotonic() - t0 < 240, "the job did not reach the save of step 8"
            time.sleep(0.05)
        during = _listing(wd)
        procs[1].send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        while procs[0].poll() is None and time.monotonic() - t_kill < 60:
            time.sleep(0.02)
    finally:
        launch_local.stop(procs, grace=0)
    assert procs[0].returncode not in (None, 0)
    after = _listing(wd)
    partial = [name for name in after if name.startswith(f"{2 * every}.orbax-checkpoint-tmp")]
    print(f"\ncheckpoints while process 1 was paused in the save of step {2 * every}: "
          f"{ {k: len(v) for k, v in during.items()} } (files per folder); after the kill: "
          f"{ {k: len(v) for k, v in after.items()} }; process 0 exited with status {procs[0].returncode}; "
          f"files only in the partial one: {sorted(set(after[partial[0]]) - set(after[str(every)]))}, "
          f"only in the committed one: {sorted(set(after[str(every)]) - set(after[partial[0]]))}")
    assert str(every) in after and str(2 * every) not in after, after  # never committed
    assert len(partial) == 1 and after[partial[0]], after  # the partial write is there, uncommitted
    assert after[str(every)] == during[str(every)]  # the committed one untouched
    _run(cfg, wd, tmp_path / "logs2")
    log0 = (tmp_path / "logs2" / "process_0.log").read_text()
    assert f"resuming from the checkpoint at step {every} " in log0, log0[-2000:]
    assert not any(".orbax-checkpoint-tmp" in name for name in _listing(wd))  # removed on reopening
    _, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err[-3000:]
    _same_run(tmp_path / "ref", wd, steps)
    _only_primary_wrote(wd, tmp_path / "logs2")



def _launch_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        launch_local.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    (line,) = err.splitlines()  # one line, as every longctx command answers a bad command line
    assert line.startswith("error: launch_local: "), line
    return line


def test_launcher_flags_are_absl_flags_with_one_line_errors(capsys):
    """The launcher's command line (absl flags like every longctx command): its own flags before ``--``,
    longctx-train's after it (without ``--``, the flags it does not define); ``--help``; each bad value one line."""
    a, train = launch_local.parse_args(["2", "--devices", "4", "--logdir=L", "--grace=3", "--", "--config=c",
                                        "--workdir", "w"])
    assert (a.num_processes, a.devices, a.logdir, a.grace, a.heartbeat, a.timeout) == (2, 4, "L", 3.0, 5, None)
    assert train == ["--config=c", "--workdir", "w"]
    a, train = launch_local.parse_args(["2", "--devices=4", "--config=c", "--workdir=w", "--timeout=60"])
    assert (a.devices, a.timeout, train) == (4, 60.0, ["--config=c", "--workdir=w"])
    with pytest.raises(SystemExit) as e:
        launch_local.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(f"--{n}" in out for n in ("devices", "logdir", "grace", "heartbeat", "timeout"))
    for argv, expect in (([], r"N is required"), (["x", "--", "--workdir=w"], r"N='x' must be"),
                         (["0"], r"N=0 must be a positive"), (["2", "--devices=0"], r"--devices=0 must be"),
                         (["2", "--devices=abc"], r"--devices=abc"), (["2", "--grace=-1"], r"--grace=-1.0 must be"),
                         (["2", "--heartbeat=0"], r"--heartbeat=0 must"), (["2", "--timeout=0"], r"--timeout=0.0 must"),
                         (["2", "--stepz=3", "--", "--workdir=w"], r"unknown flag --stepz; allowed: --devices"),
                         (["2", "3", "--", "--workdir=w"], r"unexpected argument '3' before --")):
        assert re.search(expect, _launch_error(argv, capsys)), argv
