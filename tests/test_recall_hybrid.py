"""The hybrid recall configs (configs/recall/hybrid_<method>.py: layer 1 exact, layer 2 the method with its pure
recall config's settings) validate with the recall budget, and the recall report merges new rows into an
existing table (``--merge``) and compares pure, hybrid and dense."""

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from longctx import attention, cli, config_files
from longctx.config import resolve_vocab, validate
from longctx.errors import ConfigError
from longctx.models.decoder import build_model
from longctx.recall import report

ROOT = Path(__file__).resolve().parents[1]
DENSE_PARAMS = 182_016
PATTERN_METHODS = [n for n in attention.names() if n != "dense" and attention.get_class(n).supports_causal
                   and not attention.get_class(n).stack_wrapper(causal=True)]


def _params(cfg) -> int:
    model = nnx.eval_shape(lambda: build_model(cfg.model, seed=0))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _load(name):
    return resolve_vocab(validate(config_files.load(f"configs/recall/{name}.py")), 256)


@pytest.mark.parametrize("method", PATTERN_METHODS)
def test_hybrid_recall_config_matches_the_recall_budget(method):
    c, pure, dense = _load(f"hybrid_{method}"), _load(method), _load("dense")
    assert tuple(c.model.attention.pattern) == ("dense", method) and c.model.attention.name == method
    assert c.model.attention[method].to_dict() == pure.model.attention[method].to_dict()
    assert c.execution.attention[method].to_dict() == pure.execution.attention[method].to_dict()
    assert c.model.block == "transformer" and c.model.num_layers == dense.model.num_layers == 2
    assert c.data.to_dict() == dense.data.to_dict() and c.train.to_dict() == dense.train.to_dict()
    n = _params(c)
    assert _params(dense) == DENSE_PARAMS
    assert abs(n / DENSE_PARAMS - 1) < 0.01, (method, n)
    assert validate(config_files.load(f"configs/recall/hybrid_{method}.py:tiny")).train.seq_len == 64


def test_every_pattern_method_has_a_hybrid_config_and_no_other():
    found = sorted(p.stem[len("hybrid_"):] for p in (ROOT / "configs" / "recall").glob("hybrid_*.py"))
    assert found == sorted(PATTERN_METHODS) and len(found) >= 5


def _fake_run(root: Path, name: str, res: dict, pattern=None, params=182_000) -> Path:
    wd = root / name
    (wd / "recall").mkdir(parents=True)
    (wd / "recall" / "mqar_len1024_step300.json").write_text(json.dumps(res))
    cfg = {"train": {"seq_len": 1024, "steps": 300, "batch_size": 16},
           "model": {"attention": {"name": res["attention"], "pattern": pattern or []}}}
    (wd / "config.json").write_text(json.dumps(cfg))
    (wd / "train.log").write_text(f"model: {params:,} parameters, attention={res['attention']}\n")
    (wd / "recall_train_seconds.txt").write_text("123 seconds\n")
    return wd


def test_report_merges_new_runs_into_an_existing_table(tmp_path):
    shipped = json.loads((ROOT / "results" / "recall" / "recall.json").read_text())
    dense, eva = shipped["runs/recall/dense"], shipped["runs/recall/eva"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "recall.json").write_text(json.dumps({"runs/recall/dense": dense, "runs/recall/eva": eva}))
    hyb = _fake_run(tmp_path, "hybrid_eva", dict(eva, accuracy=0.5), pattern=["eva", "dense"], params=181_998)

    table = report([str(hyb)], out, task="mqar", length=1024, merge=True)
    names = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")][1:4]
    assert names == ["dense", "eva", "hybrid_eva"]
    assert "| hybrid_eva | transformer | 181,998 | 300 | 123 | 0.500 |" in table
    assert f"| eva | {eva['accuracy']:.3f} | 0.500 | {dense['accuracy']:.3f} | {0.5 / dense['accuracy']:.2f} |" in table
    kept = json.loads((out / "recall.json").read_text())
    assert set(kept) == {"runs/recall/dense", "runs/recall/eva", str(hyb)}
    assert kept[str(hyb)]["run"]["params"] == 181_998 and kept[str(hyb)]["run"]["pattern"] == ["eva", "dense"]

    # merging again replaces the run's own row, and the kept rows keep their summaries
    report([str(hyb)], out, task="mqar", length=1024, merge=True)
    assert len(json.loads((out / "recall.json").read_text())) == 3
    # without --merge only the runs given are tabulated
    table = report([str(hyb)], out, task="mqar", length=1024)
    assert "| dense |" not in table and "hybrid_eva" in table


def test_merge_without_a_table_is_one_line(tmp_path):
    shutil.rmtree(tmp_path / "none", ignore_errors=True)
    with pytest.raises(ConfigError, match="does not exist"):
        report([str(tmp_path)], tmp_path / "none", merge=True)
    with pytest.raises(SystemExit):
        cli.recall_report_main(["x", f"--runs={tmp_path}", f"--out={tmp_path / 'none'}", "--merge"])


def test_a_missing_run_is_refused_and_a_run_without_the_result_is_named(tmp_path, capsys):
    """A misspelled run folder is one line, not a row "no result"; a run without a result for the task and length
    asked gets its row and a warning naming the results it holds."""
    shipped = json.loads((ROOT / "results" / "recall" / "recall.json").read_text())
    run = _fake_run(tmp_path, "dense", shipped["runs/recall/dense"])
    with pytest.raises(ConfigError, match="no such folder .*nothere"):
        report([str(run), str(tmp_path / "nothere")], tmp_path / "out")
    table = report([str(run)], tmp_path / "out", task="mqar", length=512)
    assert "no result" in table
    err = capsys.readouterr().err
    assert f"{run}: no recall result for task=mqar at length 512; it holds mqar at 1024" in err


@pytest.mark.slow
def test_recall_all_smoke_run_of_one_method(tmp_path):
    """scripts/recall_all.sh's documented smoke run (each config's :tiny variant, the table at its length, one
    method into a new table): trains, scores and writes the table (~30 s)."""
    import os
    import subprocess

    env = {**os.environ, "VARIANT": ":tiny", "LENGTH": "64", "OUT": str(tmp_path / "out"),
           "RUNS": str(tmp_path / "runs"), "ONLY": "dense", "NEEDLE": "", "PY": str(Path(sys.executable))}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "recall_all.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    md = (tmp_path / "out" / "recall.md").read_text()
    assert "at 64 tokens" in md and "| dense | transformer |" in md and "no result" not in md
