"""When the environment describes a multi-process job (and only then) the trainer initializes JAX's
distributed runtime; only process 0 writes metrics."""

from longctx.train import distributed
from longctx.train.metrics import MetricsWriter


def test_detects_multi_process_launches():
    assert not distributed.wanted({})
    assert not distributed.wanted({"SLURM_NTASKS": "1"})
    assert distributed.wanted({"SLURM_NTASKS": "4"})
    assert distributed.wanted({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})
    assert distributed.wanted({"TPU_WORKER_HOSTNAMES": "t1,t2"})
    assert not distributed.wanted({"TPU_WORKER_HOSTNAMES": "t1"})
    assert not distributed.wanted({"SLURM_NTASKS": "4", "LONGCTX_DISTRIBUTED": "0"})
    assert distributed.wanted({"LONGCTX_DISTRIBUTED": "1"})


def test_non_primary_processes_write_no_metrics(tmp_path):
    w = MetricsWriter(tmp_path, enabled=False)
    w.write(1, "train", {"loss": 1.0})
    w.close()
    assert not (tmp_path / "metrics.jsonl").exists()
