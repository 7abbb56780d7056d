"""Soak: a training run killed again and again, at random moments, ends where an uninterrupted run ends.

A driver starts ``longctx-train`` (the tiny config, async checkpoints every few steps), sends SIGKILL
or SIGTERM at seeded random moments -- some right after a checkpoint save starts (a new
``<step>.orbax-checkpoint-tmp`` folder seen in the checkpoint directory), the others a random
moment after a random step -- truncates the data files of the newest checkpoint once, and runs the
same command again after each kill until the run completes. Then:

* the final parameters, non-gradient state and optimizer state (restored through the project's
  restore path), every train and valid record of ``metrics.jsonl`` and the TensorBoard scalars (read
  back as TensorBoard shows them, its purge of the points past each resumed step applied) equal an
  uninterrupted run's, each step once;
* each restart resumes from the newest checkpoint that was committed when the process died (the
  truncated one excepted, with exactly one warning naming it), so no half-written checkpoint is
  ever used and nothing committed is lost;
* the work redone per kill (steps whose loss had been logged before the kill and were computed
  again after it) is the work since the newest committed checkpoint: at most one checkpoint
  interval, plus, when the kill cut an async save, the steps trained while that save was being
  written (at most one more interval: the next save waits for it; with ``async_checkpoints=False``
  the bound is one interval, checked by a second slow run); a SIGTERM redoes nothing (the
  run stops at a step boundary with a checkpoint there). The restart after the truncation also
  redoes the truncated checkpoint's interval.

Both are marked slow (``scripts/test.sh -m slow``): the default suite keeps the SIGTERM-and-resume
and truncated-checkpoint tests of ``test_resume.py`` and ``test_checkpoint.py``. The counts are
printed (run with ``-s`` to see them).

The subprocesses share a JAX persistent compilation cache (filled by the uninterrupted run first)
only so that a restart costs seconds, not a compile; it does not change what is computed.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.conftest import tiny_config, write_corpus
from tests.train.test_resume import write_cfg

TMP_SUFFIX = ".orbax-checkpoint-tmp"
ROOT = Path(__file__).resolve().parents[2]


def _env(cache: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "JAX_COMPILATION_CACHE_DIR": str(cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _start(cfg_file: Path, workdir: Path, env: dict, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "from longctx.cli import train_main; train_main()", f"--config={cfg_file}",
           f"--workdir={workdir}", "--progress=false"]
    out, err = open(log.with_suffix(".out"), "w"), open(log.with_suffix(".err"), "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT)
    out.close()
    err.close()
    return proc


def _records(workdir: Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written while we read
            pass
    return recs


def _last_train_step(workdir: Path) -> int:
    return max((r["step"] for r in _records(workdir) if r["split"] == "train"), default=0)


def _ckpt_dir_steps(workdir: Path) -> tuple[list[int], list[int]]:
    """(committed steps, steps with a temporary folder) in the checkpoint directory."""
    try:
        names = os.listdir(workdir / "checkpoints")
    except FileNotFoundError:
        return [], []
    done = sorted(int(n) for n in names if n.isdigit())
    tmp = sorted(int(n.split(".")[0]) for n in names if TMP_SUFFIX in n and n.split(".")[0].isdigit())
    return done, tmp


def _truncate_data_files(step_dir: Path) -> int:
    files = [p for p in step_dir.rglob("*") if p.is_file() and "/d/" in str(p)]
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    return len(files)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _wait_for(proc, cond, what: str, timeout: float, poll: float = 0.002):
    """Poll ``cond()`` until it returns a truthy value; None if the process ended first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            return None
        time.sleep(poll)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}")


def _plan(rng: random.Random, n_kills: int) -> tuple[list[tuple[int, str]], int]:
    """(signal, mode) for each kill, mode 'save' (right after a save starts) or 'step' (a random
    moment after a random step); at least one SIGKILL cutting a save and one SIGTERM. And after
    which kill the newest checkpoint is truncated (not the first: it needs a previous one)."""
    while True:
        plan = [(rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGTERM]), rng.choice(["save", "step"]))
                for _ in range(n_kills)]
        if (signal.SIGKILL, "save") in plan and any(s == signal.SIGTERM for s, _ in plan):
            return plan, rng.randrange(1, n_kills)


