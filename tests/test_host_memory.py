"""The host allocation settings of the entry points (longctx/host_memory.py), each in a fresh process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, resource, sys
from longctx import host_memory as hm
res = hm.keep_freed_memory()
again = hm.keep_freed_memory()
import numpy as np
def faults_of_big_buffers():
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        a = np.ones(48 << 18, np.float32)  # 48 MiB: above glibc's largest automatic mmap threshold
        del a
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
faults_of_big_buffers()  # the first buffer is faulted in under either setting
print(json.dumps({"res": res, "same": res is again, "faults": faults_of_big_buffers()}))
"""


def probe(mode: str | None):
    env = {k: v for k, v in os.environ.items() if k != "LONGCTX_HOST_MALLOC"}
    if mode is not None:
        env["LONGCTX_HOST_MALLOC"] = mode
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    return r


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc settings")
def test_keep_reuses_freed_memory_and_system_does_not():
    keep, system = probe(None), probe("system")
    assert keep.returncode == 0 and system.returncode == 0, keep.stderr + system.stderr
    keep, system = json.loads(keep.stdout), json.loads(system.stdout)
    assert keep["res"] == {"mode": "keep", "refused": []} and keep["same"]
    assert system["res"]["mode"] == "system" and "LONGCTX_HOST_MALLOC=system" in system["res"]["reason"]
    # 5 x 48 MiB re-allocated: with glibc's defaults each is a fresh mapping faulted in again (numpy asks
    # for huge pages, so ~500 faults each here rather than ~12k); kept memory is reused without faults
    assert system["faults"] > 5 * 100, system
    assert keep["faults"] * 10 < system["faults"], (keep, system)


def test_bad_value_is_refused_with_the_allowed_ones(tmp_path):
    """An entry point answers a bad LONGCTX_HOST_MALLOC with one line and exit status 2, no traceback."""
    code = ("import sys; from longctx.cli import train_main; "
            f"sys.exit(train_main(['longctx-train', '--config=configs/default.py', '--workdir={tmp_path}/w']))")
    env = {**os.environ, "LONGCTX_HOST_MALLOC": "tcmalloc"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: LONGCTX_HOST_MALLOC='tcmalloc': allowed values are 'keep' (default) and 'system'"], r.stderr
    assert not (tmp_path / "w").exists()
