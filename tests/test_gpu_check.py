"""scripts/gpu_check.sh --smoke: the steps of the accelerator check at tiny shapes on the CPU, so the script
cannot rot between the times a GPU is lent: the report and its JSON are written with every section, and
every step that ran ends ok (by default one step of each kind of command; every step with -m slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("## Environment", "## Kernel tests, compiled", "## Exact attention against every method",
            "## Exact attention against every method at 128k", "## float32 against bfloat16",
            "## Where Transformer-VQ's time goes", "## Where EVA's time goes",
            "## Exact attention against the methods at head dim 128",
            "## Each kernel against its XLA path", "## Model training steps, reduced depth",
            "### enwik8 Transformer-VQ", "### WikiText-103 EVA", "### enwik8 FMA",
            "## Kernel knob sweep", "## Flagship memory plan", "## Flagship compile time against depth",
            "## Decoding steps")


# by default the steps that take each kind of command (pytest, an attention and a kernel benchmark, a training step
# at two depths, the dry run); every step with -m slow
SOME = "env tests attention kernels sweep step_tvq memplan"  # the profile command: tests/bench/test_profile.py


@pytest.mark.parametrize("steps", [SOME, pytest.param("all", marks=pytest.mark.slow)])
def test_gpu_check_smoke_writes_every_section(tmp_path, steps):
    # a bare environment, with the suite's XLA flags (tests/conftest.py: compile speed) for the steps' processes
    env = {"PATH": "/usr/bin:/bin", "PY": sys.executable, "HOME": str(tmp_path), "STEPS": steps,
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--smoke", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    (md,) = tmp_path.glob("*-smoke.md")
    report = json.loads(md.with_suffix(".json").read_text())
    text = md.read_text()
    for s in SECTIONS:
        assert s in text, f"missing section {s!r}"
    ran = SOME.split() if steps == SOME else list(report["steps"])
    assert {k: v["status"] for k, v in report["steps"].items()} == {
        k: "ok" if k in ran else "not run" for k in report["steps"]}
    assert report["env"]["jax"] and report["tests"]["tests"] > 0 and report["tests"]["failures"] == 0
    assert {r["variant"] for r in report["attention"]} >= {"dense:naive", "transformer_vq"}
    if "attention_d128" in ran:
        assert {r["variant"] for r in report["attention_d128"]} >= {"dense:naive"}
    assert report["kernels"] and all(r["status"] == "ok" for r in report["kernels"])
    assert report["env"]["jax_in_supported_range"] is True and report["env"]["jax_supported_range"].startswith(">=")
    if "profile_tvq" in ran:
        assert report["profile_tvq"] and "Where Transformer-VQ's time goes" in text
    for name in [s for s in ("step_tvq", "step_eva", "step_fma") if s in ran]:
        assert set(report["steps_model"][name]) >= {"layers_1", "layers_2", "per_layer"}
        row = report["steps_model"][name]["layers_1"]["rows"][0]
        assert row["tokens_per_s"] > 0 and row["model_flops_per_token"] > 0 and row["mfu"] > 0
        assert row["compile_s"] > 0 and "not available" in row["device_mem"]["reason"]
    assert "MFU %" in text and "MFLOP / token" in text and "% of peak fwd+bwd" in text
    assert "peak (est.)" in report["memplan"]
    if "sweep" in ran:  # every setting of the smoke sweep computed the baseline's output
        (kern,) = report["sweep"]
        assert kern["rows"] and all(r["status"] == "ok" and r.get("max_abs_diff_out", 0.0) < 1e-5
                                    for r in kern["rows"])
    if "compile" in ran:
        assert set(report["compile"]) == {"layers_1", "layers_3"}
    if "decode" in ran:  # both cores, and a scanned model of each, write the donated state in place on XLA:CPU
        assert {r["method"] for r in report["decode"]} == {"dense", "kdeformer"}
        assert {r["method"] for r in report["decode_model"]} == {"dense", "kdeformer"}
        assert all(r["status"] == "ok" for r in report["decode"] + report["decode_model"])
        assert "| dense | core alone | 4096 |" in text and "| dense | 4 layers, scan on | 4096 |" in text
        assert "| yes |" in text and "| no |" not in text


def test_a_smoke_run_without_out_writes_to_a_scratch_folder(tmp_path):
    """``--smoke`` with no ``--out`` leaves nothing beside the committed GPU reports: its report goes to a scratch
    folder, whose path it prints."""
    before = sorted((ROOT / "results" / "gpu").iterdir())
    env = {"PATH": "/usr/bin:/bin", "PY": sys.executable, "HOME": str(tmp_path), "STEPS": "env",
           "TMPDIR": str(tmp_path)}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert sorted((ROOT / "results" / "gpu").iterdir()) == before
    (md,) = tmp_path.glob("gpu-check-smoke.*/*-smoke.md")
    assert str(md) in res.stdout
