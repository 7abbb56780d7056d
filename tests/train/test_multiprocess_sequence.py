"""Sequence parallelism across processes: 2 ``longctx-train`` processes x 4 simulated CPU devices on
one (data 1, fsdp 1, tensor 1, sequence 8) mesh, rows split over the ``sequence`` axis by composed
states (``mesh.sequence_mode='compose'``). The sequence axis is the whole mesh, so it holds the
devices of both processes: the prefix scan's exchanges cross the process boundary. Every process
reads the whole batch (the batch axes have size 1). The job trains what a single process with 8
devices trains: the same loss history, parameters and optimizer state.
"""

from __future__ import annotations

import numpy as np
import pytest

from longctx.train import sharding
from tests.conftest import tiny_config, write_corpus
from tests.train.test_multiprocess import _records, _run, _same_run, _single_start
from tests.train.test_resume import write_cfg

MESH = {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 8}


def _config(root, *, method: str, block: str, positions: str, steps: int, seq_len: int):
    corpus = root / "corpus"
    if not corpus.exists():
        write_corpus(corpus)
    c = tiny_config(corpus, root / "cache", batch_size=2, steps=steps, ckpt_every=steps, eval_every=steps,
                    seq_len=seq_len)
    c.model.attention.name, c.model.block, c.model.positions = method, block, positions
    # Adam with eps 1e-8 divides a near-zero gradient (a rare token's embedding row) by its own size, which
    # magnifies the rounding differences between the one- and two-process programs in that parameter:
    # eps 1e-4 keeps the update a smooth function of the gradient, and the comparison to float tolerance
    c.train.eps = 1e-4
    if method == "transformer_vq":  # a band (block_len) shorter than one device's slice of a row
        c.model.attention.transformer_vq.update(codebook_size=16, block_len=8)
    for k, v in MESH.items():
        c.mesh[k] = v
    c.mesh.sequence_mode = "compose"
    if method != "dense":  # composed states over packed rows: dense's only (docs/scaling.md); rows inside a document
        c.data.packing = "document"
    return write_cfg(root / "cfg.py", c)


class _Device:
    """What :func:`sharding.make_mesh` reads of a device, in the order ``jax.devices()`` lists the
    devices of a 2-process job (process 0's four, then process 1's)."""

    def __init__(self, i: int):
        self.id, self.process_index = i, i // 4


def test_the_sequence_axis_spans_both_processes():
    grid = sharding.device_grid(MESH, [_Device(i) for i in range(8)])
    assert grid.shape == (1, 1, 1, 8)
    along = grid.reshape(-1)  # the sequence axis: every other axis has size 1
    assert sorted({d.process_index for d in along}) == [0, 1]
    # a data 2 x sequence 4 mesh would keep each sequence group inside one process
    other = sharding.device_grid({**MESH, "data": 2, "sequence": 4}, [_Device(i) for i in range(8)])
    assert all(len({d.process_index for d in row}) == 1 for row in other.reshape(2, 4))


def _check(tmp_path, *, method, block, positions, steps, seq_len):
    cfg = _config(tmp_path, method=method, block=block, positions=positions, steps=steps, seq_len=seq_len)
    ref = _single_start(cfg, tmp_path / "ref")  # the reference runs beside the job
    _run(cfg, tmp_path / "run", tmp_path / "logs")
    _, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err[-3000:]
    for i in range(2):
        log = (tmp_path / "logs" / f"process_{i}.log").read_text()
        assert "sequence parallelism over 8 devices: compose" in log, log[-2000:]
    _same_run(tmp_path / "ref", tmp_path / "run", steps)
    losses = [r["loss"] for r in _records(tmp_path / "run") if r["split"] == "train"]
    assert len(losses) == steps and np.all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.slow  # three trainer start-ups; the default suite keeps the data/fsdp job of test_multiprocess.py
def test_two_processes_train_sequence_parallel_like_one_process(tmp_path):
    _check(tmp_path, method="dense", block="transformer", positions="rotary", steps=2, seq_len=32)


@pytest.mark.slow
def test_two_processes_train_sequence_parallel_transformer_vq(tmp_path):
    _check(tmp_path, method="transformer_vq", block="gau", positions="sinusoidal", steps=6, seq_len=128)
