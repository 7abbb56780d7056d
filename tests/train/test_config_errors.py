"""Bad configs and missing checkpoints give one-line, actionable errors."""

import subprocess
import sys

import pytest

from longctx import config as config_lib
from longctx.cli import parse
from longctx.errors import CheckpointError, ConfigError
from longctx.runtime import Runner


def load_config(argv):
    return parse(argv, "longctx-train", config="file")


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match="stepz.*steps"):
        load_config(["x", "--config=configs/default.py", "--config.train.stepz=3", "--workdir=/tmp/x"])


def test_bad_value_type():
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(["x", "--config=configs/default.py", "--config.train.steps=abc", "--workdir=/tmp/x"])


def test_missing_config_file_and_missing_workdir_flag():
    with pytest.raises(ConfigError, match="nope.py"):
        load_config(["x", "--config=configs/nope.py", "--workdir=/tmp/x"])
    with pytest.raises(ConfigError, match="--workdir"):
        load_config(["x", "--config=configs/default.py"])


@pytest.mark.parametrize(
    "path,value,pattern",
    [
        ("train.window", 100, "window=100 must divide"),
        ("model.positions", "alibi", "choose one of"),
        ("model.attention.name", "flash", "allowed: .*dense"),
        ("model.block", "mamba", "allowed: .*transformer"),
        ("train.steps", 7, "multiple of"),
        ("data.source", "imagenet", "allowed"),
        ("model.dropout", 1.5, r"\[0, 1\)"),
        ("eval.stride", 10_000, "at most eval.context"),
    ],
)
def test_impossible_values_and_combinations(path, value, pattern):
    c = config_lib.base_config()
    if path == "train.steps":
        c.train.window = 64
    section, key = path.rsplit(".", 1)
    node = c
    for part in section.split("."):
        node = node[part]
    node[key] = value
    with pytest.raises(ConfigError, match=pattern):
        config_lib.validate(c)


def test_remat_refused_where_a_stack_wrapper_runs_the_blocks():
    c = config_lib.base_config()
    c.model.remat = True
    config_lib.validate(c)  # dense: accepted
    c.model.attention.name = "vcc"
    with pytest.raises(ConfigError, match="model.remat=True.*stack wrapper"):
        config_lib.validate(c)
    c.model.attention.name = "eva"
    c.mesh.sequence = 2
    with pytest.raises(ConfigError, match="model.remat=True with mesh.sequence=2 needs mesh.sequence_mode='xla'"):
        config_lib.validate(c)
    c.mesh.sequence_mode = "xla"
    config_lib.validate(c)


def test_unknown_attention_option_lists_allowed_keys():
    c = config_lib.base_config()
    c.model.attention.dense.flash = True
    with pytest.raises(ConfigError, match="allowed keys"):
        config_lib.validate(c)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="train first"):
        Runner.from_workdir(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="train first"):
        Runner.from_workdir(tmp_path / "empty")


def test_cli_prints_one_line(tmp_path):
    cmds = [
        [sys.executable, "-c", "import sys; from longctx.cli import eval_main; sys.exit(eval_main())", "--workdir",
         str(tmp_path / "none")],
        [sys.executable, "-c", "from longctx.cli import train_main; train_main()", "--config=configs/default.py",
         "--config.train.window=100", f"--workdir={tmp_path / 'w'}"],
    ]
    for cmd in cmds:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
        assert "Traceback" not in r.stderr


def test_adaptive_output_rules():
    c = config_lib.base_config()
    c.model.output = "adaptive"
    with pytest.raises(ConfigError, match="tie_embeddings=False"):
        config_lib.validate(c)
    c.model.tie_embeddings = False
    c.model.vocab_size = 100
    c.model.adaptive_cutoffs = (50, 20)
    with pytest.raises(ConfigError, match="strictly increasing"):
        config_lib.validate(c)


def test_saved_config_round_trips_through_json():
    """A resolved config, saved as JSON and read back over the base, validates to the same config
    (tuples come back as lists, so compare the JSON)."""
    import json

    base = config_lib.base_config()
    base.model.adaptive_cutoffs = (10, 20)  # a tuple that the JSON round trip turns into a list
    cfg = config_lib.validate(base)
    again = config_lib.validate(config_lib.merge_over_base(json.loads(cfg.to_json())))
    assert json.loads(again.to_json()) == json.loads(cfg.to_json())
    assert list(again.model.adaptive_cutoffs) == [10, 20]


@pytest.mark.parametrize("text", ["", "()", "''"])
def test_an_empty_pattern_on_the_command_line_is_no_pattern(text):
    """``--config.model.attention.pattern=`` (or ``()``) clears a config's pattern: every layer runs
    ``model.attention.name``, not a method named ''."""
    _, cfg = parse(["longctx-train", "--config=configs/builtin/hybrid_eva.py", "--workdir=/tmp/unused",
                    f"--config.model.attention.pattern={text}"], "longctx-train", config="file")
    c = config_lib.validate(cfg)
    assert tuple(c.model.attention.pattern) == () and c.model.attention.name == "eva"
