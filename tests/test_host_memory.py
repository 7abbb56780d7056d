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
        "error: LONGCTX_HOST_MALLOC='tcmalloc': allowed values are auto, keep, system"], r.stderr
    assert not (tmp_path / "w").exists()


def test_huge_pages_env_adds_the_tunable_once():
    base = {"PATH": "/bin"}
    env = hm_env(base)
    if env is None:
        pytest.skip("no glibc >= 2.35 with transparent huge pages here")
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and env["PATH"] == "/bin" and "GLIBC_TUNABLES" not in base
    assert hm_env(env) is None  # already there: nothing to add, so a restarted process does not restart again
    other = hm_env({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"})
    assert other["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=1"
    assert hm_env({"LONGCTX_HOST_MALLOC": "system"}) is None


def test_settings_apply_on_cpu_hosts_only_unless_asked():
    from longctx import host_memory as hm

    assert hm.mode({"JAX_PLATFORMS": "cpu"})[0] == "keep"
    assert hm.mode({"JAX_PLATFORMS": "cuda"}) == ("system", "an accelerator host (cuda); LONGCTX_HOST_MALLOC=keep "
                                                  "applies the settings anyway")
    assert hm.mode({"JAX_PLATFORMS": "tpu,cpu", "LONGCTX_HOST_MALLOC": "keep"})[0] == "keep"
    assert hm.mode({"JAX_PLATFORMS": "cpu", "LONGCTX_HOST_MALLOC": "system"})[0] == "system"
    assert hm.accelerator_host({"JAX_PLATFORMS": "cpu"}) is None
    assert hm_env({"JAX_PLATFORMS": "cuda"}) is None  # no huge-page restart on a GPU host


RESTART = """
import os, sys
from longctx.host_memory import restart_with_huge_pages
print(os.getpid(), os.environ.get("GLIBC_TUNABLES"), sys.argv[1:], flush=True)
restart_with_huge_pages()
print("done", os.getpid(), flush=True)
"""


@pytest.mark.parametrize("mode", [None, "system"])
def test_restart_keeps_the_process_and_its_arguments(mode):
    from longctx import host_memory as hm

    env = {k: v for k, v in os.environ.items() if k not in ("LONGCTX_HOST_MALLOC", "GLIBC_TUNABLES")}
    if mode is not None:
        env["LONGCTX_HOST_MALLOC"] = mode
    r = subprocess.run([sys.executable, "-c", RESTART, "a", "--b=1"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    pid = lines[0].split()[0]
    assert lines[-1] == f"done {pid}"
    if mode is None and hm.huge_pages_env(env) is not None:
        # replaced once by the same command line (same process id), now with the tunable
        assert len(lines) == 3 and lines[1] == f"{pid} glibc.malloc.hugetlb=1 ['a', '--b=1']", lines
    else:
        assert len(lines) == 2 and lines[0] == f"{pid} None ['a', '--b=1']", lines


def hm_env(environ):
    from longctx import host_memory as hm

    return hm.huge_pages_env(environ)
