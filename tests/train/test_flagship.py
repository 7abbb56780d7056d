"""The flagship launches (docs/scaling.md, "Flagship configs on one node"): each paper-scale config has a ``:node8``
variant for one node of 8 GPUs of 80 GB that validates, keeps the config's batch / rows / window, and whose
module docstring states the launch and the exact dry-run command scripts/flagship_plans.py runs for the
table of docs/scaling.md. The dry runs themselves (minutes each) are not part of the default suite; the slow test
plans the smallest one."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import flagship_plans  # noqa: E402

SPECS = sorted(flagship_plans.FLAGSHIP.items())


def _module(spec: str):
    path, _, variant = spec.partition(":")
    return importlib.import_module(path[:-3].replace("/", ".")), variant


def test_the_flagship_list_is_the_paper_scale_configs():
    assert set(flagship_plans.FLAGSHIP) == {
        "enwik8/transformer_vq", "pg19/transformer_vq", "wikitext103/eva_16l", "wikitext103/eva_32l",
        "enwik8/fma", "enwik8/dense", "pg19/dense", "wikitext103/dense"}


@pytest.mark.parametrize("name,spec", SPECS, ids=[n for n, _ in SPECS])
def test_node_launch_validates_and_keeps_the_papers_batch(name, spec):
    from longctx import config as config_lib
    from longctx.train import dry_run, sharding

    mod, variant = _module(spec)
    assert variant in mod.VARIANTS
    paper, node = mod.get_config(), mod.get_config(variant)
    for k in ("batch_size", "seq_len", "window"):
        assert node.train[k] == paper.train[k], k
    for k in ("d_model", "num_layers", "d_ff", "attention"):
        assert node.model[k] == paper.model[k], k
    c = config_lib.validate(node)
    assert c.model.dtype == "bfloat16"  # planned for the GPU run, not the CPU's 'auto' = float32
    assert c.model.remat_policy != "auto" or not c.model.remat  # 'auto' resolves differently on the CPU
    shape = dict(zip(sharding.AXES, sharding.mesh_shape(c.mesh, flagship_plans.DEVICES)))
    assert c.train.batch_size % (c.train.microbatches * shape["data"] * shape["fsdp"]) == 0
    dry_run.known_vocab_size(c)  # plannable without data


@pytest.mark.parametrize("name,spec", SPECS, ids=[n for n, _ in SPECS])
def test_docstring_states_the_launch_and_the_tables_dry_run_command(name, spec):
    mod, _ = _module(spec)
    doc = " ".join(mod.__doc__.split())
    assert flagship_plans.command(spec) in doc
    assert f"longctx-train --config {spec} " in doc


def test_plans_json_rows_are_the_documented_commands_and_fit():
    f = ROOT / "results" / "flagship" / "plans.json"
    if not f.exists():
        pytest.skip("results/flagship/plans.json not generated")
    rows = json.loads(f.read_text())["rows"]
    assert {r["name"] for r in rows} == set(flagship_plans.FLAGSHIP)
    for r in rows:
        assert r["command"] == flagship_plans.command(flagship_plans.FLAGSHIP[r["name"]])
        assert "error" not in r and r["peak_gib"] <= flagship_plans.BUDGET_GIB, r["name"]
    doc = (ROOT / "docs" / "scaling.md").read_text()
    assert all(f"`{r['config']}`" in doc for r in rows)  # docs/scaling.md carries the generated table


def test_report_parser_reads_a_dry_run_report():
    from longctx.train import dry_run

    res = {"parameters": 1234, "devices": 8, "mesh": {"data": 1, "fsdp": 8}, "argument_bytes": 3 << 20,
           "temp_bytes": 5 << 20, "output_bytes": 3 << 20, "alias_bytes": 3 << 20, "peak_bytes_estimate": 8 << 20,
           "flops_per_step": 1e9, "tokens_per_step": 4096, "tokens_per_update": 1024, "compile_s": 12.5,
           "training_flops_per_token": 6.5e8, "flops_loop_note": ""}
    got = flagship_plans.parse_report(dry_run.report(res))
    assert got["parameters"] == 1234 and got["devices"] == 8 and got["tokens_per_update"] == 1024
    assert got["argument_mib"] == 3.0 and got["temp_mib"] == 5.0 and got["peak_mib"] == 8.0
    assert got["flops_per_token"] == pytest.approx(6.5e8) and got["compile_s"] == 12.5


@pytest.mark.slow
def test_smallest_flagship_dry_run_fits(tmp_path):
    """The enwik8 dense launch's dry run on 8 simulated devices, through the script (about a minute)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "flagship_plans.py"), "--only", "enwik8/dense",
                        "--out", str(tmp_path), "--no-doc"],
                       capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    row = json.loads((tmp_path / "plans.json").read_text())["rows"][0]
    assert row["peak_gib"] <= flagship_plans.BUDGET_GIB and row["flops_per_token"] > 0


def test_scan_layers_is_the_planned_setting_by_its_current_name():
    """``model.scan_layers`` is 'auto' | 'on' | 'off': the dry-run report names it as validate resolved it, the script
    reads it from there, a plan written when the setting was a bool renders under the current name, and the
    committed plans say what the launches' configs set."""
    from longctx.train import dry_run

    res = {"parameters": 1, "devices": 8, "mesh": {"data": 8}, "argument_bytes": 1 << 20, "temp_bytes": 1 << 20,
           "output_bytes": 0, "alias_bytes": 0, "peak_bytes_estimate": 2 << 20, "flops_per_step": 1.0,
           "tokens_per_step": 1, "tokens_per_update": 1, "compile_s": 1.0, "training_flops_per_token": 1.0,
           "scan_layers": "on"}
    assert flagship_plans.parse_report(dry_run.report(res))["scan_layers"] == "on"
    assert [flagship_plans.scan_layers_value(v) for v in (True, False, "on", "off")] == ["on", "off", "on", "off"]
    f = ROOT / "results" / "flagship" / "plans.json"
    if not f.exists():
        pytest.skip("results/flagship/plans.json not generated")
    rows = json.loads(f.read_text())["rows"]
    for r in rows:
        assert r["scan_layers"] == flagship_plans.settings(r["config"])["scan_layers"], r["name"]
    md = (ROOT / "results" / "flagship" / "plans.md").read_text()
    assert "scan_layers True" not in md and md.count("scan_layers on") == len(rows)
