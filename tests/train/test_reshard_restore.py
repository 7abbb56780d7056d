"""A checkpoint written on one mesh restores onto another (8-way FSDP -> 2x2x2 -> one device),
parameters, optimizer and non-gradient state included: the continued losses equal continuing
on the original mesh."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import tiny_config, xla_flags
from tests.train.test_resume import train_losses, write_cfg


def _train(cfg_file, workdir, devices, *extra):
    cmd = [sys.executable, "-c", "from longctx.cli import train_main; train_main()", f"--config={cfg_file}",
           f"--workdir={workdir}", "--noprogress", *extra]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env["XLA_FLAGS"] = xla_flags(devices if devices > 1 else None)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_restore_onto_other_meshes_continues_identically(tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=8, batch_size=8, ckpt_every=4, eval_every=1000)
    cfg.model.attention.name = "transformer_vq"  # non-gradient codebook state travels too
    cfg.model.attention.transformer_vq = {"codebook_size": 16, "block_len": 8}
    cfg.model.positions = "none"
    cfg_file = write_cfg(tmp_path / "cfg.py", cfg)
    fsdp8 = ("--config.mesh.data=1", "--config.mesh.fsdp=8")
    _train(cfg_file, tmp_path / "a", 8, *fsdp8, "--max_steps=4")
    for name in ("b", "c"):
        shutil.copytree(tmp_path / "a", tmp_path / name)
    _train(cfg_file, tmp_path / "a", 8, *fsdp8)
    r = _train(cfg_file, tmp_path / "b", 8, "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2")
    assert "resuming from the checkpoint at step 4" in r.stdout
    _train(cfg_file, tmp_path / "c", 1)
    want = train_losses(tmp_path / "a")
    for name in ("b", "c"):
        got = train_losses(tmp_path / name)
        np.testing.assert_allclose([got[s] for s in range(5, 9)], [want[s] for s in range(5, 9)], rtol=2e-5,
                                   err_msg=f"continued on mesh {name} != continued on the original mesh")
