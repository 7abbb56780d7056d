"""Regression tests of the training loop: config validated once, periodic actions with
windows, the model's aux metrics logged, the trainer's imports."""

import json
import subprocess
import sys
from pathlib import Path

import ml_collections

from longctx import cli
from longctx import config as config_lib
from longctx.train.loop import crossed, train
from tests.conftest import tiny_config


def write_cfg(path: Path, cfg) -> Path:
    path.write_text("import ml_collections\n"
                    f"def get_config():\n    return ml_collections.ConfigDict({cfg.to_dict()!r})\n")
    return path


def records(workdir, split):
    recs = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["split"] == split]


def test_config_is_validated_once_on_the_way_into_training(tiny_corpus, tmp_path, monkeypatch):
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=2, warmup_steps=1)
    calls = {"validate": 0, "check_against_base": 0}
    for name in calls:
        real = getattr(config_lib, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += not k.get("prefix")  # check_against_base recurses with a prefix
            return _real(*a, **k)

        monkeypatch.setattr(config_lib, name, counted)
    assert cli.train_main(["longctx-train", f"--config={write_cfg(tmp_path / 'c.py', cfg)}",
                           f"--workdir={tmp_path / 'w'}", "--noprogress"]) == 0
    assert calls == {"validate": 1, "check_against_base": 1}


def test_crossed():
    assert crossed(2, 4, 3) and crossed(4, 6, 3) and not crossed(6, 8, 3) and crossed(8, 10, 3)
    assert crossed(0, 1, 1) and not crossed(1, 1, 1)


def test_periodic_actions_fire_when_a_multiple_is_crossed(tiny_corpus, tmp_path):
    """seq_len/window = 2: the step goes 2, 4, 6, 8; "every 3" must fire at 4 (crossing 3), 6 and 8."""
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=8, window=16, log_every=3, eval_every=3, ckpt_every=3,
                      keep_checkpoints=10)
    wd = tmp_path / "w"
    train(cfg, wd, progress=False)
    assert [r["step"] for r in records(wd, "train")] == [4, 6, 8]
    assert [r["step"] for r in records(wd, "valid")] == [4, 6, 8]
    assert sorted(int(p.name) for p in (wd / "checkpoints").iterdir() if p.name.isdigit()) == [4, 6, 8]


def test_model_aux_metrics_are_logged(tiny_corpus, tmp_path):
    """Metrics a core reports with Aux.add_metric (and aux losses) reach metrics.jsonl."""
    cfg = tiny_config(tiny_corpus, tmp_path / "cache", steps=2, warmup_steps=1, eval_every=100)
    cfg.model.block, cfg.model.positions, cfg.model.norm = "gau", "none", "rmsnorm"
    cfg.model.num_heads = 1
    cfg.model.attention.name = "transformer_vq"
    cfg.model.attention.transformer_vq = ml_collections.ConfigDict({"codebook_size": 8, "block_len": 8})
    wd = tmp_path / "w"
    train(cfg, wd, progress=False)
    rec = records(wd, "train")[-1]
    per_layer = [k for k in rec if k.endswith("/vq_rel_err")]
    assert sorted(per_layer) == ["layer0/vq_rel_err", "layer1/vq_rel_err"], rec
    assert "aux/commit" in rec


def test_trainer_imports_no_entry_point_or_eval_module():
    """Neither at import time nor inside a function (the periodic validation used to import them lazily)."""
    import ast

    banned = {"longctx.cli", "longctx.evaluate", "longctx.sample", "longctx.runtime", "longctx.data.prepare_cli"}
    found = []
    for path in (Path(__file__).resolve().parents[2] / "longctx" / "train").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [f"{path.name}: {n}" for n in names if n in banned]
    assert not found
    code = ("import sys, longctx.train.loop, longctx.train.checkpoint;"
            "print(sorted(m for m in sys.modules if m in %r))" % sorted(banned))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
