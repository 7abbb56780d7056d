"""BERT and RoBERTa masked-LM encoders in and out, proven by logits: the committed tiny random models
(scripts/make_hf_fixtures.py: bert_tiny with two token types, exact GELU and its own decoder; roberta_tiny with
positions from pad_token_id + 1 and a tied decoder) give transformers' logits through longctx's encoder in
float32; export then import is bit-identical; transformers computes the same logits from the export (where it is
installed); bad folders give one-line errors. No torch here."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from longctx import config as config_lib
from longctx.convert import core
from longctx.convert.cli import main
from longctx.convert.safetensors import Folder, Reader
from tests.convert import hf_tokenizers
from tests.convert.test_llama_export import import_then_export, transformers_rel_err
from tests.convert.test_llama_import import _copy_fixture, _error, rel_err

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "hf"
ENCODERS = ["bert_tiny", "roberta_tiny"]

forward = nnx.jit(lambda model, ids: model(ids)[0])


def imported(folder: Path):
    fam, cfg = core.hf_model_config(core.read_hf_config(folder))
    cfg = config_lib.validate(cfg)
    graphdef, params, nongrad, rest = core.load_params(fam, cfg, Folder(folder))
    return cfg, nnx.merge(graphdef, params, nongrad, rest), nnx.to_pure_dict(params)


@pytest.mark.parametrize("name", ENCODERS)
def test_logits_match_transformers(name):
    ref = np.load(FIXTURES / name / "reference.npz")
    cfg, model, _ = imported(FIXTURES / name)
    assert jnp.dtype(model.policy.compute) == jnp.float32
    assert rel_err(forward(model, jnp.asarray(ref["ids"])), ref["logits"]) <= 1e-4


def test_the_fixtures_exercise_the_options():
    cfg, model, _ = imported(FIXTURES / "bert_tiny")
    m = cfg.model
    assert (m.kind, m.causal, m.post_norm, m.mlp, m.type_vocab_size, m.position_offset, m.tie_embeddings,
            m.head_transform, m.head_bias, m.max_len) == ("encoder", False, True, "gelu_exact", 2, 0, False, True,
                                                          True, 40)
    assert model.head is not None and model.embed_norm is not None
    cfg, _, _ = imported(FIXTURES / "roberta_tiny")
    m = cfg.model
    # 34 rows, positions from row pad_token_id + 1 = 2: 32 usable positions
    assert (m.position_offset, m.max_len, m.type_vocab_size, m.tie_embeddings) == (2, 32, 1, True)


def test_each_option_matters():
    """Dropping the offset, the token type, the head's transform or its bias moves the logits far from
    transformers': the options are each load-bearing in the comparison above."""
    ref = np.load(FIXTURES / "roberta_tiny" / "reference.npz")
    ids = jnp.asarray(ref["ids"])
    _, model, _ = imported(FIXTURES / "roberta_tiny")
    model.position_offset = 0
    assert rel_err(forward(model, ids), ref["logits"]) > 1e-2
    _, model, _ = imported(FIXTURES / "roberta_tiny")
    model.type_embed.embedding[...] = jnp.zeros_like(model.type_embed.embedding[...])
    assert rel_err(forward(model, ids), ref["logits"]) > 1e-2
    _, model, _ = imported(FIXTURES / "roberta_tiny")
    model.head_bias[...] = jnp.zeros_like(model.head_bias[...])
    assert rel_err(forward(model, ids), ref["logits"]) > 1e-2


def test_import_writes_an_encoder_run_that_restores(tmp_path, capsys):
    from longctx.runtime import Runner

    out = tmp_path / "run"
    src = hf_tokenizers.with_tokenizer("roberta_tiny", tmp_path / "src")  # the fixture has no tokenizer.json
    assert main(["longctx-convert", "import", f"--hf_dir={src}", f"--workdir={out}", "--nooptimizer_state"]) == 0
    said = capsys.readouterr().out  # one line each: the positions' offset, the shorter rows
    assert "positions start at pad_token_id + 1 = 2" in said
    assert "train.seq_len 256 -> 32" in said
    runner = Runner.from_workdir(out)
    assert runner.cfg.model.kind == "encoder" and runner.cfg.train.seq_len <= 32
    ref = np.load(FIXTURES / "roberta_tiny" / "reference.npz")
    assert rel_err(forward(runner.model(), jnp.asarray(ref["ids"])), ref["logits"]) <= 1e-4


@pytest.fixture(scope="module", params=ENCODERS)
def exported(request, tmp_path_factory):
    return request.param, import_then_export(request.param, tmp_path_factory.mktemp(request.param))


