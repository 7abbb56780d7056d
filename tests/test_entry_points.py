"""Issue 9 regressions outside the loop: one flag style for every command, configs and docs
that say what the code does."""

import runpy
from pathlib import Path

import pytest

from longctx import cli
from longctx.bench.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("prog,config,argv", [
    ("longctx-train", "file", ["--config=configs/default.py", "--workdir=/tmp/x"]),
    ("longctx-prepare", "file", ["--config=configs/default.py"]),
    ("longctx-eval", "run", ["--workdir=/tmp/x", "--config.eval.protocol=sliding"]),
    ("longctx-sample", "run", ["--workdir=/tmp/x", "--config.sample.top_k=5"]),
])
def test_every_command_takes_noprogress_and_config_overrides(prog, config, argv):
    fv, cfg_or_overrides = cli.parse([prog, *argv, "--noprogress"], prog, config=config,
                                     require_workdir=prog != "longctx-prepare")
    assert fv.progress is False
    if config == "run":
        assert cfg_or_overrides in ({"eval.protocol": "sliding"}, {"sample.top_k": 5})


def test_bench_takes_noprogress():
    assert build_parser().parse_args(["attention", "--noprogress"]).progress is False


def test_eval_and_sample_entry_points_accept_noprogress(tmp_path, capsys):
    """They used to reject it (argparse); now they get as far as the missing workdir."""
    for main in (cli.eval_main, cli.sample_main):
        with pytest.raises(SystemExit) as e:
            main(["x", f"--workdir={tmp_path / 'none'}", "--noprogress"])
        assert e.value.code == 2
        assert "does not exist: train first" in capsys.readouterr().err


def test_paper_layerdrop_is_set():
    for path, p in (("configs/enwik8/transformer_vq.py", 0.3), ("configs/pg19/transformer_vq.py", 0.1)):
        mod = runpy.run_path(str(ROOT / path))
        assert mod["get_config"]().model.gau_layerdrop == p
        assert "not in the base config" not in mod["__doc__"]


def test_docs_say_the_adaptive_softmax_is_wired_in():
    cfg = runpy.run_path(str(ROOT / "configs/wikitext103/dense.py"))["get_config"]()
    assert cfg.model.output == "adaptive"
    text = " ".join((ROOT / "docs" / "datasets.md").read_text().split())
    assert "not yet wired" not in text and "full 267,735-way softmax" not in text
