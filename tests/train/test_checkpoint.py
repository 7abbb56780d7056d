"""Checkpoints: restore checks what it reads and falls back to the newest valid one (train,
eval and sample); a killed save is never used; a failed write keeps the previous checkpoint
and stops with one line; non-finite values are never written."""

import json
import shutil
import subprocess
from pathlib import Path

import ml_collections
import numpy as np
import pytest

from longctx import cli
from longctx.errors import CheckpointError, NonFiniteError
from longctx.runtime import Runner
from longctx.train import checkpoint
from longctx.train.loop import train
from tests.conftest import tiny_config, write_corpus

pytestmark = pytest.mark.xdist_group("checkpoint")  # one worker: the trained run below is built once


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run with checkpoints at steps 4 and 8 (train losses recorded)."""
    root = tmp_path_factory.mktemp("ckpt")
    cfg = tiny_config(write_corpus(root / "corpus"), root / "cache", steps=8, ckpt_every=4, eval_every=100)
    train(cfg, root / "run", progress=False)
    return cfg, root / "run"


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def truncate_data_files(step_dir: Path) -> None:
    files = [p for p in step_dir.rglob("*") if p.is_file() and "/d/" in str(p)]
    assert files, list(step_dir.rglob("*"))
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


def losses(workdir):
    recs = [json.loads(x) for x in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r["split"] == "train"}


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_eval_and_sample_fall_back_from_a_truncated_newest_checkpoint(trained, tmp_path, capsys):
    _, run = trained
    wd = copy_run(run, tmp_path / "run")
    truncate_data_files(wd / "checkpoints" / "8")
    assert cli.eval_main(["longctx-eval", f"--workdir={wd}", "--noprogress", "--config.eval.max_tokens=64"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: skipped invalid checkpoint") == 1 and "step 8" in err and "using step 4" in err, err
    assert list((wd / "eval").glob("valid_step4_*.json"))
    assert cli.sample_main(["longctx-sample", f"--workdir={wd}", "--num_tokens=4", "--quiet", "--noprogress"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: skipped invalid checkpoint") == 1 and "using step 4" in err, err
    assert (wd / "samples" / "step4_seed0.txt").exists()


def test_train_resumes_from_the_newest_valid_checkpoint_and_matches(trained, tmp_path, capsys):
    cfg, run = trained
    wd = copy_run(run, tmp_path / "run")
    truncate_data_files(wd / "checkpoints" / "8")
    ref = losses(run)
    train(cfg, wd, progress=False)
    out = capsys.readouterr()
    assert "resuming from the checkpoint at step 4" in out.out
    assert out.err.count("warning: skipped invalid checkpoint") == 1
    got = losses(wd)
    assert sorted(got) == list(range(1, 9))
    np.testing.assert_allclose([got[s] for s in range(5, 9)], [ref[s] for s in range(5, 9)], rtol=1e-6)
    # the rewritten step 8 is valid again
    _, meta = checkpoint.restore(checkpoint.manager(wd, create=False), lambda m: _params_target(cfg, m), partial=True)
    assert meta["step"] == 8


def test_resuming_with_more_steps_says_what_changed_in_one_line(trained, tmp_path, capsys):
    """A finished 8-step run continued with train.steps=12: the schedule is recomputed for 12 steps, and the
    resume says so (the old and new learning rate at the resumed step); the same config says nothing."""
    cfg, run = trained
    wd = copy_run(run, tmp_path / "run")
    more = ml_collections.ConfigDict(cfg.to_dict())
    more.train.steps = 12
    train(more, wd, progress=False)
    notes = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("note: resuming with")]
    assert len(notes) == 1 and "train.steps 8 -> 12; learning rate at step 8: " in notes[0], notes
    assert sorted(losses(wd)) == list(range(1, 13))
    train(more, wd, progress=False)  # finished: the same config again resumes and says nothing more
    assert "note: resuming with" not in capsys.readouterr().out


def _params_target(cfg, meta):
    from flax import nnx

    from longctx import config as config_lib
    from longctx.models.decoder import build_model
    from longctx.train.step import split_model

    c = config_lib.validate(config_lib.merge_over_base(meta["config"]))
    _, params, nongrad, _ = split_model(nnx.eval_shape(lambda: build_model(c.model, seed=0)))
    return {"params": params, "nongrad": nongrad}


def test_no_valid_checkpoint_is_one_clear_error(trained, tmp_path):
    _, run = trained
    wd = copy_run(run, tmp_path / "run")
    for step in (4, 8):
        truncate_data_files(wd / "checkpoints" / str(step))
    with pytest.raises(CheckpointError, match=r"no valid checkpoint .*step 8: .*step 4: "):
        Runner.from_workdir(wd)
    r = subprocess.run([*_cmd("eval_main"), f"--workdir={wd}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "no valid checkpoint" in one_error_line(r.stderr)


def _cmd(entry):
    """A console script of longctx.cli (``eval_main``, ...) as its installed entry point runs it."""
    import sys

    return [sys.executable, "-c", f"import sys; from longctx.cli import {entry}; sys.exit({entry}())"]


def test_checksum_mismatch_and_nonfinite_values_are_rejected(trained, tmp_path, capsys):
    """A checkpoint that reads but holds other values than were written, or non-finite ones, is skipped."""
    _, run = trained
    wd = copy_run(run, tmp_path / "run")
    meta_file = next((wd / "checkpoints" / "8").rglob("meta/metadata"))
    meta = json.loads(meta_file.read_text())
    meta["crc32"]["params"] ^= 1
    meta[checkpoint.META_CRC] = checkpoint.meta_checksum(meta)  # the metadata consistent, the arrays not
    meta_file.write_text(json.dumps(meta))
    runner = Runner.from_workdir(wd)
    assert runner.step == 4
    assert "params do not match the checksum" in capsys.readouterr().err


def test_a_killed_save_leaves_only_a_temporary_directory_that_is_never_used(trained, tmp_path, capsys):
    cfg, run = trained
    wd = copy_run(run, tmp_path / "run")
    # what a SIGKILL during an async save leaves: the step's files under a temporary name, half written
    tmp = wd / "checkpoints" / "12.orbax-checkpoint-tmp"
    shutil.copytree(wd / "checkpoints" / "8", tmp)
    truncate_data_files(tmp)
    assert Runner.from_workdir(wd).step == 8
    assert "warning" not in capsys.readouterr().err
    cfg12 = tiny_config(Path(cfg.data.path), Path(cfg.data.cache_dir), steps=12, ckpt_every=4, eval_every=100)
    train(cfg12, wd, progress=False)
    assert not tmp.exists()  # removed when training opened the directory
    assert Runner.from_workdir(wd).step == 12


def test_a_failed_write_keeps_the_previous_checkpoint_and_stops_in_one_line(trained, tmp_path, monkeypatch):
    """Disk full while saving (the write error injected): the run stops naming the step it could not
    write and the intact one; resuming works from that one."""
    cfg, run = trained
    wd = copy_run(run, tmp_path / "run")
    cfg12 = tiny_config(Path(cfg.data.path), Path(cfg.data.cache_dir), steps=12, ckpt_every=4, eval_every=100)
    real_save = checkpoint.ocp.CheckpointManager.save

    def full_disk(self, step, *a, **k):
        if step == 12:
            raise OSError(28, "No space left on device")
        return real_save(self, step, *a, **k)

    monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", full_disk)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint 12 .*the disk is full.*step 8 is intact"):
        train(cfg12, wd, progress=False)
    monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", real_save)
    assert Runner.from_workdir(wd).step == 8
    train(cfg12, wd, progress=False)
    assert Runner.from_workdir(wd).step == 12


@pytest.mark.slow
def test_a_full_disk_on_a_small_tmpfs(tiny_corpus, tmp_path):
    """The real thing where the machine lets us mount a small tmpfs (root): the async write fails
    with ENOSPC, the run stops with one line and the previous checkpoint stays usable."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=40, ckpt_every=4, eval_every=100, keep_checkpoints=50,
                          async_checkpoints=True)
        cfg.model.d_model, cfg.model.d_ff = 64, 256  # ~1 MB of params + Adam state per checkpoint after compression
        cfg.train.warmup_steps = 2
        with pytest.raises(CheckpointError, match=r"could not write .*the disk is full"):
            train(cfg, mnt / "run", progress=False)
        steps = sorted(int(p.name) for p in (mnt / "run" / "checkpoints").iterdir() if p.name.isdigit())
        if steps:
            assert Runner.from_workdir(mnt / "run").step == steps[-1]
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_nonfinite_stop_names_the_step_and_checkpoints_the_last_finite_state(tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=8, lr=1e30, warmup_steps=0, grad_clip=0.0,
                      ckpt_every=1000, eval_every=1000)
    wd = tmp_path / "w"
    with pytest.raises(NonFiniteError, match=r"non-finite values at step (\d+).*checkpoint at step (\d+)") as e:
        train(cfg, wd, progress=False)
    import re

    bad, saved = map(int, re.search(r"at step (\d+).*checkpoint at step (\d+)", str(e.value)).groups())
    assert saved == bad - 1
    runner = Runner.from_workdir(wd)
    assert runner.step == saved
    import jax

    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(runner.params[0]))