def soak(root: Path, *, steps: int, ckpt_every: int, eval_every: int, n_kills: int, seed: int,
         async_checkpoints: bool = True, timeout: float = 600) -> dict:
    rng = random.Random(seed)
    corpus = write_corpus(root / "corpus")
    cfg = tiny_config(corpus, root / "cache", steps=steps, ckpt_every=ckpt_every, eval_every=eval_every,
                      async_checkpoints=async_checkpoints, keep_checkpoints=3)
    cfg_file = write_cfg(root / "cfg.py", cfg)
    env = _env(root / "jax_cache")
    logs = root / "logs"
    logs.mkdir()

    ref = _start(cfg_file, root / "ref", env, logs / "ref")
    assert ref.wait(timeout=timeout) == 0, _read(logs / "ref.err")[-3000:]

    wd = root / "run"
    plan, corrupt_after = _plan(rng, n_kills)
    kills = []  # one dict per kill
    attempt, resumed = 0, 0
    while True:
        log = logs / f"attempt{attempt:02d}"
        proc = _start(cfg_file, wd, env, log)
        if len(kills) == len(plan):
            assert proc.wait(timeout=timeout) == 0, _read(log.with_suffix(".err"))[-3000:]
            break
        sig, mode = plan[len(kills)]
        # a target beyond the next checkpoint, so every cycle commits at least one new checkpoint
        room = max(ckpt_every + 2, (steps - resumed) // (n_kills - len(kills) + 1) + ckpt_every)
        target = min(resumed + rng.randint(ckpt_every + 1, room), steps - 1)
        # until the new process resumes, the files still show the killed one's last step and cut save
        target = max(target, kills[-1]["last_logged"] + 1 if kills else 0)
        if mode == "save":
            hit = _wait_for(proc, lambda t=target: [s for s in _ckpt_dir_steps(wd)[1] if s >= t],
                            f"a save at step >= {target}", timeout, poll=0.001)
        else:
            hit = _wait_for(proc, lambda t=target: _last_train_step(wd) >= t, f"step {target}", timeout, poll=0.005)
            if hit:
                time.sleep(rng.uniform(0, 0.05))
        if hit is None:  # the run ended before the moment came: fewer kills than planned
            assert proc.returncode == 0, _read(log.with_suffix(".err"))[-3000:]
            break
        saving = _ckpt_dir_steps(wd)[1]
        proc.send_signal(sig)
        rc = proc.wait(timeout=timeout)
        if rc == 0:  # it completed in the moment before the signal
            break
        done, left_tmp = _ckpt_dir_steps(wd)
        kill = {"signal": signal.Signals(sig).name, "mode": mode, "rc": rc, "saving": saving,
                "cut_save": [s for s in left_tmp if s not in done], "committed": done,
                "last_logged": _last_train_step(wd), "resumed_from": resumed, "corrupted": None}
        if sig == signal.SIGTERM and rc == 128 + signal.SIGTERM:
            assert "checkpoint saved" in _read(log.with_suffix(".out")), _read(log.with_suffix(".err"))[-3000:]
        else:
            assert rc == -sig, (kill, _read(log.with_suffix(".err"))[-3000:])
        assert kill["last_logged"] < steps, kill
        if len(kills) == corrupt_after:
            if len(done) < 2:  # nothing to fall back to yet: corrupt after the next kill
                corrupt_after += 1
            else:
                assert _truncate_data_files(wd / "checkpoints" / str(done[-1])) > 0
                kill["corrupted"] = done[-1]
        kills.append(kill)
        attempt += 1

        # the next start must resume from the newest checkpoint committed at the kill (the truncated
        # one excepted, with one warning naming it)
        valid = [s for s in done if s != kill["corrupted"]]
        kill["expect"] = valid[-1]
        resumed = kill["expect"]
    # read what each restart said
    for i, kill in enumerate(kills):
        out = _read(logs / f"attempt{i + 1:02d}.out")
        err = _read(logs / f"attempt{i + 1:02d}.err")
        said = [int(m) for m in re.findall(r"^resuming from the checkpoint at step (\d+) ", out, re.M)]
        assert said == [kill["expect"]], (kill, out[-2000:], err[-2000:])
        kill["resumed"] = said[0]
        kill["redone"] = kill["last_logged"] - kill["resumed"]
        warned = [ln for ln in err.splitlines() if "warning: skipped invalid checkpoint" in ln]
        if kill["corrupted"] is not None:
            assert len(warned) == 1 and f"step {kill['corrupted']}:" in warned[0], err[-3000:]
            kill["warning"] = warned[0]
        else:
            assert not warned, (kill, err[-3000:])  # a committed checkpoint was never found half-written
        assert "Traceback" not in err, err[-3000:]
    return {"cfg": cfg, "ref": root / "ref", "run": wd, "kills": kills, "plan": plan, "steps": steps,
            "ckpt_every": ckpt_every, "async_checkpoints": async_checkpoints}


def _restore_final(workdir: Path):
    """Final params and non-gradient state through the eval/sample restore path, and the optimizer state."""
    from longctx.runtime import Runner
    from longctx.train import checkpoint
    from longctx.train.optim import make_optimizer

    runner = Runner.from_workdir(workdir)
    opt_target = jax.eval_shape(make_optimizer(runner.cfg.train).init, runner.params[0])
    tree, meta = checkpoint.restore(checkpoint.manager(workdir, create=False), {"opt_state": opt_target},
                                    step=runner.step, partial=True)
    return runner.step, runner.params[:2], tree["opt_state"]


def check_and_report(res: dict, *, min_kills: int) -> dict:
    kills, steps, every = res["kills"], res["steps"], res["ckpt_every"]
    # final state equals the uninterrupted run's
    step_ref, params_ref, opt_ref = _restore_final(res["ref"])
    step_run, params_run, opt_run = _restore_final(res["run"])
    assert step_ref == step_run == steps
    leaves_ref = jax.tree.leaves((params_ref, opt_ref))
    leaves_run = jax.tree.leaves((params_run, opt_run))
    assert len(leaves_ref) == len(leaves_run) > 0
    for a, b in zip(leaves_ref, leaves_run, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=0)
    # the loss history equals it too, one record per step
    ref = _records(res["ref"])
    run = _records(res["run"])
    for split in ("train", "valid"):
        r = {x["step"]: x["loss"] for x in ref if x["split"] == split}
        g = {x["step"]: x["loss"] for x in run if x["split"] == split}
        assert len([x for x in run if x["split"] == split]) == len(g)  # no step twice
        assert sorted(g) == sorted(r), split
        np.testing.assert_allclose([g[s] for s in sorted(r)], [r[s] for s in sorted(r)], rtol=1e-6, atol=0)
    assert sorted(r for r in {x["step"] for x in run if x["split"] == "train"}) == list(range(1, steps + 1))
    # and so do the TensorBoard scalars, as TensorBoard shows them (the timings aside)
    from longctx.train.metrics import read_tensorboard

    tb_ref, tb_run = read_tensorboard(res["ref"] / "tb"), read_tensorboard(res["run"] / "tb")
    timing = ("train/tokens_per_sec", "train/step_time")
    assert sorted(tb_run) == sorted(tb_ref) and "train/loss" in tb_ref and "valid/loss" in tb_ref
    for tag in tb_ref:
        steps_run = [s for s, _ in tb_run[tag]]
        assert len(steps_run) == len(set(steps_run)), f"{tag}: a step shown twice"
        if tag in timing:
            continue
        assert steps_run == [s for s, _ in tb_ref[tag]], tag
        np.testing.assert_allclose([v for _, v in tb_run[tag]], [v for _, v in tb_ref[tag]], rtol=1e-6, atol=0)
    assert len(list((res["run"] / "tb").iterdir())) == len(kills) + 1  # one event file per run segment
    assert not _ckpt_dir_steps(res["run"])[1], "a temporary checkpoint folder was left after the run"

    # work redone per kill: from the newest committed checkpoint c to the last logged step L
    for k in kills:
        c, last = k["committed"][-1], k["last_logged"]
        if k["signal"] == "SIGTERM" and k["rc"] == 128 + signal.SIGTERM:
            assert c == last, k  # stopped at a step boundary with a checkpoint there
            k["in_flight"] = 0
        else:
            # past the first save after c, that save was still being written when the process died;
            # at most one interval more (the next save waits for it to commit)
            first_save = (c // every + 1) * every
            k["in_flight"] = max(0, last - first_save)
            assert k["in_flight"] <= every, k
        assert last - c <= every + k["in_flight"], k
        if not res["async_checkpoints"]:
            assert k["in_flight"] == 0 and last - c <= every, k  # synchronous saves: one interval at most
        extra = c - k["resumed"] if k["corrupted"] is not None else 0  # the truncated checkpoint's work
        assert k["redone"] == last - c + extra, k

    by_signal = {s: sum(k["signal"] == s for k in kills) for s in ("SIGKILL", "SIGTERM")}
    counts = {
        "steps": steps,
        "async_checkpoints": res["async_checkpoints"],
        "ckpt_every": every,
        "kills": len(kills),
        "kills_by_signal": by_signal,
        "kills_sent_during_a_save": sum(bool(k["saving"]) for k in kills),
        "sigkills_that_cut_a_save": sum(bool(k["cut_save"]) for k in kills if k["signal"] == "SIGKILL"),
        "sigterms_during_a_save_that_completed_it": sum(bool(k["saving"]) for k in kills if k["signal"] == "SIGTERM"),
        "corruption_fallback": [(k["corrupted"], k["resumed"]) for k in kills if k["corrupted"] is not None],
        "steps_redone_per_kill": [k["redone"] for k in kills],
        "steps_redone_total": sum(k["redone"] for k in kills),
        "steps_trained_while_a_cut_save_was_written": [k["in_flight"] for k in kills],
        "max_redone_without_a_cut_save_or_the_corruption": max(
            [k["redone"] for k in kills if not k["in_flight"] and k["corrupted"] is None], default=0),
    }
    print("\nsoak counts:", json.dumps(counts))
    for k in kills:
        print("  kill:", json.dumps({key: k[key] for key in ("signal", "mode", "saving", "cut_save", "last_logged",
                                                          "resumed", "redone", "in_flight", "corrupted")}))
    assert len(kills) >= min_kills, counts
    assert by_signal["SIGKILL"] and by_signal["SIGTERM"], counts
    assert counts["sigkills_that_cut_a_save"] >= 1, counts
    assert len(counts["corruption_fallback"]) == 1, counts
    return counts


@pytest.mark.slow
def test_soak_short(tmp_path):
    res = soak(tmp_path, steps=60, ckpt_every=5, eval_every=20, n_kills=3, seed=0)
    check_and_report(res, min_kills=3)


@pytest.mark.slow
def test_soak_1000_steps(tmp_path):
    res = soak(tmp_path, steps=1000, ckpt_every=20, eval_every=250, n_kills=12, seed=1)
    counts = check_and_report(res, min_kills=10)
    assert counts["sigkills_that_cut_a_save"] >= 2, counts


@pytest.mark.slow
def test_soak_1000_steps_synchronous_saves(tmp_path):
    """With ``train.async_checkpoints=False`` the save commits before training goes on, so a kill
    redoes at most one checkpoint interval (the async default can redo up to two: see above)."""
    res = soak(tmp_path, steps=1000, ckpt_every=20, eval_every=250, n_kills=12, seed=2, async_checkpoints=False)
    counts = check_and_report(res, min_kills=10)
    assert counts["sigkills_that_cut_a_save"] >= 1, counts


def test_loss_history_survives_a_failure_while_it_is_rewritten_on_resume(tmp_path, monkeypatch):
    """Resuming rewrites metrics.jsonl without the records past the resumed step: a kill or a full disk
    during that rewrite keeps the history, and a record cut short by one is dropped, not a crash."""
    from longctx.train import metrics

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "split": "train", "loss": 1.0 / s}) for s in range(1, 11)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 11, "split": "tr')  # the last record cut short
    before = path.read_text()
    real = Path.write_text

    def dies_half_way(self, data, *a, **k):
        real(self, data[: len(data) // 2], *a, **k)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", dies_half_way)
    with pytest.raises(OSError):
        metrics.MetricsWriter(tmp_path, resume_step=8, tensorboard=False)
    monkeypatch.setattr(Path, "write_text", real)
    assert path.read_text() == before
    w = metrics.MetricsWriter(tmp_path, resume_step=8, tensorboard=False)
    w.write(9, "train", {"loss": 0.5})
    w.close()
    assert [(r["step"], r["loss"]) for r in metrics.read_metrics(tmp_path)] == [
        *((s, 1.0 / s) for s in range(1, 9)), (9, 0.5)]
