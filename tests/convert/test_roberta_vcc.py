"""VCC's recipe on an imported RoBERTa (configs/pretrained/roberta_to_vcc.py; docs/pretrained.md, "Adapt"): the
masked-LM task takes the tokenizer's own ``<mask>`` (:func:`longctx.config.resolve_vocab`), VCC's encoder stack
takes RoBERTa's post-norm blocks (its layer-level checks: tests/attention/test_vcc.py), and the committed
``roberta_tiny`` fixture, its positions extended 4x, imports, trains a few masked-LM steps with VCC and evaluates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from longctx import config as config_lib
from longctx.convert import core
from longctx.convert.errors import ConvertError
from longctx.data import masking
from longctx.data.tokenizers import ByteTokenizer
from longctx.errors import ConfigError
from tests.convert import hf_tokenizers

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "roberta_tiny"
RECIPE = str(ROOT / "configs" / "pretrained" / "roberta_to_vcc.py")
V = json.loads((FIXTURE / "config.json").read_text())["vocab_size"]
WORDS = [f"w{i}" for i in range(V - 5)]


def write_tokenizer(path: Path, mask_at: int | None = V - 1) -> Path:
    """A word-level tokenizer.json of the fixture's V ids: RoBERTa's specials, V - 5 words, ``<mask>`` at
    ``mask_at`` (RoBERTa: the last id; None: none)."""
    return hf_tokenizers.write_tokenizer(path, V, mask_at=mask_at)


def encoder(vocab_size: int, **mlm):
    c = config_lib.base_config()
    c.model.kind = "encoder"
    c.model.vocab_size = vocab_size
    c.mlm.update(mlm)
    return config_lib.validate(c)


def test_the_mlm_task_takes_the_tokenizers_own_mask_token():
    # an imported encoder: its vocabulary is the tokenizer's, <mask> its last id
    r = config_lib.resolve_vocab(encoder(V), V, mask_token=V - 1)
    assert (r.mlm.mask_id, r.model.vocab_size) == (V - 1, V)
    # room beyond the vocabulary (from scratch, or a larger table): one id beyond, as without a mask token
    for vocab in (0, V + 1):
        r = config_lib.resolve_vocab(encoder(vocab), V, mask_token=V - 1)
        assert (r.mlm.mask_id, r.model.vocab_size) == (V, V + 1)
    # no mask token of its own and no room: refused in one line
    with pytest.raises(ConfigError, match=f"mlm.mask_id={V} must be at least") as e:
        config_lib.resolve_vocab(encoder(V), V)
    assert "\n" not in str(e.value)
    # BERT: [MASK] not the last id (random replacements come from the whole vocabulary less the special ids)
    for random_prob in (0.1, 0.0):
        r = config_lib.resolve_vocab(encoder(V, random_prob=random_prob), V, mask_token=10)
        assert (r.mlm.mask_id, r.model.vocab_size) == (10, V)
    # named explicitly
    assert config_lib.resolve_vocab(encoder(0, mask_id=V - 1), V, mask_token=V - 1).model.vocab_size == V


def test_own_mask_id_reads_the_tokenizer_json(tmp_path):
    from longctx.data.hf import HFTokenizer

    assert masking.own_mask_id(HFTokenizer(str(write_tokenizer(tmp_path / "a.json")))) == V - 1
    assert masking.own_mask_id(HFTokenizer(str(write_tokenizer(tmp_path / "b.json", mask_at=7)))) == 7
    assert masking.own_mask_id(ByteTokenizer()) is None


@pytest.mark.parametrize("variant", ["", ":tiny"])
def test_the_recipe_imports_the_fixture(variant, tmp_path):
    """VCC in every post-norm layer of the imported RoBERTa, its positions extended 4x (a dry run: the config
    validates, every tensor is checked), given a tokenizer.json of the fixture's ids."""
    notes = []
    hf = hf_tokenizers.with_tokenizer("roberta_tiny", tmp_path / "roberta")
    core.import_hf(hf, "unused", config=RECIPE + variant, extend=4, dry_run=True, log=notes.append)
    assert any("learned positions 32 -> 128" in n for n in notes), notes