def test_export_then_import_is_bit_identical(exported):
    name, out = exported
    src, back = Reader(FIXTURES / name / "model.safetensors"), Reader(out / "model.safetensors")
    assert sorted(back.names()) == sorted(src.names())
    for n in src.names():
        assert back.dtype(n) == src.dtype(n) and np.array_equal(back.get(n), src.get(n)), n
    a, b = imported(FIXTURES / name)[2], imported(out)[2]
    for (pa, xa), (pb, xb) in zip(*(sorted(nnx.traversals.flatten_mapping(t).items()) for t in (a, b))):
        assert pa == pb and np.array_equal(np.asarray(xa), np.asarray(xb)), pa
    cfg, src_cfg = (json.loads((f / "config.json").read_text()) for f in (out, FIXTURES / name))
    # not the model's: the initialisation's scale, the training dropout (the import sets model.dropout=0)
    shared = {k for k in set(cfg) & set(src_cfg) if not k.endswith("dropout_prob")} - {"initializer_range"}
    assert {"model_type", "architectures", "max_position_embeddings", "type_vocab_size", "pad_token_id",
            "hidden_act", "layer_norm_eps", "tie_word_embeddings"} <= shared
    assert {k: cfg[k] for k in shared} == {k: src_cfg[k] for k in shared}


def test_transformers_loads_the_export(exported):
    """transformers loads the exported folder and computes the fixture's logits (where it is installed)."""
    name, out = exported
    assert transformers_rel_err(out, name, "AutoModelForMaskedLM") <= 1e-5


def test_original_names_and_pretraining_extras_read(tmp_path):
    """A pre-training checkpoint (pooler, next-sentence head, the position_ids buffer, LayerNorm gamma/beta of the
    TensorFlow conversions) imports to the same logits."""
    def original(t):
        t = {n.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): a
             for n, a in t.items()}
        t["bert.pooler.dense.weight"], t["bert.pooler.dense.bias"] = np.zeros((16, 16), np.float32), np.zeros(16)
        t["cls.seq_relationship.weight"] = np.zeros((2, 16), np.float32)
        t["bert.embeddings.position_ids"] = np.arange(40, dtype=np.int64)[None]
        return t

    folder = _copy_fixture(tmp_path, original, name="bert_tiny")
    ref = np.load(FIXTURES / "bert_tiny" / "reference.npz")
    _, model, _ = imported(folder)
    assert rel_err(forward(model, jnp.asarray(ref["ids"])), ref["logits"]) <= 1e-4


def test_one_line_errors(tmp_path, capsys):
    out = f"--workdir={tmp_path / 'out'}"

    def drop(t):
        del t["roberta.encoder.layer.1.output.LayerNorm.bias"]
        return t

    err = _error(capsys, "import", f"--hf_dir={_copy_fixture(tmp_path / 'a', drop, name='roberta_tiny')}", out)
    assert "roberta.encoder.layer.1.output.LayerNorm.bias is missing" in err

    def reshape(t):
        t["bert.embeddings.token_type_embeddings.weight"] = np.zeros((3, 16), np.float32)
        return t

    err = _error(capsys, "import", f"--hf_dir={_copy_fixture(tmp_path / 'b', reshape, name='bert_tiny')}", out)
    assert "token_type_embeddings.weight has shape [3, 16]" in err and "implies [2, 16]" in err

    def no_head(t):  # a bare BertModel: no prefix, no masked-LM head
        return {n.removeprefix("bert."): a for n, a in t.items() if not n.startswith("cls.")}

    err = _error(capsys, "import", f"--hf_dir={_copy_fixture(tmp_path / 'c', no_head, name='bert_tiny')}", out)
    assert "cls.predictions.transform.dense.weight is missing" in err

    def differ(t):
        t["cls.predictions.decoder.bias"] = t["cls.predictions.bias"] + 1
        return t

    err = _error(capsys, "import", f"--hf_dir={_copy_fixture(tmp_path / 'd', differ, name='bert_tiny')}", out)
    assert "cls.predictions.bias and cls.predictions.decoder.bias differ" in err

    for key, value, match in (("position_embedding_type", "relative_key", "position_embedding_type='relative_key'"),
                              ("hidden_act", "relu", "hidden_act='relu' is not supported"),
                              ("is_decoder", True, "is_decoder")):
        folder = _copy_fixture(tmp_path / key, config_edit=lambda hf, k=key, v=value: hf.update({k: v}),
                               name="bert_tiny")
        assert match in _error(capsys, "import", f"--hf_dir={folder}", out)
    assert not (tmp_path / "out").exists()


def test_a_decoder_with_encoder_options_exports_as_no_decoder_family():
    """A Llama-shaped decoder with post-norm blocks is no Llama: the export names the option."""
    from longctx.convert import families

    fam, cfg = core.hf_model_config(core.read_hf_config(FIXTURES / "llama_tiny"))
    assert families.family_of_model(cfg.model) is families.Llama
    cfg.model.post_norm = True
    with pytest.raises(families.ConvertError, match="model.post_norm=True") as e:
        families.family_of_model(cfg.model)
    assert "\n" not in str(e.value)
