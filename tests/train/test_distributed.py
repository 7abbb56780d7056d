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


def test_init_args_pass_the_count_and_id_jax_does_not_read_itself():
    import pytest

    from longctx.errors import ConfigError

    env = {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1",
           "LONGCTX_DIST_HEARTBEAT_TIMEOUT": "5"}
    args = distributed.init_args(env)
    assert args["coordinator_address"] == "127.0.0.1:1234"
    assert (args["num_processes"], args["process_id"], args["heartbeat_timeout_seconds"]) == (2, 1, 5)
    assert args["initialization_timeout"] == 300
    assert distributed.init_args({"SLURM_NTASKS": "4"}) == {
        "initialization_timeout": 300, "heartbeat_timeout_seconds": 100, "shutdown_timeout_seconds": 300}
    for bad, says in [({**env, "JAX_PROCESS_ID": "2"}, "out of range"),
                      ({**env, "JAX_PROCESS_ID": "x"}, "must be an integer"),
                      ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234"}, "JAX_NUM_PROCESSES and JAX_PROCESS_ID"),
                      ({**env, "JAX_COORDINATOR_ADDRESS": "nohost"}, "host:port"),
                      ({**env, "LONGCTX_DIST_INIT_TIMEOUT": "0"}, "must be >= 1")]:
        with pytest.raises(ConfigError, match=says):
            distributed.init_args(bad)


def test_an_unreachable_coordinator_is_one_line_not_a_hang():
    import time

    import pytest

    from longctx.errors import ConfigError
    from longctx.train.launch_local import free_port

    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="did not answer within 1 s"):
        distributed.wait_for_coordinator(f"127.0.0.1:{free_port()}", 1)
    assert time.monotonic() - t0 < 10


def test_an_object_storage_workdir_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    import pytest

    from longctx.config import base_config
    from longctx.errors import WorkdirError
    from longctx.train.loop import train

    monkeypatch.chdir(tmp_path)
    with pytest.raises(WorkdirError, match="object-storage workdirs are not supported"):
        train(base_config(), "gs://bucket/run")
    assert not (tmp_path / "gs:").exists()


def test_launch_environment_matches_what_the_trainer_reads():
    from longctx.train.launch_local import process_env

    env = process_env(1, 2, 4321, 4, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo"})
    assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=4"
    args = distributed.init_args(env)
    assert (args["coordinator_address"], args["num_processes"], args["process_id"]) == ("127.0.0.1:4321", 2, 1)
    assert distributed.wanted(env)