def test_save_refuses_nonfinite_values(trained, tmp_path):
    import ml_collections

    mngr = checkpoint.manager(tmp_path / "w", async_save=False)
    with pytest.raises(CheckpointError, match="non-finite values in params"):
        checkpoint.save(mngr, 1, {"params": {"w": np.array([1.0, np.nan], np.float32)}},
                        config=ml_collections.ConfigDict({"a": 1}))
    assert mngr.all_steps() == []


def _rewrite_meta(step_dir: Path, edit, *, recompute_crc: bool = True) -> None:
    """Replace a checkpoint's metadata with ``edit(meta)`` (its checksum recomputed, as a crafted
    checkpoint would have it, unless ``recompute_crc=False``)."""
    path = step_dir / "meta" / "metadata"
    meta = edit(json.loads(path.read_text()))
    if recompute_crc and isinstance(meta, dict):
        meta[checkpoint.META_CRC] = checkpoint.meta_checksum(meta)
    path.write_text(json.dumps(meta))


def _set(meta, dotted, value):
    node = meta
    *parents, key = dotted.split(".")
    for p in parents:
        node = node[p]
    node[key] = value
    return meta


CRAFTED = {
    "path-traversal step": (lambda m: {**m, "step": "X/../../../../victim"}, "metadata step"),
    "step a string": (lambda m: {**m, "step": "four hundred"}, "metadata step"),
    "step of another checkpoint": (lambda m: {**m, "step": 4}, "not the checkpoint's step 8"),
    "metadata a list": (lambda m: [1, 2, 3], "JSON list, not an object"),
    "crc32 a string": (lambda m: {**m, "crc32": "x"}, "crc32"),
    "config a string": (lambda m: {**m, "config": "x"}, "config is not an object"),
    "unknown attention": (lambda m: _set(m, "config.model.attention.name", "nope"), "saved config is not valid"),
    "changed d_model": (lambda m: _set(m, "config.model.d_model", 64), "model has|not this model"),
    "changed num_layers": (lambda m: _set(m, "config.model.num_layers", 3), "not in the checkpoint|arrays"),
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_crafted_metadata_is_skipped_with_one_warning(trained, tmp_path, name):
    _, run = trained
    wd = copy_run(run, tmp_path / "run")
    edit, why = CRAFTED[name]
    _rewrite_meta(wd / "checkpoints" / "8", edit)
    warnings = []
    mngr = checkpoint.manager(wd, create=False)
    try:

        def make_target(meta):  # the model of the saved config, as eval and sample build it
            from flax import nnx

            from longctx import config as config_lib
            from longctx.models.decoder import build_model
            from longctx.train.step import split_model

            cfg = config_lib.validate(config_lib.merge_over_base(meta["config"]))
            _, params, nongrad, _ = split_model(nnx.eval_shape(lambda: build_model(cfg.model, seed=0)))
            return {"params": params, "nongrad": nongrad}

        tree, meta = checkpoint.restore(mngr, make_target, partial=True, warn=warnings.append)
    finally:
        mngr.close()
    assert meta["step"] == 4
    assert len(warnings) == 1 and "step 8" in warnings[0] and "using step 4" in warnings[0], warnings
    assert __import__("re").search(why, warnings[0]), warnings[0]


def test_changed_metadata_fails_its_checksum(trained, tmp_path):
    _, run = trained
    wd = copy_run(run, tmp_path / "run")
    _rewrite_meta(wd / "checkpoints" / "8", lambda m: _set(m, "config.train.lr", 0.5), recompute_crc=False)
    r = Runner.from_workdir(wd)
    assert r.step == 4


def test_eval_on_crafted_metadata_writes_nothing_outside_the_workdir(trained, tmp_path, capsys, monkeypatch):
    """A path-traversal step in the newest checkpoint and a saved data.cache_dir pointing outside: eval
    uses the previous checkpoint, writes its result in the workdir, tokens only in the default cache,
    and nothing anywhere else."""
    _, run = trained
    cache = tmp_path / "default_cache"
    monkeypatch.setenv("LONGCTX_CACHE", str(cache))
    box = tmp_path / "box"
    wd = copy_run(run, box / "a" / "b" / "run")
    outside = tmp_path / "outside"
    _rewrite_meta(wd / "checkpoints" / "8", lambda m: {**m, "step": "X/../../../../victim"})
    _rewrite_meta(wd / "checkpoints" / "4", lambda m: _set(m, "config.data.cache_dir", str(outside)))
    before = {p for p in tmp_path.rglob("*")}
    assert cli.eval_main(["longctx-eval", f"--workdir={wd}", "--noprogress", "--config.eval.max_tokens=64",
                          "--split=test"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: skipped invalid checkpoint") == 1 and "using step 4" in err, err
    new = {p for p in tmp_path.rglob("*")} - before
    assert new and all(wd in p.parents or p == cache or cache in p.parents for p in new), sorted(new)
    assert any(p.name == "test.bin" for p in cache.rglob("*"))  # the split the run's cache lacked
    assert list((wd / "eval").glob("test_step4_*.json")) and not outside.exists()
