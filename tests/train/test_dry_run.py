"""longctx-train --dry_run compiles the train step for the mesh and reports memory and FLOPs
without touching data."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import tiny_config


def test_plan_reports_memory_and_flops_without_data(tmp_path):
    from longctx.train import dry_run

    cfg = tiny_config(tmp_path / "no-such-corpus", tmp_path / "no-cache")
    res = dry_run.plan(cfg)
    assert res["devices"] == 1 and res["parameters"] > 0
    assert res["argument_bytes"] >= 4 * res["parameters"]  # fp32 params alone
    assert res["temp_bytes"] > 0 and res["flops_per_step"] > 0
    assert not (tmp_path / "no-cache").exists()
    assert "MiB" in dry_run.report(res)


def test_dry_run_cli_on_eight_devices_shards_the_arguments(tmp_path):
    code = textwrap.dedent(f"""
        from longctx.config import base_config
        from longctx.train import dry_run
        from tests.conftest import tiny_config
        from pathlib import Path
        one = dry_run.plan(tiny_config(Path({str(tmp_path)!r}) / "x", Path({str(tmp_path)!r}) / "c", batch_size=8))
        cfg = tiny_config(Path({str(tmp_path)!r}) / "x", Path({str(tmp_path)!r}) / "c", batch_size=8)
        cfg.mesh.data, cfg.mesh.fsdp = 2, 4
        eight = dry_run.plan(cfg)
        print("RATIO", one["argument_bytes"] / eight["argument_bytes"])
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert "RATIO" in r.stdout, r.stderr[-3000:]
    ratio = float(r.stdout.split("RATIO")[1].split()[0])
    assert ratio > 2.0, ratio  # parameters and optimizer state split 4 ways by fsdp (the batch 8 ways)