def test_the_import_refuses_a_tokenizer_that_does_not_fit(tmp_path, capsys):
    """The fixture as committed (no tokenizer.json): the run would keep the bytes tokenizer, whose 256 ids do not
    fit the 96-id model; an encoder's tokenizer without a mask token and no id beyond it has no mask id. Refused
    in one line by the import (dry run or not), nothing written, instead of by longctx-train later."""
    from longctx.convert.cli import main as convert

    run = tmp_path / "run"
    args = ["longctx-convert", "import", f"--hf_dir={FIXTURE}", f"--workdir={run}", "--extend_positions=4",
            f"--config={RECIPE}:tiny", "--config.data.path=/tmp/corpus"]
    for extra in ([], ["--dry_run"]):
        with pytest.raises(SystemExit) as e:
            convert(args + extra)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        assert f"data.tokenizer='bytes' (the folder has no tokenizer.json), has 256 ids; the model's vocabulary " \
               f"(config.json's vocab_size) has {V}" in err, err
        assert not run.exists()
    hf = tmp_path / "no_mask"
    shutil.copytree(FIXTURE, hf)
    write_tokenizer(hf / "tokenizer.json", mask_at=None)
    with pytest.raises(ConvertError, match=f"its tokenizer.json \\({V} ids\\), does not fit the model: "
                                                f"mlm.mask_id={V} must be at least") as e:
        core.import_hf(hf, run, config=RECIPE + ":tiny", extend=4, log=lambda *_: None)
    assert "\n" not in str(e.value) and not run.exists()


def test_the_import_fits_the_run_to_its_length_once(tmp_path, capsys):
    """--extend_positions validates the source's config beside the run's: the note on the fitted train section is
    said once."""
    hf = hf_tokenizers.with_tokenizer("roberta_tiny", tmp_path / "roberta")
    core.import_hf(hf, tmp_path / "run", config=RECIPE + ":tiny", extend=4, optimizer_state=False)
    said = capsys.readouterr().out
    assert said.count("note: fitted to the run's length") == 1, said
    assert "imported" in said


def _corpus(folder: Path) -> Path:
    """Documents of runs of consecutive words (something a tiny model learns in a few steps)."""
    rng = np.random.default_rng(0)
    folder.mkdir()
    for d in range(40):
        text = " ".join(" ".join(WORDS[(s + j) % 20] for j in range(8)) for s in rng.integers(0, 20, 60))
        (folder / f"doc{d:02d}.txt").write_text(text + "\n")
    return folder


@pytest.mark.slow  # an import, a compiled train step and an evaluation: about a minute on 2 CPU cores
def test_roberta_tiny_trains_and_evaluates_under_vccs_recipe(tmp_path):
    from longctx.cli import eval_main, train_main
    from longctx.convert.cli import main as convert

    hf = tmp_path / "roberta"
    shutil.copytree(FIXTURE, hf)
    write_tokenizer(hf / "tokenizer.json")
    run = tmp_path / "run"
    steps = 12
    assert convert(["longctx-convert", "import", f"--hf_dir={hf}", f"--workdir={run}", "--extend_positions=4",
                    f"--config={RECIPE}:tiny", f"--config.data.path={_corpus(tmp_path / 'corpus')}",
                    "--config.model.dtype=float32", f"--config.train.steps={steps}", "--config.train.log_every=1",
                    f"--config.train.eval_every={steps}", f"--config.train.ckpt_every={steps}",
                    "--config.train.min_lr_ratio=1.0", "--config.eval.max_tokens=1024"]) == 0
    assert train_main(["longctx-train", f"--config={run}/config.py", f"--workdir={run}"]) == 0
    cfg = json.loads((run / "config.json").read_text())
    assert (cfg["model"]["attention"]["name"], cfg["model"]["post_norm"], cfg["model"]["max_len"]) == ("vcc", True, 128)
    assert (cfg["mlm"]["mask_id"], cfg["model"]["vocab_size"]) == (V - 1, V)  # the tokenizer's own <mask>
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train"]
    losses = np.array([r["loss"] for r in train])
    assert len(losses) == steps and np.all(np.isfinite(losses)), losses
    assert losses[-3:].mean() < losses[:3].mean() - 0.1, losses
    assert all(r["stack/vip_overflow"] == 0 for r in train)  # every masked token had a VIP slot
    assert eval_main(["longctx-eval", f"--workdir={run}", "--split=test"]) == 0
    (result,) = (run / "eval").glob("test_*.json")
    scored = json.loads(result.read_text())
    assert scored["tokens_scored"] > 0 and np.isfinite(scored["bits_per_token"])
