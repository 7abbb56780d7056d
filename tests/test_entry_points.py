"""Entry-point behaviour outside the training loop: one flag style for every command, configs and docs
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


@pytest.mark.parametrize("main,prog", [
    (cli.train_main, "longctx-train"), (cli.prepare_main, "longctx-prepare"), (cli.eval_main, "longctx-eval"),
    (cli.sample_main, "longctx-sample"), (cli.fill_main, "longctx-fill"), (cli.recall_main, "longctx-recall"),
    (cli.recall_report_main, "longctx-recall-report"),
])
def test_help_is_short_and_shows_overrides_and_configs(main, prog, capsys):
    with pytest.raises(SystemExit) as e:
        main([prog, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {prog} ") and len(out.splitlines()) < 45, out
    assert "--config.KEY=VALUE" in out and "configs/builtin/: " in out and "default.py[:tiny]" in out
    assert "--[no]check" in out and "--[no]progress" in out
    assert "attention:" not in out and "mesh:" not in out  # never the flattened config


def test_check_stops_after_validation(tmp_path, capsys):
    wd = tmp_path / "w"
    assert cli.train_main(["x", "--config=configs/builtin/vcc.py:tiny", f"--workdir={wd}", "--check"]) == 0
    assert cli.eval_main(["x", f"--workdir={wd}", "--split=test", "--config.eval.max_tokens=100", "--check"]) == 0
    assert cli.sample_main(["x", f"--workdir={wd}", "--top_k=5", "--check"]) == 0
    out = capsys.readouterr().out
    assert "ok: longctx-train would train 40 steps" in out and "eval.max_tokens=100" in out
    assert not wd.exists()  # nothing ran
    with pytest.raises(SystemExit):
        cli.eval_main(["x", f"--workdir={wd}", "--config.model.d_model=8", "--check"])
    assert "allowed here: --config.eval.*" in capsys.readouterr().err


def test_check_of_a_trained_run_validates_its_config_with_the_overrides(tmp_path, capsys):
    """Where the run exists, ``--check`` of a command that reads it validates its saved config with the overrides
    (values too, not only keys), without restoring it."""
    from longctx import config_files
    from longctx.config import validate

    wd = tmp_path / "run"
    wd.mkdir()
    (wd / "config.json").write_text(validate(config_files.load("configs/default.py:tiny")).to_json())
    assert cli.eval_main(["x", f"--workdir={wd}", "--config.model.scan_layers=on", "--check"]) == 0
    assert "checked: its saved config with the overrides" in capsys.readouterr().out
    for bad, says in (("--config.model.scan_layers=maybe", "scan_layers"), ("--config.eval.protocol=bogus", "protocol")):
        with pytest.raises(SystemExit) as e:
            cli.sample_main(["x", f"--workdir={wd}", bad, "--check"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err


def test_train_log_line_and_eval_file_names():
    from ml_collections import ConfigDict

    from longctx.config import base_config, validate
    from longctx.evaluate import protocol_tag
    from longctx.train.metrics import log_line

    rec = {"loss": 2.0, "bits_per_token": 2.885, "lr": 1e-3, "tokens_per_sec": 12345.6, "step_time": 0.25}
    assert log_line(25, 400, rec) == ("step 25/400  loss 2.0000 (2.8850 bits/token)  lr 0.001  12,346 tokens/s  "
                                      "0.250 s/step")
    assert "tokens/s" not in log_line(1, 400, {k: rec[k] for k in ("loss", "bits_per_token", "lr")})
    c = base_config()
    assert protocol_tag(validate(c)) == "stream-w256-document256"
    c.eval.protocol, c.eval.context, c.eval.stride = "sliding", 512, 128
    c.train.seq_len = 512
    assert protocol_tag(validate(c)) == "sliding-c512-s128"
    c.eval.max_tokens, c.eval.reset = 1000, "never"
    assert protocol_tag(validate(ConfigDict(c.to_dict()))) == "sliding-c512-s128-never-n1000"


def test_noprogress_training_prints_compilation_and_log_lines(tiny_cfg, tmp_path, capsys):
    import json

    from longctx.train.loop import train

    tiny_cfg.train.log_every, tiny_cfg.train.eval_every = 2, 100  # eval_every longer than the run: fitted
    train(tiny_cfg, tmp_path / "run", progress=False)
    out = capsys.readouterr().out
    assert "note: fitted to the run's length, train.steps=8: train.eval_every 100 -> 8" in out
    assert "compiling the train step" in out and "compiled the train step and ran step 1 in" in out
    assert "step 8/8  loss" in out and "tokens/s" in out and "step 8/8: valid" in out
    recs = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if r["split"] == "train"]
    assert all("lr" in r for r in train_recs) and train_recs[0]["lr"] > 0
    assert all(r["step_time"] > 0 and r["tokens_per_sec"] > 0 for r in train_recs[1:])


def test_check_says_when_the_corpus_is_not_there(tmp_path, capsys):
    """``--check`` validates without reading data, and says (exit 0, a warning on stderr) where the corpus the
    config names is missing, instead of a plain "ok"; the data's place is printed as data.path, not the workdir."""
    from longctx import cli

    base = ["longctx-train", "--config=configs/default.py:tiny", f"--workdir={tmp_path / 'w'}",
            "--config.data.source=files", "--check"]
    assert cli.train_main([*base, f"--config.data.path={tmp_path / 'missing'}"]) == 0
    out, err = capsys.readouterr()
    assert "warning: the data is not there yet: files: data.path=" in err and "does not exist" in err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.txt").write_text("text")
    assert cli.train_main([*base, f"--config.data.path={tmp_path / 'mine'}"]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err and f"on data.source='files' ({tmp_path / 'mine'}), writing to {tmp_path / 'w'}" in out
    assert not (tmp_path / "w").exists()


def test_a_missing_corpus_is_refused_before_the_workdir_is_made(tmp_path, capsys):
    """``longctx-train`` with a corpus that is not there: one line, exit 2, and no workdir left behind."""
    from longctx import cli

    with pytest.raises(SystemExit) as e:
        cli.train_main(["longctx-train", "--config=configs/default.py:tiny", f"--workdir={tmp_path / 'w'}",
                        "--config.data.source=files", f"--config.data.path={tmp_path / 'missing'}"])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_ctrl_c_in_a_command_is_one_line_and_exit_130(capsys):
    """Ctrl-C in longctx-eval, -sample, -recall, ... (the trainer checkpoints on its own): no traceback."""
    from longctx import cli

    with pytest.raises(SystemExit) as e, cli.user_errors():
        raise KeyboardInterrupt
    assert e.value.code == 130 and capsys.readouterr().err == "interrupted\n"


def test_a_capacity_error_is_one_line_also_from_inside_a_compiled_program(capsys):
    """A state given more than it holds stops a command with one line and exit 2, whether it was raised on the host
    or from a compiled program's host callback (which wraps it in the runtime's multi-line error)."""
    import jax
    import jax.numpy as jnp

    from longctx.attention.base import CapacityError, check_capacity

    def over(n):
        check_capacity(n, 4, "state holds {capacity} tokens, {needed} given")
        return n

    for call in (lambda: over(5), lambda: jax.block_until_ready(jax.jit(over)(jnp.int32(5)))):
        with pytest.raises(SystemExit) as e, cli.user_errors():
            call()
        assert e.value.code == 2
        assert capsys.readouterr().err.strip() == "error: state holds 4 tokens, 5 given"
    with pytest.raises(ValueError, match="another error"), cli.user_errors():  # not turned into a line
        raise ValueError("another error")
    assert issubclass(CapacityError, ValueError)
