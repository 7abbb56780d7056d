"""Every shipped experiment config loads and validates, with each of its variants; config files
are found from any working directory; a bad ``FILE:VARIANT`` is one clear line."""

import pytest

from longctx import cli, config_files
from longctx.config import resolve_vocab, validate
from longctx.errors import ConfigError

VOCAB = {"bytes": 256, "words": 267_735, "sentencepiece": 32_000}
CONFIGS = [name + (f":{v}" if v else "") for name, variants in config_files.shipped() for v in (None, *variants)]


@pytest.mark.parametrize("arg", CONFIGS)
def test_config_validates(arg):
    cfg = config_files.load(arg)
    vocab = cfg.data.options.vocab_size if cfg.data.tokenizer == "bpe" else VOCAB[cfg.data.tokenizer]  # bpe: its own size
    resolved = resolve_vocab(validate(cfg), vocab)
    assert resolved.train.seq_len % resolved.train.window == 0


def test_every_twin_is_a_variant():
    """One variant mechanism: no ``*_tiny.py`` files; the smoke runs are ``:tiny`` variants."""
    assert not list(config_files.CONFIG_DIR.rglob("*_tiny.py"))
    tiny = [n for n, v in config_files.shipped() if "tiny" in v]
    assert {"configs/default.py", "configs/enwik8/dense.py", "configs/enwik8/fma.py", "configs/pg19/transformer_vq.py",
            "configs/wikitext103/eva_16l.py", "configs/builtin/vcc.py", "configs/builtin/kdeformer.py"} <= set(tiny)
    assert config_files.load("configs/enwik8/fma.py:tiny").model.d_model == 128


def test_found_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for arg in ("configs/default.py", "default.py", "configs/builtin/mlm_vcc.py:tiny", "configs/wikitext103/eva_32l.py:tiny"):
        assert config_files.load(arg).train.steps > 0
    own = tmp_path / "mine.py"  # a file of one's own, starting from a shipped config by import
    own.write_text("from configs.builtin import eva\n\n\ndef get_config():\n    c = eva.get_config()\n"
                   "    c.train.steps = 10\n    return c\n")
    assert config_files.load("mine.py").model.attention.name == "eva"
    _, cfg = cli.parse(["x", "--config=configs/default.py:tiny", "--workdir=w"], "longctx-train", config="file")
    assert cfg.model.num_layers == 2


@pytest.mark.parametrize("arg,msg", [
    ("configs/default.py:huge", "configs/default.py: unknown variant 'huge'; allowed: tiny"),
    ("configs/enwik8/fma.py:n4096", "allowed: n512, n1024, n2048, linear, tiny"),
    ("configs/main.py:tiny", "has no variants"),
    ("configs/recall/_common.py", "defines no get_config() function"),
    ("configs/nope.py", "config file configs/nope.py not found"),
])
def test_bad_config_argument_is_one_line(arg, msg, capsys):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        config_files.load(arg)
    with pytest.raises(SystemExit) as e:
        cli.train_main(["longctx-train", f"--config={arg}", "--workdir=/tmp/x", "--check"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and msg in err and "Traceback" not in err


def test_short_runs_fit_their_intervals(capsys):
    """``--config.train.steps=20`` on configs/default.py: warm-up and intervals fit the run, with a note."""
    _, cfg = cli.parse(["x", "--config=configs/default.py", "--config.train.steps=20", "--workdir=w"],
                       "longctx-train", config="file")
    c = validate(cfg)
    assert (c.train.warmup_steps, c.train.log_every, c.train.eval_every, c.train.ckpt_every) == (2, 20, 20, 20)
    out = capsys.readouterr().out
    assert out.count("note: fitted to the run's length, train.steps=20: ") == 1 and "train.warmup_steps 50 -> 2" in out
    validate(config_files.load("configs/default.py"))
    assert "note:" not in capsys.readouterr().out  # a config that fits says nothing


@pytest.mark.parametrize("value", ["dense,eva", "(dense,eva)", "dense, eva", "[dense,eva]", '("dense","eva")'])
def test_a_pattern_on_the_command_line_is_a_comma_list_and_is_reported(value, capsys):
    """``--config.model.attention.pattern=dense,eva`` (as the shell passes it, or as a quoted tuple) is the two
    methods, and ``--check`` reports the stack, not only ``model.attention.name``."""
    argv = ["x", "--config=configs/default.py:tiny", f"--config.model.attention.pattern={value}", "--workdir=w"]
    _, cfg = cli.parse(argv, "longctx-train", config="file")
    assert tuple(validate(cfg).model.attention.pattern) == ("dense", "eva")
    assert cli.train_main([*argv, "--check"]) == 0
    assert "with attention=dense,eva on data.source='builtin'" in capsys.readouterr().out


def test_check_says_when_the_mesh_does_not_fit_this_machine(capsys):
    """``--check`` checks a config for another machine's devices without refusing it, but its ok line says the
    mesh does not fit the devices here (training here would refuse it); an encoder is 'an encoder'."""
    argv = ["x", "--config=configs/default.py:tiny", "--workdir=w", "--check"]
    assert cli.train_main([*argv, "--config.mesh.fsdp=3"]) == 0
    out, err = capsys.readouterr()
    assert "does not divide the 1 devices (here)" in err
    assert out.strip().endswith("not on this machine's 1 device(s): the mesh above")
    assert cli.train_main(["x", "--config=configs/builtin/mlm_dense.py:tiny", "--workdir=w", "--check"]) == 0
    assert "steps of an encoder with" in capsys.readouterr().out


def test_short_runs_fit_their_staged_phase(capsys):
    """configs/recall/dense.py (250 of 300 updates on short rows) with 40 steps: the staged phase becomes the
    run's first half, with the note, instead of a refusal."""
    _, cfg = cli.parse(["x", "--config=configs/recall/dense.py", "--config.train.steps=40", "--workdir=w"],
                       "longctx-train", config="file")
    assert validate(cfg).train.short_steps == 20
    assert "train.short_steps 250 -> 20" in capsys.readouterr().out


def test_a_relative_data_path_is_saved_absolute(tmp_path, monkeypatch):
    """A relative data.path (and cache folder) that exists is resolved against the working directory, so the
    run's saved config reads the same data from any other directory; a name that is no path stays as written."""
    (tmp_path / "corpus").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = config_files.load("configs/default.py:tiny")
    cfg.data.path, cfg.data.cache_dir = "corpus", "cache"
    c = validate(cfg)
    assert (c.data.path, c.data.cache_dir) == (str(tmp_path / "corpus"), str(tmp_path / "cache"))
    cfg.data.path = "Salesforce/wikitext"
    assert validate(cfg).data.path == "Salesforce/wikitext"


def test_a_setting_for_a_method_no_layer_runs_is_a_warning(capsys):
    """``execution.attention.eva.impl=pallas`` on a dense model: one warning line, and the run goes on."""
    argv = ["x", "--config=configs/default.py:tiny", "--config.execution.attention.eva.impl=pallas", "--workdir=w"]
    _, cfg = cli.parse(argv, "longctx-train", config="file")
    validate(cfg)
    out = capsys.readouterr().out
    assert "warning: execution.attention.eva.impl='pallas' is set but the model's layers run dense" in out
    validate(config_files.load("configs/default.py"))
    assert "warning" not in capsys.readouterr().out
